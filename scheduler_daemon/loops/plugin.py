"""The plugin loop: run each schedule's due slot once, cluster-wide, by one replica at a time.

Schedules are rows of ``scheduler_plugin_tasks``: the deployment's declared tasks (config,
plugins, built-ins), whose code this replica knows, and runtime schedules the application
added, each naming a target the deployment declared runnable, with its own ``args``.

A tick costs O(due), never O(schedules), and one statement (``plugin_claim``,
db/plugin_store.py): it claims the whole batch the tick planned, each schedule's
``next_run_at`` advanced by compare-and-set on what was read and its ``(name, slot)`` run
inserted, and reads the window the next tick plans from: the due schedules from the
``next_run_at`` index, oldest slot first and at most as many as it has places (so however
far behind the leader is, every schedule progresses and none starves), then those due
soon after the next slot to come, with the database's now. The tick plans from the last
window on its estimate of the database's clock; what that window missed or got wrong the
claim leaves alone, and the next window holds. A leadership's first tick reads first.
The unique ``(name, slot)`` and the one-running-run-per-schedule index are the
guarantee: even two overlapping leaders cannot run one slot twice, nor two runs of one
schedule at once.

The runs start after that transaction commits, as work of the leadership inside a hold
on the lock, so that none executes without this replica holding the loop's lock; their
results are written in batches. That is loops/plugin_runs.py (``PluginRuns``), which
tells the tick what is running and what waits for its result to be written: a schedule
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
from collections.abc import Callable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import TYPE_CHECKING, Any

from ..config.settings import Settings
from ..db.base import Tx
from ..db.plugin_store import Claim, Claimed, DueBatch, DueSchedule, PluginStore
from ..errors import describe
from ..leadership import ClaimScope, LeadershipLost, Lease, PendingHold
from ..logs import Logger
from ..metrics import Metrics
from ..plugins.tasks import Target, TaskSpec, plan, runtime_spec
from ..plugins.workers import Workers
from .base import LISTENING_MAX_SLEEP, Tick
from .plugin_runs import PluginRuns, Start
from .plugin_takeover import Takeover

if TYPE_CHECKING:
    from ..db.listen import Listener

# Sent by the scheduler_plugin_tasks triggers (migrations 0004, 0006) when a schedule
# becomes due sooner than its leader may have planned.
WAKE_CHANNEL = "scheduler_plugin_tasks_changed"
# Per-schedule misfire lines in one tick, past which one summary line says the rest.
MISFIRE_LINES = 10
# How often the lagging warning may repeat while the loop stays behind.
LAG_WARNING_EVERY = 10.0
# The shortest time between two ticks' starts: slots that fall due within it are claimed
# together (one transaction for all of them, not one each), for at most this much more
# lateness. 1,000 slots a second spread evenly cost 50 ticks a second, not 1,000.
TICK_SPACING = 0.02
MAX_AHEAD_ROUND_TRIP = 1.0  # the longest round trip a window's read-ahead allows for
WAKE_PAST_SLOT = 0.0002  # how long past a slot the loop wakes for it (see _next_wake)


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


@dataclass(slots=True)
class TickScope:
    """What one tick claims for and how it fences that (``claim``), and what it closes
    first: its predecessors' runs where it takes over the loop or a shard (``fresh``)."""

    claim: ClaimScope
    taking_over: bool
    orphans: dict[int, str]  # runs whose results will never be written, by id
    fresh: list[Lease]  # the leases in ``claim`` no committed tick claimed for yet

    @property
    def fence(self) -> AbstractAsyncContextManager[Tx]:
        return self.claim.fence

    @property
    def self_fenced(self) -> bool:
        return self.claim.self_fenced


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
        self.sticky = sticky  # a lease lasts until lost (session mode, SQLite)
        self.listener = listener  # PostgreSQL, session mode
        # The runs in flight and their results (loops/plugin_runs.py).
        self.runs = PluginRuns(settings, metrics, workers, self._label, lambda: self.wake(), sticky)
        # What a leadership writes before it claims (loops/plugin_takeover.py).
        self.takeover = Takeover(self.tasks, self.runnable, metrics, self._label)
        self.wake: Callable[[], None] = lambda: None  # the runner sets its own
        # The leadership's first tick takes over: reconciles the declared tasks and closes
        # the runs a predecessor left `running`. Until one has committed, every tick tries.
        self._taken_over = False
        # The leases (the loop's, or each shard's) the last committed tick claimed for:
        # their predecessors' runs are closed. A shard taken since is not among them.
        self._caught_up: set[Lease] = set()
        # A declared task another deployment declares was found by a tick that had no
        # transaction to reconcile in: the next tick has one.
        self._declare_due = False
        self._runtime: dict[tuple[str, Any], TaskSpec] = {}  # built from rows, reused
        # What the last tick's statement read: the next tick plans its claim from it, so
        # that claim (and the next window's read) is one round trip. None: read first.
        self._window: DueBatch | None = None
        # This tick's claims the database refused though their slot was due (a run still
        # `running` that is not ours, say): name -> (slot read, next slot planned). Not
        # tried again before that next slot, as if claimed, unless their row changes.
        self._passed: dict[str, tuple[datetime, datetime]] = {}
        self._last_tick = 0.0
        self._lag_warned = 0.0

    # -- the tick ------------------------------------------------------------------------

    async def tick(self, tick: Tick) -> float | None:
        spacing = self._last_tick + TICK_SPACING - time.monotonic()
        if spacing > 0:
            await asyncio.sleep(spacing)
        self._last_tick = time.monotonic()
        if self.listener is not None:
            await self.listener.ensure()  # before the read below: no change goes unheard
        scope = self._scope(tick.lease)
        if scope is None:
            return None  # sharded, nothing to lead yet; a shard taken wakes us
        holds: list[tuple[Lease, PendingHold, list[Start]]] = []
        try:
            async with scope.fence as tx:
                window, starts = await self._claim_due(PluginStore(tx), scope, tick.log)
                for lease, group in self._by_lease(scope.claim.leases, starts):
                    holds.append((lease, await lease.hold_after(tx), group))
        except BaseException:
            self._window = None  # what it read may have been rolled back
            for _, hold, _ in holds:
                await hold.discard()  # what it would have run was rolled back
            raise
        self._committed(scope, window)
        for lease, hold, group in holds:
            try:
                self.runs.start_batch(lease, hold, group, window.clock, tick.log)
            except LeadershipLost:
                if lease is tick.lease:
                    raise
                # That shard was lost since the claim committed (the member goes on): its
                # runs stay `running` for the shard's next owner to close, never run here.
                tick.log.warning("shard.lost_before_start", runs=len(group))
        return self._next_wake(window)

    def _scope(self, lease: Lease) -> TickScope | None:
        """What this tick claims for, how it fences that, and what it closes (None: a
        sharded member that holds no shard yet)."""
        taking_over, orphans = not self._taken_over, self.runs.orphaned()
        # The common tick is one statement, the claim, which fences itself (no transaction
        # around it: it compares-and-sets what was read, as it would in one). Closing and
        # reconciling take several statements: a transaction.
        closing = taking_over or not self.sticky or orphans or self._declare_due
        claim = lease.claim_scope(self_fenced=not closing)
        if not claim.leases and not taking_over:
            return None  # a shard it takes wakes the loop (wake_on_gain)
        fresh = [each for each in claim.leases.values() if each not in self._caught_up]
        return TickScope(claim, taking_over, orphans, fresh)

    async def _claim_due(
        self, store: PluginStore, scope: TickScope, log: Logger
    ) -> tuple[DueBatch, list[Start]]:
        """Close what needs closing, plan what is due, claim what can run: the window read
        after the claim (what the next tick plans from), and the runs to start once this
        commits."""
        if scope.taking_over:
            await self.takeover.take_over(store, log)
        # Whoever holds the lock knows that nothing executes the runs still marked
        # `running` (runs execute under the lock): a sticky leader when it takes over, in
        # transaction mode every tick that wins. (Had their replica lost its hold to the
        # server and still be stopping them, the guard waited for it before this tick:
        # see the guards' settle.)
        if scope.taking_over or not self.sticky or scope.orphans or scope.fresh:
            await self.takeover.abandon(store, log, self.runs.ours(scope.orphans))
        # Schedules in flight are read too (their slot is skipped as overlapping), and
        # those whose result is not written yet (they wait for it).
        limit = max(1, self._free() + self.runs.in_flight())
        # A sticky leader plans from what its last statement read, on its estimate of the
        # database's clock: its claim is then this tick's one round trip. What that window
        # missed or got wrong (a schedule added or changed since, a clock read early) the
        # claim leaves alone, and the window read with it holds: the next tick claims it.
        # A lease that is new to this tick has no window of its own yet: read first.
        window = self._window if self.sticky and not scope.fresh else None
        read_now = window is None
        if window is None:
            window = (await self._claimed(store, [], limit)).window
        elif self.sharded:  # a shard lost since: not planned for
            window = replace(window, due=[d for d in window.due if d.shard in scope.claim.leases])
        now = window.clock.now()
        # The orphans closed above free their schedules in this very transaction: planned
        # as held (waiting for a result that never comes), they would wait for the
        # longest sleep instead of running now.
        plan_ = self._plan(window, set(scope.orphans.values()), now)
        # Said now, before the awaits below: a run that ends meanwhile must see that
        # something waits for its place (or its result).
        self.runs.want(place=plan_.waiting or window.full, results=plan_.held or window.full)
        await self._write_plan(store, plan_, window, scope, log)
        self._report(window, now, plan_, log)
        self._passed = {}
        if not plan_.claims and not plan_.refused and read_now:
            return window, []  # just read: nothing to claim, nothing newer to read
        claimed = await self._claimed(store, plan_.claims, limit)
        return claimed.window, self._starts(plan_, claimed, log)

    async def _claimed(self, store: PluginStore, claims: list[Claim], limit: int) -> Claimed:
        """One statement: ``claims`` claimed, and the window read after them."""
        # Far enough past the next slot to hold the next tick's work: the tick wakes at
        # that slot, at least TICK_SPACING after this one, and reads one round trip later.
        last = self._window.round_trip if self._window is not None else 0.0
        ahead = 2 * TICK_SPACING + min(last, MAX_AHEAD_ROUND_TRIP)
        return await store.claim(self.settings.instance_id, claims, limit=limit, ahead=ahead)

    async def _write_plan(
        self, store: PluginStore, plan_: TickPlan, seen: DueBatch, scope: TickScope, log: Logger
    ) -> None:
        if plan_.unknown and not self.sharded:
            # The leader's declarations win. Sharded, members of two deployments (a rolling
            # deploy) would retire each other's new tasks: a member declares when it
            # joins, and leaves a task it does not know to the members that do. Several
            # statements: in a transaction, the next tick's at once if this one has none.
            if scope.self_fenced:
                self._declare_due = True
            else:
                await self.takeover.declare(store, log)
        if plan_.refused:
            await store.refuse(plan_.refused, {due.name: due for due in seen.due})
            for name, reason in plan_.refused.items():
                log.error("task.refused", task=name, error=reason)

    def _committed(self, scope: TickScope, window: DueBatch) -> None:
        """The tick's writes are in: what it closed may run again, and what it read is
        what the next tick plans from."""
        self._window = window
        self._taken_over = True  # reconciled, and its predecessors' runs closed
        if not scope.self_fenced:
            self._declare_due = False
        self._caught_up = set(scope.claim.leases.values())
        self.runs.closed(scope.orphans)

    @staticmethod
    def _by_lease(
        leases: Mapping[int | None, Lease], starts: list[Start]
    ) -> list[tuple[Lease, list[Start]]]:
        """The runs to start, by the lease that runs them: the tick's, or (sharded) each
        one's shard's (a sharded tick's rows say their shard; unsharded, None)."""
        groups: dict[int | None, list[Start]] = {}
        for start in starts:
            groups.setdefault(start.shard, []).append(start)
        return [(leases[shard], group) for shard, group in groups.items()]

    def _free(self) -> int:
        return self.runs.free()[0]

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

    def _plan(self, batch: DueBatch, closing: set[str], now: datetime) -> TickPlan:
        """What to claim of what is due at ``now``. One run per schedule per claim, never
        one of a schedule whose previous run is still executing (that slot is skipped, as
        overlapping); a schedule that finds no free place stays due, oldest first. A schedule
        whose result is not written yet waits for it, unless its run is in ``closing`` (an
        orphan abandoned by this tick's transaction)."""
        result = TickPlan()
        free, sync_free = self.runs.free()
        for due in batch.due:
            if due.due_at() > now:
                break  # the window is in due_at order: the rest are later still
            spec = self._spec(due)
            if spec is None:
                result.unknown = True
                continue
            if isinstance(spec, str):
                result.refused[due.name] = spec
                continue
            if self.runs.waits_for_result(due.name, closing):
                result.held = True  # claimed once its last result is written
                continue
            busy = self.runs.busy(due.name)
            is_sync = spec.target is not None and not spec.is_async
            if not busy and (free <= 0 or (is_sync and sync_free <= 0)):
                result.waiting = True  # stays due until a place frees
                continue
            if self._plan_one(due, spec, now, busy, result):
                free -= 1
                sync_free -= is_sync
        return result

    def _plan_one(
        self, due: DueSchedule, spec: TaskSpec, now: datetime, busy: bool, result: TickPlan
    ) -> bool:
        """Plan one due schedule that has a place, or whose run is in flight (``busy``):
        its claim into ``result``; True if that claim starts a run (it takes the place)."""
        slots: list[datetime] = []
        next_run_at = due.next_run_at
        if due.next_run_at <= now:
            try:
                step = plan(spec.schedule, due.next_run_at, now, spec.misfire)
            except Exception as exc:  # no next slot to be had (a date out of range)
                result.refused[due.name] = f"cannot compute its next slot: {describe(exc)}"
                return False
            next_run_at = step.next_run_at
            if step.missed:
                result.misfired.append((due.name, due.next_run_at, next_run_at))
            if step.run:
                slots.append(due.next_run_at)
        trigger = due.trigger_requested_at
        if busy:
            # Its slot overlaps the run in flight: skipped. A trigger waits for the run to
            # end (its end wakes the loop).
            skip = slots[0] if slots else None
            if next_run_at != due.next_run_at or skip is not None:
                claim = Claim(due.name, due.next_run_at, next_run_at, skip_slot=skip,
                              seen_definition=due.definition)  # fmt: skip
                result.claims.append(claim)
            result.waiting = result.waiting or trigger is not None
            return False
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
                seen_definition=due.definition,
                run_slot=run_slot,
                skip_slot=skip_slot,
            )
        )
        if run_slot is None:
            return False
        result.specs[due.name] = spec
        result.shards[due.name] = due.shard
        return True

    def _starts(self, plan_: TickPlan, claimed: Claimed, log: Logger) -> list[Start]:
        starts: list[Start] = []
        got = {(run.name, run.slot): run for run in claimed.runs}
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
            early = claim.next_run_at != claim.seen_next and claim.seen_next > claimed.window.now
            if run is None and early:
                # Planned on our estimate of the database's clock, which was ahead of it
                # (the statement's own now said so): not due yet there. At once, again.
                self._last_tick = 0.0
                continue
            if run is None:
                # Its next_run_at moved since the read (a change wins: looked at again next
                # tick), or the slot was taken: nothing runs.
                log.info("task.slot_taken", task=claim.name, slot=claim.run_slot.isoformat())
                self._passed[claim.name] = (claim.seen_next, claim.next_run_at)
                continue
            starts.append(
                Start(plan_.specs[claim.name], claim.run_slot, run.id, plan_.shards[claim.name])
            )
        return starts

    def _report(self, batch: DueBatch, now: datetime, plan_: TickPlan, log: Logger) -> None:
        oldest = batch.oldest_due(now)
        lag = 0.0 if oldest is None else max(0.0, (now - oldest).total_seconds())
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

    def _next_wake(self, batch: DueBatch) -> float | None:
        """Until the next slot to come, by the window the tick read last. What is due now
        and could be claimed: at once. What is due but waits (for a place, for a run of
        its own to end, for its last result to be written) is woken by that event, not
        by a sleep: the other schedules' slots still wake the loop on time."""
        if self._declare_due:
            return 0.0
        passed = self._passed  # as if claimed, unless changed: due again at their next slot
        kept = [d for d in batch.due if passed.get(d.name, (None,))[0] != d.next_run_at]
        ahead = self._plan(replace(batch, due=kept), set(), batch.now)
        self.runs.want(place=ahead.waiting or batch.full, results=ahead.held or batch.full)
        foreign = ahead.unknown and not self.sharded  # to be retired: declare at once
        if ahead.claims or ahead.refused or foreign or (batch.full and self._free() > 0):
            return 0.0
        upcoming = [due.due_at() for due in batch.due if due.due_at() > batch.now]
        upcoming += [following for _, following in passed.values()]
        if batch.next_slot is not None:
            upcoming.append(batch.next_slot)
        if not upcoming:
            return None
        # Counted from the statement that read it: the runner sleeps from now, so what
        # the tick took since is already spent. A hair past the slot: a sleep may end a
        # hair early, and the tick would find nothing due yet by its clock.
        until = (min(upcoming) - batch.now).total_seconds()
        return max(0.0, until - (time.monotonic() - batch.local)) + WAKE_PAST_SLOT

    def max_sleep(self) -> float:
        if self.listener is not None and self.listener.listening:
            return LISTENING_MAX_SLEEP
        return self.settings.plugin.interval

    def _on_tasks_changed(self, _payload: str) -> None:
        self.wake()

    async def leadership_started(self, lease: Lease) -> None:
        self._taken_over = False
        self._window = None
        self._caught_up = set()
        lease.wake_on_gain(self.wake)  # a shard taken is claimed for at once
        if self.listener is not None:
            await self.listener.subscribe(WAKE_CHANNEL, self._on_tasks_changed)

    async def leadership_ended(self, graceful: bool) -> None:
        """Graceful (daemon stopping, lease still valid): let the runs finish and record
        their results (the daemon cancels us past shutdown_timeout; losing the lease
        meanwhile cancels them at once). Either way the guard then stops whatever is left,
        before it lets the lock go."""
        self._taken_over = False
        self._window = None
        self._caught_up = set()
        self.metrics.plugin_lag.set(0)  # a standby reports no lag: only the leader knows
        if self.listener is not None:
            self.listener.unsubscribe(WAKE_CHANNEL)
        if graceful:
            await self.runs.batches_ended()

    def _label(self, name: str, spec: TaskSpec | None) -> str:
        """The ``task`` label of a run's metrics: a declared task's name, a runtime
        schedule's target (thousands of schedules must not make thousands of series)."""
        if name in self.tasks:
            return name
        if spec is not None and spec.target_path is not None:
            return spec.target_path
        return "runtime"
