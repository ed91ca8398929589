"""One chaos run: a throwaway PostgreSQL (a primary with a streaming standby when failover is
on offer), N replicas as real ``scheduler-daemon run`` processes, each in its own network
namespace when this machine allows it, the workload, the nemesis, and at the end the
history (``history.jsonl``), the checker's verdict and the report, all in one directory.

Every replica process is an *incarnation* with its own instance id (``r2.3``: replica 2,
third start), so a restarted replica is never mistaken for its previous self by the
checker. A replica started with its clock skewed (libfaketime) writes skewed wall-clock
times into its logs and external records; the history puts them back on the real clock
by the known offset of that incarnation.
"""

from __future__ import annotations

import contextlib
import json
import random
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rig.effects import read_effects
from rig.processes import CLI, DaemonProcess, Daemons, daemon_env
from rig.sql import execute, fetch
from rig.ticks import FAST_TIMINGS, instance_of

from chaos.environment import ChaosDatabase, ChaosNetwork, faketime_env
from chaos.history import History
from chaos.nemesis import ALL_KINDS, REPLICA_FAULTS, FaultKind, Intent, plan
from chaos.workload import KEY_PREFIX, TASK_PERIODS, WORKLOAD_DDL, Feeder, FeedLog, replica_env

# Leadership log events, and what they mean for the timeline.
LEADER_EVENTS = {
    "leader.acquired": "acquired",
    "leader.released": "released",
    "leader.lost": "lost",
    "leader.stepped_down": "lost",
}

# After the last fault: long enough for a cut-off leader's lock to be freed and every
# publication due by the end to be published (the checker's grace is shorter than this).
DRAIN_SECONDS = 8.0


@dataclass(frozen=True, slots=True)
class ChaosConfig:
    seed: int
    duration: float
    replicas: int
    directory: Path
    kinds: tuple[FaultKind, ...] = ALL_KINDS
    guaranteed: tuple[FaultKind, ...] = ()
    mean_gap: float = 3.0
    lateness_bound: float = 2.0  # seconds, outside fault windows
    recovery_allowance: float = 6.0  # seconds after a fault that still count as its window


@dataclass
class Incarnation:
    instance: str
    process: DaemonProcess
    skew_seconds: float
    started: float
    ended: float | None = None


@dataclass
class Replica:
    name: str
    index: int  # its network namespace's number
    incarnations: list[Incarnation] = field(default_factory=list)

    @property
    def current(self) -> Incarnation | None:
        if self.incarnations and self.incarnations[-1].ended is None:
            return self.incarnations[-1]
        return None


class ChaosRun:
    """Use as a context manager: everything it started is stopped and removed on exit."""

    def __init__(self, config: ChaosConfig) -> None:
        self.config = config
        self.directory = config.directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.effects_log = self.directory / "effects.jsonl"
        self.records: list[dict[str, Any]] = []
        self.stopping: float | None = None
        self._stack = contextlib.ExitStack()
        self._records_lock = threading.Lock()
        self.replicas = [Replica(f"r{n + 1}", n) for n in range(config.replicas)]
        failover = {"failover_sync", "failover_async"} & set(config.kinds)
        self.network = ChaosNetwork.create(self.directory, config.replicas)
        self.db = ChaosDatabase(with_standby=bool(failover), network=self.network)
        self.daemons = Daemons(self.directory / "daemons")
        self.intents = plan(
            config.seed,
            config.duration,
            self._available(config.kinds),
            mean_gap=config.mean_gap,
            guaranteed=config.guaranteed,
        )

    def _available(self, kinds: Sequence[FaultKind]) -> list[FaultKind]:
        """Partitions and bad links need network namespaces; without them (not root) the
        run says so in its meta record instead of pretending."""
        if self.network.enabled:
            return list(kinds)
        return [kind for kind in kinds if kind not in ("partition", "netem")]

    def __enter__(self) -> ChaosRun:
        self._stack.enter_context(self.network)
        self._stack.enter_context(self.db)
        self._stack.callback(self.daemons.close)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    # -- the run ---------------------------------------------------------------------

    def run(self) -> Path:
        """Run the workload under the nemesis; write and return ``history.jsonl``."""
        execute(self.db.admin_dsn, WORKLOAD_DDL)
        started = time.time()
        for replica in self.replicas:
            self._start(replica)
        feeder = Feeder(self.db.client_dsn, random.Random(self.config.seed + 1))
        feeder.start()
        try:
            self._nemesis(started)
            self._heal_all()
            feeder.stop()
            time.sleep(DRAIN_SECONDS)
        finally:
            feeder.stop()
            self.stopping = time.time()
            stopped = self._stop_all()
            feeder.close()
        if feeder.failure is not None:
            raise AssertionError(
                f"the feeder died, so the history is not whole: {feeder.failure!r}"
            )
        locks = self.db.advisory_locks()
        return self._write_history(started, stopped, feeder, locks)

    def _start(self, replica: Replica, skew_seconds: float = 0.0) -> Incarnation:
        instance = f"{replica.name}.{len(replica.incarnations) + 1}"
        env = {
            **FAST_TIMINGS,
            **replica_env(self.db.replica_dsn(replica.index), instance, self.effects_log),
            **(faketime_env(skew_seconds) if skew_seconds else {}),
        }
        argv = self.network.argv(replica.index, [*CLI, "run"])
        process = self.daemons.spawn(argv, daemon_env(env), name=instance)
        incarnation = Incarnation(instance, process, skew_seconds, time.time())
        replica.incarnations.append(incarnation)
        return incarnation

    def _end(self, replica: Replica, sig: int | None, wait: float = 20.0) -> None:
        """Send `sig` (None: it was sent already) and wait for the exit; SIGKILL if it
        does not come within `wait`. A second SIGTERM would force the exit (130), so
        it is sent once."""
        current = replica.current
        if current is None:
            return
        if sig is not None:
            current.process.signal(signal.SIGCONT)
            current.process.signal(sig)
        try:
            current.process.popen.wait(wait)
        except subprocess.TimeoutExpired:
            current.process.kill()
        current.ended = time.time()

    def _stop_all(self) -> float:
        """SIGTERM to every replica at once (as `docker compose stop` does), then wait."""
        for replica in self.replicas:
            if replica.current is not None:
                replica.current.process.signal(signal.SIGCONT)
                replica.current.process.signal(signal.SIGTERM)
        for replica in self.replicas:
            self._end(replica, None)
        return time.time()

    def _heal_all(self) -> None:
        for replica in self.replicas:
            self.network.heal(replica.index)
            self.network.clear(replica.index)
            current = replica.current
            if current is not None:
                current.process.signal(signal.SIGCONT)
            else:
                self._start(replica)

    # -- the nemesis -----------------------------------------------------------------

    def _nemesis(self, started: float) -> None:
        for intent in self.intents:
            delay = started + intent.at - time.time()
            if delay > 0:
                time.sleep(delay)
            self._inject(intent)
        remaining = started + self.config.duration - time.time()
        if remaining > 0:
            time.sleep(remaining)

    def _target(self, intent: Intent) -> Replica:
        if intent.target.startswith("leader:"):
            instance = self.db.leader_of(intent.target.removeprefix("leader:"))
            for replica in self.replicas:
                if replica.current is not None and replica.current.instance == instance:
                    return replica
        alive = [r for r in self.replicas if r.current is not None] or self.replicas
        return alive[int(intent.pick * len(alive))]

    def _inject(self, intent: Intent) -> None:
        kind = intent.kind
        replica = self._target(intent) if kind in REPLICA_FAULTS else None
        target = replica.name if replica is not None else "postgres"
        start = time.time()
        detail: dict[str, Any] = {}
        if replica is not None and kind in ("sigkill", "sigterm"):
            self._end(replica, signal.SIGKILL if kind == "sigkill" else signal.SIGTERM)
            time.sleep(intent.duration)
            self._start(replica)
        elif replica is not None and kind == "sigstop":
            current = replica.current
            if current is not None:
                current.process.signal(signal.SIGSTOP)
                time.sleep(intent.duration)
                current.process.signal(signal.SIGCONT)
        elif replica is not None and kind == "partition":
            self.network.partition(replica.index)
            time.sleep(intent.duration)
            self.network.heal(replica.index)
        elif replica is not None and kind == "netem":
            rng = random.Random(intent.pick)
            detail = {"delay_ms": rng.randint(50, 300), "loss_pct": rng.choice([0, 2, 5, 10])}
            self.network.impair(replica.index, jitter_ms=detail["delay_ms"] // 4, **detail)
            time.sleep(intent.duration)
            self.network.clear(replica.index)
        elif replica is not None and kind == "clock_skew":
            self._end(replica, signal.SIGTERM)
            # Whole seconds: what libfaketime is given is what the history subtracts.
            detail = {"skew_seconds": round(intent.skew_minutes * 60)}
            self._start(replica, skew_seconds=detail["skew_seconds"])
        elif kind in ("pg_restart_fast", "pg_restart_immediate"):
            self.db.restart("fast" if kind == "pg_restart_fast" else "immediate")
        elif kind in ("failover_sync", "failover_async"):
            detail = self.db.failover(synchronous=kind == "failover_sync")
        self._record("fault", kind=kind, target=target, start=start, end=time.time(), **detail)

    # -- the history -----------------------------------------------------------------

    def _record(self, type_: str, **fields: Any) -> None:
        with self._records_lock:
            self.records.append({"type": type_, **fields})

    def _skews(self) -> dict[str, float]:
        return {inc.instance: inc.skew_seconds for r in self.replicas for inc in r.incarnations}

    def _write_history(
        self, started: float, stopped: float, feeder: Feeder, locks: list[dict[str, Any]]
    ) -> Path:
        skews = self._skews()
        feed = feeder.snapshot()
        records: list[dict[str, Any]] = [
            {
                "type": "meta",
                "seed": self.config.seed,
                "duration": self.config.duration,
                "replicas": self.config.replicas,
                "start": started,
                "end": stopped,
                "stopping": self.stopping,
                "kinds": list(self._available(self.config.kinds)),
                "network_namespaces": self.network.enabled,
                "lateness_bound": self.config.lateness_bound,
                "recovery_allowance": self.config.recovery_allowance,
                "async_window": self.db.async_window,
                "expected_slots": dict(TASK_PERIODS),
                "skews": {k: v for k, v in skews.items() if v},
                "feeder_errors": len(feed.errors),
                "uncertain_keys": feed.uncertain,
            }
        ]
        records += self.records
        records += self._publications(feed)
        records += self._database_runs()
        records += self._leader_events(skews)
        records.append({"type": "final_locks", "locks": locks})
        path = self.directory / "history.jsonl"
        with path.open("w") as out:
            for record in records:
                out.write(json.dumps(record, default=str) + "\n")
        # The records the work wrote outside any database, on the real clock.
        history = History.load(path)
        history.add_effects(read_effects(self.effects_log), skews, publication_id=_key_order)
        history.dump(path)
        return path

    def _publications(self, feed: FeedLog) -> Iterator[dict[str, Any]]:
        """Publications by the number in their key, not their database id: an asynchronous
        failover rewinds the id sequence, so a lost publication's id is given again to a
        new one. Keys are the feeder's and never repeat."""
        acknowledged = {s.key: s for s in feed.scheduled}
        rows = fetch(
            self.db.admin_dsn,
            "SELECT id, key, publish_at, created_at, status "
            "FROM scheduler_publications WHERE key LIKE $1 ORDER BY id",
            KEY_PREFIX + "%",
        )
        in_db = {row["key"]: row for row in rows}
        for key in sorted(set(acknowledged) | set(in_db), key=_key_order):
            row, ack = in_db.get(key), acknowledged.get(key)
            yield {
                "type": "publication",
                "id": _key_order(key),
                "key": key,
                "via": ack.via if ack else ("sql" if _key_order(key) % 2 else "api"),
                "publish_at": row["publish_at"].timestamp() if row else ack.publish_at,
                "created": row["created_at"].timestamp() if row else ack.created,
                "acknowledged": ack is not None,
                "in_database": row is not None,
                "status": row["status"] if row else None,
                "database_id": row["id"] if row else ack.id if ack else None,
            }
        for row in fetch(self.db.admin_dsn, "SELECT key, instance, token, at FROM chaos_audit"):
            yield {
                "type": "publish_effect",
                "id": _key_order(row["key"]),
                "source": "audit",
                "instance": instance_of(row["instance"]),
                "token": row["token"],
                "at": row["at"].timestamp(),
            }
        for key, at in feed.notified:
            yield {"type": "publish_effect", "id": _key_order(key), "source": "notify",
                   "instance": None, "token": None, "at": at}  # fmt: skip
        for start, end in feed.listen_gaps:
            yield {"type": "observer_gap", "source": "notify", "start": start, "end": end}

    def _database_runs(self) -> Iterator[dict[str, Any]]:
        """The runs as the database saw them (the external records are added from the
        effects log by `History.add_effects`)."""
        for row in fetch(
            self.db.admin_dsn,
            "SELECT instance, token, slot, started, ended FROM chaos_sql_runs "
            "WHERE ended IS NOT NULL",
        ):
            slot = row["slot"].isoformat() if row["slot"] else None
            yield {"type": "run", "loop": "plugin", "task": "sql_probe", "slot": slot,
                   "kind": "sql", "source": "db", "instance": instance_of(row["instance"]),
                   "token": row["token"], "start": row["started"].timestamp(),
                   "end": row["ended"].timestamp(), "outcome": "end"}  # fmt: skip
        for row in fetch(
            self.db.admin_dsn,
            "SELECT name, slot, instance, started_at, finished_at, status "
            "FROM scheduler_plugin_runs WHERE name = ANY($1::text[])",
            # The SQL task's own rows (above) are its database record, with the real span
            # of its work and its token: the daemon's bookkeeping row would be a second
            # record of the same run.
            [task for task in TASK_PERIODS if task != "sql_probe"],
        ):
            yield {
                "type": "run",
                "loop": "plugin",
                "task": row["name"],
                "slot": row["slot"].isoformat(),
                "kind": "record",  # the daemon's own record of the run, not work
                "source": "db",
                "instance": row["instance"],
                "token": None,
                "start": row["started_at"].timestamp(),
                "end": (row["finished_at"] or row["started_at"]).timestamp(),
                "outcome": row["status"],
            }

    def _leader_events(self, skews: dict[str, float]) -> Iterator[dict[str, Any]]:
        for replica in self.replicas:
            for incarnation in replica.incarnations:
                skew = incarnation.skew_seconds
                for entry in incarnation.process.log_events():
                    event = LEADER_EVENTS.get(str(entry.get("event")))
                    if event is None or "loop" not in entry or "timestamp" not in entry:
                        continue
                    at = datetime.fromisoformat(entry["timestamp"]).replace(tzinfo=UTC)
                    yield {"type": "leader", "loop": entry["loop"],
                           "instance": incarnation.instance, "event": event,
                           "token": entry.get("fencing_token"),
                           "at": at.timestamp() - skew}  # fmt: skip
                if incarnation.ended is None:
                    continue
                code = incarnation.process.poll()
                yield {"type": "exit", "instance": incarnation.instance, "code": code,
                       "at": incarnation.ended}  # fmt: skip


def _key_order(key: str) -> int:
    return int(key.removeprefix(KEY_PREFIX))
