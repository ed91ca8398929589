"""structlog setup: JSON lines for machines, a console renderer for people.

Every line carries ``event`` (a stable dotted name, listed in docs/operations.md) and
``instance``; loop lines add ``loop`` and ``tick``. Passwords are scrubbed from every
string value as the last step before rendering, whatever put them there.
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


def _redact_secrets(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
    for key, value in event_dict.items():
        if isinstance(value, str):
            event_dict[key] = redact(value)
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
    if as_json:
        processors += [
            structlog.processors.format_exc_info,
            _redact_secrets,
            structlog.processors.JSONRenderer(),
        ]
    else:
        processors += [_redact_secrets, structlog.dev.ConsoleRenderer(colors=stream.isatty())]
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
