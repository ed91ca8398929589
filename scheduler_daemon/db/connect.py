"""Open the configured store: pick the backend from the URL, retry within a startup budget."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from ..config import Settings
from ..errors import ConfigError, DatabaseUnavailable, LoginRefused, describe
from ..logs import Logger
from .base import Store
from .url import redact

T = TypeVar("T")


async def open_store(settings: Settings) -> Store:
    """One attempt to open the configured store."""
    if settings.database_url.backend == "postgres":
        from .postgres import PostgresStore

        return await PostgresStore.open(settings)
    from .sqlite import SqliteStore

    return await SqliteStore.open(settings)


class Backoff:
    """Exponential backoff with full jitter, so restarted replicas do not retry in step."""

    def __init__(self, initial: float = 0.1, maximum: float = 5.0) -> None:
        self.initial = initial
        self.maximum = maximum
        self.attempt = 0

    def next_delay(self) -> float:
        ceiling = min(self.maximum, self.initial * 2**self.attempt)
        self.attempt += 1
        return random.uniform(ceiling / 2, ceiling)

    def reset(self) -> None:
        self.attempt = 0


async def connect(settings: Settings, log: Logger) -> Store:
    """Open the store, retrying with backoff until ``database.startup_budget`` runs out.

    Raises :class:`DatabaseUnavailable` (exit 69) with the last error, password redacted;
    :class:`LoginRefused` (exit 78) at once if the database refuses the login.
    """
    timeout = settings.database.connect_timeout * 2
    return await within_startup_budget(
        lambda: asyncio.wait_for(open_store(settings), timeout=timeout),
        settings,
        log,
        failed_event="db.connect_failed",
    )


async def within_startup_budget(
    attempt: Callable[[], Awaitable[T]], settings: Settings, log: Logger, failed_event: str
) -> T:
    """Run ``attempt`` until it succeeds. Transient errors (see :func:`is_transient`) are
    retried with backoff, each logged as ``failed_event``, until ``database.startup_budget``
    runs out; then, or at once for any other error, :class:`DatabaseUnavailable`. A login
    the database refuses (see :func:`is_login_refused`) raises :class:`LoginRefused`
    (exit 78) at once: a supervisor must not restart us in a loop until someone fixes it."""
    budget = settings.database.startup_budget
    deadline = time.monotonic() + budget
    backoff = Backoff()
    while True:
        try:
            return await attempt()
        except ConfigError:
            raise  # refused configuration (e.g. an unsafe SQLite file): exit 78, not 69
        except Exception as exc:
            if is_login_refused(exc):
                raise LoginRefused(
                    f"database_url {settings.database_url}: the database refused the login: "
                    f"{redact(str(exc))}"
                ) from None
            error = describe(exc)
            if not is_transient(exc):
                raise DatabaseUnavailable(f"database {settings.database_url}: {error}") from None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DatabaseUnavailable(
                    f"database {settings.database_url} unreachable for {budget:g}s "
                    f"(database.startup_budget): {error}"
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

    if isinstance(exc, sqlite3.OperationalError):
        return "locked" in str(exc) or "busy" in str(exc)
    if isinstance(exc, asyncpg.InterfaceError):
        # The connection is closed, or in use by something else. Its subclasses are about
        # the call, not the moment: a parameter that cannot be encoded (DataError, a bad
        # payload value), a client or server feature or setting that is missing.
        return not isinstance(
            exc,
            pg.DataError
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
