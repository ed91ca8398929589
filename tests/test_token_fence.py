"""Session mode's fence off the lock connection (leadership/session_lease.py), against a real
PostgreSQL, statement by statement: the orderings a network can produce between a replaced
leader's transactions and its successor's draw of the loop's fencing token, each made
happen on purpose and waited for in the server's own lock table, not by a sleep.

The promise: no transaction of a replaced leader commits after its successor's first
fenced statement. Its processes-level proof (real replicas, SIGKILL, SIGSTOP, partitions)
is the chaos slice and tests/test_external_exclusion.py; this file shows the mechanism."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import asyncpg
import pytest
from rig.waiting import until

from scheduler_daemon.config.settings import Settings
from scheduler_daemon.config.url import Backend
from scheduler_daemon.db.plugin_store import Declaration, PluginStore
from scheduler_daemon.db.sqlfiles import positional
from scheduler_daemon.leadership.base import LeadershipLost
from scheduler_daemon.leadership.fenced_tx import SqlEndedFence
from scheduler_daemon.leadership.session_lease import TokenFence, fencing_row
from scheduler_daemon.logs import get_logger
from scheduler_daemon.schema_gate import SchemaGate

pytestmark = pytest.mark.postgres

DRAW, DRAW_PARAMETERS = positional("postgres", "fencing_next")  # as asyncpg takes it
assert DRAW_PARAMETERS == ("loop", "instance")
SETTINGS = Settings(lock={"heartbeat_interval": 0.2, "stop_grace": 0.5, "stall_timeout": 3})
BACKEND: Backend = "postgres"


@pytest.fixture
async def pool(pg_url: str) -> AsyncIterator[asyncpg.Pool]:
    async with asyncpg.create_pool(pg_url, min_size=1, max_size=6) as opened:
        await opened.execute("CREATE TABLE fenced_writes (who text, n int)")
        yield opened


class Leader:
    """One leadership's fence, and whether the database told it that it is over."""

    def __init__(self, pool: asyncpg.Pool, token: int, name: str) -> None:
        self.name = name
        self.lost: list[str] = []
        self.fence = TokenFence(
            pool, "plugin", token, SETTINGS, SchemaGate(BACKEND), get_logger(), self.lost.append
        )

    async def write(self, n: int) -> None:
        async with self.fence.transaction(only_ours=True) as tx:
            await tx.run("INSERT INTO fenced_writes VALUES ($1, $2)", self.name, n)


async def drawn(pool: asyncpg.Pool) -> int:
    token: int = await pool.fetchval(DRAW, "plugin", "test")
    return token


async def waiting_on_the_fencing_row(pool: asyncpg.Pool, pid: int) -> bool:
    """Backend ``pid`` waits for a row lock (the fencing row: nothing else is locked)."""
    return bool(
        await pool.fetchval(
            "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1", pid
        )
    )


async def fence_waiting(pool: asyncpg.Pool) -> None:
    """Until one fenced transaction's first statement waits on a lock (the draw's row)."""
    await until(
        lambda: pool.fetchval(
            "SELECT count(*) = 1 FROM pg_stat_activity "
            "WHERE wait_event_type = 'Lock' AND query LIKE '%scheduler_fence(%'"
        ),
        "the old leader's fence to wait for the draw",
        10,
    )


async def writes(pool: asyncpg.Pool) -> list[tuple[str, int]]:
    rows = await pool.fetch("SELECT who, n FROM fenced_writes ORDER BY who, n")
    return [(row["who"], row["n"]) for row in rows]


async def test_a_successors_draw_waits_for_the_old_leaders_open_transaction(
    pool: asyncpg.Pool,
) -> None:
    """The old leader's transaction is open when its successor draws: the draw waits for it
    (the fencing row is held FOR SHARE), so what the old leader commits commits before
    the successor's token exists; its next transaction is refused before doing anything."""
    old = Leader(pool, await drawn(pool), "old")
    successor = await pool.acquire()
    try:
        async with old.fence.transaction(only_ours=True) as tx:
            await tx.run("INSERT INTO fenced_writes VALUES ('old', 1)")
            drawing = asyncio.ensure_future(successor.fetchval(DRAW, "plugin", "new"))
            pid = successor.get_server_pid()
            await until(lambda: waiting_on_the_fencing_row(pool, pid), "the draw to wait", 10)
            assert not drawing.done()
        new_token = await asyncio.wait_for(drawing, 10)
        with pytest.raises(LeadershipLost, match="newer leader"):
            await old.write(2)
        assert old.lost == ["a newer leader drew the loop's fencing token"]
        new = Leader(pool, new_token, "new")
        await new.write(1)
        assert await writes(pool) == [("new", 1), ("old", 1)]
    finally:
        await pool.release(successor)


async def test_an_old_transaction_that_begins_during_the_draw_fails_once_it_commits(
    pool: asyncpg.Pool,
) -> None:
    """The other order: the successor's draw is under way (its transaction holds the row)
    when the old leader begins. The fence waits for the draw, then reads the row as the
    draw left it (READ COMMITTED's locking read) and refuses: nothing of it ran."""
    old = Leader(pool, await drawn(pool), "old")
    successor = await pool.acquire()
    try:
        await successor.execute("BEGIN")
        await successor.fetchval(DRAW, "plugin", "new")
        beginning = asyncio.ensure_future(old.write(1))
        await fence_waiting(pool)
        await successor.execute("COMMIT")
        with pytest.raises(LeadershipLost):
            await asyncio.wait_for(beginning, 10)
        assert await writes(pool) == []
    finally:
        await pool.release(successor)


async def test_a_successor_that_rolled_its_draw_back_leaves_the_old_token_valid(
    pool: asyncpg.Pool,
) -> None:
    """A draw that never commits (the new leader died before its claim committed) changes
    nothing: the old token is still the row's, and its transactions go on."""
    old = Leader(pool, await drawn(pool), "old")
    successor = await pool.acquire()
    try:
        await successor.execute("BEGIN")
        await successor.fetchval(DRAW, "plugin", "new")
        beginning = asyncio.ensure_future(old.write(1))
        await fence_waiting(pool)
        await successor.execute("ROLLBACK")
        await asyncio.wait_for(beginning, 10)
        assert old.lost == []
        assert await writes(pool) == [("old", 1)]
    finally:
        await pool.release(successor)


async def test_fenced_transactions_run_at_once_and_user_sql_leaves_no_session_state(
    pool: asyncpg.Pool,
) -> None:
    """Several fenced transactions are in flight together (none waits for another: each
    holds the row FOR SHARE); a task's SQL that sets a session setting or takes a session
    lock leaves neither to the connection's next user; SQL that ends its transaction
    fails its run."""
    leader = Leader(pool, await drawn(pool), "leader")
    inside = asyncio.Barrier(3)

    async def one(n: int) -> None:
        async with leader.fence.transaction() as tx:
            await tx.run("INSERT INTO fenced_writes VALUES ('leader', $1)", n)
            await asyncio.wait_for(inside.wait(), 10)  # all three open at once

    await asyncio.gather(one(1), one(2), one(3))
    assert await writes(pool) == [("leader", 1), ("leader", 2), ("leader", 3)]

    async with leader.fence.transaction() as tx:
        await tx.execute(
            "SET search_path = pg_catalog; SELECT pg_advisory_lock(42)", statement_timeout=5
        )
        pid = tx.conn.get_server_pid()
    # Not one of the session's advisory locks is left, nor its setting.
    async with pool.acquire() as conn:
        assert not await conn.fetchval(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = $1", pid
        )
    async with leader.fence.transaction() as tx:
        if tx.conn.get_server_pid() == pid:
            assert await tx.conn.fetchval("SHOW search_path") != "pg_catalog"
    with pytest.raises(SqlEndedFence):
        async with leader.fence.transaction() as tx:
            await tx.execute("COMMIT")
    assert leader.lost == []


async def test_sql_sent_with_the_fence_never_runs_for_a_replaced_leader(
    pool: asyncpg.Pool,
) -> None:
    """A `sql` task's transaction (``lazy``) sends BEGIN and the fence with its statement,
    in one message: two round trips. Once a successor drew its token, the
    fence refuses and PostgreSQL runs nothing after it in that message: not the INSERT,
    nor its statement timeout. Before that, it commits; a transaction in which nothing ran
    begins nothing."""
    leader = Leader(pool, await drawn(pool), "leader")
    async with leader.fence.transaction(lazy=True) as tx:
        await tx.execute("INSERT INTO fenced_writes VALUES ('leader', 1)", statement_timeout=5)
    async with leader.fence.transaction(lazy=True):
        pass  # nothing sent, nothing to commit
    await drawn(pool)  # a successor
    with pytest.raises(LeadershipLost):
        async with leader.fence.transaction(lazy=True) as tx:
            await tx.execute("INSERT INTO fenced_writes VALUES ('leader', 2)", statement_timeout=5)
    assert await writes(pool) == [("leader", 1)]
    assert leader.lost == ["a newer leader drew the loop's fencing token"]
    async with pool.acquire() as conn:  # nothing left behind on the connections
        assert await conn.fetchval("SHOW statement_timeout") == "0"


async def test_a_statement_that_fences_itself_writes_nothing_for_a_replaced_leader(
    pool: asyncpg.Pool,
) -> None:
    """Session mode's one-round-trip bookkeeping (a claim, a refusal, a result batch) runs
    outside a transaction, each statement fenced in its first CTE: it writes while the
    token is the leader's, nothing once a successor drew one, and a write that does not
    fence itself is refused there."""
    leader = Leader(pool, await drawn(pool), "leader")
    now = datetime.now(UTC)
    async with leader.fence.transaction(only_ours=True) as tx:
        await PluginStore(tx).declare(
            [Declaration(name, "every 60s", now, "config") for name in ("a", "b")]
        )
    async with leader.fence.statements() as tx:
        await PluginStore(tx).refuse({"a": "cannot run it"})
        with pytest.raises(RuntimeError, match="does not fence itself"):
            await PluginStore(tx).declare([Declaration("c", "every 60s", now, "config")])
    await drawn(pool)  # a successor
    with pytest.raises(LeadershipLost):
        async with leader.fence.statements() as tx:
            await PluginStore(tx).refuse({"b": "cannot run it"})
    paused = await pool.fetch("SELECT name, paused FROM scheduler_plugin_tasks ORDER BY name")
    assert [(row["name"], row["paused"]) for row in paused] == [("a", True), ("b", False)]
    assert leader.lost == ["a newer leader drew the loop's fencing token"]


def test_a_second_deployment_on_its_own_lock_key_has_a_fencing_row_of_its_own() -> None:
    defaults = Settings().lock.keys
    assert fencing_row("plugin", defaults.plugin) == "plugin"
    assert fencing_row("publish", defaults.publish) == "publish"
    assert fencing_row("plugin", 12345) == "plugin/key_3039"
    assert fencing_row("plugin", -1) == "plugin/key_ffffffffffffffff"
