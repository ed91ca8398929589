"""The plugin loop's runs: from a committed claim to a written result.

loops/plugin.py's tick claims runs in a fenced transaction; once that committed, it hands
them here (``PluginRuns.start_batch``), one batch per lease that runs them (the tick's, or
sharded, each shard's). A batch runs as work of the leadership: inside a *hold* on the lock
(``lease.hold_after``), which in session mode and on SQLite is the lease itself and in
transaction mode a transaction that takes the lock over from the tick and keeps it until
the runs have ended. So no run executes without this replica holding the loop's lock, and
losing it stops every run (async targets are cancelled, sync targets run in worker
processes and are killed) before the lock can go to anyone.

Each run has its timeout, and its outcome (succeeded, failed, timed_out) is an ``Ended``.
Results are written in batches, by the batch that ran them: every
``RESULT_FLUSH_INTERVAL`` while runs remain, at once when ``RESULT_FLUSH_SIZE`` are
waiting, and when the last one ends; sharded, the shards' batches write together
(loops/results.py). A schedule whose last result is not written yet is not claimed again
until it is; a result that cannot be written leaves its run ``running``, an *orphan* the
next tick closes as abandoned.

``PluginRuns`` holds what the tick needs to know of the runs in flight: which schedules
are running (and of those, which in worker processes), which wait for their result to be
written, the orphans, and whether a run's end or a result written is worth a tick.
"""

from __future__ import annotations

import asyncio
import time
import traceback
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast

import structlog

from ..config.settings import Settings
from ..db.plugin_store import Clock, FinishedSchedule, PluginStore, RunResult
from ..errors import describe
from ..leadership import Lease, PendingHold
from ..logs import Logger
from ..metrics import Metrics
from ..plugins.context import TaskContext
from ..plugins.retention import trim_every
from ..plugins.tasks import TaskSpec
from ..plugins.worker_process import WorkerJob
from ..plugins.workers import WorkerFailed, Workers
from .results import SharedResults

# Results of one batch wait at most this long to be written, or for this many to gather.
RESULT_FLUSH_INTERVAL = 0.05
RESULT_FLUSH_SIZE = 500
# A result that cannot be written is tried this many times (the lease still valid: a
# database error, not a lost lock) before its run is left to be abandoned.
RESULT_ATTEMPTS = 3


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


class PluginRuns:
    """The plugin loop's runs in flight on this replica, and the writing of their results."""

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        workers: Workers | None,
        label: Callable[[str, TaskSpec | None], str],
        wake: Callable[[], None],
        sticky: bool,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.workers = workers  # runs sync targets; None when no target is sync
        self._label = label  # a run's metrics' ``task`` label (PluginWork._label)
        self.wake = wake  # the loop's: a tick now
        # A lease that lasts until lost: a batch's end is worth a tick only if something
        # waits for it. Otherwise (transaction mode) its hold kept the lock from the
        # ticks, which its end lets win it again.
        self.sticky = sticky
        # Executing runs by schedule name (a claimed run counts from its claim on).
        self.running: dict[str, asyncio.Task[Any]] = {}
        self.sync_running: set[str] = set()  # of those, sync targets (worker processes)
        # Schedules whose last run ended and whose result is not written yet: not claimed
        # again until it is (the database still has that run `running`).
        self.unrecorded: set[str] = set()
        # One task per tick that claimed runs, with their rows in scheduler_plugin_runs.
        self.batches: dict[asyncio.Task[None], list[int]] = {}
        # Runs whose results will never be written (dropped after failed attempts, or a
        # run that crashed), by id: closed as abandoned by the next tick, even while their
        # batch goes on; their schedules are not claimed again until that committed.
        self.orphans: dict[int, str] = {}
        # Wake-ups worth a tick: a place freed while something waited for one, results
        # written while something due waited for them (any other is a tick for nothing).
        # The tick sets them; a run's end or a result written clears one and wakes it.
        self.want_place = False
        self.want_results = False
        # Sharded: the shards' batches write their results together (loops/results.py).
        self._results = SharedResults[Ended](self._finish, lambda e: e.result.name)

    # -- what the tick reads and says (it changes nothing of this state but through these)

    def orphaned(self) -> dict[int, str]:
        """The orphans now (run id -> schedule), for a tick to close as abandoned."""
        return dict(self.orphans)

    def closed(self, orphans: Mapping[int, str]) -> None:
        """A tick's transaction closed these orphans: their schedules may run again."""
        for run_id, name in orphans.items():
            self.orphans.pop(run_id, None)
            self.unrecorded.discard(name)

    def in_flight(self) -> int:
        """Schedules running, or waiting for their last result to be written."""
        return len(self.running) + len(self.unrecorded)

    def free(self) -> tuple[int, int]:
        """Places left: of ``plugin.concurrency``, and of ``plugin.sync_concurrency``."""
        plugin = self.settings.plugin
        return plugin.concurrency - len(self.running), plugin.sync_concurrency - len(
            self.sync_running
        )

    def busy(self, name: str) -> bool:
        return name in self.running

    def waits_for_result(self, name: str, closing: Collection[str]) -> bool:
        """Its last run ended and its result is not written yet (not one of the orphans a
        tick is closing right now): claimed once it is."""
        return name in self.unrecorded and name not in closing and name not in self.running

    def want(self, place: bool, results: bool) -> None:
        """What the tick left waiting: a place (a run's end wakes it), results (a write
        wakes it). Said before the tick's awaits, so that an end meanwhile sees it."""
        self.want_place, self.want_results = place, results

    def ours(self, orphans: Collection[int]) -> list[int]:
        """The runs of this replica in flight that will write their results (not the
        ``orphans`` among them, which never will): what an abandon must leave alone."""
        return sorted(
            run_id for run_ids in self.batches.values() for run_id in run_ids
            if run_id not in orphans
        )  # fmt: skip

    async def batches_ended(self) -> None:
        """Wait until every batch has ended (results written, or given up)."""
        if self.batches:
            await asyncio.wait(list(self.batches))

    def start_batch(
        self, lease: Lease, hold: PendingHold, starts: list[Start], clock: Clock, log: Logger
    ) -> None:
        batch = lease.spawn(self._run_batch(hold, starts, clock, log), name="plugin:batch")
        self.batches[batch] = [start.run_id for start in starts]
        batch.add_done_callback(self.batches.pop)
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
            released = False
            for run, start in runs.items():
                unwritten = start.run_id not in written
                orphan = start.run_id in self.orphans  # unrecorded until abandoned
                if run.done() and not run.cancelled() and unwritten and not orphan:
                    self.unrecorded.discard(start.spec.name)
                    released = True
            waited = self.want_place or self.want_results or self.orphans or released
            if waited or not self.sticky:
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
                            self.orphans[start.run_id] = start.spec.name
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
                    if self.want_results:  # a schedule of theirs was due meanwhile
                        self.want_results = False
                        self.wake()
        finally:
            lost.cancel()

    def _drop(self, results: list[Ended], exc: Exception, log: Logger) -> None:
        # Lost leadership or database trouble: the runs stay `running` until a holder of
        # the lock marks them abandoned (this one's next tick, if it still leads). Never
        # retried as runs: a slot runs at most once.
        for ended in results:
            self.orphans[ended.result.id] = ended.result.name
            ended.log.warning(
                "task.result_not_recorded", status=ended.result.status, error=describe(exc)
            )

    async def _record(self, hold: Lease, ended: list[Ended], log: Logger) -> None:
        limit = self.settings.plugin.max_consecutive_failures
        group = hold.write_group()
        if group is not None:  # with the other shards' results, in one transaction
            finished = await self._results.write(hold, group, ended)
        else:  # one statement that fences itself (session mode: one round trip)
            async with hold.statements() as tx:
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
        """Results written, and schedules marked due a trim every so many runs: the
        built-in purge_runs trims them (plugins/retention.py), never the tick."""
        limit = self.settings.plugin.max_consecutive_failures
        every = trim_every(self.settings.plugin.history)
        return await store.finish([e.result for e in ended], limit, every)

    def _track(self, spec: TaskSpec, task: asyncio.Task[Any]) -> None:
        name = spec.name
        self.running[name] = task
        if spec.target is not None and not spec.is_async:
            self.sync_running.add(name)
        task.add_done_callback(lambda _: self._untrack(name, task))

    def _untrack(self, name: str, task: asyncio.Task[Any]) -> None:
        if self.running.get(name) is task:
            del self.running[name]
            self.sync_running.discard(name)
            if self.want_place:  # something due waits for a place
                self.want_place = False
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
        result = RunResult(start.run_id, spec.name, start.slot, status, error, clock.now())
        return Ended(result, duration, run_log, spec.timeout)

    async def _execute(self, spec: TaskSpec, ctx: TaskContext, hold: Lease, log: Logger) -> None:
        if spec.sql is not None:
            # The session's statement_timeout lifted to the task's own, a little past it,
            # so that our deadline fires first: timed_out.
            await hold.run_sql(spec.sql, statement_timeout=spec.timeout + 1.0)
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
