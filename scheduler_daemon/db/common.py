"""Rules shared by every backend, so that each one explains a refusal the same way."""

from __future__ import annotations

from ..errors import InvalidInput, NotFound
from .base import Publication


def explain_cancel_refusal(publication_id: int, current: Publication | None) -> InvalidInput:
    if current is None:
        return NotFound(f"no publication with id {publication_id}")
    return InvalidInput(
        f"publication {publication_id} is {current.status}, not scheduled: nothing to cancel"
    )
