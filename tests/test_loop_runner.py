"""The loop runner's rule for what escapes a leadership: database trouble is retried after
a back-off, a bug ends the loop (and with it the daemon, exit 70), and a service of the
leadership (the webhook deliverer, the SQLite commit watcher) that dies ends the
leadership at once and counts as a bug, instead of being noticed when leadership ends."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import pytest

from scheduler_daemon.config.settings import Settings
from scheduler_daemon.errors import EXIT_CONFIG, ConfigError, DatabaseUnavailable
from scheduler_daemon.leadership.base import Stopping
from scheduler_daemon.leadership.lease_state import LeaseState
from scheduler_daemon.logs import get_logger
from scheduler_daemon.loops.base import LoopRunner, ServiceCrashed, Tick
from scheduler_daemon.metrics import Metrics
from scheduler_daemon.schema_gate import SchemaGate


class Lease(LeaseState):
    async def run_tick(self, tick: Callable[[], Any]) -> Any:
        return await super().run_tick(tick)


class Guard:
    """Raises each of ``failures`` from successive leaderships, then leads with a
    :class:`Lease` until the runner stops."""

    loop = "publish"

    def __init__(self, stop: asyncio.Event, *failures: BaseException) -> None:
        self.failures = list(failures)
        self.attempts = 0
        self.stop = stop

    @asynccontextmanager
    async def leadership(self) -> AsyncIterator[Lease]:
        self.attempts += 1
        if self.failures:
            raise self.failures.pop(0)
        if self.stop.is_set():
            raise Stopping
        lease = Lease(1, Settings(), get_logger())
        try:
            yield lease
        finally:
            await lease.stop_work()


class Work:
    name = "publish"

    def __init__(self, on_tick: Callable[[Tick], None] = lambda tick: None) -> None:
        self.wake: Callable[[], None] = lambda: None
        self.on_tick = on_tick
        self.started: list[Lease] = []
        self.ended: list[bool] = []

    async def tick(self, tick: Tick) -> float | None:
        self.on_tick(tick)
        return 0.05

    def max_sleep(self) -> float:
        return 0.05

    async def leadership_started(self, lease: Lease) -> None:
        self.started.append(lease)

    async def leadership_ended(self, graceful: bool) -> None:
        self.ended.append(graceful)


def runner(work: Work, guard: Guard, stop: asyncio.Event) -> LoopRunner:
    schema = SchemaGate("sqlite")
    return LoopRunner(work, guard, 0.05, stop, get_logger(), Metrics(), schema)  # type: ignore[arg-type]


async def test_database_errors_are_retried_and_a_bug_ends_the_loop() -> None:
    stop = asyncio.Event()
    refused = asyncpg.CannotConnectNowError("the database system is starting up")
    guard = Guard(stop, refused, OSError("connection refused"), KeyError("a bug of ours"))
    with pytest.raises(KeyError, match="a bug of ours"):
        await asyncio.wait_for(runner(Work(), guard, stop).run(), 10)
    assert guard.attempts == 3, "the bug was retried like database trouble"


async def test_a_service_that_dies_ends_the_leadership_and_the_loop() -> None:
    stop = asyncio.Event()
    guard = Guard(stop)
    started: list[Tick] = []

    async def deliver() -> None:
        await asyncio.sleep(0.1)
        raise ZeroDivisionError("the deliverer's bug")

    def on_tick(tick: Tick) -> None:
        if not started:
            started.append(tick)
            tick.lease.spawn(deliver(), name="publish:webhooks", service=True)

    work = Work(on_tick)
    with pytest.raises(ServiceCrashed) as crashed:
        await asyncio.wait_for(runner(work, guard, stop).run(), 10)
    assert isinstance(crashed.value.__cause__, ZeroDivisionError)
    lease = started[0].lease
    assert lease.lost.is_set()
    assert lease.reason == "publish:webhooks died: ZeroDivisionError: the deliverer's bug"
    assert work.ended == [False], "leadership ended unasked, once"
    assert guard.attempts == 1


async def test_a_service_stopped_with_its_leadership_is_no_crash() -> None:
    lease = Lease(1, Settings(), get_logger())
    lease.spawn(asyncio.Event().wait(), name="publish:watch", service=True)
    await asyncio.sleep(0)
    lease.lose("lock connection closed", lock_may_be_free=True)
    await lease.stop_work()
    assert lease.crashed is None


async def test_an_explained_refusal_ends_the_loop_with_its_own_exit_code() -> None:
    """A guard that refuses to lead for a reason it explains (a SQLite file renamed under
    the leader): the loop ends at once, and the daemon exits with that error's code (78),
    not 70; a database that cannot be reached is retried instead, as any database error."""
    stop = asyncio.Event()
    refused = ConfigError("database_url names another file than the one this process locked")
    unavailable = DatabaseUnavailable("database unreachable")
    guard = Guard(stop, unavailable, refused)
    with pytest.raises(ConfigError) as error:
        await asyncio.wait_for(runner(Work(), guard, stop).run(), 10)
    assert error.value.exit_code == EXIT_CONFIG
    assert guard.attempts == 2


async def test_a_graceful_stop_cancels_services_without_calling_it_a_crash() -> None:
    """The stop cancels the webhook deliverer with the leadership: no crash, no loss, a
    graceful hand-over (a crash reported here made every rolling restart exit 70 and drop
    the lock connection instead of unlocking)."""
    stop = asyncio.Event()
    guard = Guard(stop)
    leases: list[LeaseState] = []

    def on_tick(tick: Tick) -> None:
        if not leases:
            leases.append(tick.lease)  # type: ignore[arg-type]
            tick.lease.spawn(asyncio.Event().wait(), name="publish:webhooks", service=True)
            asyncio.get_running_loop().call_later(0.2, stop.set)

    work = Work(on_tick)
    await asyncio.wait_for(runner(work, guard, stop).run(), 10)
    assert work.started == [leases[0]], "the hook told of the leadership, once"
    assert work.ended == [True]
    assert leases[0].crashed is None
    assert not leases[0].lost.is_set()
