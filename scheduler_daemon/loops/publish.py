"""The publish loop: flips due publications to ``published``."""

from __future__ import annotations

from ..db import Store
from .base import Tick


class PublishWork:
    name = "publish"

    def __init__(self, store: Store) -> None:
        self.store = store

    async def tick(self, tick: Tick) -> float | None:
        # Until publishing lands (issue 4) a tick opens its fenced transaction and reports
        # the backlog it would publish.
        async with tick.lease.transaction():
            stats = await self.store.publication_stats()
        tick.log.info("tick.done", due=stats.due, scheduled=stats.scheduled)
        return None

    async def leadership_ended(self, graceful: bool) -> None:
        pass  # a tick leaves nothing running behind it
