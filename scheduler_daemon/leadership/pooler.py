"""Refuse ``session`` mode behind a transaction pooler (PgBouncer ``pool_mode=transaction``).

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

import asyncpg

from ..db.lock_store import PgLockStore
from ..db.postgres import PostgresStore

PROBE_TIMEOUT = 2.0


async def detect_transaction_pooler(store: PostgresStore) -> str | None:
    """Return why the connection looks pooled per transaction, or None if it does not."""
    subject = await store.connect_dedicated("pooler-probe")
    try:
        pinner = await store.connect_dedicated("pooler-probe")
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
