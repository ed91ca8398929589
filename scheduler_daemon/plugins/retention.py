"""How much run history is kept, enforced off the tick by the built-in task purge_runs.

Two bounds, whichever keeps fewer (docs/operations.md, "Run history"):

- by age, ``plugin.history_max_age``: on PostgreSQL the history is partitioned by day of
  slot (migration 0012) and goes a whole day at a time, never row by row; the same upkeep
  makes the days ahead. On SQLite the oldest runs are deleted in batches.
- by count, ``plugin.history`` runs per schedule: the results' write marks a schedule due
  a trim every so many of its runs, at its own phase of that cycle (a hash of its name),
  so that schedules created together, whose run counts move in step, do not all come due
  at once; this task trims those marked, found through a partial index (it never reads
  every schedule: at a million, reading them all each minute cost the leader more than
  its runs).

Each step is a short transaction of its own on the leader's fenced connection: between
two of them the loop's ticks go on. A day emptied by the count (a busy schedule's history
turns over in hours) is dropped whole too, so on PostgreSQL both bounds free space whole.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from ..db.plugin_store import PluginStore
from .context import TaskContext

# Days of partitions made ahead of today: the upkeep runs every minute, so two days leave a
# leader-less or failing upkeep two days before runs fall into the default partition.
AHEAD_DAYS = 2
# How long a step waits for a table lock (a partition's DROP waits for the statements on
# the history to end): past that it gives up until the next round, rather than queue the
# loop's statements behind it.
LOCK_TIMEOUT = 0.1
# Runs moved or deleted per transaction.
BATCH = 1000
# Schedules trimmed per transaction (each trim deletes about `trim_every` runs).
TRIM_CHUNK = 50
# What one run of purge_runs spends at most, under its 5-minute timeout: a backlog (10
# million runs of a pre-0012 table to move took 12 minutes) goes on at the next run rather
# than be cut off by the timeout, which counts as a failure and pauses the task after 5.
# The age's upkeep leaves the last minute of it to the count's trims.
WORK_BUDGET = 240.0
TRIM_SHARE = 60.0


@dataclass(frozen=True, slots=True)
class AgeUpkeep:
    rows: int  # runs moved or deleted
    busy: bool  # a step gave up on a lock: the next round goes on


def trim_every(keep: int) -> int:
    """How many runs a schedule has between two trims: the history stays between ``keep``
    and ``keep`` + this many rows."""
    return max(1, min(100, keep))


async def keep_young(ctx: TaskContext, max_age: float, deadline: float) -> AgeUpkeep:
    """Steps of the age upkeep until there is nothing left to do, a lock was busy, or the
    monotonic ``deadline`` passed."""
    rows = 0
    while not ctx.cancelled.is_set() and time.monotonic() < deadline:
        started = time.monotonic()
        async with ctx.transaction() as tx:
            step = await PluginStore(tx).maintain_history(
                older_than=max_age, ahead_days=AHEAD_DAYS, limit=BATCH, lock_timeout=LOCK_TIMEOUT
            )
        if step.action in ("moved", "purged"):
            # A backlog (a pre-0012 history to copy: 10 million rows) is paced to half of
            # the connection's time at most: its steps share it with the loop's ticks,
            # and going flat out made the runs seconds late.
            await asyncio.sleep(time.monotonic() - started)
        if step.action == "busy":
            ctx.log.info("runs.upkeep_busy", table=step.target)
            return AgeUpkeep(rows, busy=True)
        if step.action == "blocked":  # runs of that day go to the default partition
            ctx.log.warning("runs.partition_blocked", table=step.target)
        if step.action in ("idle", "blocked"):
            return AgeUpkeep(rows, busy=False)
        rows += step.rows
        if step.action in ("created", "dropped", "emptied"):
            # DDL, rare (a few a day): each said, with the rows a dropped day held.
            ctx.log.info(f"runs.partition_{step.action}", table=step.target, rows=step.rows)
    return AgeUpkeep(rows, busy=False)


async def trim_to_count(ctx: TaskContext, keep: int, deadline: float) -> int:
    """The schedules marked due a trim lose their runs beyond the newest ``keep``, a chunk
    per transaction, paced as the age's steps are, until none is left or the monotonic
    ``deadline`` passes (the next run goes on). Returns runs deleted."""
    trimmed = 0
    while not ctx.cancelled.is_set() and time.monotonic() < deadline:
        started = time.monotonic()
        async with ctx.transaction() as tx:
            store = PluginStore(tx)
            names = await store.trims_due(TRIM_CHUNK)
            if names:
                trimmed += await store.trim(names, keep)
                await store.trims_done(names)
        if len(names) < TRIM_CHUNK:
            break
        await asyncio.sleep(time.monotonic() - started)
    return trimmed
