"""structlog setup: JSON lines for machines, a console renderer for people.

Every line carries ``event`` (a stable dotted name, listed in docs/operations.md) and
``instance``; loop lines add ``loop`` and ``tick``. Passwords are scrubbed from every
value (tracebacks included) as the last step before rendering, whatever put them there.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO, cast

import structlog
from structlog.typing import EventDict, FilteringBoundLogger, Processor, WrappedLogger

from .config import LogSettings
from .db.url import redact

Logger = FilteringBoundLogger


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


def configure_logging(settings: LogSettings, stream: TextIO | None = None) -> None:
    """Configure structlog process-wide (logging is the one thing that is global)."""
    stream = stream or sys.stderr
    as_json = settings.format == "json" or (settings.format == "auto" and not stream.isatty())
    processors: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    # Tracebacks become text before the redaction step, in both formats: ConsoleRenderer's
    # own exception formatting would run after it and print an unscrubbed message.
    processors += [structlog.processors.format_exc_info, _redact_secrets]
    if as_json:
        processors.append(structlog.processors.JSONRenderer())
    else:
        processors.append(structlog.dev.ConsoleRenderer(colors=stream.isatty()))
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[settings.level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )


def get_logger(**bound: Any) -> Logger:
    """A logger with the given context bound (``instance=…``, ``loop=…``)."""
    return cast(Logger, structlog.get_logger("scheduler_daemon").bind(**bound))
