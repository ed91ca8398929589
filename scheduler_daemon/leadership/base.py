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
from typing import Protocol, TypeVar

from ..db.base import Tx

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

        task = asyncio.create_task(call())
        lost = asyncio.create_task(self.lost.wait())
        try:
            await asyncio.wait({task, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost.cancel()
            if not task.done():
                task.cancel()
            await asyncio.wait({task, lost})
        if task.cancelled():
            raise LeadershipLost(self.reason or "lost")
        return task.result()


async def sleep_unless(event: asyncio.Event, seconds: float) -> bool:
    """Sleep up to ``seconds``; return True early if ``event`` is set."""
    try:
        async with asyncio.timeout(seconds):
            await event.wait()
    except TimeoutError:
        return False
    return True
