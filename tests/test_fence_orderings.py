"""The fence's promise where it is not session mode's token fence on the pool (that one is
tests/test_token_fence.py): no transaction of a replaced leader commits after its
successor's first fenced statement. Against a real PostgreSQL, each ordering made to
happen on purpose; the processes-level proof (real replicas, SIGKILL, SIGSTOP,
partitions) is the chaos slice, tests/test_leadership.py and tests/test_shards.py.

- Transaction mode (behind PgBouncer): a leader is a transaction that won the loop's
  transaction-level lock. The next one cannot win it while that transaction is open, and
  while the successor's is open, the old leader's next transaction cannot win either.
- Sharded: a shard's owner fences on its lock connection, holding the shard's lock at
  transaction level too. A successor cannot take the shard while a transaction of the
  owner is open (a hand-over waits for it); once the successor has drawn the shard's
  token, the old owner's next transaction finds the shard not its own, and a claim
  scoped by the old token claims nothing.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta

import asyncpg
import pytest

from scheduler_daemon.config.settings import Settings
from scheduler_daemon.config.values import DEFAULT_PLUGIN_KEY
from scheduler_daemon.db.base import ShardScope, Store
from scheduler_daemon.db.connect import open_store
from scheduler_daemon.db.plugin_store import Claim, PluginStore
from scheduler_daemon.db.postgres import PgTx
from scheduler_daemon.db.sqlfiles import positional, queries
from scheduler_daemon.leadership import Guard, NotLeader, make_guard
from scheduler_daemon.leadership.shard_keys import ShardKeys
from scheduler_daemon.logs import get_logger
from scheduler_daemon.metrics import Metrics
from scheduler_daemon.schema_gate import SchemaGate

pytestmark = pytest.mark.postgres

Q = queries("postgres")
DRAW, _ = positional("postgres", "fencing_next")  # (loop, instance), as asyncpg takes it
SHARDS = 2


def guard_on(store: Store, settings: Settings) -> Guard:
    return make_guard(
        "plugin", DEFAULT_PLUGIN_KEY, store, settings, get_logger(), Metrics(),
        asyncio.Event(), SchemaGate("postgres"),
    )  # fmt: skip


async def test_transaction_mode_a_leaders_transaction_and_its_successors_never_overlap(
    pg_url: str,
) -> None:
    settings = Settings(database_url=pg_url, lock={"mode": "transaction"})
    stores = [await open_store(settings), await open_store(settings)]
    try:
        pool = stores[0].pool  # type: ignore[attr-defined]
        await pool.execute("CREATE TABLE fenced_writes (who text, n int)")
        a, b = (guard_on(store, settings) for store in stores)
        async with a.leadership() as first, b.leadership() as second:
            async with first.transaction(only_ours=True) as tx:
                await tx.execute("INSERT INTO fenced_writes VALUES ('first', 1)")
                with pytest.raises(NotLeader):
                    async with second.transaction(only_ours=True) as other:
                        await other.execute("INSERT INTO fenced_writes VALUES ('second', 0)")
                replaced = first.fencing_token
            async with second.transaction(only_ours=True) as tx:  # the successor's first
                await tx.execute("INSERT INTO fenced_writes VALUES ('second', 1)")
                with pytest.raises(NotLeader):
                    async with first.transaction(only_ours=True) as other:
                        await other.execute("INSERT INTO fenced_writes VALUES ('first', 2)")
                assert second.fencing_token > replaced
        rows = await pool.fetch("SELECT who, n FROM fenced_writes ORDER BY who, n")
        assert [(r["who"], r["n"]) for r in rows] == [("first", 1), ("second", 1)]
    finally:
        for store in stores:
            await store.close()


async def join(conn: asyncpg.Connection, keys: ShardKeys) -> tuple[int, int, int]:
    """Make ``conn`` a member, as the guard does: the member lock and the loop's key
    shared. The fence's first arguments for it."""
    pid: int = await conn.fetchval("SELECT pg_backend_pid()")
    objid = keys.member_objid(pid)
    signed = objid - 2**32 if objid >= 2**31 else objid
    await conn.execute("SELECT pg_advisory_lock($1, $2)", keys.member_class, signed)
    await conn.execute("SELECT pg_advisory_lock_shared($1)", DEFAULT_PLUGIN_KEY)
    return keys.member_class, objid, keys.shard_class


async def fenced_for(
    conn: asyncpg.Connection, member: tuple[int, int, int], shard: int
) -> list[int]:
    """A member's fence, first statement of its transaction: the shards of those asked
    that it holds (now held by the transaction too)."""
    fence = await conn.fetchrow(Q["shard_fence_begin"], *member, [shard], DEFAULT_PLUGIN_KEY)
    assert fence["member"]
    shards: list[int] = fence["shards"]
    return shards


def claim_of(due: datetime) -> Claim:
    return Claim("s", seen_next=due, next_run_at=due + timedelta(minutes=1), run_slot=due)


async def claimed(conn: asyncpg.Connection, shard: int, token: int, due: datetime) -> list[str]:
    """What a claim of the due schedule, scoped to ``shard`` under ``token``, claims."""
    tx = PgTx(conn, token, None, ShardScope(SHARDS, {shard: token}))
    return [run.name for run in await PluginStore(tx).claim("test", [claim_of(due)])]


async def test_a_shards_old_owner_commits_nothing_after_its_successor_took_it(
    pg_url: str,
) -> None:
    keys = ShardKeys(DEFAULT_PLUGIN_KEY, SHARDS)
    old, new = await asyncpg.connect(pg_url), await asyncpg.connect(pg_url)
    try:
        due: datetime = await old.fetchval(
            "INSERT INTO scheduler_plugin_tasks (name, schedule, next_run_at, source) "
            "VALUES ('s', 'every 60s', now() - interval '1 second', 'config') "
            "RETURNING next_run_at"
        )
        shard: int = await old.fetchval(
            "SELECT shard_hash % $1 FROM scheduler_plugin_tasks WHERE name = 's'", SHARDS
        )
        old_args, new_args = await join(old, keys), await join(new, keys)
        take = "SELECT pg_try_advisory_lock($1, $2)"
        assert await old.fetchval(take, keys.shard_class, shard)
        replaced: int = await old.fetchval(DRAW, f"plugin/{shard}", "old")

        async with old.transaction():
            assert await fenced_for(old, old_args, shard) == [shard]
            # A hand-over lets the session's lock go while this transaction is open: its
            # own hold keeps the shard until it ends.
            await old.execute("SELECT pg_advisory_unlock($1, $2)", keys.shard_class, shard)
            assert not await new.fetchval(take, keys.shard_class, shard)

        assert await new.fetchval(take, keys.shard_class, shard)
        drawn: int = await new.fetchval(DRAW, f"plugin/{shard}", "new")
        assert drawn > replaced
        async with new.transaction():  # the successor's first fenced statement
            assert await fenced_for(new, new_args, shard) == [shard]

        async with old.transaction():
            assert await fenced_for(old, old_args, shard) == [], "not the old owner's now"
            assert await claimed(old, shard, replaced, due) == [], "its old token claims nothing"
        async with new.transaction():
            assert await claimed(new, shard, drawn, due) == ["s"]
    finally:
        await old.close()
        await new.close()
