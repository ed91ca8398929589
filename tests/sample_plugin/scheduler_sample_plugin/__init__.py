"""A sample scheduler-daemon plugin: three tasks declared through an entry point.

``pyproject.toml`` points the entry-point group ``scheduler_daemon.plugins`` at
:func:`tasks`, which the daemon calls once at startup. Each declaration has the keys of a
``[[plugin.tasks]]`` table; ``target`` may be the callable itself or a
``"module:function"`` string.

The tasks are declared with ``enabled = False`` unless ``SCHEDULER_SAMPLE_PLUGIN=1`` is
set, so that installing the plugin into the test environment does not add tasks to
every daemon the tests start. (A real plugin would just declare its tasks; operators
turn one off with ``plugin.disabled``.)
"""

from __future__ import annotations

import os
from typing import Any

from scheduler_daemon.plugins.context import TaskContext

ENABLE_ENV = "SCHEDULER_SAMPLE_PLUGIN"
GREETINGS_TABLE = "sample_plugin_greetings"


def tasks() -> list[dict[str, Any]]:
    enabled = os.environ.get(ENABLE_ENV) == "1"
    return [
        {
            "name": "sample.greet",
            "every": "1s",
            "timeout": "10s",
            "target": greet,  # the callable itself
            "enabled": enabled,
        },
        {
            "name": "sample.tidy",
            "cron": "30 3 * * *",
            "timezone": "Europe/Berlin",
            "misfire": "skip",
            "target": "scheduler_sample_plugin:tidy",  # or a "module:function" string
            "enabled": enabled,
        },
    ]


async def greet(ctx: TaskContext) -> None:
    """An async target runs on the daemon's event loop: it must not block. Its database
    work goes through ``ctx.transaction()``, which commits only while this replica still
    leads the plugin loop."""
    async with ctx.transaction() as tx:
        await tx.execute(f"CREATE TABLE IF NOT EXISTS {GREETINGS_TABLE} (greeted_by text)")
        await tx.execute(f"INSERT INTO {GREETINGS_TABLE} (greeted_by) VALUES ('sample.greet')")
    ctx.log.info("sample.greeted", instance=ctx.instance)


def tidy(ctx: TaskContext) -> None:
    """A plain function runs in a worker process of its own, so it may block. It is
    stopped with SIGTERM, which sets ``ctx.cancelled``, then SIGKILL: long loops check
    ``ctx.cancelled`` (set on timeout, loss of leadership and shutdown) to stop cleanly."""
    for _ in range(10):
        if ctx.cancelled.is_set():
            return
        ctx.cancelled.wait(0.01)
    ctx.log.info("sample.tidied")
