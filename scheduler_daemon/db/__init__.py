"""Database access: the :class:`Store` contract and its backends (``postgres``, ``sqlite``).

Open one with :func:`scheduler_daemon.db.connect.connect`.
"""

from .base import Publication, PublicationFilter, PublicationStats, ScheduleResult, Store
from .url import DatabaseUrl

__all__ = [
    "DatabaseUrl",
    "Publication",
    "PublicationFilter",
    "PublicationStats",
    "ScheduleResult",
    "Store",
]
