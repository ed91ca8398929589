"""Failover after SIGKILL and graceful handover after SIGTERM, with 3 real replicas.

    python -m bench.failover [--quick] [--out DIR]

Each mode gets a fresh database and three real processes: ``scheduler-daemon run --only
publish`` in session mode with waiting standbys (the default), session mode with polling
standbys, transaction mode (direct to PostgreSQL), SQLite (all three on one file, so one
flock), and the seed design (``bench/failover_seed.py``: try-lock, work, unlock, sleep
1 s). Settings are the defaults but ``publish.interval`` 1 s (default 5 s), the seed's
own interval; in transaction mode a replica that lost a tick retries after it.

**The work is continuous.** A feeder in this process keeps publications falling due
every ``PERIOD`` (10 ms), ``FEED_AHEAD`` seconds ahead, so the leader publishes about
every 10 ms (a server statement log of one run: 100 ticks a second, 40% of the time
inside a transaction) and is killed in the middle of that work, not while idle. A trial
waits a random 0.02-0.22 s (0.02-1.02 s where the survivors retry on a 1 s timer, so
that the kill lands at a random phase of it), takes the replica that published the
latest row (the leader; in transaction mode and for the seed, whichever replica worked
last), notes ``time.time()`` and sends it SIGKILL or SIGTERM. Two figures, from that
instant:

- **lock held elsewhere**: when the next leader held the lock, from the stamps it
  writes itself. Session mode: ``scheduler_leaders.acquired_at`` of another instance,
  ``now()`` of the claim transaction it opens on its lock connection as soon as
  ``pg_advisory_lock`` (or ``pg_try_advisory_lock``) returned: one round trip after the
  grant. Transaction mode: the first won transaction after the kill, whose
  ``leader_touch`` stamps ``heartbeat_at`` (and ``acquired_at`` when the instance
  changed) with its ``now()``, polled every ``POLL``; a later win can hide an earlier one,
  so the figure is capped by the first work, which proves the lock was held. SQLite: the
  row the new flock holder writes (``strftime('now')``, millisecond stamps). The seed:
  the ``clock_timestamp()`` of its ``pg_try_advisory_lock`` that succeeded.
- **work resumed**: the first ``published_at`` stamped by another replica after the
  kill (``clock_timestamp()`` in the row's UPDATE, before the commit).

**Which clock.** All stamps are the database's (PostgreSQL's ``now()`` /
``clock_timestamp()``, SQLite's ``strftime('now')`` in the daemon's process); the
database runs on this machine, so they read the same system clock as ``time.time()``
here. The offset is measured at the start of each mode (the sample with the shortest
round trip of 10) and recorded as ``clock_offset_ms``: microseconds.

**The floor.** "Lock held elsewhere" in session/wait mode is PostgreSQL noticing the
dead (or unlocking) session and granting the lock to the first waiter, plus one round
trip. "Work resumed" adds the new leader's start-up before its first row: its claim
transaction, after a SIGKILL the wait until the dead leader's sessions are gone
(``settled_in`` of its ``leader.acquired``, recorded as ``settled_ms``), opening its
LISTEN connection and a first tick whose statements are prepared for the first time on
that connection (``work_after_lock_ms_p50``). The work's own period adds at most 10 ms,
and only when the new leader is ready before the next row is due; the first row's
lateness (``first_row_late_ms`` per trial) tells: under one period it may have waited
(counted as ``period_bound``), otherwise the row waited for it. Polling standbys add up
to ``lock.poll_interval`` (1 s), transaction mode up to ``publish.interval`` (1 s here),
the seed up to its 1 s sleep: with two survivors, a third of that on average. In
transaction mode a SIGKILL inside a transaction leaves a fencing token that never
committed, and the next winner waits ``stop_grace`` + 0.5 s (1.5 s) before working
(``leader.settling``, counted as ``settling``).

After each trial the victim is reaped and a replacement started; the next trial begins
once it competes (its ``leader.waiting``; transaction mode ``loop.started``; the seed
``seed.ready``) and 0.05 s more, so there are always three and none is starting up
(a start takes most of a second of CPU on this 2-core machine) when the next is killed.
``--quick``: 3 trials per mode and signal, about a minute; the full run 30 (p99 of 30
is their maximum), about 9 minutes here: each trial waits about a second for its
replacement to start. The machine is shared and has two cores: compare modes within one
run (the load average is recorded).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from contextlib import ExitStack, closing
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import asyncpg

from bench.common import (
    RESULTS,
    ROOT,
    admin_dsn,
    bench_arguments,
    drop_database,
    fresh_database,
    percentile,
    save_results,
    start_daemon,
)

PERIOD = 0.010  # a publication falls due every 10 ms
FEED_AHEAD = 3.0  # seconds of rows kept scheduled ahead of now
INTERVAL = "1s"  # publish.interval for every mode (and the seed's fixed sleep)
REPLICAS = 3
TRIAL_TIMEOUT = 15.0
POLL = 0.005  # how often the observer looks; the figures come from database stamps
SEED_SCRIPT = ROOT / "bench" / "failover_seed.py"
SIGNALS = {"SIGKILL": signal.SIGKILL, "SIGTERM": signal.SIGTERM}
FIGURES = {"lock_ms": "lock held elsewhere", "work_ms": "work resumed"}
# Log events kept from the replicas' logs (the leader logs every tick at info level).
KEPT_EVENTS = {
    "leader.waiting", "leader.acquired", "leader.settling", "leader.lost", "leader.released",
    "loop.started", "loop.db_error", "tick.failed", "seed.ready", "seed.locked",
}  # fmt: skip
TARGETS = {  # the goals for session/wait (not asserts): (signal, figure) -> p99 ms
    ("SIGKILL", "lock_ms"): 50.0,
    ("SIGKILL", "work_ms"): 100.0,
    ("SIGTERM", "lock_ms"): 30.0,  # "handover"; work resumed after SIGTERM is shown beside it
}


@dataclass(frozen=True)
class Sizes:
    trials: int = 30  # per mode and signal


QUICK = Sizes(trials=3)


@dataclass(frozen=True)
class Mode:
    slug: str  # names the instances, the database and the work directory
    label: str
    backend: str  # "postgres", "sqlite" or "seed" (PostgreSQL, the baseline script)
    env: Mapping[str, str] = field(default_factory=dict)
    ready_event: str = "leader.waiting"  # logged once a new replica competes
    # The survivors retry on a 1 s timer (poll_interval, publish.interval, the seed's
    # sleep) whose phase is set when they start or lose: the kill must land at a random
    # phase of it, so the wait before a kill spreads over a whole second there.
    spread: float = 0.2


MODES = (
    Mode("wait", "session, standbys wait", "postgres", {"SCHEDULER_LOCK__STANDBY": "wait"}),
    Mode("poll", "session, standbys poll", "postgres", {"SCHEDULER_LOCK__STANDBY": "poll"},
         spread=1.0),
    Mode("xact", "transaction", "postgres", {"SCHEDULER_LOCK__MODE": "transaction"},
         ready_event="loop.started", spread=1.0),
    Mode("flock", "SQLite flock", "sqlite"),
    Mode("seed", "seed design (try, work, unlock, sleep 1 s)", "seed", ready_event="seed.ready",
         spread=1.0),
)  # fmt: skip


def epoch(stamp: str) -> float:
    """An ISO 8601 stamp (structlog's, SQLite's), as seconds since the epoch."""
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def iso(seconds: float) -> str:
    """Seconds since the epoch as the daemon's SQLite text format."""
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# -- the database, as the observer sees it --------------------------------------------


@dataclass(frozen=True)
class LeaderRow:
    instance: str
    acquired: float  # acquired_at, seconds since the epoch
    heartbeat: float  # heartbeat_at (transaction mode: every won transaction stamps it)


async def best_offset(clock: Callable[[], Awaitable[float]], samples: int = 10) -> float:
    """The other clock minus ours, from the sample with the shortest round trip."""
    best = (float("inf"), 0.0)
    for _ in range(samples):
        before = time.time()
        theirs = await clock()
        after = time.time()
        best = min(best, (after - before, theirs - (before + after) / 2))
    return best[1]


class Probe(Protocol):
    async def insert_due(self, first: float, count: int) -> None:
        """Rows due at first, first + PERIOD, ... (seconds since the epoch)."""
        ...

    async def latest_publisher(self) -> str | None: ...

    async def leader(self) -> LeaderRow | None:
        """The publish loop's scheduler_leaders row."""
        ...

    async def first_work(self, after: float, victim: str) -> tuple[str, float, float] | None:
        """(published_by, published_at, publish_at) of the first row published after
        `after` by anyone but `victim`."""
        ...

    async def clock_offset(self) -> float:
        """The database's clock minus ours, in seconds."""
        ...

    async def close(self) -> None: ...


class PgProbe:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool

    @classmethod
    async def open(cls, dsn: str) -> PgProbe:
        pool = await asyncpg.create_pool(
            dsn, min_size=2, max_size=3, server_settings={"application_name": "bench-observer"}
        )
        return cls(pool)

    async def insert_due(self, first: float, count: int) -> None:
        await self.pool.execute(
            "INSERT INTO scheduler_publications (payload, publish_at) "
            "SELECT '{}'::jsonb, to_timestamp($1::float8 + g * $2::float8) "
            "FROM generate_series(0, $3 - 1) g",
            first,
            PERIOD,
            count,
        )

    async def latest_publisher(self) -> str | None:
        result: str | None = await self.pool.fetchval(
            "SELECT published_by FROM scheduler_publications WHERE status <> 'scheduled' "
            "ORDER BY publish_at DESC LIMIT 1"
        )
        return result

    async def leader(self) -> LeaderRow | None:
        row = await self.pool.fetchrow(
            "SELECT instance, extract(epoch FROM acquired_at)::float8 AS acquired, "
            "extract(epoch FROM heartbeat_at)::float8 AS heartbeat "
            "FROM scheduler_leaders WHERE loop = 'publish'"
        )
        return None if row is None else LeaderRow(**row)

    async def first_work(self, after: float, victim: str) -> tuple[str, float, float] | None:
        row = await self.pool.fetchrow(
            "SELECT published_by, extract(epoch FROM published_at)::float8 AS done, "
            "extract(epoch FROM publish_at)::float8 AS due FROM scheduler_publications "
            "WHERE status <> 'scheduled' AND publish_at > to_timestamp($1::float8 - 30) "
            "AND published_at > to_timestamp($1::float8) AND published_by <> $2 "
            "ORDER BY published_at LIMIT 1",
            after,
            victim,
        )
        return None if row is None else (row["published_by"], row["done"], row["due"])

    async def clock_offset(self) -> float:
        async with self.pool.acquire() as conn:
            return await best_offset(
                lambda: conn.fetchval("SELECT extract(epoch FROM clock_timestamp())::float8")
            )

    async def close(self) -> None:
        await self.pool.close()


class SqliteProbe:
    """The same questions of the SQLite file (WAL: reading never blocks the leader)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _run(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        with closing(sqlite3.connect(self.path, timeout=10, isolation_level=None)) as db:
            return db.execute(sql, args).fetchall()

    async def _ask(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        return await asyncio.to_thread(self._run, sql, *args)

    async def insert_due(self, first: float, count: int) -> None:
        rows = [(iso(first + i * PERIOD),) for i in range(count)]

        def insert() -> None:
            with closing(sqlite3.connect(self.path, timeout=10)) as db, db:
                db.executemany(
                    "INSERT INTO scheduler_publications (payload, publish_at) VALUES ('{}', ?)",
                    rows,
                )

        await asyncio.to_thread(insert)

    async def latest_publisher(self) -> str | None:
        rows = await self._ask(
            "SELECT published_by FROM scheduler_publications WHERE status <> 'scheduled' "
            "ORDER BY publish_at DESC LIMIT 1"
        )
        return rows[0][0] if rows else None

    async def leader(self) -> LeaderRow | None:
        rows = await self._ask(
            "SELECT instance, acquired_at, heartbeat_at FROM scheduler_leaders "
            "WHERE loop = 'publish'"
        )
        return LeaderRow(rows[0][0], epoch(rows[0][1]), epoch(rows[0][2])) if rows else None

    async def first_work(self, after: float, victim: str) -> tuple[str, float, float] | None:
        rows = await self._ask(
            "SELECT published_by, published_at, publish_at FROM scheduler_publications "
            "WHERE status <> 'scheduled' AND publish_at > ? AND published_by <> ? "
            "AND julianday(published_at) > julianday(?) ORDER BY julianday(published_at) "
            "LIMIT 1",
            iso(after - 30),
            victim,
            iso(after),
        )
        if not rows:
            return None
        by, done, due = rows[0]
        return by, epoch(done), epoch(due)

    async def clock_offset(self) -> float:
        async def now() -> float:  # SQLite's clock, in milliseconds
            rows = await self._ask("SELECT strftime('%Y-%m-%dT%H:%M:%fZ', 'now')")
            return epoch(rows[0][0])

        return await best_offset(now)

    async def close(self) -> None:
        return None


async def feed(probe: Probe) -> None:
    """Keep rows falling due every PERIOD, FEED_AHEAD seconds ahead, until cancelled."""
    next_due = time.time() + 0.2
    while True:
        count = int((time.time() + FEED_AHEAD - next_due) / PERIOD)
        if count > 0:
            await probe.insert_due(next_due, count)
            next_due += count * PERIOD
        await asyncio.sleep(0.5)


# -- the replicas ---------------------------------------------------------------------


@dataclass
class Replica:
    name: str
    process: subprocess.Popen[bytes]
    log: Path
    offset: int = 0
    events: list[dict[str, Any]] = field(default_factory=list)

    def read(self) -> None:
        """Take in the log lines written since the last read (the events we keep)."""
        if not self.log.exists():
            return
        with self.log.open("rb") as file:
            file.seek(self.offset)
            data = file.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        for line in data[:end].splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and entry.get("event") in KEPT_EVENTS:
                self.events.append(entry)

    def seen(self, event: str, since: float = 0.0) -> list[dict[str, Any]]:
        self.read()
        return [e for e in self.events if e["event"] == event and event_time(e) >= since]


def event_time(entry: dict[str, Any]) -> float:
    if "timestamp" in entry:
        return epoch(entry["timestamp"])
    return float(entry.get("at", 0.0))  # the seed's lines carry the database's stamp


class Cluster:
    """Three replicas of one mode; replacements get the next number."""

    def __init__(self, mode: Mode, url: str, workdir: Path) -> None:
        self.mode = mode
        self.url = url
        self.workdir = workdir
        self.replicas: list[Replica] = []
        self.started = 0

    def spawn(self) -> Replica:
        self.started += 1
        name = f"{self.mode.slug}-{self.started}"
        workdir = self.workdir / name
        workdir.mkdir(parents=True, exist_ok=True)
        log = workdir / "daemon.log"
        if self.mode.backend == "seed":
            with log.open("ab") as output:
                process = subprocess.Popen(
                    [sys.executable, str(SEED_SCRIPT), self.url, name,
                     "--interval", INTERVAL.removesuffix("s")],
                    stdout=output, stderr=subprocess.STDOUT, cwd=workdir,
                )  # fmt: skip
        else:
            env = {**self.mode.env, "SCHEDULER_INSTANCE_ID": name, "SCHEDULER_LOG__LEVEL": "info"}
            process = start_daemon(self.url, workdir, interval=INTERVAL, only="publish", env=env)
        replica = Replica(name, process, log)
        self.replicas.append(replica)
        return replica

    async def ready(self, replica: Replica, within: float = 60.0) -> None:
        """Until the replica competes for the lock (then a short pause, so that its
        start-up is over before anyone is killed)."""
        deadline = time.monotonic() + within
        while not replica.seen(self.mode.ready_event):
            if replica.process.poll() is not None:
                raise RuntimeError(f"{replica.name} exited {replica.process.returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{replica.name}: no {self.mode.ready_event} in {within}s")
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.05)

    async def start(self, probe: Probe) -> None:
        """The first replica, until it publishes (so it is the leader), then the rest."""
        first = self.spawn()
        await self.ready(first)
        deadline = time.monotonic() + 30
        while await probe.latest_publisher() != first.name:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{first.name} never published")
            await asyncio.sleep(0.05)
        rest = [self.spawn() for _ in range(REPLICAS - 1)]
        await asyncio.gather(*(self.ready(replica) for replica in rest))

    def find(self, name: str | None) -> Replica | None:
        return next((r for r in self.replicas if r.name == name), None)

    def stop(self) -> None:
        for replica in self.replicas:
            if replica.process.poll() is None:
                replica.process.send_signal(signal.SIGTERM)
        for replica in self.replicas:
            try:
                replica.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                replica.process.kill()
                replica.process.wait()


# -- one trial ------------------------------------------------------------------------


async def lock_elsewhere(
    cluster: Cluster, probe: Probe, victim: Replica, killed_at: float
) -> tuple[str, float] | None:
    """(successor, when it held the lock) once known, else None."""
    if cluster.mode.backend == "seed":
        found = [
            (event_time(e), r.name)
            for r in cluster.replicas
            if r is not victim
            for e in r.seen("seed.locked", since=killed_at)
        ]
        if not found:
            return None
        at, name = min(found)
        return name, at
    row = await probe.leader()
    if row is None or row.instance == victim.name:
        return None
    if cluster.mode.env.get("SCHEDULER_LOCK__MODE") != "transaction":
        return row.instance, row.acquired
    # Every transaction that wins the lock stamps heartbeat_at (acquired_at only when the
    # instance changes): the first stamp after the kill is the first win after it.
    stamp = row.acquired if row.acquired >= killed_at else row.heartbeat
    return (row.instance, stamp) if stamp >= killed_at else None


async def trial(cluster: Cluster, probe: Probe, signame: str, rng: random.Random) -> dict[str, Any]:
    await asyncio.sleep(rng.uniform(0.02, 0.02 + cluster.mode.spread))
    deadline = time.monotonic() + 10
    while (victim := cluster.find(await probe.latest_publisher())) is None:
        if time.monotonic() > deadline:
            raise TimeoutError("no live replica published anything for 10 s")
        await asyncio.sleep(POLL)
    killed_at = time.time()
    victim.process.send_signal(SIGNALS[signame])
    lock: tuple[str, float] | None = None
    work: tuple[str, float, float] | None = None
    while lock is None or work is None:
        if time.time() - killed_at > TRIAL_TIMEOUT:
            break
        if lock is None:
            lock = await lock_elsewhere(cluster, probe, victim, killed_at)
        if work is None:
            work = await probe.first_work(killed_at, victim.name)
        await asyncio.sleep(POLL)
    if lock is not None and work is not None and lock[1] > work[1]:
        # Transaction mode: the row shows the latest win, which may hide an earlier one
        # (polled every POLL); the first work proves the lock was held by then.
        lock = (work[0], work[1])
    exit_code = await asyncio.to_thread(victim.process.wait, 60)
    cluster.replicas.remove(victim)
    result: dict[str, Any] = {
        "victim": victim.name,
        "exit_code": exit_code,
        "successor": lock[0] if lock else None,
        "lock_ms": (lock[1] - killed_at) * 1000 if lock else None,
        "work_ms": (work[1] - killed_at) * 1000 if work else None,
        "first_worker": work[0] if work else None,
        "first_row_late_ms": (work[1] - work[2]) * 1000 if work else None,
    }
    successor = cluster.find(result["successor"])
    if successor is not None:
        acquired = successor.seen("leader.acquired", since=killed_at)
        if acquired and "settled_in" in acquired[0]:
            result["settled_ms"] = acquired[0]["settled_in"] * 1000
            result["predecessor_alive"] = acquired[0]["predecessor_alive"]
    result["settling"] = any(r.seen("leader.settling", since=killed_at) for r in cluster.replicas)
    result["errors"] = sum(
        len(r.seen(event, since=killed_at))
        for r in cluster.replicas
        for event in ("loop.db_error", "tick.failed")
    )
    await cluster.ready(cluster.spawn())
    return result


def summarise(trials: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {"trials": len(trials)}
    for key in FIGURES:
        values = [t[key] for t in trials if t[key] is not None]
        summary[key] = (
            {
                "p50": percentile(values, 0.5),
                "p95": percentile(values, 0.95),
                "p99": percentile(values, 0.99),
                "max": max(values),
            }
            if values
            else None
        )
        summary[f"{key}_missing"] = len(trials) - len(values)
    gaps = [
        t["work_ms"] - t["lock_ms"]
        for t in trials
        if t["work_ms"] is not None and t["lock_ms"] is not None
    ]
    summary["work_after_lock_ms_p50"] = percentile(gaps, 0.5) if gaps else None
    # The first row was due less than one PERIOD before it was published: the new leader
    # may have waited for it, so the work's period may have added to "work resumed".
    summary["period_bound"] = sum(
        t["first_row_late_ms"] is not None and t["first_row_late_ms"] < PERIOD * 1000
        for t in trials
    )
    summary["settling"] = sum(bool(t.get("settling")) for t in trials)
    settled = [t["settled_ms"] for t in trials if "settled_ms" in t]
    summary["settled_ms_p50"] = percentile(settled, 0.5) if settled else None
    summary["errors"] = sum(t["errors"] for t in trials)
    summary["exit_codes"] = sorted({t["exit_code"] for t in trials})
    return summary


# -- one mode -------------------------------------------------------------------------


async def open_backend(mode: Mode, admin: str, workdir: Path) -> tuple[str, Probe, str | None]:
    """(database URL, probe, PostgreSQL database to drop afterwards)."""
    if mode.backend == "sqlite":
        path = workdir / "failover.db"
        url = f"sqlite:///{path}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("SCHEDULER_")}
        env["SCHEDULER_DATABASE_URL"] = url
        migrated = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "scheduler_daemon", "migrate"],
            env=env, capture_output=True, cwd=workdir,
        )  # fmt: skip
        if migrated.returncode != 0:
            raise RuntimeError(f"migrate: {migrated.stderr.decode()[-2000:]}")
        return url, SqliteProbe(path), None
    name = f"bench_failover_{mode.slug}"
    dsn = await fresh_database(admin, name)
    return dsn, await PgProbe.open(dsn), name


async def run_mode(
    mode: Mode, admin: str, workdir: Path, sizes: Sizes, rng: random.Random
) -> dict[str, Any]:
    await asyncio.to_thread(workdir.mkdir, parents=True, exist_ok=True)
    url, probe, database = await open_backend(mode, admin, workdir)
    started = time.monotonic()
    feeder = asyncio.create_task(feed(probe))
    cluster = Cluster(mode, url, workdir)
    results: dict[str, Any] = {"label": mode.label, "backend": mode.backend, "env": dict(mode.env)}
    results["load_before"] = os.getloadavg()[0]
    try:
        results["clock_offset_ms"] = await probe.clock_offset() * 1000
        await cluster.start(probe)
        for signame in SIGNALS:
            trials: list[dict[str, Any]] = []
            for _ in range(sizes.trials):
                trials.append(await trial(cluster, probe, signame, rng))
                if sum(t["work_ms"] is None for t in trials) >= 3:
                    break  # something is broken: say so rather than wait on
            results[signame] = {"summary": summarise(trials), "trials": trials}
            print(f"bench.failover: {mode.label}, {signame}: {format_summary(results[signame])}",
                  flush=True)  # fmt: skip
    finally:
        feeder.cancel()
        await asyncio.to_thread(cluster.stop)
        await probe.close()
        if database is not None:
            await drop_database(admin, database, grace=0)
    results["seconds"] = time.monotonic() - started
    results["load_after"] = os.getloadavg()[0]
    return results


def format_summary(entry: dict[str, Any]) -> str:
    s = entry["summary"]
    parts = []
    for key, label in FIGURES.items():
        f = s[key]
        parts.append(
            f"{label} " + ("n/a" if f is None else f"p50 {f['p50']:.1f} p99 {f['p99']:.1f} ms")
        )
    return "; ".join(parts)


async def run(admin: str, workdir: Path, sizes: Sizes, modes: tuple[Mode, ...]) -> dict[str, Any]:
    shutil.rmtree(workdir, ignore_errors=True)
    rng = random.Random(12)
    results: dict[str, Any] = {
        "trials_per_signal": sizes.trials,
        "replicas": REPLICAS,
        "period_ms": PERIOD * 1000,
        "publish_interval": INTERVAL,
        "modes": {},
    }
    for mode in modes:
        results["modes"][mode.slug] = await run_mode(mode, admin, workdir / mode.slug, sizes, rng)
    return results


# -- the report -----------------------------------------------------------------------


def ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def report(results: dict[str, Any]) -> str:
    offsets = [m["clock_offset_ms"] for m in results["modes"].values()]
    loads = [m[k] for m in results["modes"].values() for k in ("load_before", "load_after")]
    lines = [
        f"# Failover and handover ({results['date']}, {results['machine']})",
        "",
        f"{results['replicas']} real replicas per mode, {results['trials_per_signal']} trials "
        "per mode and signal, a replacement started after each one. Publications fall due "
        f"every {results['period_ms']:g} ms, so the leader works all the time (in session "
        "mode about 40% of it inside a transaction) and the signal lands mid-work. Times in ms from the signal "
        "(`time.time()` just before `kill`) to **lock**: the next leader's "
        "`scheduler_leaders.acquired_at` (`now()` of its claim transaction, right after the "
        "grant; transaction mode: of its first won transaction; seed: `clock_timestamp()` of "
        "its successful `pg_try_advisory_lock`), and to **work**: the first `published_at` "
        "stamped by another replica. Database stamps, on this machine's clock: offset to "
        f"`time.time()` measured at most {max(abs(o) for o in offsets):.2f} ms. "
        "`publish.interval` 1 s, everything else default (poll mode: `lock.poll_interval` "
        "1 s). The seed design: 3 processes doing try-lock, publish the due rows, unlock, "
        "sleep 1 s (bench/failover_seed.py). Method and notes: bench/failover.py. The "
        "machine is shared: 1-minute load average "
        f"{min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} cores during the run.",
        "",
        "| mode | signal | lock p50 | p95 | p99 | max | work p50 | p95 | p99 | max | notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode in results["modes"].values():
        for signame in SIGNALS:
            if signame not in mode:
                continue
            s = mode[signame]["summary"]
            cells = []
            for key in FIGURES:
                f = s[key] or {}
                cells += [ms(f.get(q)) for q in ("p50", "p95", "p99", "max")]
            lines.append(
                f"| {mode['label']} | {signame} | " + " | ".join(cells) + f" | {notes(s)} |"
            )
    lines += [
        "",
        "Notes: *work N ms after lock*: the new leader's own start-up before its first row "
        "(median). *period-bound*: trials whose first row was due less than one period "
        "before it was published, where waiting for the row may have added up to "
        f"{results['period_ms']:g} ms. *settling*: a transaction-mode winner found a fencing "
        "token missing (the victim died inside a transaction) and waited `stop_grace` + 0.5 s "
        "before working. *settle*: session mode after SIGKILL, the new leader's wait until "
        "none of the dead leader's sessions is left. *exit*: the victims' exit statuses "
        "(-9 SIGKILL; 0 a clean stop; the seed has no SIGTERM handler, -15). "
        f"p99 of {results['trials_per_signal']} trials is their maximum.",
        "",
        *targets(results),
        "",
    ]
    return "\n".join(lines)


def notes(s: dict[str, Any]) -> str:
    out = [f"n={s['trials']}"]
    for key in FIGURES:
        if s[f"{key}_missing"]:
            out.append(f"{s[f'{key}_missing']} without {key.removesuffix('_ms')}")
    if s["work_after_lock_ms_p50"] is not None:
        out.append(f"work {s['work_after_lock_ms_p50']:.0f} ms after lock (p50)")
    if s["period_bound"]:
        out.append(f"{s['period_bound']} period-bound")
    if s["settling"]:
        out.append(f"{s['settling']} settling")
    if s["settled_ms_p50"] is not None:
        out.append(f"settle p50 {s['settled_ms_p50']:.0f} ms")
    if s["errors"]:
        out.append(f"{s['errors']} errors logged")
    out.append("exit " + "/".join(str(c) for c in s["exit_codes"]))
    return ", ".join(out)


def targets(results: dict[str, Any]) -> list[str]:
    wait = results["modes"].get("wait")
    if wait is None:
        return []
    out = ["Targets (issue 12, session/wait, p99):"]
    for (signame, key), limit in TARGETS.items():
        figure = wait.get(signame, {}).get("summary", {}).get(key)
        if figure is None:
            continue
        verdict = "met" if figure["p99"] < limit else "NOT met"
        out.append(
            f"- {signame} → {FIGURES[key]} < {limit:g} ms: {figure['p99']:.1f} ms, {verdict}"
        )
    figure = wait.get("SIGTERM", {}).get("summary", {}).get("work_ms")
    if figure is not None:
        out.append(f"- SIGTERM → work resumed (no target): {figure['p99']:.1f} ms")
    return out


def plot(results: dict[str, Any], out: Path) -> list[Path]:
    """One PNG per signal: box and points of both figures per mode, log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    modes = list(results["modes"].values())
    jitter = random.Random(1)
    for signame in SIGNALS:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
        for ax, (key, label) in zip(axes, FIGURES.items(), strict=True):
            data = [
                [max(t[key], 0.1) for t in m[signame]["trials"] if t[key] is not None]
                if signame in m
                else []
                for m in modes
            ]
            positions = range(1, len(modes) + 1)
            ax.boxplot([d or [float("nan")] for d in data], positions=list(positions),
                       widths=0.5, showfliers=False)  # fmt: skip
            for x, values in zip(positions, data, strict=True):
                xs = [x + jitter.uniform(-0.15, 0.15) for _ in values]
                ax.scatter(xs, values, s=10, alpha=0.6)
            ax.set_yscale("log")
            ax.set_title(f"{signame} → {label}")
            ax.set_xticks(list(positions))
            ax.set_xticklabels([m["label"].split(" (")[0] for m in modes], rotation=20)
            ax.grid(axis="y", which="both", alpha=0.3)
        axes[0].set_ylabel("ms after the signal (log scale)")
        fig.suptitle(
            f"{results['replicas']} replicas, {results['trials_per_signal']} trials per mode; "
            f"{results['machine']}"
        )
        fig.tight_layout()
        path = out / f"failover_{signame.lower()}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> None:
    args = bench_arguments("bench.failover", argv)
    sizes = QUICK if args.quick else Sizes()
    with ExitStack() as stack:
        results = asyncio.run(run(admin_dsn(stack), RESULTS / ".work" / "failover", sizes, MODES))
    save_results("failover", results, report, args.out)
    for path in plot(results, args.out):
        print(f"bench.failover: wrote {path}")


if __name__ == "__main__":
    main()
