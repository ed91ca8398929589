"""Prometheus metrics. One :class:`Metrics` per daemon, on its own registry (no globals),
passed to the components that count things. Names are documented in docs/operations.md
and queried by deploy/grafana/scheduler-daemon.json; a test keeps the three in step.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from . import __version__

# Publication lateness: from milliseconds (the goal) up to minutes (an outage).
LATENESS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.build_info = Info("scheduler_build", "Version of the running daemon.", registry=r)
        self.build_info.info({"version": __version__})
        self.database_up = Gauge(
            "scheduler_database_up", "1 when the database answered the last probe.", registry=r
        )
        self.leader = Gauge(
            "scheduler_leader", "1 while this replica leads the loop.", ["loop"], registry=r
        )
        self.leadership_changes = Counter(
            "scheduler_leadership_changes_total",
            "Times this replica became or stopped being leader, by event.",
            ["loop", "event"],
            registry=r,
        )
        self.lock_waits = Counter(
            "scheduler_lock_waits_total",
            "Times this replica started waiting for a loop's lock.",
            ["loop"],
            registry=r,
        )
        self.ticks = Counter(
            "scheduler_ticks_total", "Ticks run, by result.", ["loop", "result"], registry=r
        )
        self.tick_duration = Histogram(
            "scheduler_tick_duration_seconds", "Duration of ticks.", ["loop"], registry=r
        )
        self.heartbeat_failures = Counter(
            "scheduler_heartbeat_failures_total",
            "Leader heartbeats that failed or came late.",
            ["loop"],
            registry=r,
        )
        self.evictions = Counter(
            "scheduler_evictions_total",
            "Leaderships this replica took over from a leader that was still connected but had "
            "lost its lock session (the server ended it after stall_timeout of silence).",
            ["loop"],
            registry=r,
        )
        self._shard_metrics(r)
        self._work_metrics(r)
        self._table_metrics(r)

    def _shard_metrics(self, r: CollectorRegistry) -> None:
        self.shards = Gauge(
            "scheduler_shards",
            "The loop's shard count (plugin.shards; 1: one leader leads every schedule).",
            ["loop"],
            registry=r,
        )
        self.shards_owned = Gauge(
            "scheduler_shards_owned",
            "Shards of the loop this replica leads (sharded leadership; 0 unsharded).",
            ["loop"],
            registry=r,
        )
        self.shard_members = Gauge(
            "scheduler_shard_members",
            "Replicas sharing the loop's shards, as this replica last saw the lock manager.",
            ["loop"],
            registry=r,
        )
        self.shard_changes = Counter(
            "scheduler_shard_changes_total",
            "Shards this replica took or gave up, by event (acquired, released, lost) and "
            "reason (join, rebalance, member_gone, stopping, ...).",
            ["loop", "event", "reason"],
            registry=r,
        )

    def _work_metrics(self, r: CollectorRegistry) -> None:
        self.publications_published = Counter(
            "scheduler_publications_published_total", "Publications published.", registry=r
        )
        self.publications_failed = Counter(
            "scheduler_publications_failed_total", "Publications marked failed.", registry=r
        )
        self.publication_lateness = Histogram(
            "scheduler_publication_lateness_seconds",
            "published_at - publish_at, by the database's clock.",
            buckets=LATENESS_BUCKETS,
            registry=r,
        )
        self.plugin_runs = Counter(
            "scheduler_plugin_runs_total",
            "Plugin task runs, by task (a runtime schedule: its target) and result.",
            ["task", "result"],
            registry=r,
        )
        self.plugin_lag = Gauge(
            "scheduler_plugin_lag_seconds",
            "Age of the oldest due plugin slot at the leader's last tick (0: nothing was "
            "waiting): how far behind the plugin loop is.",
            registry=r,
        )
        self.plugin_misfires = Counter(
            "scheduler_plugin_misfires_total",
            "Plugin schedules found a whole period or more late (the misfire policy chose "
            "what ran).",
            registry=r,
        )
        self.plugin_run_duration = Histogram(
            "scheduler_plugin_run_duration_seconds",
            "Duration of plugin task runs.",
            ["task"],
            registry=r,
        )

    def _table_metrics(self, r: CollectorRegistry) -> None:
        # Facts of the database, not of this replica: every replica reports the same,
        # read when /metrics is scraped (http.py, at most every TABLES_REFRESH seconds).
        self.table_bytes = Gauge(
            "scheduler_table_bytes",
            "Size of a scheduler table with its indexes and TOAST (PostgreSQL).",
            ["table"],
            registry=r,
        )
        self.table_dead_ratio = Gauge(
            "scheduler_table_dead_ratio",
            "Dead row versions / (live + dead) in a scheduler table, by the server's "
            "statistics (PostgreSQL).",
            ["table"],
            registry=r,
        )
        self.oldest_snapshot = Gauge(
            "scheduler_oldest_snapshot_seconds",
            "How long the database's oldest snapshot (xmin) has been held: VACUUM removes "
            "no row version that died since (PostgreSQL; 0: none held).",
            registry=r,
        )

    def record_tables(
        self, tables: Mapping[str, tuple[int, float]], snapshot_seconds: float | None
    ) -> None:
        """The database's tables: ``{table: (bytes, dead_ratio)}``, and how long its oldest
        snapshot has been held (None: the backend has none, the gauge is left alone)."""
        for table, (size, dead_ratio) in tables.items():
            self.table_bytes.labels(table).set(size)
            self.table_dead_ratio.labels(table).set(dead_ratio)
        if snapshot_seconds is not None:
            self.oldest_snapshot.set(snapshot_seconds)

    def prime_loop(self, loop: str) -> None:
        """Create a loop's labelled series at zero before it runs.

        A labelled series is absent until first touched, so a standby would export no
        ``scheduler_leader`` at all and "sum by (loop) == 0" alerts would see nothing.
        """
        self.leader.labels(loop).set(0)
        self.shards_owned.labels(loop).set(0)
        self.shards.labels(loop).set(1)
        for counter in (self.lock_waits, self.heartbeat_failures, self.evictions):
            counter.labels(loop)
        for result in ("ok", "skipped", "failed", "cancelled"):
            self.ticks.labels(loop, result)
        self.tick_duration.labels(loop)
