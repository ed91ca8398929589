"""The fence's promise where it is not session mode's token fence on the pool (that one is
tests/test_token_fence.py): no transaction of a replaced leader commits after its
successor's first fenced statement. Against a real PostgreSQL, each ordering made to
happen on purpose; the processes-level proof (real replicas, SIGKILL, SIGSTOP,
partitions) is the chaos slice, tests/test_leadership.py and tests/test_shards.py.

- Transaction mode (behind PgBouncer): a leader is a transaction that won the loop's
  transaction-level lock. The next one cannot win it while that transaction is open, and
  while the successor's is open, the old leader's next transaction cannot win either.
- Sharded: a member's fenced transactions are on the pool, fenced by each shard's row
  (tests/test_shard_fence.py has the statement's orderings). With real members: the
  shard's next owner's draw waits for the old owner's open transaction; after it, the old
  owner's next transaction goes on for its other shards only, and a claim scoped by the
  old token claims nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime, timedelta

import asyncpg
import pytest
from rig.waiting import until

from scheduler_daemon.config.settings import Settings
from scheduler_daemon.config.values import DEFAULT_PLUGIN_KEY
from scheduler_daemon.db.base import ShardScope, Store
from scheduler_daemon.db.connect import open_store
from scheduler_daemon.db.plugin_store import Claim, PluginStore
from scheduler_daemon.db.postgres import PgTx
from scheduler_daemon.db.sqlfiles import positional, queries
from scheduler_daemon.leadership import Guard, NotLeader, make_guard
from scheduler_daemon.leadership.shard_lease import MemberLease
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


def claim_of(due: datetime) -> Claim:
    return Claim("s", seen_next=due, next_run_at=due + timedelta(minutes=1), run_slot=due)


async def claimed(pool: asyncpg.Pool, shard: int, token: int, due: datetime) -> list[str]:
    """What a claim of the due schedule, scoped to ``shard`` under ``token``, claims."""
    async with pool.acquire() as conn, conn.transaction():
        tx = PgTx(conn, token, None, ShardScope(SHARDS, {shard: token}))
        return [run.name for run in (await PluginStore(tx).claim("test", [claim_of(due)])).runs]


async def owning(member: MemberLease, count: int) -> None:
    async def owns() -> bool:
        return len(member.active_shards()) == count

    await until(owns, f"{count} shards owned", 30)


@asynccontextmanager
async def two_members(pg_url: str) -> AsyncIterator[tuple[asyncpg.Pool, Guard, Guard]]:
    """Two replicas' sharded guards (SHARDS shards), each on a store of its own, and the
    first one's pool; the stores closed after."""
    settings = Settings(
        database_url=pg_url, plugin={"shards": SHARDS},
        lock={"heartbeat_interval": 0.2, "stop_grace": 0.5, "stall_timeout": 3},
    )  # fmt: skip
    stores = [await open_store(settings), await open_store(settings)]
    try:
        first, second = (guard_on(store, settings) for store in stores)
        yield stores[0].pool, first, second  # type: ignore[attr-defined]
    finally:
        for store in stores:
            await store.close()


async def test_sharded_a_shards_old_owner_commits_nothing_after_its_successor_took_it(
    pg_url: str,
) -> None:
    """Two real members (the guard, its rebalancer and fence). The first holds both
    shards and a fenced transaction for both, open; the second joins and is handed one.
    Its draw waits for that transaction (the fence holds the shard's row FOR SHARE), so
    what the old owner wrote commits first. After the draw, the old owner's next
    transaction for both shards goes on for the one still its own; a claim scoped by the
    moved shard's old token claims nothing."""
    async with two_members(pg_url) as (pool, first, second):
        await pool.execute("CREATE TABLE fenced_writes (who text, n int)")
        due: datetime = await pool.fetchval(
            "INSERT INTO scheduler_plugin_tasks (name, schedule, next_run_at, source) "
            "VALUES ('s', 'every 60s', now() - interval '1 second', 'config') "
            "RETURNING next_run_at"
        )
        async with first.leadership() as member:
            assert isinstance(member, MemberLease)
            await owning(member, SHARDS)
            leases = {lease.shard: lease for lease in member.active_shards()}
            async with member.fenced(list(leases.values()), only_ours=True) as tx:
                assert tx.shards is not None
                assert set(tx.shards.tokens) == set(leases)
                joined = asyncio.ensure_future(_join_and_own(second, 1))
                await until(
                    lambda: a_draw_waits(pool),
                    "the successor's draw to wait for the open transaction",
                    30,
                )
                await tx.run("INSERT INTO fenced_writes VALUES ('old', 1)")
            successor = await asyncio.wait_for(joined, 30)
            [moved] = successor.keys()
            [kept] = set(leases) - {moved}
            async with member.fenced(list(leases.values()), only_ours=True) as tx:
                assert tx.shards is not None
                assert set(tx.shards.tokens) == {kept}, "only the shard still its own"
            assert await claimed(pool, moved, leases[moved].fencing_token, due) == []
            assert successor[moved] > leases[moved].fencing_token
        rows = await pool.fetch("SELECT who, n FROM fenced_writes")
        assert [(r["who"], r["n"]) for r in rows] == [("old", 1)]


async def a_draw_waits(pool: asyncpg.Pool) -> bool:
    return bool(
        await pool.fetchval(
            # A row lock's wait (the fencing row's): the members' watch waits on an
            # advisory lock, and nothing else here waits.
            "SELECT count(*) = 1 FROM pg_stat_activity "
            "WHERE wait_event_type = 'Lock' AND wait_event IN ('transactionid', 'tuple')"
        )
    )


async def _join_and_own(guard: Guard, count: int) -> dict[int, int]:
    """Join as a member, wait for ``count`` shards, leave: each shard's token."""
    async with guard.leadership() as member:
        assert isinstance(member, MemberLease)
        await owning(member, count)
        return {lease.shard: lease.fencing_token for lease in member.active_shards()}


async def test_sharded_the_first_member_of_a_layout_supersedes_every_other_layouts_row(
    pg_url: str,
) -> None:
    """Before it leads anything, the first member of a layout moves every shard's row on,
    and the loop's own: rows of another shard count (shard 5 of 8, which 2 shards never
    draw) or of members gone, whose pooled transactions may outlive their sessions. A
    second member, joining beside it, leaves the shard rows alone."""
    tokens = "SELECT loop, token FROM scheduler_fencing WHERE loop LIKE 'plugin%'"
    async with two_members(pg_url) as (pool, first, second):
        old = {row: await pool.fetchval(DRAW, row, "old") for row in ("plugin", "plugin/5")}
        async with first.leadership() as member:
            assert isinstance(member, MemberLease)
            moved = {r["loop"]: r["token"] for r in await pool.fetch(tokens)}
            assert moved["plugin/5"] != old["plugin/5"]
            assert moved["plugin"] != old["plugin"]
            await owning(member, SHARDS)
            before = {r["loop"]: r["token"] for r in await pool.fetch(tokens)}
            async with second.leadership():
                after = {r["loop"]: r["token"] for r in await pool.fetch(tokens)}
                assert after["plugin/5"] == before["plugin/5"], "a second member moves none"
