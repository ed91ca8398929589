"""structlog setup: JSON lines for machines, a console renderer for people.

Every line carries ``event`` (a stable dotted name, listed in docs/operations.md) and
``instance``; loop lines add ``loop`` and ``tick``. Libraries' stdlib ``logging`` records
go through the same processors, with ``logger`` naming them; below info only if
``log.debug_libraries`` asks for them. Passwords are scrubbed from
every value (tracebacks included) as the last step before rendering, whatever put them
there.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any, TextIO, cast

import structlog
from structlog.typing import EventDict, FilteringBoundLogger, Processor, WrappedLogger

from .config.settings import LogSettings
from .errors import describe
from .redact import redact

Logger = FilteringBoundLogger

# The stdlib logger the daemon's structlog events go through; any other is a library's.
OWN_LOGGER = "scheduler_daemon"


def _scrub(value: Any) -> Any:
    """``value`` with passwords removed from every string in it; other objects become
    their (scrubbed) ``repr``, which is what both renderers would have printed."""
    if isinstance(value, str):
        return redact(value)
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, dict):
        return {key: _scrub(item) for key, item in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_scrub(item) for item in value]
    if hasattr(value, "__structlog__"):
        return _scrub(value.__structlog__())
    return redact(repr(value))


def _redact_secrets(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
    # Runs after format_exc_info, so a traceback (an exception message holding a DSN) is
    # a string here and is scrubbed like any other value.
    for key, value in event_dict.items():
        event_dict[key] = _scrub(value)
    return event_dict


class _Handler(logging.StreamHandler[TextIO]):
    """The root handler every line goes through, the daemon's and the libraries' alike
    (one handler, one lock: lines never interleave). Replaced when logging is configured
    again (a worker process, a test)."""

    def handleError(self, record: logging.LogRecord) -> None:
        # A record that cannot be formatted (a library's bad %-arguments): say so in a line
        # of the configured format rather than stdlib's plain-text "--- Logging error ---".
        error = sys.exc_info()[1]
        if error is None or isinstance(error, OSError):
            return  # the stream itself failed (EPIPE): nothing more to write to
        with contextlib.suppress(Exception):  # logging must never raise into the caller
            self.stream.write(self.format(_unformattable(record, error)) + self.terminator)
            self.flush()


def _unformattable(record: logging.LogRecord, error: BaseException) -> logging.LogRecord:
    return logging.makeLogRecord(
        {
            "name": record.name,
            "levelno": record.levelno,
            "levelname": record.levelname,
            "msg": f"unformattable log record: {describe(error)}: {record.msg!r}",
        }
    )


def configure_logging(
    settings: LogSettings, stream: TextIO | None = None, *, instance: str | None = None
) -> None:
    """Configure logging process-wide (logging is the one thing that is global).

    structlog events and stdlib ``logging`` records (asyncpg, aiohttp, asyncio, plugin
    code, warnings) end in the same processors and the same handler on the root logger:
    the same format, the same redaction, the traceback as the ``exception`` field, the
    configured level (for other libraries than the daemon, no lower than info unless
    ``settings.debug_libraries``). A stdlib record's ``event`` is its message; ``logger``
    names it, and ``instance`` (when given) the replica, as on the daemon's own lines.
    """
    stream = stream or sys.stderr
    as_json = settings.format == "json" or (settings.format == "auto" and not stream.isatty())
    level = logging.getLevelNamesMapping()[settings.level.upper()]
    # Tracebacks become text before the redaction step, in both formats: ConsoleRenderer's
    # own exception formatting would run after it and print an unscrubbed message.
    renderer: Processor = (
        structlog.processors.JSONRenderer()
        if as_json
        else structlog.dev.ConsoleRenderer(colors=stream.isatty())
    )
    handler = _Handler(stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            # What a stdlib record lacks that the daemon's own events already have.
            foreign_pre_chain=[
                *([_bind(instance=instance)] if instance is not None else []),
                structlog.contextvars.merge_contextvars,
                structlog.stdlib.add_log_level,
                structlog.stdlib.add_logger_name,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
            ],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                _redact_secrets,
                renderer,
            ],
        )
    )
    root = logging.getLogger()
    for previous in [h for h in root.handlers if isinstance(h, _Handler)]:
        root.removeHandler(previous)
        previous.close()
    root.addHandler(handler)
    # The daemon's own logger (and its children) at the configured level; every other
    # library's at no lower than info unless asked for: aiosqlite alone says one debug line
    # per statement, some 40 a second from SQLite's 100 ms data_version watch.
    root.setLevel(level if settings.debug_libraries else max(level, logging.INFO))
    logging.getLogger(OWN_LOGGER).setLevel(level)
    logging.captureWarnings(True)  # warnings.warn(...) as a `py.warnings` line
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            # While still inside the `except` block that logged it.
            structlog.processors.format_exc_info,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=False,
    )


def _bind(**context: Any) -> Processor:
    def bind(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
        return {**context, **event_dict}

    return bind


def get_logger(**bound: Any) -> Logger:
    """A logger with the given context bound (``instance=…``, ``loop=…``)."""
    return cast(Logger, structlog.get_logger(OWN_LOGGER).bind(**bound))
