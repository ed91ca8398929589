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
(:meth:`LeaseState.stop_work`, leadership/lease_state.py) and only then lets the lock go. Work that cannot be stopped
within ``lock.stop_grace`` ends the process instead: the kernel closes the lock's socket
(or file) only once every thread of the process is gone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection, Coroutine, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Generic, Protocol, TypeVar

from ..config.settings import Settings
from ..db.base import Tx
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

    async def run_sql(self, sql: str, statement_timeout: float) -> None:
        """One statement of user SQL (a ``sql`` task's) in a fenced transaction of its
        own, with its own timeout: as ``transaction()``, where a guard may send the fence
        with the statement (session mode: two round trips, not three)."""
        ...

    def statements(self) -> AbstractAsyncContextManager[Tx]:
        """Statements that each fence themselves, outside a transaction (session mode:
        leadership/session_lease.py): one round trip a write, for the loops' bookkeeping
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

    @property
    def shard(self) -> int | None:
        """The shard this lease leads (None: the whole loop)."""
        ...

    def write_group(self) -> WriteGroup | None:
        """The leases whose bookkeeping may share one transaction with this one's (a
        sharded member's shards: their results in one commit, loops/results.py), or
        None: this lease writes alone."""
        ...


class WriteGroup(Protocol):
    """Leases that write together (:meth:`Lease.write_group`)."""

    def spawn(
        self, work: Coroutine[Any, Any, T], name: str, *, service: bool = False
    ) -> asyncio.Task[T]:
        """Start work of the whole group (as :meth:`Lease.spawn`)."""
        ...

    def fenced_together(self, leases: Collection[Lease]) -> AbstractAsyncContextManager[Tx]:
        """One fenced transaction (``only_ours``) for those of ``leases`` that are still
        the group's; its Tx's shard scope says which of them it is fenced for."""
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
