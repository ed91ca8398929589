"""`migrate` on PostgreSQL: this build's migrations that the database lacks, applied in
order by one replica at a time.

Migrations run together in one transaction under a transaction-level advisory lock
(MIGRATION_LOCK_KEY), which first takes the version table in ACCESS EXCLUSIVE mode: it
waits for the loops' fenced transactions in flight, and every later one then sees the new
version (schema_gate.py). A migration marked to run outside a transaction (sqlfiles.py:
CREATE INDEX CONCURRENTLY on a big table) runs on its own after those before it, a
statement at a time, and is recorded last.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from itertools import takewhile

import asyncpg

from ..config.url import DatabaseUrl
from ..errors import PrivilegeRefused
from ..redact import redact
from .base import AppliedMigration
from .privileges import refuse_missing_grants, refuse_unusable_schema
from .sqlfiles import Migration, formatted, migrations, queries

QUERIES = queries("postgres")

# Serialises `migrate` across replicas. A transaction-level lock on a dedicated
# connection: a replica that starts at the same moment waits, then finds nothing to do.
MIGRATION_LOCK_KEY = 0x5C4ED01E_00000001
# A migration outside a transaction (_apply_outside): its own lock, polled for.
MIGRATION_OUTSIDE_LOCK_KEY = 0x5C4ED01E_00000002
OUTSIDE_LOCK_POLL = 0.1
# How long a migration waits for the loops' fenced transactions in flight (and for its
# DDL's locks) before it rolls back and is retried with backoff. While it waits, every
# loop's next fenced transaction queues behind it: this bounds that pause, should a
# long SQL task or transaction-mode run be in flight.
MIGRATION_LOCK_TIMEOUT = 2.0


async def apply_migrations(conn: asyncpg.Connection, url: DatabaseUrl) -> list[AppliedMigration]:
    """Apply what is pending, on ``conn`` (a dedicated connection); returns what this call
    applied (none: another replica did, or nothing was pending)."""
    applied: list[AppliedMigration] = []
    pending: list[Migration] = []
    try:
        # Looked at before any DDL: even CREATE TABLE IF NOT EXISTS needs CREATE on the
        # schema, which a runtime role that only runs the loops does not have (and should
        # not: docs/security.md). Versions only grow, so "nothing to apply" read without
        # the lock stays true.
        pending = await _pending(conn, url)
        while pending:
            # Those in a transaction, up to the first one outside (sqlfiles.py), then that
            # one; then again, until none is left.
            outside = await _apply_in_transaction(conn, applied)
            if outside is None:
                break
            await _apply_outside(conn, outside, applied)
    except asyncpg.InsufficientPrivilegeError as exc:
        if not pending:
            raise  # reading the versions: the usual explanation names the table
        raise _cannot_migrate(url, pending, exc) from None
    return applied


async def _pending(conn: asyncpg.Connection, url: DatabaseUrl) -> list[Migration]:
    """The migrations of this build that the database has not applied yet."""
    if not await conn.fetchval(QUERIES["version_table_exists"]):
        await refuse_unusable_schema(conn, f"database {url}")
        return list(migrations("postgres"))
    try:
        done = {row["version"] for row in await conn.fetch(QUERIES["applied_versions"])}
    except asyncpg.InsufficientPrivilegeError:
        # Named as the GRANT that fixes it, as every grant the loops need is.
        version_table = {("table", "scheduler_schema_version"): {"SELECT"}}
        await refuse_missing_grants(conn, version_table, f"database {url}")
        raise
    return [m for m in migrations("postgres") if m.version not in done]


async def _apply_in_transaction(
    conn: asyncpg.Connection, applied: list[AppliedMigration]
) -> Migration | None:
    """The pending migrations up to the first that runs outside a transaction, in one
    transaction; returns that one (None: nothing is left)."""
    async with conn.transaction():
        await conn.execute(QUERIES["migration_lock"], MIGRATION_LOCK_KEY)
        await conn.execute(QUERIES["create_version_table"])
        done = {row["version"] for row in await conn.fetch(QUERIES["applied_versions"])}
        todo = [m for m in migrations("postgres") if m.version not in done]
        batch = list(takewhile(lambda m: m.transactional, todo))
        if batch:  # (none: another replica applied them while we waited)
            # Migrators queue on the advisory lock, so only this one upgrades its read's
            # ACCESS SHARE: no deadlock with another.
            timeout_ms = int(MIGRATION_LOCK_TIMEOUT * 1000)
            await conn.execute(formatted(QUERIES["lock_timeout_local"], milliseconds=timeout_ms))
            await conn.execute(QUERIES["migration_lock_versions"])
        for migration in batch:
            await conn.execute(migration.sql)
            await conn.execute(QUERIES["record_version"], migration.version, migration.name)
            applied.append(AppliedMigration(migration.version, migration.name))
        if batch:
            await conn.execute(QUERIES["migration_wake_leaders"])
    rest = todo[len(batch) :]
    return rest[0] if rest else None


async def _apply_outside(
    conn: asyncpg.Connection, migration: Migration, applied: list[AppliedMigration]
) -> None:
    """One migration outside a transaction, a statement at a time, under a lock of its own
    held by this session; recorded once all its statements ran.

    The lock is not the migrations' (MIGRATION_LOCK_KEY), and it is taken by polling, not
    by a blocking wait: CREATE INDEX CONCURRENTLY waits for every transaction with an older
    snapshot, and a migrator blocked on a lock keeps the snapshot of its waiting
    statement. Had it waited on a lock this session holds, the two would deadlock (seen:
    ten concurrent `migrate`s)."""
    while True:  # (a lock, not an event: another process holds it)
        if await conn.fetchval(QUERIES["migration_session_lock"], MIGRATION_OUTSIDE_LOCK_KEY):
            break
        await asyncio.sleep(OUTSIDE_LOCK_POLL)
    try:
        done = {row["version"] for row in await conn.fetch(QUERIES["applied_versions"])}
        if migration.version in done:  # another replica did it while we waited
            return
        # Not under the session's statement_timeout (30 s by default): an index built
        # concurrently on a big table takes minutes, and a retry starts it over.
        await conn.execute(QUERIES["statement_timeout_off"])
        for statement in migration.statements:
            await conn.execute(statement)
        async with conn.transaction():
            await conn.execute(QUERIES["record_version"], migration.version, migration.name)
            await conn.execute(QUERIES["migration_wake_leaders"])
        applied.append(AppliedMigration(migration.version, migration.name))
    finally:
        await conn.execute(QUERIES["migration_session_unlock"], MIGRATION_OUTSIDE_LOCK_KEY)


def _cannot_migrate(
    url: DatabaseUrl, pending: Sequence[Migration], exc: asyncpg.PostgresError
) -> PrivilegeRefused:
    """A migration refused for a privilege: with the usual split of roles, a runtime role
    started against a schema its owner has not upgraded yet. Say which migrations wait."""
    names = ", ".join(f"{m.version:04d}_{m.name}" for m in pending)
    message = " ".join(redact(str(exc)).split())  # one line, DETAIL included
    return PrivilegeRefused(
        f"database {url}: cannot apply migrations {names}: {message} "
        "(SQLSTATE 42501): run `scheduler-daemon migrate` as the role that owns the "
        "scheduler's tables first, or give this role CREATE on the schema "
        "(docs/security.md)"
    )
