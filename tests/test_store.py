"""The store contract and the scheduling API, on both backends."""

from __future__ import annotations

import ast
import asyncio
import re
import sqlite3
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg
import pytest
from rig.databases import replace_host_port
from rig.tcpproxy import TcpProxy

import scheduler_daemon
from scheduler_daemon.aio import unless_set
from scheduler_daemon.client import Client
from scheduler_daemon.config.settings import Settings
from scheduler_daemon.db import connect as connect_module
from scheduler_daemon.db.connect import connect, open_store
from scheduler_daemon.db.sqlfiles import (
    OUTSIDE_A_TRANSACTION,
    Migration,
    formatted,
    migrations,
    queries,
)
from scheduler_daemon.errors import InvalidInput, NotFound, SchemaMissing
from scheduler_daemon.logs import get_logger


@pytest.fixture
async def client(database_url: str) -> AsyncIterator[Client]:
    settings = Settings(database_url=database_url, publish={"max_payload_bytes": 1000})
    async with Client.connect(settings) as connected:
        yield connected


def test_both_backends_define_the_same_queries() -> None:
    # Only PostgreSQL has a lock manager to ask (pg_locks) and LISTEN/NOTIFY; a SQLite
    # leader has no session to ask, so it writes its heartbeat instead.
    postgres_only = {
        "leader_touch", "lock_entry", "lock_held", "instance_sessions", "lock_sessions", "notify_published",
        "leaders_forget",
        # The session guard's lock and settings; the transaction guard's (SQLite: flock,
        # and BEGIN IMMEDIATE, its one transaction control statement).
        "session_limits", "lock_try", "lock_wait", "lock_unlock", "statement_timeout_off",
        "statement_timeout_reset", "fence_compete", "token_fence", "fencing_supersede", "session_clean", "transaction_limits", "backend_pid",
        "hold_queue", "lock_timeout_local", "lock_timeout_default",
        # A statement's own timeout (SQLite: none, busy_timeout for the whole connection).
        "statement_timeout_read", "statement_timeout_local", "statement_timeout_restore",
        # `migrate`'s lock and wake-up, and the grants a role needs (SQLite: the file's).
        "version_table_exists", "migration_lock", "migration_lock_versions",
        "migration_wake_leaders", "missing_grants", "unusable_schemas",
        "migration_session_lock", "migration_session_unlock",
    }  # fmt: skip
    # Sharded leadership is PostgreSQL's (session mode): SQLite refuses plugin.shards > 1.
    postgres_only |= {name for name in queries("postgres") if name.startswith("shard_")}
    # The connection's pragmas; the publish leader's stand-in for LISTEN.
    sqlite_only = {"leader_heartbeat", "table_exists", "connection_settings", "data_version"}
    assert set(queries("postgres")) - postgres_only == set(queries("sqlite")) - sqlite_only


# SQL is written in the named blocks of db/postgres.sql and db/sqlite.sql and in migrations,
# never in Python, but for the statements db/sqlfiles.py's rule keeps there. A string
# literal that starts as a statement does (upper-case keywords, as this code writes SQL;
# an f-string's values read as {}); docstrings are prose.
SQL_LITERAL = re.compile(
    r"\s*\(?\s*(?:(?:SELECT|INSERT|UPDATE|DELETE|WITH|VALUES|MERGE|TABLE|CREATE|ALTER|DROP"
    r"|GRANT|REVOKE|TRUNCATE|LOCK|COPY|LISTEN|UNLISTEN|NOTIFY|SET|RESET|SHOW|PRAGMA|SAVEPOINT"
    r"|RELEASE|ROLLBACK|COMMIT|BEGIN|START|END|ABORT|DISCARD|VACUUM|ANALYZE|EXPLAIN|CALL|DO"
    r"|DECLARE|FETCH|PREPARE|EXECUTE|DEALLOCATE|ATTACH|DETACH|REINDEX|CLUSTER|REFRESH)\s+\S"
    r"|(?:BEGIN|COMMIT|ROLLBACK|END|ABORT|CHECKPOINT|VACUUM|ANALYZE)\s*;?\s*$)"
)
# Transaction control, spelled by the driver code (db/sqlfiles.py): the SQLite store's
# transactions, and its savepoints, named by the code (sp_<n>).
TRANSACTION_CONTROL = {
    "BEGIN", "BEGIN IMMEDIATE", "COMMIT", "ROLLBACK", "SAVEPOINT {}", "ROLLBACK TO {}",
    "RELEASE {}",
}  # fmt: skip
# Never run: the GRANT an error message tells the operator to run (db/privileges.py).
NEVER_RUN = {"GRANT {} ON {} TO {}"}


def sql_literals(source: str) -> list[tuple[int, str]]:
    """The string literals of a module's source that read as SQL statements: (line, text)."""
    tree = ast.parse(source)
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                skip.add(id(first.value))  # a docstring
        elif isinstance(node, ast.JoinedStr):
            skip.update(id(part) for part in node.values)  # read with the f-string
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            text = "".join(
                part.value if isinstance(part, ast.Constant) else "{}" for part in node.values
            )
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) in skip:
                continue
            text = node.value
        else:
            continue
        if SQL_LITERAL.match(text):
            found.append((node.lineno, text))
    return found


def test_sql_literals_finds_statements_not_prose() -> None:
    source = '''
"""SELECT in a docstring is prose."""
A = "SELECT pg_backend_pid()"
B = f"SET LOCAL lock_timeout = {ms}"
C = ("UPDATE t "
     "SET x = 1")
D = "COMMIT"
E = ["SELECT", "INSERT"]  # privilege names
F = "lock connection closed"
G = f"Selected {n} rows"
'''
    assert sql_literals(source) == [
        (3, "SELECT pg_backend_pid()"),
        (4, "SET LOCAL lock_timeout = {}"),
        (5, "UPDATE t SET x = 1"),
        (7, "COMMIT"),
    ]


def test_no_sql_in_python() -> None:
    """Every statement the daemon runs is a named block (or a migration), used as
    ``QUERIES["name"]``: a literal SQL string in the package fails here, naming where."""
    package = Path(scheduler_daemon.__file__).parent
    inline = []
    for path in sorted(package.rglob("*.py")):
        if path == package / "db" / "sqlfiles.py":
            continue
        for line, text in sql_literals(path.read_text("utf-8")):
            if " ".join(text.split()) not in TRANSACTION_CONTROL | NEVER_RUN:
                inline.append(f"{path.relative_to(package.parent)}:{line}: {text[:70]!r}")
    assert inline == [], "SQL in Python: make it a named block (see db/sqlfiles.py)"


def test_a_migration_outside_a_transaction_is_marked_and_split_into_its_statements() -> None:
    """Only a file with the marker line runs outside a transaction (CREATE INDEX
    CONCURRENTLY cannot run in one); it is sent a statement at a time, comments dropped, each
    safe to repeat (a migrate cut short runs them again: DROP ... IF EXISTS first)."""
    outside = {m.name: m for m in migrations("postgres") if not m.transactional}
    assert "publications_not_published" in outside
    assert "runs_partitioned" not in outside
    [drop, create] = outside["publications_not_published"].statements
    assert drop.startswith("DROP INDEX CONCURRENTLY IF EXISTS ")
    assert create.startswith("CREATE INDEX CONCURRENTLY ")
    assert create.endswith(";")
    assert all(m.transactional for m in migrations("sqlite"))
    cut = Migration(99, "cut", f"{OUTSIDE_A_TRANSACTION}\nCREATE INDEX CONCURRENTLY x ON t (a)\n")
    with pytest.raises(ValueError, match="no ';'"):
        _ = cut.statements


def test_formatted_writes_integers_and_names_only() -> None:
    """``{name}`` placeholders (SET, PRAGMA: no bind parameters) take integers and the
    daemon's own names, nothing that could be read as SQL, and every one must be filled."""
    text = queries("postgres")["transaction_limits"]
    filled = formatted(text, stall_ms=1500, statement_ms=30000)
    assert "idle_in_transaction_session_timeout = 1500;" in filled
    assert filled.rstrip().endswith("statement_timeout = 30000")
    fence = formatted(
        queries("postgres")["token_fence"], stall_ms=1, check_ms=1, loop="plugin/7", token=5,
        newest=15,
    )  # fmt: skip
    assert "scheduler_fence('plugin/7', 5, 15)" in fence
    shards = formatted(
        queries("postgres")["shard_token_fence"], stall_ms=1, check_ms=1, loop="plugin",
        member_pid=4242, member_class=17, member_objid=2**31 + 5, shards=(3, 5),
        tokens=(71, 2**40 + 9), newest=16,
    )  # fmt: skip
    assert "scheduler_fence_shards('plugin', 4242, 17, 2147483653," in shards
    assert "'{3,5}'::integer[], '{71,1099511627785}'::bigint[], 16)" in shards
    with pytest.raises(TypeError, match="tuple of ints"):
        formatted(text, stall_ms=("1); DROP TABLE x; --",), statement_ms=1)  # type: ignore[arg-type]
    for hostile in ("1500; DROP TABLE x", "plugin'); DROP TABLE x; --", "Plugin"):
        with pytest.raises(ValueError, match="takes a name"):
            formatted(text, stall_ms=hostile, statement_ms=1)
    with pytest.raises(TypeError):
        formatted(text, stall_ms=1.5, statement_ms=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        formatted(text, stall_ms=True, statement_ms=1)
    with pytest.raises(ValueError, match="placeholders"):
        formatted(text, stall_ms=1500)


async def test_schedule_get_and_timezone(client: Client) -> None:
    at = datetime(2031, 5, 1, 12, 0, tzinfo=timezone(timedelta(hours=2)))
    result = await client.schedule(at, {"post": 7, "title": "héllo"})
    assert result.created
    got = await client.get(result.publication.id)
    assert got is not None
    assert got.publish_at == at  # the same instant
    assert got.publish_at.astimezone(UTC).hour == 10
    assert got.payload == {"post": 7, "title": "héllo"}
    assert got.status == "scheduled"
    assert got.attempts == 0


async def test_idempotent_key(client: Client) -> None:
    at = datetime.now(UTC) + timedelta(hours=1)
    first = await client.schedule(at, {"n": 1}, key="post-1")
    second = await client.schedule(at + timedelta(hours=5), {"n": 2}, key="post-1")
    assert first.created
    assert not second.created
    assert second.publication == first.publication
    stats = await client.store.publication_stats()
    assert stats.scheduled == 1


async def test_cancel(client: Client) -> None:
    result = await client.schedule(datetime.now(UTC) + timedelta(hours=1), {})
    cancelled = await client.cancel(result.publication.id)
    assert cancelled.status == "cancelled"
    with pytest.raises(InvalidInput, match="is cancelled, not scheduled"):
        await client.cancel(result.publication.id)
    with pytest.raises(NotFound):
        await client.cancel(424242)


@pytest.mark.parametrize(
    ("at", "payload", "key", "message"),
    [
        (datetime(2031, 1, 1), {}, None, "timezone-aware"),
        (datetime(2031, 1, 1, tzinfo=UTC), {"x": "y" * 2000}, None, "over the limit"),
        (datetime(2031, 1, 1, tzinfo=UTC), {"x": {1, 2}}, None, "not JSON"),
        (datetime(2031, 1, 1, tzinfo=UTC), {"x": float("nan")}, None, "not JSON"),
        (datetime(2031, 1, 1, tzinfo=UTC), {}, "  ", "key must not be empty"),
    ],
)
async def test_bad_input_changes_nothing(
    client: Client, at: datetime, payload: object, key: str | None, message: str
) -> None:
    with pytest.raises(InvalidInput, match=message):
        await client.schedule(at, payload, key=key)
    assert (await client.store.publication_stats()).scheduled == 0


async def test_stats_use_the_database_clock(client: Client) -> None:
    now = datetime.now(UTC)
    await client.schedule(now - timedelta(minutes=1), {})
    await client.schedule(now + timedelta(hours=1), {})
    stats = await client.store.publication_stats()
    assert stats.scheduled == 2
    assert stats.due == 1
    assert stats.next_due is not None
    assert abs((stats.next_due - (now - timedelta(minutes=1))).total_seconds()) < 0.01


# -- reads and writes: a read-only transaction kind -----------------------------------


async def test_a_read_only_transaction_does_not_wait_for_a_writer(sqlite_url: str) -> None:
    """SQLite: a deferred BEGIN, not BEGIN IMMEDIATE, so `status` and `tasks list` read
    while another process holds the write lock (they used to wait busy_timeout, 30 s)."""
    holder = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"), isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    holder.execute("UPDATE scheduler_publications SET attempts = attempts")
    # busy_timeout 0.2 s: a read that waited for the lock at all would fail.
    settings = Settings(database_url=sqlite_url, database={"statement_timeout": 0.2})
    store = await open_store(settings)
    try:
        async with asyncio.timeout(5), store.transaction(readonly=True) as tx:
            assert await tx.fetch("leaders") == []
        # Writers still queue on the lock: the read-only kind is what lets reads through.
        with pytest.raises(sqlite3.OperationalError, match="database is locked"):
            async with store.transaction():
                pass
    finally:
        holder.close()
        await store.close()


async def test_a_transaction_cancelled_as_it_begins_leaves_no_write_lock_behind(
    sqlite_url: str,
) -> None:
    """SQLite: a BEGIN IMMEDIATE whose caller is cancelled still runs in aiosqlite's
    thread (here it waits busy_timeout for another process's write lock). It used to
    begin a transaction nobody ended: the process kept the write lock while it lived, and
    a new leader granted the lock files waited busy_timeout again and again (a rolling
    upgrade's old leader, its runs' result write cancelled as it stepped down)."""
    path = sqlite_url.removeprefix("sqlite:///")
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    store = await open_store(Settings(database_url=sqlite_url, database={"statement_timeout": 5}))
    try:

        async def write() -> None:
            async with store.transaction() as tx:
                await tx.run("UPDATE scheduler_publications SET attempts = attempts")

        writing = asyncio.create_task(write())
        await asyncio.sleep(0.1)  # its BEGIN is on its way (it cannot end before holder's)
        assert not writing.done()
        writing.cancel()
        async with asyncio.timeout(2):  # at once: no waiting for holder (busy_timeout)
            with pytest.raises(asyncio.CancelledError):
                await writing
        holder.execute("ROLLBACK")  # the abandoned BEGIN takes the write lock now
        async with asyncio.timeout(10):  # a read queued behind it: it has begun by then
            assert await store.schema_version() is not None
        # ...and gave it back: another process writes, and so does the store itself.
        await asyncio.to_thread(take_write_lock, path, within=5.0)
        async with asyncio.timeout(10), store.transaction() as tx:
            await tx.run("UPDATE scheduler_publications SET attempts = attempts")
    finally:
        holder.close()
        await store.close()


def take_write_lock(path: str, within: float) -> None:
    """Take SQLite's write lock on `path` (and give it back) as another process would,
    waiting `within` seconds at most for whoever holds it."""
    other = sqlite3.connect(path, isolation_level=None, timeout=within)
    try:
        other.execute("BEGIN IMMEDIATE")
        other.execute("ROLLBACK")
    finally:
        other.close()


@pytest.mark.postgres
async def test_a_read_only_transaction_refuses_writes(pg_url: str) -> None:
    store = await open_store(Settings(database_url=pg_url))
    try:
        with pytest.raises(asyncpg.ReadOnlySQLTransactionError):
            async with store.transaction(readonly=True) as tx:
                await tx.run("DELETE FROM scheduler_publications")
        async with store.transaction(readonly=True) as tx:
            assert await tx.fetch("leaders") == []
    finally:
        await store.close()


@pytest.mark.postgres
async def test_every_session_asks_the_server_to_notice_a_vanished_client(pg_url: str) -> None:
    """Pool and LISTEN sessions carry the lock session's keepalive and user timeout too, so
    the server closes all of a vanished replica's sessions, not only the one that locks."""
    settings = Settings(database_url=pg_url)
    store = await open_store(settings)
    try:
        dedicated = await store.connect_dedicated("listen")  # type: ignore[attr-defined]
        try:
            async with store.pool.acquire() as pooled:  # type: ignore[attr-defined]
                for conn in (pooled, dedicated):
                    for name, value in settings.lock.server_tcp_settings().items():
                        shown = await conn.fetchval("SELECT current_setting($1)", name)
                        assert int(shown.removesuffix("ms").removesuffix("s")) == value, name
        finally:
            await dedicated.close()
    finally:
        await store.close()


@pytest.mark.postgres
async def test_closing_the_store_behind_a_cut_network_takes_connect_timeout_at_most(
    pg_url: str, tcp_proxy_factory: Callable[[str, int], TcpProxy]
) -> None:
    """A graceful close waits for the server to hang up on each pooled connection; behind
    a cut network it waited until the kernel gave up on the sockets (a replica SIGTERMed
    while partitioned exited 11 s after SIGTERM, shutdown_timeout 5 s). Now the close is
    bounded by database.connect_timeout, then the connections are dropped."""
    parts = urlsplit(pg_url)
    proxy = tcp_proxy_factory(parts.hostname or "127.0.0.1", parts.port or 5432)
    settings = Settings(
        database_url=replace_host_port(pg_url, "127.0.0.1", proxy.port),
        database={"connect_timeout": 1, "pool_min_size": 2},
    )
    store = await open_store(settings)
    async with store.pool.acquire() as conn:  # type: ignore[attr-defined]
        await conn.fetchval("SELECT 1")
    proxy.freeze()
    started = time.monotonic()
    await asyncio.wait_for(store.close(), 30)
    assert time.monotonic() - started < 1 + 2  # connect_timeout, and slack


@pytest.mark.postgres
@pytest.mark.parametrize("how", ["fails", "is cancelled"])
async def test_a_dedicated_connection_whose_setup_fails_is_closed(
    pg_url: str, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """connect_dedicated opens the connection, then sets it up (the JSON codecs): when that
    fails or is cancelled, the connection it opened is closed, not left to the server."""
    from scheduler_daemon.db import postgres

    store = await open_store(Settings(database_url=pg_url, instance_id="setup-1"))
    assert isinstance(store, postgres.PostgresStore)
    started = asyncio.Event()

    async def broken_setup(conn: asyncpg.Connection) -> None:
        await conn.fetchval("SELECT 1")  # the session is up on the server
        started.set()
        if how == "fails":
            raise asyncpg.QueryCanceledError("canceling statement due to statement timeout")
        await asyncio.Event().wait()

    monkeypatch.setattr(postgres, "_init_connection", broken_setup)
    try:
        connecting = asyncio.create_task(store.connect_dedicated("setup"))
        await asyncio.wait_for(started.wait(), 10)
        if how == "is cancelled":
            connecting.cancel()
        with pytest.raises((asyncpg.QueryCanceledError, asyncio.CancelledError)):
            await connecting
        deadline = asyncio.get_running_loop().time() + 10
        while await _sessions(store, "scheduler-daemon/setup-1/setup"):
            assert asyncio.get_running_loop().time() < deadline, "its session is still open"
            await asyncio.sleep(0.05)
    finally:
        await store.close()


async def _sessions(store: object, application_name: str) -> int:
    async with store.pool.acquire() as conn:  # type: ignore[attr-defined]
        count: int = await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
            application_name,
        )
        return count


async def test_opening_a_missing_sqlite_file_without_create_leaves_none(tmp_path: Path) -> None:
    path = tmp_path / "scheduler.db"
    settings = Settings(database_url=f"sqlite:///{path}")
    with pytest.raises(SchemaMissing, match=r"schema not found \(no such file .*migrate`"):
        await open_store(settings, create=False)
    assert not path.exists()
    store = await open_store(settings)  # the default (the daemon, migrate) creates it
    await store.close()
    assert path.exists()


async def test_a_stop_that_lands_as_a_connection_attempt_fails_is_not_lost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stop that came as a connection attempt failed was lost: asyncio.wait_for (Python
    3.11) answered the cancellation with the attempt's error, and the retry loop went on.
    A daemon stopped while connecting then retried until its startup budget ran out (seen
    with two suites side by side: SIGTERM, then 15 s of db.connect_failed). The stop wins."""
    stopping = asyncio.Event()

    async def refused(settings: Settings, *, create: bool = True) -> None:
        stopping.set()  # the stop arrives just as the attempt fails: its cancellation
        await asyncio.sleep(0)  # reaches the connecting task as this attempt ends
        raise ConnectionRefusedError(111, "Connect call failed")

    monkeypatch.setattr(connect_module, "open_store", refused)
    settings = Settings(database_url="postgresql://app@127.0.0.1:9/app")
    step = await asyncio.wait_for(unless_set(connect(settings, get_logger()), stopping), 20)
    assert step.cancelled()
