"""Sharded leadership of the plugin loop (``plugin.shards`` > 1; PostgreSQL session mode).

Every schedule belongs to one of ``K`` shards (its row's ``shard_hash`` modulo K), and
each shard is led by one replica at a time, which holds the shard's advisory lock on its
lock session: the session mode guard's lock, one per shard, with nothing that expires. A
replica's death ends its session, and all of its shards are free at once.

Membership comes from the lock manager, not from rows with a TTL: a replica that shares
the shards holds a *member lock* on its lock session (the two-key lock space: the member
class, and ``(K - 1) << 22 | backend pid``), so ``pg_locks`` lists the members, the shard
count each runs with, and who holds each shard. Joining happens under a gate (a
transaction-level lock) that refuses a second shard count (two counts would give one
schedule two shards) and a replica leading the loop unsharded: members also hold the
loop's own key *shared*, which the unsharded guard takes exclusively.

Every member computes the same assignment from the member list (assignment.py) and moves
towards it: it takes the free shards assigned to it (``pg_try_advisory_lock``) and hands
over those assigned elsewhere. A hand-over is the old owner's, end to end: it stops
claiming the shard, lets its runs in flight end (``plugin.handover_timeout``, then stops
them as a lost leadership would), writes their results, deletes its leader row, and only
then unlocks. The next owner, granted the lock, draws the shard's fencing token, and waits
for a predecessor that did not hand over (``wait_for_predecessor``, as the session guard does).

What makes a member look again: a NOTIFY on ``scheduler_shards_changed`` (sent by a member
that joined, handed a shard over or left), the heartbeat seeing a different member list,
and a *watch*: each member waits on a connection of its own for the member lock of the next
member in pid order, which the server grants the moment that member's session ends, so
the survivors hear of a death within milliseconds, not at a poll.

A member's fenced transactions run on its pool, each checking in its first statement
that its lock session is still a member and that each shard's token is still the one it
drew, the shard's fencing row held FOR SHARE (leadership/shard_lease.py); then every claim
and result statement checks each shard's token again (db/postgres.sql). docs/leadership.md has the guarantees and the failure matrix.

This module is the guard (``ShardedSessionGuard``): it joins, proves the membership (the
heartbeat), watches the next member and leaves. The leases and their fenced transactions
are leadership/shard_lease.py; taking and handing over shards, leadership/shard_rebalance.py;
the lock keys, leadership/shard_keys.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import asyncpg

from ..aio import wait_any
from ..db.connect import is_database_error
from ..db.lock_store import PgLockStore
from ..db.postgres import ask_between_statements, detect_dead_peer
from ..errors import describe
from .assignment import Member
from .base import Stopping
from .heartbeat import heartbeat
from .lease_state import discard_outcome
from .postgres_session import LOCK_WAIT_SLICE_MS, SessionGuard, session_keepalive_settings
from .session_lease import SessionLease, fencing_row
from .shard_keys import ShardKeys
from .shard_lease import MemberLease
from .shard_rebalance import Rebalancer

if TYPE_CHECKING:
    from ..db.listen import Listener

SHARDS_CHANNEL = "scheduler_shards_changed"
_GATE = 2**31 - 1  # the join gate's key in the shard class (shards are < MAX_SHARDS)


def _signed(value: int) -> int:
    """An oid-sized key as the int4 the two-key lock functions take."""
    return value - 2**32 if value >= 2**31 else value


class ShardedSessionGuard(SessionGuard):
    """Session mode's guard, for a loop whose work is split into shards."""

    def __init__(self, *args: Any, listener: Listener | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.keys = ShardKeys(self.key, self.settings.plugin.shards)
        self.listener = listener
        self.instance = self.settings.instance_id
        self.rebalancer = Rebalancer(self, self.keys, self._notify)

    @asynccontextmanager
    async def leadership(self) -> AsyncIterator[SessionLease]:
        """Yields once this replica is a member (it may lead no shard yet: the
        rebalancer takes its share, and the loop's ticks claim for whatever it holds)."""
        conn = await self.store.connect_dedicated(
            f"lock:{self.loop}", session_keepalive_settings(self.settings)
        )
        detect_dead_peer(conn, self.lock.step_down_after)
        try:
            await self._limit_session(conn)
            backend_pid = await self._join(conn)
            since = await PgLockStore(conn).now()
        except BaseException:
            conn.terminate()
            raise
        lease = MemberLease(
            conn, self.key, backend_pid, since, 0, self.settings, self.log,
            self._report_lost, self.schema, pool=self.store.pool, loop=self.loop,
            keys=self.keys, metrics=self.metrics,
        )  # fmt: skip
        lease.hand_over = lambda shard, reason: self.rebalancer.hand_over(lease, shard, reason)
        on_closed = self._on_closed(lease)
        conn.add_termination_listener(on_closed)
        if conn.is_closed():
            on_closed(conn)
        self.metrics.leadership_changes.labels(self.loop, "acquired").inc()
        self.log.info(
            "leader.acquired", key=self.key, backend_pid=backend_pid, shards=self.keys.count,
            member=True,
        )  # fmt: skip
        try:
            if self.listener is not None:
                await self.listener.subscribe(SHARDS_CHANNEL, lease.heard)
            await self._notify("member_joined")  # the others make room for us
        except BaseException:
            conn.terminate()  # a member that never ran: its locks go with the session
            raise
        beating = asyncio.create_task(
            heartbeat(
                lease,
                lambda: self._prove_member(lease),
                self.metrics.heartbeat_failures.labels(self.loop).inc,
            ),
            name=f"heartbeat:{self.loop}",
        )
        lease.spawn(self.rebalancer.run(lease), name="shards:rebalance", service=True)
        lease.spawn(self._watch(lease), name="shards:watch", service=True)
        clean_exit = False
        try:
            yield lease
            clean_exit = True
        finally:
            await self._stop_leading(lease, beating, on_closed)
            if self.listener is not None:
                self.listener.unsubscribe(SHARDS_CHANNEL)
            self.metrics.shards_owned.labels(self.loop).set(0)
            await self._leave(lease, graceful=clean_exit and not lease.lost.is_set())

    # -- joining and leaving ----------------------------------------------------------------

    async def _join(self, conn: asyncpg.Connection) -> int:
        """Take the member lock, once no member runs another shard count and no replica
        leads the loop unsharded; until then stand by (and say why, once)."""
        keys = self.keys
        self.metrics.lock_waits.labels(self.loop).inc()
        self.log.info("leader.waiting", key=self.key, shards=keys.count)
        said: str | None = None
        locks = PgLockStore(conn)
        while True:
            async with conn.transaction():
                await locks.join_gate(keys.shard_class, _GATE)
                layouts = await locks.other_layouts(keys.member_class, keys.count - 1)
                if layouts.others:
                    why = (
                        f"replicas running with plugin.shards={layouts.other_count} share "
                        "the loop; this one waits until none is left"
                    )
                elif not await locks.share_loop_key(self.key):
                    why = (
                        "a replica running with plugin.shards=1 leads the plugin loop (or "
                        "waits for its lock); this one waits until none is left"
                    )
                else:
                    pid = await locks.backend_pid()
                    # Never held by anyone else, but by a watch granted the lock of a
                    # dead member whose pid the server has since given to this session.
                    objid = _signed(keys.member_objid(pid))
                    if await locks.take_member_lock(keys.member_class, objid):
                        await self._supersede_other_layouts(locks, pid)
                        return pid
                    why = "this session's member lock is held by a watch; trying again"
                    await locks.unshare_loop_key(self.key)
            if why != said:
                said = why
                self.log.warning(
                    "shard.join_blocked", reason=why,
                    hint="every replica must run with the same plugin.shards",
                )  # fmt: skip
            if await wait_any([self.stop, self.schema.newer], self.lock.poll_interval):
                raise Stopping if self.stop.is_set() else self.schema.error()

    async def _supersede_other_layouts(self, locks: PgLockStore, pid: int) -> None:
        """A member, joined (under the gate): no transaction of another layout commits
        from now on. Their fenced transactions are on pooled connections, which outlive
        their lock sessions: a leader of the loop unsharded (fenced by the loop's own row,
        which no shard's draw touches) and, for the first member of this layout, members
        of another shard count, or gone (fenced by shard rows this layout may never draw,
        or draw only after another shard's owner ran the schedules that moved). Moved
        on, which waits for those still open."""
        await locks.supersede(self.loop, [fencing_row(self.loop, self.key)])
        state = await locks.member_state(pid, self.keys.member_locks(pid))
        if list(state.members) == [pid]:
            await locks.supersede(self.loop, None)

    async def _leave(self, lease: MemberLease, graceful: bool) -> None:
        shards = sorted(lease.shards)
        if graceful:
            try:
                async with asyncio.timeout(self.settings.database.connect_timeout):
                    locks = PgLockStore(lease.conn)
                    await locks.release_shards(shards)
                    await locks.leave()
                    handover: dict[str, float] = {}
                    if lease.stopping_since is not None:  # the stop to the unlock, runs too
                        since = time.monotonic() - lease.stopping_since
                        handover = {"handover": round(since, 4)}
                    await lease.conn.close()
                for shard in shards:
                    self.rebalancer.released(lease.shards[shard], "stopping", **handover)
                self.metrics.leadership_changes.labels(self.loop, "released").inc()
                self.log.info("leader.released", key=self.key, shards=len(shards))
                await self._notify("member_left")
                return
            except Exception as exc:
                self.log.warning("leader.release_failed", error=describe(exc))
        lease.conn.terminate()
        if not lease.lost.is_set():
            self.metrics.leadership_changes.labels(self.loop, "stepped_down").inc()
            self.log.info("leader.stepped_down", key=self.key)

    async def _notify(self, why: str) -> None:
        """Tell the other members to look again (best effort: the heartbeat and the
        watch find the change anyway)."""
        try:
            await PgLockStore(self.store.pool).notify_members(SHARDS_CHANNEL, why)
        except Exception as exc:
            if not is_database_error(exc):
                raise
            self.log.debug("shard.notify_failed", error=describe(exc))

    # -- the heartbeat --------------------------------------------------------------------

    async def _prove_member(self, lease: MemberLease) -> bool:
        sent = time.monotonic()
        try:
            state = await ask_between_statements(
                lease.conn,
                lease.transaction_lock,
                lease.statement_lock,
                lambda conn: PgLockStore(conn).member_state(lease.backend_pid, lease.locks),
            )
        except (asyncpg.InterfaceError, asyncpg.ConnectionDoesNotExistError):
            if not lease.conn.is_closed():
                raise
            lease.lose("lock connection closed", lock_may_be_free=True)
            return False
        if state is None:
            state = await PgLockStore(self.store.pool).member_state(lease.backend_pid, lease.locks)
        return lease.observe(state, sent)

    # -- the watch --------------------------------------------------------------------------

    async def _watch(self, lease: MemberLease) -> None:
        """Wait, on a connection of our own, for the next member's lock: granted the moment
        its session ends. Then every member looks again (a NOTIFY), not at the next
        heartbeat."""
        while True:
            await lease.view_changed.wait()
            lease.view_changed.clear()
            watched = lease.successor()
            if watched is None:
                continue
            if lease.lost.is_set():
                return
            try:
                if await self._outlived(lease, watched):
                    self.log.info("shard.member_gone", member=watched.name, backend_pid=watched.pid)
                    lease.rebalance_reason = "member_gone"
                    lease.rebalance.set()
                    await self._notify("member_gone")
            except Exception as exc:
                if lease.ended():
                    return
                if not is_database_error(exc):
                    raise
                self.log.debug("shard.watch_failed", error=describe(exc))
                lease.view_changed.set()  # try again, after a pause
                await asyncio.sleep(self.lock.poll_interval)

    async def _outlived(self, lease: MemberLease, watched: Member) -> bool:
        """True once ``watched``'s member lock was granted to us (it is gone); False if our
        view of the members changed first (watch another)."""
        # The server checks the socket of a session that waits: a killed replica's watch
        # ends within a second, not when its lock is granted.
        conn = await self.store.connect_dedicated(
            f"watch:{self.loop}", {"client_connection_check_interval": "1000"}
        )
        granted: asyncio.Future[Any] | None = None
        try:
            detect_dead_peer(conn, self.lock.step_down_after)
            locks = PgLockStore(conn)
            await locks.no_statement_timeout()
            objid = _signed(self.keys.member_objid(watched.pid))
            granted = asyncio.ensure_future(
                locks.watch_member(self.keys.member_class, objid, LOCK_WAIT_SLICE_MS)
            )
            changed = asyncio.ensure_future(lease.view_changed.wait())
            try:
                await asyncio.wait({granted, changed}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                changed.cancel()
            if granted.done():
                granted.result()
                return True
            return False
        finally:
            conn.terminate()  # frees what it was granted; ends a wait without an ERROR
            if granted is not None:
                # Its outcome is the terminate's doing: retrieved whenever it lands (we
                # may be being cancelled, and must not wait for it here).
                granted.add_done_callback(discard_outcome)
