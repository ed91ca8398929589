"""APScheduler 4 with many schedules, for bench/peers.py's comparison (run with
bench/.peers/apscheduler's python).

``--add N``: creates N schedules of ``scalejob:aps_job`` with ``add_schedule`` and an
``IntervalTrigger(seconds=PERIOD, start_time=T0 + i * PERIOD / N)`` (ids ``s00000``…,
spread over the period, all other options APScheduler's defaults), eight adds in flight
at once, then exits. ``--run``: one scheduler with both roles (schedules and runs jobs),
SQLAlchemyDataStore on asyncpg and AsyncpgEventBroker, APScheduler's defaults
(max_concurrent_jobs 100, lease 30 s, 100 schedules acquired per call), until SIGTERM.

APScheduler's default ``max_running_jobs`` is 1 *per task*, and every schedule here
names the same task (one function, a schedule per tenant): at most one of its jobs runs
at a time across all schedulers. ``--unlimited`` sets ``task_defaults.max_running_jobs
= None`` (in the adder and the runners alike: add_schedule would reset the task to the
default otherwise), the setting such a user would need.

    python apscheduler_scale.py DSN --add N --t0 EPOCH --period S [--unlimited]
    python apscheduler_scale.py DSN --run [--unlimited]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import time
from datetime import UTC, datetime

import scalejob
from apscheduler import AsyncScheduler, TaskDefaults
from apscheduler.datastores.sqlalchemy import SQLAlchemyDataStore
from apscheduler.eventbrokers.asyncpg import AsyncpgEventBroker
from apscheduler.triggers.interval import IntervalTrigger
from sqlalchemy.ext.asyncio import create_async_engine

APPLICATION_NAME = "peer-" + os.environ.get("PEER_CONTESTANT", "apscheduler")
IN_FLIGHT = 8


async def add(scheduler: AsyncScheduler, count: int, t0: float, period: float) -> None:
    await scheduler.configure_task(scalejob.aps_job)  # once, before the adds race to
    gate = asyncio.Semaphore(IN_FLIGHT)

    async def one(i: int) -> None:
        start = datetime.fromtimestamp(t0 + i * period / count, UTC)
        async with gate:
            await scheduler.add_schedule(
                scalejob.aps_job,
                IntervalTrigger(seconds=period, start_time=start),
                id=f"s{i:05d}",
            )

    began = time.monotonic()
    await asyncio.gather(*(one(i) for i in range(count)))
    print(f"added {count} in {time.monotonic() - began:.1f} s", flush=True)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dsn")
    parser.add_argument("--add", type=int, default=None)
    parser.add_argument("--t0", type=float, default=None)
    parser.add_argument("--period", type=float, default=10.0)
    parser.add_argument("--run", action="store_true")
    parser.add_argument("--unlimited", action="store_true")
    args = parser.parse_args()
    url = args.dsn.replace("postgresql://", "postgresql+asyncpg://", 1)
    settings = {"application_name": APPLICATION_NAME}
    engine = create_async_engine(url, connect_args={"server_settings": settings})
    store = SQLAlchemyDataStore(engine)
    broker = AsyncpgEventBroker.from_async_sqla_engine(
        engine, options={"server_settings": settings}
    )
    options = {}
    if args.unlimited:
        options["task_defaults"] = TaskDefaults(max_running_jobs=None)
    async with AsyncScheduler(store, broker, **options) as scheduler:
        if args.add is not None:
            await add(scheduler, args.add, args.t0, args.period)
        else:
            loop = asyncio.get_running_loop()
            loop.add_signal_handler(signal.SIGTERM, lambda: loop.create_task(scheduler.stop()))
            scalejob.ready()
            await scheduler.run_until_stopped()
    await engine.dispose()


if __name__ == "__main__":
    asyncio.run(main())
