"""PostgreSQL ``transaction`` mode: the lock lives exactly as long as one transaction.

For deployments behind a transaction pooler (PgBouncer ``pool_mode = transaction``),
where session state does not survive a statement. Every transaction a tick opens takes
``pg_try_advisory_xact_lock`` first and skips the tick (:class:`NotLeader`) if another
replica holds it; the work and the lock commit or roll back together, which is the
fencing. Nothing is sticky: each tick competes afresh, so replicas take turns, which is
harmless because due-ness is decided from database state.

Work done *outside* the database (a Python task, a webhook POST) must hold the lock too,
or two replicas would run the loop's work at once. It runs inside a **hold**
(:class:`TransactionHold`): one transaction, on a pooled connection, that keeps the lock
while the work goes on, heartbeats (``lock_entry``) so that it never sits idle past
``idle_in_transaction_session_timeout``, records the work's results in savepoints, and
commits when the work is done. A hold either competes like a tick (:meth:`hold`, the
webhook deliverer) or takes the lock over from the tick that claimed its work
(:meth:`hold_after`): it queues for the lock inside the tick's transaction, so when the
tick commits PostgreSQL grants it the lock in the same step, and nobody can take it in
between.

A client frozen inside a transaction is cut off by the server after ``stall_timeout``
(``idle_in_transaction_session_timeout``), which aborts its transaction and frees the lock.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from types import TracebackType
from typing import Any

import asyncpg

from ..db.base import Tx
from ..db.lock_store import PgLockStore
from ..db.postgres import (
    FENCED_ISOLATION,
    PgTx,
    PostgresStore,
    ask_between_statements,
    detect_dead_peer,
    statement_locked_transaction,
)
from ..errors import describe
from .base import (
    KILL_WAIT,
    GuardBase,
    LeadershipLost,
    Lease,
    NotLeader,
    PendingHold,
    settle_time,
)
from .heartbeat import heartbeat
from .lease_state import LeaseState

# How long a tick waits for its hand-over hold to be queued on the lock (one round trip
# on a healthy server) before it gives up and rolls back what it claimed.
HANDOVER_QUEUE_TIMEOUT = 5.0


class TransactionGuard(GuardBase[PostgresStore]):
    leading = False  # won the last competing transaction's lock

    def note_leading(self, leading: bool) -> None:
        """Log and count the edges only: with per-transaction locks, "leader" means "won
        the last tick"."""
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
        lease = TransactionLease(self)
        try:
            yield lease
        finally:
            # Holds stop their own work (within stop_grace + KILL_WAIT) and then end their
            # transaction (within connect_timeout): give them that long.
            settings = self.settings
            bound = settings.lock.stop_grace + KILL_WAIT + settings.database.connect_timeout
            await lease.stop_work(grace=bound)
            if self.leading:
                self.note_leading(False)

    async def begin(self, conn: asyncpg.Connection) -> None:
        """Per-transaction settings: nothing may be set for the session behind a pooler."""
        stall_ms = int(self.settings.lock.stall_timeout * 1000)
        statement_ms = int(self.settings.database.statement_timeout * 1000)
        await PgLockStore(conn).limit_transaction(stall_ms=stall_ms, statement_ms=statement_ms)

    async def compete(self, conn: asyncpg.Connection) -> tuple[int, int]:
        """Take the lock for this transaction or raise :class:`NotLeader`; return the
        fencing token, recorded with the leader row in the same transaction, and the
        server backend's pid (behind a pooler, the client cannot know it). On a schema
        newer than this build knows, :class:`SchemaNewer` instead (schema_gate.py): the
        same statement reads the version, and holds it until the transaction ends."""
        locks = PgLockStore(conn)
        fence = await locks.compete(self.key)
        self.schema.check(fence.schema_version, self.log, "fence")
        if not fence.won:
            self.note_leading(False)
            raise NotLeader(self.loop)
        instance = self.settings.instance_id
        drawn = await locks.draw_token(self.loop, instance)
        token = drawn.token
        await locks.touch_leadership(
            self.loop, self.key, instance=instance, hostname=socket.gethostname(),
            pid=os.getpid(), token=token,
        )  # fmt: skip
        self.note_leading(True)
        await self._wait_for_predecessor(drawn.previous, token)
        return token, fence.backend_pid

    async def _wait_for_predecessor(self, previous: int | None, token: int) -> None:
        """A transaction that wins the lock draws the loop's next token. If the last one
        committed is not the one before it, a holder since then did not commit: its hold
        was lost — to a terminated backend, a restarted server — and its replica, perhaps
        alive, learns so only now and is still stopping that work. Keep the lock and wait
        for it before doing any."""
        if previous is None or token == previous + 1:
            return
        seconds = settle_time(self.settings)
        self.log.info(
            "leader.settling", mode="transaction", token=token, last_committed=previous,
            seconds=seconds,
        )  # fmt: skip
        await asyncio.sleep(seconds)


class TransactionLease(LeaseState):
    """Never lost as a whole: between transactions this replica holds nothing. Its work
    (ticks, holds) is stopped when the loop stops leading."""

    def __init__(self, guard: TransactionGuard) -> None:
        super().__init__(0, guard.settings, guard.log)
        self.guard = guard
        self._watched: TransactionHold | None = None  # the tick's, while it runs

    def proven_recently(self) -> bool:
        if self.lost.is_set():
            return False
        return self._watched is None or self._watched.proven_recently()

    @asynccontextmanager
    async def transaction(self, *, only_ours: bool = False) -> AsyncIterator[PgTx]:
        if not only_ours:
            async with self._watched_transaction() as tx:
                yield tx
            return
        # The loop's own statements, back to back: nothing in it awaits anything else, so
        # nothing can leave it idle long enough for the server to end it.
        async with (
            self.guard.store.pool.acquire() as conn,
            conn.transaction(isolation=FENCED_ISOLATION),
        ):
            await self.guard.begin(conn)
            # The token of the transaction that won last: the Lease's live token.
            self.fencing_token, _ = await self.guard.compete(conn)
            yield PgTx(conn, self.fencing_token)

    @asynccontextmanager
    async def _watched_transaction(self) -> AsyncIterator[PgTx]:
        """A tick's transaction in which other code runs (a Python publisher awaiting an
        API), kept as a hold keeps its own: a heartbeat talks on its connection between
        statements, so the server never finds it idle past ``stall_timeout``, and proves
        the lock through the pool while a statement runs. If the hold is lost (its
        connection ended, a proof failed, the process was frozen), the tick is cancelled
        at once, as a session-mode tick is, and this raises :class:`LeadershipLost`."""
        task = asyncio.current_task()
        assert task is not None
        hold = TransactionHold(self.guard, self, tick=task)
        await hold.compete()
        self.fencing_token = hold.fencing_token
        self._watched = hold
        try:
            async with hold, hold.statements() as tx:
                yield tx
        except BaseException as exc:
            # Our cancellation, or what replaced it on the way out (a savepoint's rollback
            # on the closed connection raises the driver's error): the loss, unless
            # someone else cancelled the tick too.
            if hold.cancelled_tick and task.uncancel() == 0:
                raise LeadershipLost(hold.reason or "lost") from exc
            raise
        finally:
            self._watched = None
        if hold.lost.is_set():  # the body swallowed the cancellation: still lost
            if hold.cancelled_tick:
                task.uncancel()
            raise LeadershipLost(hold.reason or "lost")

    @asynccontextmanager
    async def hold(self) -> AsyncIterator[Lease]:
        hold = TransactionHold(self.guard, self)
        await hold.compete()
        async with hold:
            yield hold

    async def hold_after(self, tx: Tx) -> PendingHold:
        assert isinstance(tx, PgTx)
        hold = TransactionHold(self.guard, self)
        await hold.queue_behind(tx)
        return hold


class TransactionHold(LeaseState):
    """One transaction keeping the loop's lock while work runs outside the database.

    Its ``transaction()`` gives savepoints in the held transaction (one at a time: they
    share its connection), so the work's database writes and its results commit
    together, when the hold ends — or never, if the hold was lost (the next winner of the
    lock marks its runs abandoned).
    """

    def __init__(
        self,
        guard: TransactionGuard,
        parent: LeaseState,
        tick: asyncio.Task[Any] | None = None,
    ) -> None:
        super().__init__(0, guard.settings, guard.log, self._report_lost)
        self.guard = guard
        self.parent = parent
        # One user of the connection at a time (a savepoint's work, or a proof); within
        # it, one statement at a time (the statement lock), so that a proof can talk between two
        # statements of work that awaits something else in between.
        self.transaction_lock = asyncio.Lock()
        self.statement_lock = asyncio.Lock()
        # A tick that runs in this hold's transaction itself (_watched_transaction):
        # cancelled the moment the hold is lost.
        self._tick = tick
        self.cancelled_tick = False
        self._conn: Any = None  # a pool connection (proxy), acquired for the hold's life
        self._transaction: Any = None
        self._backend = 0  # its server backend's pid, for the heartbeat's proof
        self._granted: asyncio.Future[Any] | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._on_closed: Callable[[Any], None] | None = None

    async def _open(self) -> asyncpg.Connection:
        pool = self.guard.store.pool
        self._conn = await pool.acquire()
        detect_dead_peer(self._conn, self.settings.lock.step_down_after)  # as the session's
        try:
            self._transaction = self._conn.transaction(isolation=FENCED_ISOLATION)
            await self._transaction.start()
            await self.guard.begin(self._conn)
        except BaseException:
            await self._close(commit=False)
            raise
        return self._conn

    async def compete(self) -> None:
        conn = await self._open()
        try:
            self.fencing_token, self._backend = await self.guard.compete(conn)
        except BaseException:
            await self._close(commit=False)
            raise

    async def queue_behind(self, tx: PgTx) -> None:
        """Queue for the lock that ``tx`` holds, and return once the server shows us
        waiting: from then on, ``tx`` ending hands the lock straight to us."""
        conn = await self._open()
        try:
            locks = PgLockStore(conn)
            self._backend = await locks.backend_pid()
            stall_ms = int(self.settings.lock.stall_timeout * 1000)
            await locks.lock_timeout(milliseconds=stall_ms)
            self._granted = asyncio.ensure_future(locks.queue_for_lock(self.guard.key))
            deadline = time.monotonic() + HANDOVER_QUEUE_TIMEOUT
            waiting = [{"granted": False}]  # our backend's entry for the key, not granted
            # Asked in the tick's transaction: the hold's connection waits in hold_queue.
            entry = {"key": self.guard.key, "backend_pid": self._backend}
            while await tx.query("lock_entry", **entry) != waiting:
                if self._granted.done():
                    self._granted.result()  # an error; the lock cannot be granted meanwhile
                if time.monotonic() > deadline:
                    raise TimeoutError("the hand-over hold was not queued on the lock in time")
                await asyncio.sleep(0.001)
        except BaseException:
            await self.discard()
            raise

    async def discard(self) -> None:
        """Give up a hold that was never entered (its tick failed)."""
        if self._granted is not None and not self._granted.done():
            self._granted.cancel()
            with suppress(BaseException):
                await self._granted
        await self._close(commit=False)

    async def __aenter__(self) -> TransactionHold:
        try:
            if self._granted is not None:
                await self._granted  # granted the moment the claiming tick committed
                # Only now, not while queued: a migration waiting for the tick would queue
                # this read behind it, and the tick waits for this hold to be queued. Read
                # now, it makes a migration wait for the hold's runs, or sees it committed.
                locks = PgLockStore(self._conn)
                version = await locks.schema_version()
                self.guard.schema.check(version, self.guard.log, "fence")
                await locks.default_lock_timeout()
                # A token of its own, drawn in its own transaction: if this hold is lost,
                # the next winner of the lock sees the gap (TransactionGuard._settle).
                drawn = await locks.draw_token(self.guard.loop, self.settings.instance_id)
                self.fencing_token = drawn.token
            self.last_proven = time.monotonic()
            self._on_closed = self._closed
            self._conn.add_termination_listener(self._on_closed)
            if self._conn.is_closed():  # closed before the listener was there to hear it
                self._closed(self._conn)
            beat = heartbeat(self, self._prove)
            self._heartbeat = asyncio.create_task(beat, name="hold:heartbeat")
        except BaseException:
            await self.discard()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # From here on a loss ends nothing the tick still runs: the tick is what ends it.
        self._tick = None
        # Work first, lock last: the transaction (and the lock) ends after the work.
        try:
            await self.stop_work(unblock=self._terminate)
        finally:
            try:
                if self._heartbeat is not None:
                    self._heartbeat.cancel()
                    await asyncio.wait({self._heartbeat})
            finally:
                commit = exc_type is None and not self.lost.is_set()
                await self._close(commit=commit)

    def adopt(self, task: asyncio.Task[Any]) -> None:
        # The loop's lease stops its holds' work too, at the same time as the holds, so
        # that one stop_grace covers both.
        super().adopt(task)
        self.parent.adopt(task)

    def _usable(self) -> bool:
        """Whether the hold's connection is still ours to use. When the connection closes,
        asyncpg's pool takes it back by itself and detaches the proxy we hold, whose every
        method then raises."""
        if self._conn is None:
            return False
        try:
            return not self._conn.is_closed()
        except asyncpg.InterfaceError:
            return False

    def _terminate(self) -> None:
        self.lose("work stuck on the hold's connection", lock_may_be_free=True)
        if self._usable():
            self._conn.terminate()

    def _closed(self, _conn: Any) -> None:
        self.lose("hold connection closed", lock_may_be_free=True)

    def _report_lost(self, reason: str, lock_may_be_free: bool) -> None:
        self.guard.log.warning("hold.lost", reason=reason, lock_may_be_free=lock_may_be_free)
        tick = self._tick
        if tick is not None and tick is not asyncio.current_task() and not tick.done():
            tick.cancel()
            self.cancelled_tick = True

    async def _prove(self) -> bool:
        """One heartbeat: the lock manager shows our backend holding the key.

        Asked on the hold's own connection whenever nothing else is talking on it,
        between two statements of its work too: that keeps the held transaction from
        ever sitting idle past the server's ``idle_in_transaction_session_timeout``,
        which must end only a frozen replica's transaction. Through the pool while a
        statement runs on it (busy, so not idle)."""
        key, backend = self.guard.key, self._backend
        held = await ask_between_statements(
            self._conn,
            self.transaction_lock,
            self.statement_lock,
            lambda conn: PgLockStore(conn).lock_entry(key, backend),
        )
        if held is None:
            held = await PgLockStore(self.guard.store.pool).lock_entry(key, backend)
        return held is True

    @asynccontextmanager
    async def statements(self) -> AsyncIterator[PgTx]:
        """The held transaction itself, for one user at a time."""
        async with self.transaction_lock:
            if self.lost.is_set():
                raise LeadershipLost(self.reason or "lost")
            try:
                yield PgTx(self._conn, self.fencing_token, self.statement_lock)
            finally:
                if self._usable() and not self._conn.is_in_transaction():
                    # SQL in it ran COMMIT or ROLLBACK: the held transaction, and the lock
                    # with it, are gone; everything still running must stop now.
                    self.lose("SQL ended the hold's transaction", lock_may_be_free=True)

    @asynccontextmanager
    async def transaction(self, *, only_ours: bool = False) -> AsyncIterator[PgTx]:
        """A savepoint in the held transaction: what one piece of the hold's work wrote
        and its result commit together with the hold, or roll back alone."""
        async with (
            self.statements() as tx,
            statement_locked_transaction(self._conn, self.statement_lock),
        ):
            yield tx

    async def _close(self, commit: bool) -> None:
        """End the held transaction: commit (raising if it did not commit: what the hold
        recorded is not there), or roll back."""
        if not self._usable():
            self._conn = None  # closed: asyncpg's pool took it back already
            if commit:
                raise LeadershipLost("the hold's connection closed before it committed")
            return
        conn, self._conn = self._conn, None
        if self._on_closed is not None:
            conn.remove_termination_listener(self._on_closed)
        bound = self.settings.database.connect_timeout
        try:
            if self.lost.is_set() and not commit:
                # Its socket may be dead (a cut network): a ROLLBACK would wait for an
                # answer that never comes. Dropping the connection rolls back just as well.
                conn.terminate()
            elif self._transaction is not None and not conn.is_closed():
                async with asyncio.timeout(bound):
                    if commit:
                        await self._transaction.commit()
                    else:
                        await self._transaction.rollback()
        except Exception as exc:
            self.guard.log.warning("hold.end_failed", commit=commit, error=describe(exc))
            conn.terminate()  # the server rolls back; the pool replaces the connection
            if commit:
                raise
        finally:
            await self.guard.store.pool.release(conn, timeout=bound)
