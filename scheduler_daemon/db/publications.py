"""The publications table (``scheduler_publications``), for both backends: a publication
written (scheduled, cancelled) and taken (published, failed, its webhook owed and
delivered). One module because it is one row's life, in one table's named queries of
``postgres.sql`` / ``sqlite.sql``, over a :class:`Tx`.

Written every way in: :func:`schedule` and :func:`cancel` (the ``schedule``,
``get_by_key``, ``cancel`` and ``get`` queries). ``PostgresStore`` runs them on a pooled
connection, each statement on its own (``Client.schedule``, ``Client.cancel``);
``SqliteStore`` in a write transaction of its own; the application's API on its own
asyncpg connection, inside the transaction it has open there (``client.schedule_in``,
``client.cancel_in``). The request is validated before it gets here
(``client.validate_publication``).

Taken by the publish loop and the webhook deliverer: :class:`PublishStore`, in the
transaction they hold, returning :class:`Published` rows (what publishers are given),
:class:`NextDue` and :class:`OwedWebhook`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from ..errors import InvalidInput
from .base import Publication, ScheduleResult, Tx
from .common import explain_cancel_refusal

# -- written: scheduled and cancelled, every way in --------------------------------------

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


# -- taken: the publish loop and the webhook outbox --------------------------------------


@dataclass(frozen=True, slots=True)
class Published:
    """A publication just flipped to ``published``: what publishers are given."""

    id: int
    key: str | None
    payload: Any
    publish_at: datetime
    published_at: datetime

    def summary(self) -> dict[str, Any]:
        """The small, stable JSON shape used by notify and as the webhook envelope."""
        return {
            "id": self.id,
            "key": self.key,
            "publish_at": self.publish_at.isoformat(),
            "published_at": self.published_at.isoformat(),
        }


@dataclass(frozen=True, slots=True)
class NextDue:
    """When the earliest scheduled publication falls due, as of this transaction."""

    seconds: float | None  # until then, by the database's clock (negative: overdue)
    db_epoch: float  # the database's clock, Unix seconds (to convert a NOTIFY's time)
    # Rows due when the transaction began that another transaction holds locked (and
    # SKIP LOCKED passed over): the caller looks again soon (never on SQLite).
    skipped: bool


@dataclass(frozen=True, slots=True)
class OwedWebhook:
    """A published row whose webhook is due, with the attempts made so far."""

    publication: Published
    attempts: int


def _published(row: dict[str, Any]) -> Published:
    return Published(row["id"], row["key"], row["payload"], row["publish_at"], row["published_at"])


class PublishStore:
    """The publish loop's and the webhook outbox's statements: typed methods over named
    queries.

    Like :class:`~.plugin_store.PluginStore`: each method is one named query of the
    backend's queries file, called with named parameters inside a transaction the caller
    holds (the loop's fenced one, or the webhook deliverer's round), and returns
    dataclasses. Rows are taken in ``publish_at``, then ``id``, order; PostgreSQL skips rows
    another transaction holds locked (``FOR UPDATE SKIP LOCKED``), SQLite has one writer and
    needs no row locks.
    """

    def __init__(self, tx: Tx) -> None:
        self.tx = tx

    # -- publications --------------------------------------------------------------------

    async def take_due(self, *, limit: int, instance: str) -> list[Published]:
        """Flip up to ``limit`` due rows to ``published`` by ``instance``, in one
        statement, and return them in ``publish_at``, then ``id``, order (the order an
        UPDATE's RETURNING gives is not promised: publishers are promised this one)."""
        rows = await self.tx.query("publish_due", limit=limit, instance=instance)
        return sorted(map(_published, rows), key=lambda row: (row.publish_at, row.id))

    async def due_ids(self, *, limit: int) -> list[int]:
        """The ids :meth:`take_due` would take, locked, without reading their payloads:
        for a batch that holds a row Python cannot read, taken row by row instead."""
        return [row["id"] for row in await self.tx.query("publish_due_ids", limit=limit)]

    async def take_one(self, *, id: int, instance: str) -> Published | None:
        """Flip this row if it is still scheduled; None if it no longer is."""
        rows = await self.tx.query("publish_one", id=id, instance=instance)
        return _published(rows[0]) if rows else None

    async def fail(self, *, id: int, error: str) -> None:
        """Mark a row ``failed`` with its error (its publishers failed, or it was
        unreadable); ``published_at`` is cleared: nothing of it was published."""
        await self.tx.query("publication_fail", id=id, error=error)

    async def retry_failed(self, *, id: int) -> bool:
        """Schedule a ``failed`` row again, due now; False if it is not failed."""
        return bool(await self.tx.query("publication_retry", id=id))

    async def next_due(self) -> NextDue:
        [row] = await self.tx.query("next_due_in")
        return NextDue(row["seconds"], row["db_epoch"], bool(row["skipped"]))

    async def notify_published(self, *, channel: str, messages: Sequence[str]) -> None:
        """``pg_notify`` each message on ``channel`` at commit (PostgreSQL only)."""
        await self.tx.query("notify_published", channel=channel, messages=list(messages))

    async def purge(self, *, older_than: float, limit: int) -> int:
        """Delete up to ``limit`` rows no longer scheduled whose ``publish_at`` is more than
        ``older_than`` seconds ago; return how many went."""
        rows = await self.tx.query("purge_publications", older_than=older_than, limit=limit)
        return len(rows)

    # -- the webhook outbox --------------------------------------------------------------

    async def owe_webhooks(self, ids: Sequence[int]) -> None:
        """Owe a webhook for each of these rows (once: a row already owed is left alone)."""
        await self.tx.query("outbox_add", ids=list(ids))

    async def webhooks_due(self, *, limit: int) -> list[OwedWebhook]:
        """Up to ``limit`` owed webhooks whose attempt is due, longest waiting first
        (PostgreSQL: locked by this transaction, others' locked ones skipped)."""
        rows = await self.tx.query("outbox_due", limit=limit)
        return [OwedWebhook(_published(row), row["attempts"]) for row in rows]

    async def next_webhook_in(self) -> float | None:
        """Seconds until the next owed attempt (negative: due); None if nothing is owed."""
        [row] = await self.tx.query("outbox_next_in")
        seconds: float | None = row["seconds"]
        return seconds

    async def webhook_delivered(self, *, id: int) -> None:
        await self.tx.query("outbox_delivered", id=id)

    async def webhook_retry(self, *, id: int, delay: float, error: str) -> None:
        """Count a failed attempt and owe the next one in ``delay`` seconds."""
        await self.tx.query("outbox_retry", id=id, delay=delay, error=error)

    async def webhook_gave_up(self, *, id: int, error: str) -> None:
        """The last attempt failed: the webhook and its publication become ``failed``
        (the publication's database effects stay committed; its webhook never arrived)."""
        await self.tx.query("outbox_failed", id=id, error=error)
        await self.tx.query("publication_undelivered", id=id, error=f"webhook: {error}")
