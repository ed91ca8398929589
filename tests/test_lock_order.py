"""Row lock order on PostgreSQL: the plugin leader's multi-row writes of
scheduler_plugin_tasks lock their rows in name order (db/postgres.sql, "Row locks"), so a
bulk change that locks in name order too (docs/operations.md, "Changing many schedules in
one statement") never deadlocks with them: one waits for the other.

Each test makes the interleaving that deadlocks two statements locking in different
orders, deterministically, by the server's lock table rather than by sleeps: an operator's
transaction holds the first schedule in name order; the leader's statement, over a batch
listed (and stored) in the reverse order, starts and is seen waiting on it; then the
operator's documented bulk statement runs over all of them. Locking in the batch's order
(the statements before "Row locks"), the leader's statement held every other row by then,
and PostgreSQL aborted it (`deadlock detected`), in each test here. In name order it holds
none of them (checked: no row of the table carries its transaction id), the bulk change
goes through and commits, and the leader's statement then does all it did before, on top
of that change.

Where the leader's own statement is the one aborted (a deadlock with some other order, or
any error), tests/test_plugin_loop.py shows that nothing is lost:
test_a_result_write_aborted_by_a_deadlock_is_written_on_retry and
test_a_claim_aborted_by_a_deadlock_is_claimed_again.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from rig.databases import RIG_APP
from rig.waiting import until

from scheduler_daemon.client import Client
from scheduler_daemon.config.settings import Settings
from scheduler_daemon.db.base import Store
from scheduler_daemon.db.plugin_store import Claim, Declaration, PluginStore, RunResult

pytestmark = pytest.mark.postgres

OPERATIONS_MD = Path(__file__).resolve().parent.parent / "docs" / "operations.md"

# As many schedules as the benchmark's bulk UPDATE that deadlocked with a result batch.
COUNT = 1000
NAMES = [f"bulk-{i:04d}" for i in range(COUNT)]  # name order
REVERSED = NAMES[::-1]
FIRST = NAMES[0]


def bulk_sql(change: str | None = None) -> str:
    """docs/operations.md's bulk statement, on this test's schedules; ``change``: another
    SET list than the documented pause."""
    text = OPERATIONS_MD.read_text()
    match = re.search(r"<!-- bulk-sql -->\s*```sql\n(.*?)```", text, re.S)
    assert match, "docs/operations.md has no bulk-sql block"
    sql = match[1].strip().rstrip(";").replace("'feed-%'", "'bulk-%'")
    if change is not None:
        sql = sql.replace("SET paused = true, updated_at = now()", f"SET {change}")
    assert "'bulk-%'" in sql, sql
    assert change is None or change in sql, sql
    return sql


@pytest.fixture
async def store(pg_url: str) -> AsyncIterator[Store]:
    async with Client.connect(Settings(database_url=pg_url)) as client:
        yield client.store


Connect = Callable[[], Awaitable[asyncpg.Connection]]


@pytest.fixture
async def connect(pg_url: str) -> AsyncIterator[Connect]:
    """Connections of the test's own (the operator's, the one that watches), closed after."""
    connections: list[asyncpg.Connection] = []

    async def new() -> asyncpg.Connection:
        connections.append(await asyncpg.connect(pg_url, server_settings=RIG_APP))
        return connections[-1]

    yield new
    for each in connections:
        await each.close()


async def schedules(store: Store, **columns: Any) -> datetime:
    """COUNT declared tasks' rows, written in the reverse of name order (so that a scan of
    the table meets them in that order too), due 5 s ago; their slot."""
    async with store.transaction() as tx:
        now: datetime = (await tx.fetch("now"))[0]["now"]
        slot = now - timedelta(seconds=5)
        await tx.run(
            "INSERT INTO scheduler_plugin_tasks (name, schedule, next_run_at, source) "
            "SELECT name, 'every 10s', $2, 'config' FROM unnest($1::text[]) AS n(name)",
            REVERSED,
            slot,
        )
        for column, value in columns.items():
            await tx.run(f"UPDATE scheduler_plugin_tasks SET {column} = $1", value)
    return slot


def claims(slot: datetime) -> list[Claim]:
    return [Claim(n, slot, slot + timedelta(seconds=10), run_slot=slot) for n in REVERSED]


# Rows of scheduler_plugin_tasks that backend $1's transaction has locked or changed: their
# xmax is its transaction id.
HELD_ROWS = """
SELECT count(*) FROM scheduler_plugin_tasks t JOIN pg_stat_activity a ON t.xmax = a.backend_xid
WHERE a.pid = $1
"""


async def beside_a_bulk_change(
    store: Store,
    connect: Connect,
    statement: Callable[[PluginStore], Awaitable[Any]],
    bulk: str,
) -> tuple[Any, str]:
    """Run the leader's ``statement`` while an operator's transaction holds FIRST; once
    the server shows it waiting on that transaction, run ``bulk`` there and commit. The
    statement's result, and the bulk statement's status. Waiting for the first row in
    name order, the statement must hold no other row of the table."""
    operator, watcher = await connect(), await connect()
    pid: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def leader() -> Any:
        async with store.transaction() as tx:
            pid.set_result(tx.conn.get_server_pid())  # type: ignore[attr-defined]
            return await statement(PluginStore(tx))

    async with operator.transaction():
        await operator.execute(
            "SELECT 1 FROM scheduler_plugin_tasks WHERE name = $1 FOR UPDATE", FIRST
        )
        running = asyncio.create_task(leader())
        try:
            backend = await asyncio.wait_for(pid, 30)

            async def waits_on_the_operator() -> bool:
                blockers = await watcher.fetchval("SELECT pg_blocking_pids($1)", backend)
                if running.done():  # never waited: say why
                    running.result()
                    raise AssertionError("the leader's statement did not wait for the operator")
                return operator.get_server_pid() in blockers

            await until(waits_on_the_operator, "the leader's statement waiting on the operator's")
            held = await watcher.fetchval(HELD_ROWS, backend)
            status = await operator.execute(bulk)
        except BaseException:
            running.cancel()
            await asyncio.wait({running})
            raise
    result = await asyncio.wait_for(running, 60)
    assert held == 0, f"waiting for {FIRST}, the leader's statement held {held} other rows"
    return result, status


async def tasks(store: Store) -> list[dict[str, Any]]:
    async with store.transaction(readonly=True) as tx:
        rows = await tx.conn.fetch(  # type: ignore[attr-defined]
            "SELECT * FROM scheduler_plugin_tasks WHERE name LIKE 'bulk-%' ORDER BY name"
        )
    return [dict(row) for row in rows]


async def runs(store: Store) -> list[dict[str, Any]]:
    async with store.transaction(readonly=True) as tx:
        rows = await tx.conn.fetch(  # type: ignore[attr-defined]
            "SELECT id, name, slot, status FROM scheduler_plugin_runs ORDER BY name"
        )
    return [dict(row) for row in rows]


async def test_a_result_batch_beside_a_bulk_pause(store: Store, connect: Connect) -> None:
    """The write of COUNT results (the runs' rows, then their schedules'), listed in the
    reverse of name order, beside the documented bulk pause: both go through, the results
    are written, and the pause stays."""
    slot = await schedules(store)
    async with store.transaction() as tx:
        claimed = (await PluginStore(tx).claim("r1", claims(slot))).runs
    assert len(claimed) == COUNT
    by_name = {run.name: run for run in claimed}
    now = slot + timedelta(seconds=1)
    results = [RunResult(by_name[n].id, n, slot, "succeeded", None, now) for n in REVERSED]

    finished, status = await beside_a_bulk_change(
        store,
        connect,
        lambda plugin: plugin.finish(results, max_failures=3, trim_every=100),
        bulk_sql(),
    )

    assert status == f"UPDATE {COUNT}"
    assert sorted(f.name for f in finished) == NAMES
    assert all(f.paused for f in finished), "written on top of the pause, which stays"
    assert {r["status"] for r in await runs(store)} == {"succeeded"}
    rows = await tasks(store)
    assert all(r["paused"] and r["last_status"] == "succeeded" for r in rows)


@pytest.mark.parametrize(
    ("change", "claimed_after"),
    [
        # The claim compares and sets: a schedule paused after the tick's read is not
        # claimed (it waited for the pause, then found the row changed).
        (None, 0),
        # A change the claim does not compare: every schedule is claimed.
        ("args = '{\"bulk\": true}', updated_at = now()", COUNT),
    ],
    ids=["pause", "args"],
)
async def test_a_claim_beside_a_bulk_change(
    store: Store, connect: Connect, change: str | None, claimed_after: int
) -> None:
    slot = await schedules(store)

    async def claim(plugin: PluginStore) -> list[Any]:
        return (await plugin.claim("r1", claims(slot))).runs

    claimed, status = await beside_a_bulk_change(store, connect, claim, bulk_sql(change))

    assert status == f"UPDATE {COUNT}"
    assert len(claimed) == claimed_after
    rows = await tasks(store)
    if claimed_after:
        assert all(r["args"] == {"bulk": True} for r in rows), "the change stays"
        assert all(r["next_run_at"] == slot + timedelta(seconds=10) for r in rows)
        assert len(await runs(store)) == COUNT
    else:
        assert all(r["paused"] and r["next_run_at"] == slot for r in rows), "the pause won"
        assert await runs(store) == []


async def test_a_refusal_beside_a_bulk_change(store: Store, connect: Connect) -> None:
    await schedules(store)
    refused = {name: f"cannot run {name}" for name in REVERSED}
    _, status = await beside_a_bulk_change(
        store, connect, lambda plugin: plugin.refuse(refused), bulk_sql("updated_at = now()")
    )
    assert status == f"UPDATE {COUNT}"
    rows = await tasks(store)
    assert all(r["paused"] and r["last_error"] == f"cannot run {r['name']}" for r in rows)


async def test_the_end_of_trims_beside_a_bulk_change(store: Store, connect: Connect) -> None:
    await schedules(store, history_trim_due=True)
    _, status = await beside_a_bulk_change(
        store, connect, lambda plugin: plugin.trims_done(REVERSED), bulk_sql()
    )
    assert status == f"UPDATE {COUNT}"
    rows = await tasks(store)
    assert all(r["paused"] and not r["history_trim_due"] for r in rows)


async def test_a_declaration_beside_a_bulk_change(store: Store, connect: Connect) -> None:
    """A new leader's declaration: every other schedule rescheduled (a new schedule), the
    rest retired (no longer declared), each kind over the whole range of names."""
    slot = await schedules(store)
    first = slot + timedelta(minutes=1)
    declared = [Declaration(n, "every 20s", first, "config") for n in REVERSED[::2]]

    changes, status = await beside_a_bulk_change(
        store, connect, lambda plugin: plugin.declare(declared), bulk_sql()
    )

    assert status == f"UPDATE {COUNT}"
    assert sorted((c.name, c.change) for c in changes) == [
        (n, "rescheduled" if i % 2 else "retired") for i, n in enumerate(NAMES)
    ]
    rows = await tasks(store)
    assert all(r["paused"] for r in rows)
    assert all(r["active"] == (i % 2 == 1) for i, r in enumerate(rows))
