"""Transaction mode's watched tick transaction, in process against the real PostgreSQL:
what becomes of a tick whose transaction fails to commit, or whose connection is ended
while the tick's publisher is inside a savepoint."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from scheduler_daemon.config.settings import Settings
from scheduler_daemon.config.values import DEFAULT_PUBLISH_KEY
from scheduler_daemon.db.connect import open_store
from scheduler_daemon.db.postgres import PgTx
from scheduler_daemon.leadership import LeadershipLost, Lease, make_guard
from scheduler_daemon.logs import get_logger
from scheduler_daemon.metrics import Metrics
from scheduler_daemon.schema_gate import SchemaGate

pytestmark = pytest.mark.postgres


async def test_a_tick_whose_commit_fails_fails(pg_url: str) -> None:
    """The commit of the tick's transaction is where a deferred constraint (a SQL
    publisher's) or a lost connection shows: the tick must fail then, not count the
    batch as done while nothing committed."""
    settings = Settings(database_url=pg_url, lock={"mode": "transaction"})
    store = await open_store(settings)
    try:
        await store.pool.execute(  # type: ignore[attr-defined]
            "CREATE TABLE parent_t (id int PRIMARY KEY); "
            "CREATE TABLE child_t (parent int REFERENCES parent_t DEFERRABLE INITIALLY DEFERRED)"
        )
        schema = SchemaGate("postgres")
        guard = make_guard(
            "publish", DEFAULT_PUBLISH_KEY, store, settings, get_logger(), Metrics(),
            asyncio.Event(), schema,
        )  # fmt: skip
        async with guard.leadership() as lease:
            with pytest.raises(asyncpg.ForeignKeyViolationError):
                async with lease.transaction() as tx:
                    await tx.execute("INSERT INTO child_t VALUES (1)")
        assert await store.pool.fetchval("SELECT count(*) FROM child_t") == 0  # type: ignore[attr-defined]
    finally:
        await store.close()


async def test_a_tick_whose_connection_ends_inside_a_savepoint_loses_leadership(
    pg_url: str,
) -> None:
    """The hold's connection terminated while the tick's publisher runs in a savepoint:
    the tick is cancelled, and what comes out is the loss, with no cancellation left
    pending on the task (the savepoint's rollback on the dead connection used to replace
    both with the driver's error)."""
    settings = Settings(database_url=pg_url, lock={"mode": "transaction"})
    store = await open_store(settings)
    try:
        guard = make_guard(
            "publish", DEFAULT_PUBLISH_KEY, store, settings, get_logger(), Metrics(),
            asyncio.Event(), SchemaGate("postgres"),
        )  # fmt: skip
        task = asyncio.current_task()
        assert task is not None

        async def tick(lease: Lease) -> None:
            async with lease.transaction() as tx:
                assert isinstance(tx, PgTx)
                backend = await tx.conn.fetchval("SELECT pg_backend_pid()")
                async with tx.savepoint():
                    await store.pool.execute("SELECT pg_terminate_backend($1)", backend)  # type: ignore[attr-defined]
                    await asyncio.sleep(5)  # a publisher awaiting its API

        async with guard.leadership() as lease:
            with pytest.raises(LeadershipLost):
                await tick(lease)
            assert task.cancelling() == 0
        await asyncio.sleep(0.01)  # no stray cancellation lands afterwards
    finally:
        await store.close()
