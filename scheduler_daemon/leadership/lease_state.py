"""What every lease has in common (``LeaseState``): loss signalling, the work a leadership
started, and stopping it before the lock goes; the hold of a sticky lease; and the last
resort when work cannot be stopped (``exit_now``). The contract it implements is
leadership/base.py's ``Lease``."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Any, NoReturn, TypeVar

from ..aio import wait_any
from ..config.settings import Settings
from ..db.base import Tx
from ..errors import EXIT_SOFTWARE, describe
from ..logs import Logger
from .base import KILL_WAIT, ClaimScope, LeadershipLost, Lease, PendingHold, WriteGroup

T = TypeVar("T")


class _AlreadyHeld:
    """The hold of a sticky lease: the lock is held anyway, so there is nothing to take."""

    def __init__(self, lease: Lease) -> None:
        self.lease = lease

    async def __aenter__(self) -> Lease:
        if self.lease.lost.is_set():
            raise LeadershipLost(self.lease.reason or "lost")
        return self.lease

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None

    async def discard(self) -> None:
        return None


def exit_now(log: Logger, reason: str, **fields: Any) -> NoReturn:
    """End the process at once: the last resort when work cannot be stopped otherwise.

    ``os._exit`` rather than an exception: nothing may run after this (no finally block
    that releases the lock, no interpreter shutdown while a thread still works). The kernel
    kills every thread, then closes the lock's socket or file; worker processes follow
    through their lifeline. The supervisor restarts us (exit 70).
    """
    log.error("leader.work_unstoppable", reason=reason, **fields)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_SOFTWARE)


class LeaseState:
    """Loss signalling, the work a leadership started, and stopping it: common to every
    lease."""

    shard: int | None = None  # a loop's lease leads all of it

    def __init__(
        self,
        fencing_token: int,
        settings: Settings,
        log: Logger,
        on_lost: Callable[[str, bool], None] | None = None,
    ) -> None:
        self.lost = asyncio.Event()
        self.lock_may_be_free = asyncio.Event()
        self.reason: str | None = None
        self.fencing_token = fencing_token
        self.settings = settings
        self.log = log
        self.last_proven = time.monotonic()
        self._on_lost = on_lost  # the guard's report (log line, metric), once
        self._work: set[asyncio.Task[Any]] = set()
        self.crashed: BaseException | None = None
        # The heartbeat's proof in flight, and when it was asked.
        self.proof: tuple[float, asyncio.Future[bool]] | None = None
        # Set by a heartbeat that spares a lease with no work in flight (``quiet``): how
        # often it proves then. None: every heartbeat_interval, work or none.
        self.quiet_interval: float | None = None
        # The heartbeat's wake-up: work started, or work wants a proof before it starts.
        self.replan = asyncio.Event()
        self.proof_wanted = False
        # Set (and replaced) after every proof the heartbeat took in.
        self.proved = asyncio.Event()

    def lose(self, reason: str, *, lock_may_be_free: bool) -> bool:
        """Mark leadership lost and cancel its work. ``lock_may_be_free``: the lock may be free already
        (it can be set by a later call, which then hurries the stopping along). True the
        first time."""
        if lock_may_be_free:
            self.lock_may_be_free.set()
        if self.lost.is_set():
            return False
        self.reason = reason
        self.lost.set()
        for task in self._work:
            task.cancel()
        if self._on_lost is not None:
            self._on_lost(reason, lock_may_be_free)
        return True

    def proven_recently(self) -> bool:
        if self.lost.is_set():
            return False
        bound = self.settings.lock.step_down_after
        now = time.monotonic()
        if now - self.last_proven <= bound:
            return True
        if self.proof is not None:
            sent, proof = self.proof
            if not proof.done():
                # Asked and not answered yet: not fresh, but whether the network or the
                # process failed is the heartbeat's to say, when its wait for it ends.
                return False
            if not proof.cancelled() and proof.exception() is None and proof.result():
                # Answered while our event loop was busy elsewhere, not yet taken in by
                # the heartbeat: it counts as of when it was asked, as there.
                self.last_proven = max(self.last_proven, sent)
                if now - self.last_proven <= bound:
                    return True
        if self.quiet_interval is not None and (not self.working or self.proof_wanted):
            # Quiet (or work just started on a quiet lease, its proof asked for): nothing
            # of the lease ran unproven, so there is no freeze to conclude from.
            return False
        # The heartbeat would conclude the same when its own timer runs; whoever asks
        # first concludes it, so that nothing else of the lease runs on meanwhile.
        self.lose(stalled(now - self.last_proven), lock_may_be_free=True)
        return False

    @property
    def working(self) -> bool:
        """Whether any work of the lease (a tick, a run, a service) is still running."""
        return any(not task.done() for task in self._work)

    async def proven_for_work(self) -> None:
        """Return once the lock was proven within ``heartbeat_interval`` (or the lease is
        lost): what work of a quiet lease starts on.

        A quiet lease (see :func:`heartbeat`) goes unproven for longer than the step-down
        bound, harmlessly while nothing of it runs. From its first work on it is judged by
        that bound again, so the work must start on a recent proof: asked of the
        heartbeat here, and waited for. (A leader resumed after a freeze, or cut off while
        quiet, learns it here, before its work does anything.)"""
        if self.quiet_interval is None or self.working:
            return
        asked = time.monotonic()
        if asked - self.last_proven <= self.settings.lock.heartbeat_interval:
            return
        while self.last_proven < asked and not self.lost.is_set():
            self.proof_wanted = True
            self.replan.set()
            if not await wait_any([self.proved, self.lost], self.settings.lock.step_down_after):
                # A proof is given less than that to answer: the heartbeat is gone.
                self.lose("heartbeat not answering", lock_may_be_free=False)

    def spawn(
        self, work: Coroutine[Any, Any, T], name: str, *, service: bool = False
    ) -> asyncio.Task[T]:
        if self.lost.is_set():
            work.close()
            raise LeadershipLost(self.reason or "lost")
        task = asyncio.create_task(work, name=name)
        self.adopt(task)
        if service:
            task.add_done_callback(self._service_ended)
        return task

    def _service_ended(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled():
            return  # stopped: only the leadership's end (or the loop's) cancels a service
        error = task.exception()
        if self.lost.is_set() and (error is None or isinstance(error, LeadershipLost)):
            return  # stopped with the leadership, as it should be
        if error is None:
            error = RuntimeError(f"{task.get_name()} ended while the leadership went on")
        self.crashed = error
        self.log.error(
            "leader.service_died", task=task.get_name(), error=describe(error), exc_info=error
        )
        self.lose(f"{task.get_name()} died: {describe(error)}", lock_may_be_free=False)

    def adopt(self, task: asyncio.Task[Any]) -> None:
        """Count ``task`` as work of this lease (cancelled with it, waited for by it)."""
        if self.quiet_interval is not None and not self.working:
            # The heartbeat's pace is a working lease's from now on. Work normally starts
            # on a fresh proof (run_tick); if not, it gets one now, and meanwhile proven_recently()
            # says no without concluding a freeze from the quiet time.
            if time.monotonic() - self.last_proven > self.settings.lock.heartbeat_interval:
                self.proof_wanted = True
            self.replan.set()
        self._work.add(task)
        task.add_done_callback(self._work.discard)

    async def run_tick(self, tick: Callable[[], Awaitable[T]]) -> T:
        """Run one tick as work of this lease: it is cancelled the moment leadership is
        lost, and this returns at once then (``stop_work`` waits for it to end)."""

        async def call() -> T:
            return await tick()

        await self.proven_for_work()
        task = self.spawn(call(), name="tick")
        lost = asyncio.ensure_future(self.lost.wait())
        try:
            await asyncio.wait({task, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost.cancel()
            if not task.done():
                task.cancel()  # lost, or our caller was cancelled
                # stop_work waits for it; what it ends with (a rollback failing on the
                # closed connection, say) is the loss showing, already reported.
                task.add_done_callback(discard_outcome)
        if not task.done() or (self.lost.is_set() and task.cancelled()):
            raise LeadershipLost(self.reason or "lost")
        return task.result()

    def transaction(self, *, only_ours: bool = False) -> AbstractAsyncContextManager[Tx]:
        raise NotImplementedError  # each guard's lease fences its own way

    def statements(self) -> AbstractAsyncContextManager[Tx]:
        return self.transaction(only_ours=True)

    async def run_sql(self, sql: str, statement_timeout: float) -> None:
        async with self.transaction() as tx:
            await tx.execute(sql, statement_timeout=statement_timeout)

    def hold(self) -> AbstractAsyncContextManager[Lease]:
        return _AlreadyHeld(self)

    async def hold_after(self, tx: Tx) -> PendingHold:
        return _AlreadyHeld(self)

    def claim_scope(self, *, self_fenced: bool) -> ClaimScope:
        fence = self.statements() if self_fenced else self.transaction(only_ours=True)
        return ClaimScope(fence, self_fenced, {None: self})

    def wake_on_gain(self, wake: Callable[[], None]) -> None:
        pass  # it leads the whole loop from the start

    def write_group(self) -> WriteGroup | None:
        return None

    async def stop_work(
        self, unblock: Callable[[], None] | None = None, grace: float | None = None
    ) -> None:
        """Cancel the work still running and wait until all of it has ended.

        Worker processes are SIGTERMed and SIGKILLed within ``stop_grace`` (at once when
        the lock may be gone); async work gets the same time to unwind. Work still running
        then may be stuck in the database driver rather than in user code: asyncpg waits
        for a cancelled query's cancellation to land, which on a dead socket it never
        does. ``unblock`` (drop the lock's connection) frees those. Whatever still runs
        after that ignores cancellation and cannot be stopped from here: the process
        exits rather than go on while the lock is, or soon will be, someone else's.
        (Dropping the connection can free the lock before that exit; a new leader waits
        ``stop_grace`` + ``KILL_WAIT`` for a predecessor that is still alive.) ``grace``
        replaces ``stop_grace`` for a lease whose work bounds its own stopping (holds).
        """
        pending = {task for task in self._work if not task.done()}
        if not pending:
            return
        for task in pending:
            task.cancel()
        started = time.monotonic()
        grace = self.settings.lock.stop_grace if grace is None else grace
        _, still_running = await asyncio.wait(pending, timeout=grace)
        if still_running:  # workers are being SIGKILLed about now; DB waits unblocked
            if unblock is not None:
                unblock()
            _, still_running = await asyncio.wait(still_running, timeout=KILL_WAIT)
        if still_running:
            exit_now(
                self.log,
                f"work still running {_since(started):g}s after it was cancelled; exiting "
                "so that it cannot run on beside the next leader",
                tasks=sorted(task.get_name() for task in still_running),
            )
        self.log.debug("leader.work_stopped", tasks=len(pending), seconds=_since(started))


def discard_outcome(task: asyncio.Future[Any]) -> None:
    """Retrieve an abandoned proof's outcome, so asyncio does not report it."""
    if not task.cancelled():
        task.exception()


def stalled(silent_for: float) -> str:
    return f"heartbeat {silent_for:.1f}s late (process stalled)"


def _since(started: float) -> float:
    return round(time.monotonic() - started, 4)
