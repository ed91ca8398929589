"""The scheduling API for applications: schedule, cancel and look up publications.

On the daemon's own connection pool::

    async with Client.connect(load_settings()) as client:
        result = await client.schedule(datetime(2027, 1, 1, 9, tzinfo=UTC), {"post": 42},
                                       key="post-42")

Or inside a transaction the application already holds (asyncpg), so that its own rows
and the publication commit together or not at all::

    async with conn.transaction():
        await conn.execute("INSERT INTO posts ...")
        await schedule_in(conn, datetime(2027, 1, 1, 9, tzinfo=UTC), {"post": 42},
                          key="post-42")

Both run the same validation (:func:`validate_schedule`) before anything reaches the
database, so a refused request changes nothing (and leaves the application's transaction
usable), and the same statements, from the named queries in ``db/postgres.sql``.
(Applications may also INSERT into ``scheduler_publications`` with plain SQL.)
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any, Final

from .config import MAX_TASK_NAME_LENGTH, PublishSettings, Settings
from .db import Publication, PublicationFilter, ScheduleResult, Store
from .db.common import explain_cancel_refusal
from .db.connect import connect
from .db.sqlfiles import queries
from .errors import InvalidInput
from .logs import Logger, get_logger

#: ``publish.max_payload_bytes`` unless configured otherwise (1 MiB).
DEFAULT_MAX_PAYLOAD_BYTES: Final[int] = PublishSettings.model_fields["max_payload_bytes"].default
#: Arrays and objects inside one another, at most. Far beyond any real payload, and far
#: below what every reader copes with: Python's json (about 1,000 levels), PostgreSQL's
#: parser, the CLI's output. A PostgreSQL constraint holds plain SQL to it too.
MAX_PAYLOAD_DEPTH: Final = 100
#: Characters in a key, as in a task name: a unique index entry must stay under
#: PostgreSQL's 2,704 bytes, and a `notify` message carrying it under 8,000.
MAX_KEY_LENGTH: Final = MAX_TASK_NAME_LENGTH

_SURROGATE = re.compile("[\ud800-\udfff]")


def _unstorable(text: str) -> str | None:
    """Why PostgreSQL cannot store this text (SQLite could: refused on both alike)."""
    if "\x00" in text:
        return "a NUL character (\\u0000), which PostgreSQL text and jsonb cannot hold"
    found = _SURROGATE.search(text)
    if found is not None:
        return f"a lone surrogate ({ascii(found.group())[1:-1]}), which is not Unicode text"
    return None


def _check_payload(payload: Any) -> None:
    """Depth and text of a payload that json.dumps accepted (so it has no cycle); without
    recursion, so that no payload can exhaust the stack here."""
    pending: list[tuple[Any, int]] = [(payload, 0)]
    while pending:
        value, depth = pending.pop()
        if isinstance(value, str):
            problem = _unstorable(value)
            if problem is not None:
                raise InvalidInput(f"payload holds {problem}")
        elif isinstance(value, dict | list | tuple) and value:
            if depth >= MAX_PAYLOAD_DEPTH:
                raise InvalidInput(
                    f"payload is nested deeper than {MAX_PAYLOAD_DEPTH} levels of arrays "
                    "and objects"
                )
            items = [*value, *value.values()] if isinstance(value, dict) else value
            pending.extend((item, depth + 1) for item in items)


def encode_payload(payload: Any, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> str:
    """``payload`` as compact JSON text; refused (:class:`InvalidInput`) if it is not JSON
    (a set, NaN, …), is nested deeper than :data:`MAX_PAYLOAD_DEPTH`, holds text no
    database can store (NUL, a lone surrogate) or is longer than ``max_payload_bytes``
    once encoded."""
    try:
        text = json.dumps(payload, allow_nan=False, separators=(",", ":"))
    except RecursionError:
        raise InvalidInput(
            f"payload is nested deeper than {MAX_PAYLOAD_DEPTH} levels of arrays and objects"
        ) from None
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"payload is not JSON-serialisable: {exc}") from None
    size = len(text.encode())
    if size > max_payload_bytes:
        raise InvalidInput(
            f"payload is {size} bytes, over the limit of {max_payload_bytes} "
            "(publish.max_payload_bytes)"
        )
    _check_payload(payload)
    return text


def validate_schedule(
    publish_at: datetime,
    payload: Any = None,
    key: str | None = None,
    *,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
) -> str:
    """Every rule a scheduling request must pass; returns the payload as JSON text, ready
    for ``scheduler_publications.payload``. Raises :class:`InvalidInput`.

    The rules: ``publish_at`` is timezone-aware and in the years 1 to 9999 in UTC;
    ``key`` is None, or not blank, at most :data:`MAX_KEY_LENGTH` characters, and text
    PostgreSQL can store (no NUL, no lone surrogate); the payload (None means ``{}``) is
    JSON of at most ``max_payload_bytes``, nested at most :data:`MAX_PAYLOAD_DEPTH`
    levels, its strings storable text too. A time in the past is accepted: the
    publication is due at once.
    """
    if publish_at.tzinfo is None or publish_at.utcoffset() is None:
        raise InvalidInput("publish time must be timezone-aware (e.g. 2027-01-01T09:00Z)")
    try:
        publish_at.astimezone(UTC)
    except OverflowError:
        raise InvalidInput(
            f"publish time {publish_at.isoformat()} is out of range (years 1 to 9999, in UTC)"
        ) from None
    if key is not None:
        if not key.strip():
            raise InvalidInput("key must not be empty")
        if len(key) > MAX_KEY_LENGTH:
            raise InvalidInput(f"key is {len(key)} characters, over the limit of {MAX_KEY_LENGTH}")
        problem = _unstorable(key)
        if problem is not None:
            raise InvalidInput(f"key holds {problem}")
    return encode_payload({} if payload is None else payload, max_payload_bytes)


def ignored_changes(result: ScheduleResult, publish_at: datetime, payload: Any = None) -> list[str]:
    """What a repeated request asked for that the first one did not: ``publish_at`` and/or
    ``payload``. Scheduling an existing key changes nothing, so the first request wins;
    empty when this request created the publication or asked for the same."""
    if result.created:
        return []
    existing = result.publication
    changed = []
    if existing.publish_at != publish_at:
        changed.append("publish_at")
    # Compared as decoded JSON: jsonb may reorder keys or respace, never change a value.
    if existing.payload != json.loads(json.dumps({} if payload is None else payload)):
        changed.append("payload")
    return changed


class Client:
    def __init__(self, store: Store, max_payload_bytes: int) -> None:
        self.store = store
        self.max_payload_bytes = max_payload_bytes

    @classmethod
    @asynccontextmanager
    async def connect(cls, settings: Settings, log: Logger | None = None) -> AsyncIterator[Client]:
        """Open the store, retrying within ``database.startup_budget``; past it, raise
        :class:`~scheduler_daemon.errors.DatabaseUnavailable` (password redacted)."""
        log = log or get_logger(instance=settings.instance_id)
        store = await connect(settings, log)
        try:
            yield cls(store, settings.publish.max_payload_bytes)
        finally:
            await store.close()

    async def schedule(
        self, at: datetime, payload: Any = None, key: str | None = None
    ) -> ScheduleResult:
        """Schedule a publication; with ``key``, scheduling twice returns the first one
        unchanged (see :func:`ignored_changes`)."""
        encoded = validate_schedule(at, payload, key, max_payload_bytes=self.max_payload_bytes)
        return await self.store.schedule(at, encoded, key)

    async def cancel(self, publication_id: int) -> Publication:
        return await self.store.cancel(publication_id)

    async def get(self, publication_id: int) -> Publication | None:
        return await self.store.get(publication_id)

    async def get_by_key(self, key: str) -> Publication | None:
        return await self.store.get_by_key(key)

    async def find(self, where: PublicationFilter | None = None) -> list[Publication]:
        """Publications in ``publish_at`` order (the first 100 unless ``where.limit``)."""
        return await self.store.find_publications(where or PublicationFilter())


# -- on the application's own connection ----------------------------------------------


def _check_connection(conn: Any, function: str) -> dict[str, str]:
    """The PostgreSQL queries, once ``conn`` is known to be an asyncpg connection."""
    # Imported here: the CLI imports this module, and only `run` needs asyncpg at once.
    import asyncpg
    import asyncpg.pool

    if not isinstance(conn, (asyncpg.Connection, asyncpg.pool.PoolConnectionProxy)):
        raise TypeError(
            f"{function}() needs an asyncpg connection, not {type(conn).__name__}: with "
            "SQLAlchemy pass (await (await session.connection()).get_raw_connection())"
            ".driver_connection; with another driver run the statement shown in "
            "docs/publishing.md"
        )
    if not conn.is_in_transaction():
        # Refused rather than autocommitted: the caller meant "with my transaction", and
        # SQLAlchemy opens the database transaction only at the session's first statement.
        raise RuntimeError(
            f"{function}() needs a transaction open on the connection (asyncpg: async with "
            "conn.transaction(); SQLAlchemy: run a statement or flush() first); to schedule "
            "on its own, use Client"
        )
    return queries("postgres")


def _publication(row: Mapping[str, Any], payload_json: str | None = None) -> Publication:
    """A row read on the application's connection, whose codecs are its own: jsonb comes
    back as text unless it registered a decoder (asyncpg's and SQLAlchemy's default)."""
    data = dict(row)
    if payload_json is not None:
        data["payload"] = json.loads(payload_json)  # what we just inserted
    elif isinstance(data["payload"], str):
        # A ValueError: already decoded by the application's codec, a JSON string.
        with contextlib.suppress(ValueError):
            data["payload"] = json.loads(data["payload"])
    return Publication(**data)


async def schedule_in(
    conn: Any,
    publish_at: datetime,
    payload: Any = None,
    *,
    key: str | None = None,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
) -> ScheduleResult:
    """:meth:`Client.schedule` on an asyncpg connection the application holds (a
    ``Connection`` or a pool's proxy), inside the transaction it has open there: the
    publication exists if and only if that transaction commits. Without an open
    transaction it raises RuntimeError and sends nothing.

    The same validation runs first (:func:`validate_schedule`; pass the daemon's
    ``publish.max_payload_bytes`` if you changed it), so a refused request raises
    :class:`InvalidInput` without sending a statement and the transaction stays usable.
    With ``key``, an existing publication of that key is returned unchanged
    (``created=False``). The insert fires the same trigger as any other, whose NOTIFY
    PostgreSQL delivers at commit: a session-mode leader wakes for it then.
    """
    encoded = validate_schedule(publish_at, payload, key, max_payload_bytes=max_payload_bytes)
    q = _check_connection(conn, "schedule_in")
    for _ in range(2):
        row = await conn.fetchrow(q["schedule"], key, encoded, publish_at)
        if row is not None:
            return ScheduleResult(_publication(row, payload_json=encoded), created=True)
        # The key exists (READ COMMITTED: this statement sees the row the insert met).
        existing = await conn.fetchrow(q["get_by_key"], key)
        if existing is not None:
            return ScheduleResult(_publication(existing), created=False)
        # Purged between the two statements (a finished row past retention): once more.
    raise InvalidInput(f"key {key!r} conflicts with a publication that cannot be read")


async def cancel_in(conn: Any, publication_id: int) -> Publication:
    """:meth:`Client.cancel` on the application's asyncpg connection, in its open
    transaction (RuntimeError without one). Refuses (:class:`InvalidInput`, :class:`~scheduler_daemon.errors.NotFound`) an
    unknown id or a publication that is no longer ``scheduled``."""
    q = _check_connection(conn, "cancel_in")
    row = await conn.fetchrow(q["cancel"], publication_id)
    if row is not None:
        return _publication(row)
    current = await conn.fetchrow(q["get"], publication_id)
    raise explain_cancel_refusal(publication_id, None if current is None else _publication(current))
