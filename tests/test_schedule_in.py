"""Scheduling inside the application's own transaction (``schedule_in``/``cancel_in`` on an
asyncpg connection it holds): a post and its publication commit together or not at all,
with the validation of ``Client.schedule``, and a committed one is published by a
running daemon, woken by the NOTIFY that PostgreSQL delivers at commit."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest
from rig.processes import Daemons

from scheduler_daemon.client import (
    Client,
    cancel_in,
    ignored_changes,
    schedule_in,
)
from scheduler_daemon.config.settings import Settings
from scheduler_daemon.errors import InvalidInput, NotFound

pytestmark = pytest.mark.postgres

POSTS = """
CREATE TABLE posts (
    id     bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    title  text NOT NULL,
    status text NOT NULL DEFAULT 'draft'
)
"""


@pytest.fixture
async def conn(pg_url: str) -> AsyncIterator[asyncpg.Connection]:
    """The application's own connection (no codecs of ours), with its own `posts` table."""
    connection = await asyncpg.connect(pg_url)
    try:
        await connection.execute(POSTS)
        yield connection
    finally:
        await connection.close()


async def publications(url: str) -> list[dict[str, Any]]:
    """What everyone else sees, on a connection of its own."""
    other = await asyncpg.connect(url)
    try:
        rows = await other.fetch("SELECT * FROM scheduler_publications ORDER BY id")
    finally:
        await other.close()
    return [dict(row) for row in rows]


async def test_a_rolled_back_transaction_leaves_no_publication(
    conn: asyncpg.Connection, pg_url: str
) -> None:
    at = datetime.now(UTC) + timedelta(hours=1)
    transaction = conn.transaction()
    await transaction.start()
    post = await conn.fetchval("INSERT INTO posts (title) VALUES ('hi') RETURNING id")
    result = await schedule_in(conn, at, {"post": post}, key=f"post-{post}")
    assert result.created
    assert result.publication.payload == {"post": post}
    assert result.publication.publish_at == at
    assert result.publication.status == "scheduled"
    # Inside the transaction it is there; outside, not yet.
    assert await conn.fetchval("SELECT count(*) FROM scheduler_publications") == 1
    assert await publications(pg_url) == []
    await transaction.rollback()
    assert await publications(pg_url) == []
    assert await conn.fetchval("SELECT count(*) FROM posts") == 0


async def test_a_committed_transaction_schedules_both(
    conn: asyncpg.Connection, pg_url: str
) -> None:
    at = datetime.now(UTC) + timedelta(hours=1)
    async with conn.transaction():
        post = await conn.fetchval("INSERT INTO posts (title) VALUES ('hi') RETURNING id")
        result = await schedule_in(conn, at, {"post": post}, key=f"post-{post}")
    [row] = await publications(pg_url)
    assert row["id"] == result.publication.id
    assert json.loads(row["payload"]) == {"post": post}
    assert row["key"] == f"post-{post}"
    # And the daemon's own API reads it back as it reads its own.
    async with Client.connect(Settings(database_url=pg_url)) as client:
        assert await client.get(result.publication.id) == result.publication


async def test_a_pooled_connection_works_too(pg_url: str) -> None:
    pool = await asyncpg.create_pool(pg_url, min_size=1, max_size=1)
    try:
        async with pool.acquire() as pooled, pooled.transaction():
            result = await schedule_in(pooled, datetime.now(UTC) + timedelta(hours=1), [1, 2])
    finally:
        await pool.close()
    assert result.created
    assert [row["id"] for row in await publications(pg_url)] == [result.publication.id]


async def test_a_repeated_key_returns_the_first_publication(conn: asyncpg.Connection) -> None:
    at = datetime.now(UTC) + timedelta(hours=1)
    async with conn.transaction():
        first = await schedule_in(conn, at, {"v": 1}, key="post-1")
        same = await schedule_in(conn, at, {"v": 1}, key="post-1")
        other = await schedule_in(conn, at + timedelta(hours=1), {"v": 2}, key="post-1")
    assert first.created
    assert not same.created
    assert not other.created
    assert same.publication == other.publication == first.publication
    assert ignored_changes(same, at, {"v": 1}) == []
    assert ignored_changes(other, at + timedelta(hours=1), {"v": 2}) == ["publish_at", "payload"]


NAIVE = datetime(2030, 1, 1, 9, 0)
SOON = datetime(2030, 1, 1, 9, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("at", "payload", "key"),
    [
        (NAIVE, {}, None),  # no timezone
        (SOON, {"x": "y" * 200}, None),  # over max_payload_bytes (100 here)
        (SOON, {1, 2}, None),  # a set: not JSON
        (SOON, {"x": math.nan}, None),  # NaN: not JSON
        (SOON, {}, "   "),  # a blank key
    ],
    ids=["naive", "oversize", "set", "nan", "blank-key"],
)
async def test_refused_like_client_schedule_and_the_transaction_stays_usable(
    conn: asyncpg.Connection, pg_url: str, at: datetime, payload: Any, key: str | None
) -> None:
    settings = Settings(database_url=pg_url, publish={"max_payload_bytes": 100})
    async with Client.connect(settings) as client:
        with pytest.raises(InvalidInput) as by_client:
            await client.schedule(at, payload, key=key)
    async with conn.transaction():
        await conn.execute("INSERT INTO posts (title) VALUES ('kept')")
        with pytest.raises(InvalidInput) as in_transaction:
            await schedule_in(conn, at, payload, key=key, max_payload_bytes=100)
        # Nothing was sent: the transaction is not aborted and goes on to commit.
        assert await conn.fetchval("SELECT 1") == 1
    assert str(in_transaction.value) == str(by_client.value)
    assert await conn.fetchval("SELECT count(*) FROM posts") == 1
    assert await publications(pg_url) == []


async def test_only_an_asyncpg_connection_is_taken(pg_url: str) -> None:
    with pytest.raises(TypeError, match="needs an asyncpg connection, not str"):
        await schedule_in(pg_url, SOON, {})
    with pytest.raises(TypeError, match="needs an asyncpg connection"):
        await cancel_in(object(), 1)


async def test_outside_a_transaction_nothing_is_sent(conn: asyncpg.Connection, pg_url: str) -> None:
    """Refused, not autocommitted: an application that meant "with my transaction" (an
    SQLAlchemy session that has not run a statement yet has none open) must not get a
    publication that outlives its rollback."""
    with pytest.raises(RuntimeError, match=r"needs a transaction open on the connection"):
        await schedule_in(conn, SOON, {}, key="alone")
    with pytest.raises(RuntimeError, match=r"needs a transaction open on the connection"):
        await cancel_in(conn, 1)
    assert await publications(pg_url) == []


async def test_cancel_in_follows_the_transaction(conn: asyncpg.Connection, pg_url: str) -> None:
    async with conn.transaction():
        result = await schedule_in(conn, datetime.now(UTC) + timedelta(hours=1), {}, key="c")
    publication = result.publication.id
    transaction = conn.transaction()
    await transaction.start()
    cancelled = await cancel_in(conn, publication)
    assert cancelled.status == "cancelled"
    await transaction.rollback()
    [row] = await publications(pg_url)
    assert row["status"] == "scheduled", "a rolled-back cancel changes nothing"
    async with conn.transaction():
        await cancel_in(conn, publication)
    [row] = await publications(pg_url)
    assert row["status"] == "cancelled"
    async with conn.transaction():
        with pytest.raises(InvalidInput, match="is cancelled, not scheduled"):
            await cancel_in(conn, publication)
        with pytest.raises(NotFound, match="no publication with id 99999"):
            await cancel_in(conn, 99999)


async def test_a_running_daemon_publishes_a_committed_one_woken_at_commit(
    daemons: Daemons, pg_url: str, conn: asyncpg.Connection
) -> None:
    """The CMS case end to end: a draft post and its publication are saved in one
    transaction; the daemon's `sql` publisher flips the post when it publishes. The
    daemon polls only every 60 s, so publishing within seconds of the commit means the
    trigger's NOTIFY woke it, and PostgreSQL delivers that only at commit."""
    process = daemons.start(
        {
            "SCHEDULER_DATABASE_URL": pg_url,
            "SCHEDULER_INSTANCE_ID": "cms-1",
            "SCHEDULER_LOG__LEVEL": "debug",
            "SCHEDULER_PUBLISH__INTERVAL": "60s",
            "SCHEDULER_PUBLISH__PUBLISHERS": '["sql"]',
            "SCHEDULER_PUBLISH__SQL__STATEMENT": (
                "UPDATE posts SET status = 'published' WHERE id = ANY($1::bigint[])"
            ),
            "SCHEDULER_PUBLISH__SQL__PARAMS": '["$.post"]',
        },
        args=["run", "--only", "publish"],
    )
    # The leader's first tick found nothing and sleeps for the whole interval (None).
    tick = await asyncio.to_thread(process.wait_for_log, "tick.done", 30, loop="publish")
    assert tick["next_in"] is None or tick["next_in"] > 30, tick

    # Rolled back: nothing to publish, ever.
    transaction = conn.transaction()
    await transaction.start()
    post = await conn.fetchval("INSERT INTO posts (title) VALUES ('no') RETURNING id")
    await schedule_in(conn, datetime.now(UTC), {"post": post}, key=f"post-{post}")
    await transaction.rollback()

    async with conn.transaction():
        post = await conn.fetchval("INSERT INTO posts (title) VALUES ('yes') RETURNING id")
        result = await schedule_in(conn, datetime.now(UTC), {"post": post}, key=f"post-{post}")
        # Due already, but not committed: the leader neither sees nor hears of it.
        await asyncio.sleep(1.0)
        assert await publications(pg_url) == []
    committed = time.monotonic()

    while True:
        status = await conn.fetchval("SELECT status FROM posts WHERE id = $1", post)
        if status == "published":
            break
        assert time.monotonic() - committed < 10, "not published: the commit woke no one"
        await asyncio.sleep(0.02)
    assert time.monotonic() - committed < 10
    [row] = await publications(pg_url)
    assert row["id"] == result.publication.id
    assert row["status"] == "published"
    assert row["published_by"] == "cms-1"
    assert await conn.fetchval("SELECT count(*) FROM posts") == 1
    published = [e for e in process.log_events() if e.get("event") == "publish.published"]
    assert sum(e["count"] for e in published) == 1
