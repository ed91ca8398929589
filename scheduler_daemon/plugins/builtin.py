"""Tasks that ship with the daemon (disable one with ``plugin.disabled = ["name"]``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..config.settings import Settings
from ..db.publish_store import PublishStore
from .context import TaskContext

PURGE_BATCH = 1000


def builtin_tasks(settings: Settings) -> list[Mapping[str, Any]]:
    retention = settings.publish.retention

    async def purge_publications(ctx: TaskContext) -> None:
        """Delete finished publications due longer ago than ``publish.retention``, in
        batches, each its own short transaction so writers are never blocked for long."""
        purged = 0
        while not ctx.cancelled.is_set():
            async with ctx.transaction() as tx:
                batch = await PublishStore(tx).purge(older_than=retention, limit=PURGE_BATCH)
            purged += batch
            if batch < PURGE_BATCH:
                break
        if purged:
            ctx.log.info("publications.purged", count=purged, retention=retention)

    return [
        {
            "name": "purge_publications",
            "every": "10m",
            "timeout": "5m",
            "misfire": "skip",
            "target": purge_publications,
        }
    ]
