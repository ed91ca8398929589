"""PostgreSQL ``transaction`` mode: one ``pg_try_advisory_xact_lock`` per transaction.

For deployments behind a transaction pooler (PgBouncer ``pool_mode = transaction``),
where session state does not survive a statement. Every transaction a tick opens takes
the lock first and skips the tick (:class:`NotLeader`) if another replica holds it; the
work and the lock commit or roll back together, which is the fencing. There is nothing
sticky: each tick competes afresh, so replicas take turns, which is harmless because
due-ness is decided from database state.

A leader frozen inside a transaction is cut off by the server after ``stall_timeout``
(``idle_in_transaction_session_timeout``), which aborts its work and frees the lock.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from ..config import Settings
from ..db.postgres import PgTx, PostgresStore
from ..db.sqlfiles import queries
from ..logs import Logger
from ..metrics import Metrics
from .base import LeaseState, NotLeader

Q = queries("postgres")


class TransactionLease(LeaseState):
    def __init__(self, guard: TransactionGuard) -> None:
        super().__init__()
        self.guard = guard

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[PgTx]:
        guard = self.guard
        async with guard.store.pool.acquire() as conn, conn.transaction():
            stall_ms = int(guard.settings.lock.stall_timeout * 1000)
            await conn.execute(f"SET LOCAL idle_in_transaction_session_timeout = {stall_ms}")
            if not await conn.fetchval("SELECT pg_try_advisory_xact_lock($1)", guard.key):
                guard.note_leading(False)
                raise NotLeader(guard.loop)
            await conn.execute(
                Q["leader_touch"],
                guard.loop,
                guard.key,
                guard.settings.instance_id,
                socket.gethostname(),
                os.getpid(),
            )
            guard.note_leading(True)
            yield PgTx(conn)


class TransactionGuard:
    def __init__(
        self,
        loop: str,
        key: int,
        store: PostgresStore,
        settings: Settings,
        log: Logger,
        metrics: Metrics,
        stop: asyncio.Event,
    ) -> None:
        self.loop = loop
        self.key = key
        self.store = store
        self.settings = settings
        self.log = log.bind(loop=loop)
        self.metrics = metrics
        self.leading = False

    def note_leading(self, leading: bool) -> None:
        """Log and count the edges only: with per-tick locks, "leader" means "won the
        last tick"."""
        if leading == self.leading:
            return
        self.leading = leading
        self.metrics.leader.labels(self.loop).set(int(leading))
        event = "acquired" if leading else "lost"
        self.metrics.leadership_changes.labels(self.loop, event).inc()
        self.log.info(f"leader.{event}", key=self.key, mode="transaction")

    @asynccontextmanager
    async def leadership(self) -> AsyncIterator[TransactionLease]:
        try:
            yield TransactionLease(self)
        finally:
            if self.leading:
                self.note_leading(False)
