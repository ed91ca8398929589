"""Rules shared by every backend, so that each one explains a refusal the same way."""

from __future__ import annotations

from datetime import UTC, datetime

from ..errors import InvalidInput, NotFound
from .base import Publication


def to_db_time(value: datetime) -> str:
    """UTC, fixed width, microseconds: sorts and compares like the instant it names (how
    SQLite stores times, and how batches sent as JSON spell them to either backend)."""
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def explain_cancel_refusal(publication_id: int, current: Publication | None) -> InvalidInput:
    if current is None:
        return NotFound(f"no publication with id {publication_id}")
    return InvalidInput(
        f"publication {publication_id} is {current.status}, not scheduled: nothing to cancel"
    )
