"""``notify``: ``pg_notify`` per published row, delivered to listeners only on commit."""

from __future__ import annotations

import json
from collections.abc import Sequence

from ..config.settings import NotifyPublisherSettings
from ..db.base import Tx
from ..db.publications import Published, PublishStore


class NotifyPublisher:
    name = "notify"

    def __init__(self, settings: NotifyPublisherSettings) -> None:
        self.channel = settings.channel

    async def publish(self, tx: Tx, rows: Sequence[Published]) -> None:
        # One statement for the batch; NOTIFY payloads are capped at 8000 bytes, so the
        # message carries identifiers, not the payload.
        messages = [json.dumps(row.summary()) for row in rows]
        await PublishStore(tx).notify_published(channel=self.channel, messages=messages)
