"""Tasks that ship with the daemon (disable one with ``plugin.disabled = ["name"]``)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from ..config.settings import Settings
from ..db.publications import PublishStore
from .context import TaskContext
from .retention import BATCH, TRIM_SHARE, WORK_BUDGET, keep_young, trim_to_count


def builtin_tasks(settings: Settings) -> list[Mapping[str, Any]]:
    retention = settings.publish.retention
    history_age = settings.plugin.history_max_age
    history = settings.plugin.history

    async def purge_publications(ctx: TaskContext) -> None:
        """Delete finished publications due longer ago than ``publish.retention``, in
        batches, each its own short transaction so writers are never blocked for long."""
        purged = 0
        deadline = time.monotonic() + WORK_BUDGET  # a backlog goes on at the next run
        while not ctx.cancelled.is_set() and time.monotonic() < deadline:
            async with ctx.transaction() as tx:
                batch = await PublishStore(tx).purge(older_than=retention, limit=BATCH)
            purged += batch
            if batch < BATCH:
                break
        if purged:
            ctx.log.info("publications.purged", count=purged, retention=retention)

    async def purge_runs(ctx: TaskContext) -> None:
        """Keep the run history within ``plugin.history_max_age`` and ``plugin.history``
        runs per task (plugins/retention.py); on PostgreSQL, make its days ahead too."""
        deadline = time.monotonic() + WORK_BUDGET
        aged = await keep_young(ctx, history_age, deadline - TRIM_SHARE)
        trimmed = await trim_to_count(ctx, history, deadline)
        if aged.rows or trimmed:
            ctx.log.info(
                "runs.purged", aged=aged.rows, trimmed=trimmed, max_age=history_age, keep=history
            )

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
