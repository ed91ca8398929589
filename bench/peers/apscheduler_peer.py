"""One APScheduler 4 process for bench/peers.py (run with bench/.peers/apscheduler's python).

A scheduler with both roles (it schedules and runs jobs), SQLAlchemyDataStore on an
asyncpg engine and AsyncpgEventBroker (LISTEN/NOTIFY) on the same database, so that any
number of these processes share one schedule. The schedule ``peer-job`` runs
``peerjob:run_job``: every second (``--mode run``) or at midnight on 1 January (``--mode
idle``). Everything else is APScheduler's default unless ``--lease`` / ``--cleanup`` are
given (the "tuned lease" contestant): lease_duration 30 s, cleanup_interval 15 min,
max_running_jobs 1 per task, coalesce "latest", no misfire grace time.

    python apscheduler_peer.py DSN --mode run|idle [--lease S] [--cleanup S]

SIGTERM stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal

import peerjob
from apscheduler import AsyncScheduler
from apscheduler.datastores.sqlalchemy import SQLAlchemyDataStore
from apscheduler.eventbrokers.asyncpg import AsyncpgEventBroker
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.interval import IntervalTrigger
from sqlalchemy.ext.asyncio import create_async_engine

# The server log names each backend by it (bench/peers.py counts ERROR lines per peer).
APPLICATION_NAME = "peer-" + os.environ.get("PEER_CONTESTANT", "apscheduler")


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dsn")
    parser.add_argument("--mode", choices=["run", "idle"], default="run")
    parser.add_argument("--lease", type=float, default=None)
    parser.add_argument("--cleanup", type=float, default=None)
    args = parser.parse_args()
    url = args.dsn.replace("postgresql://", "postgresql+asyncpg://", 1)
    settings = {"application_name": APPLICATION_NAME}
    engine = create_async_engine(url, connect_args={"server_settings": settings})
    store = SQLAlchemyDataStore(engine)
    broker = AsyncpgEventBroker.from_async_sqla_engine(
        engine, options={"server_settings": settings}
    )
    tuning = {}
    if args.lease is not None:
        tuning["lease_duration"] = args.lease
    if args.cleanup is not None:
        tuning["cleanup_interval"] = args.cleanup
    trigger = (
        IntervalTrigger(seconds=1)
        if args.mode == "run"
        else CronTrigger(month=1, day=1, hour=0, minute=0)
    )
    async with AsyncScheduler(store, broker, **tuning) as scheduler:
        await scheduler.add_schedule(peerjob.run_job, trigger, id="peer-job")
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, lambda: loop.create_task(scheduler.stop()))
        await scheduler.run_until_stopped()
    await engine.dispose()


if __name__ == "__main__":
    asyncio.run(main())
