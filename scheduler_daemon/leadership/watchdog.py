"""Stalled-leader eviction (PostgreSQL).

A leader that is alive but frozen (SIGSTOP, a blocked event loop, a stuck host) keeps its
TCP session, so its lock would never free by itself. Every replica runs one watchdog: every
``heartbeat_interval`` it asks the database for a lock holder whose heartbeat is older than
``stall_timeout`` and terminates that backend, which frees the lock and aborts its open
transaction. The judgement and the termination are one statement (``evict_stalled``).
Session mode only: see :meth:`StallWatchdog.run` for transaction mode.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from ..aio import wait_any
from ..db.postgres import PostgresStore
from ..db.sqlfiles import queries
from ..errors import describe
from ..logs import Logger
from ..metrics import Metrics

Q = queries("postgres")


class StallWatchdog:
    def __init__(
        self,
        store: PostgresStore,
        keys: Mapping[str, int],
        stall_timeout: float,
        interval: float,
        log: Logger,
        metrics: Metrics,
        stop: asyncio.Event,
    ) -> None:
        self.store = store
        self.keys = keys
        self.stall_timeout = stall_timeout
        self.interval = interval
        self.log = log
        self.metrics = metrics
        self.stop = stop

    async def run(self) -> None:
        if self.store.settings.lock.mode == "transaction":
            # There the lock lives as long as one transaction, and nothing refreshes the
            # leaders row while it runs: a healthy statement longer than stall_timeout
            # would look stalled. A frozen holder is cut off by the server instead
            # (idle_in_transaction_session_timeout = stall_timeout, set per transaction).
            await self.stop.wait()
            return
        while not await wait_any([self.stop], self.interval):
            for loop, key in self.keys.items():
                try:
                    await self.check(loop, key)
                except Exception as exc:  # the database may be down; the guards cope
                    self.log.debug("watchdog.check_failed", loop=loop, error=describe(exc))

    async def check(self, loop: str, key: int) -> int:
        rows = await self.store.pool.fetch(Q["evict_stalled"], loop, key, self.stall_timeout)
        for row in rows:
            self.metrics.evictions.labels(loop).inc()
            self.log.warning(
                "leader.evicted",
                loop=loop,
                evicted_instance=row["instance"],
                evicted_backend_pid=row["pid"],
                evicted_application=row["application_name"],
                last_heartbeat=row["heartbeat_at"].isoformat() if row["heartbeat_at"] else None,
                terminated=row["terminated"],
            )
        return len(rows)
