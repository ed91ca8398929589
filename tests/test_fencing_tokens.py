"""Fencing tokens across what a PostgreSQL server goes through besides a failover (that
one is tests/test_primary_failover.py): a crash, the upgrade from tokens drawn before
migration 0007, and a new cluster whose timelines count from 1 again. The statement under
test is the one the leaders run, ``fencing_next`` (db/postgres.sql); ~2 s in all.
"""

from __future__ import annotations

from typing import Any

import asyncpg
import pytest
from rig.pgcluster import PgCluster

from scheduler_daemon.db.sqlfiles import migrations, positional

pytestmark = pytest.mark.postgres

DRAW, DRAW_PARAMETERS = positional("postgres", "fencing_next")  # as asyncpg takes it
assert DRAW_PARAMETERS == ("loop", "instance")
EPOCH = 1 << 40  # token = epoch * EPOCH + counter
# What fencing_next was before migration 0007: the sequence's value alone.
DRAW_BEFORE_0007 = """
WITH previous AS (SELECT token FROM scheduler_fencing WHERE loop = $1)
INSERT INTO scheduler_fencing AS f (loop, token, instance)
VALUES ($1, nextval(format('scheduler_fencing_%s_seq', $1::text)::regclass), $2)
ON CONFLICT (loop) DO UPDATE SET
    token = EXCLUDED.token, instance = EXCLUDED.instance, changed_at = now()
RETURNING token, (SELECT token FROM previous) AS previous
"""


async def draw(conn: asyncpg.Connection, loop: str = "plugin") -> dict[str, Any]:
    row = await conn.fetchrow(DRAW, loop, "test")
    assert row is not None
    return dict(row)


async def test_a_crash_never_hands_a_fencing_token_out_again(
    pg_cluster: PgCluster, pg_url: str
) -> None:
    """What a sequence alone gets wrong: a token drawn in a transaction still open when
    the server dies (transaction mode runs a tick's work, and a hold's, under the token of
    the transaction that drew it, before it commits), the draw past the sequence's WAL
    log-ahead. Its sequence record was never flushed, so the restarted server's sequence
    gives that value again; the token is larger all the same (the counter's offset grew
    with the server's start time)."""
    conn = await asyncpg.connect(pg_url)
    try:
        committed = await draw(conn)
        cached = await conn.fetchval("SELECT log_cnt FROM scheduler_fencing_plugin_seq")
        await conn.fetchval(
            "SELECT count(nextval('scheduler_fencing_plugin_seq')) FROM generate_series(1, $1)",
            cached,
        )
        await conn.execute("BEGIN")
        in_use = await draw(conn)
        value = await conn.fetchval("SELECT last_value FROM scheduler_fencing_plugin_seq")
        pg_cluster.kill()
    finally:
        conn.terminate()
    pg_cluster.start()
    conn = await asyncpg.connect(pg_url)
    try:
        after = await draw(conn)
        again = await conn.fetchval("SELECT last_value FROM scheduler_fencing_plugin_seq")
        assert again <= value, "the crash did not take the draw back: nothing was tested"
    finally:
        await conn.close()
    assert after["previous"] == committed["token"]  # the open one never committed
    assert after["token"] > in_use["token"] > committed["token"]
    assert after["token"] // EPOCH == in_use["token"] // EPOCH == 1  # timeline 1 still


async def test_tokens_drawn_before_migration_0007_stay_below_every_later_one(
    pg_empty_url: str,
) -> None:
    """A deployment upgrading: its tokens were the sequence's value (here one that has led
    for a long while). The first token after the migration is larger (epoch 1: timeline 1)
    and says the old one was the last committed (transaction mode sees a gap, and waits its
    settle time once); then they go on one by one."""
    conn = await asyncpg.connect(pg_empty_url)
    try:
        await conn.execute(
            "CREATE TABLE scheduler_schema_version (version integer PRIMARY KEY, "
            "name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
        )
        upgrade = next(m for m in migrations("postgres") if m.name == "fencing_epochs")
        for migration in migrations("postgres"):
            if migration.version == upgrade.version:
                await conn.execute("SELECT setval('scheduler_fencing_publish_seq', 123456789)")
                old = await conn.fetchval(DRAW_BEFORE_0007, "publish", "old build")
                assert old == 123456790
            # (One outside a transaction, a statement at a time: db/sqlfiles.py.)
            for statement in [migration.sql] if migration.transactional else migration.statements:
                await conn.execute(statement)
        first = await draw(conn, "publish")
        second = await draw(conn, "publish")
        row = await conn.fetchrow("SELECT * FROM scheduler_fencing WHERE loop = 'publish'")
        # A replica of the old build cannot write its kind of token over the new kind.
        with pytest.raises(asyncpg.CheckViolationError, match="scheduler_fencing_epoch_check"):
            await conn.fetchval(DRAW_BEFORE_0007, "publish", "old build")
    finally:
        await conn.close()
    assert first["previous"] == old
    assert first["token"] > old
    assert first["token"] // EPOCH == 1
    assert second["token"] == first["token"] + 1
    assert second["previous"] == first["token"]
    assert (row["epoch"], row["timeline"]) == (1, 1)


async def test_a_new_cluster_counting_timelines_from_1_again_keeps_tokens_growing(
    pg_url: str,
) -> None:
    """pg_upgrade, or a restore into a new cluster, starts over at timeline 1 with the
    scheduler's rows as the old cluster left them: there the last token was drawn on
    timeline 5. The epoch grows by the new timeline instead of going back, and stays
    put while the timeline does."""
    conn = await asyncpg.connect(pg_url)
    try:
        here = await draw(conn)
        counter = here["token"] % EPOCH
        await conn.execute(
            "UPDATE scheduler_fencing SET epoch = 5, timeline = 5, token = $1 WHERE loop = 'plugin'",
            5 * EPOCH + counter,
        )
        first = await draw(conn)
        second = await draw(conn)
    finally:
        await conn.close()
    assert first["previous"] == 5 * EPOCH + counter
    assert first["token"] // EPOCH == 6
    assert first["token"] > first["previous"]
    assert second["token"] == first["token"] + 1
