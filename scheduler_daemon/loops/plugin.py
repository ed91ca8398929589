"""The plugin loop: run each task's due slot once, cluster-wide, by one replica at a time.

Per tick, in one fenced transaction: read the tasks' state (due-ness comes from
``next_run_at`` in the database, judged by the database's clock), and for each due task
advance ``next_run_at`` by compare-and-set and claim the slot by inserting
``(name, slot)`` into ``scheduler_plugin_runs``, whose unique constraint is the guarantee:
even two overlapping leaders cannot run one slot twice. The runs start after that
transaction commits, up to ``plugin.concurrency`` at once, as work of the leadership:
inside a *hold* on the lock (``lease.hold_after``), which in session mode and on SQLite is
the lease itself and in transaction mode a transaction that takes the lock over from the
tick and keeps it until the runs have ended. So no run ever executes without this replica
holding the loop's lock, and losing it stops every run — async targets are cancelled,
sync targets run in worker processes and are killed — before the lock can go to anyone.

Timing: the tick returns how long until the earliest next slot (database clock), and the
leader sleeps until then. On PostgreSQL in session mode it is woken sooner by a NOTIFY
from a trigger on the tasks table when a task is triggered, resumed or moved earlier
(``tasks trigger``, ``tasks resume``, plain SQL), so an idle leader ticks only every
``LISTENING_MAX_SLEEP``; otherwise (SQLite, transaction mode, no LISTEN) it looks every
``plugin.interval``.

Runs of a leader that lost its lock can never record a result. Whoever next holds the
lock while none of its own runs is in flight (a sticky leader when it takes over; in
transaction mode, every tick that wins the lock) marks what is still ``running`` as
``abandoned``: nothing can be executing it, since execution needs the lock.
"""

from __future__ import annotations

import asyncio
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

import structlog

from ..aio import unless_set
from ..config import Settings
from ..db.base import Tx
from ..errors import describe
from ..leadership import Lease, PendingHold
from ..logs import Logger
from ..metrics import Metrics
from ..plugins.context import TaskContext
from ..plugins.schedule import Plan, plan
from ..plugins.tasks import TaskSpec
from ..plugins.worker import WorkerFailed, WorkerJob, Workers
from .base import LISTENING_MAX_SLEEP, Tick

if TYPE_CHECKING:
    from ..db.listen import Listener

ABANDONED = "abandoned: the replica running it lost the lock before it finished"
# Sent by the scheduler_plugin_tasks trigger (migration 0004) when a task becomes due
# sooner than its leader may have planned.
WAKE_CHANNEL = "scheduler_plugin_tasks_changed"


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
        workers: Workers | None,
        sticky: bool,
        listener: Listener | None = None,
    ) -> None:
        self.tasks = {spec.name: spec for spec in tasks}
        self.settings = settings
        self.metrics = metrics
        self.workers = workers  # runs sync targets; None when no task has one
        self.sticky = sticky  # a lease lasts until lost (session mode, SQLite)
        self.listener = listener  # PostgreSQL, session mode
        # In-flight runs by task name (a claimed run counts from its claim on).
        self.running: dict[str, asyncio.Task[Any]] = {}
        # One task per tick that claimed runs, with their rows in scheduler_plugin_runs.
        self._batches: dict[asyncio.Task[None], list[int]] = {}
        self.wake: Callable[[], None] = lambda: None  # the runner sets its own
        self._lease: Lease | None = None

    async def tick(self, tick: Tick) -> float | None:
        claims: list[Claim] = []
        hold: PendingHold | None = None
        if self.listener is not None:
            # Before the read below, so that no change after it goes unheard.
            if self._lease is not tick.lease:
                await self.listener.subscribe(WAKE_CHANNEL, self._on_tasks_changed)
            else:
                await self.listener.ensure()
        try:
            async with tick.lease.transaction() as tx:
                now: datetime = (await tx.fetch("now"))[0]["now"]
                taking_over = self._lease is not tick.lease
                if taking_over:
                    await self._take_over(tx, now, tick.log)
                # Whoever holds the lock knows that nothing executes the runs still marked
                # `running` (runs execute under the lock): a sticky leader when it takes
                # over, in transaction mode every tick that wins. (Had their replica lost
                # its hold to the server and still be stopping them, the guard waited for
                # it before this tick: see the guards' settle.)
                if taking_over or not self.sticky:
                    await self._abandon(tx, tick.log)
                states = await tx.fetch("task_states")
                claims = await self._claims(tx, states, now, tick.log)
                wake = self._next_wake(states, now, len(claims))
                if claims:
                    hold = await tick.lease.hold_after(tx)
        except BaseException:
            if hold is not None:
                await hold.discard()  # what it would have run was rolled back
            raise
        self._lease = tick.lease  # committed: reconciled, and its predecessors' runs closed
        if hold is not None:
            self._start_batch(tick.lease, hold, claims, tick.log)
        return wake

    async def _claims(
        self, tx: Tx, rows: list[dict[str, Any]], now: datetime, log: Logger
    ) -> list[Claim]:
        """Claim what is due, updating ``rows`` (the tick's one read of the tasks' state)
        to what this transaction wrote, so the next wake-up is planned from them. A
        change another client commits meanwhile (a trigger) notifies: the next tick."""
        claims: list[Claim] = []
        states = {row["name"]: row for row in rows}
        for spec in self.tasks.values():
            state = states.get(spec.name)
            if state is None or not state["active"] or state["paused"]:
                continue
            claims += await self._due_claims(tx, spec, state, now, len(claims), log)
        return claims

    def max_sleep(self) -> float:
        if self.listener is not None and self.listener.listening:
            return LISTENING_MAX_SLEEP
        return self.settings.plugin.interval

    def _on_tasks_changed(self, _payload: str) -> None:
        self.wake()

    async def leadership_ended(self, graceful: bool) -> None:
        """Graceful (daemon stopping, lease still valid): let the runs finish and record
        their results (the daemon cancels us past shutdown_timeout; losing the lease
        meanwhile cancels them at once). Either way the guard then stops whatever is left,
        before it lets the lock go."""
        self._lease = None
        if self.listener is not None:
            self.listener.unsubscribe(WAKE_CHANNEL)
        if graceful and self._batches:
            await asyncio.wait(list(self._batches))

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

    async def _abandon(self, tx: Tx, log: Logger) -> None:
        ours = sorted(run_id for run_ids in self._batches.values() for run_id in run_ids)
        rows = await tx.fetch("runs_abandon_all", ABANDONED, ours)
        for row in rows:
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
            state["trigger_requested_at"] = None
        next_run_at: datetime = state["next_run_at"]
        step: Plan | None = None  # not due, or no place: stays due until a place frees
        if next_run_at <= now and self._capacity_left(claimed_so_far + len(slots)) > 0:
            step = plan(spec.schedule, next_run_at, now, spec.misfire)
            if await tx.fetch("task_advance", spec.name, next_run_at, step.next_run_at):
                state["next_run_at"] = step.next_run_at
            else:
                step = None  # someone else moved it: their decision stands (look again)
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
            claim = await self._claim(tx, spec, slot, busy, log, overlaps=bool(claims))
            if claim is not None:
                claims.append(claim)
        return claims

    async def _claim(
        self,
        tx: Tx,
        spec: TaskSpec,
        slot: datetime,
        busy: int,
        log: Logger,
        overlaps: bool = False,
    ) -> Claim | None:
        instance = self.settings.instance_id
        # Only our own runs can be in flight: takeover abandoned everyone else's.
        if overlaps or spec.name in self.running or self._capacity_left(busy) <= 0:
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
            # loop (see _finished), not for a spinning tick.
            return None
        earliest: datetime = min(upcoming)
        return max(0.0, (earliest - now).total_seconds())

    def _start_batch(
        self,
        lease: Lease,
        hold: PendingHold,
        claims: list[Claim],
        log: Logger,
    ) -> None:
        batch = lease.spawn(self._run_batch(hold, claims, log), name="plugin:batch")
        self._batches[batch] = [claim.run_id for claim in claims]
        batch.add_done_callback(self._batches.pop)
        for claim in claims:  # its places are taken from now on
            self._track(claim.spec.name, batch)

    async def _run_batch(self, pending: PendingHold, claims: list[Claim], log: Logger) -> None:
        """Hold the lock for one tick's runs until every one of them has ended (or the
        hold is lost: then its exit stops them, within stop_grace, before it lets go)."""
        entered = False
        try:
            async with pending as hold:
                entered = True
                runs = []
                for claim in claims:
                    run = hold.spawn(self._run(claim, hold, log), name=f"task:{claim.spec.name}")
                    self._track(claim.spec.name, run)
                    runs.append(run)
                await unless_set(asyncio.wait(runs), hold.lost)
        except Exception as exc:  # lost before or while committing: the runs stay `running`
            log.warning("plugin.hold_failed", error=describe(exc))
        finally:
            if not entered:
                await pending.discard()  # cancelled before it began: never leave it queued

    def _track(self, name: str, task: asyncio.Task[Any]) -> None:
        self.running[name] = task
        task.add_done_callback(lambda _: self._untrack(name, task))

    def _untrack(self, name: str, task: asyncio.Task[Any] | None) -> None:
        if self.running.get(name) is task:
            del self.running[name]
            self.wake()  # a place is free: something due may be waiting for it

    async def _run(self, claim: Claim, hold: Lease, log: Logger) -> None:
        spec = claim.spec
        run_log = log.bind(task=spec.name, slot=claim.slot.isoformat())
        ctx = TaskContext(
            name=spec.name,
            slot=claim.slot,
            instance=self.settings.instance_id,
            log=run_log,
            fencing_token=hold.fencing_token,
            lease=hold,
        )
        run_log.info("task.started", run_id=claim.run_id, fencing_token=hold.fencing_token)
        started = time.monotonic()
        status, error = "succeeded", None
        deadline = asyncio.timeout(spec.timeout)
        try:
            async with deadline:
                await self._execute(spec, ctx, hold, run_log)
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
        except WorkerFailed as exc:
            status, error = "failed", exc.error
            run_log.error("task.failed", error=error, traceback=exc.traceback)
        except Exception as exc:
            status, error = "failed", describe(exc)
            run_log.error("task.failed", error=error, traceback=traceback.format_exc())
        duration = time.monotonic() - started
        self.metrics.plugin_runs.labels(spec.name, status).inc()
        self.metrics.plugin_run_duration.labels(spec.name).observe(duration)
        await self._record(claim, hold, status, error, run_log, duration)

    async def _execute(self, spec: TaskSpec, ctx: TaskContext, hold: Lease, log: Logger) -> None:
        if spec.sql is not None:
            async with hold.transaction() as tx:
                # Lift the session's statement_timeout to the task's own, a little past
                # it, so our deadline fires first: timed_out.
                await tx.execute(spec.sql, statement_timeout=spec.timeout + 1.0)
        elif spec.is_async:
            await spec.call(ctx)
        else:
            # A thread could not be stopped when the lock is lost; a process can.
            assert self.workers is not None
            assert spec.target is not None
            job = WorkerJob(
                target=spec.target,
                pass_context=spec.wants_context,
                name=spec.name,
                slot=ctx.slot,
                instance=ctx.instance,
                fencing_token=ctx.fencing_token,
                log_format=self.settings.log.format,
                log_level=self.settings.log.level,
                log_context=dict(structlog.get_context(log)),
            )
            await self.workers.run(
                job, gone=hold.gone, fresh=hold.fresh, grace=self.settings.lock.stop_grace
            )

    async def _record(
        self,
        claim: Claim,
        hold: Lease,
        status: str,
        error: str | None,
        log: Logger,
        duration: float,
    ) -> None:
        name = claim.spec.name
        limit = self.settings.plugin.max_consecutive_failures
        try:
            async with hold.transaction() as tx:
                await tx.fetch("run_finish", claim.run_id, status, error)
                rows = await tx.fetch("task_finished", name, status, error, limit)
                await tx.fetch("runs_trim", name, self.settings.plugin.history)
        except Exception as exc:
            # Lost leadership or database trouble: the run stays `running` until the next
            # holder of the lock marks it abandoned. Never retried: a slot runs at most once.
            log.warning("task.result_not_recorded", status=status, error=describe(exc))
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
