"""The heartbeat of a PostgreSQL lease: prove the lock at its pace, from the lease's last
proof on (the work's own fenced transactions prove it too), and lose the lease when a
proof fails, does not answer in time, or comes late because the process was frozen.

Each PostgreSQL guard gives it its own proof (session mode: the lock session's entry in the lock
manager; transaction mode: a hold's; sharded: the member lock and its shards). The lease
state it reads and writes (``last_proven``, ``proof``, ``quiet_interval``, ``replan``,
``proof_wanted``, ``proved``) is ``LeaseState``'s (leadership/lease_state.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from ..aio import wait_any
from ..errors import describe
from .lease_state import LeaseState, discard_outcome


async def heartbeat(
    lease: LeaseState,
    prove: Callable[[], Awaitable[bool]],
    on_failure: Callable[[], None] = lambda: None,
    *,
    quiet: bool = False,
) -> None:
    """Prove the lock ``heartbeat_interval`` after it was last proven (by a heartbeat or
    by the lease's work) until a proof fails; then lose the lease and return.

    ``prove()`` answers whether the database still sees us holding the lock. A proof that
    does not answer within one interval counts as failed: that is how a silently cut
    network shows (the lock may still be ours, so ``lock_may_be_free`` is False and the work gets its
    grace). A heartbeat that itself comes late means the process was frozen, long enough
    for a standby to have evicted us (``lock_may_be_free``).

    ``quiet``: while no work of the lease runs, prove only every
    ``lock.quiet_proof_interval``. The step-down bound is there to stop a cut-off
    leader's work before the server can free its lock; with no work there is nothing to
    stop, and the proofs only keep the session from looking frozen to the server
    (``stall_timeout``). Work starts on a fresh proof (:meth:`LeaseState.proven_for_work`),
    and from then on the working pace and bound apply. This is most of an idle cluster's
    cost to the database (bench/idle.py).
    """
    interval = lease.settings.lock.heartbeat_interval
    bound = lease.settings.lock.step_down_after
    if quiet:
        lease.quiet_interval = lease.settings.lock.quiet_proof_interval
    while True:
        lease.replan.clear()  # before looking: a wake-up from here on is kept
        judged, due = _next_proof(lease, interval)
        wait = due - time.monotonic()
        if wait > 0:
            await wait_any([lease.replan], wait)  # set only for a quiet lease
            continue
        if judged and not lease.proven_recently():  # a freeze: proven_recently() ended the lease
            return
        # Not `asyncio.timeout` around the queries: on a silently dead socket asyncpg's
        # pool cannot finish cancelling a query (releasing the connection waits for the
        # server's answer), so a cancelled heartbeat would hang with it. Wait for the
        # proof in a task of its own and abandon it when it is late.
        # Given until step_down_after from the last proof, not a whole interval: a
        # heartbeat that woke late must still decide in time. A quiet lease's proof gets
        # what a punctual heartbeat gets: the bound less one interval.
        sent = time.monotonic()
        since = lease.last_proven if judged else sent - interval
        answer_within = max(0.0, since + bound - sent)
        lease.proof_wanted = False  # what asked before now, this proof answers
        proof = asyncio.ensure_future(prove())
        lease.proof = (sent, proof)
        try:
            await asyncio.wait({proof}, timeout=answer_within)
        finally:
            lease.proof = None
            if not proof.done():
                proof.cancel()
                proof.add_done_callback(discard_outcome)
        if not proof.done():
            on_failure()
            lease.lose(
                f"heartbeat failed: no answer within {answer_within:.1f}s", lock_may_be_free=False
            )
            return
        if (exc := proof.exception()) is not None:
            on_failure()
            lease.lose(f"heartbeat failed: {describe(exc)}", lock_may_be_free=False)
            return
        if not proof.result():
            lease.lose("lock no longer held (evicted or session ended)", lock_may_be_free=True)
            return
        # As of when it was asked: an answer that arrives after a freeze proves nothing
        # about the freeze.
        lease.last_proven = max(lease.last_proven, sent)
        proved, lease.proved = lease.proved, asyncio.Event()
        proved.set()


def _next_proof(lease: LeaseState, interval: float) -> tuple[bool, float]:
    """Whether the next proof is judged by the step-down bound (a lease with work running,
    or any lease unless quiet), and when it is due: one interval after the last proof,
    whoever made it (a sharded member's fenced transactions prove the lock too); at the
    quiet pace otherwise, or at once when work waits for it."""
    quiet_every = lease.quiet_interval
    judged = quiet_every is None or (lease.working and not lease.proof_wanted)
    if judged or quiet_every is None:  # (the second: for the type checker)
        return True, lease.last_proven + interval
    if lease.proof_wanted:
        return False, 0.0
    return False, lease.last_proven + quiet_every
