"""Scale: issue 19's targets for the plugin loop on one leader.

One leader (`scheduler-daemon run --only plugin`, one process) on a fresh database of the
durable throwaway cluster. Schedules are **runtime rows** (schedules as data: rows of
scheduler_plugin_tasks naming a target of `plugin.runnable`), except the `sql` cases,
whose tasks can only be declared (a TOML config, `SCHEDULER_CONFIG`). The rows are
inserted before the daemon starts, an hour away (the harness first writes the targets
into scheduler_runnable_targets as the owner, as a leader's take-over does); once the
daemon leads, one UPDATE sets every slot. Targets: `growth_tasks:noop` (async, does
nothing) and `growth_tasks:half_second` (async, sleeps 0.5 s), bench/ on PYTHONPATH.

Cases (`Sizes` gives the counts and windows; --quick shrinks them):

- **spread**: N schedules every 10 s, schedule i's slots at T0 + i * 10 s / N + k * 10 s.
  For every slot of the window [T0, T0 + W): lateness = finished_at - slot (the target
  does nothing, so this is when the run took place; the daemon stamps finished_at from
  its monotonic clock, offset onto the database clock read at the tick: see the report's
  note) and claim = started_at - slot; a slot not run when the leader stops (GRACE after
  the window) counts with the wait it had by then (a lower bound). Runs/s = runs started
  in the window / W; leader CPU (utime + stime of the process tree from /proc, 100% = one
  core) and the CPU of its database backends over the window; commits/s.
- **aligned, jitter 10 s**: the same N rows with `jitter_seconds = 10`, all created at
  one instant T0: each first slot is the first point of its grid from T0, as
  `Client.add_schedule` computes it (whole periods from the epoch plus the schedule's
  offset, plugins/tasks.py), and so is every slot after it. Whether the jitter spreads
  them. (Rows inserted by plain SQL without next_run_at all run at their default, now(),
  once, and then on their grids.)
- **concurrency 4**: the spread case at the old default concurrency, for the
  before/after comparison with bench/growth.py's earlier rows.
- **burst**: N schedules due at one instant T0 (every hour, so one slot each): how long
  until all started (max started_at - T0) and finished (max finished_at - T0), lost =
  schedules without a run.
- **idle**: N schedules an hour away. Leader CPU over the window, and what it sends, from
  the server's statement log (`log_statement = 'all'` on that database): statements and
  transactions per second, ticks (transactions holding the due read), statements per
  tick.
- **pickup** (same leader, still idle, PostgreSQL session mode, LISTENing): another
  connection inserts a runtime schedule due at once (next_run_at = clock_timestamp() of
  the INSERT, just before its commit); latency = the run's started_at (the claiming
  transaction's start, database clock) - next_run_at. A conservative figure: it includes
  the insert's own commit.
- **sql**: declared `sql = "SELECT 1"` tasks, every 10 s, spread: 1,000 (lateness p99)
  and 10,000 (runs/s).
- **overload**: N schedules every 10 s of `half_second` with `plugin.concurrency` C, so
  that about C / 0.5 s runs/s fit against N / 10 s needed. Over the window: runs per
  schedule, the fraction that ran at least once, each schedule's longest gap in periods
  (from its first slot to its first run, between runs, from its last run to the window's
  end: the edges are lower bounds), and the lag each second, from /metrics
  (`scheduler_plugin_lag_seconds`, set by each tick) and from the database (age of the
  oldest due next_run_at).
- **profile**: py-spy (when installed) samples the leader during a spread case: where its
  CPU goes.

    python -m bench.scale [--quick] [--out DIR]
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg

from bench.common import (
    RESULTS,
    ROOT,
    admin_dsn,
    bench_arguments,
    drop_database,
    fresh_database,
    save_results,
    start_daemon,
)
from bench.growth import (
    Meter,
    backend_pids,
    code_version,
    count_events,
    fmt_pct,
    fmt_s,
    fresh_log,
    log_tail,
    summary,
    wait_leading,
)
from bench.peers import LOG_LINE, STATEMENT, ServerLog, find_log, tree
from scheduler_daemon.plugins.tasks import Every, with_jitter

PERIOD = 10.0  # every schedule runs every 10 s
NOOP = "growth_tasks:noop"
SLOW = "growth_tasks:half_second"
RUNNABLE = (NOOP, SLOW)
P99_TARGET = 0.1  # s: lateness p99 and pickup p99 (issue 19)
CPU_TARGET = 25.0  # % of one core, 1,000 runs/s
IDLE_CPU_TARGET = 1.0
BURST_TARGET = 1.0  # s until all started
GRACE = 2.0  # s after the window before the leader is stopped
LEAD = 2.0  # s between setting the slots and the first one
DB = "bench_scale"


@dataclass(frozen=True)
class Sizes:
    tasks: int = 10_000
    window: float = 30.0  # s of slots, spread and jittered cases
    compare_window: float = 20.0  # concurrency 4
    burst_timeout: float = 60.0
    idle_window: float = 30.0
    pickup_trials: int = 50
    sql_small: int = 1_000
    sql_large: int = 10_000
    sql_window: float = 20.0
    overload_window: float = 120.0  # 12 periods: every schedule's 10 are inside it
    # 55 places / 0.5 s = 110 runs/s of 1,000 needed: ~10% fit (a little over, so that a
    # full rotation fits in 10 periods at all; at exactly 10% any lost moment breaks it).
    overload_concurrency: int = 55
    wide_concurrency: int = 10_000  # a second burst with a place for each schedule
    profile_seconds: float = 15.0


QUICK = Sizes(
    tasks=2_000,
    window=10.0,
    compare_window=10.0,
    burst_timeout=30.0,
    idle_window=8.0,
    pickup_trials=10,
    sql_small=500,
    sql_large=2_000,
    sql_window=10.0,
    overload_window=30.0,
    overload_concurrency=11,
    wide_concurrency=2_000,
    profile_seconds=5.0,
)


def names(count: int) -> list[str]:
    return [f"s{i:05d}" for i in range(count)]


async def add_runtime_schedules(
    conn: asyncpg.Connection,
    count: int,
    target: str = NOOP,
    every: float = PERIOD,
    jitter: float = 0.0,
    runnable: Sequence[str] = RUNNABLE,
) -> None:
    """`count` runtime schedules named names(count), of `target` every `every` s, an hour
    away, with plain SQL (one statement; a million in about 15 s); first the runnable
    targets, as a leader's take-over writes them (the insert trigger checks the target)."""
    await conn.execute(
        "INSERT INTO scheduler_runnable_targets (target) SELECT unnest($1::text[])",
        list(runnable),
    )
    await conn.execute(
        "INSERT INTO scheduler_plugin_tasks "
        "(name, target, every_seconds, jitter_seconds, next_run_at) "
        "SELECT n, $2, $3, $4, now() + interval '1 hour' FROM unnest($1::text[]) n",
        names(count),
        target,
        every,
        jitter,
    )


def stop_all(daemons: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGTERM to every one at once, then wait for each (stop_daemon, one by one, would
    let the first's shards move to the others before they stop)."""
    for daemon in daemons:
        daemon.send_signal(signal.SIGTERM)  # once: a second SIGTERM forces the stop
    for daemon in daemons:
        daemon.wait(timeout=60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# --- one leader on a fresh database ----------------------------------------------------


@dataclass
class Leader:
    """A fresh database holding `count` schedules an hour away, and one leader on it.

    Or several replicas (bench/shards.py): ``instances`` names them (their instance ids;
    replica i logs to workdir/<name>/daemon.log, a lone unnamed one to workdir/daemon.log),
    ``shards`` > 1 shares the plugin loop's shards among them (then entering waits until
    every shard is held and shared out), ``pins`` runs replica i under `taskset -c
    pins[i]`, ``env`` goes to every replica."""

    admin: str
    workdir: Path
    count: int
    kind: str = "runtime"  # "runtime" (rows naming `target`) | "sql" (declared tasks)
    target: str = NOOP
    every: float = PERIOD
    jitter: float = 0.0
    concurrency: int | None = None  # None: the default
    http: bool = False
    log_statements: bool = False
    runnable: Sequence[str] = RUNNABLE
    instances: Sequence[str] = ()  # () : one replica, the daemon's default instance id
    shards: int = 1
    pins: Sequence[str] = ()
    env: dict[str, str] = field(default_factory=dict)
    # Run on the database once the schedules are in, before any replica starts
    # (bench/sustained.py prefills the runs table with it).
    prepare: Callable[[asyncpg.Connection], Awaitable[None]] | None = None
    database: str = DB
    dsn: str = ""
    conn: asyncpg.Connection | None = None
    daemons: list[subprocess.Popen[bytes]] = field(default_factory=list)
    ports: list[int] = field(default_factory=list)
    started: float = 0.0
    startup_s: float = 0.0

    async def __aenter__(self) -> Leader:
        self.dsn = await fresh_database(self.admin, self.database)
        fresh_log(self.workdir)
        conn = self.conn = await asyncpg.connect(self.dsn)
        if self.log_statements:
            await conn.execute(f"ALTER DATABASE {self.database} SET log_statement = 'all'")
        if self.kind == "runtime":
            await add_runtime_schedules(
                conn, self.count, self.target, self.every, self.jitter, self.runnable
            )
        else:
            await conn.execute(
                "INSERT INTO scheduler_plugin_tasks (name, schedule, next_run_at, source) "
                "SELECT n, $2, now() + interval '1 hour', 'config' FROM unnest($1::text[]) n",
                names(self.count),
                f"every {self.every:g}s",
            )
        if self.prepare is not None:
            await self.prepare(conn)
        await conn.execute("VACUUM ANALYZE scheduler_plugin_tasks")
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "scale.toml").write_text(self.config())
        self.started = time.monotonic()
        for index, name in enumerate(self.instances or [None]):
            self.start_replica(name, self.pins[index] if index < len(self.pins) else None)
        if self.shards > 1:
            await self.wait_shared()
        else:
            first = self.instances[0] if self.instances else None
            await wait_leading(conn, self.daemon, "plugin", self.replica_dir(first))
        # The take-over tick (declaring, publishing the runnable targets) is over once the
        # runnable targets carry its stamp; give it a moment more.
        await asyncio.sleep(1.0)
        self.startup_s = time.monotonic() - self.started
        return self

    def replica_dir(self, name: str | None) -> Path:
        return self.workdir if name is None else self.workdir / name

    def replica_dirs(self) -> list[Path]:
        """The first replicas' log directories (those named in `instances`)."""
        return [self.replica_dir(name) for name in self.instances] or [self.workdir]

    def start_replica(
        self, name: str | None, pin: str | None = None, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """One more replica on the database (instance id `name`), appended to `daemons`."""
        workdir = self.replica_dir(name)
        if name is not None:
            fresh_log(workdir)
        extra = {
            "SCHEDULER_CONFIG": str(self.workdir / "scale.toml"),
            # The daemon of this tree (bench/shards.py may run from a worktree of a commit).
            "PYTHONPATH": os.pathsep.join([str(ROOT / "bench"), str(ROOT)]),
        }
        if name is not None:
            extra["SCHEDULER_INSTANCE_ID"] = name
        if self.http:
            port = free_port()
            self.ports.append(port)
            extra |= {"SCHEDULER_HTTP__ENABLED": "true", "SCHEDULER_HTTP__PORT": str(port)}
        prefix = ["taskset", "-c", pin] if pin is not None else []
        daemon = start_daemon(
            self.dsn, workdir, only="plugin", env=extra | self.env | (env or {}), prefix=prefix
        )
        self.daemons.append(daemon)
        return daemon

    async def wait_shared(self, within: float = 120.0) -> None:
        """Until every shard has a leader and the live replicas share them out (each at
        most ceil(shards / replicas), as the assignment bounds it)."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            for daemon in self.daemons:
                if daemon.poll() is not None:
                    raise RuntimeError(f"a replica exited {daemon.returncode}: see {self.workdir}")
            live = sum(d.poll() is None for d in self.daemons)
            rows = await self.db.fetch(
                "SELECT instance, count(*) AS n FROM scheduler_leaders "
                "WHERE loop LIKE 'plugin/%' GROUP BY instance"
            )
            held = [row["n"] for row in rows]
            cap = -(-self.shards // max(1, live))
            if (
                sum(held) == self.shards
                and len(held) == min(live, self.shards)
                and max(held) <= cap
            ):
                return
            await asyncio.sleep(0.1)
        raise TimeoutError(f"the shards were not shared out in {within:g} s: see {self.workdir}")

    @property
    def daemon(self) -> subprocess.Popen[bytes] | None:
        return self.daemons[0] if self.daemons else None

    @property
    def port(self) -> int:
        return self.ports[0] if self.ports else 0

    def config(self) -> str:
        lines = [
            "[plugin]",
            "entry_points = false",
            'disabled = ["purge_publications"]',
            "runnable = [" + ", ".join(f'"{t}"' for t in self.runnable) + "]",
        ]
        if self.concurrency is not None:
            lines.append(f"concurrency = {self.concurrency}")
        if self.shards > 1:
            lines.append(f"shards = {self.shards}")
        lines.append("")
        if self.kind == "sql":
            for name in names(self.count):
                lines += [
                    "[[plugin.tasks]]",
                    f'name = "{name}"',
                    f'every = "{self.every:g}s"',
                    'sql = "SELECT 1"',
                    "",
                ]
        return "\n".join(lines)

    async def __aexit__(self, *exc: object) -> None:
        stop_all([d for d in self.daemons if d.poll() is None])
        if self.conn is not None:
            await self.conn.close()
        await drop_database(self.admin, self.database, grace=0)

    @property
    def db(self) -> asyncpg.Connection:
        assert self.conn is not None
        return self.conn

    @property
    def pid(self) -> int:
        assert self.daemon is not None
        return self.daemon.pid

    def stop(self) -> None:
        """Stop every replica (SIGTERM to all, then wait for each): an error if one had
        exited by itself."""
        assert self.daemon is not None
        if self.daemon.poll() is not None:
            raise RuntimeError(f"the leader exited early:\n{log_tail(self.workdir)}")
        stop_all([d for d in self.daemons if d.poll() is None])

    async def set_slots(self, spread: float, lead: float = LEAD) -> datetime:
        """Schedule i's next slot at T0 + i * spread * period / N; returns T0. With a
        jitter: each schedule's first slot from T0, as `Client.add_schedule` computes it
        for schedules created at one instant (the first point of its grid)."""
        t0: datetime = await self.db.fetchval("SELECT now() + make_interval(secs => $1)", lead)
        if self.jitter:
            all_names = names(self.count)
            firsts = [with_jitter(Every(self.every), n, self.jitter).first(t0) for n in all_names]
            await self.db.execute(
                "UPDATE scheduler_plugin_tasks t SET next_run_at = f.first "
                "FROM unnest($1::text[], $2::timestamptz[]) AS f(name, first) "
                "WHERE t.name = f.name",
                all_names,
                firsts,
            )
            return t0
        await self.db.execute(
            "UPDATE scheduler_plugin_tasks SET next_run_at = "
            "$1::timestamptz + make_interval(secs => substr(name, 2)::int * $2::float8 / $3) "
            "WHERE name LIKE 's%'",
            t0,
            spread * self.every,
            self.count,
        )
        return t0

    async def sleep_until(self, when: datetime) -> None:
        left = await self.db.fetchval("SELECT extract(epoch FROM $1::timestamptz - now())", when)
        await asyncio.sleep(max(0.0, float(left)))


# --- periodic cases (spread, jittered, sql, concurrency 4) ----------------------------------


@dataclass(frozen=True)
class Periodic:
    label: str
    kind: str  # "runtime" | "sql"
    tasks: int
    spread: float  # 1.0: spread over the period; 0.0: aligned at one instant
    jitter: float
    concurrency: int | None
    window: float
    profile: bool = False
    period: float = PERIOD  # every schedule runs every `period` s
    target: str = NOOP
    pool: int | None = None  # the replicas' database.pool_max_size (None: the default)


def expected_slots(
    case: Periodic, t0: datetime, t_end: datetime
) -> tuple[list[str], list[datetime], list[int]]:
    """Every slot the window should see, per schedule. Without jitter: its first slot (T0
    plus its share of the spread), then every PERIOD. With jitter: T0 for all (the rows'
    next_run_at, set at one instant), then the points of each schedule's own grid (whole
    periods from the epoch plus its offset, plugins/tasks.py) from T0 (set_slots) up
    to the window's end; `k` counts them from 0."""
    out_names: list[str] = []
    out_slots: list[datetime] = []
    out_ks: list[int] = []
    step = timedelta(seconds=case.period)
    for index, name in enumerate(names(case.tasks)):
        if case.jitter > 0:
            grid = with_jitter(Every(case.period), name, case.jitter)
            slot, k = grid.first(t0), 0
            while slot < t_end:
                out_names.append(name)
                out_slots.append(slot)
                out_ks.append(k)
                slot, k = grid.next_after(slot), k + 1
            continue
        first = t0 + timedelta(seconds=index * case.spread * case.period / case.tasks)
        for k in range(round(case.window / case.period)):
            out_names.append(name)
            out_slots.append(first + step * k)
            out_ks.append(k)
    return out_names, out_slots, out_ks


async def periodic(
    admin: str, workdir: Path, case: Periodic, sizes: Sizes, **replicas: Any
) -> dict[str, Any]:
    """`replicas`: Leader's options for several (bench/shards.py); then `leader_cpu_percent`
    is the first one's, and `replica_cpu_percent` lists each one's."""
    if case.pool is not None:
        pool = {"SCHEDULER_DATABASE__POOL_MAX_SIZE": str(case.pool)}
        replicas = {**replicas, "env": {**replicas.get("env", {}), **pool}}
    async with Leader(
        admin, workdir, case.tasks, kind=case.kind, jitter=case.jitter,
        concurrency=case.concurrency, every=case.period, target=case.target, **replicas,
    ) as leader:  # fmt: skip
        t0 = await leader.set_slots(case.spread)
        t_end = t0 + timedelta(seconds=case.window)
        await leader.sleep_until(t0)
        meter = Meter(leader.pid, await backend_pids(leader.db))
        others = [Meter(d.pid, []) for d in leader.daemons[1:]]
        await meter.start(leader.db)
        for other in others:
            await other.start(leader.db)
        profile: dict[str, Any] | None = None
        if case.profile:
            profile = await py_spy(leader.pid, min(sizes.profile_seconds, case.window - 1))
        await leader.sleep_until(t_end)
        usage = await meter.stop(leader.db)
        replica_cpu = [usage["leader_cpu_percent"]]
        for other in others:
            replica_cpu.append((await other.stop(leader.db))["leader_cpu_percent"])
        load = os.getloadavg()[0]
        await asyncio.sleep(GRACE)
        t_stop: datetime = await leader.db.fetchval("SELECT now()")
        leader.stop()
        periods = round(case.window / case.period)
        slot_names, slot_times, slot_ks = expected_slots(case, t0, t_end)
        expected = await leader.db.fetch(
            "WITH slots AS (SELECT * FROM unnest($1::text[], $2::timestamptz[], $3::int[]) "
            "AS s(name, slot, k)) "
            "SELECT s.k, r.status, extract(epoch FROM r.started_at - s.slot)::float8 AS claim, "
            "extract(epoch FROM coalesce(r.finished_at, $4) - s.slot)::float8 AS done "
            "FROM slots s LEFT JOIN scheduler_plugin_runs r USING (name, slot)",
            slot_names,
            slot_times,
            slot_ks,
            t_stop,
        )
        # Runs as recorded, whatever their slots (a jitter the daemon applied would move
        # them off the expected ones).
        recorded = await leader.db.fetchrow(
            "SELECT count(*) FILTER (WHERE started_at >= $1 AND started_at < $2 "
            "  AND status <> 'skipped_overlap') AS started, "
            "count(*) FILTER (WHERE slot >= $1 AND slot < $2) AS in_window, "
            "count(DISTINCT extract(epoch FROM slot - $1)::numeric % $3::numeric) "
            "  FILTER (WHERE slot >= $1 AND slot < $2) AS phases, "
            "count(*) FILTER (WHERE status = 'skipped_overlap') AS skipped "
            "FROM scheduler_plugin_runs",
            t0,
            t_end,
            case.period,
        )
    ran = [r for r in expected if r["status"] not in (None, "skipped_overlap", "running")]
    done = [r["done"] for r in expected]
    result: dict[str, Any] = {
        **asdict(case),
        "startup_s": leader.startup_s,
        "load_average": load,
        "slots_expected": len(expected),
        "slots_ran": len(ran),
        "slots_not_run": len(expected) - len(ran),
        "runs_recorded_in_window": recorded["in_window"],
        "distinct_slot_phases": recorded["phases"],
        "skipped_overlap": recorded["skipped"],
        "failed": sum(r["status"] != "succeeded" for r in ran),
        "misfire_lines": count_events(workdir, "task.misfired")
        + count_events(workdir, "plugin.misfired"),
        "lagging_warnings": count_events(workdir, "plugin.lagging"),
        "leadership_lost": sum(count_events(d, "leader.lost") for d in leader.replica_dirs()),
        "runs_per_second_needed": case.tasks / case.period,
        "runs_per_second": recorded["started"] / case.window,
        "replica_cpu_percent": replica_cpu,
        "lateness_s": summary(done),
        "lateness_ran_s": summary([r["done"] for r in ran]),
        "claim_lateness_ran_s": summary([r["claim"] for r in ran]),
        "lateness_p99_by_period_s": [
            summary([r["done"] for r in expected if r["k"] == k])["p99"] for k in range(periods)
        ],
        "profile": profile,
        **usage,
    }
    p99 = result["lateness_s"]["p99"]
    result["every_slot_ran"] = result["slots_not_run"] == 0
    result["p99_met"] = p99 is not None and p99 < P99_TARGET
    return result


# --- burst ---------------------------------------------------------------------------------


async def burst(
    admin: str, workdir: Path, sizes: Sizes, concurrency: int | None = None
) -> dict[str, Any]:
    async with Leader(admin, workdir, sizes.tasks, every=3600.0, concurrency=concurrency) as leader:
        t0 = await leader.set_slots(0.0)
        await leader.sleep_until(t0)
        meter = Meter(leader.pid, await backend_pids(leader.db))
        await meter.start(leader.db)
        deadline = time.monotonic() + sizes.burst_timeout
        while time.monotonic() < deadline:
            finished = await leader.db.fetchval(
                "SELECT count(*) FROM scheduler_plugin_runs WHERE status <> 'running'"
            )
            if finished >= sizes.tasks:
                break
            await asyncio.sleep(0.2)
        usage = await meter.stop(leader.db)
        load = os.getloadavg()[0]
        leader.stop()
        rows = await leader.db.fetch(
            "SELECT r.status, extract(epoch FROM r.started_at - t.slot)::float8 AS claim, "
            "extract(epoch FROM r.finished_at - t.slot)::float8 AS done "
            "FROM (SELECT unnest($2::text[]) AS name, $1::timestamptz AS slot) t "
            "LEFT JOIN scheduler_plugin_runs r ON r.name = t.name AND r.slot = t.slot",
            t0,
            names(sizes.tasks),
        )
        runs = await leader.db.fetchval("SELECT count(*) FROM scheduler_plugin_runs")
    ran = [r for r in rows if r["status"] == "succeeded"]
    claims = [r["claim"] for r in rows if r["claim"] is not None]
    dones = [r["done"] for r in rows if r["done"] is not None]
    result = {
        "tasks": sizes.tasks,
        "concurrency": concurrency,
        "startup_s": leader.startup_s,
        "load_average": load,
        "ran": len(ran),
        "lost": sizes.tasks - len(ran),
        "runs_recorded": runs,
        "all_started_s": max(claims) if claims else None,
        "all_finished_s": max(dones) if dones else None,
        "started_s": summary(claims),
        "finished_s": summary(dones),
        "runs_per_second": len(ran) / max(dones) if dones else None,
        **usage,
    }
    result["met"] = (
        result["lost"] == 0
        and result["all_started_s"] is not None
        and result["all_started_s"] < BURST_TARGET
    )
    return result


# --- idle, then pickup ---------------------------------------------------------------------


def transactions(lines: Sequence[str], app_prefix: str) -> list[tuple[int, list[str]]]:
    """The statements of sessions whose application name starts with `app_prefix`,
    grouped into transactions (BEGIN … COMMIT; a statement outside a block is one)."""
    open_blocks: dict[int, list[str]] = {}
    found: list[tuple[int, list[str]]] = []
    entries: list[tuple[re.Match[str], str]] = []
    for line in lines:
        match = LOG_LINE.match(line)
        if match is not None:
            entries.append((match, match["message"]))
        elif entries:
            entries[-1] = (entries[-1][0], entries[-1][1] + "\n" + line)
    for match, message in entries:
        if match["level"] != "LOG" or not match["app"].startswith(app_prefix):
            continue
        statement = STATEMENT.match(message)
        if statement is None:
            continue
        pid = int(match["pid"])
        sql = " ".join(
            p.strip()
            for p in statement["sql"].splitlines()
            if p.strip() and not p.strip().startswith("--")
        )
        head = sql.lstrip().upper()
        if head.startswith(("BEGIN", "START TRANSACTION")):
            open_blocks[pid] = [sql]
        elif head.startswith(("COMMIT", "ROLLBACK", "END", "ABORT")) and pid in open_blocks:
            found.append((pid, [*open_blocks.pop(pid), sql]))
        elif pid in open_blocks:
            open_blocks[pid].append(sql)
        else:
            found.append((pid, [sql]))
    return found


def is_tick(statements: Sequence[str]) -> bool:
    """A plugin tick: the statement (or transaction) holding the window's read (plugin_claim)."""
    return any("'outlook'" in s for s in statements)


def describe_statement(sql: str) -> str:
    text = re.sub(r"\s+", " ", sql).strip()
    return text[:90]


def tally_log(lines: Sequence[str], seconds: float) -> dict[str, Any]:
    txs = transactions(lines, "scheduler-daemon/")
    statements = [s for _, tx in txs for s in tx]
    ticks = [tx for _, tx in txs if is_tick(tx)]
    top = Counter(describe_statement(s) for s in statements).most_common(8)
    per_tick = Counter(len(tx) for tx in ticks)
    return {
        "seconds": seconds,
        "transactions": len(txs),
        "statements": len(statements),
        "transactions_per_s": len(txs) / seconds,
        "statements_per_s": len(statements) / seconds,
        "ticks": len(ticks),
        "statements_per_tick": dict(sorted(per_tick.items())),
        "tick_example": [describe_statement(s) for s in ticks[0]] if ticks else [],
        "top": [{"statement": s, "count": c} for s, c in top],
    }


async def idle_and_pickup(
    admin: str, workdir: Path, sizes: Sizes, log: ServerLog
) -> dict[str, Any]:
    async with Leader(admin, workdir, sizes.tasks, log_statements=log.path is not None) as leader:
        await asyncio.sleep(3.0)  # settle after the take-over
        members = tree(leader.pid)
        meter = Meter(leader.pid, await backend_pids(leader.db))
        offset = log.offset()
        await meter.start(leader.db)
        await asyncio.sleep(sizes.idle_window)
        usage = await meter.stop(leader.db)
        idle_lines = log.lines_since(offset)
        load = os.getloadavg()[0]
        # Pickup: one schedule at a time, due at once, from another connection.
        offset = log.offset()
        began = time.monotonic()
        latencies: list[float] = []
        missing = 0
        for trial in range(sizes.pickup_trials):
            name = f"pickup{trial:03d}"
            await leader.db.execute(
                "INSERT INTO scheduler_plugin_tasks (name, target, every_seconds, next_run_at) "
                "VALUES ($1, $2, 3600, clock_timestamp())",
                name,
                NOOP,
            )
            deadline = time.monotonic() + 5.0
            latency = None
            while time.monotonic() < deadline:
                latency = await leader.db.fetchval(
                    "SELECT extract(epoch FROM started_at - slot)::float8 "
                    "FROM scheduler_plugin_runs WHERE name = $1",
                    name,
                )
                if latency is not None:
                    break
                await asyncio.sleep(0.005)
            if latency is None:
                missing += 1
            else:
                latencies.append(latency)
            await asyncio.sleep(0.3 + 0.2 * (trial % 3))  # idle again, at varied phases
        pickup_lines = log.lines_since(offset)
        (workdir / "idle-server.log").write_text("\n".join(idle_lines))
        (workdir / "pickup-server.log").write_text("\n".join(pickup_lines))
        pickup_seconds = time.monotonic() - began
        leader.stop()
    result: dict[str, Any] = {
        "tasks": sizes.tasks,
        "startup_s": leader.startup_s,
        "window_s": sizes.idle_window,
        "load_average": load,
        "processes": len(members),
        **usage,
        "log": tally_log(idle_lines, sizes.idle_window) if log.path else None,
        "pickup": {
            "trials": sizes.pickup_trials,
            "missing": missing,
            "latency_s": summary(latencies),
            "latency_min_s": min(latencies) if latencies else None,
            "log": tally_log(pickup_lines, pickup_seconds) if log.path else None,
        },
    }
    cpu = result["leader_cpu_percent"]
    result["met"] = cpu is not None and cpu < IDLE_CPU_TARGET
    p99 = result["pickup"]["latency_s"]["p99"]
    result["pickup"]["met"] = missing == 0 and p99 is not None and p99 < P99_TARGET
    return result


# --- overload ------------------------------------------------------------------------------


def scrape_lag(port: int) -> float | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as page:
            text = page.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("scheduler_plugin_lag_seconds "):
            return float(line.split()[1])
    return None


async def overload(admin: str, workdir: Path, sizes: Sizes) -> dict[str, Any]:
    n, c = sizes.tasks, sizes.overload_concurrency
    window = sizes.overload_window
    async with Leader(admin, workdir, n, target=SLOW, concurrency=c, http=True) as leader:
        t0 = await leader.set_slots(1.0)
        await leader.sleep_until(t0)
        meter = Meter(leader.pid, await backend_pids(leader.db))
        await meter.start(leader.db)
        samples: list[dict[str, float | None]] = []
        began = time.monotonic()
        while (elapsed := time.monotonic() - began) < window:
            metric = await asyncio.to_thread(scrape_lag, leader.port)
            db_lag = await leader.db.fetchval(
                "SELECT extract(epoch FROM now() - min(next_run_at))::float8 "
                "FROM scheduler_plugin_tasks WHERE active AND NOT paused AND next_run_at <= now()"
            )
            samples.append({"t": elapsed, "metric_lag_s": metric, "db_lag_s": db_lag or 0.0})
            await asyncio.sleep(max(0.0, len(samples) - (time.monotonic() - began)))
        usage = await meter.stop(leader.db)
        load = os.getloadavg()[0]
        t_end = t0 + timedelta(seconds=window)
        leader.stop()
        rows = await leader.db.fetch(
            "SELECT t.name, extract(epoch FROM $1::timestamptz + make_interval(secs => "
            "substr(t.name, 2)::int * $2::float8 / $3) - $1)::float8 AS first, "
            "coalesce(array_agg(extract(epoch FROM r.started_at - $1)::float8 ORDER BY r.started_at) "
            "  FILTER (WHERE r.id IS NOT NULL), '{}') AS starts "
            "FROM scheduler_plugin_tasks t LEFT JOIN scheduler_plugin_runs r "
            "  ON r.name = t.name AND r.started_at >= $1 AND r.started_at < $4 "
            "  AND r.status <> 'skipped_overlap' "
            "WHERE t.name LIKE 's%' GROUP BY t.name",
            t0,
            PERIOD,
            n,
            t_end,
        )
        statuses = await leader.db.fetch(
            "SELECT status, count(*) AS n FROM scheduler_plugin_runs GROUP BY status"
        )
    runs_per_schedule: list[int] = []
    max_gaps: list[float] = []  # per schedule, in periods, edges included
    inner_gaps: list[float] = []  # per schedule that ran twice or more, between its runs
    for row in rows:
        starts = list(row["starts"])
        runs_per_schedule.append(len(starts))
        points = [row["first"], *starts, window]
        gaps = [(b - a) / PERIOD for a, b in itertools.pairwise(points)]
        max_gaps.append(max(gaps))
        if len(starts) >= 2:
            inner_gaps.append(max((b - a) / PERIOD for a, b in itertools.pairwise(starts)))
    histogram = Counter(runs_per_schedule)
    metric_lags = [s["metric_lag_s"] for s in samples if s["metric_lag_s"] is not None]
    db_lags = [s["db_lag_s"] for s in samples if s["db_lag_s"] is not None]
    total = sum(runs_per_schedule)
    periods = window / PERIOD
    result = {
        "tasks": n,
        "concurrency": c,
        "target": SLOW,
        "window_s": window,
        "periods": periods,
        "startup_s": leader.startup_s,
        "load_average": load,
        "runs_per_second_needed": n / PERIOD,
        "runs_per_second_capacity": c / 0.5,
        "runs": total,
        "runs_per_second": total / window,
        "ran_at_least_once": sum(1 for k in runs_per_schedule if k > 0) / n,
        "never_ran": sum(1 for k in runs_per_schedule if k == 0),
        "ran_twice_or_more": sum(1 for k in runs_per_schedule if k >= 2),
        # At most this share can run once in the window, at the rate achieved.
        "share_the_rate_allows": min(1.0, total / n),
        "runs_per_schedule": dict(sorted(histogram.items())),
        "max_gap_periods": summary(max_gaps),
        "schedules_with_gap_over_10_periods": sum(1 for g in max_gaps if g > 10),
        "gap_between_runs_periods": summary(inner_gaps),
        "statuses": {r["status"]: r["n"] for r in statuses},
        "misfire_lines": count_events(workdir, "task.misfired")
        + count_events(workdir, "plugin.misfired"),
        "lagging_warnings": count_events(workdir, "plugin.lagging"),
        "leadership_lost": count_events(workdir, "leader.lost"),
        "lag_metric_s": summary(metric_lags),
        "lag_db_s": summary(db_lags),
        "lag_samples": samples,
        **usage,
    }
    result["met"] = result["never_ran"] == 0 and result["schedules_with_gap_over_10_periods"] == 0
    # Fair: no schedule ran a second time while another had not run at all.
    result["fair"] = result["never_ran"] == 0 or result["ran_twice_or_more"] == 0
    return result


# --- profile -------------------------------------------------------------------------------


def py_spy_binary() -> str | None:
    candidate = Path(sys.executable).parent / "py-spy"
    if candidate.exists():
        return str(candidate)
    return shutil.which("py-spy")


async def py_spy(pid: int, seconds: float) -> dict[str, Any] | None:
    """Sample the leader for `seconds` (py-spy record, raw collapsed stacks): the share of
    samples by innermost frame of ours/asyncpg/asyncio, and by function anywhere on the
    stack."""
    binary = py_spy_binary()
    if binary is None:
        return None
    out = RESULTS / ".work" / "scale" / "profile.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    process = await asyncio.create_subprocess_exec(
        binary, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))),
        "--rate", "200", "--format", "raw", "--output", str(out), "--nonblocking",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await process.communicate()
    if process.returncode != 0 or not out.exists():
        return {"error": err.decode(errors="replace")[-300:]}
    return summarize_profile(out.read_text().splitlines())


def summarize_profile(lines: Sequence[str]) -> dict[str, Any]:
    leaf: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = idle = 0
    for line in lines:
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        samples = int(count)
        frames = stack.split(";")
        innermost = short_frame(frames[-1])
        if innermost.startswith(IDLE_FRAMES):
            idle += samples  # the event loop waiting: not CPU
            continue
        total += samples
        leaf[innermost] += samples
        for frame in {short_frame(f) for f in frames}:
            if "(" in frame and not frame.endswith(
                ("(asyncio/events.py)", "(asyncio/base_events.py)")
            ):
                inclusive[frame] += samples
    ours = [(f, c) for f, c in inclusive.most_common() if is_ours(f)]
    return {
        "idle_samples": idle,
        "ours": [{"frame": f, "share": c / total} for f, c in ours[:15]] if total else [],
        "samples": total,
        "self": [{"frame": f, "share": c / total} for f, c in leaf.most_common(12)]
        if total
        else [],
        "inclusive": [{"frame": f, "share": c / total} for f, c in inclusive.most_common(25)]
        if total
        else [],
    }


IDLE_FRAMES = ("select (selectors.py)", "EpollSelector.select (selectors.py)")
OURS = ("loops/", "db/", "leadership/", "plugins/", "growth_tasks")


def is_ours(frame: str) -> bool:
    return any(f"({marker}" in frame for marker in OURS)


def short_frame(frame: str) -> str:
    """'func (path/to/module.py:123)' -> 'func (module.py)'."""
    match = re.match(r"(?P<func>.*?) \((?P<path>[^:()]*)(?::\d+)?\)$", frame.strip())
    if match is None:
        return frame.strip()
    path = match["path"]
    for marker in ("site-packages/", "scheduler_daemon/", "lib/python3.11/"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{match['func']} ({path})"


# --- the run -------------------------------------------------------------------------------


def plan(sizes: Sizes) -> list[Periodic]:
    n = sizes.tasks
    return [
        Periodic("spread", "runtime", n, 1.0, 0.0, None, sizes.window, profile=True),
        Periodic("aligned, jitter 10 s", "runtime", n, 0.0, PERIOD, None, sizes.window),
        Periodic("spread, concurrency 4", "runtime", n, 1.0, 0.0, 4, sizes.compare_window),
        Periodic("sql, spread", "sql", sizes.sql_small, 1.0, 0.0, None, sizes.sql_window),
        Periodic("sql, spread", "sql", sizes.sql_large, 1.0, 0.0, None, sizes.sql_window),
        # Each `sql` task is a fenced transaction on the pool, and user SQL holds at most
        # pool_max_size - 2 connections: the pool bounds how many are in flight.
        Periodic(
            "sql, spread, pool 20",
            "sql",
            sizes.sql_large,
            1.0,
            0.0,
            None,
            sizes.sql_window,
            pool=20,
        ),
    ]


async def run(admin: str, workdir: Path, sizes: Sizes) -> dict[str, Any]:
    log = await find_log(admin)
    results: dict[str, Any] = {
        "code": code_version(),
        "sizes": asdict(sizes),
        "periodic": [],
    }
    for case in plan(sizes):
        print(f"scale: {case.tasks:,} {case.label}", flush=True)
        result = await periodic(admin, workdir / "periodic", case, sizes)
        results["periodic"].append(result)
        print(
            f"scale:   {result['runs_per_second']:,.0f} of {result['runs_per_second_needed']:,.0f} "
            f"runs/s, lateness p99 {fmt_s(result['lateness_s']['p99'])}, not run "
            f"{result['slots_not_run']:,} of {result['slots_expected']:,}, leader CPU "
            f"{fmt_pct(result['leader_cpu_percent'])}",
            flush=True,
        )
    print(f"scale: {sizes.tasks:,} due at one instant", flush=True)
    results["burst"] = await burst(admin, workdir / "burst", sizes)
    b = results["burst"]
    print(f"scale:   all started {fmt_s(b['all_started_s'])}, lost {b['lost']}", flush=True)
    results["burst_wide"] = await burst(
        admin, workdir / "burst", sizes, concurrency=sizes.wide_concurrency
    )
    b = results["burst_wide"]
    print(
        f"scale:   concurrency {sizes.wide_concurrency}: all started "
        f"{fmt_s(b['all_started_s'])}, lost {b['lost']}",
        flush=True,
    )
    print(f"scale: {sizes.tasks:,} idle, then pickup", flush=True)
    results["idle"] = await idle_and_pickup(admin, workdir / "idle", sizes, log)
    i = results["idle"]
    print(
        f"scale:   idle CPU {i['leader_cpu_percent']:.2f}%, pickup p99 "
        f"{fmt_s(i['pickup']['latency_s']['p99'])}",
        flush=True,
    )
    print(
        f"scale: overload, {sizes.tasks:,} at concurrency {sizes.overload_concurrency}", flush=True
    )
    results["overload"] = await overload(admin, workdir / "overload", sizes)
    o = results["overload"]
    print(
        f"scale:   {o['runs_per_second']:.0f} runs/s, ran at least once {o['ran_at_least_once']:.1%}, "
        f"max gap {o['max_gap_periods']['max']:.1f} periods",
        flush=True,
    )
    return results


# --- report --------------------------------------------------------------------------------


def yes_no(value: bool | None) -> str:
    return {True: "met", False: "**not met**", None: "-"}[value]


def targets(results: dict[str, Any]) -> list[str]:
    """Issue 19's targets against what this run measured."""
    by = {(r["label"], r["tasks"]): r for r in results["periodic"]}
    n = results["sizes"]["tasks"]
    small, large = results["sizes"]["sql_small"], results["sizes"]["sql_large"]
    lines = [
        "| case | target | measured | |",
        "|---|---|---|---|",
    ]
    for label in ("spread", "aligned, jitter 10 s"):
        r = by.get((label, n))
        if r is None:
            continue
        met = (
            r["every_slot_ran"]
            and r["p99_met"]
            and r["runs_per_second"] >= 0.98 * r["runs_per_second_needed"]
            and (r["leader_cpu_percent"] or 0) <= CPU_TARGET
        )
        p99 = f"p99 {fmt_s(r['lateness_s']['p99'])}"
        lines.append(
            f"| {n:,} every 10 s, {label} | ≥ {n / PERIOD:,.0f} runs/s, every slot run, "
            f"lateness p99 < 100 ms, leader CPU ≤ 25% | {r['runs_per_second']:,.0f} runs/s, "
            f"{r['slots_not_run']:,} of {r['slots_expected']:,} slots not run, {p99}, "
            f"leader CPU {fmt_pct(r['leader_cpu_percent'])} | {yes_no(met)} |"
        )
    b = results["burst"]
    lines.append(
        f"| {b['tasks']:,} due at one instant | all started within 1 s, none lost "
        f"| all started after {fmt_s(b['all_started_s'])} (finished {fmt_s(b['all_finished_s'])}), "
        f"{b['lost']} lost | {yes_no(b['met'])} |"
    )
    i = results["idle"]
    idle_ticks = (i["log"] or {}).get("ticks", 0)
    woken = (i["pickup"]["log"] or {}).get("statements_per_tick") or {}
    lines.append(
        f"| {i['tasks']:,} idle | leader CPU < 1%, at most one statement per wake-up "
        f"| CPU {i['leader_cpu_percent']:.2f}%; {idle_ticks} ticks in the "
        f"{i['window_s']:g} s window; a woken tick (pickup trials): one read of the tasks "
        "table in a fenced transaction of "
        + " or ".join(f"{k} statements ({v} ticks)" for k, v in woken.items())
        + f" | {yes_no(i['met'])} (CPU); one read per wake-up |"
    )
    for count, label in ((small, "keep up, p99 < 100 ms"), (large, "≥ 1,000 runs/s")):
        r = by.get(("sql, spread", count))
        if r is None:
            continue
        met = (
            r["every_slot_ran"] and r["p99_met"]
            if count == small
            else r["runs_per_second"] >= 0.98 * r["runs_per_second_needed"]
        )
        lines.append(
            f"| `sql` tasks, {count:,} every 10 s | {label} | {r['runs_per_second']:,.0f} runs/s, "
            f"{r['slots_not_run']:,} of {r['slots_expected']:,} not run, p99 "
            f"{fmt_s(r['lateness_s']['p99'])}, leader CPU {fmt_pct(r['leader_cpu_percent'])} "
            f"| {yes_no(met)} |"
        )
    p = i["pickup"]
    lines.append(
        f"| runtime schedule pickup (session mode) | p99 < 100 ms of its commit "
        f"| p50 {fmt_s(p['latency_s']['p50'])}, p99 {fmt_s(p['latency_s']['p99'])}, "
        f"max {fmt_s(p['latency_s']['max'])} ({p['trials']} trials, {p['missing']} missed) "
        f"| {yes_no(p['met'])} |"
    )
    o = results["overload"]
    lines.append(
        f"| overload: {o['tasks']:,} every 10 s, ~{o['runs_per_second_capacity'] / o['runs_per_second_needed']:.0%} fit "
        f"| every schedule runs at least once every 10 periods; none starves; lag reported "
        f"| {o['ran_at_least_once']:.1%} ran in {o['periods']:g} periods (the "
        f"{o['runs_per_second']:.0f} runs/s achieved allow {o['share_the_rate_allows']:.1%}), "
        f"{o['ran_twice_or_more']:,} ran twice; longest gap "
        f"{o['max_gap_periods']['max']:.1f} periods; lag (metric) max {fmt_s(o['lag_metric_s']['max'])} "
        f"| {yes_no(o['met'])} |"
    )
    return lines


def report(results: dict[str, Any]) -> str:
    code = results["code"]
    lines = [
        f"# Scale: issue 19's targets on one leader ({results['date']}, {results['machine']})",
        "",
        f"Commit {code['commit'][:12]}"
        + (f", with uncommitted changes to {', '.join(code['changed'])}" if code["changed"] else "")
        + ". PostgreSQL with fsync and synchronous_commit on; one leader (one process, "
        "`run --only plugin`), runtime schedules (rows naming `growth_tasks:noop`, async, "
        "does nothing) unless `sql`. Lateness: finished_at - slot (a slot not run by the "
        "end counts with its wait so far). CPU: 100% = one core.",
        "",
        *[line for note in results.get("notes", []) for line in (note, "")],
        "## Against the targets",
        "",
        *targets(results),
        "",
        "## Periodic: N schedules every 10 s",
        "",
        "| N | case | concurrency | window | runs/s needed | runs/s | lateness p50 | p99 "
        "| max | claim p99 | not run | p99 by period | leader CPU | db CPU | commits/s | load |",
        "|" + "---|" * 16,
    ]
    for r in results["periodic"]:
        late = r["lateness_s"]
        by_period = ", ".join(fmt_s(v) for v in r["lateness_p99_by_period_s"])
        lines.append(
            f"| {r['tasks']:,} | {r['label']} | {r['concurrency'] or 'default'} "
            f"| {r['window']:g} s | {r['runs_per_second_needed']:,.0f} | {r['runs_per_second']:,.0f} "
            f"| {fmt_s(late['p50'])} | {fmt_s(late['p99'])} | {fmt_s(late['max'])} "
            f"| {fmt_s(r['claim_lateness_ran_s']['p99'])} "
            f"| {r['slots_not_run']:,} of {r['slots_expected']:,} | {by_period} "
            f"| {fmt_pct(r['leader_cpu_percent'])} | {fmt_pct(r['db_cpu_percent'])} "
            f"| {r['commits_per_second']:,.0f} | {r['load_average']:.1f} |"
        )
    jittered = [r for r in results["periodic"] if r["jitter"]]
    for r in jittered:
        lines += [
            "",
            f"Aligned with `jitter_seconds = {r['jitter']:g}`: the window's runs fell on "
            f"{r['distinct_slot_phases']:,} distinct slot phases (of {r['tasks']:,} schedules).",
        ]
    b = results["burst"]
    lines += [
        "",
        f"## Burst: {b['tasks']:,} schedules due at one instant",
        "",
        "| concurrency | started p50 | p99 | all started | finished p50 | p99 | all finished "
        "| lost | runs/s | leader CPU | db CPU | load |",
        "|" + "---|" * 12,
    ]
    for b in (results["burst"], results.get("burst_wide")):
        if b is None:
            continue
        lines.append(
            f"| {b['concurrency'] or 'default'} | {fmt_s(b['started_s']['p50'])} "
            f"| {fmt_s(b['started_s']['p99'])} "
            f"| {fmt_s(b['all_started_s'])} | {fmt_s(b['finished_s']['p50'])} "
            f"| {fmt_s(b['finished_s']['p99'])} | {fmt_s(b['all_finished_s'])} | {b['lost']} "
            f"| {b['runs_per_second'] or 0:,.0f} | {fmt_pct(b['leader_cpu_percent'])} "
            f"| {fmt_pct(b['db_cpu_percent'])} | {b['load_average']:.1f} |"
        )
    i = results["idle"]
    lines += [
        "",
        f"## Idle: {i['tasks']:,} schedules an hour away, {i['window_s']:g} s window",
        "",
        f"Leader CPU {i['leader_cpu_percent']:.2f}% (db backends {fmt_pct(i['db_cpu_percent'])}).",
    ]
    if i["log"]:
        g = i["log"]
        lines += [
            f"From the server's statement log: {g['transactions_per_s']:.2f} transactions/s, "
            f"{g['statements_per_s']:.2f} statements/s, {g['ticks']} plugin ticks in the window.",
            "",
            "| statement (idle window) | count |",
            "|---|---|",
            *[f"| `{t['statement']}` | {t['count']} |" for t in g["top"]],
        ]
    p = i["pickup"]
    lines += [
        "",
        f"## Pickup: a runtime schedule due at once, inserted while the leader idles "
        f"({p['trials']} trials)",
        "",
        f"started_at - next_run_at (clock_timestamp() in the INSERT, before its commit): "
        f"p50 {fmt_s(p['latency_s']['p50'])}, p99 {fmt_s(p['latency_s']['p99'])}, max "
        f"{fmt_s(p['latency_s']['max'])}, min {fmt_s(p['latency_min_s'])}; {p['missing']} "
        "not picked up within 5 s.",
    ]
    if p["log"]:
        g = p["log"]
        ticks = ", ".join(f"{k} statements: {v}" for k, v in g["statements_per_tick"].items())
        lines += [
            f"Ticks during the trials: {g['ticks']} ({ticks}). A tick's transaction: "
            + " → ".join(f"`{s[:40]}`" for s in g["tick_example"])
            + ".",
        ]
    o = results["overload"]
    hist = ", ".join(f"{k}: {v:,}" for k, v in o["runs_per_schedule"].items())
    lines += [
        "",
        f"## Overload: {o['tasks']:,} schedules every 10 s, `growth_tasks:half_second`, "
        f"concurrency {o['concurrency']}",
        "",
        f"Capacity {o['runs_per_second_capacity']:,.0f} runs/s against "
        f"{o['runs_per_second_needed']:,.0f} needed, over {o['window_s']:g} s "
        f"({o['periods']:g} periods): {o['runs_per_second']:,.0f} runs/s; "
        f"{o['ran_at_least_once']:.1%} of the schedules ran at least once "
        f"({o['never_ran']:,} never; at the rate achieved at most "
        f"{o['share_the_rate_allows']:.1%} could); runs per schedule: {hist}; "
        f"{o['ran_twice_or_more']:,} ran twice or more"
        + (" (fair: none ran again before every other had run)" if o["fair"] else "")
        + f". Longest gap per schedule "
        f"(edges included, in periods): p50 {o['max_gap_periods']['p50']:.1f}, p99 "
        f"{o['max_gap_periods']['p99']:.1f}, max {o['max_gap_periods']['max']:.1f}; "
        f"{o['schedules_with_gap_over_10_periods']:,} schedules with a gap over 10 periods. "
        f"Lag from /metrics: p50 {fmt_s(o['lag_metric_s']['p50'])}, max "
        f"{fmt_s(o['lag_metric_s']['max'])}; from the database: p50 "
        f"{fmt_s(o['lag_db_s']['p50'])}, max {fmt_s(o['lag_db_s']['max'])}. "
        f"`plugin.lagging` warnings: {o['lagging_warnings']}; misfire lines: "
        f"{o['misfire_lines']}. Leader CPU {fmt_pct(o['leader_cpu_percent'])}.",
    ]
    profiled = [r for r in results["periodic"] if r.get("profile") and r["profile"].get("samples")]
    for r in profiled:
        prof = r["profile"]
        lines += [
            "",
            f"## Where the leader's time goes ({r['tasks']:,} {r['label']}, py-spy at "
            f"200 Hz, {prof['samples']:,} busy samples)",
            "",
            f"Shares of the samples where the leader was not waiting in its event loop "
            f"({prof['idle_samples']:,} more samples were). Innermost frame, and our "
            "functions anywhere on the stack:",
            "",
            "| innermost frame | share | our function (inclusive) | share |",
            "|---|---|---|---|",
            *[
                f"| `{a['frame']}` | {a['share']:.1%} | `{b['frame']}` | {b['share']:.1%} |"
                for a, b in zip(prof["self"][:12], prof["ours"][:12], strict=False)
            ],
        ]
    lines += ["", *observations(results), ""]
    return "\n".join(lines)


def observations(results: dict[str, Any]) -> list[str]:
    lines = []
    cases = [*results["periodic"], results["burst"], results["idle"], results["overload"]]
    for r in cases:
        if r.get("leadership_lost"):
            lines.append(
                f"- {r.get('label', '')} {r['tasks']:,}: the leader lost its lock "
                f"{r['leadership_lost']} times: not a clean measurement."
            )
    return lines


def plots(results: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    o = results["overload"]
    fig, (lag, hist) = plt.subplots(1, 2, figsize=(12, 4.2))
    ts = [s["t"] for s in o["lag_samples"]]
    lag.plot(ts, [s["metric_lag_s"] for s in o["lag_samples"]], label="/metrics lag")
    lag.plot(ts, [s["db_lag_s"] for s in o["lag_samples"]], "--", label="oldest due (database)")
    lag.set_xlabel("seconds into the window")
    lag.set_ylabel("seconds")
    lag.set_title(
        f"overload: {o['tasks']:,} every 10 s, capacity {o['runs_per_second_capacity']:.0f} runs/s"
    )
    lag.grid(True, alpha=0.3)
    lag.legend(fontsize=8)
    counts = o["runs_per_schedule"]
    keys = sorted(int(k) for k in counts)
    hist.bar(keys, [counts[k] if k in counts else counts[str(k)] for k in keys])
    hist.set_xlabel(f"runs of a schedule in {o['periods']:g} periods")
    hist.set_ylabel("schedules")
    hist.set_title("runs per schedule under overload")
    hist.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "scale_overload.png", dpi=110)
    plt.close(fig)
    return ["scale_overload.png"]


def main(argv: list[str] | None = None) -> None:
    args = bench_arguments("bench.scale", argv)
    sizes = QUICK if args.quick else Sizes()
    with ExitStack() as stack:
        results = asyncio.run(run(admin_dsn(stack), RESULTS / ".work" / "scale", sizes))
    results["plots"] = plots(results, args.out)
    save_results("scale", results, report, args.out)


if __name__ == "__main__":
    main()
