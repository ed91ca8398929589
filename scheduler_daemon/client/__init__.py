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

Both run the same validation (:func:`validate_publication`) before anything reaches the
database, so a refused request changes nothing (and leaves the application's transaction
usable), and the same statements (``db/publications.py``, the named queries in
``db/postgres.sql``).
(Applications may also INSERT into ``scheduler_publications`` with plain SQL.)

Runtime schedules (plugin tasks held as data: docs/plugins.md, "Schedules as data") the
same two ways::

    async with Client.connect(load_settings()) as client:
        await client.add_schedule("feed-42", every="5m", target="feeds.jobs:refresh",
                                  args={"feed": 42})
        await client.remove_schedule("feed-42")

    async with conn.transaction():
        await conn.execute("INSERT INTO feeds ...")
        await add_schedule_in(conn, "feed-42", every="5m", target="feeds.jobs:refresh",
                              args={"feed": 42})

validated first by :func:`validate_runtime_schedule`.

The package: ``pool`` (the validation every way in shares, and :class:`Client`),
``in_transaction`` (the ``*_in`` functions); the public API is imported here, from
``scheduler_daemon.client``.
"""

from .in_transaction import add_schedule_in, cancel_in, remove_schedule_in, schedule_in
from .pool import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    MAX_KEY_LENGTH,
    MAX_PAYLOAD_DEPTH,
    Client,
    DurationLike,
    PublicationRequest,
    RuntimeSchedule,
    encode_payload,
    ignored_changes,
    validate_publication,
    validate_runtime_schedule,
    validate_schedule,
)

__all__ = [
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "MAX_KEY_LENGTH",
    "MAX_PAYLOAD_DEPTH",
    "Client",
    "DurationLike",
    "PublicationRequest",
    "RuntimeSchedule",
    "add_schedule_in",
    "cancel_in",
    "encode_payload",
    "ignored_changes",
    "remove_schedule_in",
    "schedule_in",
    "validate_publication",
    "validate_runtime_schedule",
    "validate_schedule",
]
