"""Scheduling and cancelling a publication, for both backends and every way in: the named
queries ``schedule``, ``get_by_key``, ``cancel`` and ``get`` of ``postgres.sql`` /
``sqlite.sql``, over a :class:`Tx`.

``PostgresStore`` runs them on a pooled connection, each statement on its own
(``Client.schedule``, ``Client.cancel``); ``SqliteStore`` in a write transaction of its
own; the application's API on its own asyncpg connection, inside the transaction it has
open there (``client.schedule_in``, ``client.cancel_in``). The request is validated
before it gets here (``client.validate_publication``).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any, Final

from ..errors import InvalidInput
from .base import Publication, ScheduleResult, Tx
from .common import explain_cancel_refusal

# Inserts tried: a second one only when the row a key met was purged before it could be
# read (a finished row past retention); that one creates it, or meets a scheduled row.
_ATTEMPTS: Final = 2


def _publication(
    row: Mapping[str, Any], decoded: bool, inserted_json: str | None = None
) -> Publication:
    """A row as a :class:`Publication`. ``decoded``: the connection's rows hold the payload
    decoded (the store's jsonb codec; SQLite's rows). Otherwise it is an application's
    connection, whose codecs are its own: jsonb comes back as text unless it registered a
    decoder (asyncpg's and SQLAlchemy's default)."""
    data = dict(row)
    if not decoded and inserted_json is not None:
        data["payload"] = json.loads(inserted_json)  # what we just inserted
    elif not decoded and isinstance(data["payload"], str):
        # A ValueError: already decoded by the application's codec, a JSON string.
        with contextlib.suppress(ValueError):
            data["payload"] = json.loads(data["payload"])
    return Publication(**data)


async def schedule(
    tx: Tx, publish_at: datetime, payload_json: str, key: str | None, *, decoded: bool = True
) -> ScheduleResult:
    """Insert a publication, or with ``key`` return the existing one of that key unchanged
    (``created=False``: the first request wins). ``payload_json``: the payload as JSON
    text; ``decoded``: as :func:`_publication` (False on an application's connection)."""
    for _ in range(_ATTEMPTS):
        rows = await tx.fetch("schedule", key, payload_json, publish_at)
        if rows:
            return ScheduleResult(_publication(rows[0], decoded, payload_json), created=True)
        # The key exists. Read in a snapshot that sees the row the insert met (a statement
        # of its own, READ COMMITTED, or SQLite's same write transaction); a row with a key
        # is never deleted while scheduled.
        existing = await tx.fetch("get_by_key", key)
        if existing:
            return ScheduleResult(_publication(existing[0], decoded), created=False)
        # Purged between the two statements: once more.
    raise InvalidInput(f"key {key!r} conflicts with a publication that cannot be read")


async def cancel(tx: Tx, publication_id: int, *, decoded: bool = True) -> Publication:
    """Cancel a ``scheduled`` publication, returning it; :class:`InvalidInput` for one no
    longer scheduled, :class:`~scheduler_daemon.errors.NotFound` for an unknown id."""
    rows = await tx.fetch("cancel", publication_id)
    if rows:
        return _publication(rows[0], decoded)
    current = await tx.fetch("get", publication_id)
    raise explain_cancel_refusal(
        publication_id, _publication(current[0], decoded) if current else None
    )
