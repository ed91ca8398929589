"""Database access: the :class:`Store` contract and its backends (``postgres``, ``sqlite``).

Open one with :func:`scheduler_daemon.db.connect.connect`.
"""

from ..config.url import DatabaseUrl
from .base import (
    AddedSchedule,
    Publication,
    PublicationFilter,
    PublicationStats,
    ScheduleDefinition,
    ScheduleRecord,
    ScheduleResult,
    Store,
)

__all__ = [
    "AddedSchedule",
    "DatabaseUrl",
    "Publication",
    "PublicationFilter",
    "PublicationStats",
    "ScheduleDefinition",
    "ScheduleRecord",
    "ScheduleResult",
    "Store",
]
