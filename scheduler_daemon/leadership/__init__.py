"""Leadership guards: which replica runs a loop's work, and proof that it still may.

- PostgreSQL ``session`` mode: :class:`~.postgres_session.SessionGuard` (default)
- PostgreSQL ``transaction`` mode: :class:`~.postgres_transaction.TransactionGuard`
- SQLite: :class:`~.sqlite_flock.FlockGuard`

See docs/leadership.md for the failure matrix and the timing arithmetic.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from ..config.settings import Settings
from ..db.base import Store
from ..logs import Logger
from ..metrics import Metrics
from ..schema_gate import SchemaGate
from .base import (
    ClaimScope,
    Guard,
    LeadershipLost,
    Lease,
    NotLeader,
    PendingHold,
    Stopping,
    WriteGroup,
)

if TYPE_CHECKING:
    from ..db.listen import Listener

__all__ = [
    "ClaimScope",
    "Guard",
    "LeadershipLost",
    "Lease",
    "NotLeader",
    "PendingHold",
    "Stopping",
    "WriteGroup",
    "make_guard",
]


def make_guard(
    loop: str,
    key: int,
    store: Store,
    settings: Settings,
    log: Logger,
    metrics: Metrics,
    stop: asyncio.Event,
    schema: SchemaGate,
    listener: Listener | None = None,
) -> Guard:
    from ..db.postgres import PostgresStore
    from ..db.sqlite import SqliteStore

    if isinstance(store, SqliteStore):
        from .sqlite_flock import FlockGuard

        guard = FlockGuard(loop, key, store, settings, log, metrics, stop, schema)
        # Now, at startup: a lock file or database file we cannot open is exit 78 naming
        # it, not a loop retrying for ever. The database file stays open (never close a
        # descriptor of it: that would drop SQLite's own locks in this process).
        guard.open_files()
        return guard
    assert isinstance(store, PostgresStore)
    if settings.lock.mode == "transaction":
        from .postgres_transaction import TransactionGuard

        return TransactionGuard(loop, key, store, settings, log, metrics, stop, schema)
    if loop == "plugin" and settings.plugin.shards > 1:  # config/settings.py: session mode only
        from .shards import ShardedSessionGuard

        return ShardedSessionGuard(
            loop, key, store, settings, log, metrics, stop, schema, listener=listener
        )
    from .postgres_session import SessionGuard

    return SessionGuard(loop, key, store, settings, log, metrics, stop, schema)
