"""Ad-hoc SQL against either backend, for tests to arrange and inspect state.

Write PostgreSQL placeholders (``$1``); for SQLite they become ``?1``. Rows come back as
dicts. ``fetch`` is for sync tests, ``afetch`` for async ones (asyncio.run cannot nest).
"""

from __future__ import annotations

import asyncio
import re
import sqlite3
from pathlib import Path
from typing import Any

import asyncpg

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


async def afetch(url: str, sql: str, *params: Any) -> list[dict[str, Any]]:
    if url.startswith("sqlite"):
        return await asyncio.to_thread(_sqlite_fetch, url, sql, params)
    conn = await asyncpg.connect(url)
    try:
        return [dict(row) for row in await conn.fetch(sql, *params)]
    finally:
        await conn.close()


def fetch(url: str, sql: str, *params: Any) -> list[dict[str, Any]]:
    if url.startswith("sqlite"):
        return _sqlite_fetch(url, sql, params)
    return asyncio.run(afetch(url, sql, *params))


def scalar(url: str, sql: str, *params: Any) -> Any:
    rows = fetch(url, sql, *params)
    return next(iter(rows[0].values())) if rows else None
