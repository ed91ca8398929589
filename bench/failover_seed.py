"""The seed design's leader election, one replica: the baseline of ``bench.failover``.

What the seed (the CMS this project comes from) did on every replica, on a free-running
timer: try the advisory lock, do the work if it got it, unlock, sleep a fixed interval.
Nothing is sticky (the lock is free between ticks, so whichever replica ticks next wins),
nobody waits on the lock, and there is no handover: SIGTERM ends the process as SIGKILL
does (Python's default action), since the seed had no shutdown path.

This is the seed's *best case*: lock, work and unlock run on one dedicated connection
(the seed ran them through a pool, which excluded nothing: see docs/leadership.md), and
the work is the same set-based statement our publish loop runs, so that the comparison is
of the election, not of the work. Each tick whose try-lock succeeds prints one JSON line
with the database's clock at the moment the lock was granted (``clock_timestamp()`` of
the ``pg_try_advisory_lock`` statement itself).

    python bench/failover_seed.py DSN INSTANCE [--key K] [--interval SECONDS]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import asyncpg

TRY_LOCK = "SELECT pg_try_advisory_lock($1), extract(epoch FROM clock_timestamp())::float8"
PUBLISH_DUE = """
UPDATE scheduler_publications
SET status = 'published', published_at = clock_timestamp(), published_by = $1,
    attempts = attempts + 1
WHERE status = 'scheduled' AND publish_at <= now()
"""


def emit(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


async def run(dsn: str, instance: str, key: int, interval: float) -> None:
    conn = await asyncpg.connect(dsn, server_settings={"application_name": f"seed/{instance}"})
    emit("seed.ready", instance=instance)
    while True:
        got, at = await conn.fetchrow(TRY_LOCK, key)
        if got:
            emit("seed.locked", instance=instance, at=at)
            try:
                status = await conn.execute(PUBLISH_DUE, instance)
            finally:
                await conn.execute("SELECT pg_advisory_unlock($1)", key)
            emit("seed.worked", instance=instance, rows=int(status.split()[-1]))
        await asyncio.sleep(interval)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="bench/failover_seed.py")
    parser.add_argument("dsn")
    parser.add_argument("instance")
    parser.add_argument("--key", type=int, default=0x9A37B7A1)
    parser.add_argument("--interval", type=float, default=1.0)
    args = parser.parse_args(argv)
    asyncio.run(run(args.dsn, args.instance, args.key, args.interval))


if __name__ == "__main__":
    main(sys.argv[1:])
