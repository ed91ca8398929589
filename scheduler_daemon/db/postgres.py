"""The PostgreSQL store, on asyncpg.

Ordinary reads and writes go through a pool. Anything that depends on *session* state
(advisory locks, LISTEN) must never use it: asyncpg resets a connection that goes back to
the pool with ``pg_advisory_unlock_all()`` and ``UNLISTEN *``. Those callers open a
dedicated connection with :meth:`PostgresStore.connect_dedicated`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any, Final, TypeVar

import asyncpg

from ..config.settings import Settings
from ..config.url import DatabaseUrl
from ..errors import explain_timeouts
from . import publications
from .base import (
    COUNT_LIMIT,
    SCHEDULER_TABLES,
    AppliedMigration,
    Capabilities,
    Publication,
    PublicationFilter,
    PublicationStats,
    ScheduleResult,
    ShardScope,
    SnapshotHolder,
    TableHealth,
    TableStats,
)
from .postgres_migrate import apply_migrations
from .privileges import Grants, refuse_missing_grants
from .sqlfiles import formatted, positional, queries

QUERIES = queries("postgres")
T = TypeVar("T")


async def _init_connection(conn: asyncpg.Connection) -> None:
    for type_name in ("json", "jsonb"):
        await conn.set_type_codec(
            type_name, encoder=json.dumps, decoder=json.loads, schema="pg_catalog"
        )


async def _keep_session(conn: asyncpg.Connection) -> None:
    """Session mode's pool reset: none. asyncpg's default runs ``pg_advisory_unlock_all();
    CLOSE ALL; UNLISTEN *; RESET ALL`` on every release (a round trip each time), against
    session state that only user SQL could leave behind; in session mode the fenced
    transaction that ran user SQL clears it with its own COMMIT or ROLLBACK, in the same
    round trip (leadership/session_lease.py, ``session_clean``), and the loops' bookkeeping
    leaves none. An open transaction is still rolled back (asyncpg does that before
    calling this). Transaction mode keeps the default."""


def _publication(row: Mapping[str, Any]) -> Publication:
    return Publication(**dict(row))


def detect_dead_peer(conn: asyncpg.Connection, within: float) -> bool:
    """Make the kernel end ``conn``'s socket when the server has been unreachable for
    about ``within`` seconds, so that asyncpg reports the connection closed.

    For the connections a leader's work depends on: without this, a statement whose
    answer never comes (a cut network, a NAT table that dropped the flow) waits for ever
    while the heartbeat, on other connections, may go on succeeding. TCP_USER_TIMEOUT ends
    the socket when data we sent stays unacknowledged; keepalive probes (one after a
    heartbeat's worth of silence) give it something to time out when we sent nothing.
    Returns False where there is no TCP socket to tune (a Unix socket) or the platform
    lacks the options. asyncpg exposes no socket: its transport is read privately.
    """
    transport = getattr(conn, "_transport", None)
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return False
    idle = max(1, math.ceil(within / 2))
    options = [
        (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
        (socket.IPPROTO_TCP, getattr(socket, "TCP_KEEPIDLE", None), idle),
        (socket.IPPROTO_TCP, getattr(socket, "TCP_KEEPINTVL", None), 1),
        (socket.IPPROTO_TCP, getattr(socket, "TCP_KEEPCNT", None), max(1, math.ceil(within))),
        (socket.IPPROTO_TCP, getattr(socket, "TCP_USER_TIMEOUT", None), int(within * 1000)),
    ]
    try:
        for level, option, value in options:
            if option is not None:
                sock.setsockopt(level, option, value)
    except OSError:
        return False
    return True


# A fenced transaction's first statement proves the lock and reads the schema version, then
# waits for a migration in flight (schema_gate.py): only READ COMMITTED gives each later
# statement a snapshot taken after that wait. A database or role whose
# default_transaction_isolation is stricter would freeze the snapshot before it, so the
# fenced transactions say so in their BEGIN (the same one statement).
FENCED_ISOLATION = "read_committed"


@asynccontextmanager
async def statement_locked_transaction(
    conn: asyncpg.Connection, statement_lock: asyncio.Lock | None, isolation: str | None = None
) -> AsyncIterator[None]:
    """``conn.transaction()`` (a transaction, or a savepoint inside one) whose statements
    (BEGIN or SAVEPOINT, and how it ends) each take ``statement_lock`` first. ``isolation``: for the
    outermost one only (a savepoint has the transaction's)."""
    # asyncpg's own context manager, its enter and its exit each taken under the statement lock.
    transaction = conn.transaction(isolation=isolation)
    async with _held(statement_lock):
        await transaction.__aenter__()
    try:
        yield
    except BaseException as exc:
        async with _held(statement_lock):
            await transaction.__aexit__(type(exc), exc, exc.__traceback__)
        raise
    async with _held(statement_lock):
        await transaction.__aexit__(None, None, None)


async def ask_between_statements(
    conn: asyncpg.Connection,
    transaction_lock: asyncio.Lock,
    statement_lock: asyncio.Lock,
    ask: Callable[[asyncpg.Connection], Awaitable[T]],
) -> T | None:
    """``ask(conn)``'s answer (one statement on ``conn``: a lock store's read,
    db/lock_store.py), asked if nobody is talking on it: no transaction holds it
    (``transaction_lock``), or one does but is between two statements (``statement_lock``: it
    awaits something else, a publisher's API call, a task's sleep). ``None`` while a
    statement runs, or when the transaction it would run in has failed: then the
    connection is busy or answered, so not idle, and the caller asks elsewhere.

    For a lock held by a connection that work may leave waiting: talking on it whenever
    it is quiet keeps the server's idle timeouts for the frozen replica they exist for."""
    if _free(transaction_lock):
        async with transaction_lock:  # taken at once: nothing ran since it was seen free
            return await ask(conn)
    if not _free(statement_lock):
        return None
    async with statement_lock:
        try:
            return await ask(conn)
        except asyncpg.InFailedSQLTransactionError:
            return None


def _free(lock: asyncio.Lock) -> bool:
    """Whether ``lock`` can be taken without waiting. Not just ``not locked()``: a lock
    just released to a waiter that has not run yet reads unlocked, and ``acquire()``
    queues behind that waiter, for as long as its work takes."""
    waiters = getattr(lock, "_waiters", None) or ()
    return not lock.locked() and all(waiter.cancelled() for waiter in waiters)


def _held(statement_lock: asyncio.Lock | None) -> contextlib.AbstractAsyncContextManager[Any]:
    return statement_lock if statement_lock is not None else contextlib.nullcontext()


# A statement that fences itself (``fence_*`` parameters, leadership/session_lease.py) run
# where it needs not: in a transaction already fenced, or outside any loop.
NO_FENCE: Mapping[str, Any] = {"fence_loop": None, "fence_token": None, "fence_newest": None}


class PgTx:
    """A transaction's statements. ``statement_lock``: taken around each statement, so that a
    heartbeat can talk on the same connection between them (a hold's connection in
    transaction mode; a pooled transaction's keeper, leadership/session_lease.py). ``fence``: the values of the
    ``fence_*`` parameters of the statements that fence themselves."""

    def __init__(
        self,
        conn: asyncpg.Connection,
        fencing_token: int | None = None,
        statement_lock: asyncio.Lock | None = None,
        shards: ShardScope | None = None,
        fence: Mapping[str, Any] = NO_FENCE,
    ) -> None:
        self.conn = conn
        self.fencing_token = fencing_token
        self.statement_lock = statement_lock
        self.shards = shards
        self.fence = fence

    async def execute(self, sql: str, statement_timeout: float | None = None) -> None:
        async with _held(self.statement_lock):
            await self._execute(sql, statement_timeout)

    async def _execute(self, sql: str, statement_timeout: float | None) -> None:
        if statement_timeout is None:
            await self.conn.execute(sql)
            return
        # Scoped to this statement: in transaction mode several runs share one transaction
        # (savepoints), and a SET LOCAL would outlive the savepoint that made it.
        previous = await self.conn.fetchval(QUERIES["statement_timeout_read"])
        milliseconds = int(statement_timeout * 1000)
        await self.conn.execute(
            formatted(QUERIES["statement_timeout_local"], milliseconds=milliseconds)
        )
        # And asyncpg's own limit: a pooled connection's command_timeout would cut it short.
        await self.conn.execute(sql, timeout=statement_timeout + 1.0)
        await self.conn.execute(QUERIES["statement_timeout_restore"], previous)

    async def fetch(self, query: str, *args: Any) -> list[dict[str, Any]]:
        async with _held(self.statement_lock):
            return [dict(row) for row in await self.conn.fetch(QUERIES[query], *args)]

    async def query(self, query: str, **params: Any) -> list[dict[str, Any]]:
        text, names = positional("postgres", query)
        args = [params[name] if name in params else self.fence[name] for name in names]
        async with _held(self.statement_lock):
            return [dict(row) for row in await self.conn.fetch(text, *args)]

    async def run(self, sql: str, *args: Any) -> None:
        async with _held(self.statement_lock):
            await self.conn.execute(sql, *args)

    async def run_many(self, sql: str, args: Sequence[Sequence[Any]]) -> None:
        async with _held(self.statement_lock):
            await self.conn.executemany(sql, args)

    @asynccontextmanager
    async def savepoint(self) -> AsyncIterator[None]:
        async with statement_locked_transaction(self.conn, self.statement_lock):
            yield


class PostgresStore:
    backend: Final = "postgres"
    capabilities: Final = Capabilities(advisory_locks=True)
    commit_watch: Final = None

    def __init__(self, url: DatabaseUrl, settings: Settings, pool: asyncpg.Pool) -> None:
        self.url = url
        self.settings = settings
        self.pool = pool

    @classmethod
    async def open(cls, settings: Settings) -> PostgresStore:
        db = settings.database
        pool = await asyncpg.create_pool(
            settings.database_url.postgres_dsn,
            min_size=db.pool_min_size,
            max_size=db.pool_max_size,
            timeout=db.connect_timeout,
            command_timeout=db.statement_timeout + db.connect_timeout,
            server_settings=cls.server_settings(settings, purpose="pool"),
            init=_init_connection,
            reset=None if settings.lock.mode == "transaction" else _keep_session,
            statement_cache_size=cls.statement_cache_size(settings),
        )
        return cls(settings.database_url, settings, pool)

    @staticmethod
    def statement_cache_size(settings: Settings) -> int:
        """asyncpg's named prepared statements live in one server session; behind a
        transaction pooler (the reason for ``transaction`` mode) the next statement may run
        in another, so prepare unnamed statements there instead."""
        return 0 if settings.lock.mode == "transaction" else 100

    @staticmethod
    def server_settings(settings: Settings, purpose: str) -> dict[str, str]:
        values = {
            # Shows up in pg_stat_activity, so `status` and operators can tell who is who.
            "application_name": f"scheduler-daemon/{settings.instance_id}/{purpose}"[:63],
        }
        # A transaction pooler refuses most startup parameters (PgBouncer: "unsupported
        # startup parameter"), and session settings would leak to its other clients; in
        # transaction mode each transaction sets its own timeout instead (SET LOCAL).
        if settings.lock.mode == "session":
            values["statement_timeout"] = str(int(settings.database.statement_timeout * 1000))
            # Every session, not only the lock's: a replica whose host vanished (a dead
            # switch) would otherwise leave its pool and LISTEN sessions open on the server
            # for tcp_keepalives_idle's default of 2 hours, holding connection slots.
            values.update(
                {name: str(value) for name, value in settings.lock.server_tcp_settings().items()}
            )
        return values

    async def connect_dedicated(
        self, purpose: str, extra_settings: Mapping[str, str] | None = None
    ) -> asyncpg.Connection:
        """A connection outside the pool, for session state (locks, LISTEN)."""
        server_settings = self.server_settings(self.settings, purpose)
        server_settings.update(extra_settings or {})
        timeout = self.settings.database.connect_timeout
        with explain_timeouts(
            f"connecting ({purpose}): no answer within {timeout:g}s (database.connect_timeout)"
        ):
            conn: asyncpg.Connection = await asyncpg.connect(
                self.url.postgres_dsn,
                timeout=timeout,
                server_settings=server_settings,
                statement_cache_size=self.statement_cache_size(self.settings),
            )
        try:
            await _init_connection(conn)
        except BaseException:  # failed or cancelled: the caller never gets it to close
            conn.terminate()
            raise
        return conn

    async def server_version(self) -> tuple[int, int]:
        async with self.pool.acquire() as conn:
            version = conn.get_server_version()
        return (version.major, version.minor)

    async def refuse_missing_grants(self, need: Grants) -> None:
        async with self.pool.acquire() as conn:
            await refuse_missing_grants(conn, need, f"database {self.url}")

    async def migrate(self) -> list[AppliedMigration]:
        conn = await self.connect_dedicated("migrate")
        try:
            return await apply_migrations(conn, self.url)
        finally:
            await conn.close()

    async def schema_version(self) -> int | None:
        try:
            version: int | None = await self.pool.fetchval(QUERIES["schema_version"])
        except asyncpg.UndefinedTableError:  # never migrated
            return None
        return version

    async def schedule(
        self, publish_at: datetime, payload_json: str, key: str | None
    ) -> ScheduleResult:
        # Each statement on its own (no transaction): the read after a conflict sees the
        # row the insert met.
        async with self.pool.acquire() as conn:
            return await publications.schedule(PgTx(conn), publish_at, payload_json, key)

    async def cancel(self, publication_id: int) -> Publication:
        async with self.pool.acquire() as conn:
            return await publications.cancel(PgTx(conn), publication_id)

    async def get(self, publication_id: int) -> Publication | None:
        row = await self.pool.fetchrow(QUERIES["get"], publication_id)
        return None if row is None else _publication(row)

    async def get_by_key(self, key: str) -> Publication | None:
        row = await self.pool.fetchrow(QUERIES["get_by_key"], key)
        return None if row is None else _publication(row)

    async def find_publications(self, where: PublicationFilter) -> list[Publication]:
        rows = await self.pool.fetch(
            QUERIES["publications_find"],
            None if where.statuses is None else list(where.statuses),
            where.due_after, where.due_before, where.key, where.key_prefix, where.limit,
        )  # fmt: skip
        return [_publication(row) for row in rows]

    async def publication_stats(self, limit: int = COUNT_LIMIT) -> PublicationStats:
        row = await self.pool.fetchrow(QUERIES["publication_stats"], limit)
        return PublicationStats(row["scheduled"], row["due"], row["next_due"])

    async def table_health(self) -> TableHealth:
        rows = await self.pool.fetch(QUERIES["table_health"], list(SCHEDULER_TABLES))
        tables = tuple(
            TableStats(
                table=row["table_name"],
                total_bytes=row["total_bytes"],
                live_rows=row["live_rows"],
                dead_rows=row["dead_rows"],
                dead_ratio=row["dead_ratio"],
                last_vacuum=row["last_vacuum"],
                vacuum_age=row["vacuum_age"],
                vacuum_count=row["vacuum_count"],
                autovacuum_count=row["autovacuum_count"],
            )
            for row in rows
            if row["total_bytes"] is not None  # (a table missing: a schema never migrated)
        )
        first = rows[0] if rows else None
        holder = None
        if first is not None and first["holder_kind"] is not None:
            holder = SnapshotHolder(
                kind=first["holder_kind"],
                name=first["holder_name"],
                state=first["holder_state"],
                backend_pid=first["holder_pid"],
                xmin_age=first["holder_xmin_age"],
                held_for=first["holder_held_for"],
            )
        timed = None if first is None else first["timed_held_for"]
        return TableHealth(tables, holder, None, snapshot_seconds=timed or 0.0)

    @asynccontextmanager
    async def transaction(self, *, readonly: bool = False) -> AsyncIterator[PgTx]:
        async with self.pool.acquire() as conn, conn.transaction(readonly=readonly):
            yield PgTx(conn)

    async def close(self) -> None:
        # A graceful close says goodbye on every connection and waits for the server to
        # hang up; behind a cut network that wait lasts until the kernel gives up on the
        # socket, long after the daemon reported itself stopped. The server notices a
        # dropped connection by itself (keepalive), and nothing is in flight by now.
        try:
            async with asyncio.timeout(self.settings.database.connect_timeout):
                await self.pool.close()
        except TimeoutError:
            self.pool.terminate()
