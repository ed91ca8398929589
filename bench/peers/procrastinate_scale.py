"""procrastinate with many periodic tasks, for bench/peers.py's comparison (run with
bench/.peers/procrastinate's python).

procrastinate's periodic tasks are declared in code, so each worker declares all N at
start: one task (``scale_job``, running ``scalejob.procrastinate_job``) registered N
times with ``app.periodic(cron=…, periodic_id="s00000"…, task_kwargs={"sid": …})``.
Its cron has whole seconds at best (a sixth field), so the N schedules are spread over
the ten phases a 10 s period has: schedule i fires at seconds ``i % 10``, ``+ 10``, …
(cron ``* * * * * P-59/10``), a tenth of them at each whole second. Every worker runs the
periodic deferrer over all N (the database refuses a second defer of one
(task, periodic_id, timestamp)), and fetches jobs. Worker defaults (concurrency 1,
LISTEN/NOTIFY plus a 5 s poll) unless ``--concurrency``.

    python procrastinate_scale.py DSN --count N [--concurrency C]
    python procrastinate_scale.py DSN --apply-schema

SIGTERM stops it (procrastinate's own handler).
"""

from __future__ import annotations

import argparse
import asyncio
import os

import procrastinate
import scalejob

APPLICATION_NAME = "peer-" + os.environ.get("PEER_CONTESTANT", "procrastinate")
PERIOD = 10  # s; a divisor of 60, so that the cron's seconds field can say it


def build_app(dsn: str, count: int) -> procrastinate.App:
    connector = procrastinate.PsycopgConnector(
        conninfo=dsn, kwargs={"application_name": APPLICATION_NAME}
    )
    app = procrastinate.App(connector=connector)

    @app.task(name="scale_job", pass_context=False)
    async def scale_job(timestamp: int, sid: str) -> None:
        await scalejob.procrastinate_job(timestamp, sid)

    for i in range(count):
        sid = f"s{i:05d}"
        cron = f"* * * * * {i % PERIOD}-59/{PERIOD}"
        app.periodic(cron=cron, periodic_id=sid, task_kwargs={"sid": sid})(scale_job)
    return app


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dsn")
    parser.add_argument("--count", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=None)
    parser.add_argument("--apply-schema", action="store_true")
    args = parser.parse_args()
    app = build_app(args.dsn, args.count)
    async with app.open_async():
        if args.apply_schema:
            await app.schema_manager.apply_schema_async()
            return
        scalejob.ready()
        options = {} if args.concurrency is None else {"concurrency": args.concurrency}
        await app.run_worker_async(**options)


if __name__ == "__main__":
    asyncio.run(main())
