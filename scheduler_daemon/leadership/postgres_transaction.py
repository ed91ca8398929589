"""PostgreSQL ``transaction`` mode: one ``pg_try_advisory_xact_lock`` per transaction.

For deployments behind a transaction pooler (PgBouncer ``pool_mode = transaction``),
where session state does not survive a statement. Every transaction a tick opens takes
the lock first and skips the tick (:class:`NotLeader`) if another replica holds it; the
work and the lock commit or roll back together, which is the fencing. There is nothing
sticky: each tick competes afresh, so replicas take turns, which is harmless because
due-ness is decided from database state.

Only the tick's own transactions compete that way. A transaction opened by another task
(a claimed slot's run, its result, a webhook delivery) is work this replica already owns in
the database: it *waits* for the lock (``lock_timeout`` = ``stall_timeout``) rather than
being dropped because another replica's tick held the lock for a moment.

A leader frozen inside a transaction is cut off by the server after ``stall_timeout``
(``idle_in_transaction_session_timeout``), which aborts its work and frees the lock.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import asyncpg

from ..db.postgres import PgTx, PostgresStore
from ..db.sqlfiles import queries
from .base import GuardBase, LeaseState, NotLeader

Q = queries("postgres")
T = TypeVar("T")


class TransactionLease(LeaseState):
    def __init__(self, guard: TransactionGuard) -> None:
        super().__init__()
        self.guard = guard
        self._tick_task: asyncio.Task[Any] | None = None

    async def run_tick(self, tick: Callable[[], Awaitable[T]]) -> T:
        async def marked() -> T:
            self._tick_task = asyncio.current_task()  # its transactions compete
            return await tick()

        return await super().run_tick(marked)

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[PgTx]:
        guard = self.guard
        competing = asyncio.current_task() is self._tick_task
        async with guard.store.pool.acquire() as conn, conn.transaction():
            stall_ms = int(guard.settings.lock.stall_timeout * 1000)
            statement_ms = int(guard.settings.database.statement_timeout * 1000)
            await conn.execute(
                f"SET LOCAL idle_in_transaction_session_timeout = {stall_ms}; "
                f"SET LOCAL statement_timeout = {statement_ms}"
            )
            if competing:
                if not await conn.fetchval("SELECT pg_try_advisory_xact_lock($1)", guard.key):
                    guard.note_leading(False)
                    raise NotLeader(guard.loop)
            else:
                await conn.execute(f"SET LOCAL lock_timeout = {stall_ms}")
                try:
                    await conn.execute("SELECT pg_advisory_xact_lock($1)", guard.key)
                except asyncpg.LockNotAvailableError:
                    raise NotLeader(guard.loop) from None
                await conn.execute("SET LOCAL lock_timeout = DEFAULT")
            if competing:  # a tick, not a run recording its result: that is leading
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


class TransactionGuard(GuardBase[PostgresStore]):
    leading = False  # won the last tick's lock

    def note_leading(self, leading: bool) -> None:
        """Log and count the edges only: with per-tick locks, "leader" means "won the
        last tick"."""
        if leading == self.leading:
            return
        self.leading = leading
        self.metrics.leader.labels(self.loop).set(int(leading))
        event = "acquired" if leading else "lost"
        self.metrics.leadership_changes.labels(self.loop, event).inc()
        # Per-tick locks change hands routinely here: worth a debug line, not an info one.
        self.log.debug(f"leader.{event}", key=self.key, mode="transaction")

    @asynccontextmanager
    async def leadership(self) -> AsyncIterator[TransactionLease]:
        try:
            yield TransactionLease(self)
        finally:
            if self.leading:
                self.note_leading(False)
