"""Targets for bench/growth.py's async Python tasks (bench/ is put on PYTHONPATH, so the
targets are ``growth_tasks:noop`` and ``growth_tasks:half_second``)."""

from __future__ import annotations

import asyncio

from scheduler_daemon.plugins.context import TaskContext


async def noop(ctx: TaskContext) -> None:
    """Does nothing: what is measured is the scheduler's own cost per run."""
    del ctx


async def half_second(ctx: TaskContext) -> None:
    """Waits 0.5 s, as an async I/O target would: the overload case of bench/scale.py
    caps plugin.concurrency so that only about a tenth of what is due fits."""
    del ctx
    await asyncio.sleep(0.5)
