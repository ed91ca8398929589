"""The seed design for bench/peers.py: what the CMS the project started from did.

One asyncpg connection; a fixed 1 s interval (a free-running timer: each process on its
own phase); every tick ``pg_try_advisory_lock(k)``, and if it got the lock, run whatever
is due (``peerjob.run_job`` on that same connection, every tick with ``--mode run``,
never with ``--mode idle``), then ``pg_advisory_unlock(k)``. No notion of a slot: the lock
only keeps two runs from overlapping.

    python seed_peer.py DSN --mode run|idle

SIGTERM stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import time

import asyncpg
import peerjob

KEY = 0x5EED
# The server log names each backend by it (bench/peers.py counts ERROR lines per peer).
APPLICATION_NAME = "peer-" + os.environ.get("PEER_CONTESTANT", "seed")


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dsn")
    parser.add_argument("--mode", choices=["run", "idle"], default="run")
    args = parser.parse_args()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    conn = await asyncpg.connect(args.dsn, server_settings={"application_name": APPLICATION_NAME})
    try:
        next_tick = time.monotonic()
        while not stop.is_set():
            if await conn.fetchval("SELECT pg_try_advisory_lock($1)", KEY):
                try:
                    if args.mode == "run":
                        await peerjob.run_job(conn)
                finally:
                    await conn.fetchval("SELECT pg_advisory_unlock($1)", KEY)
            next_tick += 1.0
            delay = max(0.0, next_tick - time.monotonic())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
    finally:
        await conn.close()


if __name__ == "__main__":
    asyncio.run(main())
