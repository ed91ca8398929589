"""Observing leadership from inside the guarded work, and proving no two leaders overlapped.

The probe is a plugin SQL task: it runs in the leader's fenced transaction (on the lock
connection in session mode, on a pooled connection holding the transaction lock in
transaction mode), so a row in ``tick_log`` exists only if the transaction that ran the
work committed, that is, only if its replica still held the lock at commit. Each row is
one interval ``[started, ended]`` of database time, stamped with the server's
``clock_timestamp()``, and tagged with the application_name of the session, which names
the instance (``scheduler-daemon/<instance>/lock:plugin``).

SQLite serialises every write transaction on the file, so an SQL probe there could never
show an overlap; :func:`python_probe_env` runs a Python target instead, which records
wall-clock intervals to a file outside any transaction (the probe of ``rig.effects``).

:func:`assert_no_overlap` is what every leadership test asks of its ticks: the one rule of
``rig.overlap``, with every tick its own holder (a loop's ticks never intersect, one
instance's included: that would be a re-entrant tick). It refuses data that proves nothing
(too few ticks, too few instances).
"""

from __future__ import annotations

import json
import signal
import sqlite3
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from contextlib import closing
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import asyncpg

from rig.databases import RIG_APP, run_sync
from rig.overlap import find_overlaps
from rig.processes import DaemonProcess
from rig.waiting import wait_until

PROBE_TASK = "probe"

TICK_LOG_DDL = """
CREATE TABLE tick_log (
    id       bigserial PRIMARY KEY,
    instance text NOT NULL,
    started  timestamptz NOT NULL,
    ended    timestamptz
)
"""

TICK_LOG_DDL_SQLITE = """
CREATE TABLE tick_log (
    id       integer PRIMARY KEY AUTOINCREMENT,
    instance text NOT NULL,
    started  text NOT NULL,
    ended    text
)
"""


def pg_probe_sql(sleep: float = 0.05, instance: str | None = None) -> str:
    """Insert a row, hold the work open for `sleep` seconds, close the row: one transaction.

    The row names the session's application_name, unless `instance` is given (behind
    PgBouncer the server session's application_name is not the client's).
    """
    who = "current_setting('application_name')" if instance is None else f"'{instance}'"
    return (
        "INSERT INTO tick_log (instance, started) "
        f"VALUES ({who}, clock_timestamp()); "
        f"SELECT pg_sleep({sleep}); "
        "UPDATE tick_log SET ended = clock_timestamp() WHERE id = currval('tick_log_id_seq')"
    )


SQLITE_PROBE_SQL = (
    "INSERT INTO tick_log (instance, started, ended) VALUES ('sqlite', "
    "strftime('%Y-%m-%dT%H:%M:%fZ','now'), strftime('%Y-%m-%dT%H:%M:%fZ','now'))"
)


def probe_env(sql: str, every: str = "0.2s", name: str = PROBE_TASK) -> dict[str, str]:
    """The plugin loop, ticking every 0.1 s, with one SQL probe task."""
    tasks = [{"name": name, "every": every, "sql": sql, "timeout": "10s"}]
    return {
        "SCHEDULER_PLUGIN__INTERVAL": "0.1",
        "SCHEDULER_PLUGIN__TASKS": json.dumps(tasks),
    }


def python_probe_env(log_file: Path, every: str = "0.2s", sleep: float = 0.05) -> dict[str, str]:
    """The plugin loop with a Python probe: the async target of
    ``scheduler_sample_plugin.effects``, working `sleep` seconds and writing wall-clock
    records to `log_file` (read back with :func:`python_ticks`)."""
    from rig.effects import EFFECTS_TARGETS, effects_env

    tasks = [{"name": PROBE_TASK, "every": every, "target": EFFECTS_TARGETS["async"]}]
    return {
        "SCHEDULER_PLUGIN__INTERVAL": "0.1",
        "SCHEDULER_PLUGIN__TASKS": json.dumps(tasks),
        **effects_env(log_file, sleep),
    }


# Timings short enough for a test and valid for config.py: the leader decides to step down
# within 2 x 0.5 = 1 s and its work has stopped 0.5 s (stop_grace) later; + 1 s margin =
# 2.5 s <= 3 s, the earliest the server can free a cut-off leader's lock (min(tcp_user_timeout
# 4, max(interval 1, 4 - max(idle 1, interval 1)), interval 1 x count 3)), and <= 3 s
# (stall_timeout).
FAST_TIMINGS: Mapping[str, str] = {
    "SCHEDULER_LOCK__HEARTBEAT_INTERVAL": "0.5",
    "SCHEDULER_LOCK__STOP_GRACE": "0.5",
    "SCHEDULER_LOCK__STALL_TIMEOUT": "3",
    "SCHEDULER_LOCK__KEEPALIVE_IDLE": "1",
    "SCHEDULER_LOCK__KEEPALIVE_INTERVAL": "1",
    "SCHEDULER_LOCK__KEEPALIVE_COUNT": "3",
    "SCHEDULER_LOCK__TCP_USER_TIMEOUT": "4",
    "SCHEDULER_SHUTDOWN_TIMEOUT": "5",
    "SCHEDULER_DATABASE__CONNECT_TIMEOUT": "2",
}


@dataclass(frozen=True, slots=True)
class Interval:
    loop: str
    instance: str
    start: float  # seconds since the epoch
    end: float


def instance_of(application_name: str) -> str:
    """``scheduler-daemon/<instance>/<purpose>`` -> ``<instance>``."""
    parts = application_name.split("/")
    return "/".join(parts[1:-1]) if len(parts) >= 3 else application_name


def assert_no_overlap(
    intervals: Iterable[Interval], *, min_ticks: int, min_instances: int = 1
) -> dict[str, dict[str, int]]:
    """Fail if two intervals of one loop intersect by the rule of ``rig.overlap``, whoever
    ran them (the same instance twice would be a re-entrant tick). Also fail on data that
    proves nothing: fewer than `min_ticks` intervals or `min_instances` distinct instances
    in a loop, or no loop.

    Returns ``{loop: {instance: ticks}}`` for the caller to print or check further.
    """
    intervals = list(intervals)
    assert intervals, "no intervals at all: the probe never ran, so nothing was checked"
    problems = [
        f"loop {o.scope}: {o.earlier.instance} ran [{stamp(o.earlier.start)}, "
        f"{stamp(o.earlier.end)}] and {o.later.instance} started at {stamp(o.later.start)}, "
        f"{o.earlier.end - o.later.start:.3f}s before that ended: "
        + ("two leaders at once" if o.earlier.instance != o.later.instance
           else "two ticks of one instance at once (a re-entrant tick)")
        for o in find_overlaps(intervals, scope=lambda i: i.loop)
    ]  # fmt: skip
    assert not problems, "\n  ".join(["", *problems])
    by_loop: dict[str, list[str]] = defaultdict(list)
    for interval in intervals:
        by_loop[interval.loop].append(interval.instance)
    return {
        loop: assert_enough(loop, instances, min_ticks, min_instances)
        for loop, instances in by_loop.items()
    }


def assert_enough(
    loop: str, instances: list[str], minimum: int, min_instances: int, what: str = "ticks"
) -> dict[str, int]:
    """Refuse data that proves nothing: fewer than `minimum` intervals, or fewer distinct
    instances than `min_instances`. Returns the count per instance."""
    counts: dict[str, int] = defaultdict(int)
    for instance in instances:
        counts[instance] += 1
    assert len(instances) >= minimum, (
        f"loop {loop}: only {len(instances)} {what} (< {minimum}): too little to prove exclusion"
    )
    assert len(counts) >= min_instances, (
        f"loop {loop}: {what} by {dict(counts)}, expected >= {min_instances} instances"
    )
    return dict(counts)


def stamp(epoch: float) -> str:
    """Seconds since the epoch as local ``HH:MM:SS.ffffff``, for messages."""
    return datetime.fromtimestamp(epoch).strftime("%H:%M:%S.%f")


# -- reading the probes back ------------------------------------------------------------


async def create_tick_log(dsn: str) -> None:
    conn = await asyncpg.connect(dsn, server_settings=RIG_APP)
    try:
        await conn.execute(TICK_LOG_DDL)
    finally:
        await conn.close()


async def pg_ticks(dsn: str, loop: str = "plugin") -> list[Interval]:
    """The committed probe rows. A row without ``ended`` cannot exist: the probe closes its
    row in the transaction that opened it. Any such row fails the test here."""
    conn = await asyncpg.connect(dsn, server_settings=RIG_APP)
    try:
        rows = await conn.fetch(
            "SELECT id, instance, extract(epoch FROM started)::float8 AS s, "
            "extract(epoch FROM ended)::float8 AS e FROM tick_log ORDER BY id"
        )
    finally:
        await conn.close()
    open_rows = [row["id"] for row in rows if row["e"] is None]
    assert not open_rows, f"committed probe rows without an end: {open_rows}"
    return [Interval(loop, instance_of(row["instance"]), row["s"], row["e"]) for row in rows]


def create_sqlite_tick_log(path: Path) -> None:
    with closing(sqlite3.connect(path)) as conn, conn:
        conn.execute(TICK_LOG_DDL_SQLITE)


def sqlite_tick_count(path: Path) -> int:
    with closing(sqlite3.connect(path)) as conn:
        count: int = conn.execute("SELECT count(*) FROM tick_log").fetchone()[0]
        return count


def python_ticks(log_file: Path, loop: str = "plugin") -> list[Interval]:
    """The runs of the Python probe (see :func:`python_probe_env`), as intervals."""
    from rig.effects import read_effects

    return [Interval(loop, run.instance, run.start, run.end) for run in read_effects(log_file)]


def wait_for_ticks(
    source: str | Path,
    count: int,
    *,
    instance: str | None = None,
    since: float = 0.0,
    timeout: float = 30.0,
) -> list[Interval]:
    """Wait until the probe has recorded `count` ticks (by `instance`, if named) begun at or
    after `since` (seconds since the epoch); return every tick recorded by then.

    `source` is where the probe writes: a PostgreSQL URL (the SQL probe's committed
    ``tick_log`` rows) or a path (the Python probe's log file). What a test observes is
    then a number of ticks, however busy the machine, rather than however many fit into a
    fixed sleep.
    """
    assert count >= 1, count

    def enough() -> list[Interval] | None:
        ticks = run_sync(pg_ticks(source)) if isinstance(source, str) else python_ticks(source)
        mine = [t for t in ticks if t.start >= since and instance in (None, t.instance)]
        return ticks if len(mine) >= count else None

    who = f" by {instance}" if instance else ""
    ticks: list[Interval] = wait_until(
        enough, timeout, f"{count} probe ticks{who} since {stamp(since)}", every=0.1
    )
    return ticks


# -- log events -------------------------------------------------------------------------


def event_time(entry: Mapping[str, Any]) -> float:
    """A log line's timestamp (structlog ISO 8601, UTC), as seconds since the epoch."""
    stamp = str(entry["timestamp"]).replace("Z", "+00:00")
    return datetime.fromisoformat(stamp).timestamp()


def wait_for_event(
    process: DaemonProcess,
    event: str,
    *,
    after: float = 0.0,
    timeout: float = 30.0,
    where: Callable[[Mapping[str, Any]], bool] = lambda entry: True,
    **fields: Any,
) -> dict[str, Any]:
    """The first log line `event` with `fields`, logged at or after epoch time `after`.

    ``DaemonProcess.wait_for_log`` returns the first match ever; failover tests need
    "the next one since X".
    """
    deadline = time.monotonic() + timeout
    while True:
        exited = process.poll() is not None
        for entry in process.log_events():
            if (
                entry.get("event") == event
                and all(entry.get(key) == value for key, value in fields.items())
                and event_time(entry) >= after
                and where(entry)
            ):
                return entry
        if exited or time.monotonic() >= deadline:
            raise AssertionError(
                process.summary(f"no {event!r} {fields} after {stamp(after)} within {timeout}s")
            )
        time.sleep(0.02)


def first_leader(
    processes: Iterable[DaemonProcess], loop: str = "plugin", timeout: float = 30.0
) -> DaemonProcess:
    """The process that logged ``leader.acquired`` for `loop` first (waits for one)."""
    candidates = list(processes)
    deadline = time.monotonic() + timeout
    while True:
        acquired = []
        for process in candidates:
            for entry in process.log_events():
                if entry.get("event") == "leader.acquired" and entry.get("loop") == loop:
                    acquired.append((event_time(entry), process))
                    break
        if acquired:
            return min(acquired, key=lambda pair: pair[0])[1]
        dead = [p for p in candidates if p.poll() is not None]
        if dead or time.monotonic() >= deadline:
            reports = "\n".join(
                f"--- {p.name} ---\n" + "\n".join(p.output().splitlines()[-15:]) for p in candidates
            )
            raise AssertionError(f"no leader for {loop} within {timeout}s\n{reports}")
        time.sleep(0.02)


PLUGIN_ONLY = ("run", "--only", "plugin")


def pg_env(url: str, instance: str, sleep: float = 0.05, **extra: str) -> dict[str, str]:
    """A replica on PostgreSQL with the fast timings and the tick probe."""
    return {
        "SCHEDULER_DATABASE_URL": url,
        "SCHEDULER_INSTANCE_ID": instance,
        **FAST_TIMINGS,
        **probe_env(pg_probe_sql(sleep)),
        **extra,
    }


def stop_all(processes: list[DaemonProcess]) -> None:
    """SIGTERM everyone still running, then require a clean exit (0) from each."""
    running = [p for p in processes if p.poll() is None]
    for process in running:
        process.signal(signal.SIGTERM)
    for process in running:
        assert process.wait(30) == 0, process.output()[-3000:]
