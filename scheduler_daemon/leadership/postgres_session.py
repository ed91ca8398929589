"""PostgreSQL ``session`` mode: sticky leadership on a dedicated connection.

Why a dedicated connection: asyncpg resets a pooled connection with
``pg_advisory_unlock_all()`` when it is released, so a session lock taken through a pool
is dropped at once, and lock and unlock could land on different connections. The guard
owns one connection per loop; lock, ticks and unlock all run on it.

Standbys *wait* on ``pg_advisory_lock`` (``standby = "wait"``), so PostgreSQL hands the
lock over the moment the leader's session ends. Each wait is bounded by ``lock_timeout``
(``standby_recheck``) and re-issued, which also proves the standby's own connection alive.

While leading, a heartbeat task proves every ``heartbeat_interval``, through the pool,
that the database still sees our backend holding the key, and pings the lock connection
when no tick is using it. Any failure, or a heartbeat that comes late because the process
was frozen, makes the leader step down: cancel the tick, drop the connection.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime

import asyncpg

from ..aio import unless_set, wait_any
from ..config import LockSettings, Settings
from ..db.postgres import PgTx, PostgresStore
from ..db.sqlfiles import queries
from ..errors import describe
from .base import GuardBase, LeaseState, Stopping

Q = queries("postgres")


def _discard_outcome(task: asyncio.Future[bool]) -> None:
    """Retrieve an abandoned heartbeat's outcome, so asyncio does not report it."""
    if not task.cancelled():
        task.exception()


def session_keepalive_settings(settings: Settings) -> dict[str, str]:
    """Per-session TCP settings, so the server drops a vanished leader in bounded time."""
    lock = settings.lock
    return {
        "tcp_keepalives_idle": str(max(1, round(lock.keepalive_idle))),
        "tcp_keepalives_interval": str(max(1, round(lock.keepalive_interval))),
        "tcp_keepalives_count": str(lock.keepalive_count),
        "tcp_user_timeout": str(int(lock.tcp_user_timeout * 1000)),
    }


class SessionLease(LeaseState):
    def __init__(self, conn: asyncpg.Connection, backend_pid: int, since: datetime) -> None:
        super().__init__()
        self.conn = conn
        self.backend_pid = backend_pid
        self.since = since
        # One user of the connection at a time: the tick's transaction or a heartbeat ping.
        self.conn_lock = asyncio.Lock()

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[PgTx]:
        async with self.conn_lock, self.conn.transaction():
            yield PgTx(self.conn)


class SessionGuard(GuardBase[PostgresStore]):
    @property
    def lock(self) -> LockSettings:
        return self.settings.lock

    @asynccontextmanager
    async def leadership(self) -> AsyncIterator[SessionLease]:
        conn = await self.store.connect_dedicated(
            f"lock:{self.loop}", session_keepalive_settings(self.settings)
        )
        try:
            if conn.get_server_version() >= (14, 0):
                # A leader killed mid-statement: without this the server notices the closed
                # socket only when the statement ends, and holds the lock until then.
                await conn.execute("SET client_connection_check_interval = 1000")
            await self._wait_for_lock(conn)
            row = await conn.fetchrow(
                Q["leader_claim"],
                self.loop,
                self.key,
                self.settings.instance_id,
                socket.gethostname(),
                os.getpid(),
            )
        except BaseException:
            conn.terminate()
            raise
        lease = SessionLease(conn, row["backend_pid"], row["acquired_at"])
        self.metrics.leader.labels(self.loop).set(1)
        self.metrics.leadership_changes.labels(self.loop, "acquired").inc()
        self.log.info("leader.acquired", key=self.key, backend_pid=lease.backend_pid)
        heartbeat = asyncio.create_task(self._heartbeat(lease), name=f"heartbeat:{self.loop}")
        clean_exit = False
        try:
            yield lease
            clean_exit = True
        finally:
            heartbeat.cancel()
            await asyncio.wait({heartbeat})
            self.metrics.leader.labels(self.loop).set(0)
            await self._release(lease, graceful=clean_exit and not lease.lost.is_set())

    async def _wait_for_lock(self, conn: asyncpg.Connection) -> None:
        self.metrics.lock_waits.labels(self.loop).inc()
        self.log.info("leader.waiting", key=self.key, standby=self.lock.standby)
        if self.lock.standby == "poll":
            while not await conn.fetchval("SELECT pg_try_advisory_lock($1)", self.key):
                if await wait_any([self.stop], self.lock.poll_interval):
                    raise Stopping
            return
        recheck = self.lock.standby_recheck
        await conn.execute(f"SET lock_timeout = {int(recheck * 1000)}")
        while True:
            if self.stop.is_set():
                raise Stopping
            if await self._one_wait(conn, recheck):
                break
        await conn.execute("RESET lock_timeout")

    async def _one_wait(self, conn: asyncpg.Connection, recheck: float) -> bool:
        """One bounded ``pg_advisory_lock`` wait, abandoned if the daemon stops.

        The client-side timeout catches a connection that died silently: the server's
        ``lock_timeout`` answer would never arrive.
        """
        timeout = recheck + self.settings.database.connect_timeout
        waiting = await unless_set(
            conn.execute("SELECT pg_advisory_lock($1)", self.key, timeout=timeout), self.stop
        )
        if waiting.cancelled():
            raise Stopping
        try:
            waiting.result()
        except asyncpg.LockNotAvailableError:
            return False  # lock_timeout: still a standby, and our connection is alive
        return True

    async def _heartbeat(self, lease: SessionLease) -> None:
        interval = self.lock.heartbeat_interval
        last_ok = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            silent_for = time.monotonic() - last_ok
            if silent_for > self.lock.step_down_after:
                # We were frozen (SIGSTOP, a blocked event loop): a standby may have
                # evicted us already. Do not trust the connection; step down.
                self._lose(lease, f"heartbeat {silent_for:.1f}s late (process stalled)")
                return
            # Not `asyncio.timeout` around the queries: on a silently dead socket asyncpg's
            # pool cannot finish cancelling a query (releasing the connection waits for
            # the server's answer), so a cancelled heartbeat would hang with it. Wait for
            # the proof in a task of its own and abandon it when it is late.
            proof = asyncio.ensure_future(self._prove(lease))
            try:
                await asyncio.wait({proof}, timeout=interval)
            finally:
                if not proof.done():
                    proof.cancel()
                    proof.add_done_callback(_discard_outcome)
            if not proof.done():
                self.metrics.heartbeat_failures.labels(self.loop).inc()
                self._lose(lease, f"heartbeat failed: no answer within {interval:g}s")
                return
            if (exc := proof.exception()) is not None:
                self.metrics.heartbeat_failures.labels(self.loop).inc()
                self._lose(lease, f"heartbeat failed: {describe(exc)}")
                return
            if not proof.result():
                self._lose(lease, "lock no longer held (evicted or session ended)")
                return
            last_ok = time.monotonic()

    async def _prove(self, lease: SessionLease) -> bool:
        """One heartbeat: the database still sees our backend holding the key (False if
        not), and the lock connection answers."""
        still_held = await self.store.pool.fetchval(
            Q["leader_heartbeat"],
            self.loop,
            lease.backend_pid,
            self.settings.instance_id,
            self.key,
        )
        if still_held is None:
            return False
        if not lease.conn_lock.locked():  # a tick proves the connection itself
            async with lease.conn_lock:
                await lease.conn.fetchval("SELECT 1")
        return True

    def _lose(self, lease: SessionLease, reason: str) -> None:
        if lease.lose(reason):
            self.metrics.leadership_changes.labels(self.loop, "lost").inc()
            self.log.warning("leader.lost", reason=reason)
            # Closing the socket ends our session at once where the server can still hear
            # us; where it cannot, keepalive/tcp_user_timeout end it after we stopped.
            lease.conn.terminate()

    async def _release(self, lease: SessionLease, graceful: bool) -> None:
        if graceful:
            try:
                async with asyncio.timeout(self.settings.database.connect_timeout):
                    await lease.conn.execute(Q["leader_release"], self.loop, self.key)
                    await lease.conn.execute("SELECT pg_advisory_unlock($1)", self.key)
                    await lease.conn.close()
                self.metrics.leadership_changes.labels(self.loop, "released").inc()
                self.log.info("leader.released", key=self.key)
                return
            except Exception as exc:
                self.log.warning("leader.release_failed", error=describe(exc))
        # Not graceful (lost, cancelled mid-tick, release failed): closing the socket
        # ends the session, which frees the lock and aborts any open transaction.
        lease.conn.terminate()
        if not lease.lost.is_set():
            self.metrics.leadership_changes.labels(self.loop, "stepped_down").inc()
            self.log.info("leader.stepped_down", key=self.key)
