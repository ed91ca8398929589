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
when no tick is using it. The lock connection's own end is noticed at once (asyncpg's
termination listener): a terminated backend, a restarted server. Any of these ends the
leadership: its work is cancelled and waited for, and only then is the connection closed.
The order matters where the server can still hear us (the pool broke, the lock connection
did not): closing first would hand the lock to a standby while our runs still run.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any

import asyncpg

from ..aio import unless_set, wait_any
from ..config import LockSettings, Settings
from ..db.postgres import PgTx, PostgresStore, detect_dead_peer
from ..db.sqlfiles import queries
from ..errors import describe
from ..logs import Logger
from .base import GuardBase, LeadershipLost, LeaseState, Stopping, heartbeat, settle_time

Q = queries("postgres")


def session_keepalive_settings(settings: Settings) -> dict[str, str]:
    """Per-session TCP settings, so the server drops a vanished leader in bounded time.

    Exactly the values config.py checked the step-down arithmetic on (whole seconds,
    tcp_user_timeout in whole milliseconds): nothing is rounded here.
    """
    return {name: str(value) for name, value in settings.lock.server_tcp_settings().items()}


class SessionLease(LeaseState):
    def __init__(
        self,
        conn: asyncpg.Connection,
        key: int,
        backend_pid: int,
        since: datetime,
        fencing_token: int,
        settings: Settings,
        log: Logger,
        on_lost: Callable[[str, bool], None],
    ) -> None:
        super().__init__(fencing_token, settings, log, on_lost)
        self.conn = conn
        self.key = key
        self.backend_pid = backend_pid
        self.since = since
        # One user of the connection at a time: the tick's transaction or a heartbeat ping.
        self.conn_lock = asyncio.Lock()

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[PgTx]:
        """A transaction on the lock connection, fenced twice over: it cannot commit once
        the session is gone, and SQL run inside it cannot release the lock.

        The transaction first checks that the session holds the lock and takes a
        transaction-level hold on it too (``fence_begin``): SQL that runs
        ``pg_advisory_unlock_all()`` releases session-level holds only, so the lock stays
        ours. The work runs in a savepoint; whatever becomes of it, the session lock is
        restored before the transaction ends (``fence_restore``), while the
        transaction-level hold still keeps it."""
        async with self.conn_lock:
            if self.lost.is_set():
                raise LeadershipLost(self.reason or "lost")
            async with self.conn.transaction():
                if not await self.conn.fetchval(Q["fence_begin"], self.key):
                    self._fence_broken("the lock connection no longer holds the lock")
                try:
                    async with self.conn.transaction():
                        yield PgTx(self.conn, self.fencing_token)
                finally:
                    await self._restore()

    async def _restore(self) -> None:
        if self.lost.is_set() or self.conn.is_closed():
            return  # nothing to keep: the guard drops the connection
        try:
            async with asyncio.timeout(self.settings.database.connect_timeout):
                if self.conn.is_in_transaction():
                    if not await self.conn.fetchval(Q["fence_restore"], self.key):
                        self.log.warning(
                            "leader.lock_restored",
                            hint="SQL run in a fenced transaction released the loop's "
                            "lock (pg_advisory_unlock_all?); it was held throughout and "
                            "is held again",
                        )
                # SQL ended the transaction (COMMIT): without the transaction-level hold
                # only the session lock is left to tell. Do not touch it; look.
                elif not await self.conn.fetchval(Q["lock_entry"], self.key, self.backend_pid):
                    self._fence_broken("SQL in a fenced transaction ended it and the lock")
        except LeadershipLost:
            raise
        except Exception as exc:  # fail closed: unsure is lost
            self._fence_broken(f"could not restore the fence: {describe(exc)}")

    def _fence_broken(self, reason: str) -> None:
        self.lose(reason, gone=True)
        raise LeadershipLost(reason)


class SessionGuard(GuardBase[PostgresStore]):
    @property
    def lock(self) -> LockSettings:
        return self.settings.lock

    @asynccontextmanager
    async def leadership(self) -> AsyncIterator[SessionLease]:
        conn = await self.store.connect_dedicated(
            f"lock:{self.loop}", session_keepalive_settings(self.settings)
        )
        # Within the step-down bound, the kernel ends a socket whose server went silent:
        # then even a tick stuck waiting on it ends leadership (the termination listener).
        detect_dead_peer(conn, self.lock.step_down_after)
        try:
            if conn.get_server_version() >= (14, 0):
                # A leader killed mid-statement: without this the server notices the closed
                # socket only when the statement ends, and holds the lock until then.
                await conn.execute("SET client_connection_check_interval = 1000")
            await self._wait_for_lock(conn)
            async with conn.transaction():
                predecessor = await conn.fetchrow(Q["leader_predecessor"], self.loop, self.key)
                token = await conn.fetchval(Q["fencing_next"], self.loop, self.settings.instance_id)
                row = await conn.fetchrow(
                    Q["leader_claim"],
                    self.loop,
                    self.key,
                    self.settings.instance_id,
                    socket.gethostname(),
                    os.getpid(),
                    token,
                )
            settled = await self._settle(conn, predecessor)
        except BaseException:
            conn.terminate()
            raise
        lease = SessionLease(
            conn,
            self.key,
            row["backend_pid"],
            row["acquired_at"],
            token,
            self.settings,
            self.log,
            self._report_lost,
        )
        on_closed = self._on_closed(lease)
        conn.add_termination_listener(on_closed)
        if conn.is_closed():  # closed before the listener was there to hear it
            on_closed(conn)
        self.metrics.leader.labels(self.loop).set(1)
        self.metrics.leadership_changes.labels(self.loop, "acquired").inc()
        self.log.info(
            "leader.acquired", key=self.key, backend_pid=lease.backend_pid,
            fencing_token=token, **settled,
        )  # fmt: skip
        beat = heartbeat(
            lease, lambda: self._prove(lease), self.metrics.heartbeat_failures.labels(self.loop).inc
        )
        beating = asyncio.create_task(beat, name=f"heartbeat:{self.loop}")
        clean_exit = False
        try:
            yield lease
            clean_exit = True
        finally:
            # Work first, lock last: nothing of this leadership may run once it is free.
            await lease.stop_work(unblock=conn.terminate)
            beating.cancel()
            await asyncio.wait({beating})
            conn.remove_termination_listener(on_closed)
            self.metrics.leader.labels(self.loop).set(0)
            await self._release(lease, graceful=clean_exit and not lease.lost.is_set())

    async def _settle(self, conn: asyncpg.Connection, predecessor: Any) -> dict[str, Any]:
        """Before doing any work, make sure the previous leader has stopped its own.

        A leader that did not hand over (no graceful release) either died — then its
        sessions end with it, within milliseconds — or is alive and lost its lock to the
        server (an operator's ``pg_terminate_backend``, say): then it learns so from its
        socket at about the moment we were granted the lock, and stops its work (or exits)
        within ``stop_grace`` and a little. Wait for whichever comes first: none of its
        sessions left, or that bound (``settle_time``). A frozen predecessor is the one
        case this cannot cover (docs/leadership.md).
        """
        me = (self.settings.instance_id, os.getpid())
        if predecessor is None or (predecessor["instance"], predecessor["pid"]) == me:
            return {}
        prefix = f"scheduler-daemon/{predecessor['instance']}/"[:63]
        started = time.monotonic()
        deadline = started + settle_time(self.settings)
        alive = True
        while time.monotonic() < deadline:
            if not await conn.fetchval(
                Q["instance_sessions"], prefix, timeout=self.lock.stop_grace
            ):
                alive = False
                break
            await asyncio.sleep(0.01)
        return {
            "predecessor": predecessor["instance"],
            "predecessor_alive": alive,
            "settled_in": round(time.monotonic() - started, 4),
        }

    def _on_closed(self, lease: SessionLease) -> Callable[[Any], None]:
        def closed(_conn: Any) -> None:
            # The session is over, so is the lock: a standby may be granted it right now.
            lease.lose("lock connection closed", gone=True)

        return closed

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

    def _report_lost(self, reason: str, gone: bool) -> None:
        """The lease's loss, reported once, whatever noticed it."""
        self.metrics.leadership_changes.labels(self.loop, "lost").inc()
        self.log.warning("leader.lost", reason=reason, lock_may_be_free=gone)

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
        # ends the session, which frees the lock and aborts any open transaction. Where
        # the server cannot hear us, keepalive / tcp_user_timeout end it later — after our
        # work stopped, which is what the timing arithmetic in config.py guarantees.
        lease.conn.terminate()
        if not lease.lost.is_set():
            self.metrics.leadership_changes.labels(self.loop, "stepped_down").inc()
            self.log.info("leader.stepped_down", key=self.key)
