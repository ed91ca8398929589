"""Open the configured store: pick the backend from the URL, retry within a startup budget."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from ..config import Settings
from ..errors import DatabaseUnavailable, describe
from ..logs import Logger
from .base import Store

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

    Raises :class:`DatabaseUnavailable` (exit 69) with the last error, password redacted.
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
    runs out; then, or at once for any other error, :class:`DatabaseUnavailable`."""
    budget = settings.database.startup_budget
    deadline = time.monotonic() + budget
    backoff = Backoff()
    while True:
        try:
            return await attempt()
        except Exception as exc:
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


def is_transient(exc: BaseException) -> bool:
    """Errors that say "not now" rather than "never": the server is down, starting,
    unreachable or busy; a deadlock, serialization failure, lock or statement timeout.
    Worth retrying later. Authentication failures, unknown databases and bad data are not:
    retrying would only hide the message.
    """
    import sqlite3

    import asyncpg

    if isinstance(exc, OSError | TimeoutError | ConnectionError):
        return True
    if isinstance(exc, sqlite3.OperationalError):
        return "locked" in str(exc) or "busy" in str(exc)
    return isinstance(
        exc,
        asyncpg.PostgresConnectionError
        | asyncpg.InterfaceError
        | asyncpg.CannotConnectNowError
        | asyncpg.TooManyConnectionsError
        | asyncpg.TransactionRollbackError
        | asyncpg.LockNotAvailableError
        | asyncpg.QueryCanceledError,
    )
