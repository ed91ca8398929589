"""The shape every loop shares: sequential ticks, a stop signal, an early wake-up.

A tick never starts while the previous one of the same loop still runs (PostgreSQL
advisory locks are re-entrant within a session, so overlapping ticks of one process
would both "hold" the lock). The sleep between ticks ends early on stop or on ``wake()``.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass
from typing import Protocol

from ..logs import Logger


@dataclass(frozen=True, slots=True)
class Tick:
    loop: str
    number: int
    log: Logger


class LoopWork(Protocol):
    """One loop's business logic. ``tick`` returns how long to sleep before the next one
    (None: the configured interval)."""

    name: str

    async def tick(self, tick: Tick) -> float | None: ...


class LoopRunner:
    def __init__(self, work: LoopWork, interval: float, stop: asyncio.Event, log: Logger) -> None:
        self.work = work
        self.interval = interval
        self.stop = stop
        self.log = log.bind(loop=work.name)
        self._wake = asyncio.Event()
        self._numbers = itertools.count(1)
        self.started = asyncio.Event()

    def wake(self) -> None:
        """Start the next tick now (e.g. something became due sooner than planned)."""
        self._wake.set()

    async def run(self) -> None:
        self.log.info("loop.started", interval=self.interval)
        self.started.set()
        while not self.stop.is_set():
            number = next(self._numbers)
            tick = Tick(self.work.name, number, self.log.bind(tick=number))
            try:
                delay = await self.work.tick(tick)
            except Exception:
                # A failing tick is logged and retried on the next interval; it must not
                # end the loop (the daemon's monitor treats a dead loop as fatal).
                tick.log.exception("tick.failed")
                delay = None
            await self._sleep(self.interval if delay is None else min(delay, self.interval))
        self.log.info("loop.stopped")

    async def _sleep(self, seconds: float) -> None:
        self._wake.clear()
        waiters = [
            asyncio.ensure_future(self.stop.wait()),
            asyncio.ensure_future(self._wake.wait()),
        ]
        try:
            await asyncio.wait(
                waiters, timeout=max(seconds, 0), return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for waiter in waiters:
                waiter.cancel()
            await asyncio.gather(*waiters, return_exceptions=True)
