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
from typing import Protocol

from ..db.base import Tx
from ..db.publications import Published


class Publisher(Protocol):
    name: str

    async def publish(self, tx: Tx, rows: Sequence[Published]) -> None: ...
