"""The plugin loop: run each task's due slot once, cluster-wide.

Per tick, in one fenced transaction: read the tasks' state (due-ness comes from
``next_run_at`` in the database, judged by the database's clock), and for each due task
advance ``next_run_at`` by compare-and-set and claim the slot by inserting
``(name, slot)`` into ``scheduler_plugin_runs``, whose unique constraint is the guarantee:
even two overlapping leaders cannot run one slot twice. The runs start after that
transaction commits, as owned tasks, up to ``plugin.concurrency`` at once; each records
its result in a transaction of its own.

Runs of a leader that lost its lock can never record a result; the next sticky leader
marks whatever is still ``running`` as ``abandoned`` when it takes over.
"""

from __future__ import annotations

import asyncio
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import partial
from typing import Any

from ..config import Settings
from ..db.base import Tx
from ..errors import describe
from ..leadership import Lease
from ..logs import Logger
from ..metrics import Metrics
from ..plugins.context import TaskContext
from ..plugins.schedule import Plan, plan
from ..plugins.tasks import TaskSpec
from .base import FatalLoopError, Tick

# Grace on top of a run's timeout before a running row from another replica is presumed
# dead (transaction mode, where no takeover moment tells us).
ABANDON_GRACE = 30.0
# How long a deposed leader waits for its sync targets' threads to notice ctx.cancelled.
THREAD_GRACE = 5.0


@dataclass(frozen=True, slots=True)
class Claim:
    spec: TaskSpec
    slot: datetime
    run_id: int


class PluginWork:
    name = "plugin"

    def __init__(
        self,
        tasks: list[TaskSpec],
        settings: Settings,
        metrics: Metrics,
        sticky: bool,
    ) -> None:
        self.tasks = {spec.name: spec for spec in tasks}
        self.settings = settings
        self.metrics = metrics
        self.sticky = sticky  # a lease lasts until lost (session mode, SQLite)
        self.running: dict[str, asyncio.Task[None]] = {}
        # Threads of sync targets, which cancellation cannot stop: a task whose thread is
        # still alive is still running, whatever became of the task that awaited it.
        self.threads: dict[str, threading.Thread] = {}
        self.wake: Callable[[], None] = lambda: None  # the runner sets its own
        self._lease: Lease | None = None

    async def tick(self, tick: Tick) -> float | None:
        claims: list[Claim] = []
        async with tick.lease.transaction() as tx:
            now: datetime = (await tx.fetch("now"))[0]["now"]
            if self._lease is not tick.lease:
                await self._take_over(tx, now, tick.log)
                self._lease = tick.lease
            states = {row["name"]: row for row in await tx.fetch("task_states")}
            for spec in self.tasks.values():
                state = states.get(spec.name)
                if state is None or not state["active"] or state["paused"]:
                    continue
                claims += await self._due_claims(tx, spec, state, now, len(claims), tick.log)
            wake = self._next_wake(await tx.fetch("task_states"), now, len(claims))
        for claim in claims:
            self._start(claim, tick.lease, tick.log)
        return wake

    async def leadership_ended(self, graceful: bool) -> None:
        """Graceful (daemon stopping): let runs finish and record their results (the
        daemon cancels us past shutdown_timeout). Otherwise cancel them: a deposed leader
        must stop working."""
        self._lease = None
        running = list(self.running.values())
        if not running:
            return
        try:
            if graceful:
                await asyncio.wait(running)
        finally:
            for task in running:
                task.cancel()
            await asyncio.wait(running)
        if not graceful:
            await self._deposed_threads_stop()

    async def _deposed_threads_stop(self) -> None:
        """A deposed leader must stop working, and a sync target can only be asked to
        (``ctx.cancelled``). One that has not stopped within THREAD_GRACE would run on
        beside the new leader's runs: end this process instead (the supervisor restarts
        it), rather than compete for leadership again while it runs."""
        deadline = time.monotonic() + THREAD_GRACE
        for thread in list(self.threads.values()):
            if (remaining := deadline - time.monotonic()) > 0:
                await asyncio.to_thread(thread.join, remaining)
        if alive := self._alive_threads():
            raise FatalLoopError(
                f"sync task(s) {', '.join(sorted(alive))} still running {THREAD_GRACE:g}s "
                "after leadership was lost; exiting so they cannot run beside the new leader"
            )

    def _alive_threads(self) -> list[str]:
        return [name for name, thread in self.threads.items() if thread.is_alive()]

    async def _take_over(self, tx: Tx, now: datetime, log: Logger) -> None:
        """First tick of a leadership: bring task rows in line with the configuration,
        keeping every known task's next_run_at (a restart must not reschedule)."""
        existing = {row["name"]: row for row in await tx.fetch("task_states")}
        for spec in self.tasks.values():
            schedule = spec.schedule.describe()
            row = existing.get(spec.name)
            if row is None:
                await tx.fetch("task_insert", spec.name, schedule, spec.schedule.first(now))
                log.info("task.registered", task=spec.name, schedule=schedule, source=spec.source)
            elif row["schedule"] != schedule:
                await tx.fetch("task_reschedule", spec.name, schedule, spec.schedule.first(now))
                log.info("task.rescheduled", task=spec.name, schedule=schedule)
            elif not row["active"]:
                await tx.fetch("task_activate", spec.name)
        await tx.fetch("tasks_deactivate_others", list(self.tasks))
        if self.sticky:
            for row in await tx.fetch(
                "runs_abandon_all", "abandoned: its leader lost the lock before it finished"
            ):
                self.metrics.plugin_runs.labels(row["name"], "abandoned").inc()
                log.warning(
                    "task.abandoned", task=row["name"], slot=row["slot"].isoformat(),
                    run_instance=row["instance"],  # `instance` names the logger
                )  # fmt: skip

    async def _due_claims(
        self,
        tx: Tx,
        spec: TaskSpec,
        state: dict[str, Any],
        now: datetime,
        claimed_so_far: int,
        log: Logger,
    ) -> list[Claim]:
        claims: list[Claim] = []
        slots: list[datetime] = []
        if self._capacity_left(claimed_so_far) <= 0:
            return claims  # stays due (and triggered); picked up when a place frees
        triggered = state["trigger_requested_at"]
        if triggered is not None and await tx.fetch("trigger_consume", spec.name, triggered):
            slots.append(triggered)  # a manual run is a slot like any other
        next_run_at: datetime = state["next_run_at"]
        step: Plan | None = None  # not due, or no place: stays due until a place frees
        if next_run_at <= now and self._capacity_left(claimed_so_far + len(slots)) > 0:
            step = plan(spec.schedule, next_run_at, now, spec.misfire)
            if not await tx.fetch("task_advance", spec.name, next_run_at, step.next_run_at):
                step = None  # someone else moved it: their decision stands
        if step is not None:
            if step.missed:
                log.warning(
                    "task.misfired", task=spec.name, slot=next_run_at.isoformat(),
                    policy=spec.misfire, next_run_at=step.next_run_at.isoformat(),
                )  # fmt: skip
            if step.run:
                slots.append(next_run_at)
        for slot in slots:
            # A task runs one slot at a time: a second slot claimed in this same tick (a
            # trigger and a due slot together) would overlap the first.
            busy = claimed_so_far + len(claims)
            claim = await self._claim(tx, spec, slot, now, busy, log, overlaps=bool(claims))
            if claim is not None:
                claims.append(claim)
        return claims

    async def _claim(
        self,
        tx: Tx,
        spec: TaskSpec,
        slot: datetime,
        now: datetime,
        busy: int,
        log: Logger,
        overlaps: bool = False,
    ) -> Claim | None:
        instance = self.settings.instance_id
        if overlaps or await self._in_flight(tx, spec, now) or self._capacity_left(busy) <= 0:
            await tx.fetch("slot_claim", spec.name, slot, instance, "skipped_overlap")
            self.metrics.plugin_runs.labels(spec.name, "skipped_overlap").inc()
            log.warning("task.skipped_overlap", task=spec.name, slot=slot.isoformat())
            return None
        rows = await tx.fetch("slot_claim", spec.name, slot, instance, "running")
        if not rows:
            log.info("task.slot_taken", task=spec.name, slot=slot.isoformat())
            return None
        await tx.fetch("task_started", spec.name, slot)
        return Claim(spec, slot, rows[0]["id"])

    async def _in_flight(self, tx: Tx, spec: TaskSpec, now: datetime) -> bool:
        if spec.name in self.running or spec.name in self._alive_threads():
            return True
        if self.sticky:
            return False  # takeover abandoned every other leader's runs
        cutoff = now - timedelta(seconds=spec.timeout + ABANDON_GRACE)
        await tx.fetch(
            "runs_abandon_expired", spec.name, cutoff, "abandoned: no result within timeout"
        )
        return bool(await tx.fetch("run_in_flight", spec.name))

    def _capacity_left(self, claimed: int) -> int:
        return self.settings.plugin.concurrency - len(self.running) - claimed

    def _next_wake(self, states: list[dict[str, Any]], now: datetime, claimed: int) -> float | None:
        live = [
            row
            for row in states
            if row["name"] in self.tasks and row["active"] and not row["paused"]
        ]
        upcoming = [row["next_run_at"] for row in live]
        # A trigger this tick could not take (no free place) waits for a place, not for
        # a spinning loop; one on a paused task waits for `tasks resume`.
        if self._capacity_left(claimed) > 0 and any(row["trigger_requested_at"] for row in live):
            return 0.0
        if not upcoming or self._capacity_left(claimed) <= 0:
            # Every place is taken: what is due waits for a run to finish, which wakes the
            # loop (see _start), not for a spinning tick.
            return None
        earliest: datetime = min(upcoming)
        return max(0.0, (earliest - now).total_seconds())

    def _start(self, claim: Claim, lease: Lease, log: Logger) -> None:
        task = asyncio.create_task(self._run(claim, lease, log), name=f"task:{claim.spec.name}")
        self.running[claim.spec.name] = task
        task.add_done_callback(lambda _: self._finished(claim.spec.name))

    def _finished(self, name: str) -> None:
        self.running.pop(name, None)
        self.wake()  # a place is free: something due may be waiting for it

    async def _run(self, claim: Claim, lease: Lease, log: Logger) -> None:
        spec = claim.spec
        run_log = log.bind(task=spec.name, slot=claim.slot.isoformat())
        ctx = TaskContext(spec.name, claim.slot, self.settings.instance_id, run_log, lease)
        run_log.info("task.started", run_id=claim.run_id)
        started = time.monotonic()
        status, error = "succeeded", None
        deadline = asyncio.timeout(spec.timeout)
        try:
            async with deadline:
                if spec.sql is not None:
                    async with lease.transaction() as tx:
                        # Lift the session's statement_timeout to the task's own, a
                        # little past it, so our deadline fires first: timed_out.
                        await tx.execute(spec.sql, statement_timeout=spec.timeout + 1.0)
                else:
                    await spec.call(ctx, on_thread=partial(self.threads.__setitem__, spec.name))
        except TimeoutError as exc:
            if not deadline.expired():  # the target's own TimeoutError: a failure
                status, error = "failed", describe(exc)
                run_log.error("task.failed", error=error, traceback=traceback.format_exc())
            else:
                ctx.cancelled.set()
                status, error = "timed_out", f"timed out after {spec.timeout:g}s"
        except asyncio.CancelledError:
            ctx.cancelled.set()
            raise
        except Exception as exc:
            status, error = "failed", describe(exc)
            run_log.error("task.failed", error=error, traceback=traceback.format_exc())
        duration = time.monotonic() - started
        self.metrics.plugin_runs.labels(spec.name, status).inc()
        self.metrics.plugin_run_duration.labels(spec.name).observe(duration)
        await self._record(claim, lease, status, error, run_log, duration)

    async def _record(
        self,
        claim: Claim,
        lease: Lease,
        status: str,
        error: str | None,
        log: Logger,
        duration: float,
    ) -> None:
        name = claim.spec.name
        limit = self.settings.plugin.max_consecutive_failures
        try:
            async with lease.transaction() as tx:
                await tx.fetch("run_finish", claim.run_id, status, error)
                rows = await tx.fetch("task_finished", name, status, error, limit)
                await tx.fetch("runs_trim", name, self.settings.plugin.history)
        except Exception as exc:
            # Lost leadership or database trouble: the run stays `running` until the next
            # leader marks it abandoned. Never retried: a slot runs at most once.
            log.warning("task.result_not_recorded", status=status, error=repr(exc))
            return
        if status == "succeeded":
            log.info("task.succeeded", duration=round(duration, 3))
        elif status == "timed_out":
            log.error("task.timed_out", timeout=claim.spec.timeout)
        if rows and rows[0]["paused"] and status != "succeeded":
            failures = rows[0]["consecutive_failures"]
            if failures == limit:
                log.error(
                    "task.auto_paused", failures=failures,
                    hint=f"scheduler-daemon tasks resume {name}",
                )  # fmt: skip
