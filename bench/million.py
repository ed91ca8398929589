"""A million schedules: does a run cost the leader the same at 1,000,000 schedules as at
10,000 (issue 30, item 3)?

Two cases at the same rate, 278 runs a second, so that only the number of schedules
differs: 10,000 runtime schedules every 36 s, and 1,000,000 hourly. Slots spread evenly
over the period (schedule i at T0 + i * period / N). One leader (`run --only plugin`) on a
fresh database of the durable cluster; the rows inserted by plain SQL (bench/scale.py's
add_runtime_schedules, timed here: rows a second). Over a window of WINDOW seconds:

- every slot due in the window, and its lateness (finished_at - slot: the target does
  nothing), p50 / p99 / max; slots not run;
- the leader's CPU (utime + stime, 100% = one core) and per run (ms of CPU a run); the
  CPU of its database backends;
- the leader's RSS at the window's start and end;
- with py-spy installed (`.venv/bin/pip install py-spy`; not a dependency), where its
  CPU goes.

    .venv/bin/python -m bench.million [--quick] [--out DIR]
"""

from __future__ import annotations

import asyncio
import time
from contextlib import ExitStack
from datetime import timedelta
from pathlib import Path
from typing import Any

import asyncpg

from bench.common import RESULTS, admin_dsn, bench_arguments, fresh_database, save_results
from bench.growth import Meter, backend_pids, summary
from bench.scale import NOOP, Leader, add_runtime_schedules, names, py_spy
from bench.sustained import rss_mb

RATE = 10_000 / 36.0  # runs a second in both cases (1,000,000 / 3,600 s)


async def insert_rate(admin: str, count: int) -> float:
    """Rows a second of add_runtime_schedules, in a database of its own."""
    dsn = await fresh_database(admin, "bench_million_insert")
    conn = await asyncpg.connect(dsn)
    try:
        started = time.monotonic()
        await add_runtime_schedules(conn, count, NOOP, 3600.0)
        return count / (time.monotonic() - started)
    finally:
        await conn.close()


async def case(admin: str, workdir: Path, count: int, window: float) -> dict[str, Any]:
    period = count / RATE
    async with Leader(admin, workdir, count, every=period) as leader:
        # T0 far enough ahead for the UPDATE that sets a million slots to commit first (it
        # rewrites every row and its index entries: about 10 s here); with the default 2 s
        # the first seconds of slots were due before they were visible, and late by that.
        t0 = await leader.set_slots(1.0, lead=2.0 + count / 25_000)
        t_end = t0 + timedelta(seconds=window)
        await leader.sleep_until(t0)
        rss_start = rss_mb(leader.pid)
        meter = Meter(leader.pid, await backend_pids(leader.db))
        await meter.start(leader.db)
        profile = await py_spy(leader.pid, min(20.0, window - 1))
        await leader.sleep_until(t_end)
        usage = await meter.stop(leader.db)
        rss_end = rss_mb(leader.pid)
        await asyncio.sleep(2.0)
        t_stop = await leader.db.fetchval("SELECT now()")
        leader.stop()
        # Schedule i's slots: t0 + i * period / N + k * period, those before t_end.
        slot_names: list[str] = []
        slot_times = []
        for index, name in enumerate(names(count)):
            slot = t0 + timedelta(seconds=index * period / count)
            while slot < t_end:
                slot_names.append(name)
                slot_times.append(slot)
                slot += timedelta(seconds=period)
        rows = await leader.db.fetch(
            "WITH slots AS (SELECT * FROM unnest($1::text[], $2::timestamptz[]) AS s(name, slot)) "
            "SELECT r.status, extract(epoch FROM coalesce(r.finished_at, $3) - s.slot)::float8 "
            "AS done FROM slots s LEFT JOIN scheduler_plugin_runs r USING (name, slot)",
            slot_names, slot_times, t_stop,
        )  # fmt: skip
    ran = [r for r in rows if r["status"] == "succeeded"]
    runs_per_s = len(ran) / window
    cpu = usage["leader_cpu_percent"]
    return {
        "schedules": count,
        "period_s": period,
        "window_s": window,
        "slots": len(rows),
        "not_run": len(rows) - len(ran),
        "runs_per_second": runs_per_s,
        "lateness_s": summary([r["done"] for r in rows]),
        "leader_cpu_percent": cpu,
        "leader_cpu_ms_per_run": None if cpu is None else cpu * 10 / runs_per_s,
        "db_cpu_percent": usage["db_cpu_percent"],
        "rss_mb_start": rss_start,
        "rss_mb_end": rss_end,
        "startup_s": leader.startup_s,
        "profile": profile,
    }


def report(results: dict[str, Any]) -> str:
    lines = [
        "# A million schedules (bench/million.py)",
        "",
        f"{results['date']}, {results['machine']}. One leader, {RATE:.0f} runs a second in "
        f"both cases, slots spread; insert by plain SQL: {results['insert_rows_per_s']:,.0f} "
        "rows/s.",
        "",
        "| schedules | period | slots | not run | runs/s | lateness p50 / p99 / max | "
        "leader CPU | CPU per run | database CPU | leader RSS start / end |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in results["cases"]:
        lat = c["lateness_s"]
        lines.append(
            f"| {c['schedules']:,} | {c['period_s']:.0f} s | {c['slots']:,} | {c['not_run']} | "
            f"{c['runs_per_second']:.0f} | {lat['p50'] * 1000:.0f} / {lat['p99'] * 1000:.0f} / "
            f"{lat['max'] * 1000:.0f} ms | {c['leader_cpu_percent']:.1f}% | "
            f"{c['leader_cpu_ms_per_run']:.3f} ms | {c['db_cpu_percent']:.1f}% | "
            f"{c['rss_mb_start']:.0f} / {c['rss_mb_end']:.0f} MB |"
        )
    first, last = results["cases"][0], results["cases"][-1]
    lines += [
        "",
        f"CPU per run at {last['schedules']:,} schedules over {first['schedules']:,}: "
        f"{last['leader_cpu_ms_per_run'] / first['leader_cpu_ms_per_run']:.2f}x "
        "(target: within 1.5x).",
    ]
    for c in results["cases"]:
        profile = c.get("profile") or {}
        top = profile.get("self") or []
        if top:
            lines += ["", f"Where the leader's CPU went at {c['schedules']:,} (py-spy, "
                      "innermost frames, share of busy samples):", ""]  # fmt: skip
            lines += [f"- {e['share']:.1%} `{e['frame']}`" for e in top[:12]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = bench_arguments("bench.million", argv)
    small, large, window = (1_000, 100_000, 20.0) if args.quick else (10_000, 1_000_000, 90.0)
    workdir = RESULTS / ".work" / ("million-quick" if args.quick else "million")
    with ExitStack() as stack:
        admin = admin_dsn(stack)

        async def both() -> dict[str, Any]:
            rate = await insert_rate(admin, large)
            cases = [
                await case(admin, workdir / "small", small, window),
                await case(admin, workdir / "large", large, window),
            ]
            return {"insert_rows_per_s": rate, "cases": cases}

        results = asyncio.run(both())
    save_results("million" + ("-quick" if args.quick else ""), results, report, args.out)


if __name__ == "__main__":
    main()
