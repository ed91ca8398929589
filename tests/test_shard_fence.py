"""The sharded fence's SQL (db/postgres.sql, shard_fence_*) against a real server: it
reports only shards the session holds (a free one is not taken and called held), and its
restore works with every member key, the largest shard count's included."""

from __future__ import annotations

import asyncpg
import pytest

from scheduler_daemon.config.settings import MAX_SHARDS
from scheduler_daemon.db.sqlfiles import queries
from scheduler_daemon.leadership.shard_keys import ShardKeys

pytestmark = pytest.mark.postgres

Q = queries("postgres")
LOOP_KEY = 0x7B9C5F3E


def holds(rows: list[asyncpg.Record], pid: int, classid: int) -> set[int]:
    return {r["objid"] for r in rows if r["pid"] == pid and r["classid"] == classid}


async def test_the_fence_reports_held_shards_only_and_restores_at_the_largest_count(
    pg_url: str,
) -> None:
    keys = ShardKeys(LOOP_KEY, MAX_SHARDS)
    conn = await asyncpg.connect(pg_url)
    other = await asyncpg.connect(pg_url)
    try:
        pid = await conn.fetchval("SELECT pg_backend_pid()")
        objid = keys.member_objid(pid)
        assert objid >= 2**31, "the largest count's member key is past int4's range"
        signed = objid - 2**32
        await conn.execute("SELECT pg_advisory_lock($1, $2)", keys.member_class, signed)
        await conn.execute("SELECT pg_advisory_lock_shared($1)", LOOP_KEY)
        await conn.execute("SELECT pg_advisory_lock($1, 3)", keys.shard_class)
        args = (keys.member_class, objid, keys.shard_class)
        async with conn.transaction():
            fence = await conn.fetchrow(Q["shard_fence_begin"], *args, [3, 5], LOOP_KEY)
            assert fence["member"] is True
            assert fence["shards"] == [3], "shard 5 is free: not ours, and not taken"
            assert pid in fence["members"]
            # Shard 5 is still free for anyone else while this transaction lasts.
            assert await other.fetchval("SELECT pg_try_advisory_lock($1, 5)", keys.shard_class)
            # What user SQL may do, and the restore after it.
            await conn.execute("SELECT pg_advisory_unlock_all()")
            assert not await conn.fetchval(Q["shard_fence_release"], *args, [3], LOOP_KEY)
            assert await conn.fetchval(Q["shard_fence_retake"], *args, [3], LOOP_KEY) == 3
        rows = await other.fetch(
            "SELECT pid, classid::bigint, objid::bigint FROM pg_locks "
            "WHERE locktype = 'advisory' AND granted AND objsubid = 2"
        )
        assert holds(rows, pid, keys.shard_class) == {3}, "held again after the commit"
        assert holds(rows, pid, keys.member_class) == {objid}
        assert await other.fetchval("SELECT NOT pg_try_advisory_lock($1)", LOOP_KEY), (
            "the loop's key is held shared again: an unsharded leader stays out"
        )
    finally:
        await conn.close()
        await other.close()
