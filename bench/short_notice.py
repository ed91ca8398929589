"""Short-notice lateness: a row another process schedules while the leader idles.

The leader sleeps until its next planned tick (up to ``publish.interval``, 30 s here). A
row scheduled sooner by another process must wake it: on PostgreSQL a NOTIFY from the
table's trigger, on SQLite the leader's watch of its files and ``PRAGMA data_version``.
Each trial schedules one row through the client API from this process, at a random
moment, either 1 s ahead or due at once, and lateness is published_at - publish_at as
the database stamped them.

    python -m bench.short_notice [--trials N]
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from contextlib import ExitStack
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from bench.common import (
    admin_dsn,
    bench_arguments,
    fresh_database,
    percentile,
    save_results,
    start_daemon,
    stop_daemon,
)
from scheduler_daemon.client import Client
from scheduler_daemon.config.settings import Settings

INTERVAL = "30s"
LEADS = {"1 s ahead": 1.0, "due at once": 0.0}


async def trials(url: str, workdir: Path, count: int) -> dict[str, dict[str, float]]:
    daemon = start_daemon(url, workdir, interval=INTERVAL)
    rng = random.Random(7)
    results: dict[str, dict[str, float]] = {}
    try:
        await asyncio.sleep(2.0)  # leading, and idle: its next tick is INTERVAL away
        async with Client.connect(Settings(database_url=url)) as client:
            for label, lead in LEADS.items():
                late: list[float] = []
                for _ in range(count):
                    await asyncio.sleep(rng.uniform(0.3, 1.0))
                    at = datetime.now(UTC) + timedelta(seconds=lead)
                    scheduled = await client.schedule(at, {"lead": lead})
                    publication = scheduled.publication.id
                    deadline = time.monotonic() + 35
                    while True:
                        row = await client.get(publication)
                        if row is not None and row.published_at is not None:
                            late.append((row.published_at - row.publish_at).total_seconds())
                            break
                        if time.monotonic() > deadline:
                            raise TimeoutError(f"{publication} not published")
                        await asyncio.sleep(0.01)
                ms = [max(v, 0.0) * 1000 for v in late]
                results[label] = {
                    "trials": len(ms),
                    "p50_ms": percentile(ms, 0.5),
                    "p99_ms": percentile(ms, 0.99),
                    "max_ms": max(ms),
                }
    finally:
        stop_daemon(daemon)
    return results


def report(results: dict[str, Any]) -> str:
    lines = [
        f"# Short-notice lateness ({results['date']}, {results['machine']})",
        "",
        f"The leader idles (publish.interval {INTERVAL}); another process schedules one row "
        f"at a random moment, {results['trials']} trials per row. Lateness = published_at "
        "- publish_at, database clock. PostgreSQL wakes the leader with NOTIFY; SQLite by "
        "its 100 ms watch of the files and PRAGMA data_version.",
        "",
        "| scheduled | backend | p50 | p99 | max |",
        "|---|---|---|---|---|",
    ]
    for label in LEADS:
        for backend in ("sqlite", "postgres"):
            r = results[backend][label]
            lines.append(
                f"| {label} | {backend} | {r['p50_ms']:.1f} ms | {r['p99_ms']:.1f} ms "
                f"| {r['max_ms']:.1f} ms |"
            )
    return "\n".join([*lines, ""])


def main(argv: list[str] | None = None) -> None:
    args = bench_arguments("bench.short_notice", argv)
    results: dict[str, Any] = {"trials": 5 if args.quick else 30}
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        results["sqlite"] = asyncio.run(
            trials(f"sqlite:///{work / 'short.db'}", work / "sqlite", results["trials"])
        )
        dsn = asyncio.run(fresh_database(admin_dsn(stack), "bench_short_notice"))
        results["postgres"] = asyncio.run(trials(dsn, work / "postgres", results["trials"]))
    save_results("short_notice", results, report, args.out)


if __name__ == "__main__":
    main()
