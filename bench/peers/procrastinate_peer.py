"""One procrastinate worker for bench/peers.py (run with bench/.peers/procrastinate's python).

A periodic task (``@app.periodic``) that runs ``peerjob.run_job``: every second (cron
``* * * * * *``, the sixth field is seconds; ``--mode run``) or at midnight on 1 January
(``--mode idle``). Every worker runs procrastinate's periodic deferrer; the database
refuses a second defer of one (task, periodic_id, timestamp), and any worker may fetch
the job. Defaults otherwise: concurrency 1, LISTEN/NOTIFY plus a fetch poll every 5 s, a
worker heartbeat every 10 s, stalled workers pruned after 30 s, no retry.

    python procrastinate_peer.py DSN --mode run|idle
    python procrastinate_peer.py DSN --apply-schema

SIGTERM stops it (procrastinate's own handler).
"""

from __future__ import annotations

import argparse
import asyncio
import os

import peerjob
import procrastinate

# The server log names each backend by it (bench/peers.py counts ERROR lines per peer).
APPLICATION_NAME = "peer-" + os.environ.get("PEER_CONTESTANT", "procrastinate")
CRON = {"run": "* * * * * *", "idle": "0 0 1 1 *"}


def build_app(dsn: str, mode: str) -> procrastinate.App:
    connector = procrastinate.PsycopgConnector(
        conninfo=dsn, kwargs={"application_name": APPLICATION_NAME}
    )
    app = procrastinate.App(connector=connector)

    @app.periodic(cron=CRON[mode], periodic_id="peer")
    @app.task(name="peer_job", pass_context=False)
    async def peer_job(timestamp: int) -> None:
        await peerjob.run_job()

    return app


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dsn")
    parser.add_argument("--mode", choices=list(CRON), default="run")
    parser.add_argument("--apply-schema", action="store_true")
    args = parser.parse_args()
    app = build_app(args.dsn, args.mode)
    async with app.open_async():
        if args.apply_schema:
            await app.schema_manager.apply_schema_async()
            return
        await app.run_worker_async()


if __name__ == "__main__":
    asyncio.run(main())
