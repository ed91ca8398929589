"""Open the configured store: pick the backend from the URL, retry within a budget; and
tell what a database error means (retry, fix the configuration, migrate, try later)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from typing import Literal, TypeVar
from urllib.parse import urlsplit

from ..config.settings import Settings
from ..config.url import DatabaseUrl
from ..errors import (
    DatabaseBusy,
    DatabaseFailed,
    DatabaseUnavailable,
    LoginRefused,
    PrivilegeRefused,
    SchedulerError,
    SchemaMissing,
    describe,
    explain_timeouts,
)
from ..logs import Logger
from ..redact import redact
from .base import Store

T = TypeVar("T")

#: Which ``database.*`` setting bounds the retries: the daemon's start waits long (for a
#: database starting with it), a command someone is waiting for does not.
Budget = Literal["startup_budget", "command_budget"]


async def open_store(settings: Settings, *, create: bool = True) -> Store:
    """One attempt to open the configured store. ``create=False``: a SQLite file that does
    not exist is :class:`SchemaMissing`, and is not created (PostgreSQL: no effect)."""
    if settings.database_url.backend == "postgres":
        from .postgres import PostgresStore

        return await PostgresStore.open(settings)
    from .sqlite import SqliteStore

    return await SqliteStore.open(settings, create=create)


class Backoff:
    """Exponential backoff with full jitter, so restarted replicas do not retry in step."""

    def __init__(self, initial: float = 0.1, maximum: float = 5.0) -> None:
        self.initial = initial
        self.maximum = maximum
        self.attempt = 0

    def next_delay(self) -> float:
        # The exponent is capped: 2**1024 no longer converts to a float (OverflowError).
        ceiling = min(self.maximum, self.initial * 2 ** min(self.attempt, 64))
        self.attempt += 1
        return random.uniform(ceiling / 2, ceiling)

    def reset(self) -> None:
        self.attempt = 0


async def connect(
    settings: Settings,
    log: Logger,
    *,
    create: bool = True,
    budget: Budget = "startup_budget",
) -> Store:
    """Open the store, retrying with backoff until ``database.<budget>`` runs out.

    Raises :class:`DatabaseUnavailable` (exit 69) with the last error, password redacted;
    :class:`LoginRefused` (exit 78) at once if the database refuses the login. ``create``:
    see :func:`open_store`.
    """
    timeout = settings.database.connect_timeout

    async def attempt() -> Store:
        # The pool's connections time out at connect_timeout, opening it all at twice that.
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for answers a cancellation
        # that lands as the attempt fails with the attempt's error, and the retry loop
        # below would go on connecting after a stop (tests/test_store.py).
        with explain_timeouts(
            f"connecting: no answer in time (database.connect_timeout {timeout:g}s)"
        ):
            async with asyncio.timeout(timeout * 2):
                return await open_store(settings, create=create)

    return await within_startup_budget(
        attempt, settings, log, failed_event="db.connect_failed", budget=budget
    )


async def within_startup_budget(
    attempt: Callable[[], Awaitable[T]],
    settings: Settings,
    log: Logger,
    failed_event: str,
    budget: Budget = "startup_budget",
) -> T:
    """Run ``attempt`` until it succeeds. Transient errors (see :func:`is_transient`) are
    retried with backoff, each logged as ``failed_event``, until ``database.<budget>`` runs
    out; then, or at once for any other error, :class:`DatabaseUnavailable`. A login the
    database refuses (see :func:`is_login_refused`) raises :class:`LoginRefused`, a
    missing privilege :class:`PrivilegeRefused` (both exit 78), at once: a supervisor
    must not restart us in a loop until someone fixes it."""
    seconds: float = getattr(settings.database, budget)
    deadline = time.monotonic() + seconds
    backoff = Backoff()
    while True:
        try:
            return await attempt()
        except SchedulerError:
            raise  # already explained (e.g. an unsafe SQLite file: exit 78, not 69)
        except Exception as exc:
            refused = _refusal(exc, settings.database_url)
            if refused is not None:
                raise refused from None
            error = describe(exc)
            if not is_transient(exc):
                raise DatabaseUnavailable(f"database {settings.database_url}: {error}") from None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DatabaseUnavailable(
                    f"database {settings.database_url} unreachable for {seconds:g}s "
                    f"(database.{budget}): {error}"
                ) from None
            delay = min(backoff.next_delay(), remaining)
            log.warning(
                failed_event,
                url=str(settings.database_url),
                error=error,
                retry_in=round(delay, 3),
                attempt=backoff.attempt,
            )
            await asyncio.sleep(delay)


# SQLSTATE class 28 (invalid_authorization_specification: 28000 unknown role, no pg_hba.conf
# entry, role not allowed to log in; 28P01 wrong password) and 3D000 (invalid_catalog_name:
# no such database). The server says "never, as configured", not "not now".
_LOGIN_REFUSED_CLASSES = ("28",)
_LOGIN_REFUSED_CODES = ("3D000",)


def is_login_refused(exc: BaseException) -> bool:
    """The database answered and refused the login: a wrong password, an unknown role or
    database, a ``pg_hba.conf`` rule (asyncpg's ``InvalidPasswordError``,
    ``InvalidAuthorizationSpecificationError``, ``InvalidCatalogNameError``). A
    configuration error: retrying with the same settings gets the same answer."""
    import asyncpg

    if not isinstance(exc, asyncpg.PostgresError):
        return False
    sqlstate = getattr(exc, "sqlstate", None)
    if not isinstance(sqlstate, str):
        return False
    return sqlstate.startswith(_LOGIN_REFUSED_CLASSES) or sqlstate in _LOGIN_REFUSED_CODES


def is_privilege_refused(exc: BaseException) -> bool:
    """SQLSTATE 42501 (insufficient_privilege): the role may log in but not do this (read
    or write a scheduler table, create the schema). Configuration, like a refused login."""
    import asyncpg

    return isinstance(exc, asyncpg.PostgresError) and getattr(exc, "sqlstate", None) == "42501"


def _role(url: DatabaseUrl | None) -> str | None:
    if url is None or url.backend != "postgres":
        return None
    try:
        return urlsplit(url.secret()).username
    except ValueError:
        return None


def _refusal(exc: BaseException, url: DatabaseUrl | None) -> SchedulerError | None:
    """A refusal that retrying cannot change (exit 78): the login, or a privilege."""
    # One line: the server's DETAIL comes on a line of its own ("User does not have
    # CONNECT privilege.") and says which privilege.
    message = " ".join(redact(str(exc)).split())
    if is_login_refused(exc):
        return LoginRefused(f"database_url {url}: the database refused the login: {message}")
    if is_privilege_refused(exc):
        role = _role(url)
        to = f" to the role {role!r}" if role else ""
        return PrivilegeRefused(
            f"database {url}: {message} (SQLSTATE 42501): grant that privilege{to}, "
            "or set database_url to a role that has it"
        )
    return None


def explain_database_error(exc: BaseException, url: DatabaseUrl) -> SchedulerError | None:
    """What an error a database call raised means, as one line and an exit code for the
    command line: a refusal (78: login, privilege), no schema (66: run ``migrate``), busy
    (75: SQLite's write lock, a lock or statement timeout, a deadlock: try again),
    unreachable (69), or any other error the database raised (70). None for an exception
    that is not the database's (a bug)."""
    import sqlite3

    import asyncpg

    if isinstance(exc, SchedulerError):
        return exc
    refused = _refusal(exc, url)
    if refused is not None:
        return refused
    where = f"database {url}"
    message = redact(str(exc))
    if isinstance(exc, asyncpg.UndefinedTableError) or (
        isinstance(exc, sqlite3.OperationalError) and message.startswith("no such table")
    ):
        # PostgreSQL hides a schema the role may not use (no USAGE) from name lookup.
        hidden = "" if url.backend != "postgres" else (
            " (if it was run: this role may lack USAGE on the tables' schema, or not have "
            "it on its search_path)"
        )  # fmt: skip
        return SchemaMissing(
            f"{where}: schema not found ({message}): run `scheduler-daemon migrate`{hidden}"
        )
    if isinstance(exc, sqlite3.OperationalError) and _database_says_not_now(exc):
        return DatabaseBusy(
            f"{where}: {message}: another process held the write lock for longer than "
            "database.statement_timeout; nothing was changed, try again"
        )
    if isinstance(
        exc,
        asyncpg.LockNotAvailableError
        | asyncpg.QueryCanceledError
        | asyncpg.TransactionRollbackError,
    ):
        return DatabaseBusy(f"{where}: {describe(exc)}; nothing was changed, try again")
    # Not is_transient: any OSError (a full disk, a file's permissions) is no outage.
    if is_transient_database_error(exc) or isinstance(exc, ConnectionError | TimeoutError):
        return DatabaseUnavailable(f"{where}: {describe(exc)}")
    if isinstance(exc, asyncpg.PostgresError | asyncpg.InterfaceError | sqlite3.Error):
        return DatabaseFailed(f"{where}: {describe(exc)}")
    return None


def is_transient(exc: BaseException) -> bool:
    """Errors that say "not now" rather than "never", from connecting or talking to the
    database: the server is down, starting, unreachable or busy (including a plain
    ``OSError``/``TimeoutError`` from the socket); a deadlock, serialization failure, lock
    or statement timeout. Worth retrying later. Authentication failures, unknown databases
    and bad data are not: retrying would only hide the message.

    For code that runs other people's code between database calls (publishers), a bare
    ``OSError`` says nothing about the database: use :func:`is_transient_database_error`.
    """
    if isinstance(exc, OSError | TimeoutError | ConnectionError):
        return True
    return _database_says_not_now(exc)


def is_transient_database_error(exc: BaseException) -> bool:
    """An error *raised by the database driver* (asyncpg, sqlite3) that says "not now":
    the connection is lost or closed, the server is shutting down or out of resources, a
    deadlock or serialization failure, a lock or statement timeout, SQLite busy/locked.

    Unlike :func:`is_transient`, ``OSError`` and ``TimeoutError`` do not count: a
    publisher's own network call raises those too, and a row that always makes it raise
    must fail, not be retried for ever. (A connection that really died shows itself as a
    driver error on the next statement, the savepoint's rollback included.) An exception
    raised explicitly ``from`` such a driver error counts, so a publisher that wraps the
    database's error keeps its meaning.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if _database_says_not_now(current):
            return True
        seen.add(id(current))
        current = current.__cause__
    return False


def _database_says_not_now(exc: BaseException) -> bool:
    import sqlite3

    import asyncpg
    from asyncpg import exceptions as pg
    from asyncpg.exceptions import _base as client  # where asyncpg's client-side errors live

    if isinstance(exc, sqlite3.OperationalError):
        return "locked" in str(exc) or "busy" in str(exc)
    if isinstance(exc, asyncpg.InterfaceError):
        # The connection is closed, or in use by something else. Its subclasses are about
        # the call, not the moment: a parameter that cannot be encoded (DataError, a bad
        # payload value), a client or server feature or setting that is missing.
        # (pg.DataError is the server's SQLSTATE class 22, a PostgresError: not this one.)
        return not isinstance(
            exc,
            client.DataError
            | pg.ClientConfigurationError
            | pg.UnsupportedClientFeatureError
            | pg.UnsupportedServerFeatureError,
        )
    if isinstance(exc, asyncpg.TransactionRollbackError):  # 40xxx: deadlock, serialization
        return not isinstance(exc, pg.TransactionIntegrityConstraintViolationError)
    return isinstance(
        exc,
        asyncpg.PostgresConnectionError
        | pg.OutdatedSchemaCacheError  # a concurrent schema change: the retry re-prepares
        | asyncpg.CannotConnectNowError  # 57P03: starting up or shutting down
        | asyncpg.AdminShutdownError  # 57P01: terminated (pg_terminate_backend, shutdown)
        | asyncpg.CrashShutdownError  # 57P02
        | pg.IdleSessionTimeoutError  # 57P05
        | asyncpg.InsufficientResourcesError  # 53xxx: too many connections, disk full, memory
        | asyncpg.LockNotAvailableError  # 55P03: lock_timeout, NOWAIT
        | asyncpg.QueryCanceledError,  # 57014: statement_timeout, pg_cancel_backend
    )


def is_database_error(exc: BaseException) -> bool:
    """Whether ``exc`` came from the database or the way to it: anything the server or
    the driver raised (a refused statement too), an error of the socket, a timeout. A
    loop backs off and competes again on these; anything else is a bug, which no retry
    fixes (loops/base.py)."""
    import sqlite3

    import asyncpg
    from asyncpg.exceptions import _base as client

    from ..errors import DatabaseBusy, DatabaseFailed, DatabaseUnavailable

    return isinstance(
        exc,
        asyncpg.PostgresError
        | asyncpg.InterfaceError
        | client.InternalClientError
        | sqlite3.Error
        | OSError
        | TimeoutError
        | DatabaseUnavailable
        | DatabaseBusy
        | DatabaseFailed,
    )
