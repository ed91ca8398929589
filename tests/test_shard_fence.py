"""A sharded member's fence off its lock connection (``scheduler_fence_shards``, migration
0016; leadership/shard_lease.py), against a real PostgreSQL, statement by statement: the
orderings between a replaced owner's transactions and the next owner's draw of a shard's
token, each made to happen on purpose and waited for in the server's own lock table.

The promise, per shard: no transaction of a shard's replaced owner commits after its
successor's first fenced statement; a transaction for several shards goes on for those
still its own. And across layouts: an unsharded leader's transactions end where a member
of a sharded layout starts, and the other way round (``fencing_supersede``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import pytest
from rig.waiting import until

from scheduler_daemon.db.sqlfiles import formatted, positional, queries

pytestmark = pytest.mark.postgres

Q = queries("postgres")
DRAW, _ = positional("postgres", "fencing_next")  # (loop, instance), as asyncpg takes it
SUPERSEDE, SUPERSEDE_PARAMETERS = positional("postgres", "fencing_supersede")
assert SUPERSEDE_PARAMETERS == ("loop", "rows")
NEWEST = 99  # newer than any migration: the schema check passes


@pytest.fixture
async def pool(pg_url: str) -> AsyncIterator[asyncpg.Pool]:
    async with asyncpg.create_pool(pg_url, min_size=1, max_size=6) as opened:
        await opened.execute("CREATE TABLE fenced_writes (who text, n int)")
        yield opened


MEMBER_CLASS = 7  # the test's stand-in member lock: (7, the session's backend pid)


def shard_fence(owned: dict[int, int], member_pid: int, newest: int = NEWEST) -> str:
    """BEGIN and a member's fence for ``owned`` (shard -> token), as the daemon sends it,
    for a member whose lock session is ``member_pid``."""
    shards = tuple(sorted(owned))
    fence = formatted(
        Q["shard_token_fence"], stall_ms=3000, check_ms=1000, loop="plugin",
        member_pid=member_pid, member_class=MEMBER_CLASS, member_objid=member_pid,
        shards=shards, tokens=tuple(owned[s] for s in shards), newest=newest,
    )  # fmt: skip
    return ";\n".join(("BEGIN", fence))


async def member(conn: asyncpg.Connection) -> int:
    """Make ``conn`` its own member's lock session: the member lock taken. Its pid."""
    pid: int = conn.get_server_pid()
    await conn.execute("SELECT pg_advisory_lock($1, $2)", MEMBER_CLASS, pid)
    return pid


def loop_fence(token: int) -> str:
    fence = formatted(
        Q["token_fence"], stall_ms=3000, check_ms=1000, loop="plugin", token=token,
        newest=NEWEST,
    )  # fmt: skip
    return ";\n".join(("BEGIN", fence))


async def draw(conn: asyncpg.Connection | asyncpg.Pool, row: str) -> int:
    token: int = await conn.fetchval(DRAW, row, "test")
    return token


async def superseded_shards(conn: asyncpg.Connection, owned: dict[int, int]) -> set[int]:
    """Begin a fenced transaction for ``owned`` (``conn`` its own member); the shards the
    fence refused (empty: it is open)."""
    try:
        await conn.execute(shard_fence(owned, conn.get_server_pid()))
    except asyncpg.PostgresError as exc:
        await conn.execute("ROLLBACK")
        if exc.sqlstate != "SDF01":
            raise
        return {int(s) for s in (exc.detail or "").split(",")}
    return set()


async def waits_on_a_lock(pool: asyncpg.Pool, pid: int) -> bool:
    return bool(
        await pool.fetchval(
            "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1", pid
        )
    )


async def writes(pool: asyncpg.Pool) -> list[tuple[str, int]]:
    rows = await pool.fetch("SELECT who, n FROM fenced_writes ORDER BY who, n")
    return [(row["who"], row["n"]) for row in rows]


async def test_a_shards_next_owner_waits_for_the_old_owners_open_transaction(
    pool: asyncpg.Pool,
) -> None:
    """The old owner's transaction for shards 3 and 5 is open when shard 5's next owner
    draws: the draw waits for it, what it wrote commits before the new token exists, and
    the old owner's next transaction goes on for shard 3 alone."""
    owned = {3: await draw(pool, "plugin/3"), 5: await draw(pool, "plugin/5")}
    old, successor = await pool.acquire(), await pool.acquire()
    try:
        await member(old)
        await member(successor)
        assert await superseded_shards(old, owned) == set()
        await old.execute("INSERT INTO fenced_writes VALUES ('old', 1)")
        drawing = asyncio.ensure_future(draw(successor, "plugin/5"))
        pid = successor.get_server_pid()
        await until(lambda: waits_on_a_lock(pool, pid), "the draw to wait", 10)
        assert not drawing.done()
        await old.execute("COMMIT")
        new_token = await asyncio.wait_for(drawing, 10)
        assert new_token > owned[5]

        assert await superseded_shards(old, owned) == {5}, "shard 5 is the successor's"
        assert await superseded_shards(old, {3: owned[3]}) == set(), "shard 3 is still ours"
        await old.execute("ROLLBACK")
        assert await superseded_shards(successor, {5: new_token}) == set()
        await successor.execute("ROLLBACK")
        assert await writes(pool) == [("old", 1)]
    finally:
        await pool.release(old)
        await pool.release(successor)


async def test_an_old_owners_transaction_begun_during_the_draw_is_refused(
    pool: asyncpg.Pool,
) -> None:
    """The other order: the draw is under way when the old owner begins. Its fence waits
    for the draw, reads the row as the draw left it, and refuses before anything ran."""
    owned = {1: await draw(pool, "plugin/1")}
    old, successor = await pool.acquire(), await pool.acquire()
    try:
        await member(old)
        await member(successor)
        await successor.execute("BEGIN")
        await draw(successor, "plugin/1")
        beginning = asyncio.ensure_future(superseded_shards(old, owned))
        pid = old.get_server_pid()
        await until(lambda: waits_on_a_lock(pool, pid), "the old fence to wait", 10)
        await successor.execute("COMMIT")
        assert await asyncio.wait_for(beginning, 10) == {1}
    finally:
        await pool.release(old)
        await pool.release(successor)


async def test_a_newer_schema_or_a_member_gone_refuses_before_anything_runs(
    pool: asyncpg.Pool,
) -> None:
    """A newer schema (SDF02); a member whose lock session no longer holds its member
    lock (SDF01, DETAIL 'member'), even for no shard at all (a take-over's declarations)."""
    conn, lock_session = await pool.acquire(), await pool.acquire()
    try:
        with pytest.raises(asyncpg.PostgresError) as refused:
            await conn.execute(shard_fence({}, await member(conn), newest=1))
        assert refused.value.sqlstate == "SDF02"
        await conn.execute("ROLLBACK")
        pid = await member(lock_session)
        await conn.execute(shard_fence({}, pid))  # a member: it passes
        await conn.execute("ROLLBACK")
        await lock_session.execute("SELECT pg_advisory_unlock_all()")  # its session "ends"
        with pytest.raises(asyncpg.PostgresError) as refused:
            await conn.execute(shard_fence({}, pid))
        assert refused.value.sqlstate == "SDF01"
        assert refused.value.detail == "member"
    finally:
        await conn.execute("ROLLBACK")
        await conn.execute("SELECT pg_advisory_unlock_all()")
        await pool.release(conn)
        await pool.release(lock_session)


async def test_a_sharded_layout_and_an_unsharded_leader_supersede_each_other(
    pool: asyncpg.Pool,
) -> None:
    """The loop led unsharded, then by members (a change of plugin.shards in a rolling
    deploy), then unsharded again. A member that joins moves the loop's own row on: it
    waits for the unsharded leader's open transaction and refuses its next. An unsharded
    leader that takes over moves every shard's row on, with the same two effects. Another
    deployment's row (a key of its own) is left alone."""
    other_deployment = await draw(pool, "plugin/key_2a")
    unsharded = await draw(pool, "plugin")
    old, newcomer = await pool.acquire(), await pool.acquire()
    try:
        await member(newcomer)
        # A member joins while the unsharded leader's transaction is open.
        await old.execute(loop_fence(unsharded))
        joining = asyncio.ensure_future(newcomer.fetch(SUPERSEDE, "plugin", ["plugin"]))
        pid = newcomer.get_server_pid()
        await until(lambda: waits_on_a_lock(pool, pid), "the join to wait", 10)
        await old.execute("INSERT INTO fenced_writes VALUES ('unsharded', 1)")
        await old.execute("COMMIT")
        assert [r["loop"] for r in await asyncio.wait_for(joining, 10)] == ["plugin"]
        with pytest.raises(asyncpg.PostgresError) as refused:
            await old.execute(loop_fence(unsharded))
        assert refused.value.sqlstate == "SDF01"
        await old.execute("ROLLBACK")

        # The member's transaction is open when an unsharded leader takes over.
        owned = {0: await draw(pool, "plugin/0"), 1: await draw(pool, "plugin/1")}
        assert await superseded_shards(newcomer, owned) == set()
        taking = asyncio.ensure_future(old.fetch(SUPERSEDE, "plugin", None))
        pid = old.get_server_pid()
        await until(lambda: waits_on_a_lock(pool, pid), "the takeover to wait", 10)
        await newcomer.execute("INSERT INTO fenced_writes VALUES ('member', 1)")
        await newcomer.execute("COMMIT")
        superseded = {r["loop"] for r in await asyncio.wait_for(taking, 10)}
        assert {"plugin/0", "plugin/1"} <= superseded
        assert "plugin/key_2a" not in superseded
        assert "plugin" not in superseded
        assert await superseded_shards(newcomer, owned) == {0, 1}
        assert (
            await pool.fetchval("SELECT token FROM scheduler_fencing WHERE loop = 'plugin/key_2a'")
            == other_deployment
        )
        assert await writes(pool) == [("member", 1), ("unsharded", 1)]
    finally:
        await pool.release(old)
        await pool.release(newcomer)
