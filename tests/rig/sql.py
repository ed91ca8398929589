"""Ad-hoc SQL against either backend, for tests to arrange and inspect state.

Write PostgreSQL placeholders (``$1``); for SQLite they become ``?1``. Rows come back as
dicts. ``fetch`` is for sync tests (on an event loop of its own, in a thread, so a sync test
whose thread runs Playwright's loop can use it too), ``afetch`` for async ones.
"""

from __future__ import annotations

import asyncio
import re
import sqlite3
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

import aiosqlite
import asyncpg

from rig.databases import RIG_APP, run_sync
from scheduler_daemon.config.url import DatabaseUrl
from scheduler_daemon.db.sqlite import from_db_row, to_db_value

_PLACEHOLDER = re.compile(r"\$(\d+)")


def _sqlite_path(url: str) -> Path:
    return Path(url.removeprefix("sqlite:///"))


def _sqlite_fetch(url: str, sql: str, params: tuple[Any, ...]) -> list[dict[str, Any]]:
    conn = sqlite3.connect(_sqlite_path(url), timeout=30, isolation_level=None)
    conn.row_factory = sqlite3.Row
    try:
        cursor = conn.execute(_PLACEHOLDER.sub(r"?\1", sql), params)
        return [dict(row) for row in cursor.fetchall()]
    finally:
        conn.close()


# Who holds (granted first) and who waits for the advisory lock whose key is $1 (PostgreSQL).
LOCK_HOLDERS = """
SELECT l.pid, l.granted, a.application_name
FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.objsubid = 1
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND l.classid = (($1::bigint >> 32) & 4294967295)::oid
  AND l.objid = ($1::bigint & 4294967295)::oid
ORDER BY l.granted DESC
"""


# The sessions waiting for a lock that backend $1 holds (PostgreSQL), and what they run.
BLOCKED_BY = """
SELECT pid, wait_event_type, query FROM pg_stat_activity
WHERE $1 = ANY(pg_blocking_pids(pid))
ORDER BY pid
"""


async def afetch(url: str, sql: str, *params: Any) -> list[dict[str, Any]]:
    if url.startswith("sqlite"):
        return await asyncio.to_thread(_sqlite_fetch, url, sql, params)
    conn = await asyncpg.connect(url, server_settings=RIG_APP)
    try:
        return [dict(row) for row in await conn.fetch(sql, *params)]
    finally:
        await conn.close()


def fetch(url: str, sql: str, *params: Any, timeout: float | None = None) -> list[dict[str, Any]]:
    """`timeout`: for all of it, connecting included (asking a server that may be down)."""
    if url.startswith("sqlite"):
        return _sqlite_fetch(url, sql, params)
    return run_sync(asyncio.wait_for(afetch(url, sql, *params), timeout))


async def aexecute(url: str, *scripts: str) -> None:
    """Run each of `scripts` (one statement, or several without parameters) in turn, on one
    connection (PostgreSQL; ``fetch`` takes one statement with parameters)."""
    conn = await asyncpg.connect(url, server_settings=RIG_APP)
    try:
        for script in scripts:
            await conn.execute(script)
    finally:
        await conn.close()


def execute(url: str, *scripts: str) -> None:
    """`aexecute` for sync tests and fixtures."""
    run_sync(aexecute(url, *scripts))


def lock_backend(url: str, instance: str, loop: str = "plugin") -> int:
    """The pid of the backend of `instance`'s lock session for `loop`, which holds a
    granted advisory lock (the leader's); fails unless there is exactly one."""
    rows = fetch(
        url,
        "SELECT DISTINCT a.pid FROM pg_stat_activity a JOIN pg_locks l ON l.pid = a.pid "
        "AND l.locktype = 'advisory' AND l.granted WHERE a.application_name = $1",
        f"scheduler-daemon/{instance}/lock:{loop}",
    )
    assert len(rows) == 1, (instance, loop, rows)
    pid: int = rows[0]["pid"]
    return pid


def leader_of(url: str, loop: str) -> str | None:
    """The instance holding `loop`'s lock, by the lock manager (pg_locks) and its row."""
    leader: str | None = scalar(
        url,
        "SELECT s.instance FROM scheduler_leaders s JOIN pg_locks l ON l.pid = s.backend_pid "
        "AND l.locktype = 'advisory' AND l.granted WHERE s.loop = $1",
        loop,
    )
    return leader


def scalar(url: str, sql: str, *params: Any) -> Any:
    rows = fetch(url, sql, *params)
    return next(iter(rows[0].values())) if rows else None


class Db:
    """Plain SQL against the test's database, one short connection per call.

    Write ``$1``-style parameters; for SQLite they become ``?1`` and times are converted
    both ways (SQLite keeps them as text).
    """

    def __init__(self, url: str) -> None:
        self.url = DatabaseUrl.parse(url)
        self.backend = self.url.backend

    async def fetch(self, sql: str, *args: Any) -> list[dict[str, Any]]:
        if self.backend == "postgres":
            conn = await asyncpg.connect(self.url.postgres_dsn)
            try:
                return [dict(row) for row in await conn.fetch(sql, *args)]
            finally:
                await conn.close()
        path = self.url.sqlite_path
        assert path is not None
        params = tuple(to_db_value(arg) for arg in args)
        async with aiosqlite.connect(path, timeout=30) as conn:
            conn.row_factory = sqlite3.Row
            async with conn.execute(_PLACEHOLDER.sub(r"?\1", sql), params) as cursor:
                rows = await cursor.fetchall()
            await conn.commit()
        return [from_db_row(row) for row in rows]

    async def runs(self, name: str | None = None) -> list[dict[str, Any]]:
        rows = await self.fetch(
            "SELECT id, name, slot, instance, status, error, started_at, finished_at "
            "FROM scheduler_plugin_runs ORDER BY id"
        )
        return [row for row in rows if name is None or row["name"] == name]

    async def statuses(self, name: str) -> Counter[str]:
        return Counter(row["status"] for row in await self.runs(name))

    async def task(self, name: str) -> dict[str, Any]:
        rows = await self.fetch("SELECT * FROM scheduler_plugin_tasks WHERE name = $1", name)
        assert rows, f"task {name!r} is not registered"
        row = rows[0]
        row["active"], row["paused"] = bool(row["active"]), bool(row["paused"])
        return row

    async def now(self) -> datetime:
        if self.backend == "postgres":
            [row] = await self.fetch("SELECT now() AS now")
            return row["now"]  # type: ignore[no-any-return]
        [row] = await self.fetch("SELECT strftime('%Y-%m-%dT%H:%M:%fZ', 'now') AS now")
        return row["now"]  # type: ignore[no-any-return]
