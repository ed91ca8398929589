"""Loops at their edges: no busy-spinning, bad rows written by hand, transient errors."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from pathlib import Path

import asyncpg
import pytest
from rig.processes import Daemons
from rig.sql import fetch, scalar

from scheduler_daemon.db.connect import is_transient

TESTS = str(Path(__file__).resolve().parent)


def ticks(events: list[dict[str, object]], loop: str) -> int:
    return sum(1 for e in events if e.get("event") == "tick.done" and e.get("loop") == loop)


def test_a_full_plugin_loop_waits_for_a_free_place_instead_of_spinning(
    daemons: Daemons, sqlite_url: str
) -> None:
    tasks = [
        {"name": "long", "every": "1h", "target": "plugin_targets:hang"},
        {"name": "due", "every": "1h", "target": "plugin_targets:tick"},
    ]
    process = daemons.start(
        {
            "SCHEDULER_DATABASE_URL": sqlite_url,
            "SCHEDULER_PLUGIN__TASKS": json.dumps(tasks),
            "SCHEDULER_PLUGIN__CONCURRENCY": "1",
            "SCHEDULER_PLUGIN__DISABLED": '["purge_publications", "purge_runs"]',
            "SCHEDULER_PLUGIN__INTERVAL": "1s",
            "SCHEDULER_LOG__LEVEL": "debug",
            "PYTHONPATH": TESTS,
        },
        args=["run", "--only", "plugin"],
    )
    process.wait_for_log("task.started")
    time.sleep(3)
    # One place, held by a run that never ends: about one tick a second, not thousands.
    assert ticks(process.log_events(), "plugin") < 10


@pytest.mark.postgres
def test_due_rows_locked_by_the_application_do_not_make_the_leader_spin(
    daemons: Daemons, pg_url: str
) -> None:
    fetch(pg_url, "INSERT INTO scheduler_publications (payload, publish_at) VALUES ('{}', now())")

    async def hold_the_row_then_count() -> int:
        conn = await asyncpg.connect(pg_url)
        try:
            async with conn.transaction():
                await conn.execute("SELECT * FROM scheduler_publications FOR UPDATE")
                process = daemons.start(
                    {"SCHEDULER_DATABASE_URL": pg_url, "SCHEDULER_LOG__LEVEL": "debug"},
                    args=["run", "--only", "publish"],
                )
                await asyncio.to_thread(process.wait_for_log, "tick.done", loop="publish")
                await asyncio.sleep(2)
                count = ticks(process.log_events(), "publish")
            await asyncio.to_thread(
                lambda: process.wait_for_log("publish.published", count=1, timeout=10)
            )
            return count
        finally:
            await conn.close()

    assert asyncio.run(hold_the_row_then_count()) < 15


def test_a_julian_day_row_written_by_hand_publishes_on_sqlite(
    daemons: Daemons, sqlite_url: str
) -> None:
    path = sqlite_url.removeprefix("sqlite:///")
    with sqlite3.connect(path) as conn:
        conn.execute(
            "INSERT INTO scheduler_publications (key, payload, publish_at) "
            "VALUES ('jd', '{}', julianday('now') - 0.0001)"
        )
        conn.execute(
            "INSERT INTO scheduler_publications (key, payload, publish_at) "
            "VALUES ('iso', '{}', strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))"
        )
    daemons.start(
        {"SCHEDULER_DATABASE_URL": sqlite_url, "SCHEDULER_PUBLISH__INTERVAL": "0.2"},
        args=["run", "--only", "publish"],
    )
    deadline = time.monotonic() + 20
    while (
        scalar(sqlite_url, "SELECT count(*) FROM scheduler_publications WHERE status = 'published'")
        < 2
    ):
        assert time.monotonic() < deadline, fetch(
            sqlite_url, "SELECT key, status FROM scheduler_publications"
        )
        time.sleep(0.1)


def test_transient_errors_are_told_apart_from_bad_data() -> None:
    assert is_transient(asyncpg.DeadlockDetectedError("deadlock"))
    assert is_transient(asyncpg.SerializationError("could not serialize"))
    assert is_transient(asyncpg.LockNotAvailableError("lock timeout"))
    assert is_transient(asyncpg.QueryCanceledError("statement timeout"))
    assert is_transient(ConnectionResetError())
    assert is_transient(sqlite3.OperationalError("database is locked"))
    assert not is_transient(asyncpg.CheckViolationError("check"))
    assert not is_transient(asyncpg.UniqueViolationError("dup"))
    assert not is_transient(sqlite3.IntegrityError("CHECK constraint failed"))
    assert not is_transient(ValueError("bad payload"))
