"""Refuse ``session`` mode where it cannot keep its exclusion: on a server too old to end
a stalled session (no ``idle_session_timeout`` before PostgreSQL 14), and behind a
transaction pooler (PgBouncer ``pool_mode=transaction``).

There, consecutive statements of one client may run on different server sessions, so a
session advisory lock is held by whichever server connection ran ``pg_advisory_lock`` and
then lent to other clients: no exclusion at all. The probe pins one server connection in an
open transaction from a second client, then asks the first for its backend pid twice. A
direct connection keeps its pid. Behind a transaction pooler the pid changes, or the
statement waits for a free server connection (a pool of one), which the timeout catches.
A prepared statement that vanished or already exists on the server session is the same
evidence: asyncpg prepared it on one server session and is now talking to another.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import asyncpg

from ..errors import ConfigError
from .base import Store
from .lock_store import PgLockStore
from .postgres import PostgresStore

PROBE_TIMEOUT = 2.0
# Session mode relies on idle_session_timeout to end a stalled leader's session, and with
# it its lock.
SESSION_MODE_SERVER = (14, 0)


async def refuse_unsafe_locking(store: Store) -> None:
    """Raise :class:`ConfigError` if ``store`` cannot keep the configured lock mode's
    exclusion. Before migrating: behind a transaction pooler even that can fail in
    confusing ways. SQLite's file lock and transaction mode: nothing to refuse."""
    if not isinstance(store, PostgresStore) or store.settings.lock.mode != "session":
        return
    version = await store.server_version()
    if version < SESSION_MODE_SERVER:
        raise ConfigError(
            f"lock.mode: 'session' needs PostgreSQL {SESSION_MODE_SERVER[0]} or later "
            f"(idle_session_timeout is what ends a stalled leader's session); the "
            f"server is {'.'.join(map(str, version))}. Upgrade it, or set "
            "SCHEDULER_LOCK__MODE=transaction."
        )
    reason = await detect_transaction_pooler(store.connect_dedicated)
    if reason is not None:
        raise ConfigError(
            "lock.mode: 'session' needs a direct or session-pooled connection, but this "
            f"one looks like a transaction pooler (PgBouncer pool_mode=transaction?): "
            f"{reason}. Set SCHEDULER_LOCK__MODE=transaction."
        )


async def detect_transaction_pooler(
    connect: Callable[[str], Awaitable[asyncpg.Connection]],
) -> str | None:
    """Return why connections made by ``connect`` (given their purpose) look pooled per
    transaction, or None if they do not."""
    subject = await connect("pooler-probe")
    try:
        pinner = await connect("pooler-probe")
    except BaseException:
        subject.terminate()
        raise
    try:
        asked, pinning = PgLockStore(subject), PgLockStore(pinner)
        first = await asked.backend_pid()
        async with pinner.transaction():
            await pinning.backend_pid()
            try:
                second = await asked.backend_pid(within=PROBE_TIMEOUT)
            except TimeoutError:
                return "a statement waited for another client's transaction to end"
        third = await asked.backend_pid()
    except (asyncpg.InvalidSQLStatementNameError, asyncpg.DuplicatePreparedStatementError) as exc:
        return f"prepared statements moved between server sessions ({type(exc).__name__})"
    finally:
        for conn in (subject, pinner):
            conn.terminate()
    if len({first, second, third}) > 1:
        return f"backend pid changed between statements ({first} -> {second} -> {third})"
    return None
