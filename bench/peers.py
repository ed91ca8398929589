"""Our daemon beside real peers, the same job in the same run (issue 12, items 3 and 4;
issue 19: many schedules).

Contestants, each running three processes against a database of its own on the durable
throwaway cluster:

- **ours**: ``scheduler-daemon run --only plugin``, one plugin task (``every = "1s"``,
  async target ``peerjob:ours``) declared through ``SCHEDULER_PLUGIN__TASKS``; the
  built-in ``purge_publications`` is disabled so that every contestant has exactly one
  task;
- **apscheduler**: APScheduler 4 (pre-release), SQLAlchemyDataStore on asyncpg and
  AsyncpgEventBroker, all defaults (lease 30 s, cleanup every 15 min);
- **apscheduler-tuned**: the same with ``lease_duration`` 2 s and ``cleanup_interval``
  1 s (the knobs APScheduler has for reclaiming a dead scheduler's jobs);
- **procrastinate**: a periodic task (``@app.periodic``, cron every second), its
  workers with the psycopg connector and defaults;
- **seed**: the design the project started from: every 1 s (fixed interval) try
  ``pg_try_advisory_lock(k)``, run the job, ``pg_advisory_unlock(k)``, on one asyncpg
  connection.

The job is the same for all (``bench/peers/peerjob.py``): insert a row with the process
id and ``clock_timestamp()``, sleep 0.2 s, update the row with the end; it also appends
a start and an end line (wall clock) to a file per process, so that intervals can be
checked outside the database. APScheduler and procrastinate are installed from PyPI,
exact pinned versions, each into a venv of its own under ``bench/.peers/<name>/``
(created once; recreated only when the pins change); ``pip freeze`` of each is recorded.

**Kill trial** (per contestant): three processes run the job for a while; then, several
times, the harness waits for a run to start (the start line appears in a process's
file, written once the row is in, so the process is in its 0.2 s sleep), SIGKILLs that
process 50 ms later, starts a replacement at once, and waits for the next run by any
other process. Failover gap = next run's start - kill (wall clock, one host); "late" =
that start - (the killed run's start + 1 s), i.e. the delay against the schedule.
Duplicate runs: consecutive starts less than 0.5 s apart (two runs for one 1 s slot).
Overlaps: intervals of different processes that overlap, from the files (a killed run
ends at its kill). Lost: slots without a run, from the gaps between consecutive starts.
After each kill the peer's own tables are read, and the report says in words what is
left behind. A contestant that runs nothing for the whole observation window after a
kill is not killed again (nothing runs to kill): the gap is reported as "≥ window".

**Idle cost**: all contestants idle side by side, each in its own database, the job
scheduled for midnight on 1 January (a cron far away; for ours a cron task), with 1, 3
and 10 processes (quick: 1 and 3). Processes are added (1 → 3 → 10), and each window
starts once they have settled (their CPU quiet, and at least 11 s after the last start).
Over the window:

- transactions per second, counted from the server log: the contestants' databases get
  ``log_statement = 'all'`` (the throwaway cluster only), and every statement their
  sessions issue in the window is attributed by application name (each peer sets
  ``peer-<name>``, ours ``scheduler-daemon/…``) or by backend pid; a statement outside
  ``BEGIN … COMMIT`` is one transaction, a block is one. The most frequent statements are
  kept, so the report says what the idle work *is*;
- commits and rollbacks per second as ``pg_stat_database`` reports them for the
  contestant's database over the same window (the observer reads them from the
  ``postgres`` database, so its own queries are not counted; a control database with no
  client shows the noise floor). Beside the log's count because it is what the issue
  quoted, but **it is not a measure of the window**: PostgreSQL 15 flushes a backend's
  transaction counts only together with table statistics (or when it disconnects), so a
  transaction that reads no table (``pg_try_advisory_lock``, ``SELECT 1``) is counted
  late or only at disconnect, and start-up work lands in later windows. Checked here by
  bracketing whole process lifetimes (counts before the first connect and after the last
  disconnect are exact) at two lengths: the log's steady-state rate matched the exact
  one (ours 0.47 vs 0.47 /s, APScheduler tuned 3.10 vs 3.07, defaults ~0 vs ~0, the seed
  6.07 vs 6.00, procrastinate 2.0 vs 1.9, with 3 processes), while the window's pg_stat_database delta was off by up to several per
  second (the seed design's 6 lock tries and unlocks per second show as ~0). A session's
  start costs one more commit that no statement shows (and asyncpg's first prepare of a
  statement another): not part of a steady idle state;
- client connections from ``pg_stat_activity`` (max over the window); CPU (utime +
  stime from /proc, the process and its children) and RSS / PSS per process; ERROR
  lines in the server log in the window, attributed like the statements.

**Many schedules** (issue 19; results in ``peers_scale.json`` / ``.md``): N = 1,000 and
10,000 schedules every 10 s (quick: 1,000), a no-op async job
(``bench/peers/scalejob.py``) that appends one line per run — schedule, slot (the
scheduled instant as the peer hands it to the job), start (wall clock), pid — to a file
per process. Three processes per contestant; contestants one after another, each on a
database of its own:

- **ours**: runtime schedule rows (``scheduler_plugin_tasks``, target ``scalejob:ours``
  in ``plugin.runnable``; the harness writes it into scheduler_runnable_targets as the
  owner first, as a take-over would), schedule i's slots at T0 + i * 10 s / N + k * 10 s,
  one INSERT; ``run --only plugin``, defaults;
- **apscheduler** / **apscheduler-unlimited**: ``add_schedule`` with an
  ``IntervalTrigger(seconds=10, start_time=T0 + i * 10 s / N)``, by a setup process
  before the schedulers start (``bench/peers/apscheduler_scale.py``); defaults, then
  ``max_running_jobs = None`` (the default is 1 per task, and all schedules share one
  task);
- **procrastinate** / **procrastinate-c100**: the periodic tasks are code, so every worker
  declares all N (``bench/peers/procrastinate_scale.py``), on whole seconds (the ten
  phases of the period); worker defaults (concurrency 1), then concurrency 100.

Once every process is up (ours: a plugin leader recorded; a peer: each process's ready
file), at least one period of warm-up, then a window of 3 periods (quick: 1); the
processes are stopped 5 s after it. Per contestant and N: runs/s (runs that started in
the window) against N / 10 s, lateness (start - slot) p50/p99/max of each window slot's
first run, window slots not run by the stop, schedules with no run in the window,
duplicates (runs of a (schedule, slot) beyond the first, whole run), CPU of the three
process trees (utime + stime, /proc) and of their lasting database backends over the
window, commits/s, the load average.

    python -m bench.peers [--quick] [--out DIR] [--part all|trials|scale]
                          [--scale-contestants NAME ...] [--scale-counts N ...]

``--part trials`` runs the kill trial and idle cost (``peers.*``), ``--part scale`` the
many-schedules comparison (``peers_scale.*``); both by default. The processes' logs and
run files go to a temporary directory, or to ``$BENCH_PEERS_WORKDIR`` to keep them.
``--quick`` (one kill each, 1 and 3 idle processes, 10 s windows; 1,000 schedules for a
10 s window) takes about four minutes; the full run about twenty.

Numbers depend on the machine (2 cores here, shared): compare the rows of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import itertools
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import asyncpg

from bench.common import (
    RESULTS,
    ROOT,
    admin_dsn,
    create_database,
    drop_database,
    fresh_database,
    percentile,
    save_results,
    start_daemon,
)

HELPERS = ROOT / "bench" / "peers"
VENVS = ROOT / "bench" / ".peers"
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE_MB = os.sysconf("SC_PAGE_SIZE") / 2**20
DUPLICATE_WITHIN = 0.5  # s: two starts closer than this are two runs of one 1 s slot
IDLE_CRON = "0 0 1 1 *"  # midnight, 1 January: nothing runs during the benchmark
TUNED_LEASE = 2.0
TUNED_CLEANUP = 1.0
PLOTS = ("peers_failover.png", "peers_idle_commits.png", "peers_idle_resources.png")


@dataclass(frozen=True)
class PeerEnv:
    """A venv under bench/.peers/ with exact pins."""

    name: str
    requirements: tuple[str, ...]
    pre: bool = False


PEER_ENVS = {
    "apscheduler": PeerEnv(
        "apscheduler",
        (
            "apscheduler==4.0.0a6",
            "sqlalchemy[asyncio]==2.1.9",
            "asyncpg==0.32.0",
            # 4.0.0a6 (April 2025) breaks with today's anyio: AsyncpgEventBroker's LISTEN
            # callback starts a task outside any task (NoEventLoopError from 4.1x), and it
            # imports sniffio, which newer anyio no longer brings. The anyio of its day:
            "anyio==4.9.0",
        ),
        pre=True,
    ),
    # asyncpg only for the job (peerjob.py), identical for every contestant.
    "procrastinate": PeerEnv(
        "procrastinate",
        ("procrastinate==3.10.0", "psycopg[binary,pool]==3.3.9", "asyncpg==0.32.0"),
    ),
}


@dataclass(frozen=True)
class Contestant:
    name: str
    label: str
    venv: str | None  # a PEER_ENVS key, or None for this interpreter
    script: str | None  # helper under bench/peers/, or None for our daemon
    options: tuple[str, ...] = ()


CONTESTANTS = (
    Contestant("ours", "ours (scheduler-daemon, session mode)", None, None),
    Contestant("apscheduler", "APScheduler 4, defaults", "apscheduler", "apscheduler_peer.py"),
    Contestant(
        "apscheduler-tuned",
        f"APScheduler 4, lease {TUNED_LEASE:g} s, cleanup {TUNED_CLEANUP:g} s",
        "apscheduler",
        "apscheduler_peer.py",
        ("--lease", str(TUNED_LEASE), "--cleanup", str(TUNED_CLEANUP)),
    ),
    Contestant(
        "procrastinate", "procrastinate, periodic task", "procrastinate", "procrastinate_peer.py"
    ),
    Contestant("seed", "seed design (try-lock, work, unlock)", None, "seed_peer.py"),
)


@dataclass(frozen=True)
class Sizes:
    kills: int = 5
    warmup: float = 10.0  # s of running before the first kill
    observe: float = 20.0  # s to wait for the next run after a kill
    settle: float = 2.5  # s after that run, to see bursts and duplicates
    idle_sizes: tuple[int, ...] = (1, 3, 10)
    idle_window: float = 45.0
    idle_settle_max: float = 40.0


QUICK = Sizes(
    kills=1,
    warmup=2.0,
    observe=8.0,
    settle=1.5,
    idle_sizes=(1, 3),
    idle_window=10.0,
    idle_settle_max=20.0,
)


# -- environments --------------------------------------------------------------------


def ensure_venv(spec: PeerEnv) -> dict[str, Any]:
    """Create or update bench/.peers/<name>, skipped when `pip freeze` already shows every
    pinned version; return its python and `pip freeze`."""
    venv = VENVS / spec.name
    python = venv / "bin" / "python"
    freeze = pip_freeze(python) if python.exists() else []
    installed = {line.lower().replace("_", "-") for line in freeze}
    pins = {re.sub(r"\[.*\]", "", r).lower().replace("_", "-") for r in spec.requirements}
    if not pins <= installed:
        if not python.exists():
            base = shutil.which("python3") or sys.executable
            subprocess.run([base, "-m", "venv", str(venv)], check=True)
        pre = ["--pre"] if spec.pre else []
        print(f"bench.peers: installing {' '.join(spec.requirements)} into {venv}", flush=True)
        install = subprocess.run(
            [str(python), "-m", "pip", "install", "--quiet", *pre, *spec.requirements],
            capture_output=True,
            text=True,
        )
        if install.returncode != 0:
            sys.exit(f"bench.peers: pip install failed:\n{install.stdout}{install.stderr}")
        freeze = pip_freeze(python)
    return {"python": str(python), "requirements": list(spec.requirements), "freeze": freeze}


def pip_freeze(python: Path) -> list[str]:
    return subprocess.run(
        [str(python), "-m", "pip", "freeze", "--disable-pip-version-check"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()


def our_versions() -> dict[str, str]:
    from importlib.metadata import version

    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "scheduler_daemon"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return {
        "scheduler-daemon": version("scheduler-daemon"),
        "commit": commit + (" (scheduler_daemon/ modified)" if dirty else ""),
        "asyncpg": version("asyncpg"),
        "python": sys.version.split()[0],
    }


# -- one contestant's processes ---------------------------------------------------------


@dataclass
class Arena:
    """One contestant's database, directories and processes."""

    contestant: Contestant
    dsn: str
    workdir: Path
    python: str
    mode: str  # "run" or "idle"
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    spawned: int = 0

    @property
    def runs_dir(self) -> Path:
        return self.workdir / "runs"

    def environment(self) -> dict[str, str]:
        return {
            "PYTHONPATH": str(HELPERS),
            "PEER_DSN": self.dsn,
            "PEER_RUNS_DIR": str(self.runs_dir),
            "PEER_CONTESTANT": self.contestant.name,
        }

    def spawn(self) -> subprocess.Popen[bytes]:
        self.spawned += 1
        workdir = self.workdir / f"p{self.spawned}"
        workdir.mkdir(parents=True, exist_ok=True)
        if self.contestant.script is None:
            task: dict[str, str] = {"name": "peer-job", "target": "peerjob:ours"}
            task |= {"every": "1s"} if self.mode == "run" else {"cron": IDLE_CRON}
            env = self.environment() | {
                "SCHEDULER_PLUGIN__TASKS": json.dumps([task]),
                "SCHEDULER_PLUGIN__DISABLED": json.dumps(["purge_publications"]),
            }
            process = start_daemon(self.dsn, workdir, only="plugin", env=env)
        else:
            environment = {k: v for k, v in os.environ.items() if not k.startswith("SCHEDULER_")}
            with (workdir / "peer.log").open("ab") as log:
                process = subprocess.Popen(
                    [
                        self.python,
                        str(HELPERS / self.contestant.script),
                        self.dsn,
                        "--mode",
                        self.mode,
                        *self.contestant.options,
                    ],
                    env=environment | self.environment(),
                    cwd=workdir,
                    stdout=subprocess.DEVNULL,
                    stderr=log,
                )
        self.processes.append(process)
        return process

    def live(self) -> list[subprocess.Popen[bytes]]:
        return [p for p in self.processes if p.poll() is None]


async def prepare(admin: str, contestant: Contestant, name: str) -> str:
    """A fresh database for `contestant` with the job's table (and its own schema)."""
    if contestant.name == "ours":
        dsn = await fresh_database(admin, name)
    else:
        await drop_database(admin, name, grace=0)
        await create_database(admin, name)
        dsn = admin.rsplit("/", 1)[0] + f"/{name}"
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(job_table())
    finally:
        await conn.close()
    return dsn


def job_table() -> str:
    """peerjob.TABLE, read from bench/peers/peerjob.py (not a package: it runs in the
    peers' venvs too)."""
    spec = importlib.util.spec_from_file_location("peerjob", HELPERS / "peerjob.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    table: str = module.TABLE
    return table


async def initialise(arena: Arena) -> None:
    """Peer schemas that several processes starting at once would race to create."""
    if arena.contestant.name == "procrastinate":
        script = str(HELPERS / "procrastinate_peer.py")
        env = {**os.environ, **arena.environment()}
        arena.workdir.mkdir(parents=True, exist_ok=True)
        with (arena.workdir / "schema.log").open("ab") as log:
            process = await asyncio.create_subprocess_exec(
                arena.python, script, arena.dsn, "--apply-schema", env=env, stdout=log, stderr=log
            )
            if await process.wait() != 0:
                raise RuntimeError(f"procrastinate: applying the schema failed: {log.name}")


async def wait_ready(arena: Arena, within: float = 60.0) -> None:
    """Until the first process of a peer that creates its schema at start has done so."""
    if arena.contestant.venv != "apscheduler":
        return
    deadline = time.monotonic() + within
    conn = await asyncpg.connect(arena.dsn)
    try:
        while time.monotonic() < deadline:
            # (to_regclass first: a query of a missing table would be a server ERROR line)
            exists = await conn.fetchval("SELECT to_regclass('schedules') IS NOT NULL")
            if exists and await conn.fetchval("SELECT count(*) FROM schedules") > 0:
                return
            if not arena.live():
                break
            await asyncio.sleep(0.1)
    finally:
        await conn.close()
    raise RuntimeError(f"{arena.contestant.name}: not ready; see {arena.workdir}/p1/peer.log")


async def grow(arena: Arena, count: int) -> None:
    """Start processes until `count` run; the first alone if it creates a schema."""
    if not arena.processes:
        arena.spawn()
        await wait_ready(arena)
    while len(arena.live()) < count:
        arena.spawn()


class Running(Protocol):
    def live(self) -> list[subprocess.Popen[bytes]]: ...


async def stop_all(arenas: Sequence[Running], within: float = 15.0) -> None:
    """SIGTERM every live process; SIGKILL what has not exited `within` seconds later."""
    processes = [p for arena in arenas for p in arena.live()]
    for process in processes:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
    await asyncio.gather(*(asyncio.to_thread(wait_or_kill, p, within) for p in processes))


def wait_or_kill(process: subprocess.Popen[bytes], within: float) -> None:
    try:
        process.wait(within)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


# -- runs, from the files ---------------------------------------------------------------


@dataclass
class Run:
    token: str
    pid: int
    start: float  # wall clock, before the insert
    seen: float  # when the harness first saw its start line
    end: float | None = None


def read_runs(runs_dir: Path, known: dict[str, Run]) -> dict[str, Run]:
    """Every run in the per-process files, updating `known` in place."""
    now = time.time()
    for path in runs_dir.glob("*.runs"):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) != 4:
                continue  # a line being written
            kind, token, pid, stamp = parts
            run = known.get(token)
            if run is None:
                run = known[token] = Run(token, int(pid), float(stamp), now)
            if kind == "E":
                run.end = float(stamp)
    return known


async def wait_for_run(
    arena: Arena,
    runs: dict[str, Run],
    within: float,
    after: float = 0.0,
    exclude: int | None = None,
    fresh: bool = False,
) -> Run | None:
    """The first run starting after `after` by a process other than `exclude`; with
    `fresh`, one whose start line just appeared and that has not ended yet."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        read_runs(arena.runs_dir, runs)
        candidates = sorted(
            (r for r in runs.values() if r.start > after and r.pid != exclude),
            key=lambda r: r.start,
        )
        for run in candidates:
            if not fresh:
                return run
            if run.end is None and time.time() - run.seen < 0.05:
                return run
        await asyncio.sleep(0.005)
    return None


# -- the kill trial -----------------------------------------------------------------------


async def peer_state(arena: Arena) -> dict[str, Any]:
    """What the peer's own tables say (read right after a kill's observation)."""
    conn = await asyncpg.connect(arena.dsn)
    try:
        name = arena.contestant.name
        rows: dict[str, Any] = {}
        if name == "ours":
            rows["runs_by_status"] = dict(
                await conn.fetch(
                    "SELECT status, count(*) FROM scheduler_plugin_runs "
                    "WHERE name = 'peer-job' GROUP BY status"
                )
            )
            task = await conn.fetchrow(
                "SELECT extract(epoch FROM next_run_at - now())::float8 AS next_in_s, "
                "last_status, run_count FROM scheduler_plugin_tasks WHERE name = 'peer-job'"
            )
            rows["task"] = dict(task) if task else None
        elif name.startswith("apscheduler"):
            rows["tasks"] = [
                dict(r)
                for r in await conn.fetch("SELECT id, running_jobs, max_running_jobs FROM tasks")
            ]
            jobs = await conn.fetchrow(
                "SELECT count(*) AS jobs, count(acquired_by) AS acquired, "
                "max(extract(epoch FROM acquired_until - now()))::float8 "
                "AS lease_left_s, "
                "extract(epoch FROM now() - min(created_at))::float8 AS oldest_age_s "
                "FROM jobs"
            )
            rows["jobs"] = dict(jobs)
            rows["job_results_by_outcome"] = {
                str(k): v
                for k, v in await conn.fetch(
                    "SELECT outcome::text, count(*) FROM job_results GROUP BY outcome"
                )
            }
        elif name == "procrastinate":
            rows["jobs_by_status"] = {
                str(k): v
                for k, v in await conn.fetch(
                    "SELECT status::text, count(*) FROM procrastinate_jobs GROUP BY status"
                )
            }
            rows["doing"] = [
                dict(r)
                for r in await conn.fetch(
                    "SELECT j.id, j.worker_id, w.id IS NOT NULL AS worker_registered, "
                    "extract(epoch FROM now() - w.last_heartbeat)::float8 AS heartbeat_age_s, "
                    "extract(epoch FROM now() - (SELECT max(e.at) FROM procrastinate_events e "
                    "WHERE e.job_id = j.id AND e.type = 'started'))::float8 AS started_s_ago "
                    "FROM procrastinate_jobs j "
                    "LEFT JOIN procrastinate_workers w ON w.id = j.worker_id "
                    "WHERE j.status = 'doing' ORDER BY j.id"
                )
            ]
            rows["workers"] = await conn.fetchval("SELECT count(*) FROM procrastinate_workers")
        else:
            rows["advisory_locks_held"] = await conn.fetchval(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
            )
        rows["unfinished_rows"] = await conn.fetchval(
            "SELECT count(*) FROM peer_runs WHERE finished_at IS NULL"
        )
        return rows
    finally:
        await conn.close()


async def state_at(arena: Arena, when: float) -> dict[str, Any]:
    await asyncio.sleep(max(0.0, when - time.time()))
    return await peer_state(arena)


def overlaps(runs: Sequence[Run], ends: dict[str, float]) -> list[tuple[str, str]]:
    """Pairs of runs of different processes whose intervals overlap."""
    spans = sorted(
        ((r.start, ends.get(r.token, r.end if r.end is not None else r.start), r) for r in runs),
        key=lambda s: s[0],
    )
    found = []
    for i, (_, end, run) in enumerate(spans):
        for other_start, _, other in spans[i + 1 :]:
            if other_start >= end:
                break
            if other.pid != run.pid:
                found.append((run.token, other.token))
    return found


def timeline(starts: Sequence[float]) -> dict[str, int]:
    """Duplicates (starts < 0.5 s apart) and lost slots (gaps of 2 s or more)."""
    duplicates = lost = 0
    for before, after in itertools.pairwise(starts):
        gap = after - before
        if gap < DUPLICATE_WITHIN:
            duplicates += 1
        else:
            lost += max(0, round(gap) - 1)
    return {"duplicates": duplicates, "lost": lost}


async def kill_trial(arena: Arena, sizes: Sizes, log: ServerLog) -> dict[str, Any]:
    runs: dict[str, Run] = {}
    log_from = log.offset()
    await initialise(arena)
    began = time.time()
    await grow(arena, 3)
    first = await wait_for_run(arena, runs, within=60)
    if first is None:
        await stop_all([arena])
        raise RuntimeError(f"{arena.contestant.name}: no run within 60 s; see {arena.workdir}")
    await asyncio.sleep(sizes.warmup)
    kills: list[dict[str, Any]] = []
    ends: dict[str, float] = {}  # killed run -> kill time
    for _ in range(sizes.kills):
        victim = await wait_for_run(arena, runs, within=5, after=time.time() - 0.05, fresh=True)
        if victim is None:
            kills.append({"error": "no run started within 5 s: nothing to kill"})
            break
        await asyncio.sleep(max(0.0, victim.seen + 0.05 - time.time()))
        process = next(p for p in arena.processes if p.pid == victim.pid)
        process.kill()
        killed_at = time.time()
        process.wait()
        ends[victim.token] = killed_at
        arena.spawn()
        soon = asyncio.create_task(state_at(arena, killed_at + 1.5))
        successor = await wait_for_run(
            arena, runs, within=sizes.observe, after=killed_at, exclude=victim.pid
        )
        if successor is not None:
            await asyncio.sleep(sizes.settle)
        read_runs(arena.runs_dir, runs)
        state = await peer_state(arena)
        window_end = time.time()
        after = sorted(r.start for r in runs.values() if killed_at < r.start <= window_end)
        event: dict[str, Any] = {
            "killed_pid": victim.pid,
            "killed_into_run_s": killed_at - victim.start,
            "killed_mid_run": runs[victim.token].end is None,
            "observed_s": window_end - killed_at,
            "runs_after_kill": len(after),
            "peer_state_1_5s": await soon,
            "peer_state": state,
        }
        if successor is None:
            event |= {"gap_s": None, "censored_at_s": sizes.observe, "late_s": None}
            event |= {
                "lost": int(window_end - victim.start),
                "duplicates": timeline(after)["duplicates"],
            }
        else:
            gap = successor.start - killed_at
            event |= {
                "gap_s": gap,
                "late_s": successor.start - (victim.start + 1.0),
                "lost": max(0, round(successor.start - victim.start) - 1),
                "duplicates": timeline(after)["duplicates"],
            }
        kills.append(event)
        if successor is None:
            break  # nothing runs any more: no process to kill
    await asyncio.sleep(1.0)
    stopped = time.time()
    await stop_all([arena])
    read_runs(arena.runs_dir, runs)
    ordered = sorted(runs.values(), key=lambda r: r.start)
    pairs = overlaps(ordered, ends)
    rows = await db_runs(arena.dsn)
    summary = timeline([r.start for r in ordered])
    summary["lost"] += max(0, int(stopped - ordered[-1].start) - 1)  # the tail, if blocked
    for event in kills:
        if "killed_pid" in event:
            killed = event["killed_pid"]
            event["overlaps"] = sum(1 for a, b in pairs if killed in (runs[a].pid, runs[b].pid))
    return {
        "label": arena.contestant.label,
        "seconds": time.time() - began,
        "runs": len(ordered),
        "runs_completed": sum(1 for r in ordered if r.end is not None),
        "db_rows": rows["rows"],
        "db_unfinished": rows["unfinished"],
        "db_and_files_agree": rows["rows"] == len(ordered),
        "duplicates": summary["duplicates"],
        "lost": summary["lost"],
        "overlaps": len(pairs),
        "processes_seen": len({r.pid for r in ordered}),
        "kills": kills,
        "server_errors": log.errors_since(log_from),
    }


async def db_runs(dsn: str) -> dict[str, int]:
    conn = await asyncpg.connect(dsn)
    try:
        row = await conn.fetchrow(
            "SELECT count(*) AS rows, count(*) FILTER (WHERE finished_at IS NULL) AS unfinished "
            "FROM peer_runs"
        )
        return dict(row)
    finally:
        await conn.close()


# -- the server log -----------------------------------------------------------------------

# tests/rig/pgcluster.py's log_line_prefix "%m [%p] %a: ": time, backend pid, application
# name (which may itself contain ": "), then the level.
LOG_LINE = re.compile(
    r"^\d{4}-\d\d-\d\d [\d:.]+ \S+ \[(?P<pid>\d+)\] (?P<app>.*?): "
    r"(?P<level>LOG|ERROR|FATAL|PANIC|WARNING|NOTICE|INFO|DEBUG\d?|DETAIL|HINT|STATEMENT|CONTEXT):"
    r"  (?P<message>.*)"
)
STATEMENT = re.compile(r"^(?:statement|execute [^:]*): (?P<sql>.*)", re.DOTALL)


@dataclass(frozen=True)
class ServerLog:
    """The throwaway cluster's log (None when it cannot be read: a server of yours)."""

    path: Path | None

    def offset(self) -> int:
        return self.path.stat().st_size if self.path else 0

    def lines_since(self, offset: int) -> list[str]:
        if self.path is None:
            return []
        with self.path.open("rb") as log:
            log.seek(offset)
            return log.read().decode(errors="replace").splitlines()

    def errors_since(self, offset: int) -> dict[str, Any] | None:
        if self.path is None:
            return None
        errors = [
            match
            for match in map(LOG_LINE.match, self.lines_since(offset))
            if match is not None and match["level"] == "ERROR"
        ]
        examples = sorted({f"{m['app']}: {m['message']}"[:160] for m in errors})
        return {"lines": len(errors), "examples": examples[:5]}


async def find_log(admin: str) -> ServerLog:
    conn = await asyncpg.connect(admin)
    try:
        data = Path(await conn.fetchval("SHOW data_directory"))
    finally:
        await conn.close()
    path = data.parent / "postgres.log"  # tests/rig/pgcluster.py: base_dir/postgres.log
    return ServerLog(path if os.access(path, os.R_OK) else None)


# -- idle cost ---------------------------------------------------------------------------


def tree(pid: int) -> list[int]:
    """`pid` and its descendants (our daemon has a forkserver child)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, []))
    return found


def cpu_seconds(pids: Sequence[int]) -> float:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / CLK_TCK


def memory_mb(pid: int) -> tuple[float, float]:
    """(RSS of the process, PSS of the process and its children), MB."""
    rss = 0.0
    with contextlib.suppress(OSError, IndexError):
        rss = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE_MB
    pss = 0.0
    for member in tree(pid):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{member}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    pss += int(line.split()[1]) / 1024
    return rss, pss


async def settle(arenas: Sequence[Arena], most: float) -> float:
    """Wait until the processes' CPU is quiet (under 2 % of a core plus 0.5 % per
    process, two seconds in a row) or `most` seconds passed; returns the wait."""
    began = time.monotonic()
    quiet = 0
    pids = [pid for arena in arenas for p in arena.live() for pid in tree(p.pid)]
    before = cpu_seconds(pids)
    while time.monotonic() - began < most:
        await asyncio.sleep(1.0)
        pids = [pid for arena in arenas for p in arena.live() for pid in tree(p.pid)]
        now = cpu_seconds(pids)
        processes = sum(len(arena.live()) for arena in arenas)
        quiet = quiet + 1 if now - before < 0.02 + 0.005 * processes else 0
        before = now
        if quiet >= 2:
            break
    # A backend holds back table statistics up to 10 s (PGSTAT_IDLE_INTERVAL) when it
    # flushed less than 1 s before: let the start-up's counts land before the window.
    await asyncio.sleep(max(2.0, 11.0 - (time.monotonic() - began)))
    return time.monotonic() - began


async def idle_window(
    observer: asyncpg.Connection,
    arenas: Sequence[Arena],
    control: str,
    window: float,
    log: ServerLog,
) -> dict[str, Any]:
    names = {arena.contestant.name: arena for arena in arenas}
    databases = {name: arena.dsn.rsplit("/", 1)[1] for name, arena in names.items()}
    databases["control"] = control
    query = (
        "SELECT datname, xact_commit, xact_rollback FROM pg_stat_database WHERE datname = ANY($1)"
    )

    async def counters() -> dict[str, tuple[int, int]]:
        await observer.execute("SELECT pg_stat_clear_snapshot()")
        rows = await observer.fetch(query, list(databases.values()))
        return {r["datname"]: (r["xact_commit"], r["xact_rollback"]) for r in rows}

    processes = {name: [p.pid for p in arena.live()] for name, arena in names.items()}
    trees = {name: [t for pid in pids for t in tree(pid)] for name, pids in processes.items()}
    cpu_before = {name: cpu_seconds(pids) for name, pids in trees.items()}
    log_from = log.offset()
    before = await counters()
    began = time.monotonic()
    backends: dict[int, str] = {}
    samples: dict[str, list[int]] = {name: [] for name in databases}
    while True:
        rows = await observer.fetch(
            "SELECT pid, datname FROM pg_stat_activity "
            "WHERE backend_type = 'client backend' AND datname = ANY($1)",
            list(databases.values()),
        )
        for name, datname in databases.items():
            samples[name].append(sum(1 for r in rows if r["datname"] == datname))
        for r in rows:
            backends[r["pid"]] = r["datname"]
        left = window - (time.monotonic() - began)
        if left <= 0:
            break
        await asyncio.sleep(min(2.0, left))
    elapsed = time.monotonic() - began
    after = await counters()
    cpu_after = {name: cpu_seconds(pids) for name, pids in trees.items()}
    tally = account_log(log.lines_since(log_from), backends, databases)
    empty = {"errors": 0, "error_examples": [], "statements": 0, "transactions": 0, "top": []}
    result: dict[str, Any] = {}
    for name, datname in databases.items():
        commits = after[datname][0] - before[datname][0]
        rollbacks = after[datname][1] - before[datname][1]
        logged = tally.get(name, empty)
        entry: dict[str, Any] = {
            "window_s": elapsed,
            "commits_per_s": commits / elapsed,
            "rollbacks_per_s": rollbacks / elapsed,
            "transactions_per_s_logged": logged["transactions"] / elapsed if log.path else None,
            "statements_per_s_logged": logged["statements"] / elapsed if log.path else None,
            "top_statements": logged["top"],
            "connections": max(samples[name]),
            "connections_min": min(samples[name]),
            "server_error_lines": logged["errors"] if log.path else None,
            "server_error_examples": logged["error_examples"],
        }
        if name in processes:
            pids = processes[name]
            memory = [memory_mb(pid) for pid in pids]
            entry |= {
                "processes": len(pids),
                "cpu_percent_per_process": 100
                * (cpu_after[name] - cpu_before[name])
                / elapsed
                / len(pids),
                "rss_mb_per_process": sum(m[0] for m in memory) / len(pids),
                "pss_mb_per_process_tree": sum(m[1] for m in memory) / len(pids),
            }
        result[name] = entry
    result["unattributed"] = tally.get("unattributed", empty)
    return result


def log_entries(lines: Sequence[str]) -> list[tuple[re.Match[str], str]]:
    """Each log line with a prefix, and its message with the lines that continue it (a
    multi-line statement goes on without a prefix)."""
    entries: list[tuple[re.Match[str], str]] = []
    for line in lines:
        match = LOG_LINE.match(line)
        if match is not None:
            entries.append((match, match["message"]))
        elif entries:
            entries[-1] = (entries[-1][0], entries[-1][1] + "\n" + line)
    return entries


def account_log(
    lines: Sequence[str], backends: dict[int, str], databases: dict[str, str]
) -> dict[str, dict[str, Any]]:
    """Per contestant, from the server log of a window: ERROR lines, statements, and
    transactions (a statement outside BEGIN … COMMIT is one, a block is one; one
    simple-query message of several statements is one implicit transaction), with the
    most frequent statements. A line is the contestant's by the backend's application
    name (each peer sets peer-<name>, ours scheduler-daemon/…), else by its pid as seen in
    pg_stat_activity during the window."""
    by_datname = {datname: name for name, datname in databases.items()}
    tally: dict[str, dict[str, Any]] = {}
    in_block: dict[int, bool] = {}
    for match, message in log_entries(lines):
        app, pid = match["app"], int(match["pid"])
        peer = app.removeprefix("peer-").split("/")[0]
        if app.startswith("scheduler-daemon/"):
            name = "ours"
        elif app.startswith("peer-") and peer in databases:
            name = peer
        else:
            name = by_datname.get(backends.get(pid, ""), "unattributed")
        entry = tally.setdefault(
            name, {"errors": 0, "error_examples": [], "statements": 0, "transactions": 0, "top": {}}
        )
        if match["level"] == "ERROR":
            entry["errors"] += 1
            if message[:120] not in entry["error_examples"][:3]:
                entry["error_examples"].append(message[:120])
            continue
        statement = STATEMENT.match(message) if match["level"] == "LOG" else None
        if statement is None:
            continue
        entry["statements"] += 1
        sql = " ".join(
            part.strip()
            for part in statement["sql"].splitlines()
            if part.strip() and not part.strip().startswith("--")
        )
        entry["top"][sql[:100]] = entry["top"].get(sql[:100], 0) + 1
        implicit = False
        pieces = [p.strip().upper() for p in sql.split(";") if p.strip()]
        if not pieces and not in_block.get(pid, False):
            entry["transactions"] += 1  # an empty query (psycopg sends them) is one too
        for piece in pieces:
            if piece.startswith(("BEGIN", "START TRANSACTION")):
                in_block[pid] = True
            elif piece.startswith(("COMMIT", "END", "ABORT")) or (
                piece.startswith("ROLLBACK") and not piece.startswith("ROLLBACK TO")
            ):
                if in_block.pop(pid, False):
                    entry["transactions"] += 1
                implicit = False
            elif not in_block.get(pid, False) and not implicit:
                entry["transactions"] += 1
                implicit = True
    for entry in tally.values():
        top = sorted(entry["top"].items(), key=lambda kv: -kv[1])[:6]
        entry["top"] = [{"statement": sql, "count": count} for sql, count in top]
        del entry["error_examples"][3:]
    return tally


async def idle_cost(
    admin: str, work: Path, pythons: dict[str, str], sizes: Sizes, log: ServerLog
) -> list[dict[str, Any]]:
    arenas = []
    for contestant in CONTESTANTS:
        dsn = await prepare(
            admin, contestant, f"bench_peers_idle_{contestant.name.replace('-', '_')}"
        )
        arena = Arena(
            contestant, dsn, work / f"idle-{contestant.name}", pythons[contestant.name], "idle"
        )
        arena.runs_dir.mkdir(parents=True, exist_ok=True)
        await initialise(arena)
        arenas.append(arena)
    control = "bench_peers_idle_control"
    await drop_database(admin, control, grace=0)
    await create_database(admin, control)
    if log.path is not None:
        # Every statement of the contestants' sessions goes to the log: pg_stat_database
        # alone undercounts (see the module docstring).
        conn = await asyncpg.connect(admin)
        try:
            for datname in [*(a.dsn.rsplit("/", 1)[1] for a in arenas), control]:
                await conn.execute(f"ALTER DATABASE \"{datname}\" SET log_statement = 'all'")
        finally:
            await conn.close()
    observer = await asyncpg.connect(admin)
    windows = []
    try:
        for count in sizes.idle_sizes:
            for arena in arenas:
                await grow(arena, count)
            waited = await settle(arenas, sizes.idle_settle_max)
            for arena in arenas:
                if len(arena.live()) != count:
                    raise RuntimeError(
                        f"{arena.contestant.name}: a process died; see {arena.workdir}"
                    )
            print(
                f"bench.peers: idle, {count} per contestant (settled in {waited:.0f} s)", flush=True
            )
            window = await idle_window(observer, arenas, control, sizes.idle_window, log)
            windows.append({"processes": count, "settled_s": waited, "contestants": window})
    finally:
        await observer.close()
        await stop_all(arenas)
    return windows


# -- report and plots ---------------------------------------------------------------------


def describe(name: str, trial: dict[str, Any]) -> str:
    """What the contestant does after a kill, in words, from what was observed."""
    kills = [k for k in trial["kills"] if "killed_pid" in k]
    if not kills:
        return "no kill happened"
    first = kills[0]
    state = kills[-1]["peer_state"]  # cumulative: after the last kill
    gaps = [k["gap_s"] for k in kills if k["gap_s"] is not None]
    late = [k["late_s"] for k in kills if k["late_s"] is not None]
    if name == "ours":
        runs = state.get("runs_by_status", {})
        timing = (
            f"the next slot ran at most {max(late):.2f} s late"
            if late
            else "no run followed within the window"
        )
        return (
            "a standby takes the advisory lock as soon as the killed leader's session ends "
            f"and leads; {timing}. The killed run is recorded `abandoned` by the new leader "
            f"({runs.get('abandoned', 0)} after {len(kills)} kills) and never re-run; the "
            "unique (name, slot) claim keeps any slot from running twice."
        )
    if name.startswith("apscheduler"):
        soon = first["peer_state_1_5s"]
        tasks = soon.get("tasks") or [{}]
        jobs = first["peer_state"].get("jobs", {})
        lease = TUNED_LEASE if name.endswith("tuned") else 30.0
        cleanup = f"{TUNED_CLEANUP:g} s" if name.endswith("tuned") else "15 min"
        blocked = first["gap_s"] is None
        text = (
            f"the killed job stays in `jobs`, acquired by the dead scheduler (lease {lease:g} s), "
            f"and the task's `running_jobs` stays at {tasks[0].get('running_jobs')} "
            f"(max_running_jobs = 1; read 1.5 s after the kill), so no other scheduler starts "
            "it; a new job is still "
            "queued every second. Only `cleanup()` (every "
            f"{cleanup}, and once when a scheduler starts) releases a job whose lease expired. "
        )
        if blocked:
            text += (
                f"Nothing ran for the {first['observed_s']:.0f} s observed; "
                f"{jobs.get('jobs')} jobs were queued by then. Until the next cleanup after "
                "the lease expires (up to 15 min), then the queued backlog runs one by one."
            )
        else:
            text += (
                f"Here the next run came {min(gaps):.1f}"
                + (f" to {max(gaps):.1f}" if max(gaps) - min(gaps) >= 0.05 else "")
                + " s after the kill, then "
                "the jobs queued meanwhile ran back to back (the duplicates)."
            )
        return text
    if name == "procrastinate":
        doing = stuck(state)
        dead = [j for j in state.get("doing", []) if (j["started_s_ago"] or 0) > 1] or [{}]
        timing = (
            ("on time" if max(late) <= 0.05 else f"at most {max(late):.2f} s late")
            if late
            else "not within the window"
        )
        return (
            "every worker's periodic deferrer defers each second's job (the database "
            "refuses a second defer of one timestamp) and any free worker fetches it, so the "
            f"schedule goes on ({timing}). The killed job stays `doing` ({doing} after "
            f"{len(kills)} kills), still assigned to the dead worker, whose heartbeat stops "
            f"({dead[0].get('heartbeat_age_s') or 0:.0f} s old when read): nothing retries "
            "it (procrastinate documents a periodic task of your own that calls "
            "`get_stalled_jobs` and retries them), and a worker starting more than 30 s later "
            "only deletes the dead worker's row (the job's worker_id becomes NULL): the job "
            "stays `doing` forever."
        )
    return (
        "the killed process's session ends and its advisory lock with it; the others' "
        "next ticks take it. No state is left behind, but there is no notion of a slot "
        "either: each process runs the job on every tick that finds the lock free, so "
        "the 1 s job runs up to once per process per second (the duplicates)."
    )


def pinned(env: dict[str, Any]) -> str:
    """The pinned distributions as `pip freeze` shows them."""
    names = {re.sub(r"[\[=].*", "", r).lower() for r in env["requirements"]}
    return ", ".join(f for f in env["freeze"] if f.split("==")[0].lower() in names)


def fmt_gap(kill: dict[str, Any]) -> str:
    if "killed_pid" not in kill:
        return "—"
    if kill["gap_s"] is None:
        return f"≥ {kill['censored_at_s']:.0f}"
    return f"{kill['gap_s']:.2f}"


def report(results: dict[str, Any]) -> str:
    sizes = results["sizes"]
    lines = [
        f"# Beside real peers ({results['date']}, {results['machine']})",
        "",
        "Same job for all (insert a row with the pid and clock_timestamp(), sleep 0.2 s, "
        "update the row; a start and an end line per run in a file per process), 3 "
        "processes, durable throwaway PostgreSQL "
        f"{results['postgres']}. Peers from PyPI, each in its own venv: "
        + "; ".join(pinned(env) for name, env in results["versions"].items() if "freeze" in env)
        + f". Ours {results['versions']['ours']['scheduler-daemon']} at "
        f"{results['versions']['ours']['commit']}.",
        "",
        "## SIGKILL of the process running the job, mid-run",
        "",
        f"{sizes['kills']} kill(s) per contestant after {sizes['warmup']:g} s of running; a "
        "replacement process is started at once. Gap = next run's start - kill; late = "
        "that start - (killed run's start + 1 s). Duplicates: starts < 0.5 s apart; "
        "overlaps: intervals of two processes that overlap (from the files); lost: 1 s "
        "slots with no run start. '≥ N': nothing ran in the N s observed.",
        "",
        "| contestant | gap per kill (s) | late p50 (s) | runs | duplicates | overlaps | lost "
        "| left behind (peer's tables) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, trial in results["kill"].items():
        kills = [k for k in trial["kills"] if "killed_pid" in k]
        late = [k["late_s"] for k in kills if k["late_s"] is not None]
        lines.append(
            f"| {trial['label']} | {', '.join(fmt_gap(k) for k in kills)} "
            f"| {percentile(late, 0.5):.2f} | {trial['runs']} | {trial['duplicates']} "
            f"| {trial['overlaps']} | {trial['lost']} | {left_behind(name, kills)} |"
            if late
            else f"| {trial['label']} | {', '.join(fmt_gap(k) for k in kills)} | — "
            f"| {trial['runs']} | {trial['duplicates']} | {trial['overlaps']} | {trial['lost']} "
            f"| {left_behind(name, kills)} |"
        )
    lines += [
        "",
        "Per kill (killed = how far into its 0.2 s run the process was; lost, duplicates "
        "and overlaps counted from the killed run to the end of that kill's observation):",
        "",
        "| contestant | kill | killed at | gap (s) | late (s) | lost | duplicates | overlaps |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for trial in results["kill"].values():
        for number, kill in enumerate(trial["kills"], 1):
            if "killed_pid" not in kill:
                lines.append(f"| {trial['label']} | {number} | {kill.get('error')} |" + " — |" * 5)
                continue
            late = "—" if kill["late_s"] is None else f"{kill['late_s']:+.2f}"
            where = f"{kill['killed_into_run_s'] * 1000:.0f} ms" + (
                "" if kill["killed_mid_run"] else " (run had ended)"
            )
            lines.append(
                f"| {trial['label']} | {number} | {where} | {fmt_gap(kill)} | {late} "
                f"| {kill['lost']} | {kill['duplicates']} | {kill.get('overlaps', 0)} |"
            )
    lines += [
        "",
        "A negative 'late' is a next run less than 1 s after the killed one's start: the "
        "seed design has no schedule (another process's tick comes sooner); procrastinate "
        "runs a job when a worker fetches it, some time after its whole second, so the "
        "killed run may itself have started late.",
        "",
        "What each does after a kill:",
        "",
    ]
    for name, trial in results["kill"].items():
        lines.append(f"- **{trial['label']}**: {describe(name, trial)}")
    errors = [
        f"{t['label']} {t['server_errors']['lines']}"
        + "".join(f" (`{m}`)" for m in t["server_errors"]["examples"][:2])
        for t in results["kill"].values()
        if t["server_errors"]
    ]
    if errors:
        lines += [
            "",
            "Server ERROR lines during each kill trial (start-ups included): "
            + ", ".join(errors)
            + ".",
        ]
    lines += [
        "",
        "## Idle cost",
        "",
        f"Nothing due (cron `{IDLE_CRON}`); all contestants idle side by side, each in "
        f"its own database; {sizes['idle_window']:g} s windows once the processes' CPU "
        "settled. Transactions/s: every statement of the contestant's sessions, from the "
        "server log (log_statement = all on its database), a statement outside BEGIN … "
        "COMMIT or a whole block counting one. Commits/s and rollbacks/s: what "
        "pg_stat_database reports for the same window, which misses most transactions "
        "that read no table (a lock try, a `SELECT 1`): PostgreSQL 15 only flushes a "
        "backend's transaction counts with table statistics, or when it disconnects. The "
        "observer works in another database; the control database has no client. "
        "Connections from pg_stat_activity (max over the window); CPU % of one core and "
        "memory per process (PSS includes children: ours has a forkserver); ERROR lines "
        "the server logged in the window.",
        "",
        "| contestant | processes | transactions/s | commits/s (pg_stat) | rollbacks/s "
        "| connections | CPU %/process | RSS MB/process | PSS MB/process | ERROR lines |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    labels = {c.name: c.label for c in CONTESTANTS}

    def number(value: float | None, digits: int = 2) -> str:
        return "—" if value is None else f"{value:.{digits}f}"

    for name in [*labels, "control"]:
        for window in results["idle"]:
            e = window["contestants"][name]
            errors = "—" if e["server_error_lines"] is None else str(e["server_error_lines"])
            logged = number(e["transactions_per_s_logged"])
            if name == "control":
                lines.append(
                    f"| control (no client) | 0 | {logged} | {e['commits_per_s']:.2f} "
                    f"| {e['rollbacks_per_s']:.2f} | {e['connections']} | — | — | — | {errors} |"
                )
                break
            lines.append(
                f"| {labels[name]} | {e['processes']} | {logged} | {e['commits_per_s']:.2f} "
                f"| {e['rollbacks_per_s']:.2f} | {e['connections']} "
                f"| {e['cpu_percent_per_process']:.2f} | {e['rss_mb_per_process']:.0f} "
                f"| {e['pss_mb_per_process_tree']:.0f} | {errors} |"
            )
    examples = sorted(
        {
            f"{labels.get(name, name)}: `{m}`"
            for w in results["idle"]
            for name, e in w["contestants"].items()
            for m in e.get("server_error_examples", e.get("error_examples", []))
        }
    )
    if examples:
        lines += ["", "Server ERROR messages while idle: " + "; ".join(examples) + "."]
    sample = next((w for w in results["idle"] if w["processes"] == 3), results["idle"][-1])
    if results["server_log_read"]:
        lines += [
            "",
            f"What the idle transactions are ({sample['processes']} processes, "
            f"{sample['contestants']['ours']['window_s']:.0f} s, most frequent statements):",
            "",
        ]
        for name in labels:
            top = sample["contestants"][name]["top_statements"][:4]
            shown = (
                "; ".join(f"{t['count']} x `{t['statement'] or '(empty query)'}`" for t in top)
                or "none"
            )
            lines.append(f"- {labels[name]}: {shown}")
    lines += [
        "",
        "Plots: " + ", ".join(f"`{name}`" for name in PLOTS) + ".",
        "",
    ]
    return "\n".join(lines)


def stuck(state: dict[str, Any]) -> int:
    """procrastinate jobs `doing` for more than 1 s (the job takes 0.2 s): killed ones."""
    return sum(1 for job in state.get("doing", []) if (job["started_s_ago"] or 0) > 1)


def left_behind(name: str, kills: Sequence[dict[str, Any]]) -> str:
    if not kills:
        return "—"
    state = kills[-1]["peer_state"]
    if name == "ours":
        runs = state.get("runs_by_status", {})
        return f"`abandoned` runs: {runs.get('abandoned', 0)}"
    if name.startswith("apscheduler"):
        soon = kills[-1]["peer_state_1_5s"]
        jobs = soon.get("jobs", {})
        tasks = soon.get("tasks") or [{}]
        return (
            f"1.5 s after the kill: running_jobs = {tasks[0].get('running_jobs')}, "
            f"{jobs.get('jobs')} jobs in `jobs`, {jobs.get('acquired')} acquired by the dead "
            f"scheduler (lease {max(0.0, jobs.get('lease_left_s') or 0):.1f} s left)"
        )
    if name == "procrastinate":
        return f"jobs `doing` forever: {stuck(state)}"
    return "nothing"


def plot(results: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    labels = {c.name: c.label for c in CONTESTANTS}
    names = list(results["kill"])
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, name in enumerate(names):
        kills = [k for k in results["kill"][name]["kills"] if "killed_pid" in k]
        done = [k["gap_s"] for k in kills if k["gap_s"] is not None]
        censored = [k["censored_at_s"] for k in kills if k["gap_s"] is None]
        ax.scatter([i] * len(done), done, color="C0", zorder=3)
        if censored:
            ax.scatter([i] * len(censored), censored, marker="^", color="C3", zorder=3)
            ax.annotate(
                f"nothing ran for ≥ {censored[0]:.0f} s",
                (i, censored[0]),
                textcoords="offset points",
                xytext=(8, -4),
                fontsize=8,
                color="C3",
            )
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks(range(len(names)), [labels[n].replace(", ", ",\n") for n in names], fontsize=8)
    ax.set_yscale("log")
    ax.set_yticks(
        [0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50], ["0.1", "0.2", "0.5", "1", "2", "5", "10", "20", "50"]
    )
    ax.minorticks_off()
    ax.set_ylabel("kill → next run by another process (s)")
    ax.set_title("Failover gap after SIGKILL mid-run (1 s job; dashed: the period)")
    fig.tight_layout()
    path = out / "peers_failover.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path.name)

    counts = [w["processes"] for w in results["idle"]]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    key = "transactions_per_s_logged" if results["server_log_read"] else "commits_per_s"
    for name in labels:
        ax.plot(
            counts,
            [w["contestants"][name][key] for w in results["idle"]],
            marker="o",
            label=labels[name],
        )
    ax.set_xlabel("idle processes")
    ax.set_ylabel(
        "transactions / s (server statement log)"
        if results["server_log_read"]
        else "commits / s (pg_stat_database)"
    )
    ax.set_xticks(counts)
    ax.set_title("Idle cost to the database")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "peers_idle_commits.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path.name)

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    metrics = [
        ("connections", "open connections"),
        ("cpu_percent_per_process", "CPU % of a core, per process"),
        ("pss_mb_per_process_tree", "PSS MB per process"),
    ]
    for ax, (key, title) in zip(axes, metrics, strict=True):
        for name in labels:
            ax.plot(
                counts,
                [w["contestants"][name][key] for w in results["idle"]],
                marker="o",
                label=labels[name],
            )
        ax.set_xlabel("idle processes")
        ax.set_title(title)
        ax.set_xticks(counts)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    path = out / "peers_idle_resources.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path.name)
    return written


# -- many schedules ---------------------------------------------------------------------------

SCALE_PERIOD = 10.0  # s: every schedule runs every 10 s
SCALE_PROCESSES = 3
SCALE_GRACE = 5.0  # s after the window before the processes are stopped
SCALE_LEAD = 5.0  # s from inserting our rows to their first slots
ON_GRID = 0.01  # s: a recorded slot this close to one of its schedule's slots is that slot
SCALE_DB = "bench_peers_scale_{}"


@dataclass(frozen=True)
class ScaleContestant:
    name: str
    label: str
    venv: str | None  # a PEER_ENVS key, or None for our daemon
    script: str | None
    options: tuple[str, ...] = ()


SCALE_CONTESTANTS = (
    ScaleContestant("ours", "ours (scheduler-daemon, defaults)", None, None),
    ScaleContestant(
        "apscheduler", "APScheduler 4, defaults", "apscheduler", "apscheduler_scale.py"
    ),
    ScaleContestant(
        "apscheduler-unlimited",
        "APScheduler 4, max_running_jobs None",
        "apscheduler",
        "apscheduler_scale.py",
        ("--unlimited",),
    ),
    ScaleContestant(
        "procrastinate", "procrastinate, defaults", "procrastinate", "procrastinate_scale.py"
    ),
    ScaleContestant(
        "procrastinate-c100",
        "procrastinate, concurrency 100",
        "procrastinate",
        "procrastinate_scale.py",
        ("--concurrency", "100"),
    ),
)


@dataclass(frozen=True)
class ScaleSizes:
    counts: tuple[int, ...] = (1_000, 10_000)
    periods: int = 3  # the window: this many periods of 10 s
    ready_within: float = 180.0


QUICK_SCALE = ScaleSizes(counts=(1_000,), periods=1)


@dataclass
class ScaleArena:
    """One contestant with `count` schedules: its database, directory and processes."""

    contestant: ScaleContestant
    count: int
    dsn: str
    workdir: Path
    python: str
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def runs_dir(self) -> Path:
        return self.workdir / "runs"

    def environment(self) -> dict[str, str]:
        return {
            "PYTHONPATH": str(HELPERS),
            "PEER_DSN": self.dsn,
            "PEER_RUNS_DIR": str(self.runs_dir),
            "PEER_CONTESTANT": self.contestant.name,
        }

    def peer_command(self, *arguments: str, dsn: str | None = None) -> list[str]:
        assert self.contestant.script is not None
        return [self.python, str(HELPERS / self.contestant.script), dsn or self.dsn, *arguments]

    # Where process n runs and the DSN it connects with: here, this host as it is;
    # bench/latency_peers.py puts each process in a network namespace of its own.
    def prefix(self, n: int) -> list[str]:
        return []

    def process_dsn(self, n: int) -> str:
        return self.dsn

    def peer_environment(self) -> dict[str, str]:
        outside = {k: v for k, v in os.environ.items() if not k.startswith("SCHEDULER_")}
        return outside | self.environment()

    def spawn(self) -> subprocess.Popen[bytes]:
        n = len(self.processes)
        workdir = self.workdir / f"p{n + 1}"
        workdir.mkdir(parents=True, exist_ok=True)
        if self.contestant.script is None:
            config = self.workdir / "scale.toml"
            env = self.environment() | {"SCHEDULER_CONFIG": str(config)}
            process = start_daemon(
                self.process_dsn(n), workdir, only="plugin", env=env, prefix=self.prefix(n)
            )
        else:
            name = self.contestant.name
            arguments = (
                ["--run"] if name.startswith("apscheduler") else ["--count", str(self.count)]
            )
            with (workdir / "peer.log").open("ab") as log:
                command = self.peer_command(
                    *arguments, *self.contestant.options, dsn=self.process_dsn(n)
                )
                process = subprocess.Popen(
                    [*self.prefix(n), *command],
                    env=self.peer_environment(),
                    cwd=workdir,
                    stdout=subprocess.DEVNULL,
                    stderr=log,
                )
        self.processes.append(process)
        return process

    def live(self) -> list[subprocess.Popen[bytes]]:
        return [p for p in self.processes if p.poll() is None]


async def helper(arena: ScaleArena, log_name: str, *arguments: str) -> float:
    """Run the contestant's helper script once (a setup step); returns its seconds."""
    began = time.monotonic()
    with (arena.workdir / log_name).open("ab") as log:
        process = await asyncio.create_subprocess_exec(
            *arena.peer_command(*arguments),
            env=arena.peer_environment(),
            stdout=log,
            stderr=log,
        )
        if await process.wait() != 0:
            raise RuntimeError(f"{arena.contestant.name}: {arguments[0]} failed; see {log.name}")
    return time.monotonic() - began


async def scale_setup(arena: ScaleArena) -> tuple[float, list[float], float]:
    """Create the schedules; returns T0 (epoch s), each schedule's offset from T0 (its
    first slot is T0 + offset, then every period) and the seconds the setup took."""
    name, count, period = arena.contestant.name, arena.count, SCALE_PERIOD
    spread = [i * period / count for i in range(count)]
    began = time.monotonic()
    if name == "ours":
        (arena.workdir / "scale.toml").write_text(
            "[plugin]\nentry_points = false\n"
            'disabled = ["purge_publications"]\nrunnable = ["scalejob:ours"]\n'
        )
        conn = await asyncpg.connect(arena.dsn)
        try:
            # As a leader's take-over would: the trigger refuses targets not listed.
            await conn.execute(
                "INSERT INTO scheduler_runnable_targets (target) VALUES ('scalejob:ours')"
            )
            t0 = time.time() + SCALE_LEAD
            await conn.execute(
                "INSERT INTO scheduler_plugin_tasks (name, target, every_seconds, next_run_at) "
                "SELECT 's' || lpad(i::text, 5, '0'), 'scalejob:ours', $2, "
                "to_timestamp($3::float8 + i * $2::float8 / $1) "
                "FROM generate_series(0, $1 - 1) i",
                count,
                period,
                t0,
            )
            await conn.execute("VACUUM ANALYZE scheduler_plugin_tasks")
        finally:
            await conn.close()
        return t0, spread, time.monotonic() - began
    if name.startswith("apscheduler"):
        # Schedules added before the schedulers start, their first slots a little after
        # the adds should end (a late first slot runs at once, in the warm-up).
        t0 = time.time() + 3.0 + count / 400
        await helper(
            arena,
            "add.log",
            "--add",
            str(count),
            "--t0",
            f"{t0:.6f}",
            "--period",
            f"{period:g}",
            *arena.contestant.options,
        )
        return t0, spread, time.monotonic() - began
    # procrastinate: the periodic tasks are code (every worker declares all N); whole
    # seconds only, so the ten phases of a 10 s period, on the wall clock's grid.
    await helper(arena, "schema.log", "--apply-schema")
    t0 = math.floor(time.time() / period) * period
    return t0, [float(i % int(period)) for i in range(count)], time.monotonic() - began


async def scale_ready(arena: ScaleArena, within: float) -> None:
    """Ours: a plugin leader is recorded (and a moment for its take-over tick); a peer:
    every process wrote its ready file (its schedules declared or its scheduler up)."""
    deadline = time.monotonic() + within
    conn = await asyncpg.connect(arena.dsn)
    try:
        while time.monotonic() < deadline:
            if len(arena.live()) < len(arena.processes):
                raise RuntimeError(f"{arena.contestant.name}: a process died; see {arena.workdir}")
            if arena.contestant.script is None:
                if await conn.fetchval(
                    "SELECT count(*) FROM scheduler_leaders WHERE loop = 'plugin'"
                ):
                    await asyncio.sleep(1.0)
                    return
            elif len(list(arena.runs_dir.glob("*.ready"))) >= len(arena.processes):
                return
            await asyncio.sleep(0.2)
    finally:
        await conn.close()
    raise RuntimeError(f"{arena.contestant.name}: not ready within {within:g} s")


async def until(epoch: float) -> None:
    await asyncio.sleep(max(0.0, epoch - time.time()))


async def database_backends(admin: str, datname: str) -> list[int]:
    conn = await asyncpg.connect(admin)
    try:
        rows = await conn.fetch(
            "SELECT pid FROM pg_stat_activity WHERE datname = $1 AND backend_type = 'client backend'",
            datname,
        )
        return [r["pid"] for r in rows]
    finally:
        await conn.close()


async def database_commits(admin: str, datname: str) -> int:
    conn = await asyncpg.connect(admin)
    try:
        await conn.execute("SELECT pg_stat_clear_snapshot()")
        value: int = await conn.fetchval(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = $1", datname
        )
        return value
    finally:
        await conn.close()


def read_slots(runs_dir: Path) -> list[tuple[str, float, float, int]]:
    """Every (schedule, slot, start, pid) line of the per-process files."""
    records = []
    for path in runs_dir.glob("*.slots"):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 4:
                records.append((parts[0], float(parts[1]), float(parts[2]), int(parts[3])))
    return records


def tally_slots(
    records: Sequence[tuple[str, float, float, int]],
    t0: float,
    offsets: Sequence[float],
    first: int,
    periods: int,
    window: tuple[float, float],
) -> dict[str, Any]:
    """Slot k of schedule i is T0 + offset_i + k * period; the window's slots are k in
    [first, first + periods). Runs per slot (duplicates: a slot run more than once, over
    the whole run), the window's slots not run, lateness = start - slot of each window
    slot's first run, and the runs that *started* in the wall-clock window."""
    count = len(offsets)
    runs: Counter[tuple[int, int]] = Counter()
    started: dict[tuple[int, int], float] = {}
    off_grid = 0
    in_window = 0
    by_process: Counter[int] = Counter()
    for schedule, slot, start, pid in records:
        if window[0] <= start < window[1]:
            in_window += 1
            by_process[pid] += 1
        i = int(schedule.lstrip("s"))
        base = t0 + offsets[i]
        k = round((slot - base) / SCALE_PERIOD)
        if abs(slot - (base + k * SCALE_PERIOD)) > ON_GRID:
            off_grid += 1
            continue
        runs[(i, k)] += 1
        started[(i, k)] = min(start, started.get((i, k), math.inf))
    wanted = range(first, first + periods)
    ran = [key for key in runs if key[1] in wanted]
    late = [started[(i, k)] - (t0 + offsets[i] + k * SCALE_PERIOD) for i, k in ran]
    seconds = window[1] - window[0]
    return {
        "runs_recorded": len(records),
        "runs_per_s_needed": count / SCALE_PERIOD,
        "runs_per_s": in_window / seconds,
        "slots_expected": count * periods,
        "slots_ran": len(ran),
        "slots_not_run": count * periods - len(ran),
        "schedules_without_run": count - len({i for i, _ in ran}),
        "duplicates": sum(n - 1 for n in runs.values()),
        "slots_run_twice": sum(1 for n in runs.values() if n > 1),
        "off_grid_runs": off_grid,
        "lateness_s": {
            "p50": percentile(late, 0.5) if late else None,
            "p99": percentile(late, 0.99) if late else None,
            "max": max(late) if late else None,
        },
        "window_runs_by_process": sorted(by_process.values(), reverse=True),
    }


def lasting_cpu(before: dict[int, float]) -> tuple[list[int], float]:
    """CPU seconds since `before` of the processes still there (a pool may close a
    connection: its backend's pid is gone, or even reused)."""
    lasting = [pid for pid in before if Path(f"/proc/{pid}").exists()]
    spent = {pid: cpu_seconds([pid]) - before[pid] for pid in lasting}
    kept = [pid for pid in lasting if spent[pid] >= 0]
    return kept, sum(spent[pid] for pid in kept)


def scale_window(t0: float, ready_at: float, periods: int) -> tuple[int, float, float]:
    """The measured window: the index of its first slot (slot k of a schedule is at
    T0 + offset + k periods), its start and its end, `periods` periods later.

    At least one whole period between ready and the window: start-up catch-up (a first
    slot that passed during the adds, procrastinate's deferral of each schedule's
    previous slot) stays out of it."""
    first = max(1, math.ceil((ready_at - t0) / SCALE_PERIOD) + 1)
    w0 = t0 + first * SCALE_PERIOD
    return first, w0, w0 + periods * SCALE_PERIOD


async def scale_trial(admin: str, arena: ScaleArena, sizes: ScaleSizes) -> dict[str, Any]:
    datname = arena.dsn.rsplit("/", 1)[1]
    arena.runs_dir.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    t0, offsets, setup_s = await scale_setup(arena)
    began = time.monotonic()
    try:
        for _ in range(SCALE_PROCESSES):
            arena.spawn()
        await scale_ready(arena, sizes.ready_within)
        ready_at = time.time()
        startup_s = time.monotonic() - began
        first, w0, w1 = scale_window(t0, ready_at, sizes.periods)
        await until(w0)
        pids = [pid for p in arena.live() for pid in tree(p.pid)]
        backends = await database_backends(admin, datname)
        cpu0, db0 = cpu_seconds(pids), {pid: cpu_seconds([pid]) for pid in backends}
        commits0 = await database_commits(admin, datname)
        load_start = os.getloadavg()
        m0 = time.monotonic()
        await until(w1)
        cpu1 = cpu_seconds(pids)
        lasting, db_cpu = lasting_cpu(db0)
        elapsed = time.monotonic() - m0
        commits1 = await database_commits(admin, datname)
        load_end = os.getloadavg()
        alive = len(arena.live())
        await until(w1 + SCALE_GRACE)
    finally:
        await stop_all([arena])
    result = tally_slots(read_slots(arena.runs_dir), t0, offsets, first, sizes.periods, (w0, w1))
    result |= {
        "label": arena.contestant.label,
        "schedules": arena.count,
        "processes": SCALE_PROCESSES,
        "processes_alive_at_end": alive,
        "setup_s": setup_s,
        "startup_s": startup_s,
        "warmup_s": w0 - ready_at,
        "window_s": w1 - w0,
        "cpu_percent": 100 * (cpu1 - cpu0) / elapsed,
        "db_cpu_percent": 100 * db_cpu / elapsed,
        "db_backends": len(backends),
        "db_backends_lasting": len(lasting),
        "commits_per_s": (commits1 - commits0) / elapsed,
        "load_average": {
            "before": load_before[0],
            "window_start": load_start[0],
            "window_end": load_end[0],
        },
    }
    return result


async def scale_database(admin: str, contestant: ScaleContestant, database: str) -> str:
    """A fresh, empty database: ours migrated, a peer's left to create its own schema."""
    if contestant.script is None:
        return await fresh_database(admin, database)
    await drop_database(admin, database, grace=0)
    await create_database(admin, database)
    return admin.rsplit("/", 1)[0] + f"/{database}"


async def scale_bench(
    admin: str, work: Path, sizes: ScaleSizes, pythons: dict[str, str], names: Sequence[str]
) -> list[dict[str, Any]]:
    """Each contestant alone (one after another), on a database of its own."""
    trials = []
    for count in sizes.counts:
        for contestant in SCALE_CONTESTANTS:
            if contestant.name not in names:
                continue
            database = SCALE_DB.format(contestant.name.replace("-", "_"))
            dsn = await scale_database(admin, contestant, database)
            python = pythons[contestant.venv] if contestant.venv else sys.executable
            arena = ScaleArena(
                contestant, count, dsn, work / f"scale-{count}-{contestant.name}", python
            )
            print(f"bench.peers: scale, {contestant.name}, {count} schedules", flush=True)
            try:
                trial = await scale_trial(admin, arena, sizes)
            except RuntimeError as error:
                trial = {"label": contestant.label, "schedules": count, "error": str(error)}
            trial["name"] = contestant.name
            trials.append(trial)
            print(
                f"bench.peers: scale, {contestant.name}, {count}: {scale_line(trial)}", flush=True
            )
            await drop_database(admin, database, grace=0)
    return trials


def scale_line(trial: dict[str, Any]) -> str:
    if "error" in trial:
        return f"error: {trial['error']}"
    late = trial["lateness_s"]
    return (
        f"{trial['runs_per_s']:.0f} of {trial['runs_per_s_needed']:.0f} runs/s, "
        f"lateness p50 {fmt_seconds(late['p50'])} p99 {fmt_seconds(late['p99'])}, "
        f"{trial['slots_not_run']:,} of {trial['slots_expected']:,} not run, "
        f"{trial['duplicates']} duplicates, CPU {trial['cpu_percent']:.0f}%"
    )


def fmt_seconds(value: float | None) -> str:
    if value is None:
        return "—"
    if abs(value) < 1:
        return f"{value * 1000:.1f} ms"
    return f"{value:.2f} s"


def scale_report(results: dict[str, Any]) -> str:
    sizes = results["sizes"]
    versions = results["versions"]
    window = sizes["periods"] * SCALE_PERIOD
    lines = [
        f"# Many schedules beside real peers ({results['date']}, {results['machine']})",
        "",
        f"N schedules every {SCALE_PERIOD:g} s, a no-op async job that appends one line per "
        "run (schedule, slot, start, pid) to a file per process; "
        f"{SCALE_PROCESSES} processes per contestant, each contestant alone on the machine "
        "(one after another) with a database of its own on the durable throwaway "
        f"PostgreSQL {results['postgres']}. Peers from PyPI, each in its own venv: "
        + "; ".join(pinned(env) for env in versions.values() if "freeze" in env)
        + f". Ours {versions['ours']['scheduler-daemon']} at {versions['ours']['commit']}.",
        "",
        "- **ours**: runtime schedule rows (`scheduler_plugin_tasks`, target "
        "`scalejob:ours` listed in `plugin.runnable`), slots spread over the period "
        "(schedule i at T0 + i·10 s/N), `run --only plugin`, defaults "
        "(`plugin.concurrency` 100);",
        "- **APScheduler 4**: `add_schedule` with `IntervalTrigger(seconds=10, "
        "start_time=T0 + i·10 s/N)`, one task (function) for all schedules, "
        "SQLAlchemyDataStore on asyncpg and AsyncpgEventBroker, defaults: "
        "`max_running_jobs` 1 *per task*, so one job at a time across all schedulers; the "
        "second row sets it to None, what a user with one function and many schedules "
        "must do;",
        "- **procrastinate**: periodic tasks are code, so every worker declares all N "
        "(`app.periodic` N times on one task, a `periodic_id` and `task_kwargs` each); its "
        "cron has whole seconds, so the N are spread over the ten phases of the period "
        "(a tenth due at each whole second); worker defaults (concurrency 1), then "
        "concurrency 100.",
        "",
        f"After all processes are up, at least one period of warm-up, then a {window:g} s "
        "window: the slots of the window are each schedule's "
        f"{sizes['periods']} slots in it. Runs/s: runs that started in the window / "
        f"{window:g} s. Lateness: start (wall clock, in the job) - slot, for each window "
        "slot's first run, whenever it ran until the processes were stopped "
        f"{SCALE_GRACE:g} s after the window. Not run: window slots with no run by then "
        "(a slot skipped by a peer's coalescing counts as not run). Duplicates: runs of "
        "a (schedule, slot) beyond the first, whole run. CPU: utime + stime of the three "
        "processes (and children) over the window, 100% = one core; DB CPU: their "
        "PostgreSQL backends connected when the window began and still there at its end "
        "(a pool's short-lived connections are missed). Load: the 1-minute load average at the window's end "
        "(2 cores; other work may run on the machine).",
        "",
        "| contestant | N | runs/s needed | runs/s | lateness p50 | p99 | max "
        "| not run | schedules with no run | duplicates | CPU (3 processes) | DB CPU "
        "| commits/s | setup | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t in results["scale"]:
        if "error" in t:
            lines.append(
                f"| {t['label']} | {t['schedules']:,} | {t['schedules'] / SCALE_PERIOD:,.0f} "
                f"| error: {t['error']} |" + " |" * 11
            )
            continue
        late = t["lateness_s"]
        lines.append(
            f"| {t['label']} | {t['schedules']:,} | {t['runs_per_s_needed']:,.0f} "
            f"| {t['runs_per_s']:,.0f} | {fmt_seconds(late['p50'])} | {fmt_seconds(late['p99'])} "
            f"| {fmt_seconds(late['max'])} "
            f"| {t['slots_not_run']:,} of {t['slots_expected']:,} "
            f"| {t['schedules_without_run']:,} | {t['duplicates']:,} "
            f"| {t['cpu_percent']:.0f}% | {t['db_cpu_percent']:.0f}% "
            f"| {t['commits_per_s']:,.0f} | {t['setup_s']:.1f} s "
            f"| {t['load_average']['window_end']:.1f} |"
        )
    lines += [
        "",
        "Runs in the window by process (does the work spread over the three?), and "
        "runs whose slot was not on its schedule's grid (none expected):",
        "",
    ]
    for t in results["scale"]:
        if "error" in t:
            continue
        spread = ", ".join(f"{n:,}" for n in t["window_runs_by_process"]) or "none"
        lines.append(
            f"- {t['label']}, {t['schedules']:,}: {spread}; off the grid: {t['off_grid_runs']}"
        )
    lines.append("")
    return "\n".join(lines)


# -- main ----------------------------------------------------------------------------------


async def bench(admin: str, work: Path, sizes: Sizes, results: dict[str, Any]) -> None:
    pythons = {
        c.name: results["versions"][c.venv]["python"] if c.venv else sys.executable
        for c in CONTESTANTS
    }
    log = await find_log(admin)
    conn = await asyncpg.connect(admin)
    try:
        results["postgres"] = await conn.fetchval("SHOW server_version")
    finally:
        await conn.close()
    results["server_log_read"] = log.path is not None
    results["kill"] = {}
    for contestant in CONTESTANTS:
        name = contestant.name
        dsn = await prepare(admin, contestant, f"bench_peers_kill_{name.replace('-', '_')}")
        arena = Arena(contestant, dsn, work / f"kill-{name}", pythons[name], "run")
        arena.runs_dir.mkdir(parents=True, exist_ok=True)
        try:
            trial = await kill_trial(arena, sizes, log)
        finally:
            await stop_all([arena])
        gaps = ", ".join(fmt_gap(k) for k in trial["kills"])
        print(f"bench.peers: {name}: gaps {gaps} s, {trial['duplicates']} duplicates", flush=True)
        results["kill"][name] = trial
    results["idle"] = await idle_cost(admin, work, pythons, sizes, log)


def arguments(argv: list[str] | None) -> argparse.Namespace:
    """bench.common's --quick and --out, and which parts to run."""
    parser = argparse.ArgumentParser(prog="python -m bench.peers")
    parser.add_argument("--quick", action="store_true", help="few trials, short runs")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--part",
        choices=("all", "trials", "scale"),
        default="all",
        help="trials: the kill trial and idle cost (peers.*); scale: many schedules "
        "(peers_scale.*); all (default): both",
    )
    parser.add_argument(
        "--scale-contestants",
        nargs="+",
        choices=[c.name for c in SCALE_CONTESTANTS],
        default=[c.name for c in SCALE_CONTESTANTS],
    )
    parser.add_argument(
        "--scale-counts",
        nargs="+",
        type=int,
        default=None,
        help="schedules (default 1,000 and 10,000; --quick: 1,000)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = arguments(argv)
    versions = {name: ensure_venv(spec) for name, spec in PEER_ENVS.items()}
    versions["ours"] = our_versions()
    scale_sizes = QUICK_SCALE if args.quick else ScaleSizes()
    if args.scale_counts:
        scale_sizes = ScaleSizes(tuple(args.scale_counts), scale_sizes.periods)
    with ExitStack() as stack:
        keep = os.environ.get("BENCH_PEERS_WORKDIR")
        if keep:
            work = Path(keep)
            work.mkdir(parents=True, exist_ok=True)
        else:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-peers-")))
        admin = admin_dsn(stack)
        if args.part in ("all", "trials"):
            sizes = QUICK if args.quick else Sizes()
            results: dict[str, Any] = {"quick": args.quick, "sizes": asdict(sizes)}
            results["versions"] = versions
            asyncio.run(bench(admin, work, sizes, results))
            results["plots"] = list(PLOTS)
            save_results("peers", results, report, args.out)
            plot(results, args.out)
        if args.part in ("all", "scale"):
            scale: dict[str, Any] = {"quick": args.quick, "sizes": asdict(scale_sizes)}
            scale["versions"] = versions
            pythons = {name: env["python"] for name, env in versions.items() if "python" in env}
            asyncio.run(
                scale_main(admin, work, scale_sizes, pythons, args.scale_contestants, scale)
            )
            save_results("peers_scale", scale, scale_report, args.out)


async def scale_main(
    admin: str,
    work: Path,
    sizes: ScaleSizes,
    pythons: dict[str, str],
    names: Sequence[str],
    results: dict[str, Any],
) -> None:
    conn = await asyncpg.connect(admin)
    try:
        results["postgres"] = await conn.fetchval("SHOW server_version")
    finally:
        await conn.close()
    results["scale"] = await scale_bench(admin, work, sizes, pythons, names)


if __name__ == "__main__":
    main()
