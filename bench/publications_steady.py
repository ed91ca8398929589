"""Publications at steady state: 50 M finished rows, 20 new a second (issue 30, item 5).

`publish.retention` keeps finished publications 30 days: at 20 a second, 52 million rows.
The publish loop's due read, `publications list` and the purge must cost the same with
them as without. Two cases, one after the other on one cluster:

- empty: a fresh database;
- steady: ROWS finished publications, published, their publish_at spread over the 30
  days of retention and one hour more (that hour is what the first purge finds), then
  VACUUM ANALYZE, as autovacuum would have left it.

In each, one replica runs both loops with the defaults (so `purge_publications` runs at
once, and then every 10 minutes) while a feeder inserts 20 publications a second, each
due 2 s after its insert. Reported: lateness (published_at - publish_at, both stamped by
the database), per minute; the purge's statements and the publish loop's due read from
pg_stat_statements (calls, mean, max); and `scheduler-daemon publications list` timed as
a user runs it (a process each: the first page, `--status failed`, `--status published`,
`--due-after -1h`).

    .venv/bin/python -m bench.publications_steady [--quick] [--out DIR]
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from contextlib import ExitStack
from typing import Any

import asyncpg

from bench.common import (
    ROOT,
    admin_dsn,
    bench_arguments,
    fresh_database,
    percentile,
    save_results,
    start_daemon,
    stop_daemon,
)

RATE = 20.0
LEAD = 2.0
RETENTION_DAYS = 30
LISTS = {
    "first page": [],
    "--status failed": ["--status", "failed"],
    "--status published": ["--status", "published"],
    "--due-after -1h": ["--due-after", "-1h"],
}

STATEMENTS = r"""
SELECT left(regexp_replace(regexp_replace(query, '--[^\n]*', '', 'g'), '\s+', ' ', 'g'), 90)
           AS query, calls, mean_exec_time AS mean_ms, max_exec_time AS max_ms, rows
FROM pg_stat_statements
WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND (query LIKE '%SKIP LOCKED%' OR query LIKE '%DELETE FROM scheduler_publications%')
ORDER BY total_exec_time DESC LIMIT 6
"""


async def fill(conn: asyncpg.Connection, rows: int) -> float:
    started = time.monotonic()
    span = (RETENTION_DAYS * 86400 + 3600) / max(rows, 1)
    step = 1_000_000
    for first in range(0, rows, step):
        count = min(step, rows - first)
        await conn.execute(
            "INSERT INTO scheduler_publications "
            "(payload, publish_at, status, published_at, published_by, attempts, created_at) "
            "SELECT '{\"order\": 1, \"kind\": \"x\"}', t, 'published', t, 'fill', 1, t "
            "FROM (SELECT now() - make_interval(secs => i * $3::float8) AS t "
            "      FROM generate_series($1::bigint, $2::bigint) i) s",
            first + 1, first + count, span,
        )  # fmt: skip
    await conn.execute("VACUUM ANALYZE scheduler_publications")
    return time.monotonic() - started


async def feed(dsn: str, seconds: float, fed: list[int]) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        t0 = time.monotonic()
        i = 0
        while time.monotonic() - t0 < seconds:
            i += 1
            row = await conn.fetchval(
                "INSERT INTO scheduler_publications (payload, publish_at) "
                "VALUES ('{\"fed\": true}', clock_timestamp() + make_interval(secs => $1)) "
                "RETURNING id",
                LEAD,
            )
            fed.append(row)
            await asyncio.sleep(max(0.0, t0 + i / RATE - time.monotonic()))
    finally:
        await conn.close()


def list_time(dsn: str, args: list[str]) -> float:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("SCHEDULER_")}
    best = float("inf")
    for _ in range(3):
        t = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "scheduler_daemon", "publications", "list", *args],
            env=environment | {"SCHEDULER_DATABASE_URL": dsn},
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        best = min(best, time.monotonic() - t)
    return best


async def case(admin: str, label: str, rows: int, minutes: float) -> dict[str, Any]:
    dsn = await fresh_database(admin, f"bench_pubs_{label}")
    async with asyncpg.create_pool(dsn, min_size=1, max_size=2) as db:
        await db.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        fill_s = 0.0
        if rows:
            async with db.acquire() as conn:
                fill_s = await fill(conn, rows)
        size = await db.fetchval("SELECT pg_total_relation_size('scheduler_publications')")
        await db.execute("SELECT pg_stat_statements_reset()")
        workdir = ROOT / "bench" / "results" / ".work" / f"publications_{label}"
        daemon = start_daemon(
            dsn, workdir, only=None,
            env={"SCHEDULER_PLUGIN__DISABLED": '["purge_runs"]', "SCHEDULER_LOG__LEVEL": "info"},
        )  # fmt: skip
        fed: list[int] = []
        try:
            t0 = time.time()
            await feed(dsn, minutes * 60, fed)
            await asyncio.sleep(LEAD + 3)
        finally:
            stop_daemon(daemon)
        late = await db.fetch(
            "SELECT (extract(epoch FROM published_at - publish_at) * 1000)::float8 AS ms, "
            "extract(epoch FROM publish_at)::float8 AS at FROM scheduler_publications "
            "WHERE id = ANY($1::bigint[])",
            fed,
        )
        statements = [dict(r) for r in await db.fetch(STATEMENTS)]
        purged = await db.fetchval(
            "SELECT count(*) FROM scheduler_publications WHERE status <> 'scheduled' "
            "AND publish_at < now() - make_interval(days => $1)",
            RETENTION_DAYS,
        )
    missed = len(fed) - sum(1 for r in late if r["ms"] is not None)
    by_minute = []
    for minute in range(int(minutes + 0.999)):
        inside = [
            float(r["ms"]) for r in late
            if r["ms"] is not None and minute * 60 <= r["at"] - t0 < (minute + 1) * 60
        ]  # fmt: skip
        if inside:
            by_minute.append(
                {"minute": minute, "n": len(inside), "p50_ms": percentile(inside, 0.5),
                 "p99_ms": percentile(inside, 0.99), "max_ms": max(inside)}
            )  # fmt: skip
    lists = {name: await asyncio.to_thread(list_time, dsn, args) for name, args in LISTS.items()}
    values = [float(r["ms"]) for r in late if r["ms"] is not None]
    return {
        "case": label,
        "rows": rows,
        "fill_s": fill_s,
        "table_bytes": size,
        "fed": len(fed),
        "not_published": missed,
        "left_past_retention": purged,
        "lateness": {
            "p50_ms": percentile(values, 0.5),
            "p99_ms": percentile(values, 0.99),
            "max_ms": max(values),
        },
        "by_minute": by_minute,
        "statements": statements,
        "list_s": lists,
    }


def report(results: dict[str, Any]) -> str:
    lines = [
        "# Publications at steady state (bench/publications_steady.py)",
        "",
        f"{results['date']}, {results['machine']}. One replica, both loops, defaults; "
        f"{RATE:g} new publications a second, each due {LEAD:g} s after its insert.",
        "",
        "| case | finished rows | table | publish lateness p50 / p99 / max | not published | "
        "left past retention |",
        "|---|---|---|---|---|---|",
    ]
    for c in results["cases"]:
        lat = c["lateness"]
        lines.append(
            f"| {c['case']} | {c['rows']:,} | {c['table_bytes'] / 2**30:.1f} GB | "
            f"{lat['p50_ms']:.1f} / {lat['p99_ms']:.1f} / {lat['max_ms']:.1f} ms | "
            f"{c['not_published']} | {c['left_past_retention']:,} |"
        )
    lines += ["", "Lateness p99 by minute (ms):", "", "| case | " + " | ".join(
        str(m["minute"]) for m in results["cases"][0]["by_minute"]) + " |"]  # fmt: skip
    lines.append("|---" * (1 + len(results["cases"][0]["by_minute"])) + "|")
    for c in results["cases"]:
        lines.append(
            f"| {c['case']} | " + " | ".join(f"{m['p99_ms']:.1f}" for m in c["by_minute"]) + " |"
        )
    lines += ["", "`scheduler-daemon publications list`, best of 3, seconds (a process each):", ""]
    names = list(LISTS)
    lines.append("| case | " + " | ".join(f"`{n}`" for n in names) + " |")
    lines.append("|---" * (1 + len(names)) + "|")
    for c in results["cases"]:
        lines.append(
            f"| {c['case']} | " + " | ".join(f"{c['list_s'][n]:.2f}" for n in names) + " |"
        )
    lines += ["", "The purge and the due read (pg_stat_statements):", ""]
    lines.append("| case | statement | calls | mean ms | max ms |")
    lines.append("|---|---|---|---|---|")
    for c in results["cases"]:
        for s in c["statements"]:
            lines.append(
                f"| {c['case']} | `{s['query']}` | {s['calls']} | {s['mean_ms']:.2f} | "
                f"{s['max_ms']:.1f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = bench_arguments("bench.publications_steady", argv)
    rows, minutes = (500_000, 1.0) if args.quick else (50_000_000, 5.0)
    with ExitStack() as stack:
        admin = admin_dsn(stack, {"shared_preload_libraries": "pg_stat_statements"})

        async def both() -> list[dict[str, Any]]:
            return [
                await case(admin, "empty", 0, minutes),
                await case(admin, "steady", rows, minutes),
            ]

        cases = asyncio.run(both())
    name = "publications_steady" + ("-quick" if args.quick else "")
    save_results(name, {"cases": cases}, report, args.out)


if __name__ == "__main__":
    main()
