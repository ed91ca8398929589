"""The scheduling API inside the application's own asyncpg transaction: ``schedule_in``,
``cancel_in``, ``add_schedule_in``, ``remove_schedule_in``, which commit or roll back with
the application's rows."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from ..db import AddedSchedule, Publication, ScheduleRecord, ScheduleResult, publications
from ..db.base import Tx
from ..db.schedules import ScheduleStore
from .pool import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    DurationLike,
    validate_publication,
    validate_runtime_schedule,
)

# -- on the application's own connection ----------------------------------------------


def _transaction_on(conn: Any, function: str) -> Tx:
    """The statements of ``conn``'s open transaction, once ``conn`` is known to be an
    asyncpg connection with one open."""
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
    from ..db.postgres import PgTx

    return PgTx(conn)


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
    request = validate_publication(publish_at, payload, key, max_payload_bytes=max_payload_bytes)
    tx = _transaction_on(conn, "schedule_in")
    # decoded=False: the application's codecs, not the store's (db/publications.py).
    return await publications.schedule(
        tx, request.publish_at, request.payload_json, request.key, decoded=False
    )


async def cancel_in(conn: Any, publication_id: int) -> Publication:
    """:meth:`Client.cancel` on the application's asyncpg connection, in its open
    transaction (RuntimeError without one). Refuses (:class:`InvalidInput`, :class:`~scheduler_daemon.errors.NotFound`) an
    unknown id or a publication that is no longer ``scheduled``."""
    tx = _transaction_on(conn, "cancel_in")
    return await publications.cancel(tx, publication_id, decoded=False)


async def add_schedule_in(
    conn: Any,
    name: str,
    *,
    target: str,
    every: DurationLike | None = None,
    cron: str | None = None,
    timezone: str = "UTC",
    args: Mapping[str, Any] | None = None,
    timeout: DurationLike = 300.0,  # noqa: ASYNC109 (each run's, not this call's)
    misfire: str = "run_once",
    jitter: DurationLike = 0.0,
    start: datetime | None = None,
    replace: bool = False,
    max_args_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
) -> AddedSchedule:
    """:meth:`Client.add_schedule` on the application's asyncpg connection (PostgreSQL),
    inside the transaction it has open there: the schedule exists if and only if that
    transaction commits (RuntimeError without one, and nothing sent).

    Every refusal (:class:`InvalidInput`: a bad parameter, a name in use, a target the
    deployment does not declare runnable) is decided before anything is written, so the
    transaction stays usable. The first slot comes from the database's clock at this call
    (``clock_timestamp()``, not the transaction's start). Pass the daemon's
    ``publish.max_payload_bytes`` as ``max_args_bytes`` if you changed it. The insert's
    NOTIFY reaches a session-mode leader at commit."""
    request = validate_runtime_schedule(
        name, target=target, every=every, cron=cron, timezone=timezone, args=args,
        timeout=timeout, misfire=misfire, jitter=jitter, start=start,
        max_args_bytes=max_args_bytes,
    )  # fmt: skip
    tx = _transaction_on(conn, "add_schedule_in")
    return await ScheduleStore(tx).add(request.definition(), replace=replace)


async def remove_schedule_in(conn: Any, name: str) -> ScheduleRecord:
    """:meth:`Client.remove_schedule` on the application's asyncpg connection, in its open
    transaction (RuntimeError without one): removed if and only if that transaction
    commits. :class:`~scheduler_daemon.errors.NotFound` for an unknown name or a declared
    task, raised before anything is written."""
    return await ScheduleStore(_transaction_on(conn, "remove_schedule_in")).remove(name)
