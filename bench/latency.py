"""A leader across a real network: what round-trip time to PostgreSQL costs the work.

Per RTT case (0, 2, 10, 40 ms by default): a fresh database on a throwaway, durable
cluster listening on the host's end of the rig's links (tests/rig/netns.py), and three
replicas, real `scheduler-daemon run` processes (both loops, `database.pool_max_size`
10), each in a network namespace of its own: every connection crosses its link, which
delays each direction by RTT/2 (`Namespaces.impair`: a process holding the packets in a
netfilter queue, this kernel has no netem; at RTT 0 there is no such process).

The workload, all at once from T0; a WARMUP is left out, then the window is measured:

- **async**: 1,000 runtime schedules every 10 s (`add_schedule_in`), slots spread over
  the period, of `growth_tasks:probe` (bench/ on PYTHONPATH): it notes the wall clock as
  it is called, awaits 1 ms and appends one line to a file, outside the database.
  Lateness = that start - slot (one clock: the namespaces share the host's, and the
  database runs on it). Not run: the window's slots without a line GRACE after it;
  duplicates: a (schedule, slot) with two lines.
- **sql**: 20 declared `sql` tasks every 1 s (`SCHEDULER_PLUGIN__TASKS`), spread over the
  second by `jitter = 1s` (declared together they would share one phase). Each inserts
  its slot, read from its own `running` row of scheduler_plugin_runs (committed by the
  claim before the run starts; one per schedule at a time), with `now()` of its
  transaction into a table of the bench's: lateness = now() - slot.
- **publications**: one every 50 ms, `schedule_in` with `publish_at` = now + 1 s, each in
  its own transaction as an application would; `notify` publishes them: lateness =
  published_at - publish_at.

RTT measured: the median of 20 `SELECT 1` (asyncpg) from inside namespace 0, before the
workload and after the window (under load). The machine has 2 cores: the probe appends
one line per run, results are read after the window, and the CPU of the replicas and of
the delay processes is recorded (100% = one core).

**SIGKILL of the leader** (issue 31: "at RTT 10 ms, the next slot on time, 0
duplicates"): one more case, at RTT 10 ms by default, the same setup and workload on a
fresh database. KILL_LEAD s into its window (20 s; less if the window is shorter, so that
every schedule's next slot, within PERIOD of the kill, still falls in it), the bench reads
the plugin loop's leader from `scheduler_leaders` (and the publish loop's: usually the
same replica, then both loops fail over), checks that the pid there is the process it
started under that name, notes `time.time()` and sends that process SIGKILL. Measured
from the work's own records, per workload (async: the probes' lines; sql: its rows, each
with the instance that claimed its run; publications: published_at, published_by, and
the `notify` messages a listener of the bench's hears):

- *resumed*: from the kill to the first run another replica started (the takeover);
  beside it, when the successors held the locks (`scheduler_leaders.acquired_at`);
- lateness before the kill; in the *takeover window* (the slots due from the kill until
  that first run, with those due before the kill that the victim had not started); after
  it; and of each schedule's *next slot* (its first slot after the kill), p99 and max;
- *not run*: slots due after the kill with no run GRACE after the window (must be 0:
  every one still runs once); apart, *in flight*: slots due before the kill that the
  victim had claimed and died before recording (a slot runs at most once: the successor
  marks the run abandoned, it is not run again; counted in the database too);
- *duplicates*: a (schedule, slot) run twice, over the whole case (publications: a row
  published twice, or a `notify` heard twice); *overlap*: runs of another replica begun
  before the kill (the victim's end at the kill at the latest: SIGKILL).

What "on time" can mean here. SIGKILL closes the process's sockets at once, so no timeout
is involved: each FIN reaches the server RTT/2 later, the backend of the leader's lock
session (idle between heartbeats) reads the end and exits, and PostgreSQL frees its
session advisory lock. The standbys do not poll (`lock.standby = "wait"`, the default;
"poll" would add up to `lock.poll_interval`, 1 s): each waits in `pg_advisory_lock` (in
slices of LOCK_WAIT_SLICE_MS, re-entered inside the server: no gap a client could see),
so one is granted the lock at once and hears so RTT/2 later. TCP keepalive,
`tcp_user_timeout` and `lock.stall_timeout` play no part: they bound a leader cut off or
frozen, whose sockets stay open. Then comes the successor's start-up, in round trips (a
statement new to its connection takes two: asyncpg prepares it): its claim (fencing
token, `scheduler_leaders` row); the wait until none of the dead leader's sessions is
left (leadership/postgres_session.py, `wait_for_predecessor`: one or two looks, as they
all closed together); its LISTEN connection and pooled connections opened; a first tick
that takes over (declares the tasks, marks the victim's runs abandoned) before it reads
and claims what is due. Smoke runs here: the lock held elsewhere 40-80 ms after the kill,
the first run 0.32 s after it at RTT 0 and 0.68 s at 10 ms, i.e. about 0.3 s of the
successor's own work (both loops take over at once, on two cores) and some 35 round
trips. So the slots due in that window (at 10 ms about 7% of the 1,000 next slots, hence
their p99) run up to the takeover late, all claimed by that first tick; the slots after
it run at about the usual lateness. The bound, when a session of the victim was caught
mid-statement (a standby's wait for the other loop's lock, a fenced statement on the
pool): the server notices it within `client_connection_check_interval` (1 s, set on those
sessions) instead, and the successor waits for such a session at most `settle_time` =
`lock.stop_grace` + 2 x KILL_WAIT (1.5 s by default) before it works anyway.

    python -m bench.latency [--quick] [--out DIR] [--rtts 0,2,10,40] [--seconds N]
                            [--kill-rtt 10] [--kill-seconds N] [--no-kill | --kill-only]

--seconds: the measured window of each case, after the warm-up (default 30; --quick:
RTTs 0 and 10, 10 s). --kill-seconds: the SIGKILL case's (default 20, the kill 5 s in;
--quick 12, the kill 1 s in). The full run takes about 5 minutes here, the SIGKILL case
alone about 50 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import ExitStack, asynccontextmanager, suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg

from bench.common import (
    DURABLE,
    RESULTS,
    ROOT,
    PgCluster,
    drop_database,
    find_pg_bindir,
    fresh_database,
    netns,
    save_results,
    start_daemon,
)
from bench.growth import code_version, fmt_s, log_tail, summary
from bench.scale import stop_all
from scheduler_daemon.client import add_schedule_in, schedule_in
from scheduler_daemon.config.settings import NotifyPublisherSettings

REPLICAS = 3
SCHEDULES = 1_000
PERIOD = 10.0  # s, each runtime schedule
SQL_TASKS = 20  # every 1 s
PUBLICATIONS = 20  # a second
WARMUP = 10.0  # s from T0 not measured: start-up, NOTIFY pickup, first slots
LEAD = 2.0  # s at least from the first add to T0: adding 1,000 takes about 0.5 s here
GRACE = 5.0  # s after the window before reading: late runs still count
PROBE = "growth_tasks:probe"
KILL_RTT = 10.0  # ms: where issue 31 sets the SIGKILL target
KILL_SECONDS = 20.0  # s measured in the kill case: KILL_LEAD before the kill, 15 after
QUICK_KILL_SECONDS = 12.0  # 1 s before, 11 after: still every schedule's next slot
KILL_LEAD = 5.0  # s of steady state measured before the kill
DB = "bench_latency"
SQL = (
    "INSERT INTO bench_latency_sql SELECT name, slot, now() FROM scheduler_plugin_runs "
    "WHERE name = '{name}' AND status = 'running'"
)
# Run inside a namespace. Its first SELECT prepares the statement, so that each one timed
# after it is a single round trip.
RTT_SCRIPT = """
import asyncio, statistics, sys, time, asyncpg
async def main():
    conn = await asyncpg.connect(sys.argv[1])
    await conn.fetchval("SELECT 1")
    times = []
    for _ in range(20):
        start = time.perf_counter()
        await conn.fetchval("SELECT 1")
        times.append(time.perf_counter() - start)
    print(statistics.median(times))
asyncio.run(main())
"""


def utc(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


def cpu_seconds(pids: Sequence[int]) -> float:
    total = 0.0
    for pid in pids:
        with suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def replica_env(probes: Path, shards: int = 1) -> dict[str, str]:
    tasks = [
        {"name": f"q{i:02d}", "every": "1s", "jitter": "1s", "sql": SQL.format(name=f"q{i:02d}")}
        for i in range(SQL_TASKS)
    ]
    return {
        "SCHEDULER_DATABASE__POOL_MAX_SIZE": "10",
        "SCHEDULER_PUBLISH__PUBLISHERS": '["notify"]',
        "SCHEDULER_PLUGIN__RUNNABLE": json.dumps([PROBE]),
        "SCHEDULER_PLUGIN__TASKS": json.dumps(tasks),
        "SCHEDULER_PLUGIN__ENTRY_POINTS": "false",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "bench"), str(ROOT)]),
        "BENCH_PROBES": str(probes),
    } | ({"SCHEDULER_PLUGIN__SHARDS": str(shards)} if shards > 1 else {})


async def wait_ready(
    conn: asyncpg.Connection,
    replicas: Sequence[subprocess.Popen[bytes]],
    workdir: Path,
    shards: int = 1,
) -> None:
    """Until both loops have a leader, the runnable target is published (the plugin
    leader's take-over) and every replica has a session open across its link."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for n, replica in enumerate(replicas):
            if replica.poll() is not None:
                tail = log_tail(workdir / f"r{n}")
                raise RuntimeError(f"replica r{n} exited {replica.returncode}:\n{tail}")
        ready = await conn.fetchval(
            # The publish leader, and the plugin loop's (or each of its shards' leaders).
            "SELECT (SELECT count(*) FROM scheduler_leaders) = $4 "
            "AND EXISTS (SELECT 1 FROM scheduler_runnable_targets WHERE target = $1) "
            "AND (SELECT count(DISTINCT client_addr) FROM pg_stat_activity "
            "     WHERE datname = current_database() AND client_addr << $2::cidr) = $3",
            PROBE,
            netns.TRUSTED_NETWORK,
            len(replicas),
            1 + shards,
        )
        if ready:
            await asyncio.sleep(1.0)  # the take-over ticks' own work
            return
        await asyncio.sleep(0.2)
    raise TimeoutError(f"replicas not ready after 120 s: see {workdir}")


async def measure_rtt(net: netns.Namespaces, dsn: str) -> float:
    command = net.argv(0, [sys.executable, "-c", RTT_SCRIPT, net.dsn(0, dsn)])
    done = await asyncio.to_thread(
        subprocess.run, command, capture_output=True, text=True, timeout=120
    )
    if done.returncode != 0:
        raise RuntimeError(f"RTT probe failed: {done.stderr.strip()}")
    return float(done.stdout) * 1000


async def add_schedules(conn: asyncpg.Connection) -> tuple[float, float]:
    """The 1,000 schedules in one transaction, schedule i's first slot T0 + i * 10 ms
    (its phase from then on); returns (T0, seconds the adding took). T0 is a whole
    second, so that a window of whole seconds from it holds exactly seconds * 100 slots
    (and the sql tasks' seconds * 20), none on a float's edge."""
    started = time.time()
    t0 = float(math.ceil(started + LEAD))
    async with conn.transaction():
        for i in range(SCHEDULES):
            first = utc(t0 + i * PERIOD / SCHEDULES)
            await add_schedule_in(conn, f"p{i:04d}", target=PROBE, every=PERIOD, start=first)
    return t0, time.time() - started


async def feed(conn: asyncpg.Connection, until: float) -> None:
    """One publication every 1/PUBLICATIONS s, due 1 s after it is scheduled, as an
    application scheduling them one at a time would (each in its own transaction)."""
    step = 1.0 / PUBLICATIONS
    at = time.time()
    while at + 1.0 < until:
        await asyncio.sleep(max(0.0, at - time.time()))
        async with conn.transaction():
            await schedule_in(conn, utc(time.time() + 1.0))
        at += step


def read_probes(directory: Path) -> list[tuple[str, str, float, float]]:
    lines = []
    for path in directory.glob("*.probes"):
        for line in path.read_text().splitlines():
            instance, name, slot, started = line.split()
            lines.append((instance, name, float(slot), float(started)))
    return lines


def runs(
    records: Sequence[tuple[str, float, float]], start: float, end: float, expected: int
) -> dict[str, Any]:
    """(key, slot, ran at) records: rate in the window, lateness of the window's slots."""
    seen: set[tuple[str, float]] = set()
    late: list[float] = []
    for key, slot, at in records:
        if (key, round(slot, 3)) in seen:
            continue
        seen.add((key, round(slot, 3)))
        if start <= slot < end:
            late.append(at - slot)
    return {
        "runs_per_second": sum(start <= at < end for _, _, at in records) / (end - start),
        "lateness_s": summary(late),
        "slots_expected": expected,
        "slots_not_run": expected - len(late),
        "duplicates": len(records) - len(seen),
    }


@dataclass(frozen=True)
class Rig:
    """One case's running setup: the database, the bench's connection to it, the replicas
    and where their probes write."""

    dsn: str
    conn: asyncpg.Connection
    replicas: list[subprocess.Popen[bytes]]
    probes: Path
    delayers: list[int]


@asynccontextmanager
async def running(
    admin: str, net: netns.Namespaces, rtt_ms: float, workdir: Path, shards: int = 1
) -> AsyncIterator[Rig]:
    """The links set to `rtt_ms`, a fresh database and the replicas started and ready;
    on leaving, the replicas still alive stopped and the database dropped."""
    for n in range(REPLICAS):
        if rtt_ms:
            net.impair(n, delay_ms=rtt_ms / 2)
        else:
            net.clear(n)
    shutil.rmtree(workdir, ignore_errors=True)
    probes = workdir / "probes"
    probes.mkdir(parents=True)
    dsn = await fresh_database(admin, DB)
    conn = await asyncpg.connect(dsn)
    await conn.execute(
        "CREATE TABLE bench_latency_sql (task text, slot timestamptz, at timestamptz)"
    )
    env = replica_env(probes, shards)
    replicas = [
        start_daemon(net.dsn(n, dsn), workdir / f"r{n}", only=None,
                     env=env | {"SCHEDULER_INSTANCE_ID": f"r{n}"}, prefix=net.argv(n, []))
        for n in range(REPLICAS)
    ]  # fmt: skip
    delayers = [h.delayer.pid for h in net.hosts if h.delayer is not None]
    try:
        await wait_ready(conn, replicas, workdir, shards)
        yield Rig(dsn, conn, replicas, probes, delayers)
    finally:
        await asyncio.to_thread(stop_all, [r for r in replicas if r.poll() is None])
        await conn.close()
        await drop_database(admin, DB, grace=0)


async def case(
    admin: str,
    net: netns.Namespaces,
    rtt_ms: float,
    seconds: float,
    workdir: Path,
    shards: int = 1,
) -> dict[str, Any]:
    async with running(admin, net, rtt_ms, workdir, shards) as setup:
        conn, replicas = setup.conn, setup.replicas
        rtt_idle = await measure_rtt(net, setup.dsn)
        t0, adding_s = await add_schedules(conn)
        start, end = t0 + WARMUP, t0 + WARMUP + seconds
        feeder = asyncio.create_task(feed(conn, end))
        await asyncio.sleep(max(0.0, start - time.time()))
        cpu_before = cpu_seconds([p.pid for p in replicas]), cpu_seconds(setup.delayers)
        await asyncio.sleep(max(0.0, end - time.time()))
        cpu_after = cpu_seconds([p.pid for p in replicas]), cpu_seconds(setup.delayers)
        load = os.getloadavg()[0]
        await feeder
        await asyncio.sleep(GRACE)
        rtt_loaded = await measure_rtt(net, setup.dsn)
        exited = {f"r{n}": p.returncode for n, p in enumerate(replicas) if p.poll() is not None}
        probe_lines = read_probes(setup.probes)
        sql_rows = await conn.fetch(
            "SELECT task, extract(epoch FROM slot)::float8 AS slot, "
            "extract(epoch FROM at)::float8 AS at FROM bench_latency_sql"
        )
        publications = await conn.fetch(
            "SELECT extract(epoch FROM published_at - publish_at)::float8 AS late "
            "FROM scheduler_publications "
            "WHERE publish_at >= to_timestamp($1::float8) AND publish_at < to_timestamp($2::float8)",
            start,
            end,
        )
        leaders = dict(await conn.fetch("SELECT loop, instance FROM scheduler_leaders"))
    published = [r["late"] for r in publications if r["late"] is not None]
    return {
        "rtt_set_ms": rtt_ms,
        "rtt_idle_ms": rtt_idle,
        "rtt_loaded_ms": rtt_loaded,
        "adding_s": adding_s,
        "async": runs([(n, s, a) for _, n, s, a in probe_lines], start, end,
                      round(seconds * SCHEDULES / PERIOD)),
        "sql": runs([(r["task"], r["slot"], r["at"]) for r in sql_rows], start, end,
                    round(SQL_TASKS * seconds)),
        "publications": {
            "scheduled": len(publications),
            "not_published": len(publications) - len(published),
            "lateness_s": summary(published),
        },
        "plugin_runners": sorted({i for i, _, _, a in probe_lines if start <= a < end}),
        "leaders": leaders,
        "exited_early": exited,
        "replicas_cpu_percent": (cpu_after[0] - cpu_before[0]) / seconds * 100,
        "delay_cpu_percent": (cpu_after[1] - cpu_before[1]) / seconds * 100,
        "load_average": load,
    }  # fmt: skip


# -- the SIGKILL case -------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One run as recorded: an async slot's probe line, an `sql` task's row (its instance
    from its run in scheduler_plugin_runs), or a publication (its id as the key,
    publish_at as the slot, published_at as when it ran, published_by)."""

    key: str
    slot: float
    at: float
    instance: str


@dataclass(frozen=True)
class Kill:
    victim: str  # the plugin loop's leader, SIGKILLed
    publish_leader: str  # the publish loop's at that moment (often the same replica)
    at: float  # time.time() just before the signal was sent
    exit_code: int | None


def slot_key(key: str, slot: float) -> tuple[str, float]:
    # Milliseconds: a slot read back from the database or a probe line, and one computed
    # here, differ in the last float bits only.
    return key, round(slot, 3)


def expected_slots(
    phases: dict[str, float], every: float, start: float, end: float
) -> set[tuple[str, float]]:
    """Every slot of each key (a slot of its, ``phases``) in [start, end)."""
    slots = set()
    for key, phase in phases.items():
        at = phase + math.ceil((start - phase) / every) * every
        while at < end:
            slots.add(slot_key(key, at))
            at += every
    return slots


def async_phases(t0: float) -> dict[str, float]:
    """The runtime schedules' first slots, as add_schedules set them."""
    return {f"p{i:04d}": t0 + i * PERIOD / SCHEDULES for i in range(SCHEDULES)}


async def kill_leader(db: asyncpg.Connection, replicas: Sequence[subprocess.Popen[bytes]]) -> Kill:
    """SIGKILL the plugin loop's leader, as scheduler_leaders names it, once its pid there
    is the process this bench started under that name (never another process)."""
    rows = await db.fetch("SELECT loop, instance, pid FROM scheduler_leaders")
    leaders = {row["loop"]: (row["instance"], row["pid"]) for row in rows}
    victim, pid = leaders["plugin"]
    process = {f"r{n}": p for n, p in enumerate(replicas)}[victim]
    if process.pid != pid or process.poll() is not None:
        raise RuntimeError(f"plugin leader {victim} (pid {pid}) is not our live {process.pid}")
    killed_at = time.time()
    process.send_signal(signal.SIGKILL)
    exit_code = await asyncio.to_thread(process.wait, 10)
    return Kill(victim, leaders["publish"][0], killed_at, exit_code)


def first_runs(records: Sequence[Run]) -> tuple[dict[tuple[str, float], Run], int]:
    """Each (key, slot)'s earliest run, and how many runs were of a (key, slot) already
    run: duplicates."""
    first: dict[tuple[str, float], Run] = {}
    for run_ in sorted(records, key=lambda r: r.at):
        first.setdefault(slot_key(run_.key, run_.slot), run_)
    return first, len(records) - len(first)


def lateness(records: Sequence[Run]) -> dict[str, Any]:
    return {"slots": len(records), **summary([r.at - r.slot for r in records])}


def failover(
    records: Sequence[Run],
    expected: set[tuple[str, float]],
    lost: str | None,
    killed_at: float,
    *,
    next_slot: bool,
) -> dict[str, Any]:
    """One workload's figures around the kill. ``expected``: the window's slots. ``lost``:
    the instance whose leadership of this work the kill ended (None: another replica led
    it and still does: nothing to take over, everything after the kill is "after")."""
    first, duplicates = first_runs(records)
    taken = sorted(
        (r for r in records if lost is not None and r.instance != lost and r.at >= killed_at),
        key=lambda r: r.at,
    )
    resumed_at = taken[0].at if taken else None
    # Where "after" begins. Nobody lost this work: it was never interrupted, so at the kill.
    boundary = killed_at if lost is None else resumed_at
    before: list[Run] = []
    window: list[Run] = []
    after: list[Run] = []
    inherited = 0
    for r in (first[k] for k in expected if k in first):
        if r.slot < killed_at and (lost is None or r.instance == lost):
            before.append(r)
        elif boundary is None or r.slot < boundary:
            # Due before the successor's first run, or before the kill and not started
            # by the victim: both waited for the takeover.
            window.append(r)
            inherited += r.slot < killed_at
        else:
            after.append(r)
    missing = expected - first.keys()
    victims = [r.at for r in records if r.instance == lost]
    figures: dict[str, Any] = {
        "resumed_s": None if resumed_at is None else resumed_at - killed_at,
        "successor": taken[0].instance if taken else None,
        "before": lateness(before),
        "window": lateness(window) | {"due_before_kill": inherited},
        "after": lateness(after),
        "expected_after_kill": sum(slot >= killed_at for _, slot in expected),
        "not_run_after_kill": sum(slot >= killed_at for _, slot in missing),
        # Claimed by the victim and killed before recorded: a slot runs at most once.
        "not_run_in_flight": sum(slot < killed_at for _, slot in missing),
        "duplicates": duplicates,
        # Runs of another replica begun before the kill, when the victim still ran.
        "overlap": sum(lost is not None and r.instance != lost and r.at < killed_at
                       for r in records),
        "victim_last_run_s": max(victims) - killed_at if victims else None,
    }  # fmt: skip
    if next_slot:
        figures["next_slot"] = next_slots(first, expected, killed_at)
    return figures


def next_slots(
    first: dict[tuple[str, float], Run], expected: set[tuple[str, float]], killed_at: float
) -> dict[str, Any]:
    """Each schedule's first slot after the kill: its lateness, and how many did not run."""
    nexts: dict[str, float] = {}
    for key, slot in expected:
        if slot >= killed_at and slot < nexts.get(key, math.inf):
            nexts[key] = slot
    ran = [first[k] for k in nexts.items() if k in first]
    return lateness(ran) | {"expected": len(nexts), "not_run": len(nexts) - len(ran)}


async def read_sql_runs(conn: asyncpg.Connection) -> list[Run]:
    """The sql tasks' rows, each with the instance its run was claimed by."""
    rows = await conn.fetch(
        "SELECT s.task, extract(epoch FROM s.slot)::float8 AS slot, "
        "extract(epoch FROM s.at)::float8 AS at, coalesce(r.instance, '?') AS instance "
        "FROM bench_latency_sql s "
        "LEFT JOIN scheduler_plugin_runs r ON r.name = s.task AND r.slot = s.slot"
    )
    return [Run(r["task"], r["slot"], r["at"], r["instance"]) for r in rows]


async def read_publications(
    conn: asyncpg.Connection, start: float, end: float
) -> tuple[list[Run], set[tuple[str, float]]]:
    """The window's publications: those published, and every one due (the expected)."""
    rows = await conn.fetch(
        "SELECT id::text AS id, extract(epoch FROM publish_at)::float8 AS due, "
        "extract(epoch FROM published_at)::float8 AS at, published_by "
        "FROM scheduler_publications "
        "WHERE publish_at >= to_timestamp($1::float8) AND publish_at < to_timestamp($2::float8)",
        start,
        end,
    )
    done = [Run(r["id"], r["due"], r["at"], r["published_by"]) for r in rows if r["at"]]
    return done, {slot_key(r["id"], r["due"]) for r in rows}


def notified(heard: Sequence[str], published: Sequence[Run]) -> dict[str, int]:
    """The `notify` publisher's messages the bench heard, against the rows published: each
    row once, none twice (its effect outside the table)."""
    counts: dict[str, int] = {}
    for key in heard:
        counts[key] = counts.get(key, 0) + 1
    return {
        "notified_twice": sum(n > 1 for n in counts.values()),
        "published_not_notified": sum(r.key not in counts for r in published),
    }


@dataclass(frozen=True)
class KillRun:
    """What the kill case's timeline gives, besides the records read after it."""

    t0: float
    start: float
    end: float
    kill: Kill
    heard: list[str]  # publication ids in the `notify` messages, as heard
    rtt_idle_ms: float
    rtt_loaded_ms: float
    load: float


async def kill_mid_window(net: netns.Namespaces, setup: Rig, seconds: float) -> KillRun:
    """The workload, as in a case; kill_offset(seconds) into the window, the plugin
    loop's leader SIGKILLed; then the rest of the window and GRACE."""
    conn = setup.conn
    # Its own connection: `conn` is the feeder's, one statement at a time.
    observer = await asyncpg.connect(setup.dsn)
    heard: list[str] = []
    await observer.add_listener(
        NotifyPublisherSettings().channel,
        lambda _c, _p, _ch, payload: heard.append(str(json.loads(payload)["id"])),
    )
    try:
        rtt_idle = await measure_rtt(net, setup.dsn)
        t0, _ = await add_schedules(conn)
        start, end = t0 + WARMUP, t0 + WARMUP + seconds
        feeder = asyncio.create_task(feed(conn, end))
        await asyncio.sleep(max(0.0, start + kill_offset(seconds) - time.time()))
        kill = await kill_leader(observer, setup.replicas)
        await asyncio.sleep(max(0.0, end - time.time()))
        load = os.getloadavg()[0]
        await feeder
        await asyncio.sleep(GRACE)
        rtt_loaded = await measure_rtt(net, setup.dsn)
    finally:
        await observer.close()
    return KillRun(t0, start, end, kill, heard, rtt_idle, rtt_loaded, load)


async def kill_case(
    admin: str, net: netns.Namespaces, rtt_ms: float, seconds: float, workdir: Path
) -> dict[str, Any]:
    """The same setup and workload, the plugin loop's leader SIGKILLed mid-window: what
    its successor made of the slots, the sql tasks and the publications."""
    async with running(admin, net, rtt_ms, workdir) as setup:
        k = await kill_mid_window(net, setup, seconds)
        exited = {
            f"r{n}": p.returncode
            for n, p in enumerate(setup.replicas)
            if p.poll() is not None and f"r{n}" != k.kill.victim
        }
        probes = [Run(n, s, a, i) for i, n, s, a in read_probes(setup.probes)]
        sql = await read_sql_runs(setup.conn)
        published, due = await read_publications(setup.conn, k.start, k.end)
        acquired = {
            row["loop"]: row["acquired"]
            for row in await setup.conn.fetch(
                "SELECT loop, extract(epoch FROM acquired_at)::float8 AS acquired "
                "FROM scheduler_leaders"
            )
        }
        abandoned = await setup.conn.fetchval(
            "SELECT count(*) FROM scheduler_plugin_runs WHERE status = 'abandoned'"
        )
    kill = k.kill
    sql_phases = {r.key: r.slot for r in sql}  # the jitter sets each task's phase
    publish_lost = kill.victim if kill.publish_leader == kill.victim else None
    return {
        "rtt_set_ms": rtt_ms,
        "rtt_idle_ms": k.rtt_idle_ms,
        "rtt_loaded_ms": k.rtt_loaded_ms,
        "seconds": seconds,
        "killed_after_s": kill.at - k.start,
        "victim": kill.victim,
        "publish_leader": kill.publish_leader,
        "exit_code": kill.exit_code,
        # When each loop's successor held its lock: now() of its claim transaction, two
        # round trips after the grant (the grant's answer; RESET statement_timeout; BEGIN)
        # (scheduler_leaders.acquired_at). None: that loop's leader did not change.
        "lock_s": {
            loop: at - kill.at if at >= kill.at else None for loop, at in acquired.items()
        },
        "async": failover(probes, expected_slots(async_phases(k.t0), PERIOD, k.start, k.end),
                          kill.victim, kill.at, next_slot=True),
        "sql": failover(sql, expected_slots(sql_phases, 1.0, k.start, k.end), kill.victim,
                        kill.at, next_slot=True) | {"tasks_seen": len(sql_phases)},
        "publications": failover(published, due, publish_lost, kill.at, next_slot=False)
        | notified(k.heard, published),
        "abandoned_runs": abandoned,
        "exited_early": exited,
        "load_average": k.load,
    }  # fmt: skip


def kill_offset(seconds: float) -> float:
    """How far into the kill case's window the kill comes: KILL_LEAD s of steady state
    before it, but never so late that a schedule's next slot (within PERIOD of the kill)
    falls after the window, as long as the window allows (at least 1 s before it)."""
    return max(1.0, min(KILL_LEAD, seconds - PERIOD - 1.0))


async def run(
    admin: str,
    net: netns.Namespaces,
    rtts: list[float],
    seconds: float,
    kill_rtt: float | None = None,
    kill_seconds: float = KILL_SECONDS,
    shards: int = 1,
) -> dict[str, Any]:
    """The RTT cases, then (``kill_rtt`` given) the SIGKILL case at that RTT. ``shards``
    > 1: the plugin loop sharded over the replicas (the RTT cases only)."""
    results: dict[str, Any] = {
        "code": code_version(),
        "replicas": REPLICAS,
        "shards": shards,
        "seconds": seconds,
        "warmup_s": WARMUP,
        "cases": [],
    }
    for rtt in rtts:
        print(f"bench.latency: RTT {rtt:g} ms, {WARMUP:g} + {seconds:g} s", flush=True)
        workdir = RESULTS / ".work" / "latency" / f"rtt{rtt:g}"
        r = await case(admin, net, rtt, seconds, workdir, shards)
        results["cases"].append(r)
        print(f"bench.latency:   {row(r)}", flush=True)
    if kill_rtt is not None:
        print(
            f"bench.latency: SIGKILL of the plugin leader at RTT {kill_rtt:g} ms, "
            f"{WARMUP:g} + {kill_seconds:g} s, the kill {kill_offset(kill_seconds):g} s in",
            flush=True,
        )
        workdir = RESULTS / ".work" / "latency" / f"kill-rtt{kill_rtt:g}"
        k = await kill_case(admin, net, kill_rtt, kill_seconds, workdir)
        results["kill"] = k
        for work in ("async", "sql", "publications"):
            print(f"bench.latency:   {kill_row(work, k[work])}", flush=True)
    return results


def row(r: dict[str, Any]) -> str:
    a, q, p = r["async"], r["sql"], r["publications"]
    dup = a["duplicates"] + q["duplicates"]
    return (
        f"| {r['rtt_set_ms']:g} ms | {r['rtt_idle_ms']:.1f} / {r['rtt_loaded_ms']:.1f} ms "
        f"| {a['runs_per_second']:.1f} | {fmt_s(a['lateness_s']['p50'])} "
        f"| {fmt_s(a['lateness_s']['p99'])} | {fmt_s(a['lateness_s']['max'])} "
        f"| {a['slots_not_run']} of {a['slots_expected']} | {q['runs_per_second']:.1f} "
        f"| {fmt_s(q['lateness_s']['p99'])} | {q['slots_not_run']} of {q['slots_expected']} "
        f"| {fmt_s(p['lateness_s']['p99'])} | {p['not_published']} of {p['scheduled']} "
        f"| {'**' + str(dup) + '**' if dup else 0} | {', '.join(r['plugin_runners']) or '-'} "
        f"/ {r['leaders'].get('publish', '-')} | {r['replicas_cpu_percent']:.0f}% "
        f"| {r['delay_cpu_percent']:.0f}% | {r['load_average']:.1f} |"
    )


def report(results: dict[str, Any]) -> str:
    code = results["code"]
    lines = [
        f"# A leader across a real network ({results['date']}, {results['machine']})",
        "",
        f"Commit {code['commit'][:12]}"
        + (f", with uncommitted changes to {', '.join(code['changed'])}" if code["changed"] else "")
        + f". {results['replicas']} replicas (`scheduler-daemon run`, both loops, pool 10"
        + (
            f"; the plugin loop in {results['shards']} shards shared by them"
            if results.get("shards", 1) > 1
            else ""
        )
        + "), "
        "each in a network namespace whose link to PostgreSQL (durable, this host) delays "
        "each direction by RTT/2. All at once: 1,000 runtime schedules every 10 s of an "
        "async target awaiting 1 ms, 20 `sql` tasks every 1 s, 20 publications a second "
        f"(`notify`) due 1 s after scheduling; {results['seconds']:g} s measured after a "
        f"{results['warmup_s']:g} s warm-up. Lateness: async, the target's own start - slot; "
        "sql, `now()` of its transaction - slot; publications, published_at - publish_at. "
        "*Measured*: median `SELECT 1` from a namespace, idle / under load. *Runners*: the "
        "replicas whose async runs fell in the window / the publish leader. CPU: 100% = "
        "one core; *delay*: the rig's userspace delay processes. Method: bench/latency.py.",
        "",
    ]
    if results["cases"]:  # none with --kill-only
        lines += [
            "| RTT | measured | async runs/s (of 100) | lateness p50 | p99 | max | not run "
            "| sql runs/s (of 20) | sql p99 | sql not run | publications p99 | not published "
            "| duplicates | runners | replicas CPU | delay CPU | load |",
            "|" + "---|" * 17,
            *[row(r) for r in results["cases"]],
            "",
        ]
    for r in results["cases"]:
        # Sharded, every replica runs some of the plugin loop: that is the point.
        if len(r["plugin_runners"]) > 1 and results.get("shards", 1) == 1:
            lines.append(f"- RTT {r['rtt_set_ms']:g} ms: the plugin loop changed hands in the "
                         "window: not a clean measurement.")  # fmt: skip
        if r["exited_early"]:
            lines.append(
                f"- RTT {r['rtt_set_ms']:g} ms: replicas exited early: {r['exited_early']}."
            )
    text = "\n".join(lines).rstrip("\n") + "\n"
    if results.get("kill"):
        text += "\n" + "\n".join(kill_report(results["kill"])) + "\n"
    return text


def bold(count: int) -> str:
    """A count that must be 0, in bold when it is not."""
    return f"**{count}**" if count else "0"


def kill_row(work: str, f: dict[str, Any]) -> str:
    w, a, n = f["window"], f["after"], f.get("next_slot")
    return (
        f"| {work} | {fmt_s(f['resumed_s'])} | {fmt_s(f['before']['p99'])} | {w['slots']} "
        f"| {fmt_s(w['p50'])} | {fmt_s(w['p99'])} | {fmt_s(w['max'])} | {fmt_s(a['p50'])} "
        f"| {fmt_s(a['p99'])} | {fmt_s(a['max'])} | {fmt_s(n['p99']) if n else '-'} "
        f"| {fmt_s(n['max']) if n else '-'} "
        f"| {bold(f['not_run_after_kill'])} of {f['expected_after_kill']} "
        f"| {f['not_run_in_flight']} | {bold(f['duplicates'] + f.get('notified_twice', 0))} "
        f"| {bold(f['overlap'])} |"
    )


def kill_report(k: dict[str, Any]) -> list[str]:
    victim, lock = k["victim"], k["lock_s"]
    publish = (
        "which led the publish loop too (both loops failed over)"
        if k["publish_leader"] == victim
        else f"not the publish loop's ({k['publish_leader']}, left running)"
    )
    a = k["async"]
    last = a["victim_last_run_s"]
    lines = [
        f"## SIGKILL of the plugin leader at RTT {k['rtt_set_ms']:g} ms",
        "",
        f"The same setup and workload on a fresh database (measured {k['rtt_idle_ms']:.1f} / "
        f"{k['rtt_loaded_ms']:.1f} ms), {k['seconds']:g} s measured after the warm-up. "
        f"{k['killed_after_s']:.1f} s into it the plugin loop's leader, {victim} (from "
        f"`scheduler_leaders`, its pid checked against the process), {publish}, was sent "
        f"SIGKILL (exit {k['exit_code']}). {a['successor'] or 'No replica'} ran the next "
        f"async slot; the successors held the plugin lock {fmt_s(lock.get('plugin'))} and "
        f"the publish lock {fmt_s(lock.get('publish'))} after the kill "
        "(`scheduler_leaders.acquired_at`: `now()` of the claim, two round trips after the "
        "grant; '-': that leader did not change). *Resumed*: from the kill to the first run "
        "another replica started (async: the probe's own start; sql: `now()` of its "
        "transaction; publications: published_at). *Window*: the slots due from the kill "
        "until then, and those due before it that the victim had not started "
        f"({a['window']['due_before_kill']} async); *after*: the rest of the window. *Next slot*: each schedule's first slot "
        "after the kill (1,000 async, 20 sql). *Not run*: slots due from the kill on with no "
        f"run {GRACE:g} s after the window: 0, or a slot was lost. *In flight*: slots due "
        "before the kill that the victim claimed and died before recording (a slot runs at "
        "most once: abandoned, not run again). *Duplicates*: a (schedule, slot) run twice "
        "in the whole case; publications: published twice, or `notify` heard twice by a "
        "listener of the bench's. *Overlap*: runs of another replica begun before the kill. "
        "The bound to expect, and why: bench/latency.py.",
        "",
        "| work | resumed | before the kill p99 | window slots | window p50 | p99 | max "
        "| after p50 | p99 | max | next slot p99 | max | not run after the kill "
        "| in flight, not run | duplicates | overlap |",
        "|" + "---|" * 16,
        *[kill_row(work, k[work]) for work in ("async", "sql", "publications")],
        "",
        f"- The victim's last async run began {fmt_s(None if last is None else -last)} before "
        "the kill. "
        f"Runs marked abandoned by the successor: {k['abandoned_runs']} (the victim's runs "
        "in flight, whether they had been recorded or not). Publications published without "
        f"a `notify` heard: {k['publications']['published_not_notified']}. Load average "
        f"{k['load_average']:.1f}.",
    ]  # fmt: skip
    if k["exited_early"]:
        lines.append(f"- Replicas other than the victim exited early: {k['exited_early']}.")
    return lines


def rtt_arguments(prog: str) -> argparse.ArgumentParser:
    """The flags of the benches run per RTT (this one, bench/latency_peers.py)."""
    parser = argparse.ArgumentParser(prog=f"python -m {prog}")
    parser.add_argument("--quick", action="store_true", help="RTTs 0 and 10 ms, 10 s each")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--rtts", type=lambda s: [float(v) for v in s.split(",")])
    parser.add_argument("--seconds", type=float, help="measured window per case")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = rtt_arguments("bench.latency")
    parser.add_argument(
        "--kill-rtt",
        type=float,
        default=KILL_RTT,
        help=f"RTT of the SIGKILL case, ms (default {KILL_RTT:g})",
    )
    parser.add_argument(
        "--kill-seconds",
        type=float,
        help=f"its measured window (default {KILL_SECONDS:g}; --quick {QUICK_KILL_SECONDS:g})",
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--no-kill", action="store_true", help="the RTT cases only")
    which.add_argument("--kill-only", action="store_true", help="the SIGKILL case only")
    parser.add_argument(
        "--shards",
        type=int,
        default=1,
        help="plugin.shards for the RTT cases (> 1: no SIGKILL case; saved as latency_shards)",
    )
    args = parser.parse_args(argv)
    if args.shards > 1 and args.kill_only:
        parser.error("--shards runs the RTT cases only")
    rtts = args.rtts or ([0.0, 10.0] if args.quick else [0.0, 2.0, 10.0, 40.0])
    seconds = args.seconds or (10.0 if args.quick else 30.0)
    kill_seconds = args.kill_seconds or (QUICK_KILL_SECONDS if args.quick else KILL_SECONDS)
    why_not = netns.unavailable()
    bindir = find_pg_bindir()
    if why_not or bindir is None:
        sys.exit(f"bench.latency: {why_not or 'no PostgreSQL server binaries'}")
    with ExitStack() as stack:
        settings = DURABLE | {"listen_addresses": "*"}  # the namespaces reach the host's end
        cluster = stack.enter_context(PgCluster(bindir, settings=settings))
        netns.trust_namespaces(cluster)
        net = stack.enter_context(netns.Namespaces(REPLICAS))
        results = asyncio.run(
            run(cluster.dsn(), net, [] if args.kill_only else rtts, seconds,
                kill_rtt=None if args.no_kill or args.shards > 1 else args.kill_rtt,
                kill_seconds=kill_seconds, shards=args.shards)
        )  # fmt: skip
    save_results("latency_shards" if args.shards > 1 else "latency", results, report, args.out)


if __name__ == "__main__":
    main()
