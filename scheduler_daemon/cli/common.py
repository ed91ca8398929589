"""What every command shares: the ``--config`` option, loading the settings, one
database (or :class:`Client`) per command, failures as one line and an exit code
(:func:`handles_errors`), and reading times (``--at``) and laying out tables.
"""

from __future__ import annotations

import asyncio
import functools
import os
import sys
import traceback
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import click

from ..client.pool import Client
from ..config import load_settings
from ..config.settings import Settings
from ..config.values import parse_duration
from ..db import Store
from ..db.connect import connect, explain_database_error
from ..errors import EXIT_SOFTWARE, InvalidInput, SchedulerError, describe
from ..logs import configure_logging, get_logger
from ..redact import redact

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")

config_option = click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="TOML config file (env: SCHEDULER_CONFIG). SCHEDULER_* variables override it.",
)


def _text(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A string a database can store (a click callback). An argument's bytes that are not
    UTF-8 reach Python as lone surrogates (``\\udcff`` for the byte 0xff), which no driver
    can encode: refused here, as a usage error naming the option, not as an internal error
    later."""
    if value is None:
        return None
    if "\x00" in value:  # impossible in a real argv; possible from Python
        raise click.BadParameter("contains a NUL character", ctx, param)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        char = ord(value[exc.start])
        what = f"the byte {char - 0xDC00:#04x}" if 0xDC80 <= char <= 0xDCFF else "a surrogate"
        raise click.BadParameter(
            f"is not UTF-8 text ({what} at position {exc.start})", ctx, param
        ) from None
    return value


# Where _settings() leaves the command's settings (click's per-invocation context), for
# handles_errors to name the database in what it prints.
_SETTINGS = "scheduler_daemon.settings"


class InternalError(SchedulerError):
    """Not a refusal: a bug. One line too; the traceback only at log level debug."""

    exit_code = EXIT_SOFTWARE


def _fail(error: SchedulerError) -> None:
    click.echo(f"scheduler-daemon: {error}", err=True)
    sys.exit(error.exit_code)


def _explain(exc: Exception) -> SchedulerError:
    context = click.get_current_context(silent=True)
    settings: Settings | None = context.meta.get(_SETTINGS) if context else None
    if settings is not None:
        explained = explain_database_error(exc, settings.database_url)
        if explained is not None:
            return explained
    if settings is not None and settings.log.level == "debug":
        click.echo(redact("".join(traceback.format_exception(exc))), err=True, nl=False)
    hint = "a bug; SCHEDULER_LOG__LEVEL=debug prints the traceback"
    return InternalError(f"internal error ({hint}): {describe(exc)}")


def handles_errors(command: F) -> F:
    """Turn every failure into one line on stderr and an exit code, never a traceback: the
    daemon's own errors as they are, a database's explained (``explain_database_error``:
    no schema, busy, privilege, …), anything else as an internal error (70)."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except BrokenPipeError:
            # `scheduler-daemon publications list | head`: the reader is gone, which is no
            # error worth a line. stdout goes to /dev/null so the exit flush cannot fail.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(1)
        except SchedulerError as error:
            _fail(error)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise  # click's own: usage errors print themselves (exit 2)
        except Exception as exc:
            _fail(_explain(exc))

    return wrapper  # type: ignore[return-value]


def _settings(config_file: Path | None, quiet: bool = True) -> Settings:
    settings = load_settings(config_file)
    context = click.get_current_context(silent=True)
    if context is not None:
        context.meta[_SETTINGS] = settings
    # One-shot commands only log problems (e.g. retries); `run` logs at the configured level.
    level = "warning" if quiet and settings.log.level in ("debug", "info") else settings.log.level
    configure_logging(
        settings.log.model_copy(update={"level": level}), instance=settings.instance_id
    )
    return settings


def _run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


@asynccontextmanager
async def _store(settings: Settings, *, create: bool = False) -> AsyncIterator[Store]:
    """The database for one command: an unreachable one is retried for
    ``database.command_budget`` (not the daemon's startup budget: someone is waiting), and
    a SQLite file that does not exist is left uncreated unless ``create`` (``migrate``)."""
    log = get_logger(instance=settings.instance_id)
    store = await connect(settings, log, create=create, budget="command_budget")
    try:
        yield store
    finally:
        await store.close()


@asynccontextmanager
async def _client(settings: Settings) -> AsyncIterator[Client]:
    """:class:`Client` on :func:`_store`."""
    async with _store(settings) as store:
        yield Client(store, settings.publish.max_payload_bytes)


def parse_when(text: str, now: datetime | None = None, option: str = "--at") -> datetime:
    """ISO 8601 with a timezone (``2027-01-01T09:00:00+02:00``, ``…Z``), or relative to
    this machine's clock: ``+10m``, ``-1h``."""
    text = text.strip()
    if text[:1] in ("+", "-"):
        try:
            seconds = parse_duration(text[1:])
        except ValueError:
            raise InvalidInput(
                f"{option} {text!r}: not a relative time like +90s, +10m or -1h"
            ) from None
        sign = -1 if text[0] == "-" else 1
        try:
            return (now or datetime.now(UTC)) + timedelta(seconds=sign * seconds)
        except OverflowError:
            raise InvalidInput(f"{option} {text!r}: {_OUT_OF_RANGE}") from None
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise InvalidInput(f"{option} {text!r}: not an ISO 8601 time") from None
    if when.tzinfo is None:
        raise InvalidInput(f"{option} {text!r}: give a timezone (e.g. Z or +02:00)")
    try:
        when.astimezone(UTC)  # 9999-12-31T23:00-05:00 is in the year 10000 in UTC
    except OverflowError:
        raise InvalidInput(f"{option} {text!r}: {_OUT_OF_RANGE}") from None
    return when


_OUT_OF_RANGE = "out of range (years 1 to 9999, in UTC)"


async def _database_now(store: Store) -> datetime:
    async with store.transaction(readonly=True) as tx:
        [row] = await tx.query("now")
    now: datetime = row["now"]
    return now


def _when(value: datetime | None) -> str:
    return value.isoformat(timespec="seconds") if value else "-"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Left-aligned columns, as wide as their widest cell; the last one is not padded."""
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(headers))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in [headers, *rows]
    ]
