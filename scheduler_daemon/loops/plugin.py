"""The plugin loop: runs plugin-declared periodic tasks whose slot is due."""

from __future__ import annotations

from ..config import PluginTaskSettings
from .base import Tick


class PluginWork:
    name = "plugin"

    def __init__(self, tasks: list[PluginTaskSettings]) -> None:
        self.tasks = tasks

    async def tick(self, tick: Tick) -> float | None:
        # Until task execution lands (issue 5) a tick runs the enabled SQL tasks in its
        # fenced transaction, every tick.
        async with tick.lease.transaction() as tx:
            for task in self.tasks:
                if task.enabled and task.sql:
                    await tx.execute(task.sql)
        tick.log.info("tick.done", tasks=len(self.tasks))
        return None
