"""The leadership contract shared by every guard.

A loop's runner does::

    async with guard.leadership() as lease:        # returns once this replica leads
        while leading:
            await lease.run_tick(lambda: work.tick(...))   # cancelled if leadership is lost
            ...

The tick does its database work in ``async with lease.transaction() as tx`` — a
transaction that can only commit while this replica still holds the lock (fencing) — and
starts work that outlives it (a plugin run, the webhook deliverer) with ``lease.spawn``.

The rule every guard keeps: **the lock is never released while work of the leadership may
still run.** Everything the leadership started is registered with its lease; when
leadership ends, for whatever reason, the guard stops that work first
(:meth:`LeaseState.stop_work`) and only then lets the lock go. Work that cannot be stopped
within ``lock.stop_grace`` ends the process instead: the kernel closes the lock's socket
(or file) only once every thread of the process is gone.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Generic, NoReturn, Protocol, TypeVar

from ..aio import wait_any
from ..config.settings import Settings
from ..db.base import Tx
from ..errors import EXIT_SOFTWARE, describe
from ..logs import Logger
from ..metrics import Metrics
from ..schema_gate import SchemaGate

T = TypeVar("T")

# A SIGKILLed worker is dead and reaped within milliseconds; this covers a loaded machine.
KILL_WAIT = 0.25


def settle_time(settings: Settings) -> float:
    """How long a new holder of the lock waits, before doing any work, for a predecessor
    that may be alive and learning only now that it lost the lock: the longest it takes to
    stop its work or exit (``stop_work``: stop_grace, then KILL_WAIT), plus as much again
    as KILL_WAIT for noticing and scheduling on both sides."""
    return settings.lock.stop_grace + 2 * KILL_WAIT


class LeadershipLost(Exception):
    """This replica stopped leading (heartbeat failed, evicted, connection lost)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class NotLeader(Exception):
    """Transaction mode: another replica holds this tick's lock; skip the tick."""


class Stopping(Exception):
    """The daemon is stopping while this guard waited for leadership."""


class Lease(Protocol):
    """Proof of leadership, and the owner of everything done under it."""

    @property
    def lost(self) -> asyncio.Event:
        """Set when leadership ends unasked (heartbeat, eviction, connection lost)."""
        ...

    @property
    def lock_may_be_free(self) -> asyncio.Event:
        """Set when the lock may already be free — another replica may be running — so
        work is stopped at once (worker processes SIGKILLed), without any grace."""
        ...

    @property
    def reason(self) -> str | None:
        """Why leadership was lost (None while it holds)."""
        ...

    @property
    def fencing_token(self) -> int:
        """The loop's fencing token for this leadership (grows with every change of leader)."""
        ...

    def proven_recently(self) -> bool:
        """Whether the lock was proven held recently enough that this process cannot have
        been evicted meanwhile (False after a freeze longer than the step-down bound).

        Ask it right before doing anything outside the database: after a freeze, timers
        run in deadline order, so work whose sleep ended first runs before the heartbeat
        that would notice the freeze. A stale answer ends the lease there and then."""
        ...

    def transaction(self, *, only_ours: bool = False) -> AbstractAsyncContextManager[Tx]:
        """A fenced transaction. ``only_ours``: nothing but the daemon's own statements run
        in it (a loop's bookkeeping, never a task's or a publisher's SQL), so nothing in it
        can release the lock: a guard may spare the round trips that protect the lock from
        such SQL (session mode's savepoint and restore)."""
        ...

    def statements(self) -> AbstractAsyncContextManager[Tx]:
        """Statements that each fence themselves, outside a transaction (session mode:
        leadership/token_fence.py): one round trip a write, for the loops' bookkeeping
        that is one statement (a tick's read and claim, a result batch). Only named queries
        written to fence themselves may write there. Where a guard has no such fence
        (transaction mode, SQLite, a sharded member), a fenced transaction (``only_ours``)."""
        ...

    async def run_tick(self, tick: Callable[[], Awaitable[T]]) -> T: ...

    @property
    def crashed(self) -> BaseException | None:
        """What killed a service of this leadership (see :meth:`spawn`), if one died."""
        ...

    def spawn(
        self, work: Coroutine[Any, Any, T], name: str, *, service: bool = False
    ) -> asyncio.Task[T]:
        """Start work that belongs to this leadership: cancelled the moment it is lost,
        and waited for (or killed) before the lock is released. ``service``: it runs as
        long as the leadership and nobody awaits it (the webhook deliverer): its ending
        any other way is a bug, which ends the leadership and is reported as
        :attr:`crashed`."""
        ...

    def hold(self) -> AbstractAsyncContextManager[Lease]:
        """Keep the lock for the body's duration, for work done outside the database (a
        webhook POST). Session mode and SQLite hold it anyway; transaction mode competes
        for it (:class:`NotLeader` if another replica has it)."""
        ...

    async def hold_after(self, tx: Tx) -> PendingHold:
        """A hold that takes the lock over from ``tx`` (a transaction of this lease, which
        holds it) the moment ``tx`` ends, so that nobody can take it in between. Call
        inside ``tx``; enter the hold after ``tx`` committed, or ``discard()`` it if
        ``tx`` failed."""
        ...

    def claim_scope(self, *, self_fenced: bool) -> ClaimScope:
        """What one tick of this lease claims for, and the fence of that tick's
        bookkeeping: statements that fence themselves if ``self_fenced`` and the guard has
        them, else one fenced transaction (``only_ours``). A loop's lease claims for the
        whole loop; a sharded member for the shards it holds now, one transaction for
        all of them, each claimed run under its shard's lease."""
        ...

    def wake_on_gain(self, wake: Callable[[], None]) -> None:
        """Have ``wake`` called when this lease comes to lead more than it did (a member
        takes a shard), so that the loop claims for it at once, not at its next planned
        tick. A loop's lease leads all of the loop from the start: it never calls it."""
        ...


@dataclass(frozen=True, slots=True)
class ClaimScope:
    """What one tick claims for (:meth:`Lease.claim_scope`)."""

    fence: AbstractAsyncContextManager[Tx]
    self_fenced: bool  # statements that fence themselves, not one transaction
    # The lease each claimed run starts under, by the shard of its schedule (None: the
    # loop is not sharded). Empty: a member that holds no shard yet.
    leases: Mapping[int | None, Lease]


class PendingHold(Protocol):
    """A hold prepared inside a transaction, to be entered once that transaction ended."""

    async def __aenter__(self) -> Lease: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...

    async def discard(self) -> None:
        """Give the hold up unentered: what it was to run was rolled back."""
        ...


class Guard(Protocol):
    loop: str

    def leadership(self) -> AbstractAsyncContextManager[Lease]:
        """Wait until this replica leads the loop (raise :class:`Stopping` if the daemon
        stops first), hold leadership for the ``async with`` body, then release it — after
        every piece of work of the leadership has stopped."""
        ...


StoreT = TypeVar("StoreT")


class GuardBase(Generic[StoreT]):
    """What every guard is given (see ``make_guard``), held the same way by each."""

    def __init__(
        self,
        loop: str,
        key: int,
        store: StoreT,
        settings: Settings,
        log: Logger,
        metrics: Metrics,
        stop: asyncio.Event,
        schema: SchemaGate,
    ) -> None:
        self.loop = loop
        self.key = key
        self.store = store
        self.settings = settings
        self.log = log.bind(loop=loop)
        self.metrics = metrics
        self.stop = stop
        # Every fenced transaction and every lock granted checks the schema version
        # against this build's migrations; set, it also ends a standby's wait.
        self.schema = schema


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

    def hold(self) -> AbstractAsyncContextManager[Lease]:
        return _AlreadyHeld(self)

    async def hold_after(self, tx: Tx) -> PendingHold:
        return _AlreadyHeld(self)

    def claim_scope(self, *, self_fenced: bool) -> ClaimScope:
        fence = self.statements() if self_fenced else self.transaction(only_ours=True)
        return ClaimScope(fence, self_fenced, {None: self})

    def wake_on_gain(self, wake: Callable[[], None]) -> None:
        pass  # it leads the whole loop from the start

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
