"""Publishing benchmark: our publish loop against the seed design, in one run.

- throughput: 100,000 rows already due; ours is the real daemon process (one leader,
  default batch size), timed by the database's own published_at stamps; the baseline is
  what the seed did — select the due rows, then publish them one row at a time, one
  statement and commit per row — through an asyncpg pool (how the seed ran its queries;
  the brief's "seed's pattern, ported to an asyncpg pool"), and, as its best case, on
  one dedicated connection.
- lateness: 400 rows due at random instants over 20 s while a leader waits; lateness is
  published_at - publish_at, both stamped by the database. The baseline polls on a fixed
  1 s interval, as the seed's free-running timer did.

It runs against a throwaway cluster (the test rig's), or SCHEDULER_BENCH_DATABASE_URL (an
admin DSN where databases may be created). Numbers depend on the machine: compare the two
columns of one run, not runs across machines.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import asyncpg

from bench.common import (
    RESULTS,
    admin_dsn,
    bench_arguments,
    drop_database,
    fresh_database,
    percentile,
    save_results,
    start_daemon,
    stop_daemon,
)


@dataclass(frozen=True)
class Sizes:
    throughput_rows: int = 100_000
    lateness_rows: int = 400
    lateness_spread: float = 20.0


QUICK = Sizes(throughput_rows=5_000, lateness_rows=40, lateness_spread=4.0)


async def wait_all_published(conn: asyncpg.Connection, total: int, within: float) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        done = await conn.fetchval(
            "SELECT count(*) FROM scheduler_publications WHERE status = 'published'"
        )
        if done >= total:
            return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"only {done} of {total} published after {within}s")


async def insert_due(conn: asyncpg.Connection, rows: int) -> None:
    await conn.execute(
        "INSERT INTO scheduler_publications (key, payload, publish_at) "
        "SELECT 'b' || g, jsonb_build_object('n', g), now() - interval '1 s' "
        "FROM generate_series(1, $1) g",
        rows,
    )


async def ours_throughput(dsn: str, workdir: Path, rows: int) -> dict[str, float]:
    conn = await asyncpg.connect(dsn)
    try:
        await insert_due(conn, rows)
        daemon = start_daemon(dsn, workdir)
        try:
            await wait_all_published(conn, rows, within=600)
        finally:
            stop_daemon(daemon)
        first, last = await conn.fetchrow(
            "SELECT min(published_at), max(published_at) FROM scheduler_publications"
        )
    finally:
        await conn.close()
    seconds = (last - first).total_seconds()
    return {
        "rows": rows,
        "seconds": seconds,
        "rows_per_second": rows / seconds,
    }


async def seed_publish_tick(conn: asyncpg.Connection | asyncpg.Pool) -> int:
    """The seed's tick: select due rows, then one UPDATE (and commit) per row.

    Given a pool, each statement borrows a connection and returns it (with asyncpg's
    reset), which is how the seed ran every query; given one connection, it is the best
    case of the same design."""
    due = await conn.fetch(
        "SELECT id FROM scheduler_publications WHERE status = 'scheduled' AND publish_at <= now() "
        "ORDER BY publish_at"
    )
    for row in due:
        await conn.execute(
            "UPDATE scheduler_publications SET status = 'published', "
            "published_at = clock_timestamp(), published_by = 'seed' "
            "WHERE id = $1 AND status = 'scheduled'",
            row["id"],
        )
    return len(due)


async def baseline_throughput(dsn: str, pooled: bool, rows: int) -> dict[str, float]:
    conn = await asyncpg.connect(dsn)
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=5) if pooled else None
    try:
        await insert_due(conn, rows)
        started = time.perf_counter()
        published = await seed_publish_tick(pool or conn)
        seconds = time.perf_counter() - started
    finally:
        await conn.close()
        if pool is not None:
            await pool.close()
    return {"rows": published, "seconds": seconds, "rows_per_second": published / seconds}


async def schedule_spread(conn: asyncpg.Connection, seed: int, sizes: Sizes) -> None:
    rng = random.Random(seed)
    offsets = [2.0 + rng.uniform(0, sizes.lateness_spread) for _ in range(sizes.lateness_rows)]
    await conn.executemany(
        "INSERT INTO scheduler_publications (payload, publish_at) "
        "VALUES ('{}', now() + make_interval(secs => $1))",
        [(offset,) for offset in offsets],
    )


async def lateness_of(conn: asyncpg.Connection) -> dict[str, float]:
    rows = await conn.fetch(
        "SELECT extract(epoch FROM published_at - publish_at)::float8 AS late "
        "FROM scheduler_publications WHERE status = 'published'"
    )
    values = [row["late"] * 1000 for row in rows]
    return {
        "rows": len(values),
        "p50_ms": percentile(values, 0.5),
        "p99_ms": percentile(values, 0.99),
        "max_ms": max(values),
        "mean_ms": statistics.fmean(values),
    }


async def ours_lateness(dsn: str, workdir: Path, sizes: Sizes) -> dict[str, float]:
    conn = await asyncpg.connect(dsn)
    daemon = start_daemon(dsn, workdir)
    try:
        await asyncio.sleep(1.5)  # let it lead and settle
        await schedule_spread(conn, seed=1, sizes=sizes)
        await wait_all_published(conn, sizes.lateness_rows, within=sizes.lateness_spread + 30)
        return await lateness_of(conn)
    finally:
        stop_daemon(daemon)
        await conn.close()


async def baseline_lateness(dsn: str, sizes: Sizes) -> dict[str, float]:
    conn = await asyncpg.connect(dsn)
    try:
        await schedule_spread(conn, seed=1, sizes=sizes)
        deadline = time.monotonic() + sizes.lateness_spread + 10
        published = 0
        while published < sizes.lateness_rows and time.monotonic() < deadline:
            published += await seed_publish_tick(conn)
            await asyncio.sleep(1.0)
        return await lateness_of(conn)
    finally:
        await conn.close()


async def run(admin_dsn: str, workdir: Path, sizes: Sizes) -> dict[str, Any]:
    results: dict[str, Any] = {"sizes": asdict(sizes)}
    dsn = await fresh_database(admin_dsn, "bench_ours_tp")
    results["throughput_ours"] = await ours_throughput(dsn, workdir / "tp", sizes.throughput_rows)
    dsn = await fresh_database(admin_dsn, "bench_seed_tp")
    results["throughput_seed"] = await baseline_throughput(
        dsn, pooled=True, rows=sizes.throughput_rows
    )
    dsn = await fresh_database(admin_dsn, "bench_seed1_tp")
    results["throughput_seed_one_connection"] = await baseline_throughput(
        dsn, pooled=False, rows=sizes.throughput_rows
    )
    dsn = await fresh_database(admin_dsn, "bench_ours_late")
    results["lateness_ours"] = await ours_lateness(dsn, workdir / "late", sizes)
    dsn = await fresh_database(admin_dsn, "bench_seed_late")
    results["lateness_seed"] = await baseline_lateness(dsn, sizes)
    for name in ("bench_ours_tp", "bench_seed_tp", "bench_seed1_tp", "bench_ours_late",
                 "bench_seed_late"):  # fmt: skip
        await drop_database(admin_dsn, name, grace=0)
    ours = results["throughput_ours"]["rows_per_second"]
    results["throughput_ratio"] = ours / results["throughput_seed"]["rows_per_second"]
    results["throughput_ratio_one_connection"] = (
        ours / results["throughput_seed_one_connection"]["rows_per_second"]
    )
    return results


def report(results: dict[str, Any]) -> str:
    tp_ours, tp_seed = results["throughput_ours"], results["throughput_seed"]
    tp_one = results["throughput_seed_one_connection"]
    late_ours, late_seed = results["lateness_ours"], results["lateness_seed"]
    sizes = Sizes(**results["sizes"])

    def rate(r: dict[str, float]) -> str:
        return f"{r['rows_per_second']:,.0f} rows/s ({r['seconds']:.2f} s)"

    return "\n".join(
        [
            f"# Publishing benchmark ({results['date']}, {results['machine']})",
            "",
            "PostgreSQL with fsync and synchronous_commit on. Seed design: select the due "
            "rows, then one UPDATE and commit per row; through an asyncpg pool as the seed "
            "ran its queries, and on one dedicated connection (its best case).",
            "",
            "| | scheduler-daemon | seed, pooled | seed, one connection |",
            "|---|---|---|---|",
            f"| throughput, {sizes.throughput_rows:,} due rows | {rate(tp_ours)} | {rate(tp_seed)} "
            f"| {rate(tp_one)} |",
            f"| ours / baseline | | {results['throughput_ratio']:.1f}x "
            f"| {results['throughput_ratio_one_connection']:.1f}x |",
            "",
            f"Lateness (published_at - publish_at), {sizes.lateness_rows} rows due at random "
            f"instants over {sizes.lateness_spread:g} s; the seed polls every 1 s.",
            "",
            "| | scheduler-daemon | seed, 1 s poll |",
            "|---|---|---|",
            f"| p50 | {late_ours['p50_ms']:.1f} ms | {late_seed['p50_ms']:.1f} ms |",
            f"| p99 | {late_ours['p99_ms']:.1f} ms | {late_seed['p99_ms']:.1f} ms |",
            f"| max | {late_ours['max_ms']:.1f} ms | {late_seed['max_ms']:.1f} ms |",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    args = bench_arguments("bench.publish", argv)
    with ExitStack() as stack:
        sizes = QUICK if args.quick else Sizes()
        results = asyncio.run(run(admin_dsn(stack), RESULTS / ".work", sizes))
    save_results("publish", results, report, args.out)


if __name__ == "__main__":
    main()
