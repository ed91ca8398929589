"""What a lease answers when asked whether it is still fresh, and the locks its proofs
take only when they are free: pure asyncio, no database."""

from __future__ import annotations

import asyncio
import time

from scheduler_daemon.config import Settings
from scheduler_daemon.db.postgres import ask_between_statements
from scheduler_daemon.leadership.base import LeaseState
from scheduler_daemon.logs import get_logger

SETTINGS = Settings(lock={"heartbeat_interval": 0.5, "stop_grace": 0.5, "stall_timeout": 3})


def lease_silent_for(seconds: float) -> LeaseState:
    lease = LeaseState(1, SETTINGS, get_logger())
    lease.last_proven = time.monotonic() - seconds
    return lease


async def test_a_stale_lease_ends_when_asked() -> None:
    lease = lease_silent_for(SETTINGS.lock.step_down_after + 1)
    assert not lease.fresh()
    assert lease.lost.is_set()
    assert lease.gone.is_set()
    assert lease.reason is not None
    assert "process stalled" in lease.reason


async def test_a_proof_answered_but_not_yet_taken_in_counts() -> None:
    """The heartbeat asked, the answer arrived, and our event loop was busy elsewhere
    until past the step-down bound: the proof counts as of when it was asked."""
    lease = lease_silent_for(SETTINGS.lock.step_down_after + 0.5)
    answered: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
    answered.set_result(True)
    lease.proof = (time.monotonic() - 0.3, answered)
    assert lease.fresh()
    assert not lease.lost.is_set()


async def test_an_unanswered_proof_is_left_to_the_heartbeat() -> None:
    """No answer yet: not fresh, but a network that went silent is the heartbeat's to
    judge (workers get their grace), not a freeze (killed at once)."""
    lease = lease_silent_for(SETTINGS.lock.step_down_after + 0.5)
    lease.proof = (time.monotonic() - 0.3, asyncio.get_running_loop().create_future())
    assert not lease.fresh()
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
    conn_lock, gate = asyncio.Lock(), asyncio.Lock()
    await conn_lock.acquire()
    waiter = asyncio.ensure_future(conn_lock.acquire())
    await asyncio.sleep(0)
    conn_lock.release()  # handed to the waiter, which has not run yet
    await gate.acquire()  # and the work holding it is mid-statement
    conn = Conn()
    async with asyncio.timeout(1):  # awaited in this task: nothing else runs first
        answer = await ask_between_statements(conn, conn_lock, gate, "lock_held")  # type: ignore[arg-type]
    assert answer is None  # ask elsewhere (the pool)
    assert conn.asked == 0
    await waiter
