"""The shape every loop shares: lead, then run sequential ticks until told to stop.

A tick never starts while the previous one of the same loop still runs (PostgreSQL
advisory locks are re-entrant within a session, so overlapping ticks of one process would
both "hold" the lock). The sleep between ticks ends early on stop, on ``wake()``, or when
leadership is lost. Database trouble never ends the loop: the runner steps down, backs
off and competes again. Anything else that escapes the guard, the work's leadership hooks
(``leadership_started``, ``leadership_ended``) or a service of the leadership is a bug:
the loop ends, and with it the daemon (exit 70). A schema newer than this build knows
does end the competing: the runner hands over what it leads and waits for the stop,
leading nothing (schema_gate.py).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ..aio import wait_any
from ..db.connect import Backoff, is_database_error
from ..errors import SchedulerError, describe
from ..leadership import Guard, LeadershipLost, Lease, NotLeader, Stopping
from ..logs import Logger
from ..metrics import Metrics
from ..schema_gate import SchemaGate, SchemaNewer


@dataclass(frozen=True, slots=True)
class Tick:
    loop: str
    number: int
    log: Logger
    lease: Lease  # do database work in `async with tick.lease.transaction() as tx`


class ServiceCrashed(Exception):
    """Work the leadership runs for its whole length (the webhook deliverer) died."""


# The longest a leader sleeps when a notification will wake it for anything due sooner:
# a safety net for a notification lost without the connection noticing, and the tick
# that shows the loop alive (scheduler_ticks_total; the SchedulerLoopStalled alert).
LISTENING_MAX_SLEEP = 60.0


class LoopWork(Protocol):
    """One loop's business logic. ``tick`` returns how long to sleep before the next one
    (None: as long as :meth:`max_sleep` allows)."""

    name: str
    # Set by the runner: call it to start the next tick now (from any callback).
    wake: Callable[[], None]

    async def tick(self, tick: Tick) -> float | None: ...

    def max_sleep(self) -> float:
        """The longest sleep between ticks now: the loop's interval, or
        :data:`LISTENING_MAX_SLEEP` while a notification will wake it."""
        ...

    async def leadership_started(self, lease: Lease) -> None:
        """Called once this replica leads, before the lease's first tick: start the work
        that lasts the whole leadership (spawned on ``lease``), and note that the first
        tick takes over from the predecessor."""
        ...

    async def leadership_ended(self, graceful: bool) -> None:
        """Called before leadership is released (also when :meth:`leadership_started`
        failed). ``graceful``: the daemon is stopping and
        the lease is still valid; otherwise leadership was lost."""
        ...


class LoopRunner:
    def __init__(
        self,
        work: LoopWork,
        guard: Guard,
        interval: float,
        stop: asyncio.Event,
        log: Logger,
        metrics: Metrics,
        schema: SchemaGate,
    ) -> None:
        self.work = work
        self.guard = guard
        self.interval = interval
        self.stop = stop
        self.schema = schema
        self.log = log.bind(loop=work.name)
        self.metrics = metrics
        self.started = asyncio.Event()
        self._wake = asyncio.Event()
        work.wake = self.wake
        self._numbers = itertools.count(1)

    def wake(self) -> None:
        """Start the next tick now (e.g. something became due sooner than planned)."""
        self._wake.set()

    async def run(self) -> None:
        self.log.info("loop.started", interval=self.interval)
        self.started.set()
        backoff = Backoff(initial=0.2, maximum=5.0)
        while not self.stop.is_set():
            if self.schema.outdated:
                # Not an exit: a supervisor would start this build again, and again.
                await self.stop.wait()
                break
            try:
                async with self.guard.leadership() as lease:
                    backoff.reset()
                    cancelled = False
                    try:
                        await self.work.leadership_started(lease)
                        await self._lead(lease)
                    except asyncio.CancelledError:
                        cancelled = True  # shutdown_timeout ran out: no more waiting
                        raise
                    finally:
                        graceful = not cancelled and self.stop.is_set() and not lease.lost.is_set()
                        await self.work.leadership_ended(graceful)
                if lease.crashed is not None:  # logged where it died; a bug, as below
                    raise ServiceCrashed(lease.reason or "a service died") from lease.crashed
                if self.schema.outdated and not lease.lost.is_set():
                    # Handed over like a stop (released on its own connection), only
                    # sooner: the runs it started are stopped, not awaited. Their results
                    # could not be recorded on this schema anyway.
                    self.log.warning("leader.stepped_down", reason=self.schema.describe())
                    continue
                if not lease.lost.is_set():
                    continue  # a stop: the loop condition ends it
                # Lost between ticks (heartbeat, eviction): the same pause as mid-tick.
                self.log.warning("leader.stepped_down", reason=lease.reason)
            except SchemaNewer:
                continue  # granted a lock on the newer schema and let it go at once
            except Stopping:
                break
            except LeadershipLost as lost:
                self.log.warning("leader.stepped_down", reason=lost.reason)
            except Exception as exc:
                if isinstance(exc, ServiceCrashed) or not is_database_error(exc):
                    # Retrying would only hide it: the loop dies, and the daemon exits
                    # (its locks go with the process) for the supervisor to start afresh.
                    # A bug (exit 70) gets its traceback; an explained refusal (a SQLite
                    # file renamed under us: ConfigError, exit 78) its one line.
                    explained = isinstance(exc, SchedulerError)
                    self.log.error("loop.crashed", error=describe(exc), exc_info=not explained)
                    raise
                # The database is unreachable, restarting, refusing: compete again later.
                self.log.warning("loop.db_error", error=describe(exc))
            # Back to standby after a pause, so a flapping database is not hammered. Only a
            # stop cuts it short: a wake-up (a plugin run that ended with the lease) is for a
            # leader's next tick, and would turn the pause into a busy loop of errors.
            await wait_any([self.stop], backoff.next_delay())
        self.log.info("loop.stopped")

    async def _lead(self, lease: Lease) -> None:
        while not self.stop.is_set() and not lease.lost.is_set() and not self.schema.outdated:
            # Cleared before the tick, not before the sleep: a wake-up that arrives while
            # the tick runs (a row scheduled after it read its snapshot) is kept.
            self._wake.clear()
            number = next(self._numbers)
            tick = Tick(self.work.name, number, self.log.bind(tick=number), lease)
            started = time.monotonic()
            result = "ok"
            delay: float | None = None
            try:
                delay = await lease.run_tick(functools.partial(self.work.tick, tick))
            except NotLeader:
                result = "skipped"
            except SchemaNewer:
                # Its fence saw the newer schema: nothing was done, and nothing more is.
                self.metrics.ticks.labels(self.work.name, "skipped").inc()
                return
            except LeadershipLost:
                self.metrics.ticks.labels(self.work.name, "cancelled").inc()
                raise
            except Exception as exc:
                if lease.lost.is_set():  # the error is the loss showing through
                    self.metrics.ticks.labels(self.work.name, "cancelled").inc()
                    raise LeadershipLost(str(exc)) from exc
                # A failing tick is logged and retried next interval; the loop goes on.
                tick.log.exception("tick.failed")
                result = "failed"
            elapsed = time.monotonic() - started
            self.metrics.ticks.labels(self.work.name, result).inc()
            self.metrics.tick_duration.labels(self.work.name).observe(elapsed)
            tick.log.debug("tick.done", result=result, duration=round(elapsed, 4), next_in=delay)
            # A tick that failed is retried after the interval, listening or not: what
            # failed will not send a notification when it would succeed.
            longest = self.work.max_sleep() if result == "ok" else self.interval
            await self._sleep(longest if delay is None else min(delay, longest), lease)

    async def _sleep(self, seconds: float, lease: Lease) -> None:
        await wait_any([self.stop, self._wake, lease.lost, self.schema.newer], seconds)
