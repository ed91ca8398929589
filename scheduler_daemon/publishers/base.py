"""What a publisher is: something run for each batch of freshly published rows.

Publishers run inside the publishing transaction, on the leader's connection, after the
rows were flipped to ``published``. If one raises, the batch is retried row by row (each
in a savepoint) and only the rows that still fail are marked ``failed``; the rest publish.

A third-party publisher is an entry point in the group ``scheduler_daemon.publishers``
naming a class (or factory) called with the daemon's ``Settings``, whose instances have a
``name`` and an ``async publish(tx, rows)``. Side effects outside the database are
at-least-once: a crash between the side effect and the commit republishes the row; use
``row.id`` as the idempotency key.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from ..db.base import Tx


@dataclass(frozen=True, slots=True)
class Published:
    id: int
    key: str | None
    payload: Any
    publish_at: datetime
    published_at: datetime

    def summary(self) -> dict[str, Any]:
        """The small, stable JSON shape used by notify and as the webhook envelope."""
        return {
            "id": self.id,
            "key": self.key,
            "publish_at": self.publish_at.isoformat(),
            "published_at": self.published_at.isoformat(),
        }


class Publisher(Protocol):
    name: str

    async def publish(self, tx: Tx, rows: Sequence[Published]) -> None: ...
