"""The plugin loop: runs plugin-declared periodic tasks whose slot is due."""

from __future__ import annotations

from ..config import PluginTaskSettings
from .base import Tick


class PluginWork:
    name = "plugin"

    def __init__(self, tasks: list[PluginTaskSettings]) -> None:
        self.tasks = tasks

    async def tick(self, tick: Tick) -> float | None:
        # Until task execution lands (issue 5) a tick only reports what is configured.
        tick.log.info("tick.done", tasks=len(self.tasks))
        return None
