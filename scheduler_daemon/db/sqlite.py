"""The SQLite store, on aiosqlite: the embedded, single-host default.

One connection per process, in autocommit mode with explicit ``BEGIN IMMEDIATE``
transactions, serialised by an asyncio lock: SQLite has one writer at a time anyway, and
interleaving two coroutines' statements on one connection would mix their transactions.
Other processes on the same file wait on ``busy_timeout``. Reads (plain statements, or a
``transaction(readonly=True)``) take no write lock: in WAL mode they never wait for the
writer.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import os
import re
import sqlite3
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager, suppress
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import quote

import aiosqlite

from ..config.settings import Settings
from ..config.url import DatabaseUrl
from ..errors import ConfigError, SchemaMissing
from . import publications
from .base import (
    COUNT_LIMIT,
    AppliedMigration,
    Capabilities,
    CommitWatch,
    DatabaseFile,
    Publication,
    PublicationFilter,
    PublicationStats,
    ScheduleResult,
    ShardScope,
    TableHealth,
)
from .common import to_db_time
from .sqlfiles import formatted, migrations, queries

if TYPE_CHECKING:
    from .privileges import Grants
from .sqlite_file import check_database_file, real_path

QUERIES = queries("sqlite")
_UNIX_EPOCH_JD = 2440587.5


# SQLite's own grammar for a date and time (date.c), which rows written by hand may use and
# fromisoformat() reads only part of: a date, then optionally (after any run of spaces and
# T's, none included) HH:MM[:SS[.digits]] and a zone (spaces, then Z, z or ±HH:MM), then
# spaces. Fields are not range-checked here: julianday() has accepted the row already.
_SPACE = "[ \t\n\v\f\r]"
_SQLITE_TIME = re.compile(
    rf"([0-9]{{4}})-([0-9]{{2}})-([0-9]{{2}})(?:(?:{_SPACE}|T)*([0-9]{{2}}):([0-9]{{2}})"
    rf"(?::([0-9]{{2}})(?:\.([0-9]+))?)?{_SPACE}*(?:[zZ]|([+-])([0-9]{{2}}):([0-9]{{2}}))?)?"
    rf"{_SPACE}*"
)


def _from_sqlite_grammar(value: str) -> datetime | None:
    match = _SQLITE_TIME.fullmatch(value)
    if match is None:
        return None
    year, month, day, hour, minute, second, fraction, sign, zone_h, zone_m = match.groups()
    # Day and hour arithmetic as SQLite's (2027-02-31 is 3 March, 24:00 the next day).
    parsed = datetime(int(year), int(month), 1, tzinfo=UTC) + timedelta(
        days=int(day) - 1,
        hours=int(hour or 0),
        minutes=int(minute or 0),
        seconds=int(second or 0),
        microseconds=int((fraction or "0")[:6].ljust(6, "0")),
    )
    if sign is not None:
        offset = timedelta(hours=int(zone_h), minutes=int(zone_m))
        parsed = parsed - offset if sign == "+" else parsed + offset
    return parsed


def from_db_time(value: str | float | None) -> datetime | None:
    """Our own writes are ISO 8601; rows written by hand may hold anything julianday()
    accepts that starts with a date, or a Julian day number (migration 0005's triggers)."""
    if value is None:
        return None
    if isinstance(value, int | float):
        return from_julian_day(float(value))
    try:
        parsed = datetime.fromisoformat(value.replace(" ", "T"))
    except ValueError:
        written = _from_sqlite_grammar(value)
        if written is not None:
            return written
        try:
            return from_julian_day(float(value))
        except ValueError:
            raise ValueError(f"not a time SQLite understands here: {value!r}") from None
    return parsed.replace(tzinfo=UTC) if parsed.tzinfo is None else parsed.astimezone(UTC)


def from_julian_day(value: float | None) -> datetime | None:
    if value is None:
        return None
    return datetime(1970, 1, 1, tzinfo=UTC) + timedelta(days=value - _UNIX_EPOCH_JD)


def split_script(script: str) -> list[str]:
    """Split a migration into statements; ``complete_statement`` understands triggers.

    (``executescript`` would be simpler but commits any open transaction first, which
    would let a half-applied migration be recorded.)
    """
    statements, current = [], ""
    for piece in script.split(";"):
        current += piece + ";"
        if sqlite3.complete_statement(current):
            if current.strip(" \n\t;"):
                statements.append(current.strip())
            current = ""
    if current.strip(" \n\t;"):
        raise ValueError(f"incomplete SQL statement at end of script: {current[:80]!r}")
    return statements


@functools.cache
def _statements(query: str) -> tuple[str, ...]:
    """A named query's statements (more than one where SQLite needs a script)."""
    return tuple(split_script(QUERIES[query]))


def _publication(row: sqlite3.Row) -> Publication:
    return Publication(**from_db_row(row))


# Columns holding times in our schema; SQLite stores them as text, callers get datetimes.
TIME_COLUMNS = frozenset(
    {"publish_at", "published_at", "created_at", "updated_at", "now", "next_run_at",
     "trigger_requested_at", "last_slot", "last_started_at", "last_finished_at", "slot",
     "started_at", "finished_at", "acquired_at", "heartbeat_at"}
)  # fmt: skip


def to_db_value(value: Any) -> Any:
    if isinstance(value, datetime):
        return to_db_time(value)
    if isinstance(value, list | tuple):
        return json.dumps(list(value))
    return value


def from_db_row(row: sqlite3.Row) -> dict[str, Any]:
    data = dict(row)
    for column in TIME_COLUMNS.intersection(data):
        data[column] = from_db_time(data[column])
    if isinstance(data.get("payload"), str):  # jsonb comes back decoded on PostgreSQL
        data["payload"] = json.loads(data["payload"])
    return data


class SqliteTx:
    def __init__(self, conn: aiosqlite.Connection, fencing_token: int | None = None) -> None:
        self.conn = conn
        self.fencing_token = fencing_token
        self.shards: ShardScope | None = (
            None  # sharding is PostgreSQL's (config/settings.py refuses it)
        )
        self._savepoints = itertools.count()

    async def execute(self, sql: str, statement_timeout: float | None = None) -> None:
        for statement in split_script(sql):
            await self.conn.execute(statement)

    async def fetch(self, query: str, *args: Any) -> list[dict[str, Any]]:
        params = tuple(to_db_value(arg) for arg in args)
        async with self.conn.execute(QUERIES[query], params) as cursor:
            return [from_db_row(row) for row in await cursor.fetchall()]

    async def query(self, query: str, **params: Any) -> list[dict[str, Any]]:
        values = {name: to_db_value(value) for name, value in params.items()}
        rows: list[dict[str, Any]] = []
        for statement in _statements(query):
            async with self.conn.execute(statement, values) as cursor:
                rows += [from_db_row(row) for row in await cursor.fetchall()]
        return rows

    async def run(self, sql: str, *args: Any) -> None:
        await self.conn.execute(sql, tuple(to_db_value(arg) for arg in args))

    async def run_many(self, sql: str, args: Sequence[Sequence[Any]]) -> None:
        await self.conn.executemany(sql, [tuple(to_db_value(a) for a in row) for row in args])

    @asynccontextmanager
    async def savepoint(self) -> AsyncIterator[None]:
        name = f"sp_{next(self._savepoints)}"
        await self.conn.execute(f"SAVEPOINT {name}")
        try:
            yield
        except BaseException:
            await self.conn.execute(f"ROLLBACK TO {name}")
            await self.conn.execute(f"RELEASE {name}")
            raise
        await self.conn.execute(f"RELEASE {name}")


class SqliteStore:
    backend: Final = "sqlite"
    capabilities: Final = Capabilities(advisory_locks=False)

    def __init__(
        self, url: DatabaseUrl, conn: aiosqlite.Connection, file: Path | None = None
    ) -> None:
        self.url = url
        self.conn = conn
        self._file = file
        self._lock = asyncio.Lock()
        # The last clean-up of a transaction whose caller was cancelled (see _settle).
        self._settling: asyncio.Task[None] | None = None

    @property
    def commit_watch(self) -> CommitWatch:
        return self

    async def refuse_missing_grants(self, need: Grants) -> None:
        pass  # no roles: whoever can open the file can do everything

    @property
    def path(self) -> Path:
        """The database file's real path (symlinks resolved when the store opened): what
        the leader locks are named from, however ``database_url`` spells it."""
        if self._file is not None:
            return self._file
        path = self.url.sqlite_path
        assert path is not None  # DatabaseUrl refuses in-memory databases
        return real_path(path)

    @classmethod
    async def open(cls, settings: Settings, *, create: bool = True) -> SqliteStore:
        """Open the database file; create it if it does not exist and ``create`` is true.

        Without ``create`` (the CLI's commands other than ``migrate``) a missing file is
        :class:`SchemaMissing` and nothing is left behind. A file or directory this user
        cannot write is :class:`ConfigError` (exit 78), naming the path.
        """
        path = settings.database_url.sqlite_path
        assert path is not None
        if not path.parent.is_dir():
            # Configuration: no amount of waiting or restarting creates the directory.
            raise ConfigError(
                f"database_url {settings.database_url}: directory {path.parent} does not exist"
            )
        # Refuses (ConfigError, exit 78) a hard-linked file or a network filesystem.
        real = check_database_file(path)
        if not real.exists():
            if not create:
                raise SchemaMissing(
                    f"database {settings.database_url}: schema not found (no such file "
                    f"{real}): run `scheduler-daemon migrate` to create it"
                )
            if not os.access(real.parent, os.W_OK | os.X_OK):
                raise ConfigError(
                    f"database_url: cannot create {real}: this user (uid {os.geteuid()}) "
                    f"may not write to the directory {real.parent}"
                )
        elif not os.access(real, os.R_OK | os.W_OK):
            raise ConfigError(
                f"database_url: {real} is not readable and writable by this user "
                f"(uid {os.geteuid()})"
            )
        # mode=rw: never create the file here unless asked to (the check above could race
        # with a file being removed).
        mode = "rwc" if create else "rw"
        conn = await aiosqlite.connect(
            f"file:{quote(str(real))}?mode={mode}", uri=True, isolation_level=None
        )
        try:
            conn.row_factory = sqlite3.Row
            busy_ms = int(settings.database.statement_timeout * 1000)
            pragmas = formatted(QUERIES["connection_settings"], busy_ms=busy_ms)
            for statement in split_script(pragmas):
                await conn.execute(statement)
        except BaseException:
            await conn.close()
            raise
        return cls(settings.database_url, conn, real)

    @asynccontextmanager
    async def transaction(self, *, readonly: bool = False) -> AsyncIterator[SqliteTx]:
        # A read is a deferred transaction: in WAL mode it neither waits for the writer
        # nor holds it up; it reads the last committed snapshot.
        async with self._transaction("BEGIN" if readonly else "BEGIN IMMEDIATE") as conn:
            yield SqliteTx(conn)

    def write_transaction(self) -> AbstractAsyncContextManager[aiosqlite.Connection]:
        """``BEGIN IMMEDIATE``: take the write lock up front, so two writers queue on
        ``busy_timeout`` instead of failing later with SQLITE_BUSY on upgrade."""
        return self._transaction("BEGIN IMMEDIATE")

    @asynccontextmanager
    async def _transaction(self, begin: str) -> AsyncIterator[aiosqlite.Connection]:
        await self._lock.acquire()
        # The last statement sent (BEGIN, COMMIT or ROLLBACK): it runs to its end in
        # aiosqlite's thread whatever happens to our await of it, so it is awaited
        # shielded, for _settle to see how it ended.
        statement: asyncio.Future[Any] | None = None
        try:
            statement = self._send(begin)
            await asyncio.shield(statement)
            try:
                yield self.conn
            except BaseException as exc:
                if isinstance(exc, asyncio.CancelledError):
                    # The statement keeps running in aiosqlite's thread after the await
                    # is cancelled (a timed-out SQL task, a shutdown): stop it, or the
                    # ROLLBACK queued behind it would wait for ever.
                    await self.conn.interrupt()
                # An interrupted write has already been rolled back by SQLite itself; a
                # second ROLLBACK would fail and hide the original exception.
                if self.conn.in_transaction:
                    statement = self._send("ROLLBACK")
                    await asyncio.shield(statement)
                raise
            statement = self._send("COMMIT")
            await asyncio.shield(statement)
        finally:
            # Left with a statement still running (we were cancelled meanwhile) or a
            # transaction still open (cancelled just as BEGIN ended, a COMMIT that
            # failed): _settle ends it, and only then lets the lock go.
            if statement is not None and (not statement.done() or self.conn.in_transaction):
                self._settling = asyncio.create_task(self._settle(statement), name="sqlite:settle")
            else:
                self._lock.release()

    def _send(self, sql: str) -> asyncio.Future[Any]:
        return asyncio.ensure_future(self.conn.execute(sql))

    async def _settle(self, statement: asyncio.Future[Any]) -> None:
        """End the transaction a cancelled caller left behind, then release the lock.

        A BEGIN IMMEDIATE whose await was cancelled still runs in aiosqlite's thread: at
        once, or once that thread gets the CPU (a loaded machine), or once another
        process lets the write lock go (it waits up to busy_timeout, which no interrupt
        cuts short). Nobody would end the transaction it begins: this process would hold
        the database's write lock for as long as it lives, every other process's write
        failing after busy_timeout (a new leader, granted the lock files, among them),
        and its own next BEGIN failing too. Rolled back here, before anything else of ours
        runs on the connection; the cancelled caller does not wait for it (a leader's work
        must stop within stop_grace, not busy_timeout)."""
        try:
            with suppress(Exception):  # the caller's outcome, and the caller is gone
                await statement
            if self.conn.in_transaction:  # it began, or a COMMIT failed
                await self.conn.execute("ROLLBACK")
        finally:
            self._lock.release()

    async def migrate(self) -> list[AppliedMigration]:
        applied: list[AppliedMigration] = []
        async with self.write_transaction() as conn:
            await conn.execute(QUERIES["create_version_table"])
            async with conn.execute(QUERIES["applied_versions"]) as cursor:
                done = {row[0] for row in await cursor.fetchall()}
            for migration in migrations("sqlite"):
                if migration.version in done:
                    continue
                for statement in split_script(migration.sql):
                    await conn.execute(statement)
                await conn.execute(QUERIES["record_version"], (migration.version, migration.name))
                applied.append(AppliedMigration(migration.version, migration.name))
        return applied

    async def _fetchone(self, sql: str, params: tuple[Any, ...] = ()) -> sqlite3.Row | None:
        async with self._lock, self.conn.execute(sql, params) as cursor:
            row: sqlite3.Row | None = await cursor.fetchone()
            return row

    def files_changed_marker(self) -> tuple[int, ...]:
        """The database file's and its WAL's size and mtime: a change that costs a
        ``stat`` to notice (every commit, ours included, writes the WAL), to be confirmed
        with :meth:`data_version` only when it moved."""
        marker: list[int] = []
        file = self.path
        for path in (file, file.with_name(file.name + "-wal")):
            try:
                st = path.stat()
            except FileNotFoundError:
                marker += [0, 0]
            else:
                marker += [st.st_size, st.st_mtime_ns]
        return tuple(marker)

    async def data_version(self) -> int:
        """SQLite's ``PRAGMA data_version`` on our connection: it changes when another
        connection (another process) commits, never for our own commits. Cheap: it reads
        the WAL index in shared memory, no page of the database."""
        row = await self._fetchone(QUERIES["data_version"])
        assert row is not None
        return int(row[0])

    async def next_due_in(self) -> float | None:
        """Seconds until the earliest scheduled publication (negative: due), by the
        database's clock; None if nothing is scheduled."""
        row = await self._fetchone(QUERIES["next_due_in"])
        return None if row is None or row["seconds"] is None else float(row["seconds"])

    async def schema_version(self) -> int | None:
        exists = await self._fetchone(QUERIES["table_exists"], ("scheduler_schema_version",))
        if exists is None:
            return None
        row = await self._fetchone(QUERIES["schema_version"])
        return None if row is None else row[0]

    async def schedule(
        self, publish_at: datetime, payload_json: str, key: str | None
    ) -> ScheduleResult:
        async with self.transaction() as tx:
            return await publications.schedule(tx, publish_at, payload_json, key)

    async def cancel(self, publication_id: int) -> Publication:
        async with self.transaction() as tx:
            return await publications.cancel(tx, publication_id)

    async def get(self, publication_id: int) -> Publication | None:
        row = await self._fetchone(QUERIES["get"], (publication_id,))
        return None if row is None else _publication(row)

    async def get_by_key(self, key: str) -> Publication | None:
        row = await self._fetchone(QUERIES["get_by_key"], (key,))
        return None if row is None else _publication(row)

    async def find_publications(self, where: PublicationFilter) -> list[Publication]:
        # A plain read in autocommit (no BEGIN IMMEDIATE): WAL readers never wait for the
        # writer, nor hold it up.
        params = tuple(
            to_db_value(value)
            for value in (
                where.statuses, where.due_after, where.due_before, where.key,
                where.key_prefix, where.limit,
            )
        )  # fmt: skip
        async with self._lock, self.conn.execute(QUERIES["publications_find"], params) as cursor:
            rows = await cursor.fetchall()
        return [_publication(row) for row in rows]

    async def publication_stats(self, limit: int = COUNT_LIMIT) -> PublicationStats:
        row = await self._fetchone(QUERIES["publication_stats"], (limit,))
        assert row is not None
        return PublicationStats(row["scheduled"], row["due"], from_julian_day(row["next_due_jd"]))

    async def table_health(self) -> TableHealth:
        row = await self._fetchone(QUERIES["table_health"])
        assert row is not None
        wal = self.path.with_name(self.path.name + "-wal")
        try:
            # A reader that never ends keeps checkpoints from recycling the log, which
            # then grows: SQLite's counterpart of a held-back VACUUM.
            wal_bytes: int | None = wal.stat().st_size
        except FileNotFoundError:
            wal_bytes = None
        file = DatabaseFile(row["bytes"], row["page_size"], row["free_pages"], wal_bytes)
        return TableHealth(tables=None, oldest_snapshot=None, file=file)

    async def close(self) -> None:
        if self._settling is not None:
            # Its ROLLBACK first. Should that fail, closing rolls back all the same.
            with suppress(Exception):
                await self._settling
        await self.conn.close()
