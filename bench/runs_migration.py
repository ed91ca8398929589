"""Migration 0012 on an existing 10 M-row run history, with the daemon running beside it.

Issue 30's target: no lock held by the migration longer than 1 s, and the daemon keeps
running. Steps:

1. A database at schema 0011 (migrations applied up to it, as an older release left it)
   holding ROWS finished runs: SCHEDULES schedules with 1,000 runs each, one every 10 s
   back from now; then VACUUM ANALYZE, as autovacuum would have left it.
2. A probe on a connection of its own, every 50 ms: the loop's own kinds of statement on
   the history (a run written, a schedule's newest runs read through the (name, slot)
   index), each timed. A statement queued behind a lock shows here.
3. `scheduler-daemon migrate` (this build): 0012 renames the old table and makes the
   partitioned one; its ACCESS EXCLUSIVE lasts as long as its transaction.
4. One replica runs the plugin loop with its SCHEDULES schedules every 10 s (the target
   `growth_tasks:stamp` writes its lateness outside the database) and the built-in
   purge_runs, which moves the old history in steps of 1,000 rows, each its own
   transaction, until the old table is dropped.

Reported: the migration's time, the longest step of the upkeep (pg_stat_statements'
max_exec_time of scheduler_runs_maintain: the longest any of its locks was held), the
probe's latency (p50, p99, max) in each phase, and the runs' lateness while the history
moved.

    .venv/bin/python -m bench.runs_migration [--quick] [--out DIR]
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import asyncpg

from bench.common import (
    ROOT,
    admin_dsn,
    bench_arguments,
    create_database,
    drop_database,
    migrate_up_to,
    percentile,
    save_results,
    start_daemon,
    stop_daemon,
)
from bench.growth_tasks import STAMPS

DB = "bench_runs_migration"
PER_SCHEDULE = 1000
PERIOD = 10.0
PROBE_EVERY = 0.05
STAMP = "growth_tasks:stamp"


async def at_0011(admin: str, schedules: int) -> tuple[str, float]:
    """A database as release 0011 left it, with its history; the seconds the fill took."""
    await drop_database(admin, DB, grace=0)
    await create_database(admin, DB)
    dsn = admin.rsplit("/", 1)[0] + f"/{DB}"
    conn = await asyncpg.connect(dsn)
    try:
        await migrate_up_to(conn, 11)
        started = time.monotonic()
        names = [f"s{i:07d}" for i in range(schedules)]
        await conn.execute("INSERT INTO scheduler_runnable_targets (target) VALUES ($1)", STAMP)
        await conn.execute(
            "INSERT INTO scheduler_plugin_tasks (name, target, every_seconds, next_run_at, "
            "run_count) SELECT n, $2, $3, now() + interval '1 hour', $4 FROM unnest($1::text[]) n",
            names, STAMP, PERIOD, PER_SCHEDULE,
        )  # fmt: skip
        for chunk in range(0, schedules, 500):
            await conn.execute(
                "INSERT INTO scheduler_plugin_runs "
                "(name, slot, instance, started_at, finished_at, status) "
                "SELECT n, s, 'prefill', s, s + interval '1 millisecond', 'succeeded' "
                "FROM unnest($1::text[]) AS n, LATERAL (SELECT date_trunc('second', now()) "
                "  - make_interval(secs => k * $2::float8) AS s "
                "  FROM generate_series(1, $3::int) AS k) slots",
                names[chunk : chunk + 500], PERIOD, PER_SCHEDULE,
            )  # fmt: skip
        await conn.execute("VACUUM ANALYZE scheduler_plugin_runs")
        return dsn, time.monotonic() - started
    finally:
        await conn.close()


async def probe(dsn: str, phase: list[str], out: list[tuple[str, float, float]]) -> None:
    """Until cancelled: every PROBE_EVERY a write and a read of the history, each timed,
    labelled with the phase it ran in."""
    conn = await asyncpg.connect(dsn)
    try:
        i = 0
        while True:
            i += 1
            t = time.monotonic()
            await conn.execute(
                "INSERT INTO scheduler_plugin_runs (name, slot, instance, status, finished_at) "
                "VALUES ('probe', clock_timestamp(), 'probe', 'succeeded', clock_timestamp())"
            )
            w = time.monotonic()
            await conn.fetch(
                "SELECT id FROM scheduler_plugin_runs WHERE name = 's0000001' "
                "ORDER BY slot DESC LIMIT 20"
            )
            r = time.monotonic()
            out.append((phase[0], (w - t) * 1000, (r - w) * 1000))
            await asyncio.sleep(max(0.0, PROBE_EVERY - (r - t)))
    finally:
        await conn.close()


def summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {
        "n": len(values),
        "p50_ms": percentile(values, 0.5),
        "p99_ms": percentile(values, 0.99),
        "max_ms": max(values),
    }


def lateness(directory: Path) -> list[float]:
    late = []
    for path in directory.glob("*.stamps"):
        for line in path.read_text().splitlines():
            _name, slot, wall, _instance = line.split()
            late.append((float(wall) - float(slot)) * 1000)
    return late


async def run(schedules: int, workdir: Path) -> dict[str, Any]:
    with ExitStack() as stack:
        admin = admin_dsn(stack, {"shared_preload_libraries": "pg_stat_statements"})
        dsn, fill_s = await at_0011(admin, schedules)
        async with asyncpg.create_pool(dsn, min_size=1, max_size=2) as db:
            await db.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            before_rows = await db.fetchval("SELECT count(*) FROM scheduler_plugin_runs")
            phase = ["before"]
            probes: list[tuple[str, float, float]] = []
            prober = asyncio.create_task(probe(dsn, phase, probes))
            await asyncio.sleep(5)
            phase[0] = "migrate"
            environment = {k: v for k, v in os.environ.items() if not k.startswith("SCHEDULER_")}
            t = time.monotonic()
            migrated = await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-m", "scheduler_daemon", "migrate"],
                env=environment | {"SCHEDULER_DATABASE_URL": dsn},
                capture_output=True, text=True, check=False,
            )  # fmt: skip
            migrate_s = time.monotonic() - t
            assert migrated.returncode == 0, migrated.stderr
            await db.execute("SELECT pg_stat_statements_reset()")
            phase[0] = "moving"
            stamps = workdir / "stamps"
            stamps.mkdir(parents=True, exist_ok=True)
            for old in stamps.glob("*.stamps"):
                old.unlink()
            await db.execute(
                "UPDATE scheduler_plugin_tasks SET next_run_at = now() + interval '5 seconds' "
                "+ make_interval(secs => $1 * (substr(name, 2)::int % 1000) / 1000.0)",
                PERIOD,
            )
            daemon = start_daemon(
                dsn, workdir, interval="1s", only="plugin",
                env={
                    "SCHEDULER_PLUGIN__RUNNABLE": f'["{STAMP}"]',
                    "SCHEDULER_PLUGIN__DISABLED": '["purge_publications"]',
                    "SCHEDULER_LOG__LEVEL": "info",
                    "PYTHONPATH": os.pathsep.join([str(ROOT / "bench"), str(ROOT)]),
                    STAMPS: str(stamps),
                },
            )  # fmt: skip
            t = time.monotonic()
            try:
                while await db.fetchval("SELECT to_regclass('scheduler_plugin_runs_0011')"):
                    assert daemon.poll() is None, "the daemon exited"
                    await asyncio.sleep(1)
                moved_s = time.monotonic() - t
                phase[0] = "after"
                await asyncio.sleep(10)
            finally:
                stop_daemon(daemon)
                prober.cancel()
                await asyncio.gather(prober, return_exceptions=True)
            steps = await db.fetchrow(
                "SELECT calls, max_exec_time, mean_exec_time FROM pg_stat_statements "
                "WHERE query LIKE '%scheduler_runs_maintain(%' ORDER BY calls DESC LIMIT 1"
            )
            after_rows = await db.fetchval("SELECT count(*) FROM scheduler_plugin_runs")
            parts = await db.fetchval(
                "SELECT count(*) FROM pg_inherits WHERE inhparent = 'scheduler_plugin_runs'::regclass"
            )
        by_phase = {
            p: {
                "write": summary([w for ph, w, _ in probes if ph == p]),
                "read": summary([r for ph, _, r in probes if ph == p]),
            }
            for p in ("before", "migrate", "moving", "after")
        }
        late = lateness(stamps)
        return {
            "schedules": schedules,
            "rows_before": before_rows,
            "fill_s": fill_s,
            "migrate_s": migrate_s,
            "move_s": moved_s,
            "upkeep_steps": steps["calls"] if steps else None,
            "upkeep_step_max_ms": steps["max_exec_time"] if steps else None,
            "upkeep_step_mean_ms": steps["mean_exec_time"] if steps else None,
            "rows_after": after_rows,
            "partitions": parts,
            "probe": by_phase,
            "runs": len(late),
            "lateness": summary(late),
        }


def report(results: dict[str, Any]) -> str:
    r = results["result"]
    lines = [
        "# Migration 0012 on an existing run history (bench/runs_migration.py)",
        "",
        f"{results['date']}, {results['machine']}. {r['rows_before']:,} runs of "
        f"{r['schedules']:,} schedules at schema 0011 (filled in {r['fill_s']:.0f} s); "
        f"one replica runs them every {PERIOD:g} s throughout.",
        "",
        "| what | value |",
        "|---|---|",
        f"| `scheduler-daemon migrate` (0012, one transaction) | {r['migrate_s']:.2f} s |",
        f"| old history moved by purge_runs, until the old table dropped | {r['move_s']:.0f} s |",
        f"| upkeep steps (each its own transaction) | {r['upkeep_steps']} |",
        f"| longest step (the longest any of its locks was held) | "
        f"{r['upkeep_step_max_ms']:.0f} ms (mean {r['upkeep_step_mean_ms']:.1f} ms) |",
        f"| runs after (moved, younger than 7 days, plus the new) | {r['rows_after']:,} in "
        f"{r['partitions']} partitions |",
        f"| the replica's runs while it moved: lateness p50 / p99 / max | "
        f"{r['lateness'].get('p50_ms', 0):.0f} / {r['lateness'].get('p99_ms', 0):.0f} / "
        f"{r['lateness'].get('max_ms', 0):.0f} ms ({r['runs']:,} runs) |",
        "",
        "The probe (a run written, a schedule's newest 20 read; every 50 ms on its own "
        "connection), in ms:",
        "",
        "| phase | write p50 | write p99 | write max | read p50 | read p99 | read max |",
        "|---|---|---|---|---|---|---|",
    ]
    for phase, kinds in r["probe"].items():
        w, rd = kinds["write"], kinds["read"]
        if not w:
            continue
        lines.append(
            f"| {phase} ({w['n']}) | {w['p50_ms']:.1f} | {w['p99_ms']:.1f} | {w['max_ms']:.1f} | "
            f"{rd['p50_ms']:.1f} | {rd['p99_ms']:.1f} | {rd['max_ms']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = bench_arguments("bench.runs_migration", argv)
    schedules = 200 if args.quick else 10_000
    workdir = (
        ROOT
        / "bench"
        / "results"
        / ".work"
        / ("runs_migration-quick" if args.quick else "runs_migration")
    )
    result = asyncio.run(run(schedules, workdir))
    save_results(
        "runs_migration" + ("-quick" if args.quick else ""), {"result": result}, report, args.out
    )


if __name__ == "__main__":
    main()
