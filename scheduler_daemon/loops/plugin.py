"""The plugin loop: run each schedule's due slot once, cluster-wide, by one replica at a time.

Schedules are rows of ``scheduler_plugin_tasks``: the deployment's declared tasks (config,
plugins, built-ins), whose code this replica knows, and runtime schedules the application
added, each naming a target the deployment declared runnable, with its own ``args``.

A tick costs O(due), never O(schedules): in one fenced transaction (db/plugin_store.py)
it reads the due schedules from the ``next_run_at`` index, oldest slot first and at most
as many as it has free places (so however far behind the leader is, every schedule
progresses and none starves), with the database's now and the next slot to come; then
one statement claims the whole batch: each schedule's ``next_run_at`` advanced by
compare-and-set on the value read, and its ``(name, slot)`` run inserted. The unique
``(name, slot)`` and the one-running-run-per-schedule index are the guarantee: even two
overlapping leaders cannot run one slot twice, nor two runs of one schedule at once.

The runs start after that transaction commits, as work of the leadership: inside a
*hold* on the lock (``lease.hold_after``), which in session mode and on SQLite is the lease
itself and in transaction mode a transaction that takes the lock over from the tick and
keeps it until the runs have ended. So no run executes without this replica holding the
loop's lock, and losing it stops every run (async targets are cancelled, sync targets run
in worker processes and are killed) before the lock can go to anyone. Results are written
in batches, by the batch that ran them: every ``RESULT_FLUSH_INTERVAL`` while runs remain,
at once when ``RESULT_FLUSH_SIZE`` are waiting, and when the last one ends. A schedule
whose last result is not written yet is not claimed again until it is.

Timing: the tick returns how long until the earliest next slot (database clock), and the
leader sleeps until then. On PostgreSQL in session mode it is woken sooner by a NOTIFY
from triggers on the tasks table when a schedule is added, triggered, resumed or moved
earlier, so an idle leader ticks only every ``LISTENING_MAX_SLEEP``; otherwise (SQLite,
transaction mode, no LISTEN) it looks every ``plugin.interval``.

Runs of a leader that lost its lock can never record a result. Whoever next holds the
lock while none of its own runs is in flight (a sticky leader when it takes over; in
transaction mode, every tick that wins the lock) marks what is still ``running`` as
``abandoned``: nothing can be executing it, since execution needs the lock.
"""

from __future__ import annotations

import asyncio
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, cast

import structlog

from ..config import Settings
from ..db.base import Tx
from ..db.plugin_store import (
    Claim,
    Declaration,
    DueBatch,
    DueSchedule,
    FinishedSchedule,
    PluginStore,
    RunResult,
)
from ..errors import describe
from ..leadership import LeadershipLost, Lease, PendingHold
from ..logs import Logger
from ..metrics import Metrics
from ..plugins.context import TaskContext
from ..plugins.schedule import plan
from ..plugins.tasks import Target, TaskSpec, runtime_spec
from ..plugins.worker_process import WorkerJob
from ..plugins.workers import WorkerFailed, Workers
from .base import LISTENING_MAX_SLEEP, Tick
from .results import SharedResults

if TYPE_CHECKING:
    from ..db.listen import Listener
    from ..leadership.shards import MemberLease, ShardLease

ABANDONED = "abandoned: the replica running it lost the lock before it finished"
# Sent by the scheduler_plugin_tasks triggers (migrations 0004, 0006) when a schedule
# becomes due sooner than its leader may have planned.
WAKE_CHANNEL = "scheduler_plugin_tasks_changed"
# Results of one batch wait at most this long to be written, or for this many to gather.
RESULT_FLUSH_INTERVAL = 0.05
RESULT_FLUSH_SIZE = 500
# A result that cannot be written is tried this many times (the lease still valid: a
# database error, not a lost lock) before its run is left to be abandoned.
RESULT_ATTEMPTS = 3
# Per-schedule misfire lines in one tick, past which one summary line says the rest.
MISFIRE_LINES = 10
# How often the lagging warning may repeat while the loop stays behind.
LAG_WARNING_EVERY = 10.0
# The shortest time between two ticks' starts: slots that fall due within it are claimed
# together (one transaction for all of them, not one each), for at most this much more
# lateness. 1,000 slots a second spread evenly cost 50 ticks a second, not 1,000.
TICK_SPACING = 0.02


@dataclass(frozen=True, slots=True)
class Start:
    """A claimed run, to start once the claim has committed."""

    spec: TaskSpec
    slot: datetime
    run_id: int
    shard: int | None = None  # sharded: the shard whose lease runs it


@dataclass(frozen=True, slots=True)
class Ended:
    """A run that ended, with what to say once its result is written."""

    result: RunResult
    duration: float
    log: Logger
    timeout: float


@dataclass(frozen=True, slots=True)
class Clock:
    """The database's clock at a tick's read, against ours: a run's end, measured here, is
    recorded on the database's clock without waiting for a statement to stamp it."""

    db_now: datetime
    local: float

    def now(self) -> datetime:
        return self.db_now + timedelta(seconds=time.monotonic() - self.local)


@dataclass(slots=True)
class TickPlan:
    claims: list[Claim] = field(default_factory=list)
    specs: dict[str, TaskSpec] = field(default_factory=dict)  # by name, for what runs
    shards: dict[str, int | None] = field(default_factory=dict)  # by name, sharded
    refused: dict[str, str] = field(default_factory=dict)  # name -> why it cannot run
    misfired: list[tuple[str, datetime, datetime]] = field(default_factory=list)
    waiting: bool = False  # something due waits for a free place or a run's end
    held: bool = False  # something due waits for its last run's result to be written
    unknown: bool = False  # a declared task another deployment declares: not ours


class PluginWork:
    name = "plugin"

    def __init__(
        self,
        tasks: list[TaskSpec],
        runnable: Mapping[str, Target],
        settings: Settings,
        metrics: Metrics,
        workers: Workers | None,
        sticky: bool,
        listener: Listener | None = None,
    ) -> None:
        # Sharded leadership (leadership/shards.py): a tick's lease is the replica's
        # membership, and it claims for the shards it holds; each shard's runs are the
        # work of that shard's lease.
        self.sharded = settings.plugin.shards > 1
        self.tasks = {spec.name: spec for spec in tasks}  # declared by the deployment
        self.runnable = dict(runnable)  # what runtime schedules may name
        self.settings = settings
        self.metrics = metrics
        self.workers = workers  # runs sync targets; None when no target is sync
        self.sticky = sticky  # a lease lasts until lost (session mode, SQLite)
        self.listener = listener  # PostgreSQL, session mode
        # Executing runs by schedule name (a claimed run counts from its claim on).
        self.running: dict[str, asyncio.Task[Any]] = {}
        self._sync_running: set[str] = set()  # of those, sync targets (worker processes)
        # Schedules whose last run ended and whose result is not written yet: not claimed
        # again until it is (the database still has that run `running`).
        self.unrecorded: set[str] = set()
        # One task per tick that claimed runs, with their rows in scheduler_plugin_runs.
        self._batches: dict[asyncio.Task[None], list[int]] = {}
        self.wake: Callable[[], None] = lambda: None  # the runner sets its own
        self._lease: Lease | None = None
        self._runtime: dict[tuple[str, Any], TaskSpec] = {}  # built from rows, reused
        # Runs whose results will never be written (dropped after failed attempts, or a
        # run that crashed), by id: closed as abandoned by the next tick, even while their
        # batch goes on; their schedules are not claimed again until that committed.
        self._orphans: dict[int, str] = {}
        # Wake-ups worth a tick: a place freed while something waited for one, results
        # written while something due waited for them (any other is a tick for nothing).
        self._want_place = False
        self._want_results = False
        self._last_tick = 0.0
        self._lag_warned = 0.0
        # Sharded: the shards' batches write their results together (loops/results.py).
        self._results = SharedResults[Ended](self._finish, lambda e: e.result.name)

    # -- the tick ------------------------------------------------------------------------

    async def tick(self, tick: Tick) -> float | None:
        starts: list[Start] = []
        spacing = self._last_tick + TICK_SPACING - time.monotonic()
        if spacing > 0:
            await asyncio.sleep(spacing)
        self._last_tick = time.monotonic()
        if self.listener is not None:
            await self.listener.ensure()  # before the read below: no change goes unheard
        taking_over = self._lease is not tick.lease
        shards: list[ShardLease] = []
        fence: AbstractAsyncContextManager[Tx]
        if self.sharded:
            member = cast("MemberLease", tick.lease)
            member.wake_loop = self.wake  # a shard taken is claimed for at once
            shards = member.active_shards()
            if not shards and not taking_over:
                return None  # nothing to lead yet; a shard taken wakes us
            fence = member.fenced(shards, only_ours=True)
        else:
            fence = tick.lease.transaction(only_ours=True)
        holds: list[tuple[Lease, PendingHold, list[Start]]] = []
        try:
            async with fence as tx:
                store = PluginStore(tx)
                if taking_over:
                    await self._take_over(store, tick.log)
                # Whoever holds the lock knows that nothing executes the runs still marked
                # `running` (runs execute under the lock): a sticky leader when it takes
                # over, in transaction mode every tick that wins. (Had their replica lost
                # its hold to the server and still be stopping them, the guard waited for
                # it before this tick: see the guards' settle.)
                orphans = dict(self._orphans)
                new_shards = [s for s in shards if s.needs_abandon]
                if taking_over or not self.sticky or orphans or new_shards:
                    await self._abandon(store, tick.log, orphans)
                # Schedules in flight are read too (their slot is skipped as overlapping),
                # and those whose result is not written yet (they wait for it).
                limit = max(1, self._free() + len(self.running) + len(self.unrecorded))
                batch = await store.due(limit)
                clock = Clock(batch.now, time.monotonic())
                plan_ = self._plan(batch)
                # Said now, before the awaits below: a run that ends meanwhile must see
                # that something waits for its place (or its result).
                truncated = len(batch.due) >= limit
                self._want_place = plan_.waiting or truncated
                self._want_results = plan_.held or truncated
                if plan_.unknown and not self.sharded:
                    # The leader's declarations win. Sharded, members of two deployments
                    # (a rolling deploy) would retire each other's new tasks: a member
                    # declares when it joins, and leaves a task it does not know to the
                    # members that do.
                    await self._declare(store, tick.log)
                if plan_.refused:
                    await store.refuse(plan_.refused)
                    for name, reason in plan_.refused.items():
                        tick.log.error("task.refused", task=name, error=reason)
                if plan_.claims:
                    claimed = await store.claim(self.settings.instance_id, plan_.claims)
                    starts = self._starts(plan_, claimed, tick.log)
                self._report(batch, plan_, tick.log)
                wake = self._next_wake(batch, plan_, limit)
                for lease, group in self._by_lease(tick.lease, shards, starts):
                    holds.append((lease, await lease.hold_after(tx), group))
        except BaseException:
            for _, hold, _ in holds:
                await hold.discard()  # what it would have run was rolled back
            raise
        self._lease = tick.lease  # committed: reconciled, and its predecessors' runs closed
        for shard in new_shards:
            shard.needs_abandon = False
        for run_id, name in orphans.items():  # closed: their schedules may run again
            del self._orphans[run_id]
            self.unrecorded.discard(name)
        for lease, hold, group in holds:
            try:
                self._start_batch(lease, hold, group, clock, tick.log)
            except LeadershipLost:
                if lease is tick.lease:
                    raise
                # That shard was lost since the claim committed (the member goes on): its
                # runs stay `running` for the shard's next owner to close, never run here.
                tick.log.warning("shard.lost_before_start", runs=len(group))
        return wake

    @staticmethod
    def _by_lease(
        lease: Lease, shards: list[ShardLease], starts: list[Start]
    ) -> list[tuple[Lease, list[Start]]]:
        """The runs to start, by the lease that runs them: the tick's, or (sharded) each
        one's shard's."""
        if not starts:
            return []
        if not shards:
            return [(lease, starts)]
        by_shard = {shard.shard: shard for shard in shards}
        groups: dict[int, list[Start]] = {}
        for start in starts:
            assert start.shard is not None  # a sharded tick's rows say their shard
            groups.setdefault(start.shard, []).append(start)
        return [(by_shard[shard], group) for shard, group in groups.items()]

    def _free(self) -> int:
        return self.settings.plugin.concurrency - len(self.running)

    def _spec(self, due: DueSchedule) -> TaskSpec | str | None:
        """The task a due row stands for; a reason (str) when it cannot be run here; None
        for a declared task this deployment does not declare."""
        if due.runtime is None:
            return self.tasks.get(due.name)
        key = (due.name, due.runtime)
        spec = self._runtime.get(key)
        if spec is None:
            try:
                spec = runtime_spec(due.name, due.runtime, self.runnable)
            except Exception as exc:  # whatever a row written by hand makes of it
                return describe(exc)
            if len(self._runtime) > 4 * max(self.settings.plugin.concurrency, 10_000):
                self._runtime.clear()  # definitions change; never grow without bound
            self._runtime[key] = spec
        return spec

    def _plan(self, batch: DueBatch) -> TickPlan:
        """What to claim of what is due. One run per schedule per claim, never one of a
        schedule whose previous run is still executing (that slot is skipped, as
        overlapping); a schedule that finds no free place stays due, oldest first."""
        result = TickPlan()
        now = batch.now
        free = self._free()
        sync_free = self.settings.plugin.sync_concurrency - len(self._sync_running)
        for due in batch.due:
            spec = self._spec(due)
            if spec is None:
                result.unknown = True
                continue
            if isinstance(spec, str):
                result.refused[due.name] = spec
                continue
            if due.name in self.unrecorded and due.name not in self.running:
                result.held = True  # claimed once its last result is written
                continue
            busy = due.name in self.running
            is_sync = spec.target is not None and not spec.is_async
            if not busy and (free <= 0 or (is_sync and sync_free <= 0)):
                result.waiting = True  # stays due until a place frees
                continue
            slots: list[datetime] = []
            next_run_at = due.next_run_at
            if due.next_run_at <= now:
                try:
                    step = plan(spec.schedule, due.next_run_at, now, spec.misfire)
                except Exception as exc:  # no next slot to be had (a date out of range)
                    result.refused[due.name] = f"cannot compute its next slot: {describe(exc)}"
                    continue
                next_run_at = step.next_run_at
                if step.missed:
                    result.misfired.append((due.name, due.next_run_at, next_run_at))
                if step.run:
                    slots.append(due.next_run_at)
            trigger = due.trigger_requested_at
            if busy:
                # Its slot overlaps the run in flight: skipped. A trigger waits for the
                # run to end (its end wakes the loop).
                claim = Claim(
                    due.name, due.next_run_at, next_run_at, skip_slot=slots[0] if slots else None
                )
                if next_run_at != due.next_run_at or claim.skip_slot is not None:
                    result.claims.append(claim)
                if trigger is not None:
                    result.waiting = True
                continue
            if trigger is not None:
                slots.append(trigger)  # a manual run is a slot like any other
            run_slot = slots[0] if slots else None
            # A trigger and a due slot found together: one runs, the other would overlap it.
            skip_slot = slots[1] if len(slots) > 1 else None
            result.claims.append(
                Claim(
                    due.name,
                    seen_next=due.next_run_at,
                    next_run_at=next_run_at,
                    seen_trigger=trigger,
                    run_slot=run_slot,
                    skip_slot=skip_slot,
                )
            )
            if run_slot is not None:
                result.specs[due.name] = spec
                result.shards[due.name] = due.shard
                free -= 1
                sync_free -= is_sync
        return result

    def _starts(self, plan_: TickPlan, claimed: list[Any], log: Logger) -> list[Start]:
        starts: list[Start] = []
        got = {(run.name, run.slot): run for run in claimed}
        for claim in plan_.claims:
            if claim.skip_slot is not None and (claim.name, claim.skip_slot) in got:
                label = self._label(claim.name, plan_.specs.get(claim.name))
                self.metrics.plugin_runs.labels(label, "skipped_overlap").inc()
                log.warning(
                    "task.skipped_overlap", task=claim.name, slot=claim.skip_slot.isoformat()
                )
            if claim.run_slot is None:
                continue
            run = got.get((claim.name, claim.run_slot))
            if run is None:
                # Its next_run_at moved since the read (a change wins: looked at again next
                # tick), or the slot was taken: nothing runs.
                log.info("task.slot_taken", task=claim.name, slot=claim.run_slot.isoformat())
                continue
            starts.append(
                Start(plan_.specs[claim.name], claim.run_slot, run.id, plan_.shards[claim.name])
            )
        return starts

    def _report(self, batch: DueBatch, plan_: TickPlan, log: Logger) -> None:
        oldest = batch.oldest_due
        lag = 0.0 if oldest is None else max(0.0, (batch.now - oldest).total_seconds())
        self.metrics.plugin_lag.set(lag)
        if plan_.misfired:
            self.metrics.plugin_misfires.inc(len(plan_.misfired))
            by_name = {name: spec.misfire for name, spec in self.tasks.items()}
            for name, slot, following in plan_.misfired[:MISFIRE_LINES]:
                log.warning(
                    "task.misfired", task=name, slot=slot.isoformat(),
                    policy=by_name.get(name, "runtime"), next_run_at=following.isoformat(),
                )  # fmt: skip
            if len(plan_.misfired) > MISFIRE_LINES:
                log.warning(
                    "plugin.misfired", schedules=len(plan_.misfired),
                    logged=MISFIRE_LINES, oldest_slot=min(s for _, s, _ in plan_.misfired).isoformat(),
                )  # fmt: skip
        behind = plan_.waiting and lag > max(1.0, self.settings.plugin.interval)
        if behind and time.monotonic() - self._lag_warned > LAG_WARNING_EVERY:
            self._lag_warned = time.monotonic()
            log.warning(
                "plugin.lagging", lag=round(lag, 3), concurrency=self.settings.plugin.concurrency,
                hint="due schedules wait for a free place: raise plugin.concurrency, or "
                "shorten the runs",
            )  # fmt: skip

    def _next_wake(self, batch: DueBatch, plan_: TickPlan, limit: int) -> float | None:
        """Until the next slot to come. What is due but waits (for a place, for a run of
        its own to end, for its last result to be written) is woken by that event, not
        by a sleep: the other schedules' slots still wake the loop on time."""
        if len(batch.due) >= limit and self._free() - len(plan_.specs) > 0:
            return 0.0  # more may be due than this tick read, and places are left
        upcoming = [claim.next_run_at for claim in plan_.claims]
        if batch.next_slot is not None:
            upcoming.append(batch.next_slot)
        if not upcoming:
            return None
        return max(0.0, (min(upcoming) - batch.now).total_seconds())

    def max_sleep(self) -> float:
        if self.listener is not None and self.listener.listening:
            return LISTENING_MAX_SLEEP
        return self.settings.plugin.interval

    def _on_tasks_changed(self, _payload: str) -> None:
        self.wake()

    async def leadership_started(self, lease: Lease) -> None:
        # The first tick takes over (reconciles, closes the predecessor's runs): until it
        # has committed, self._lease is not this lease, and every tick tries again.
        if self.listener is not None:
            await self.listener.subscribe(WAKE_CHANNEL, self._on_tasks_changed)

    async def leadership_ended(self, graceful: bool) -> None:
        """Graceful (daemon stopping, lease still valid): let the runs finish and record
        their results (the daemon cancels us past shutdown_timeout; losing the lease
        meanwhile cancels them at once). Either way the guard then stops whatever is left,
        before it lets the lock go."""
        self._lease = None
        self.metrics.plugin_lag.set(0)  # a standby reports no lag: only the leader knows
        if self.listener is not None:
            self.listener.unsubscribe(WAKE_CHANNEL)
        if graceful and self._batches:
            await asyncio.wait(list(self._batches))

    # -- a leadership's first tick ----------------------------------------------------------

    async def _take_over(self, store: PluginStore, log: Logger) -> None:
        """Bring declared tasks' rows in line with this deployment, keeping every known
        task's next_run_at (a restart must not reschedule), and publish what runtime
        schedules may name."""
        await self._declare(store, log)
        await store.publish_runnable(self.runnable)

    async def _declare(self, store: PluginStore, log: Logger) -> None:
        now = await store.now()
        declared = [
            Declaration(spec.name, spec.schedule.describe(), spec.schedule.first(now), spec.source)
            for spec in self.tasks.values()
        ]
        for change in await store.declare(declared):
            spec = self.tasks.get(change.name)
            schedule = spec.schedule.describe() if spec is not None else None
            if change.change == "registered":
                log.info(
                    "task.registered", task=change.name, schedule=schedule,
                    source=spec.source if spec is not None else None,
                )  # fmt: skip
            elif change.change == "rescheduled":
                log.info("task.rescheduled", task=change.name, schedule=schedule)
            elif change.change == "shadowed":
                log.error(
                    "task.shadowed", task=change.name,
                    hint="a runtime schedule has this declared task's name: the runtime "
                    "schedule runs; remove it or rename the task",
                )  # fmt: skip

    async def _abandon(self, store: PluginStore, log: Logger, orphans: dict[int, str]) -> None:
        # Our own runs in flight are left alone: they will write their results. Not the
        # orphans among them, which never will.
        ours = sorted(
            run_id
            for run_ids in self._batches.values()
            for run_id in run_ids
            if run_id not in orphans
        )
        for run in await store.abandon(ABANDONED, ours):
            self.metrics.plugin_runs.labels(self._label(run.name, None), "abandoned").inc()
            log.warning(
                "task.abandoned", task=run.name, slot=run.slot.isoformat(),
                run_instance=run.instance,  # `instance` names the logger
            )  # fmt: skip

    def _label(self, name: str, spec: TaskSpec | None) -> str:
        """The ``task`` label of a run's metrics: a declared task's name, a runtime
        schedule's target (thousands of schedules must not make thousands of series)."""
        if name in self.tasks:
            return name
        if spec is not None and spec.target_path is not None:
            return spec.target_path
        return "runtime"

    # -- running a batch ------------------------------------------------------------------

    def _start_batch(
        self, lease: Lease, hold: PendingHold, starts: list[Start], clock: Clock, log: Logger
    ) -> None:
        batch = lease.spawn(self._run_batch(hold, starts, clock, log), name="plugin:batch")
        self._batches[batch] = [start.run_id for start in starts]
        batch.add_done_callback(self._batches.pop)
        for start in starts:  # its places are taken from now on
            self._track(start.spec, batch)

    async def _run_batch(
        self, pending: PendingHold, starts: list[Start], clock: Clock, log: Logger
    ) -> None:
        """Hold the lock for one tick's runs until every one of them has ended and its
        result is written (or the hold is lost: then its exit stops them, within
        stop_grace, before it lets go)."""
        entered = False
        runs: dict[asyncio.Task[Ended], Start] = {}
        written: set[int] = set()  # run ids whose results are in the database
        try:
            async with pending as hold:
                entered = True
                for start in starts:
                    run = hold.spawn(
                        self._run(start, hold, clock, log), name=f"task:{start.spec.name}"
                    )
                    self._track(start.spec, run)
                    runs[run] = start
                await self._collect(hold, runs, written, log)
        except Exception as exc:  # lost before or while committing: the runs stay `running`
            log.warning("plugin.hold_failed", error=describe(exc))
        finally:
            if not entered:
                await pending.discard()  # cancelled before it began: never leave it queued
            # A result not written stays `running` for a holder of the lock to abandon;
            # its schedule may be claimed again (it cannot have been meanwhile).
            for run, start in runs.items():
                unwritten = start.run_id not in written
                orphan = start.run_id in self._orphans  # unrecorded until abandoned
                if run.done() and not run.cancelled() and unwritten and not orphan:
                    self.unrecorded.discard(start.spec.name)
            self.wake()

    async def _collect(
        self,
        hold: Lease,
        runs: dict[asyncio.Task[Ended], Start],
        written: set[int],
        log: Logger,
    ) -> None:
        """Write the runs' results as they end: every RESULT_FLUSH_INTERVAL while some
        still run, at once when RESULT_FLUSH_SIZE wait, and the rest when the last ends."""
        pending: set[asyncio.Future[Any]] = set(runs)
        buffered: list[Ended] = []
        oldest = 0.0
        lost = asyncio.ensure_future(hold.lost.wait())
        attempts = 0
        try:
            while pending or buffered:
                timeout = None
                if buffered:
                    timeout = max(0.0, oldest + RESULT_FLUSH_INTERVAL - time.monotonic())
                if pending:
                    done, pending = await asyncio.wait(
                        pending | {lost}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                    )
                    pending.discard(lost)
                    if lost.done():
                        return  # the hold's exit stops the runs
                    for run in done:
                        if run is lost or run.cancelled():
                            continue
                        if (error := run.exception()) is not None:  # a bug of ours: say so
                            log.error("task.run_crashed", error=describe(error))
                            start = runs[cast(asyncio.Task[Ended], run)]
                            self._orphans[start.run_id] = start.spec.name
                            self.unrecorded.add(start.spec.name)
                            continue
                        if not buffered:
                            oldest = time.monotonic()
                        buffered.append(cast(Ended, run.result()))
                due = time.monotonic() - oldest >= RESULT_FLUSH_INTERVAL
                if buffered and (not pending or due or len(buffered) >= RESULT_FLUSH_SIZE):
                    try:
                        await self._record(hold, buffered, log)
                    except Exception as exc:
                        attempts += 1
                        if hold.lost.is_set() or attempts >= RESULT_ATTEMPTS:
                            self._drop(buffered, exc, log)
                            buffered = []
                            attempts = 0
                        else:
                            log.warning("task.results_retry", error=describe(exc))
                            await asyncio.sleep(RESULT_FLUSH_INTERVAL * attempts)
                        continue
                    for ended in buffered:
                        self.unrecorded.discard(ended.result.name)
                        written.add(ended.result.id)
                    buffered = []
                    attempts = 0
                    if self._want_results:  # a schedule of theirs was due meanwhile
                        self._want_results = False
                        self.wake()
        finally:
            lost.cancel()

    def _drop(self, results: list[Ended], exc: Exception, log: Logger) -> None:
        # Lost leadership or database trouble: the runs stay `running` until a holder of
        # the lock marks them abandoned (this one's next tick, if it still leads). Never
        # retried as runs: a slot runs at most once.
        for ended in results:
            self._orphans[ended.result.id] = ended.result.name
            ended.log.warning(
                "task.result_not_recorded", status=ended.result.status, error=describe(exc)
            )

    async def _record(self, hold: Lease, ended: list[Ended], log: Logger) -> None:
        limit = self.settings.plugin.max_consecutive_failures
        if self.sharded:  # with the other shards' results, in one transaction
            finished = await self._results.write(cast("ShardLease", hold), ended)
        else:
            async with hold.transaction(only_ours=True) as tx:
                finished = await self._finish(PluginStore(tx), ended)
        for each in ended:  # said once recorded: a reader of the log finds it in the table
            if each.result.status == "succeeded":
                each.log.info("task.succeeded", duration=round(each.duration, 3))
            elif each.result.status == "timed_out":
                each.log.error("task.timed_out", timeout=each.timeout)
        for schedule in finished:
            if schedule.paused and schedule.consecutive_failures == limit:
                log.error(
                    "task.auto_paused", task=schedule.name, failures=limit,
                    hint=f"scheduler-daemon tasks resume {schedule.name}",
                )  # fmt: skip

    async def _finish(self, store: PluginStore, ended: Sequence[Ended]) -> list[FinishedSchedule]:
        """Results written, and history trimmed every so many runs per schedule, never
        per run: it stays between `history` and `history` + that many rows."""
        keep = self.settings.plugin.history
        every = max(1, min(100, keep))
        limit = self.settings.plugin.max_consecutive_failures
        finished = await store.finish([e.result for e in ended], limit)
        trim = [f.name for f in finished if f.run_count % every == 0]
        if trim:
            await store.trim(trim, keep)
        return finished

    def _track(self, spec: TaskSpec, task: asyncio.Task[Any]) -> None:
        name = spec.name
        self.running[name] = task
        if spec.target is not None and not spec.is_async:
            self._sync_running.add(name)
        task.add_done_callback(lambda _: self._untrack(name, task))

    def _untrack(self, name: str, task: asyncio.Task[Any]) -> None:
        if self.running.get(name) is task:
            del self.running[name]
            self._sync_running.discard(name)
            if self._want_place:  # something due waits for a place
                self._want_place = False
                self.wake()

    async def _run(self, start: Start, hold: Lease, clock: Clock, log: Logger) -> Ended:
        spec = start.spec
        run_log = log.bind(task=spec.name, slot=start.slot.isoformat())
        if start.shard is not None:
            run_log = run_log.bind(shard=start.shard)
        ctx = TaskContext(
            name=spec.name,
            slot=start.slot,
            instance=self.settings.instance_id,
            log=run_log,
            fencing_token=hold.fencing_token,
            args=spec.args,
            shard=start.shard,
            lease=hold,
        )
        run_log.info("task.started", run_id=start.run_id, fencing_token=hold.fencing_token)
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
        label = self._label(spec.name, spec)
        self.metrics.plugin_runs.labels(label, status).inc()
        self.metrics.plugin_run_duration.labels(label).observe(duration)
        # Its schedule is not claimed again until this result is written.
        self.unrecorded.add(spec.name)
        result = RunResult(start.run_id, spec.name, status, error, clock.now())
        return Ended(result, duration, run_log, spec.timeout)

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
                log=self.settings.log,
                log_context=dict(structlog.get_context(log)),
                args=spec.args,
                shard=ctx.shard,
            )
            await self.workers.run(
                job,
                lock_may_be_free=hold.lock_may_be_free,
                proven_recently=hold.proven_recently,
                grace=self.settings.lock.stop_grace,
            )
