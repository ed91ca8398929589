"""PostgreSQL ``session`` mode: sticky leadership on a dedicated connection.

Why a dedicated connection: asyncpg resets a pooled connection with
``pg_advisory_unlock_all()`` when it is released, so a session lock taken through a pool
is dropped at once, and lock and unlock could land on different connections. The guard
owns one connection per loop, which holds and proves the lock and nothing else; the
leader's work runs on the pool, fenced by its token (leadership/session_lease.py).

Standbys *wait* on ``pg_advisory_lock`` (``standby = "wait"``), so PostgreSQL hands the
lock over the moment the leader's session ends. The wait is one statement, for as long as
it takes: a waiting standby sends nothing and costs the database nothing but its
connection, and writes nothing to the server's log. A standby whose connection dies
silently learns it from the kernel (TCP keepalive and user timeout on the socket, within
``lock.step_down_after``), as a leader does.

The server itself ends a leader that stops talking: the lock session carries
``idle_session_timeout`` and ``idle_in_transaction_session_timeout`` of ``stall_timeout``.
A leader frozen (SIGSTOP, a blocked event loop, a stuck host) keeps its TCP session up, so
nothing else would ever free its lock; a live leader talks on it at least every
``heartbeat_interval`` while work runs (``quiet_proof_interval``, a third of
``stall_timeout`` at most, while none does), and gives up by itself long before (the timing arithmetic in
config/timing.py). No replica has to poll for stalled leaders.

While leading, a heartbeat proves every ``heartbeat_interval``, on the lock connection,
that the database still sees this session holding the key (one read-only statement).
While no work of the
leadership runs, only every ``lock.quiet_proof_interval``, and its next tick waits for a
fresh proof first (``heartbeat``'s ``quiet``). The proof talks on the lock connection
itself (a sharded member's also carries the rebalancer's statements: between two of
them, the statement lock), and through the pool only while a statement runs on it. The lock connection's own end is
noticed at once (asyncpg's termination listener): a terminated backend, a restarted
server, the server's idle timeout. Any of these ends the leadership: its work is cancelled
and waited for, and only then is the connection closed. The order matters where the
server can still hear us (the pool broke, the lock connection did not): closing first
would hand the lock to a standby while our runs still run.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import asyncpg

from ..aio import wait_any
from ..config.settings import Settings
from ..config.timing import LockSettings
from ..db.lock_store import Claimed, PgLockStore, Predecessor, StaleLeader
from ..db.postgres import (
    PostgresStore,
    ask_between_statements,
    detect_dead_peer,
)
from ..errors import describe
from .base import GuardBase, Stopping, settle_time
from .heartbeat import heartbeat
from .session_lease import SessionLease, fencing_row

# A standby's wait for the lock, and a sharded member's watch, are slices this long, each
# a transaction of its own (migration 0010): no snapshot lives longer than this, so a
# waiting standby never holds back VACUUM by more. A slice ending costs the server one
# subtransaction and the database nothing else; the wait itself is unbroken.
LOCK_WAIT_SLICE_MS = 1000


def session_keepalive_settings(settings: Settings) -> dict[str, str]:
    """Per-session TCP settings, so the server drops a vanished leader in bounded time.

    Exactly the values config/timing.py checked the step-down arithmetic on (whole seconds,
    tcp_user_timeout in whole milliseconds): nothing is rounded here.
    """
    return {name: str(value) for name, value in settings.lock.server_tcp_settings().items()}


async def wait_for_predecessor(
    conn: asyncpg.Connection | asyncpg.Pool,
    predecessor: Predecessor | StaleLeader | None,
    key: int,
    settings: Settings,
) -> dict[str, Any]:
    """Before a new leader does any work, make sure the previous one has stopped its own.

    ``predecessor`` is the ``scheduler_leaders`` row it left (None: it handed over), read
    on ``conn``, the new leader's lock connection, which holds lock ``key`` (or the pool,
    for a shard: who waits for ``key`` then tells nothing).

    A leader that did not hand over either died — then its sessions end with it, within
    milliseconds — or is alive and lost its lock to the server (an operator's
    ``pg_terminate_backend``, the server's failover, say): then it learns so from its
    socket at about the moment we were granted the lock, and stops its work (or exits)
    within ``stop_grace`` and a little. Wait for whichever comes first: none of its
    sessions left, or that bound (``settle_time``). If one of its sessions waits for this
    lock by then, it is a standby again (the guard stops a leadership's work before it
    waits anew): that is reported, and alive and not standing by is an eviction. A frozen predecessor is the one case this cannot cover
    (docs/leadership.md).
    """
    me = (settings.instance_id, os.getpid())
    if predecessor is None or (predecessor.instance, predecessor.pid) == me:
        return {}
    # As the server stores application_name: cut to 63 bytes, at a character boundary.
    whole = f"scheduler-daemon/{predecessor.instance}/".encode()
    prefix = whole[:63].decode(errors="ignore")
    started = time.monotonic()
    deadline = started + settle_time(settings)
    alive, standing_by = True, False
    locks = PgLockStore(conn)
    while time.monotonic() < deadline:
        sessions = await locks.instance_sessions(prefix, key, within=settings.lock.stop_grace)
        if not sessions.count:
            alive = False
            break
        # Waiting for the lock again says it stopped its work, but a name is not proof of
        # who waits: a sibling whose instance id shares the cut prefix, or a replica given
        # the same id by mistake, waits too. So it only decides how the take-over is
        # reported (not an eviction), never how long to wait.
        standing_by = bool(sessions.waiting) and len(whole) <= 63
        await asyncio.sleep(0.01)
    return {
        "predecessor": predecessor.instance,
        "predecessor_alive": alive,
        "predecessor_standing_by": standing_by,
        "settled_in": round(time.monotonic() - started, 4),
    }


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
            await self._limit_session(conn)
            await self._wait_for_lock(conn)
            predecessor, token, claimed = await self._claim(conn)
            settled = await self._wait_for_predecessor(conn, predecessor)
        except BaseException:
            conn.terminate()
            raise
        lease = SessionLease(
            conn,
            self.key,
            claimed.backend_pid,
            claimed.acquired_at,
            token,
            self.settings,
            self.log,
            self._report_lost,
            self.schema,
            pool=self.store.pool,
            loop=fencing_row(self.loop, self.key),
        )
        on_closed = self._on_closed(lease)
        conn.add_termination_listener(on_closed)
        if conn.is_closed():  # closed before the listener was there to hear it
            on_closed(conn)
        self._report_acquired(lease, settled)
        beat = heartbeat(
            lease,
            lambda: self._prove(lease),
            self.metrics.heartbeat_failures.labels(self.loop).inc,
            quiet=True,
        )
        beating = asyncio.create_task(beat, name=f"heartbeat:{self.loop}")
        clean_exit = False
        try:
            yield lease
            clean_exit = True
        finally:
            await self._stop_leading(lease, beating, on_closed)
            await self._release(lease, graceful=clean_exit and not lease.lost.is_set())

    async def _claim(self, conn: asyncpg.Connection) -> tuple[Predecessor | None, int, Claimed]:
        """Just granted the lock: who led before (None: nobody recorded), the fencing token
        drawn for this leadership, and our row in ``scheduler_leaders``, in one
        transaction."""
        locks = PgLockStore(conn)
        async with conn.transaction():
            found = await locks.predecessor(self.loop, self.key)
            # Granted on a schema newer than we know: claim nothing, let the lock go (the
            # caller drops the connection) to whoever waits next.
            self.schema.check(found.schema_version, self.log, "lock granted")
            predecessor = found if found.instance is not None else None
            instance = self.settings.instance_id
            row = fencing_row(self.loop, self.key)
            drawn = await locks.draw_token(row, instance)
            if self.loop == "plugin" and row == self.loop:
                # Members of a sharded layout that led before (their sessions are gone, or
                # we would not hold the key) may still have fenced transactions open, each
                # fenced by its shard's row: moved on, which waits for them and fails any
                # later one. (A shard's row is named for the loop, not the key: a
                # deployment on a key of its own leaves them to the default key's.)
                await locks.supersede(self.loop, None)
            claimed = await locks.claim_leadership(
                self.loop, self.key, instance=instance, hostname=socket.gethostname(),
                pid=os.getpid(), token=drawn.token,
            )  # fmt: skip
        return predecessor, drawn.token, claimed

    def _report_acquired(self, lease: SessionLease, settled: dict[str, Any]) -> None:
        if settled.get("predecessor_alive") and not settled.get("predecessor_standing_by"):
            # It did not hand over and is still connected, yet its lock session ended: the
            # server evicted it (idle past stall_timeout: frozen, or cut off), or someone
            # terminated the backend.
            self.metrics.evictions.labels(self.loop).inc()
            self.log.warning(
                "leader.evicted", evicted_instance=settled["predecessor"],
                stall_timeout=self.lock.stall_timeout,
            )  # fmt: skip
        self.metrics.leader.labels(self.loop).set(1)
        self.metrics.leadership_changes.labels(self.loop, "acquired").inc()
        self.log.info(
            "leader.acquired", key=self.key, backend_pid=lease.backend_pid,
            fencing_token=lease.fencing_token, **settled,
        )  # fmt: skip

    async def _stop_leading(
        self, lease: SessionLease, beating: asyncio.Task[None], on_closed: Callable[[Any], None]
    ) -> None:
        """Work first, lock last: nothing of this leadership may run once it is free. The
        caller lets the lock go after this."""
        await lease.stop_work(unblock=lease.unblock)
        beating.cancel()
        await asyncio.wait({beating})
        lease.conn.remove_termination_listener(on_closed)
        self.metrics.leader.labels(self.loop).set(0)

    async def _limit_session(self, conn: asyncpg.Connection) -> None:
        """The lock session's server-side limits (``session_limits`` in db/postgres.sql says
        why each): the idle timeouts, the stall eviction, are ``stall_timeout`` in whole
        milliseconds, as config/timing.py checked. Sent before the wait for the lock."""
        await PgLockStore(conn).limit_session(stall_ms=round(self.lock.stall_timeout * 1000))

    async def _wait_for_predecessor(
        self, conn: asyncpg.Connection, predecessor: Predecessor | None
    ) -> dict[str, Any]:
        settled = await wait_for_predecessor(conn, predecessor, self.key, self.settings)
        if self.loop == "plugin":
            await self._settle_shard_leaders(conn)
        return settled

    async def _settle_shard_leaders(self, conn: asyncpg.Connection) -> None:
        """Leaders of the plugin loop's shards that did not hand over (it ran sharded
        until now: a rolling change of plugin.shards) may still be stopping runs of
        schedules this leader now runs: wait for them too, then forget them."""
        from .shard_keys import ShardKeys

        me = (self.settings.instance_id, os.getpid())
        locks = PgLockStore(conn)
        stale = [
            leader
            for leader in await locks.stale_leaders(self.loop, ShardKeys(self.key, 1).shard_class)
            if leader.loop != self.loop and (leader.instance, leader.pid) != me
        ]
        if not stale:
            return
        whom = {(leader.instance, leader.pid): leader for leader in stale}
        pool = self.store.pool  # several at once: not on the one lock connection
        await asyncio.gather(
            *(wait_for_predecessor(pool, row, self.key, self.settings) for row in whom.values())
        )
        await locks.forget_leaders(stale)

    def _on_closed(self, lease: SessionLease) -> Callable[[Any], None]:
        def closed(_conn: Any) -> None:
            # The session is over, so is the lock: a standby may be granted it right now.
            lease.lose("lock connection closed", lock_may_be_free=True)

        return closed

    async def _wait_for_lock(self, conn: asyncpg.Connection) -> None:
        self.metrics.lock_waits.labels(self.loop).inc()
        self.log.info("leader.waiting", key=self.key, standby=self.lock.standby)
        locks = PgLockStore(conn)
        if self.lock.standby == "poll":
            while not await locks.try_lock(self.key):
                if await wait_any([self.stop, self.schema.newer], self.lock.poll_interval):
                    raise Stopping if self.stop.is_set() else self.schema.error()
            return
        # No statement_timeout on the wait: it lasts until the lock is granted.
        await locks.no_statement_timeout()
        waiting = asyncio.ensure_future(locks.wait_for_lock(self.key, LOCK_WAIT_SLICE_MS))
        # Stopping, or another loop of this replica found the schema newer than we know.
        quitting = [asyncio.ensure_future(e.wait()) for e in (self.stop, self.schema.newer)]
        try:
            await asyncio.wait({waiting, *quitting}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for each in quitting:
                each.cancel()
            if not waiting.done():
                # Stopping (or cancelled): drop the connection rather than cancel the
                # statement, which the server would log as an ERROR for every stop. The
                # server ends the session (client_connection_check_interval); whatever it
                # was granted goes with it.
                conn.terminate()
                await asyncio.wait({waiting})
                if not waiting.cancelled():
                    waiting.exception()  # retrieved: the stop (or cancellation) is the news
            await asyncio.wait(quitting)
        if self.stop.is_set() or self.schema.outdated:
            if not waiting.cancelled():
                waiting.exception()  # retrieved: the stop is what we report
            raise Stopping if self.stop.is_set() else self.schema.error()
        waiting.result()
        await locks.reset_statement_timeout()

    async def _prove(self, lease: SessionLease) -> bool:
        """One heartbeat: the database still sees our lock session holding the key.

        Asked on the lock connection itself whenever nothing else is talking on it (the
        lock connection carries nothing else; a sharded member's, the rebalancer's
        statements too). That restarts the server's idle timeouts, so the server's clock of our silence never runs ahead of the proofs the
        step-down is timed from (the event loop runs nothing else between the check and
        the taking of a lock). Through the pool only while a statement runs on it, when
        the session is busy and no idle timeout runs."""
        try:
            held = await ask_between_statements(
                lease.conn,
                lease.transaction_lock,
                lease.statement_lock,
                lambda conn: PgLockStore(conn).holds(self.key),
            )
            if held is not None:
                return bool(held)
        except (
            asyncpg.InterfaceError, asyncpg.ConnectionDoesNotExistError,
            asyncpg.InternalClientError,
        ):  # fmt: skip
            if not lease.conn.is_closed():
                raise
            # Closed under us, its close callback not yet run: the session, and the lock
            # with it, is over (not a network doubt that would earn the work its grace).
            # A server ending the session mid-proof can leave asyncpg's protocol in a
            # state it reports as its own error (InternalClientError): closed all the same.
            lease.lose("lock connection closed", lock_may_be_free=True)
            return False
        entry = await PgLockStore(self.store.pool).lock_entry(self.key, lease.backend_pid)
        return entry is True

    def _report_lost(self, reason: str, lock_may_be_free: bool) -> None:
        """The lease's loss, reported once, whatever noticed it."""
        self.metrics.leadership_changes.labels(self.loop, "lost").inc()
        self.log.warning("leader.lost", reason=reason, lock_may_be_free=lock_may_be_free)

    async def _release(self, lease: SessionLease, graceful: bool) -> None:
        if graceful:
            try:
                async with asyncio.timeout(self.settings.database.connect_timeout):
                    locks = PgLockStore(lease.conn)
                    await locks.release_leadership(self.loop, self.key)
                    await locks.unlock(self.key)
                    await lease.conn.close()
                self.metrics.leadership_changes.labels(self.loop, "released").inc()
                self.log.info("leader.released", key=self.key)
                return
            except Exception as exc:
                self.log.warning("leader.release_failed", error=describe(exc))
        # Not graceful (lost, cancelled mid-tick, release failed): closing the socket
        # ends the session, which frees the lock and aborts any open transaction. Where
        # the server cannot hear us, keepalive / tcp_user_timeout end it later — after our
        # work stopped, which is what the timing arithmetic in config/timing.py guarantees.
        lease.conn.terminate()
        if not lease.lost.is_set():
            self.metrics.leadership_changes.labels(self.loop, "stepped_down").inc()
            self.log.info("leader.stepped_down", key=self.key)
