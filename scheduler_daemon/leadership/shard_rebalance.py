"""Moving towards the assignment: a sharded member takes the free shards assigned to it
and hands over those assigned elsewhere.

Every member computes the same assignment from the member list (assignment.py). Taking a
shard: ``pg_try_advisory_lock`` on the member's lock session, then its fencing token
drawn and its leader row written, then a wait for any predecessor that did not hand over
(``wait_for_predecessor``, as the session guard does) before any of its work starts. A
hand-over is the old owner's, end to end: it stops claiming the shard, lets its runs in
flight end (``plugin.handover_timeout``, then stops them as a lost leadership would),
writes their results, deletes its leader row, and only then unlocks and tells the others.

``Rebalancer.run`` looks again when woken (a NOTIFY, the heartbeat seeing another member
list, the watch: leadership/shards.py), and while the assignment is not reached, soon.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

import asyncpg

from ..aio import wait_any
from ..db.connect import is_database_error
from ..db.lock_store import PgLockStore, StaleLeader
from ..db.postgres import PostgresStore
from ..errors import describe
from ..schema_gate import SchemaNewer
from .assignment import Member, assign
from .base import GuardBase, LeadershipLost
from .postgres_session import wait_for_predecessor
from .shard_keys import ShardKeys, member_name
from .shard_lease import MemberLease, ShardLease, View

# While the assignment is not reached (a shard still held by its old owner, which sends
# a NOTIFY when it lets go), look again this soon, then less often.
RETRY_FIRST, RETRY_MAX = 0.2, 5.0


def _who(leader: StaleLeader) -> tuple[Any, ...]:
    """A leader row's leadership: its instance, process and lock session."""
    return (leader.instance, leader.pid, leader.backend_pid)


class Rebalancer:
    """A member's moves towards the assignment, one per guard: ``run`` is the member
    lease's service; ``hand_over`` gives a shard up (also when it was lost)."""

    def __init__(
        self,
        guard: GuardBase[PostgresStore],
        keys: ShardKeys,
        notify: Callable[[str], Awaitable[None]],
    ) -> None:
        self.loop = guard.loop
        self.key = guard.key
        self.store = guard.store
        self.settings = guard.settings
        self.log = guard.log
        self.metrics = guard.metrics
        self.stop = guard.stop
        self.schema = guard.schema
        self.instance = guard.settings.instance_id
        self.keys = keys
        self._notify = notify  # tell the other members to look again (the guard's)

    async def run(self, lease: MemberLease) -> None:
        """The member's service: read the members, take what is ours and free, hand over
        what is not. Ends only with the lease (or idles once the daemon stops)."""
        retry = RETRY_FIRST
        reason = "join"
        while not self.stop.is_set():
            lease.rebalance.clear()
            why, lease.rebalance_reason = lease.rebalance_reason, None
            try:
                # Its first shards are the member's joining, whoever's NOTIFY woke it.
                settled = await self._step(lease, reason if reason == "join" else why or reason)
            except SchemaNewer:
                break  # the loop hands over what it leads; take nothing meanwhile
            except Exception as exc:
                if lease.ended():
                    return  # the lease's end showing through
                if not is_database_error(exc):
                    raise
                self.log.warning("shard.rebalance_failed", error=describe(exc))
                settled = False
            if lease.shards:
                reason = "rebalance"  # "join" until the member first leads something
            if settled:
                retry = RETRY_FIRST
                wait = self.settings.lock.heartbeat_interval * 30  # a safety net only
            else:
                wait, retry = retry, min(retry * 2, RETRY_MAX)
            await wait_any([lease.rebalance, self.stop], wait)
        if self.stop.is_set():
            lease.stopping_since = time.monotonic()  # the graceful leave's hand-over starts
        await asyncio.Future()  # stopping: take nothing more; cancelled with the lease

    async def _step(self, lease: MemberLease, reason: str) -> bool:
        view = await self._view()
        if lease.view is None or lease.view.members != view.members:
            lease.view_changed.set()
        lease.view = view
        self.metrics.shard_members.labels(self.loop).set(len(view.members))
        # Held by our session but by no lease of ours: a shard taken and never set up
        # (an error between the lock and its lease). Let it go.
        orphans = sorted(
            s
            for s, pid in view.holders.items()
            if pid == lease.backend_pid and s not in lease.shards
        )
        if orphans:
            await self._release_untaken(lease, orphans)
        me = next((m for m in view.members if m.pid == lease.backend_pid), None)
        if me is None:
            return False  # not listed yet (or no longer: the heartbeat will say)
        mine = set(assign(view.members, self.keys.count)[me])
        for shard in lease.shards.values():
            if shard.shard not in mine and not shard.draining:
                shard.draining = True
                lease.spawn(
                    self.hand_over(lease, shard, "rebalance"), name=f"shard:{shard.shard}:handover"
                )
        wanted = sorted(s for s in mine if s not in lease.shards and view.holders.get(s) is None)
        if wanted:
            await self._acquire(lease, wanted, reason)
        missing = [s for s in mine if s not in lease.shards]
        return not missing and all(s.shard in mine for s in lease.shards.values())

    async def _view(self) -> View:
        rows = await PgLockStore(self.store.pool).lock_holders(
            self.keys.member_class, self.keys.shard_class, self.keys.count - 1, self.keys.count
        )
        members = tuple(
            sorted(
                Member(member_name(row.application_name or ""), row.pid)
                for row in rows
                if row.kind == "member"
            )
        )
        holders = {row.shard: row.pid for row in rows if row.shard is not None}  # shards
        return View(members, holders)

    async def _acquire(self, lease: MemberLease, wanted: list[int], reason: str) -> None:
        """Take those of ``wanted`` that are free, draw each one's fencing token and
        record ourselves as its leader; then wait for predecessors that did not hand over
        (dead ones are gone in milliseconds) before any of its work starts."""
        conn = lease.conn
        started = time.monotonic()
        # The statement lock too: no heartbeat may talk on the connection between these statements.
        async with lease.transaction_lock, lease.statement_lock:
            if lease.lost.is_set():
                return
            taken = await PgLockStore(conn).try_lock_shards(self.keys.shard_class, wanted)
            if not taken:
                return
        try:
            # Drawn on the pool: a draw waits for the old owner's fenced transactions
            # still open, and the heartbeat goes on on the lock connection meanwhile.
            tokens, stale = await self._claim(lease, taken)
            async with lease.transaction_lock, lease.statement_lock:
                await self._record(conn, tokens)
            waited = await self._settle_all(stale)
            # Members may have come and gone while we waited (the others coming back after
            # a restart): a shard that is no longer ours goes on to its owner before any
            # run of it starts here.
            mine = set(taken)
            if stale:
                view = await self._view()
                me = next((m for m in view.members if m.pid == lease.backend_pid), None)
                mine = set(assign(view.members, self.keys.count).get(me, [])) if me else set()
        except BaseException:
            await self._give_back(lease, taken)
            raise
        own = {leader.loop: waited[_who(leader)] for leader in stale}
        for shard in taken:
            lease.shards[shard] = ShardLease(lease, shard, tokens[shard])
            self.metrics.shard_changes.labels(self.loop, "acquired", reason).inc()
            self.log.info(
                "shard.acquired", shard=shard, fencing_token=tokens[shard], reason=reason,
                took=round(time.monotonic() - started, 4),
                **own.get(f"{self.loop}/{shard}", {}),
            )  # fmt: skip
            if shard not in mine:
                lease.shards[shard].draining = True
                lease.spawn(
                    self.hand_over(lease, lease.shards[shard], "rebalance"),
                    name=f"shard:{shard}:handover",
                )
        self._owned(lease)
        lease.wake_loop()

    async def _give_back(self, lease: MemberLease, shards: list[int]) -> None:
        """Shards taken whose setup failed: never left held and led by nobody. Their rows
        go, then their locks (or the connection, and every lock with it)."""
        try:
            async with lease.transaction_lock, lease.statement_lock:
                await self._unlock(lease, shards)
        except BaseException:
            lease.conn.terminate()
            raise

    async def _release_untaken(self, lease: MemberLease, shards: list[int]) -> None:
        self.log.warning("shard.released", shards=shards, reason="never_set_up")
        await self._give_back(lease, shards)

    async def _unlock(self, lease: MemberLease, shards: list[int]) -> None:
        if lease.lost.is_set():
            return  # the guard drops the connection, and the locks with it
        locks = PgLockStore(lease.conn)
        await locks.release_shards(shards)
        await locks.unlock_shards(self.keys.shard_class, shards)

    async def _settle_all(self, stale: list[StaleLeader]) -> dict[tuple[Any, ...], dict[str, Any]]:
        """Wait for every leader that did not hand over, at once (after a PostgreSQL
        restart the first member back takes every shard, from every other member: one
        settle time, not one per predecessor); then forget the rows of another layout's
        leaders (the loop unsharded, a shard this count does not have), which no holder
        of a shard will overwrite, so that nobody waits for them again. Not this layout's
        shards' rows: their next holders overwrite them, and deleting them here, while a
        member claims them, deadlocked (measured: a second's deadlock_timeout on a
        takeover). What each wait was, by leader."""
        whom = {_who(row): row for row in stale}
        waits = await asyncio.gather(
            *(
                wait_for_predecessor(self.store.pool, row, self.key, self.settings)
                for row in whom.values()
            ),
            return_exceptions=True,
        )
        for outcome in waits:
            if isinstance(outcome, BaseException):
                raise outcome
        other = [leader for leader in stale if not self._of_this_layout(leader.loop)]
        if other:
            await PgLockStore(self.store.pool).forget_leaders(other)
        return {who: cast(dict[str, Any], wait) for who, wait in zip(whom, waits, strict=True)}

    def _of_this_layout(self, loop: str) -> bool:
        """A leader row's loop names a shard of this shard count."""
        _, sep, shard = loop.partition("/")
        return bool(sep) and shard.isdigit() and int(shard) < self.keys.count

    async def _claim(
        self, lease: MemberLease, shards: list[int]
    ) -> tuple[dict[int, int], list[StaleLeader]]:
        """Per shard taken, its token; and the rows of every leader of the loop that did
        not hand over and whose session no longer holds what it led. Not only these
        shards' last leaders: a leader of another layout (the loop unsharded, or another
        shard count) may still be stopping runs of schedules that are in these shards
        now. (A dead one's sessions are gone in milliseconds: no wait.)

        Each shard's draw waits for the transactions its old owner still has open, fenced
        by the shard's row, and fails every later one (leadership/shard_lease.py): drawn
        in shard order, as the fence takes the rows, so the two never wait in a cycle.

        On the pool, so bounded as a fenced transaction is: a member frozen in it is cut
        off by the server after stall_timeout (its lock session by then too), which lets
        go of the rows; and it commits only if the lock session still holds the shards (a
        member frozen between taking them and drawing may have lost them meanwhile: its
        draw would supersede their next owner)."""
        tokens: dict[int, int] = {}
        me = (self.instance, os.getpid())
        async with self.store.pool.acquire() as conn, conn.transaction():
            locks = PgLockStore(conn)
            await locks.limit_transaction(
                stall_ms=round(self.settings.lock.stall_timeout * 1000),
                statement_ms=round(self.settings.database.statement_timeout * 1000),
            )
            stale = [
                leader
                for leader in await locks.stale_leaders(self.loop, self.keys.shard_class)
                if (leader.instance, leader.pid) != me
            ]
            for shard in sorted(shards):
                name, key = f"{self.loop}/{shard}", self.keys.lock_key(shard)
                found = await locks.predecessor(name, key)
                self.schema.check(found.schema_version, self.log, "lock granted")
                tokens[shard] = (await locks.draw_token(name, self.instance)).token
            state = await locks.member_state(lease.backend_pid, lease.locks)
            if not state.member or not set(shards) <= set(state.shards):
                reason = "the lock session lost the shards it took before their tokens were drawn"
                lease.lose(reason, lock_may_be_free=True)  # the session is gone: so is the member
                raise LeadershipLost(reason)
        return tokens, stale

    async def _record(self, conn: asyncpg.Connection, tokens: dict[int, int]) -> None:
        """Ourselves as each shard's leader, with its token: on the lock connection,
        whose backend pid is what a successor asks after."""
        locks = PgLockStore(conn)
        async with conn.transaction():
            for shard, token in tokens.items():
                await locks.claim_leadership(
                    f"{self.loop}/{shard}", self.keys.lock_key(shard), instance=self.instance,
                    hostname=socket.gethostname(), pid=os.getpid(), token=token,
                )  # fmt: skip

    async def hand_over(self, lease: MemberLease, shard: ShardLease, reason: str) -> None:
        """Give ``shard`` up: no more claims, its runs end (or are stopped), their results
        written, its leader row deleted; then its lock goes, and the others hear of it.
        A hand-over that fails half-way ends the membership: the session goes, and every
        lock with it, rather than a shard left held and led by nobody."""
        try:
            await self._give_up(lease, shard, reason)
        except Exception as exc:
            if lease.ended():
                return
            self.log.error("shard.handover_failed", shard=shard.shard, error=describe(exc))
            lease.lose(
                f"handing shard {shard.shard} over failed: {describe(exc)}", lock_may_be_free=False
            )

    async def _give_up(self, lease: MemberLease, shard: ShardLease, reason: str) -> None:
        started = time.monotonic()
        # A tick fenced for it before it was marked draining has started its runs by the
        # time it lets go of its claim: they are the shard's work from here on.
        async with lease.claiming:
            pass
        pending = {task for task in shard._work if not task.done()}
        if pending and not shard.lost.is_set():
            timeout = self.settings.plugin.handover_timeout
            _, late = await asyncio.wait(pending, timeout=timeout)
            if late:
                shard.lose(
                    f"handed over: runs still running after {timeout:g}s", lock_may_be_free=False
                )
        await shard.stop_work(unblock=lambda: lease.unblock_shard(shard))
        shard.unlocking = True
        async with lease.transaction_lock, lease.statement_lock:
            if not lease.lost.is_set():
                locks = PgLockStore(lease.conn)
                await locks.release_shards([shard.shard])
                await locks.unlock_shards(self.keys.shard_class, [shard.shard])
        del lease.shards[shard.shard]
        self.released(shard, reason, handover=round(time.monotonic() - started, 4))
        self._owned(lease)
        await self._notify("shard_released")
        lease.rebalance.set()

    def released(self, shard: ShardLease, reason: str, **fields: Any) -> None:
        self.metrics.shard_changes.labels(self.loop, "released", reason).inc()
        self.log.info("shard.released", shard=shard.shard, reason=reason, **fields)

    def _owned(self, lease: MemberLease) -> None:
        owned = len(lease.shards)
        self.metrics.shards_owned.labels(self.loop).set(owned)
        self.metrics.leader.labels(self.loop).set(1 if owned else 0)
