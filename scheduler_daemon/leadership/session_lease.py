"""Session mode's lease (``SessionLease``) and its fenced transactions, off the lock
connection. The guard that wins the lock and proves it is leadership/postgres_session.py.

The lock connection only holds and proves the lock. A leader's database work (ticks,
result batches, ``sql`` tasks, ``ctx.transaction()``, publishers) runs in transactions on
pooled connections, as many at once as there are connections for them, each fenced in its
first statement by the loop's fencing token (``scheduler_fence``, migration 0015):

- the statement takes the loop's row of ``scheduler_fencing`` FOR SHARE, and fails
  (SQLSTATE ``SDF01``) unless the token there is this leadership's;
- a new leader draws its token (an UPDATE of that row, ``fencing_next``) right after it
  is granted the lock, before any work. The draw waits for every transaction of the old
  leader that holds the row, and every transaction the old leader begins after it finds
  the new token and fails before doing anything.

So no transaction of a replaced leader commits after its successor's first fenced
statement, whatever the old leader's connections still do: the database orders them. A
sharded member's transactions are fenced the same way per shard (:class:`FenceCheck`:
each shard's row, ``scheduler_fence_shards``; leadership/shard_lease.py). The
lock connection's session lock still decides who leads; the token decides whose writes
count. A holder frozen inside a transaction is cut off by the server after
``stall_timeout`` (the transaction's ``idle_in_transaction_session_timeout``), and its
share of the row with it.

BEGIN, the transaction's settings and the fence go in one round trip, with user SQL's
first statement (a ``sql`` task's, with its timeout: leadership/fenced_tx.py's
``PooledTx``); COMMIT is the last. A task's SQL cannot reach the lock:
it runs in another session than the one that holds it.

The loops' bookkeeping that is a single statement (a tick's claim, a result batch) needs
no transaction: :meth:`TokenFence.statements` runs such statements on their own, each
fencing itself in its first CTE (the same function, its share of the row held until that
statement commits): one round trip a write.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

import asyncpg

from ..config.settings import Settings
from ..config.values import DEFAULT_PLUGIN_KEY, DEFAULT_PUBLISH_KEY
from ..db.base import ShardScope
from ..db.lock_store import PgLockStore
from ..db.postgres import PgTx
from ..db.sqlfiles import formatted, queries
from ..errors import describe
from ..logs import Logger
from ..schema_gate import SchemaGate
from .base import LeadershipLost
from .fenced_tx import SCHEMA_NEWER, SUPERSEDED, PooledTx, SelfFencedTx, SqlEndedFence
from .lease_state import LeaseState

QUERIES = queries("postgres")

# How often the server checks, while a fenced statement runs, that its client is still
# there (client_connection_check_interval): a leader killed mid-statement lets go of the
# fencing row within this, not when the statement would have ended.
CLIENT_CHECK_MS = 1000
# Connections of the pool left to the loops' own bookkeeping (ticks, result batches) and
# the HTTP endpoints, whatever the tasks' and publishers' SQL holds.
RESERVED_CONNECTIONS = 2
DEFAULT_KEYS = {"publish": DEFAULT_PUBLISH_KEY, "plugin": DEFAULT_PLUGIN_KEY}


def fencing_row(loop: str, key: int) -> str:
    """The row of ``scheduler_fencing`` a session leader of ``loop`` on lock ``key`` draws
    its tokens from and is fenced by: the loop's own for its default key; for another key
    (a second deployment on the same database, docs/leadership.md), a row of its own, or
    the two leaders would supersede each other's tokens. Its tokens come from the loop's
    sequence all the same."""
    if key == DEFAULT_KEYS.get(loop):
        return loop
    return f"{loop}/key_{key & 0xFFFF_FFFF_FFFF_FFFF:x}"


class FenceCheck(Protocol):
    """What a fenced transaction's first statement checks: the loop's token
    (:class:`LoopCheck`), or each of a sharded member's shards' (leadership/shard_lease.py)."""

    @property
    def token(self) -> int | None:
        """The transaction's fencing token (None: several shards, each its own)."""
        ...

    @property
    def scope(self) -> ShardScope | None:
        """The shards the transaction is for (None: the whole loop)."""
        ...

    def statement(self, *, stall_ms: int, check_ms: int, newest: int) -> str:
        """The settings and the check, sent with BEGIN in one round trip."""
        ...

    def superseded(self, detail: str) -> FenceCheck:
        """The check found tokens superseded (SDF01, ``detail`` its DETAIL): the check to
        try again with, for what is still ours; or raise :class:`LeadershipLost`."""
        ...

    @property
    def narrows(self) -> bool:
        """Whether :meth:`superseded` may go on with less (then the fence is sent on its
        own, before the work: the work is for what the fence leaves)."""
        ...


@dataclass(frozen=True, slots=True)
class LoopCheck:
    """A loop's fencing row (``fencing_row``), its token ``token``; ``lose`` ends the
    leadership when a successor drew another."""

    loop: str
    token: int
    lose: Callable[[str], object]
    scope: None = None
    narrows: bool = False

    def statement(self, *, stall_ms: int, check_ms: int, newest: int) -> str:
        return formatted(
            QUERIES["token_fence"], stall_ms=stall_ms, check_ms=check_ms, loop=self.loop,
            token=self.token, newest=newest,
        )  # fmt: skip

    def superseded(self, detail: str) -> FenceCheck:
        reason = "a newer leader drew the loop's fencing token"
        self.lose(reason)
        raise LeadershipLost(reason)


class TokenFence:
    """The fenced transactions of one leadership of ``loop`` (its fencing row), drawn
    ``token``; ``lose`` ends the leadership when the database says it is over."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        loop: str,
        token: int,
        settings: Settings,
        schema: SchemaGate,
        log: Logger,
        lose: Callable[[str], object],
    ) -> None:
        self.pool = pool
        self.loop = loop
        self.token = token
        self.settings = settings
        self.schema = schema
        self.log = log
        self.lose = lose
        # User SQL may hold a connection for as long as its task runs: never all of them.
        places = max(1, settings.database.pool_max_size - RESERVED_CONNECTIONS)
        self._user_places = asyncio.Semaphore(places)
        # Connections in use, each with the shards its transaction is fenced for (None: the
        # whole loop), so that stopping one shard's work drops only its connections.
        self._in_use: dict[asyncpg.Connection, frozenset[int] | None] = {}
        self._loop_check = LoopCheck(loop, token, lose)
        self._statement_fence = {
            "fence_loop": loop, "fence_token": token, "fence_newest": schema.newest
        }  # fmt: skip

    def terminate(self, shard: int | None = None) -> None:
        """Drop every connection a fenced transaction holds (``shard``: those fenced for
        that shard): what asyncpg waits for on a dead socket (a cancellation that never
        lands) ends at once. The server rolls back what they had begun."""
        for conn, shards in list(self._in_use.items()):
            if shard is None or shards is None or shard in shards:
                conn.terminate()

    @asynccontextmanager
    async def transaction(
        self, *, only_ours: bool = False, check: FenceCheck | None = None, lazy: bool = False
    ) -> AsyncIterator[PgTx]:
        """A fenced transaction, by the loop's token or by ``check``. ``only_ours``: the
        loops' bookkeeping, never user SQL (which waits for one of the pool's places left
        to it, and leaves the session as it found it). ``lazy``: the fence goes with the
        first statement (one statement of user SQL: :meth:`SessionLease.run_sql`); else it
        is taken on entry, and held for all of the body (a ``ctx.transaction()`` that
        calls an API before its first statement does so fenced)."""
        places = contextlib.nullcontext() if only_ours else self._user_places
        check = check or self._loop_check
        async with places:
            conn = await self.pool.acquire()
            # In use (terminated by ``terminate``) until it is back in the pool: giving it
            # back waits for a cancelled statement to end, which on a dead socket it never
            # does.
            self._in_use[conn] = _shards_of(check)
            try:
                async with self._fenced(conn, only_ours, check, lazy) as tx:
                    yield tx
            finally:
                await self._release(conn)

    @asynccontextmanager
    async def statements(self) -> AsyncIterator[PgTx]:
        """A pooled connection whose statements each fence themselves, outside any
        transaction: a named query with ``fence_*`` parameters calls ``scheduler_fence`` in
        its first CTE, and commits or fails whole, in one round trip (the loops'
        single-statement bookkeeping: a tick's claim, a result batch). Reads need no fence;
        any other write is refused here, unfenced."""
        conn = await self.pool.acquire()
        self._in_use[conn] = None
        try:
            yield SelfFencedTx(conn, self.token, fence=self._statement_fence)
        except asyncpg.PostgresError as exc:
            self._refused(exc, self._loop_check)
            raise
        finally:
            await self._release(conn)

    @asynccontextmanager
    async def _fenced(
        self, conn: asyncpg.Connection, only_ours: bool, check: FenceCheck, lazy: bool
    ) -> AsyncIterator[PgTx]:
        # A `sql` task's one statement takes the fence with it, in one message; everything
        # else takes it first (its statements carry parameters, which cannot share a
        # message, or it must be fenced from its start).
        prelude = None
        if lazy and not only_ours and not check.narrows:
            prelude = self._prelude(check)
        else:
            check = await self._begin(conn, check)
        self._in_use[conn] = _shards_of(check)
        statement_lock = asyncio.Lock()
        tx = PooledTx(
            conn, check.token, statement_lock, check.scope, prelude,
            lambda exc: self._refused(exc, check),
        )  # fmt: skip
        keeper = asyncio.create_task(self._keep_alive(conn, statement_lock, tx))
        try:
            yield tx
        except BaseException:
            await _stopped(keeper)
            if tx.prelude is None:
                await self._end(conn, "ROLLBACK", only_ours)
            raise
        await _stopped(keeper)
        if tx.prelude is not None:
            return  # nothing ran: nothing was begun, nothing to end
        if not conn.is_in_transaction():
            await self._end(conn, "ROLLBACK", only_ours)  # its session cleaned
            raise SqlEndedFence
        await self._end(conn, "COMMIT", only_ours)

    async def _release(self, conn: asyncpg.Connection) -> None:
        try:
            # Bounded: past it asyncpg drops the connection (the server rolls back).
            await self.pool.release(conn, timeout=self.settings.database.connect_timeout)
        except Exception as exc:
            self.log.debug("fence.release_failed", error=describe(exc))
        finally:
            self._in_use.pop(conn, None)

    async def _keep_alive(
        self, conn: asyncpg.Connection, statement_lock: asyncio.Lock, tx: PooledTx
    ) -> None:
        """While the transaction's owner awaits something else (a task inside
        ``ctx.transaction()`` calling an API), say something on it every
        ``heartbeat_interval``: its idle_in_transaction_session_timeout is for a frozen
        process, whose keeper is frozen too, not for a live one that is busy elsewhere."""
        while True:
            await asyncio.sleep(self.settings.lock.heartbeat_interval)
            if statement_lock.locked() or tx.prelude is not None:
                continue  # a statement runs, or none ran yet: no transaction is idle
            async with statement_lock:
                try:
                    await PgLockStore(conn).now()
                except asyncpg.PostgresError:
                    return  # the transaction failed: its owner rolls it back

    def _prelude(self, check: FenceCheck) -> str:
        """BEGIN, the transaction's settings and ``check``'s fence, as one text."""
        fence = check.statement(
            stall_ms=round(self.settings.lock.stall_timeout * 1000),
            check_ms=CLIENT_CHECK_MS,
            newest=self.schema.newest,
        )
        return ";\n".join(("BEGIN", fence))

    def _refused(self, exc: asyncpg.PostgresError, check: FenceCheck) -> None:
        """What ``check``'s fence said, as what it means here (a loss, a newer schema),
        where the answer cannot narrow what is fenced: a check that superseded() narrows
        is retried by ``_begin``."""
        if exc.sqlstate == SUPERSEDED:
            check.superseded(exc.detail or "")
        if exc.sqlstate == SCHEMA_NEWER:
            self.schema.check(int(exc.detail or 0), self.log, "fence")

    async def _begin(self, conn: asyncpg.Connection, check: FenceCheck) -> FenceCheck:
        """BEGIN and the fence, in one round trip; the check that passed (a member's
        shards found superseded are dropped from it, and it is tried again for the rest)."""
        while True:
            try:
                await conn.execute(self._prelude(check))
                return check
            except asyncpg.PostgresError as exc:
                await self._end(conn, "ROLLBACK", only_ours=True)
                if exc.sqlstate != SUPERSEDED:
                    self._refused(exc, check)
                    raise
                check = check.superseded(exc.detail or "")

    async def _end(self, conn: asyncpg.Connection, how: str, only_ours: bool) -> None:
        """COMMIT or ROLLBACK; after user SQL, with whatever session state it may have
        left behind (a SET, a LISTEN, a cursor, an advisory lock) cleared in the same
        round trip. On a connection that cannot say, dropped: the server rolls back."""
        if conn.is_closed():
            return
        ending = [how] if conn.is_in_transaction() else []
        text = ";\n".join(ending if only_ours else [*ending, QUERIES["session_clean"]])
        if not text:
            return
        if how == "COMMIT":
            await conn.execute(text)
            return
        try:
            async with asyncio.timeout(self.settings.database.connect_timeout):
                await conn.execute(text)
        except Exception:
            conn.terminate()  # cannot say: dropped, the server rolls back


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
        schema: SchemaGate,
        *,
        pool: asyncpg.Pool,
        loop: str,
    ) -> None:
        super().__init__(fencing_token, settings, log, on_lost)
        self.schema = schema
        self.conn = conn
        self.key = key
        self.backend_pid = backend_pid
        self.since = since
        # One user of the lock connection at a time: a heartbeat, or (a sharded member's)
        # the rebalancer taking or letting go of shards. Within a transaction, one
        # statement at a time (the statement lock): between two of them a heartbeat may
        # talk on the connection too.
        self.transaction_lock = asyncio.Lock()
        self.statement_lock = asyncio.Lock()
        # The leader's fenced transactions, on the pool, by fencing row ``loop`` (a sharded
        # member's, by its shards' rows: leadership/shard_lease.py).
        self.fence = TokenFence(
            pool, loop, fencing_token, settings, schema, log,
            lambda reason: self.lose(reason, lock_may_be_free=True),
        )  # fmt: skip

    def transaction(self, *, only_ours: bool = False) -> AbstractAsyncContextManager[PgTx]:
        """A fenced transaction, on a pooled connection (leadership/session_lease.py): it
        cannot commit once a successor drew its fencing token, and SQL run in it cannot
        reach the lock, which another session holds. Several run at once.

        ``only_ours`` (the loops' own bookkeeping): no user SQL runs, so the transaction
        needs none of the pool's places kept for it, nor the session clean-up after it."""
        return self._while_held(self.fence.transaction(only_ours=only_ours))

    async def run_sql(self, sql: str, statement_timeout: float) -> None:
        async with self._while_held(self.fence.transaction(lazy=True)) as tx:
            await tx.execute(sql, statement_timeout=statement_timeout)

    def statements(self) -> AbstractAsyncContextManager[PgTx]:
        return self._while_held(self.fence.statements())

    @asynccontextmanager
    async def _while_held(self, opened: AbstractAsyncContextManager[PgTx]) -> AsyncIterator[PgTx]:
        """``opened``'s transaction, refused once the lease is lost; a failure in it that
        is the lock connection's end showing is said as the loss it is."""
        self._closed_already()
        if self.lost.is_set():
            raise LeadershipLost(self.reason or "lost")
        try:
            async with opened as tx:
                yield tx
        except BaseException:
            self._closed_already()
            raise

    def _closed_already(self) -> None:
        """A lock connection found closed is a session, and a lock, that are over: said at
        once, not when asyncpg's close callback runs (a connection that the server ended
        can read closed for a while before it does, and a tick meanwhile fails on it)."""
        if not self.lost.is_set() and self.conn.is_closed():
            self.lose("lock connection closed", lock_may_be_free=True)

    def unblock(self) -> None:
        """Drop every connection work of this leadership may be stuck on (the lock's, the
        fenced transactions'): asyncpg waits for a cancelled statement's cancellation to
        land, which on a dead socket it never does."""
        self.conn.terminate()
        self.fence.terminate()


def _shards_of(check: FenceCheck) -> frozenset[int] | None:
    return None if check.scope is None else frozenset(check.scope.tokens)


async def _stopped(task: asyncio.Task[None]) -> None:
    """Cancel ``task`` and wait until it has ended (whatever it ended with is moot)."""
    task.cancel()
    await asyncio.wait({task})
    if not task.cancelled():
        task.exception()
