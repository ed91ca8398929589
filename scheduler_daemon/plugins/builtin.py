"""Tasks that ship with the daemon (disable one with ``plugin.disabled = ["name"]``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..config.settings import Settings
from ..db.plugin_store import PluginStore
from ..db.publish_store import PublishStore
from .context import TaskContext

# Rows deleted per transaction: each batch is a short transaction of its own (on the
# leader's lock connection, between its ticks), so a purge of a million rows never holds
# a tick up for long.
PURGE_BATCH = 1000


def builtin_tasks(settings: Settings) -> list[Mapping[str, Any]]:
    retention = settings.publish.retention
    history_age = settings.plugin.history_max_age

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

    async def purge_runs(ctx: TaskContext) -> None:
        """Delete run history older than ``plugin.history_max_age``, oldest first, in
        batches (the count per task, ``plugin.history``, is trimmed as results are
        written)."""
        purged = 0
        while not ctx.cancelled.is_set():
            async with ctx.transaction() as tx:
                batch = await PluginStore(tx).purge(older_than=history_age, limit=PURGE_BATCH)
            purged += batch
            # Not `< PURGE_BATCH`: a run still going among the oldest (a long timeout)
            # stays in every batch's window, and the purge must go on past it.
            if batch == 0:
                break
        if purged:
            ctx.log.info("runs.purged", count=purged, max_age=history_age)

    return [
        {
            "name": "purge_runs",
            "every": "1m",
            "timeout": "5m",
            "misfire": "skip",
            "target": purge_runs,
        },
        {
            "name": "purge_publications",
            "every": "10m",
            "timeout": "5m",
            "misfire": "skip",
            "target": purge_publications,
        },
    ]
