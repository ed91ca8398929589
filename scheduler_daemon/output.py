"""One JSON shape for what the CLI prints, whichever backend the rows came from.

PostgreSQL hands back booleans and aware datetimes; SQLite has neither type, so the same
row comes back with ``1`` for true and times parsed from text. Everything printed with
``--json`` goes through :func:`json_rows`: booleans as ``true``/``false``, times as ISO
8601 in UTC (``2026-12-01T05:04:31.951000+00:00``), the rest as it is. The text output
writes sizes and durations with :func:`human_size` and :func:`human_duration`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

# Columns of the public schema that are booleans (stored as 0/1 on SQLite).
BOOLEAN_COLUMNS = frozenset({"active", "paused"})


def json_value(value: Any) -> Any:
    """A value JSON can hold: datetimes as ISO 8601 in UTC, containers recursively."""
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat()
    if isinstance(value, Mapping):
        return {str(k): json_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_value(v) for v in value]
    return value


def json_row(row: Mapping[str, Any] | Any) -> dict[str, Any]:
    """A database row (a mapping or a dataclass such as ``Publication``) as JSON values."""
    data: dict[str, Any]
    if isinstance(row, Mapping):
        data = dict(row)
    elif dataclasses.is_dataclass(row) and not isinstance(row, type):
        data = dataclasses.asdict(row)
    else:
        raise TypeError(f"not a row: {type(row).__name__}")
    return {
        column: bool(value)
        if column in BOOLEAN_COLUMNS and value is not None
        else json_value(value)
        for column, value in data.items()
    }


def json_rows(rows: Iterable[Mapping[str, Any] | Any]) -> list[dict[str, Any]]:
    return [json_row(row) for row in rows]


def dumps(value: Any) -> str:
    """Indented JSON; refuses (TypeError) anything :func:`json_value` did not convert."""
    return json.dumps(value, indent=2)


def human_size(count: int) -> str:
    """Bytes in the units pg_size_pretty uses (bytes, kB, MB, GB, TB), to one decimal:
    24.9 MB."""
    if count < 1024:
        return f"{count} bytes"
    value = float(count)
    for unit in ("kB", "MB", "GB", "TB"):
        value /= 1024
        if value < 1024 or unit == "TB":
            break
    return f"{value:.1f} {unit}"


def human_duration(seconds: float) -> str:
    """12s, 14m 3s, 5h 2m, 3d 4h."""
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m {whole % 60}s"
    if whole < 86400:
        return f"{whole // 3600}h {whole % 3600 // 60}m"
    return f"{whole // 86400}d {whole % 86400 // 3600}h"


def counted(value: int, limit: int | None) -> str:
    """A count that stopped at ``limit`` (a report's ``count_limit``) as "10000+": at least
    that many."""
    return f"{value}+" if limit is not None and value >= limit else str(value)
