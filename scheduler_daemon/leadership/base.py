"""The leadership contract shared by every guard.

A loop's runner does::

    async with guard.leadership() as lease:        # returns once this replica leads
        while leading:
            await lease.run_tick(lambda: work.tick(...))   # cancelled if leadership is lost
            ...

and the tick does its database work in ``async with lease.transaction() as tx`` — a
transaction that can only commit while this replica still holds the lock (fencing).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Generic, Protocol, TypeVar

from ..aio import unless_set
from ..config import Settings
from ..db.base import Tx
from ..logs import Logger
from ..metrics import Metrics

T = TypeVar("T")


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
    @property
    def lost(self) -> asyncio.Event: ...

    @property
    def reason(self) -> str | None:
        """Why leadership was lost (None while it holds)."""
        ...

    def transaction(self) -> AbstractAsyncContextManager[Tx]: ...

    async def run_tick(self, tick: Callable[[], Awaitable[T]]) -> T: ...


class Guard(Protocol):
    loop: str

    def leadership(self) -> AbstractAsyncContextManager[Lease]:
        """Wait until this replica leads the loop (raise :class:`Stopping` if the daemon
        stops first), hold leadership for the ``async with`` body, then release it."""
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
    ) -> None:
        self.loop = loop
        self.key = key
        self.store = store
        self.settings = settings
        self.log = log.bind(loop=loop)
        self.metrics = metrics
        self.stop = stop


class LeaseState:
    """Loss signalling and tick cancellation, common to every lease."""

    def __init__(self) -> None:
        self.lost = asyncio.Event()
        self.reason: str | None = None

    def lose(self, reason: str) -> bool:
        """Mark leadership lost; the running tick is cancelled. True the first time."""
        if self.lost.is_set():
            return False
        self.reason = reason
        self.lost.set()
        return True

    async def run_tick(self, tick: Callable[[], Awaitable[T]]) -> T:
        """Run one tick as a child task that is cancelled the moment leadership is lost,
        so a deposed leader stops working instead of finishing a tick it no longer owns."""
        if self.lost.is_set():
            raise LeadershipLost(self.reason or "lost")

        async def call() -> T:
            return await tick()

        outcome = await unless_set(call(), self.lost)
        if outcome.cancelled():
            raise LeadershipLost(self.reason or "lost")
        return outcome.result()
