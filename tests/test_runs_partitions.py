"""The run history on PostgreSQL: partitioned by day of slot, kept by whole days, moved out
of a pre-partitioning table without long locks (migration 0012, issue 30).

The upkeep is one function, ``scheduler_runs_maintain``, called by the built-in task
purge_runs a step at a time (plugins/retention.py); these tests call it as the daemon
does, through ``PluginStore.maintain_history``, and look at the catalog.
"""

from __future__ import annotations

import asyncio
import os
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest
from rig.databases import RIG_APP, migrate, migrate_up_to
from rig.sql import aexecute, afetch

from scheduler_daemon.db.plugin_store import HistoryStep
from scheduler_daemon.plugins.retention import AHEAD_DAYS

DAY = timedelta(days=1)
WEEK = 7 * 86400.0


def day_of(moment: datetime) -> datetime:
    return moment.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)


def part(day: datetime) -> str:
    return f"scheduler_plugin_runs_{day:%Y%m%d}"


async def partitions(url: str) -> set[str]:
    rows = await afetch(
        url,
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
        "WHERE i.inhparent = 'scheduler_plugin_runs'::regclass",
    )
    return {row["relname"] for row in rows}


async def step(
    url: str, *, keep: float = WEEK, ahead: int = AHEAD_DAYS, batch: int = 1000, lock_ms: int = 100
) -> HistoryStep:
    [row] = await afetch(
        url, "SELECT * FROM scheduler_runs_maintain($1, $2, $3, $4)", keep, ahead, batch, lock_ms
    )
    return HistoryStep(row["action"], row["target"], row["rows"])


async def until_idle(url: str, **kwargs: float) -> list[HistoryStep]:
    steps: list[HistoryStep] = []
    for _ in range(1000):
        done = await step(url, **kwargs)  # type: ignore[arg-type]
        steps.append(done)
        if done.action in ("idle", "busy", "blocked"):
            return steps
    raise AssertionError(f"the upkeep never came to rest: {steps[-5:]}")


async def add_run(url: str, name: str, slot: datetime, status: str = "succeeded") -> None:
    await afetch(
        url,
        "INSERT INTO scheduler_plugin_runs (name, slot, instance, started_at, status) "
        "VALUES ($1, $2, 'test', $2, $3)",
        name,
        slot,
        status,
    )


async def where(url: str, name: str) -> str:
    [row] = await afetch(
        url, "SELECT tableoid::regclass::text AS t FROM scheduler_plugin_runs WHERE name = $1", name
    )
    return str(row["t"])


async def test_runs_land_in_their_days_made_ahead_and_strays_in_the_default(pg_url: str) -> None:
    today = day_of(datetime.now(UTC))
    await until_idle(pg_url)
    made = await partitions(pg_url)
    assert {part(today + i * DAY) for i in range(AHEAD_DAYS + 1)} <= made
    assert "scheduler_plugin_runs_default" in made
    await add_run(pg_url, "now", datetime.now(UTC))
    await add_run(pg_url, "long-ago", today - 400 * DAY)
    assert await where(pg_url, "now") == part(today)
    assert await where(pg_url, "long-ago") == "scheduler_plugin_runs_default"
    # More days ahead when asked: the upkeep makes one per step.
    steps = await until_idle(pg_url, ahead=AHEAD_DAYS + 2)
    assert [s.action for s in steps if s.action != "purged"] == ["created", "created", "idle"]
    assert part(today + (AHEAD_DAYS + 2) * DAY) in await partitions(pg_url)


async def test_a_day_goes_whole_once_older_than_the_max_age_and_strays_by_age(
    pg_url: str,
) -> None:
    old_day = day_of(datetime.now(UTC)) - 30 * DAY
    await aexecute(
        pg_url,
        f"CREATE TABLE {part(old_day)} PARTITION OF scheduler_plugin_runs "
        f"FOR VALUES FROM ('{old_day.isoformat()}') TO ('{(old_day + DAY).isoformat()}')",
    )
    for i in range(50):
        await add_run(pg_url, f"old-{i}", old_day + timedelta(minutes=i))
    await add_run(pg_url, "stray", old_day - 10 * DAY)  # no day of its own: the default
    await add_run(pg_url, "stray-young", datetime.now(UTC) - 20 * DAY)
    await aexecute(pg_url, f"ANALYZE {part(old_day)}")
    steps = await until_idle(pg_url, keep=21 * 86400.0)
    assert HistoryStep("dropped", part(old_day), 50) in steps
    assert HistoryStep("purged", "scheduler_plugin_runs_default", 1) in steps
    assert part(old_day) not in await partitions(pg_url)
    names = {r["name"] for r in await afetch(pg_url, "SELECT name FROM scheduler_plugin_runs")}
    assert names == {"stray-young"}


async def test_a_day_with_a_run_in_flight_stays_until_it_ends(pg_url: str) -> None:
    """A run still going (a long one, or a late slot) keeps its day: dropping it would
    lose the row its result is written to."""
    old_day = day_of(datetime.now(UTC)) - 30 * DAY
    await aexecute(
        pg_url,
        f"CREATE TABLE {part(old_day)} PARTITION OF scheduler_plugin_runs "
        f"FOR VALUES FROM ('{old_day.isoformat()}') TO ('{(old_day + DAY).isoformat()}')",
    )
    await add_run(pg_url, "going", old_day + timedelta(hours=1), status="running")
    await add_run(pg_url, "done", old_day + timedelta(hours=2))
    steps = await until_idle(pg_url)
    assert not [s for s in steps if s.target == part(old_day)], steps
    await afetch(
        pg_url, "UPDATE scheduler_plugin_runs SET status = 'succeeded' WHERE name = 'going'"
    )
    steps = await until_idle(pg_url)
    assert HistoryStep("dropped", part(old_day), 2) in steps


async def test_the_upkeep_refuses_numbers_out_of_range(pg_url: str) -> None:
    """Its caller may drop its own history, as it may delete it, but not make a thousand
    tables or wait on locks for ever."""
    for keep, ahead, batch, lock_ms in ((0, 2, 10, 100), (WEEK, 1000, 10, 100),
                                        (WEEK, 2, 10**7, 100), (WEEK, 2, 10, 0)):  # fmt: skip
        with pytest.raises(asyncpg.RaiseError, match="out of range"):
            await step(pg_url, keep=keep, ahead=ahead, batch=batch, lock_ms=lock_ms)


async def test_a_past_day_the_count_emptied_goes_and_one_with_a_run_stays(pg_url: str) -> None:
    today = day_of(datetime.now(UTC))
    days = [today - 3 * DAY, today - 2 * DAY]
    for day in days:
        await aexecute(
            pg_url,
            f"CREATE TABLE {part(day)} PARTITION OF scheduler_plugin_runs "
            f"FOR VALUES FROM ('{day.isoformat()}') TO ('{(day + DAY).isoformat()}')",
        )
        await add_run(pg_url, f"run-{day:%d}", day + timedelta(hours=1))
    # The per-task count trimmed the first day's only run; vacuum saw it empty.
    await afetch(pg_url, "DELETE FROM scheduler_plugin_runs WHERE name = $1", f"run-{days[0]:%d}")
    await aexecute(pg_url, f"VACUUM {part(days[0])}", f"VACUUM {part(days[1])}")
    steps = await until_idle(pg_url)
    assert HistoryStep("emptied", part(days[0]), 0) in steps
    assert {part(days[0]), part(days[1])} & await partitions(pg_url) == {part(days[1])}


async def test_a_day_with_rows_in_the_default_is_skipped_until_they_age_out(pg_url: str) -> None:
    """The default partition holding a row of a day would make that day's partition refuse
    to attach: the day is reported blocked and skipped, the later days still made."""
    today = day_of(datetime.now(UTC))
    far = today + (AHEAD_DAYS + 1) * DAY
    await add_run(pg_url, "early", far + timedelta(hours=2), status="running")
    steps = await until_idle(pg_url, ahead=AHEAD_DAYS + 2)
    assert HistoryStep("created", part(far + DAY), 0) in steps
    assert steps[-1] == HistoryStep("blocked", part(far), 0), "said when all else is done"
    assert part(far) not in await partitions(pg_url)
    assert await where(pg_url, "early") == "scheduler_plugin_runs_default"


async def test_a_drop_that_cannot_lock_at_once_gives_up_and_blocks_no_one(pg_url: str) -> None:
    """A transaction reading the history (a long dashboard query, a transaction-mode hold)
    keeps a day from being dropped: the step gives up after its lock timeout, says busy,
    and the statements behind it were never queued for longer."""
    old_day = day_of(datetime.now(UTC)) - 30 * DAY
    await aexecute(
        pg_url,
        f"CREATE TABLE {part(old_day)} PARTITION OF scheduler_plugin_runs "
        f"FOR VALUES FROM ('{old_day.isoformat()}') TO ('{(old_day + DAY).isoformat()}')",
    )
    reader = await asyncpg.connect(pg_url, server_settings=RIG_APP)
    try:
        reader_tx = reader.transaction()
        await reader_tx.start()
        await reader.fetch("SELECT count(*) FROM scheduler_plugin_runs")
        writer = asyncio.create_task(step(pg_url, lock_ms=300))
        await asyncio.sleep(0.1)  # the step waits for its lock now
        # Behind the waiting step, a write of a run goes through once the step gives up.
        await add_run(pg_url, "written", datetime.now(UTC))
        assert (await writer) == HistoryStep("busy", part(old_day), 0)
        await reader_tx.rollback()
    finally:
        await reader.close()
    assert part(old_day) in await partitions(pg_url)
    steps = await until_idle(pg_url)
    assert HistoryStep("dropped", part(old_day), 0) in steps


@pytest.mark.parametrize("rows", [0, 5000])
async def test_a_history_from_before_partitioning_moves_in_batches(
    pg_empty_url: str, rows: int
) -> None:
    """Migrated from 0011 with a history in place: its running runs move with the
    migration; the rest moves in batches (older than the max age: deleted), the old
    table goes once empty, and ids go on from where they were."""
    conn = await asyncpg.connect(pg_empty_url, server_settings=RIG_APP)
    try:
        async with conn.transaction():
            await migrate_up_to(conn, 11)
        now = datetime.now(UTC)
        await conn.execute(
            "INSERT INTO scheduler_plugin_runs (name, slot, instance, started_at, status) "
            "SELECT 'r' || i, $1::timestamptz - i * interval '1 minute', 'old', "
            "$1::timestamptz - i * interval '1 minute', "
            "'succeeded' FROM generate_series(1, $2) i",
            now,
            rows,
        )
        await conn.execute(
            "INSERT INTO scheduler_plugin_runs (name, slot, instance, status) "
            "VALUES ('in-flight', $1, 'old', 'running')",
            now,
        )
        [before] = await conn.fetch("SELECT max(id) AS id FROM scheduler_plugin_runs")
        role = f"runs_runtime_{rows}_{os.getpid()}"
        await conn.execute(f"DROP ROLE IF EXISTS {role}")
        await conn.execute(f"CREATE ROLE {role}")
        await conn.execute(
            f"GRANT SELECT, INSERT, UPDATE, DELETE ON scheduler_plugin_runs TO {role}"
        )
    finally:
        await conn.close()
    await asyncio.to_thread(migrate, pg_empty_url)  # `scheduler-daemon migrate`: 0012
    # The runtime role of docs/security.md keeps its grants on the history, and may call
    # the upkeep that purge_runs now runs.
    [grants] = await afetch(
        pg_empty_url,
        "SELECT has_table_privilege($1, 'scheduler_plugin_runs', 'DELETE') AS runs, "
        "has_function_privilege($1, 'scheduler_runs_maintain(float8, integer, integer, "
        "integer)', 'EXECUTE') AS upkeep",
        role,
    )
    await aexecute(pg_empty_url, f"DROP OWNED BY {role}", f"DROP ROLE {role}")
    assert grants == {"runs": True, "upkeep": True}
    [flight] = await afetch(
        pg_empty_url,
        "SELECT tableoid::regclass::text AS t, status FROM "
        "scheduler_plugin_runs WHERE name = 'in-flight'",
    )
    assert flight == {"t": part(day_of(datetime.now(UTC))), "status": "running"}
    legacy = await afetch(pg_empty_url, "SELECT to_regclass('scheduler_plugin_runs_0011') AS t")
    if rows == 0:
        assert legacy == [{"t": None}], "nothing to move: the old table went with the migration"
        return
    assert legacy != [{"t": None}]
    steps = await until_idle(pg_empty_url, keep=3 * 86400.0, batch=1000)
    moved = [s for s in steps if s.action == "moved"]
    assert len(moved) == 5, steps  # 1,000 a step
    young = sum(s.rows for s in moved)  # one a minute: those younger than 3 days
    assert 3 * 24 * 60 - 10 <= young < 3 * 24 * 60, steps
    assert HistoryStep("dropped", "scheduler_plugin_runs_0011", 0) in steps
    [count] = await afetch(pg_empty_url, "SELECT count(*) AS n FROM scheduler_plugin_runs")
    assert count["n"] == young + 1
    await add_run(pg_empty_url, "new", datetime.now(UTC))
    [new] = await afetch(pg_empty_url, "SELECT id FROM scheduler_plugin_runs WHERE name = 'new'")
    assert new["id"] > before["id"]
