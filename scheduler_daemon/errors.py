"""The daemon's own exceptions, and the exit codes they map to (see sysexits.h)."""

from __future__ import annotations

EXIT_OK = 0
EXIT_UNAVAILABLE = 69  # EX_UNAVAILABLE: the database could not be reached in time
EXIT_SOFTWARE = 70  # EX_SOFTWARE: a loop died, or work could not be stopped; restart us
EXIT_CONFIG = 78  # EX_CONFIG: the configuration is invalid (or the database refused the login)


class SchedulerError(Exception):
    """Base class: an error the daemon explains in one line instead of a traceback."""

    exit_code = 1


class ConfigError(SchedulerError):
    exit_code = EXIT_CONFIG


class LoginRefused(ConfigError):
    """The database answered and refused us: a wrong password, an unknown role or
    database, no ``pg_hba.conf`` entry. Retrying cannot help until the configuration (or
    the database's) changes, so it is a configuration error, not an unavailable database."""


class DatabaseUnavailable(SchedulerError):
    exit_code = EXIT_UNAVAILABLE


class InvalidInput(SchedulerError):
    """A request (schedule, cancel, …) was refused; nothing was changed."""

    exit_code = 65  # EX_DATAERR


class NotFound(InvalidInput):
    pass


def describe(exc: BaseException) -> str:
    """An exception as one line for logs and stored errors, passwords removed."""
    from .db.url import redact

    return redact(f"{type(exc).__name__}: {exc}")
