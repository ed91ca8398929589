"""Sustained load: issue 30's first target, minute by minute for as long as it lasts.

10,000 runtime schedules every 10 s (1,000 runs/s), slots spread over the period, three
replicas (`scheduler-daemon run --only plugin`, default settings), the leader SIGKILLed
at half time. Measured outside the database where the promise is about the work:

- lateness is the target's own: `growth_tasks:stamp` writes its schedule, its slot and
  the wall clock as it was called, one line per run, to a file per process
  (BENCH_STAMPS). Runs/s in a minute = runs whose stamp falls in it; lateness p50/p99 of
  the slots of that minute; "not run" = slots of that minute with no stamp by the end;
  duplicates = stamps of a (schedule, slot) already stamped (must be 0);
- the tables, every SAMPLE seconds, from the server: total size (heap, indexes, TOAST) of
  scheduler_plugin_tasks and scheduler_plugin_runs, live and dead rows, how often
  (auto)vacuum ran on each;
- each replica's RSS, from /proc;
- where the server's time goes: pg_stat_statements (the cluster loads it), reset at T0,
  read at the first minute's end and at the end: per statement, calls and mean time.

Two cases: **fresh** (an empty runs table) and **prefilled** (before the replicas start,
the runs table holds what the default retention keeps at steady state: `prefill` finished
runs per schedule, one every period back from now).

    python -m bench.sustained [--quick] [--out DIR] [--minutes M] [--only fresh|prefilled]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
from collections import defaultdict
from contextlib import ExitStack, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg

from bench.common import RESULTS, admin_dsn, percentile, save_results
from bench.growth import code_version, fmt_s
from bench.scale import PERIOD, Leader
from scheduler_daemon.plugins.retention import trim_every
from scheduler_daemon.plugins.tasks import name_hash

STAMP = "growth_tasks:stamp"
SAMPLE = 10.0  # s between two looks at the tables and the replicas
GRACE = 15.0  # s after the last minute before the replicas stop: late slots still count
INSTANCES = ("r1", "r2", "r3")
LATENESS_P99_TARGET = 0.1  # s
RUNS_TARGET = 0.99  # of what is needed, every minute but the failover's
SIZE_DRIFT_TARGET = 0.10  # tables within 10% of their size after the first minute
DB = "bench_sustained"
TRIM_EVERY = trim_every(1000)  # how often a schedule's history is trimmed (history 1,000)


@dataclass(frozen=True)
class Sizes:
    tasks: int = 10_000
    minutes: int = 30
    prefill: int = 1_000  # runs per schedule: plugin.history's default


QUICK = Sizes(tasks=2_000, minutes=2, prefill=50)


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


TABLES = ("scheduler_plugin_tasks", "scheduler_plugin_runs")

TABLE_STATS = """
SELECT c.relname AS table,
       pg_total_relation_size(c.oid) AS total_bytes,
       pg_relation_size(c.oid) AS heap_bytes,
       coalesce(s.n_live_tup, 0) AS live, coalesce(s.n_dead_tup, 0) AS dead,
       coalesce(s.autovacuum_count, 0) AS autovacuums, coalesce(s.vacuum_count, 0) AS vacuums,
       coalesce(s.n_tup_hot_upd, 0) AS hot_updates, coalesce(s.n_tup_upd, 0) AS updates
FROM pg_class c LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
WHERE c.relname = ANY($1::text[]) AND c.relkind IN ('r', 'p')
"""

# A partitioned table has no size or statistics of its own: its partitions' are summed
# under its name (its vacuums too: one vacuum of each partition counts as one).
PARTITIONS = """
SELECT i.inhparent::regclass::text AS table, sum(pg_total_relation_size(i.inhrelid)) AS bytes,
       sum(pg_relation_size(i.inhrelid)) AS heap_bytes,
       coalesce(sum(s.n_live_tup), 0) AS live, coalesce(sum(s.n_dead_tup), 0) AS dead,
       coalesce(sum(s.autovacuum_count), 0) AS autovacuums,
       coalesce(sum(s.vacuum_count), 0) AS vacuums, count(*) AS partitions
FROM pg_inherits i LEFT JOIN pg_stat_user_tables s ON s.relid = i.inhrelid
WHERE i.inhparent::regclass::text = ANY($1::text[])
GROUP BY i.inhparent
"""

STATEMENTS = r"""
SELECT left(regexp_replace(regexp_replace(query, '--[^\n]*', '', 'g'), '\s+', ' ', 'g'), 120)
           AS query, calls,
       total_exec_time AS total_ms, mean_exec_time AS mean_ms, rows,
       shared_blks_hit + shared_blks_read AS blocks
FROM pg_stat_statements
WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
ORDER BY total_exec_time DESC LIMIT 12
"""


async def prefill(conn: asyncpg.Connection, per_schedule: int) -> float:
    """Finished runs for every schedule, one per period back from now, as many as the
    default retention keeps at steady state after `per_schedule` runs: `per_schedule`
    (plugin.history), plus those run since the schedule's last trim, which it makes every
    TRIM_EVERY runs at its own phase (plugins/retention.py); then VACUUM ANALYZE, as
    autovacuum would have left it. Returns the seconds it took."""
    started = time.monotonic()
    names = [r["name"] for r in await conn.fetch("SELECT name FROM scheduler_plugin_tasks")]
    kept = [per_schedule + (per_schedule + name_hash(n)) % TRIM_EVERY for n in names]
    for chunk in range(0, len(names), 500):
        await conn.execute(
            "INSERT INTO scheduler_plugin_runs "
            "(name, slot, instance, started_at, finished_at, status) "
            "SELECT n, s, 'prefill', s, s + interval '1 millisecond', 'succeeded' "
            "FROM unnest($1::text[], $2::int[]) AS t(n, kept), "
            "LATERAL (SELECT date_trunc('second', now()) "
            "  - make_interval(secs => k * $3::float8) AS s "
            "  FROM generate_series(1, t.kept) AS k) slots",
            names[chunk : chunk + 500],
            kept[chunk : chunk + 500],
            PERIOD,
        )
    # Their counts, as such a history leaves them (the trim of plugin.history keys off it).
    await conn.execute("UPDATE scheduler_plugin_tasks SET run_count = $1", per_schedule)
    await conn.execute("VACUUM ANALYZE scheduler_plugin_runs")
    return time.monotonic() - started


async def table_sample(conn: asyncpg.Connection) -> dict[str, dict[str, int]]:
    rows = await conn.fetch(TABLE_STATS, list(TABLES))
    out = {row["table"]: dict(row) for row in rows}
    for row in await conn.fetch(PARTITIONS, list(TABLES)):
        out[row["table"]] |= {
            "total_bytes": int(row["bytes"]),
            "heap_bytes": int(row["heap_bytes"]),
            "live": int(row["live"]),
            "dead": int(row["dead"]),
            "autovacuums": int(row["autovacuums"]),
            "vacuums": int(row["vacuums"]),
            "partitions": int(row["partitions"]),
        }
    return out


async def statements(conn: asyncpg.Connection) -> list[dict[str, Any]]:
    try:
        return [dict(row) for row in await conn.fetch(STATEMENTS)]
    except asyncpg.PostgresError:
        return []


def read_stamps(directory: Path) -> list[tuple[str, float, float, str]]:
    out = []
    for path in directory.glob("*.stamps"):
        for line in path.read_text().splitlines():
            name, slot, at, instance = line.split()
            out.append((name, float(slot), float(at), instance))
    return out


def minutes_table(
    stamps: list[tuple[str, float, float, str]], t0: float, tasks: int, minutes: int
) -> tuple[list[dict[str, Any]], int]:
    """Per minute from T0: runs/s (stamps in it), lateness of its slots, slots never run;
    and the duplicates (a (schedule, slot) stamped twice)."""
    seen: set[tuple[str, float]] = set()
    duplicates = 0
    ran_at: dict[int, int] = defaultdict(int)
    lateness: dict[int, list[float]] = defaultdict(list)
    for name, slot, at, _ in stamps:
        key = (name, round(slot, 3))
        if key in seen:
            duplicates += 1
            continue
        seen.add(key)
        ran_at[int((at - t0) // 60)] += 1
        if slot >= t0:
            lateness[int((slot - t0) // 60)].append(at - slot)
    expected = tasks * round(60 / PERIOD)
    rows = []
    for minute in range(minutes):
        late = lateness.get(minute, [])
        rows.append(
            {
                "minute": minute,
                "runs_per_second": ran_at.get(minute, 0) / 60,
                "lateness_p50_s": percentile(late, 0.5) if late else None,
                "lateness_p99_s": percentile(late, 0.99) if late else None,
                "lateness_max_s": max(late) if late else None,
                "slots_not_run": expected - len(late),
            }
        )
    return rows, duplicates


async def sample_loop(
    leader: Leader, t0: float, samples: list[dict[str, Any]], stop: asyncio.Event
) -> None:
    while not stop.is_set():
        tables = await table_sample(leader.db)
        holder = await leader.db.fetchval(
            "SELECT instance FROM scheduler_leaders WHERE loop = 'plugin'"
        )
        samples.append(
            {
                "t": time.time() - t0,
                "tables": tables,
                "rss_mb": {
                    n: rss_mb(d.pid) for n, d in zip(INSTANCES, leader.daemons, strict=True)
                },
                "leader": holder,
            }
        )
        with suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), SAMPLE)


async def case(
    admin: str, workdir: Path, label: str, sizes: Sizes, env: dict[str, str]
) -> dict[str, Any]:
    stamps_dir = workdir / label / "stamps"
    stamps_dir.mkdir(parents=True, exist_ok=True)
    for old in stamps_dir.glob("*.stamps"):
        old.unlink()
    prefill_s: list[float] = []
    code = code_version()  # the replicas import the work tree as it is when they start

    async def prepare(conn: asyncpg.Connection) -> None:
        if label == "prefilled":
            prefill_s.append(await prefill(conn, sizes.prefill))

    async with Leader(
        admin, workdir / label, sizes.tasks, target=STAMP, runnable=(STAMP,),
        instances=INSTANCES, env={"BENCH_STAMPS": str(stamps_dir)} | env, prepare=prepare,
        database=DB,
    ) as leader:  # fmt: skip
        await leader.db.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        start_tables = await table_sample(leader.db)
        t0_db = await leader.set_slots(1.0)
        t0 = t0_db.timestamp()
        await leader.sleep_until(t0_db)
        await leader.db.execute("SELECT pg_stat_statements_reset()")
        samples: list[dict[str, Any]] = []
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_loop(leader, t0, samples, stop))
        try:
            await asyncio.sleep(60)
            first_minute_statements = await statements(leader.db)
            # Early in a minute: that minute is the failover's, the next one is not.
            kill_at = t0 + sizes.minutes // 2 * 60 + 5
            await asyncio.sleep(max(0.0, kill_at - time.time()))
            killed = await leader.db.fetchval(
                "SELECT instance FROM scheduler_leaders WHERE loop = 'plugin'"
            )
            killed_at = time.time() - t0
            leader.daemons[INSTANCES.index(killed)].send_signal(signal.SIGKILL)
            await asyncio.sleep(max(0.0, t0 + sizes.minutes * 60 + GRACE - time.time()))
            last_statements = await statements(leader.db)
        finally:
            stop.set()
            await sampler
        end_tables = await table_sample(leader.db)
        rows, duplicates = minutes_table(read_stamps(stamps_dir), t0, sizes.tasks, sizes.minutes)
    for row in rows:  # the last sample in each minute
        inside = [s for s in samples if s["t"] < (row["minute"] + 1) * 60]
        if inside:
            last = inside[-1]
            for table in TABLES:
                short = table.removeprefix("scheduler_plugin_")
                row[f"{short}_mb"] = last["tables"][table]["total_bytes"] / 2**20
                row[f"{short}_dead"] = last["tables"][table]["dead"]
                row[f"{short}_autovacuums"] = last["tables"][table]["autovacuums"]
                row[f"{short}_vacuums"] = last["tables"][table]["vacuums"]
            alive = [v for v in last["rss_mb"].values() if v is not None]
            row["rss_mb_max"] = max(alive) if alive else None
    return {
        "case": label,
        "code": code,
        "tasks": sizes.tasks,
        "minutes": sizes.minutes,
        "prefill_per_schedule": sizes.prefill if label == "prefilled" else 0,
        "prefill_s": prefill_s[0] if prefill_s else None,
        "killed": killed,
        "killed_at_s": killed_at,
        "duplicates": duplicates,
        "by_minute": rows,
        "tables_before": start_tables,
        "tables_after": end_tables,
        "samples": samples,
        "statements_first_minute": first_minute_statements,
        "statements_end": last_statements,
    }


def verdict(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets for one case: every minute but the failover's at >= 99% of the
    needed rate with lateness p99 < 100 ms; each table within 10% of its size after the
    first minute; no duplicates."""
    needed = result["tasks"] / PERIOD
    failover = int(result["killed_at_s"] // 60)
    rows = [r for r in result["by_minute"] if r["minute"] != failover]
    slow = [r["minute"] for r in rows if r["runs_per_second"] < RUNS_TARGET * needed]
    late = [
        r["minute"]
        for r in rows
        if r["lateness_p99_s"] is None or r["lateness_p99_s"] >= LATENESS_P99_TARGET
    ]
    # "Within 10% of their size after the first minute": from the first look at or after
    # 60 s (the first autovacuum has come by then) to the last.
    samples = result["samples"]
    after = next((s for s in samples if s["t"] >= 60), samples[0])
    drift = {}
    sizes = {}
    for table in TABLES:
        short = table.removeprefix("scheduler_plugin_")
        first = after["tables"][table]["total_bytes"]
        last = samples[-1]["tables"][table]["total_bytes"]
        drift[short] = last / first - 1 if first else None
        sizes[short] = (first / 2**20, last / 2**20)
    return {
        "sizes_mb": sizes,
        "minutes_below_rate": slow,
        "minutes_late": late,
        "size_drift": drift,
        "met": not slow
        and not late
        and result["duplicates"] == 0
        and all(d is not None and d <= SIZE_DRIFT_TARGET for d in drift.values()),
    }


def fmt_mb(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def report(results: dict[str, Any]) -> str:
    lines = [
        f"# Sustained load ({results['date']}, {results['machine']})",
        "",
        "Written by `python -m bench.sustained` "
        "(bench/sustained.py says how it measures). Lateness is the target's own: the wall "
        "clock as it was called, minus its slot.",
        "",
    ]
    for result in results["cases"]:
        v = result["verdict"]
        lines += [
            f"## {result['case']}: {result['tasks']:,} schedules every {PERIOD:g} s, "
            f"3 replicas, {result['minutes']} minutes",
            "",
            f"- prefilled runs per schedule: {result['prefill_per_schedule']:,}"
            + (f" (took {result['prefill_s']:.0f} s)" if result["prefill_s"] else ""),
            f"- leader {result['killed']} SIGKILLed at {result['killed_at_s']:.0f} s; "
            f"duplicates: {result['duplicates']}",
            f"- target met: {'yes' if v['met'] else 'no'} (minutes below 99% of the rate: "
            f"{v['minutes_below_rate'] or 'none'}; minutes with p99 >= 100 ms: "
            f"{v['minutes_late'] or 'none'}; from the first look after a minute to the "
            f"last, tasks {_sizes(v, 'tasks')}, runs {_sizes(v, 'runs')})",
            f"- code: {_code(result.get('code') or results['code'])}",
            "",
            "| minute | runs/s | lateness p50 | p99 | max | slots not run | tasks MB "
            "| tasks dead | runs MB | runs dead | (auto)vacuums tasks | runs | RSS MB |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in result["by_minute"]:
            lines.append(
                f"| {r['minute']} | {r['runs_per_second']:.0f} | {fmt_s(r['lateness_p50_s'])} "
                f"| {fmt_s(r['lateness_p99_s'])} | {fmt_s(r['lateness_max_s'])} "
                f"| {r['slots_not_run']:,} | {fmt_mb(r.get('tasks_mb'))} "
                f"| {r.get('tasks_dead', '-')} | {fmt_mb(r.get('runs_mb'))} "
                f"| {r.get('runs_dead', '-')} "
                f"| {r.get('tasks_autovacuums', '-')}+{r.get('tasks_vacuums', '-')} "
                f"| {r.get('runs_autovacuums', '-')}+{r.get('runs_vacuums', '-')} "
                f"| {fmt_mb(r.get('rss_mb_max'))} |"
            )
        lines += ["", "Server time by statement, the whole run (pg_stat_statements):", ""]
        lines += ["| calls | mean ms | total s | statement |", "|---|---|---|---|"]
        for s in result["statements_end"][:8]:
            lines.append(
                f"| {s['calls']:,} | {s['mean_ms']:.2f} | {s['total_ms'] / 1000:.1f} "
                f"| `{s['query'][:90]}` |"
            )
        lines.append("")
    return "\n".join(lines) + "\n"


def plots(results: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rate, size) = plt.subplots(1, 2, figsize=(12, 4.2))
    for result in results["cases"]:
        rows = result["by_minute"]
        minutes = [r["minute"] for r in rows]
        rate.plot(minutes, [r["runs_per_second"] for r in rows], label=f"{result['case']} runs/s")
        samples = result["samples"]
        ts = [s["t"] / 60 for s in samples]
        for table in TABLES:
            short = table.removeprefix("scheduler_plugin_")
            size.plot(
                ts,
                [s["tables"][table]["total_bytes"] / 2**20 for s in samples],
                label=f"{result['case']}: {short}",
            )
        rate.axvline(result["killed_at_s"] / 60, color="grey", linestyle=":", linewidth=1)
    rate.set_xlabel("minute")
    rate.set_ylabel("runs per second (target: 1,000)")
    rate.set_ylim(0, 1100)
    rate.set_title("runs/s each minute (dotted: leader SIGKILLed)")
    rate.grid(True, alpha=0.3)
    rate.legend(fontsize=8)
    size.set_xlabel("minute")
    size.set_ylabel("MB, with indexes")
    size.set_yscale("log")
    size.set_title("table sizes")
    size.grid(True, alpha=0.3)
    size.legend(fontsize=8)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "sustained_load.png", dpi=110)
    plt.close(fig)
    return ["sustained_load.png"]


def _sizes(verdict: dict[str, Any], short: str) -> str:
    first, last = verdict["sizes_mb"][short]
    return f"{first:.1f} -> {last:.1f} MB ({_pct(verdict['size_drift'][short])})"


def _code(code: dict[str, Any]) -> str:
    changed = code.get("changed") or []
    return code["commit"][:12] + (f" with changes to {', '.join(changed)}" if changed else "")


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.0%}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.sustained")
    parser.add_argument("--quick", action="store_true", help="2,000 schedules, 2 minutes")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--minutes", type=int, help="how long each case runs")
    parser.add_argument("--tasks", type=int, help="how many schedules")
    parser.add_argument(
        "--env", nargs="*", default=[], metavar="NAME=VALUE", help="for every replica"
    )
    parser.add_argument(
        "--only", nargs="+", choices=("fresh", "prefilled"), default=("fresh", "prefilled")
    )
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else Sizes()
    if args.minutes:
        sizes = Sizes(sizes.tasks, args.minutes, sizes.prefill)
    if args.tasks:
        sizes = Sizes(args.tasks, sizes.minutes, sizes.prefill)
    # Logs and stamps, not committed; a smoke run's apart (a case clears its stamps).
    workdir = RESULTS / ".work" / ("sustained-quick" if args.quick else "sustained")
    with ExitStack() as stack:
        admin = admin_dsn(stack, {"shared_preload_libraries": "pg_stat_statements"})
        cases = []
        for label in args.only:
            env = dict(item.split("=", 1) for item in args.env)
            result = asyncio.run(case(admin, workdir, label, sizes, env))
            result["verdict"] = verdict(result)
            cases.append(result)
            print(json.dumps({"case": label, "verdict": result["verdict"]}), flush=True)
    results = {"code": code_version(), "env": args.env, "cases": cases}
    save_results("sustained", results, report, args.out)
    plots(results, args.out)


if __name__ == "__main__":
    main()
