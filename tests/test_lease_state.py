"""What a lease answers when asked whether it is still fresh, and the locks its proofs
take only when they are free: pure asyncio, no database."""

from __future__ import annotations

import asyncio
import time

import pytest

from scheduler_daemon.config.settings import Settings
from scheduler_daemon.db.postgres import ask_between_statements
from scheduler_daemon.leadership.base import LeadershipLost
from scheduler_daemon.leadership.heartbeat import heartbeat
from scheduler_daemon.leadership.lease_state import LeaseState
from scheduler_daemon.logs import get_logger

SETTINGS = Settings(lock={"heartbeat_interval": 0.5, "stop_grace": 0.5, "stall_timeout": 3})


def lease_silent_for(seconds: float) -> LeaseState:
    lease = LeaseState(1, SETTINGS, get_logger())
    lease.last_proven = time.monotonic() - seconds
    return lease


async def test_a_stale_lease_ends_when_asked() -> None:
    lease = lease_silent_for(SETTINGS.lock.step_down_after + 1)
    assert not lease.proven_recently()
    assert lease.lost.is_set()
    assert lease.lock_may_be_free.is_set()
    assert lease.reason is not None
    assert "process stalled" in lease.reason


async def test_a_proof_answered_but_not_yet_taken_in_counts() -> None:
    """The heartbeat asked, the answer arrived, and our event loop was busy elsewhere
    until past the step-down bound: the proof counts as of when it was asked."""
    lease = lease_silent_for(SETTINGS.lock.step_down_after + 0.5)
    answered: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
    answered.set_result(True)
    lease.proof = (time.monotonic() - 0.3, answered)
    assert lease.proven_recently()
    assert not lease.lost.is_set()


async def test_an_unanswered_proof_is_left_to_the_heartbeat() -> None:
    """No answer yet: not fresh, but a network that went silent is the heartbeat's to
    judge (workers get their grace), not a freeze (killed at once)."""
    lease = lease_silent_for(SETTINGS.lock.step_down_after + 0.5)
    lease.proof = (time.monotonic() - 0.3, asyncio.get_running_loop().create_future())
    assert not lease.proven_recently()
    assert not lease.lost.is_set()


class Conn:
    def __init__(self) -> None:
        self.asked = 0

    async def fetchval(self, query: str, *args: object) -> bool:
        self.asked += 1
        return True


async def test_a_proof_never_queues_behind_work_promised_the_connection() -> None:
    """A lock released to a waiter that has not run yet reads unlocked, and acquiring it
    queues behind that waiter's whole piece of work: the proof must go elsewhere."""
    transaction_lock, statement_lock = asyncio.Lock(), asyncio.Lock()
    await transaction_lock.acquire()
    waiter = asyncio.ensure_future(transaction_lock.acquire())
    await asyncio.sleep(0)
    transaction_lock.release()  # handed to the waiter, which has not run yet
    await statement_lock.acquire()  # and the work holding it is mid-statement
    conn = Conn()
    async with asyncio.timeout(1):  # awaited in this task: nothing else runs first
        answer = await ask_between_statements(
            conn,  # type: ignore[arg-type]
            transaction_lock,
            statement_lock,
            lambda conn: conn.fetchval("lock_held"),
        )
    assert answer is None  # ask elsewhere (the pool)
    assert conn.asked == 0
    await waiter


# Quiet leases (session mode): with no work running, proofs at the quiet pace; work
# starts on a fresh proof, and is held to the step-down bound from then on.
QUIET = Settings(lock={"heartbeat_interval": 0.2, "stop_grace": 0.5, "stall_timeout": 3})


class Proofs:
    """A heartbeat's prove(): records when it was asked, answers `held`."""

    def __init__(self, order: list[str] | None = None) -> None:
        self.times: list[float] = []
        self.held = True
        self.order = order if order is not None else []

    async def __call__(self) -> bool:
        self.times.append(time.monotonic())
        self.order.append("proof")
        return self.held


async def beating(lease: LeaseState, proofs: Proofs) -> asyncio.Task[None]:
    task = asyncio.create_task(heartbeat(lease, proofs, quiet=True))
    await asyncio.sleep(0)  # it has set the lease's quiet pace
    return task


async def test_a_quiet_lease_proves_at_the_quiet_pace_and_is_not_judged_stale() -> None:
    lock = QUIET.lock
    assert lock.quiet_proof_interval == 1.0 > lock.step_down_after == 0.4
    lease, proofs = LeaseState(1, QUIET, get_logger()), Proofs()
    task = await beating(lease, proofs)
    await asyncio.sleep(2.5)
    assert not lease.lost.is_set(), lease.reason
    assert not lease.proven_recently()  # unproven for longer than the bound, yet not lost
    assert not lease.lost.is_set()
    task.cancel()
    # A working lease would have proven 12 times; a quiet one twice (at 1.0 s and 2.0 s).
    assert len(proofs.times) == 2, proofs.times


async def test_work_on_a_quiet_lease_starts_on_a_fresh_proof_then_works_at_the_working_pace() -> (
    None
):
    lease = LeaseState(1, QUIET, get_logger())
    order: list[str] = []
    proofs = Proofs(order)
    task = await beating(lease, proofs)
    await asyncio.sleep(0.5)  # quiet, and stale by the step-down bound
    assert order == []

    async def work() -> None:
        order.append("tick")
        await asyncio.sleep(1.0)

    await lease.run_tick(work)
    task.cancel()
    assert order[:2] == ["proof", "tick"], order
    # Working for 1 s: a proof every 0.2 s after the one it started on.
    assert 4 <= order.count("proof") <= 7, order
    assert not lease.lost.is_set(), lease.reason


async def test_a_quiet_lease_found_not_holding_runs_nothing() -> None:
    """Cut off or evicted while quiet (a freeze, say): the proof the next tick waits for
    says so, and the tick never starts."""
    lease = LeaseState(1, QUIET, get_logger())
    proofs = Proofs()
    task = await beating(lease, proofs)
    await asyncio.sleep(0.5)
    proofs.held = False
    ran = False

    async def work() -> None:
        nonlocal ran
        ran = True

    with pytest.raises(LeadershipLost):
        await lease.run_tick(work)
    assert not ran
    assert lease.lock_may_be_free.is_set()
    await asyncio.wait({task}, timeout=1)
    assert task.done()


async def test_work_waiting_for_a_proof_from_a_heartbeat_that_is_gone_ends_the_lease() -> None:
    lease = LeaseState(1, QUIET, get_logger())
    lease.quiet_interval = QUIET.lock.quiet_proof_interval  # as a heartbeat that then died
    lease.last_proven -= 1.0

    async def work() -> None:
        raise AssertionError("ran without a proof")

    async with asyncio.timeout(2):
        with pytest.raises(LeadershipLost, match="heartbeat not answering"):
            await lease.run_tick(work)
    assert (
        not lease.lock_may_be_free.is_set()
    )  # the lock may still be ours: the work gets its grace


async def test_work_started_on_a_quiet_stale_lease_outside_a_tick_is_proven_not_lost() -> None:
    """Every start goes through run_tick today; one that does not is not taken for a
    freeze: the heartbeat proves at once, and proven_recently() says no until it has."""
    lease = LeaseState(1, QUIET, get_logger())
    proofs = Proofs()
    task = await beating(lease, proofs)
    await asyncio.sleep(0.5)  # quiet, and stale by the step-down bound
    work = lease.spawn(asyncio.sleep(1.0), name="work")
    assert not lease.proven_recently()
    await asyncio.sleep(0.05)
    assert lease.proven_recently(), lease.reason
    await work
    task.cancel()
    assert not lease.lost.is_set(), lease.reason
    assert proofs.times[0] - (time.monotonic() - 1.05) < 0.05  # at once, not a period later
