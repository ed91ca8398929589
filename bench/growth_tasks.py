"""Targets for bench/growth.py's async Python tasks (bench/ is put on PYTHONPATH, so the
target is ``growth_tasks:noop``)."""

from __future__ import annotations

from scheduler_daemon.plugins.context import TaskContext


async def noop(ctx: TaskContext) -> None:
    """Does nothing: what is measured is the scheduler's own cost per run."""
    del ctx
