"""``sql``: a configured statement run in the publishing transaction.

This is how the daemon publishes rows in the application's own tables atomically with
the state flip, e.g. ``UPDATE posts SET status = 'published' WHERE id = ANY($1::bigint[])``
with ``params = ["$.post_id"]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..config.settings import SqlPublisherSettings
from ..db.base import Tx
from ..db.publications import Published


def extract(row: Published, param: str) -> Any:
    if param == "id":
        return row.id
    if param == "key":
        return row.key
    if param == "publish_at":
        return row.publish_at
    value: Any = row.payload
    for part in param.removeprefix("$.").split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


class SqlPublisher:
    name = "sql"

    def __init__(self, settings: SqlPublisherSettings) -> None:
        assert settings.statement is not None
        self.statement = settings.statement
        self.params = settings.params
        self.mode = settings.mode

    async def publish(self, tx: Tx, rows: Sequence[Published]) -> None:
        if self.mode == "batch":
            arrays = [[extract(row, param) for row in rows] for param in self.params]
            await tx.run(self.statement, *arrays)
        else:
            await tx.run_many(
                self.statement, [[extract(row, param) for param in self.params] for row in rows]
            )
