"""The daemon's own exceptions, the exit codes they map to (see sysexits.h), and the rule
they carry out: bad input never stops the daemon (README promise 8).

Bad input is refused in one line where it arrives, or isolated where it runs; only a bug
ends the daemon. Where each kind is handled:

- configuration (environment, TOML): refused before anything starts, exit 78, one line
  naming the key or variable (``config/explain.py``, ``ConfigError``);
- a login or privilege the database refuses: exit 78 at once, never retried
  (``LoginRefused``, ``PrivilegeRefused``; ``db/connect.py``, ``db/privileges.py``);
- an unreachable database: retried with backoff within ``database.startup_budget``, then
  exit 69 (``DatabaseUnavailable``; ``db/connect.py``); once running, the loops retry
  database trouble for ever (``loops/base.py``);
- a request refused by the CLI or ``Client`` (key, time, payload): exit 65, nothing
  changed (``InvalidInput``; ``client/pool.py``);
- a publisher that raises, or hangs past ``publish.publisher_timeout``: its batch is
  retried row by row and only the bad row fails (``loops/publish.py``);
- a plugin task that raises, or runs past its ``timeout``: the run is recorded failed or
  timed_out and the loop goes on (``loops/plugin_runs.py``);
- anything else escaping a loop's leadership (the guard, its hooks, a service such as
  the webhook deliverer) is a bug: the loop ends and the daemon exits 70 with a traceback
  (``loops/base.py``, ``daemon.py``); a command prints one line and its code
  (``handles_errors`` in ``cli/common.py``);
- the one exception: an error inside a tick, a bug or not, is logged with its traceback
  (``tick.failed``; the ``SchedulerTicksFailing`` alert) and the tick is tried again next
  interval, the other loop going on (``loops/base.py``).

The proof is ``tests/test_bad_input.py``; docs/guarantees.md has the whole map.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from .redact import redact

EXIT_OK = 0
EXIT_DATAERR = 65  # EX_DATAERR: a request (schedule, cancel, …) was refused
EXIT_NOINPUT = 66  # EX_NOINPUT: the database has no scheduler schema yet (run `migrate`)
EXIT_UNAVAILABLE = 69  # EX_UNAVAILABLE: the database could not be reached in time
EXIT_SOFTWARE = 70  # EX_SOFTWARE: a loop died, or work could not be stopped; restart us
EXIT_TEMPFAIL = 75  # EX_TEMPFAIL: the database is busy (locked); try again
EXIT_CONFIG = 78  # EX_CONFIG: invalid configuration, or the database refused a login/privilege


class SchedulerError(Exception):
    """Base class: an error the daemon explains in one line instead of a traceback."""

    exit_code = 1


class ConfigError(SchedulerError):
    exit_code = EXIT_CONFIG


class LoginRefused(ConfigError):
    """The database answered and refused us: a wrong password, an unknown role or
    database, no ``pg_hba.conf`` entry. Retrying cannot help until the configuration (or
    the database's) changes, so it is a configuration error, not an unavailable database."""


class PrivilegeRefused(ConfigError):
    """The database refused a statement for lack of a privilege (SQLSTATE 42501): the
    configured role may log in but not use the scheduler's tables (or create them).
    Retrying cannot help until someone grants it, so it is configuration, not
    unavailability."""


class DatabaseUnavailable(SchedulerError):
    exit_code = EXIT_UNAVAILABLE


class SchemaMissing(SchedulerError):
    """The database (or SQLite file) has no scheduler schema: never migrated."""

    exit_code = EXIT_NOINPUT


class DatabaseBusy(SchedulerError):
    """The database could not do it now: SQLite's write lock stayed taken past
    ``busy_timeout``, a lock or statement timeout, a deadlock. Nothing was changed; the
    same command may succeed later."""

    exit_code = EXIT_TEMPFAIL


class DatabaseFailed(SchedulerError):
    """The database refused a statement for a reason none of the others covers (a damaged
    file, a row edited by hand into a shape the code does not expect, a bug)."""

    exit_code = EXIT_SOFTWARE


class InvalidInput(SchedulerError):
    """A request (schedule, cancel, …) was refused; nothing was changed."""

    exit_code = EXIT_DATAERR


class NotFound(InvalidInput):
    pass


def describe(exc: BaseException) -> str:
    """An exception as one line for logs and stored errors, passwords removed.

    An exception without a message says what it is rather than ``"TimeoutError: "``: a
    timeout reads ``"TimeoutError: timed out"``, another the first line of its class's
    docstring (``"ConnectionResetError: Connection reset."``); either adds the exception
    it was raised from, if that one has a message.
    """
    message = str(exc).strip() or _without_message(exc)
    # asyncpg puts the server's DETAIL and HINT on lines of their own: one line here.
    message = " ".join(line.strip() for line in message.splitlines() if line.strip())
    return redact(f"{type(exc).__name__}: {message}")


@contextmanager
def explain_timeouts(message: str) -> Iterator[None]:
    """A bare ``TimeoutError`` raised inside (asyncpg's connect and command timeouts,
    ``asyncio.timeout``) becomes one that says what timed out, e.g. ``"connecting to the
    database: no answer within 2s (database.connect_timeout)"``. Still a ``TimeoutError``,
    so the callers' retry decisions are unchanged; one with a message is left alone."""
    try:
        yield
    except TimeoutError as exc:
        if str(exc).strip():
            raise
        raise TimeoutError(message) from exc


def _without_message(exc: BaseException) -> str:
    doc = type(exc).__doc__ if type(exc) not in (Exception, BaseException) else None
    if isinstance(exc, TimeoutError):
        what = "timed out"
    elif doc and doc.strip():
        what = doc.strip().splitlines()[0]
    else:
        what = "(no message)"
    cause = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    if cause is not None and str(cause).strip():
        what += f" ({describe(cause)})"
    return what
