"""Growth: what one leader does when the work grows.

Plugin loop. N interval tasks (`every = "10s"`), all SQL (`sql = "SELECT 1"`) or all
async Python (`growth_tasks:noop`, bench/ on PYTHONPATH), declared in a TOML config file
(`SCHEDULER_CONFIG`: 10,000 tasks do not fit in one environment variable). Their rows in
scheduler_plugin_tasks are created before the daemon starts, with next_run_at an hour
away (the daemon keeps a known task's next_run_at); once the daemon leads, one UPDATE
sets every slot: "spread", task i at T0 + i * 10 s / N, or "burst", every task due at T0
("idle" leaves them an hour away: the cost of merely having N tasks). One leader (one
process, `run --only plugin`). For every slot of the window [T0, T0 + W):

- lateness = finished_at - slot (the targets do nothing, so this is when the run took
  place; started_at is the claiming tick's transaction time, kept in the JSON as
  `claim`); a slot that has not run when the leader is stopped (GRACE after the window)
  counts with the wait it had by then, a lower bound, so falling behind shows in the
  percentiles instead of vanishing from them;
- runs/s achieved (runs claimed in the window / W) against runs/s needed (N / 10 s);
- the leader's CPU (utime + stime from /proc/<pid>/stat), the CPU of the database
  backends serving it (when the server is local), and database commits/s
  (pg_stat_database.xact_commit delta).

"Keeps up": every slot of the window ran and lateness p99 < 1 s (the issue's target for
10,000 tasks). plugin.history stays at its default (1,000 runs per task): a window holds
at most a few slots per task, so nothing measured is trimmed.

Publish loop. A backlog of B rows already due (inserted with generate_series before the
daemon starts), drained by one leader with `publish.batch_size` S, while another
connection inserts 5 rows due "now" every 100 ms: rows/s drained (by the database's
published_at stamps) and the lateness (published_at - publish_at) of the fresh rows,
during the drain and in the second after it. Then calm: the same fresh rows while the
table holds 0, 100k or 1M rows scheduled a day ahead.

The daemon measured is the work tree as it is (commit and changed files are recorded).

    python -m bench.growth [--quick] [--out DIR]
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from contextlib import ExitStack, suppress
from dataclasses import asdict, dataclass
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
    percentile,
    save_results,
    start_daemon,
    stop_daemon,
)

PERIOD = 10.0  # every task runs every 10 s
TARGET = "growth_tasks:noop"
FRESH_EVERY = 0.1  # s between inserts of fresh rows during a backlog
FRESH_ROWS = 5  # rows per insert
KEEP_UP_P99 = 1.0  # s: the target for run lateness
GRACE = 1.5  # s after the window before the leader is stopped: its last slots run


@dataclass(frozen=True)
class PluginCase:
    tasks: int
    kind: str  # "sql" | "async"
    pattern: str  # "spread" | "burst" | "idle" (no slot due in the window)
    concurrency: int
    window: float  # s of slots measured

    @property
    def label(self) -> str:
        return f"{self.tasks} {self.kind} {self.pattern} c={self.concurrency}"


@dataclass(frozen=True)
class PublishCase:
    backlog: int
    batch_size: int


@dataclass(frozen=True)
class Plan:
    plugin: tuple[PluginCase, ...]
    publish: tuple[PublishCase, ...]
    future: tuple[int, ...]  # sizes of a schedule a day ahead, for calm lateness
    calm: float = 10.0  # s of fresh rows per future case


def full_plan() -> Plan:
    """About 12 minutes: 20 s windows (10 s for 10 tasks), concurrency 64 beside the
    default 4 for 10,000 tasks and for a burst of 1,000, and the 1M backlog at the default
    batch size only (it takes a minute or two per batch size)."""
    plugin: list[PluginCase] = []
    for kind in ("sql", "async"):
        for pattern in ("spread", "burst"):
            plugin.append(PluginCase(10, kind, pattern, 4, 10.0))
            plugin.append(PluginCase(1_000, kind, pattern, 4, 10.0))
            if pattern == "burst" and kind == "async":
                plugin.append(PluginCase(1_000, kind, pattern, 64, 10.0))
            plugin.append(PluginCase(10_000, kind, pattern, 4, 10.0))
            plugin.append(PluginCase(10_000, kind, pattern, 64, 10.0))
    plugin.append(PluginCase(10_000, "async", "idle", 4, 10.0))
    plugin.sort(key=lambda c: (c.tasks, c.kind, c.pattern, c.concurrency))
    publish = [PublishCase(b, s) for b in (10_000, 100_000) for s in (100, 500, 5_000)]
    publish.append(PublishCase(1_000_000, 500))
    return Plan(plugin=tuple(plugin), publish=tuple(publish), future=(0, 100_000, 1_000_000))


def quick_plan() -> Plan:
    plugin = (
        PluginCase(10, "sql", "spread", 4, 10.0),
        PluginCase(1_000, "sql", "spread", 4, 10.0),
        PluginCase(1_000, "async", "burst", 64, 10.0),
    )
    publish = tuple(PublishCase(10_000, s) for s in (100, 500, 5_000))
    return Plan(plugin=plugin, publish=publish, future=(100_000,), calm=5.0)


# --- measuring a process ---------------------------------------------------------------


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of a process, or None if it is gone (or not on this machine)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_total(pids: list[int]) -> float | None:
    values = [cpu_seconds(pid) for pid in pids]
    known = [v for v in values if v is not None]
    return sum(known) if known else None


async def backend_pids(conn: asyncpg.Connection) -> list[int]:
    """The server processes of everyone else connected to this database: the daemon's."""
    rows = await conn.fetch(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
        "AND pid <> pg_backend_pid()"
    )
    return [row["pid"] for row in rows]


async def commits(conn: asyncpg.Connection) -> int:
    value: int = await conn.fetchval(
        "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
    )
    return value


@dataclass
class Meter:
    """CPU of the leader and of its database backends, and commits, over an interval."""

    pid: int
    backends: list[int]
    started: float = 0.0
    leader_cpu: float | None = None
    db_cpu: float | None = None
    xact: int = 0

    async def start(self, conn: asyncpg.Connection) -> None:
        self.started = time.monotonic()
        self.leader_cpu = cpu_seconds(self.pid)
        self.db_cpu = cpu_total(self.backends)
        self.xact = await commits(conn)

    async def stop(self, conn: asyncpg.Connection) -> dict[str, float | None]:
        # Backends flush their statistics at most once a second, at both ends alike.
        seconds = time.monotonic() - self.started
        leader, db = cpu_seconds(self.pid), cpu_total(self.backends)
        xact = await commits(conn)
        return {
            "leader_cpu_percent": None
            if leader is None or self.leader_cpu is None
            else 100 * (leader - self.leader_cpu) / seconds,
            "db_cpu_percent": None
            if db is None or self.db_cpu is None
            else 100 * (db - self.db_cpu) / seconds,
            "commits_per_second": (xact - self.xact) / seconds,
        }


def fresh_log(workdir: Path) -> None:
    """Each case's daemon.log holds that case alone (start_daemon appends)."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "daemon.log").unlink(missing_ok=True)


def log_tail(workdir: Path, lines: int = 20) -> str:
    with suppress(OSError):
        return "\n".join((workdir / "daemon.log").read_text().splitlines()[-lines:])
    return ""


def count_events(workdir: Path, event: str) -> int:
    count = 0
    with suppress(OSError), (workdir / "daemon.log").open() as log:
        for line in log:
            if event in line:
                with suppress(ValueError):
                    count += json.loads(line).get("event") == event
    return count


# --- the plugin loop -------------------------------------------------------------------


def task_names(count: int) -> list[str]:
    return [f"g{i:05d}" for i in range(count)]


def write_config(path: Path, case: PluginCase) -> None:
    action = f'target = "{TARGET}"' if case.kind == "async" else 'sql = "SELECT 1"'
    lines = [
        "[plugin]",
        f"concurrency = {case.concurrency}",
        "entry_points = false",
        'disabled = ["purge_publications"]',
        "",
    ]
    for name in task_names(case.tasks):
        lines += ["[[plugin.tasks]]", f'name = "{name}"', f'every = "{PERIOD:g}s"', action, ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


async def wait_leading(conn: asyncpg.Connection, daemon: Any, loop: str, workdir: Path) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if daemon.poll() is not None:
            raise RuntimeError(f"daemon exited {daemon.returncode}:\n{log_tail(workdir)}")
        if await conn.fetchval("SELECT count(*) FROM scheduler_leaders WHERE loop = $1", loop):
            return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"no {loop} leader after 120 s:\n{log_tail(workdir)}")


def summary(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "max": None}
    return {
        "p50": percentile(values, 0.5),
        "p99": percentile(values, 0.99),
        "max": max(values),
    }


# Slot i of task g<i> in a case, as one SQL expression: the UPDATE that sets the slots
# and the query that lists the window's slots compute the very same timestamps.
SLOT = (
    "$1::timestamptz + make_interval(secs => substr({name}, 2)::int * $2::float8 / $3 * $4) "
    "+ make_interval(secs => {k} * $2::float8)"
)


async def plugin_case(admin: str, workdir: Path, case: PluginCase) -> dict[str, Any]:
    dsn = await fresh_database(admin, "bench_growth")
    config = workdir / "tasks.toml"
    write_config(config, case)
    fresh_log(workdir)
    conn = await asyncpg.connect(dsn)
    names = task_names(case.tasks)
    periods = round(case.window / PERIOD)
    spread = 1.0 if case.pattern == "spread" else 0.0
    try:
        await conn.execute(
            "INSERT INTO scheduler_plugin_tasks (name, schedule, next_run_at) "
            "SELECT n, $2, now() + interval '1 hour' FROM unnest($1::text[]) n",
            names,
            f"every {PERIOD:g}s",
        )
        env = {"SCHEDULER_CONFIG": str(config), "PYTHONPATH": str(ROOT / "bench")}
        started = time.monotonic()
        daemon = start_daemon(dsn, workdir, only="plugin", env=env)
        try:
            await wait_leading(conn, daemon, "plugin", workdir)
            startup = time.monotonic() - started
            lead = 3.0  # s: the takeover tick reads every task first
            t0: datetime = await conn.fetchval("SELECT now() + make_interval(secs => $1)", lead)
            if case.pattern != "idle":
                await conn.execute(
                    "UPDATE scheduler_plugin_tasks SET next_run_at = "
                    + SLOT.format(name="name", k=0)
                    + " WHERE name LIKE 'g%'",
                    t0,
                    PERIOD,
                    case.tasks,
                    spread,
                )
            meter = Meter(daemon.pid, await backend_pids(conn))
            await asyncio.sleep(lead)
            await meter.start(conn)
            await asyncio.sleep(case.window)
            usage = await meter.stop(conn)
            load = os.getloadavg()[0]
            await asyncio.sleep(GRACE)  # the window's last slots
            t_stop: datetime = await conn.fetchval("SELECT now()")
        finally:
            stop_daemon(daemon)
        t_end = t0 + timedelta(seconds=case.window)
        expected = []
        if case.pattern != "idle":
            expected = await conn.fetch(
                "WITH slots AS (SELECT n AS name, k, "
                + SLOT.format(name="n", k="k")
                + " AS slot FROM unnest($5::text[]) n, generate_series(0, $6 - 1) k) "
                "SELECT s.k, r.status, extract(epoch FROM r.started_at - s.slot)::float8 AS claim, "
                "extract(epoch FROM coalesce(r.finished_at, $7) - s.slot)::float8 AS done "
                "FROM slots s LEFT JOIN scheduler_plugin_runs r USING (name, slot)",
                t0,
                PERIOD,
                case.tasks,
                spread,
                names,
                periods,
                t_stop,
            )
        claimed = await conn.fetchval(
            "SELECT count(*) FROM scheduler_plugin_runs "
            "WHERE started_at >= $1 AND started_at < $2 AND status <> 'skipped_overlap'",
            t0,
            t_end,
        )
    finally:
        await conn.close()
    await drop_database(admin, "bench_growth", grace=0)
    ran = [row for row in expected if row["status"] not in (None, "skipped_overlap", "running")]
    skipped = sum(row["status"] == "skipped_overlap" for row in expected)
    # A slot that never ran counts as late as the wait it had when the leader stopped (a
    # lower bound), so falling behind shows in the percentiles instead of vanishing.
    done = [row["done"] for row in expected]
    result: dict[str, Any] = {
        **asdict(case),
        "startup_s": startup,
        "load_average": load,
        "slots_expected": len(expected),
        "slots_ran": len(ran),
        "slots_not_run": len(expected) - len(ran) - skipped,
        "skipped_overlap": skipped,
        "misfired": count_events(workdir, "task.misfired"),
        "leadership_lost": count_events(workdir, "leader.lost"),
        "failed": sum(row["status"] != "succeeded" for row in ran),
        "runs_per_second_needed": 0.0 if case.pattern == "idle" else case.tasks / PERIOD,
        "runs_per_second": claimed / case.window,
        "claim_lateness_ran_s": summary([row["claim"] for row in ran]),
        "done_lateness_ran_s": summary([row["done"] for row in ran]),
        "lateness_s": summary(done),
        "lateness_p50_by_period_s": [
            summary([row["done"] for row in expected if row["k"] == k])["p50"]
            for k in range(periods)
        ],
        **usage,
    }
    p99 = result["lateness_s"]["p99"]
    result["keeps_up"] = (
        None
        if case.pattern == "idle"
        else result["slots_not_run"] == 0 and skipped == 0 and p99 is not None and p99 < KEEP_UP_P99
    )
    return result


# --- the publish loop ------------------------------------------------------------------


async def insert_fresh(dsn: str, stop: asyncio.Event) -> int:
    """Every FRESH_EVERY s, FRESH_ROWS rows due now, until `stop`."""
    conn = await asyncpg.connect(dsn)
    inserted = 0
    try:
        while not stop.is_set():
            await conn.execute(
                "INSERT INTO scheduler_publications (key, publish_at) "
                "SELECT 'f' || ($1 + g), now() FROM generate_series(1, $2) g",
                inserted,
                FRESH_ROWS,
            )
            inserted += FRESH_ROWS
            with suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), FRESH_EVERY)
    finally:
        await conn.close()
    return inserted


async def poll_until(conn: asyncpg.Connection, query: str, *args: Any, within: float) -> None:
    deadline = time.monotonic() + within
    while not await conn.fetchval(query, *args):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{query!r} still false after {within:g} s")
        await asyncio.sleep(0.05)


async def publish_case(admin: str, workdir: Path, case: PublishCase) -> dict[str, Any]:
    dsn = await fresh_database(admin, "bench_growth_pub")
    await asyncio.to_thread(fresh_log, workdir)
    conn = await asyncpg.connect(dsn)
    try:
        started = time.monotonic()
        await conn.execute(
            "INSERT INTO scheduler_publications (publish_at) "
            "SELECT now() - interval '1 minute' FROM generate_series(1, $1)",
            case.backlog,
        )
        await conn.execute("ANALYZE scheduler_publications")
        insert_seconds = time.monotonic() - started
        due: datetime = await conn.fetchval("SELECT max(publish_at) FROM scheduler_publications")
        env = {"SCHEDULER_PUBLISH__BATCH_SIZE": str(case.batch_size)}
        daemon = start_daemon(dsn, workdir, only="publish", env=env)
        stop = asyncio.Event()
        fresh: asyncio.Task[int] | None = None
        try:
            await wait_leading(conn, daemon, "publish", workdir)
            await poll_until(
                conn,
                "SELECT EXISTS (SELECT 1 FROM scheduler_publications WHERE status = 'published')",
                within=60,
            )
            meter = Meter(daemon.pid, await backend_pids(conn))
            await meter.start(conn)
            fresh = asyncio.create_task(insert_fresh(dsn, stop))
            await poll_until(
                conn,
                "SELECT NOT EXISTS (SELECT 1 FROM scheduler_publications "
                "WHERE status = 'scheduled' AND publish_at <= $1)",
                due,
                within=900,
            )
            drain_seconds = time.monotonic() - meter.started
            load = os.getloadavg()[0]
            await asyncio.sleep(1.0)  # fresh rows once the backlog is gone: calm lateness
            stop.set()
            await fresh
            usage = await meter.stop(conn)
            await poll_until(
                conn,
                "SELECT NOT EXISTS (SELECT 1 FROM scheduler_publications "
                "WHERE status = 'scheduled')",
                within=120,
            )
        finally:
            stop.set()
            if fresh is not None and not fresh.done():
                fresh.cancel()
            stop_daemon(daemon)
        backlog = await conn.fetchrow(
            "SELECT count(*) AS n, extract(epoch FROM max(published_at) - min(published_at))"
            "::float8 AS seconds, max(published_at) AS last "
            "FROM scheduler_publications WHERE key IS NULL"
        )
        rows = await conn.fetch(
            "SELECT publish_at < $1 AS during, "
            "extract(epoch FROM published_at - publish_at)::float8 AS late "
            "FROM scheduler_publications WHERE key IS NOT NULL",
            backlog["last"],
        )
    finally:
        await conn.close()
    await drop_database(admin, "bench_growth_pub", grace=0)
    during = [row["late"] for row in rows if row["during"]]
    after = [row["late"] for row in rows if not row["during"]]
    return {
        **asdict(case),
        "insert_seconds": insert_seconds,
        "load_average": load,
        "drain_seconds": backlog["seconds"],
        "drain_wall_seconds": drain_seconds,
        "rows_per_second": backlog["n"] / backlog["seconds"],
        "fresh_rows": len(rows),
        "fresh_during_drain": len(during),
        "fresh_lateness_during_s": summary(during),
        "fresh_lateness_after_s": summary(after),
        "leader_cpu_percent": usage["leader_cpu_percent"],
        "db_cpu_percent": usage["db_cpu_percent"],
        "leadership_lost": count_events(workdir, "leader.lost"),
    }


async def future_case(admin: str, workdir: Path, future: int, seconds: float) -> dict[str, Any]:
    """Calm lateness while `future` rows are scheduled a day ahead: fresh rows due now,
    FRESH_ROWS every FRESH_EVERY s for `seconds`, each insert waking the leader."""
    dsn = await fresh_database(admin, "bench_growth_future")
    await asyncio.to_thread(fresh_log, workdir)
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            "INSERT INTO scheduler_publications (publish_at) "
            "SELECT now() + interval '1 day' + g * interval '1 ms' FROM generate_series(1, $1) g",
            future,
        )
        await conn.execute("VACUUM ANALYZE scheduler_publications")
        daemon = start_daemon(dsn, workdir, only="publish")
        stop = asyncio.Event()
        try:
            await wait_leading(conn, daemon, "publish", workdir)
            await asyncio.sleep(1.0)
            meter = Meter(daemon.pid, await backend_pids(conn))
            await meter.start(conn)
            fresh = asyncio.create_task(insert_fresh(dsn, stop))
            await asyncio.sleep(seconds)
            stop.set()
            await fresh
            usage = await meter.stop(conn)
            load = os.getloadavg()[0]
            await poll_until(
                conn,
                "SELECT NOT EXISTS (SELECT 1 FROM scheduler_publications "
                "WHERE status = 'scheduled' AND key IS NOT NULL)",
                within=120,
            )
        finally:
            stop.set()
            stop_daemon(daemon)
        late = await conn.fetch(
            "SELECT extract(epoch FROM published_at - publish_at)::float8 AS late "
            "FROM scheduler_publications WHERE key IS NOT NULL"
        )
    finally:
        await conn.close()
    await drop_database(admin, "bench_growth_future", grace=0)
    return {
        "future_rows": future,
        "fresh_rows": len(late),
        "lateness_s": summary([row["late"] for row in late]),
        "load_average": load,
        "leadership_lost": count_events(workdir, "leader.lost"),
        **usage,
    }


# --- running it all, reporting ---------------------------------------------------------


async def run(admin: str, workdir: Path, plan: Plan) -> dict[str, Any]:
    results: dict[str, Any] = {
        "code": code_version(),
        "plugin": [],
        "publish": [],
        "future": [],
    }
    for index, case in enumerate(plan.plugin):
        began = time.monotonic()
        result = await plugin_case(admin, workdir / f"plugin{index}", case)
        results["plugin"].append(result)
        print(
            f"growth: {case.label}: {result['runs_per_second']:.1f}/"
            f"{result['runs_per_second_needed']:.1f} runs/s, lateness p99 "
            f"{fmt_s(result['lateness_s']['p99'])}, not run {result['slots_not_run']} "
            f"({time.monotonic() - began:.0f} s)",
            flush=True,
        )
    for index, pcase in enumerate(plan.publish):
        began = time.monotonic()
        result = await publish_case(admin, workdir / f"publish{index}", pcase)
        results["publish"].append(result)
        print(
            f"growth: backlog {pcase.backlog} batch {pcase.batch_size}: "
            f"{result['rows_per_second']:,.0f} rows/s, fresh p99 "
            f"{fmt_s(result['fresh_lateness_during_s']['p99'])} "
            f"({time.monotonic() - began:.0f} s)",
            flush=True,
        )
    for index, future in enumerate(plan.future):
        result = await future_case(admin, workdir / f"future{index}", future, plan.calm)
        results["future"].append(result)
        print(
            f"growth: {future} future rows: fresh lateness p99 "
            f"{fmt_s(result['lateness_s']['p99'])}",
            flush=True,
        )
    return results


def code_version() -> dict[str, Any]:
    """The commit measured, and the files of the daemon that differ from it (the work
    tree is measured as it is)."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.rstrip("\n")

    changed = git("status", "--porcelain", "--", "scheduler_daemon").splitlines()
    return {"commit": git("rev-parse", "HEAD"), "changed": [line[3:] for line in changed]}


def fmt_s(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.1f} ms"
    return f"{seconds:.2f} s"


def fmt_pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}%"


def breaking_points(results: dict[str, Any]) -> list[str]:
    """Per kind, pattern and concurrency: the largest task count that kept up and the
    smallest that did not."""
    lines = []
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for r in results["plugin"]:
        if r["pattern"] != "idle":
            groups.setdefault((r["kind"], r["pattern"], r["concurrency"]), []).append(r)
    for (kind, pattern, concurrency), rs in sorted(groups.items()):
        kept = [r["tasks"] for r in rs if r["keeps_up"]]
        lost = [r for r in rs if not r["keeps_up"]]
        text = f"- {kind}, {pattern}, concurrency {concurrency}: "
        text += f"keeps up with {max(kept):,} tasks" if kept else "kept up at no size measured"
        if lost:
            first = min(lost, key=lambda r: r["tasks"])
            text += (
                f"; not with {first['tasks']:,} ({first['runs_per_second']:,.0f} of "
                f"{first['runs_per_second_needed']:,.0f} runs/s, lateness p99 "
                f"{fmt_s(first['lateness_s']['p99'])}, leader CPU "
                f"{fmt_pct(first['leader_cpu_percent'])})"
            )
        lines.append(text + ".")
    return lines


def report(results: dict[str, Any]) -> str:
    code = results["code"]
    lines = [
        f"# Growth ({results['date']}, {results['machine']})",
        "",
        f"Commit {code['commit'][:12]}"
        + (f", with uncommitted changes to {', '.join(code['changed'])}" if code["changed"] else "")
        + ". PostgreSQL with fsync and synchronous_commit on; one leader (one process).",
        *[f"{note}" for note in results.get("notes", [])],
        "",
        f"## Plugin loop: N tasks every {PERIOD:g} s",
        "",
        "Lateness: finished_at - slot for every slot of the window (the targets do "
        "nothing, so this is when the run took place); a slot that had not run when the "
        "leader stopped counts with the wait it had by then (a lower bound). Not run: such "
        "slots (still waiting, or passed over by the misfire policy). Leader CPU: the "
        "daemon process; db CPU: the server backends serving it (100% = one core). Keeps "
        f"up: every slot ran and lateness p99 < {KEEP_UP_P99:g} s. Idle: no slot due in "
        "the window (the cost of merely having the tasks). Load: the machine's 1-minute "
        f"load average at the end of the window ({os.cpu_count()} cores; other work on the "
        "machine shows there).",
        "",
        "| tasks | kind | pattern | concurrency | window | runs/s needed | runs/s achieved "
        "| lateness p50 | p99 | max | not run | leader CPU | db CPU | commits/s | load "
        "| keeps up |",
        "|" + "---|" * 16,
    ]
    for r in results["plugin"]:
        late = r["lateness_s"]
        keeps = {True: "yes", False: "**no**", None: "-"}[r["keeps_up"]]
        lines.append(
            f"| {r['tasks']:,} | {r['kind']} | {r['pattern']} | {r['concurrency']} "
            f"| {r['window']:g} s | {r['runs_per_second_needed']:,.0f} "
            f"| {r['runs_per_second']:,.0f} | {fmt_s(late['p50'])} | {fmt_s(late['p99'])} "
            f"| {fmt_s(late['max'])} | {r['slots_not_run']:,} of {r['slots_expected']:,} "
            f"| {fmt_pct(r['leader_cpu_percent'])} | {fmt_pct(r['db_cpu_percent'])} "
            f"| {r['commits_per_second']:,.0f} | {r['load_average']:.1f} | {keeps} |"
        )
    lines += [
        "",
        "Lateness p50 per 10 s period of the window (growing: falling behind):",
        "",
        "| case | p50 by period |",
        "|---|---|",
    ]
    for r in results["plugin"]:
        if r["pattern"] != "idle":
            label = f"{r['tasks']:,} {r['kind']} {r['pattern']} c={r['concurrency']}"
            periods = ", ".join(fmt_s(v) for v in r["lateness_p50_by_period_s"])
            lines.append(f"| {label} | {periods} |")
    lines += ["", "Where one leader stops keeping up:", "", *breaking_points(results)]
    lines += [
        "",
        f"## Publish loop: a backlog of due rows, {FRESH_ROWS} fresh rows due now every "
        f"{FRESH_EVERY * 1000:g} ms while it drains",
        "",
        "Fresh: rows inserted during the drain, published_at - publish_at; after: those "
        "inserted in the second after the backlog was gone.",
        "",
        "| backlog | batch size | insert | drain | rows/s | fresh p50 | fresh p99 | fresh max "
        "| after p50 | after max | leader CPU | db CPU | load |",
        "|" + "---|" * 13,
    ]
    for r in results["publish"]:
        during, after = r["fresh_lateness_during_s"], r["fresh_lateness_after_s"]
        lines.append(
            f"| {r['backlog']:,} | {r['batch_size']:,} | {r['insert_seconds']:.1f} s "
            f"| {r['drain_seconds']:.2f} s | {r['rows_per_second']:,.0f} "
            f"| {fmt_s(during['p50'])} | {fmt_s(during['p99'])} | {fmt_s(during['max'])} "
            f"| {fmt_s(after['p50'])} | {fmt_s(after['max'])} "
            f"| {fmt_pct(r['leader_cpu_percent'])} | {fmt_pct(r['db_cpu_percent'])} "
            f"| {r['load_average']:.1f} |"
        )
    lines += [
        "",
        "## Publish loop, calm: a large schedule a day ahead, fresh rows due now",
        "",
        f"{FRESH_ROWS} rows due now every {FRESH_EVERY * 1000:g} ms (each insert a "
        "NOTIFY that wakes the leader) while the table holds rows scheduled a day ahead "
        "(vacuumed and analyzed); lateness = published_at - publish_at.",
        "",
        "| rows scheduled ahead | fresh rows | lateness p50 | p99 | max | leader CPU "
        "| db CPU | commits/s | load |",
        "|" + "---|" * 9,
    ]
    for r in results["future"]:
        late = r["lateness_s"]
        lines.append(
            f"| {r['future_rows']:,} | {r['fresh_rows']:,} | {fmt_s(late['p50'])} "
            f"| {fmt_s(late['p99'])} | {fmt_s(late['max'])} "
            f"| {fmt_pct(r['leader_cpu_percent'])} | {fmt_pct(r['db_cpu_percent'])} "
            f"| {r['commits_per_second']:,.0f} | {r['load_average']:.1f} |"
        )
    lines += ["", *ANALYSIS, *observations(results), ""]
    return "\n".join(lines)


# What the numbers mean for a user; the measured figures are in the tables above.
ANALYSIS = [
    "## Reading it",
    "",
    "- **Plugin loop.** Every tick reads all N task rows, twice (`task_states`, for the "
    "claims and again for the next wake-up), and walks all N tasks in Python, however few "
    "are due and however few places are free; it claims at most `plugin.concurrency` runs. "
    "Every run then records its result in a transaction of its own (one commit, so one "
    "WAL flush, per run) on the leader's single lock connection, which also serves the "
    "ticks and every `sql` task. Each fenced transaction is 6 statements of its own "
    "(BEGIN, the fence check, a savepoint and its release, the fence restore, COMMIT), so "
    "an async run costs about 12 round trips (3 to claim it, 9 to record it) and a `sql` "
    "run about 22, one after the other. So the work per run grows with N, and runs/s is "
    "capped by the round trips of one connection.",
    "- **What a user does when one leader falls behind**: raise `plugin.concurrency` (more "
    "claims per O(N) tick: the largest gain here); spread the slots rather than having "
    "thousands due at one instant; fold many tiny tasks into fewer tasks that each do a "
    "batch of the work (the cost is per task and per run, not per unit of work); run "
    "long or many SQL statements from a Python target on its own connection, not as `sql` "
    "tasks on the shared lock connection; and lengthen periods where the work allows. "
    "Adding replicas does not help: one leader runs every task.",
    "- **Publish loop.** Rows publish in `publish_at` order, so a row due now waits behind "
    "every row of an older backlog: its lateness is about the backlog divided by the drain "
    "rate. A larger `publish.batch_size` drains faster (fewer transactions and commits). "
    "A large backlog also drains slower per row: each batch's scan of the due index walks "
    "past the entries of the rows already published (dead until vacuum), so the batch "
    "select grows with the rows drained so far. What a user does: raise "
    "`publish.batch_size` for bulk loads, schedule bulk imports at their real (future) "
    "times rather than all due at once, and let autovacuum (or a VACUUM) run after a "
    "large drain.",
    "- **Calm, with a large schedule ahead.** Every publish tick ends with `next_due_in`, "
    "whose `bool_or(publish_at <= now())` reads every scheduled row (a sequential scan), "
    "so each tick costs in proportion to everything scheduled, due or not; "
    "`min(publish_at) <= now()` gives the same answer from one index entry.",
]


CASE_KEYS = ("tasks", "kind", "pattern", "concurrency", "backlog", "batch_size", "future_rows")


def observations(results: dict[str, Any]) -> list[str]:
    """What this run showed beyond the tables' own columns."""
    lines = []
    for section in ("plugin", "publish", "future"):
        for r in results[section]:
            if r["leadership_lost"]:
                case = ", ".join(f"{key} {r[key]}" for key in CASE_KEYS if key in r)
                lines.append(
                    f"- {section}, {case}: the leader lost its lock {r['leadership_lost']} "
                    "times (see its daemon.log): not a clean measurement."
                )
    for r in results["publish"]:
        late = r["fresh_lateness_after_s"]["max"]
        if late is not None and late > 1.0:
            lines.append(
                f"- Backlog {r['backlog']:,}, batch {r['batch_size']:,}: a row inserted "
                f"just after the drain waited {fmt_s(late)}: a wake-up lost at the end of a "
                "busy tick, so the leader slept its longest sleep."
            )
    for r in results["future"]:
        late = r["lateness_s"]["max"]
        if late is not None and late > 1.0:
            lines.append(
                f"- Calm with {r['future_rows']:,} rows ahead: one fresh row waited "
                f"{fmt_s(late)}, a wake-up lost while a (slow) tick ran."
            )
    return lines


def plots(results: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[str] = []
    out.mkdir(parents=True, exist_ok=True)
    series: dict[str, list[dict[str, Any]]] = {}
    for r in results["plugin"]:
        if r["pattern"] != "idle":
            series.setdefault(f"{r['kind']} {r['pattern']} c={r['concurrency']}", []).append(r)

    fig, (late, rate) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, rs in sorted(series.items()):
        rs = sorted(rs, key=lambda r: r["tasks"])
        xs = [r["tasks"] for r in rs]
        ys = [max(1e-3, r["lateness_s"]["p99"] or 1e-3) for r in rs]
        style = "--" if rs[0]["concurrency"] > 4 else "-"
        late.plot(xs, ys, style, marker="o", label=label)
        rate.plot(xs, [max(0.1, r["runs_per_second"]) for r in rs], style, marker="o", label=label)
    counts = sorted({r["tasks"] for rs in series.values() for r in rs})
    rate.plot(counts, [n / PERIOD for n in counts], "k--", label="needed (N / 10 s)")
    late.axhline(KEEP_UP_P99, color="grey", linestyle=":", label="1 s target")
    for axis, title, ylabel in (
        (late, "run lateness p99 (a slot not run: its wait so far)", "seconds"),
        (rate, "runs/s achieved", "runs/s"),
    ):
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xlabel("tasks (each every 10 s)")
        axis.set_ylabel(ylabel)
        axis.set_title(title)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "growth_plugin.png", dpi=110)
    plt.close(fig)
    written.append("growth_plugin.png")

    fig, (drain, fresh) = plt.subplots(1, 2, figsize=(12, 4.5))
    backlogs: dict[int, list[dict[str, Any]]] = {}
    for r in results["publish"]:
        backlogs.setdefault(r["backlog"], []).append(r)
    for backlog, rs in sorted(backlogs.items()):
        rs = sorted(rs, key=lambda r: r["batch_size"])
        xs = [r["batch_size"] for r in rs]
        drain.plot(xs, [r["rows_per_second"] for r in rs], marker="o", label=f"{backlog:,} due")
        ys = [r["fresh_lateness_during_s"]["p99"] or 1e-3 for r in rs]
        fresh.plot(xs, ys, marker="o", label=f"{backlog:,} due")
    for axis, title, ylabel in (
        (drain, "backlog drain rate", "rows/s"),
        (fresh, "lateness p99 of fresh rows during the drain", "seconds"),
    ):
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xlabel("publish.batch_size")
        axis.set_ylabel(ylabel)
        axis.set_title(title)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "growth_publish.png", dpi=110)
    plt.close(fig)
    written.append("growth_publish.png")
    return written


def main(argv: list[str] | None = None) -> None:
    args = bench_arguments("bench.growth", argv)
    plan = quick_plan() if args.quick else full_plan()
    with ExitStack() as stack:
        results = asyncio.run(run(admin_dsn(stack), RESULTS / ".work" / "growth", plan))
    results["plots"] = plots(results, args.out)
    save_results("growth", results, report, args.out)


if __name__ == "__main__":
    main()
