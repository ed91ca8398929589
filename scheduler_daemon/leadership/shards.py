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

A fenced transaction checks, in its first statement, the member lock and each shard it is
for, and holds all of them at transaction level (as session mode's ``fence_begin``); then
every claim and result statement checks each shard's fencing token against its current one
(db/postgres.sql). docs/leadership.md has the guarantees and the failure matrix.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

import asyncpg

from ..aio import wait_any
from ..db.base import ShardScope
from ..db.connect import is_database_error
from ..db.postgres import (
    FENCED_ISOLATION,
    PgTx,
    ask_between_statements,
    detect_dead_peer,
    statement_locked_transaction,
)
from ..db.sqlfiles import queries
from ..errors import describe
from ..schema_gate import SchemaNewer
from .assignment import Member, assign
from .base import LeadershipLost, LeaseState, Stopping, discard_outcome, heartbeat
from .postgres_session import (
    SessionGuard,
    SessionLease,
    session_keepalive_settings,
    wait_for_predecessor,
)

if TYPE_CHECKING:
    from ..db.listen import Listener
    from ..metrics import Metrics

QUERIES = queries("postgres")
T = TypeVar("T")

SHARDS_CHANNEL = "scheduler_shards_changed"
# Why a member looked again, as NOTIFY payloads and the `reason` of shard.acquired.
REASONS = frozenset({"member_joined", "member_left", "member_gone", "shard_released"})
NOTIFY = f"SELECT pg_notify('{SHARDS_CHANNEL}', $1)"  # the payload: why, for the logs
_PID_BITS = 22  # Linux pids stay below 2^22 (pid_max's ceiling)
_GATE = 2**31 - 1  # the join gate's key in the shard class (shards are < MAX_SHARDS)
# While the assignment is not reached (a shard still held by its old owner, which sends
# a NOTIFY when it lets go), look again this soon, then less often.
RETRY_FIRST, RETRY_MAX = 0.2, 5.0


@dataclass(frozen=True, slots=True)
class ShardKeys:
    """The advisory lock keys of one sharded loop, derived from its own key."""

    loop_key: int  # the loop's key (bigint space): members hold it shared
    count: int

    @property
    def shard_class(self) -> int:
        """30 bits of a hash of the whole key: two keys that differ anywhere get classes
        of their own (but for a 1 in 2^30 chance), unlike the key's low bits."""
        digest = hashlib.blake2b(self.loop_key.to_bytes(8, "big", signed=True), digest_size=4)
        return int.from_bytes(digest.digest(), "big") & (2**30 - 1)

    @property
    def member_class(self) -> int:
        return self.shard_class | 2**30

    def member_objid(self, backend_pid: int) -> int:
        return (self.count - 1) << _PID_BITS | backend_pid

    def lock_key(self, shard: int) -> int:
        """The shard's lock as one bigint (scheduler_leaders.lock_key): class, then shard."""
        return self.shard_class << 32 | shard


def _who(row: Any) -> tuple[Any, ...]:
    """A leader row's leadership: its instance, process and lock session."""
    return (row["instance"], row["pid"], row["backend_pid"])


def _signed(value: int) -> int:
    """An oid-sized key as the int4 the two-key lock functions take."""
    return value - 2**32 if value >= 2**31 else value


def member_name(application_name: str) -> str:
    """The instance id in a lock session's application_name (``scheduler-daemon/<id>/
    lock:plugin``, cut at 63 bytes by the server: then as much of it as there is)."""
    name = application_name.removeprefix("scheduler-daemon/")
    head, sep, _ = name.rpartition("/lock:")
    return head if sep else name


@dataclass(frozen=True, slots=True)
class View:
    """The members and the shards' holders, as the lock manager listed them."""

    members: tuple[Member, ...]
    holders: dict[int, int]  # shard -> backend pid


class ShardLease(LeaseState):
    """Leadership of one shard: its runs are its work, stopped when it is lost or handed
    over; its fencing token is the shard's."""

    def __init__(self, member: MemberLease, shard: int, token: int) -> None:
        super().__init__(token, member.settings, member.log.bind(shard=shard), self._report)
        self.member = member
        self.shard = shard
        self.acquired_at = time.monotonic()
        self.draining = False  # being handed over: claim nothing more
        self.unlocking = False  # its lock is being let go: the heartbeat must not judge it
        self.needs_abandon = True  # runs its predecessor left `running` are closed first

    def _report(self, reason: str, lock_may_be_free: bool) -> None:
        self.member.shard_lost(self, reason, lock_may_be_free)

    @property
    def scope(self) -> ShardScope:
        return ShardScope(self.member.keys.count, {self.shard: self.fencing_token})

    def proven_recently(self) -> bool:
        return not self.lost.is_set() and self.member.proven_recently()

    def transaction(self, *, only_ours: bool = False) -> AbstractAsyncContextManager[PgTx]:
        return self.member.fenced([self], only_ours=only_ours, require_all=True)

    def spawn(
        self, work: Coroutine[Any, Any, T], name: str, *, service: bool = False
    ) -> asyncio.Task[T]:
        task = super().spawn(work, name, service=service)
        self.member.adopt(task)  # and the member's: its end stops everything
        return task


class MemberLease(SessionLease):
    """A replica's membership of a sharded loop, on its lock session, and the shards it
    leads. Ticks run under it, over its active shards; runs under their shard's lease."""

    def __init__(self, *args: Any, keys: ShardKeys, metrics: Metrics, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.keys = keys
        self.metrics = metrics
        self.member_objid = keys.member_objid(self.backend_pid)
        self.shards: dict[int, ShardLease] = {}
        self.view: View | None = None
        self.rebalance = asyncio.Event()  # look at the members again now
        self.rebalance_reason: str | None = None  # what asked, when it says (the watch)
        self.stopping_since: float | None = None  # when the daemon's stop reached it
        self.view_changed = asyncio.Event()  # for the watch: its member may have changed
        # The plugin loop's wake-up (it sets this on its first tick): a shard taken
        # is claimed for at once, not at the loop's next planned tick.
        self.wake_loop: Callable[[], None] = lambda: None
        # The guard's hand-over of a shard (set by the guard once the lease exists).
        self.hand_over: Callable[[ShardLease, str], Coroutine[Any, Any, None]] | None = None

    def heard(self, payload: str) -> None:
        """A NOTIFY from another member (or the listener reconnected: ``""``). Anyone who
        may connect can send one: only our own reasons become a metric label."""
        if payload in REASONS:
            self.rebalance_reason = self.rebalance_reason or payload
        self.rebalance.set()

    def active_shards(self) -> list[ShardLease]:
        """The shards a tick may claim for: held, not lost, not being handed over."""
        return [s for s in self.shards.values() if not s.draining and not s.lost.is_set()]

    def lose(self, reason: str, *, lock_may_be_free: bool) -> bool:
        first = super().lose(reason, lock_may_be_free=lock_may_be_free)
        for shard in list(self.shards.values()):
            shard.lose(reason, lock_may_be_free=lock_may_be_free)
        return first

    def shard_lost(self, shard: ShardLease, reason: str, lock_may_be_free: bool) -> None:
        if self.lost.is_set():
            return  # the member's own loss is what gets reported
        self.metrics.shard_changes.labels("plugin", "lost", "lost").inc()
        shard.log.warning("shard.lost", reason=reason, lock_may_be_free=lock_may_be_free)
        self.rebalance.set()
        if not shard.draining and self.hand_over is not None:
            # Stopped now, not when the rebalancer next gets round to it: its work must
            # end (or the process exit) within stop_grace of this.
            shard.draining = True
            self.spawn(self.hand_over(shard, "lost"), name=f"shard:{shard.shard}:lost")

    def transaction(  # type: ignore[override]  # a context manager, built another way
        self, *, only_ours: bool = False
    ) -> AbstractAsyncContextManager[PgTx]:
        return self.fenced(self.active_shards(), only_ours=only_ours)

    @asynccontextmanager
    async def fenced(
        self, shards: Sequence[ShardLease], *, only_ours: bool, require_all: bool = False
    ) -> AsyncIterator[PgTx]:
        """A transaction on the lock connection, fenced for ``shards`` (those of them the
        session still holds: a shard found lost is lost from here on; ``require_all``: then
        the transaction is refused). Its PgTx carries their scope, which the plugin
        loop's statements keep to."""
        async with self.transaction_lock:
            self._closed_already()
            if self.lost.is_set():
                raise LeadershipLost(self.reason or "lost")
            try:
                async with statement_locked_transaction(
                    self.conn, self.statement_lock, FENCED_ISOLATION
                ):
                    # User SQL may run (a task's, not only_ours): then every lock of the
                    # member is held by the transaction, not just these shards' (SQL that
                    # unlocks everything must not free the others for a moment either).
                    asked = [s.shard for s in shards]
                    if not only_ours:
                        asked = sorted(s.shard for s in self.shards.values() if not s.unlocking)
                    sent = time.monotonic()
                    async with self.statement_lock:
                        fence = await self.conn.fetchrow(
                            QUERIES["shard_fence_begin"], self.keys.member_class, self.member_objid,
                            self.keys.shard_class, asked, self.key,
                        )  # fmt: skip
                    if not fence["member"]:
                        self._fence_broken("the lock connection is no longer a member")
                    self.last_proven = sent
                    self.schema.check(fence["schema_version"], self.log, "fence")
                    self.note_members(fence["members"])
                    held = set(fence["shards"])
                    for shard in shards:
                        if shard.shard not in held:
                            shard.lose("its shard lock is no longer held", lock_may_be_free=True)
                    live = [s for s in shards if s.shard in held]
                    if require_all and len(live) < len(shards):
                        raise LeadershipLost("its shard lock is no longer held")
                    scope = ShardScope(self.keys.count, {s.shard: s.fencing_token for s in live})
                    token = live[0].fencing_token if len(live) == 1 else None
                    tx = PgTx(self.conn, token, self.statement_lock, scope)
                    if only_ours:
                        yield tx
                        return
                    try:
                        async with statement_locked_transaction(self.conn, self.statement_lock):
                            yield tx
                    finally:
                        async with self.statement_lock:
                            await self._restore_all(sorted(held))
            except BaseException:
                self._closed_already()
                raise

    async def _restore_all(self, shards: list[int]) -> None:
        """As the session lease's restore, for every lock the member holds."""
        if self.lost.is_set() or self.conn.is_closed():
            return
        args = (self.keys.member_class, self.member_objid, self.keys.shard_class, shards, self.key)
        try:
            async with asyncio.timeout(self.settings.database.connect_timeout):
                if self.conn.is_in_transaction():
                    kept = await self.conn.fetchval(QUERIES["shard_fence_release"], *args)
                    await self.conn.fetchval(QUERIES["shard_fence_retake"], *args)
                    if not kept:
                        self.log.warning(
                            "leader.lock_restored",
                            hint="SQL run in a fenced transaction released the member's "
                            "locks (pg_advisory_unlock_all?); they were held throughout and "
                            "are held again",
                        )
                    return
                # SQL ended the transaction (COMMIT): look, do not touch.
                state = await self.conn.fetchval(
                    QUERIES["shard_member_state"], self.backend_pid, self.keys.member_class,
                    self.member_objid, self.keys.shard_class,
                )  # fmt: skip
                if not state["member"] or not set(shards) <= set(state["shards"]):
                    self._fence_broken("SQL in a fenced transaction ended it and the locks")
        except LeadershipLost:
            raise
        except Exception as exc:  # fail closed: unsure is lost
            self._fence_broken(f"could not restore the fence: {describe(exc)}")

    def observe(self, state: dict[str, Any], sent: float) -> bool:
        """Take in a heartbeat's answer (asked at ``sent``): shards it no longer lists are
        lost, a different member list asks for a rebalance. Whether we are a member."""
        held = set(state["shards"])
        for shard in list(self.shards.values()):
            judged = shard.acquired_at < sent and not shard.unlocking
            if judged and shard.shard not in held and not shard.lost.is_set():
                shard.lose("heartbeat: its shard lock is no longer held", lock_may_be_free=True)
        self.note_members(state["members"])
        return bool(state["member"])

    def note_members(self, pids: Sequence[int]) -> None:
        """The members' pids as the lock manager lists them now: a list other than the
        rebalancer's last view asks it to look again."""
        if self.view is not None and sorted(m.pid for m in self.view.members) != list(pids):
            self.rebalance.set()

    def successor(self) -> Member | None:
        """The member this one watches: the next in pid order, round the ring."""
        if self.view is None or len(self.view.members) < 2:
            return None
        ring = sorted(self.view.members, key=lambda m: m.pid)
        later = [m for m in ring if m.pid > self.backend_pid]
        return later[0] if later else ring[0]


class ShardedSessionGuard(SessionGuard):
    """Session mode's guard, for a loop whose work is split into shards."""

    def __init__(self, *args: Any, listener: Listener | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.keys = ShardKeys(self.key, self.settings.plugin.shards)
        self.listener = listener
        self.instance = self.settings.instance_id

    @asynccontextmanager
    async def leadership(self) -> AsyncIterator[SessionLease]:
        """Yields once this replica is a member (it may lead no shard yet: the
        rebalancer takes its share, and the loop's ticks claim for whatever it holds)."""
        conn = await self.store.connect_dedicated(
            f"lock:{self.loop}", session_keepalive_settings(self.settings)
        )
        detect_dead_peer(conn, self.lock.step_down_after)
        try:
            await conn.execute(self._session_timeouts())
            backend_pid = await self._join(conn)
            since = await conn.fetchval("SELECT now()")
        except BaseException:
            conn.terminate()
            raise
        lease = MemberLease(
            conn, self.key, backend_pid, since, 0, self.settings, self.log,
            self._report_lost, self.schema, keys=self.keys, metrics=self.metrics,
        )  # fmt: skip
        lease.hand_over = lambda shard, reason: self._hand_over(lease, shard, reason)
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
        lease.spawn(self._rebalance(lease), name="shards:rebalance", service=True)
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
        while True:
            async with conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock($1, $2)", keys.shard_class, _GATE)
                layouts = await conn.fetchrow(
                    QUERIES["shard_layouts"], keys.member_class, keys.count - 1
                )
                if layouts["others"]:
                    why = (
                        f"replicas running with plugin.shards={layouts['other_count']} share "
                        "the loop; this one waits until none is left"
                    )
                elif not await conn.fetchval("SELECT pg_try_advisory_lock_shared($1)", self.key):
                    why = (
                        "a replica running with plugin.shards=1 leads the plugin loop (or "
                        "waits for its lock); this one waits until none is left"
                    )
                else:
                    pid: int = await conn.fetchval("SELECT pg_backend_pid()")
                    # Never held by anyone else, but by a watch granted the lock of a
                    # dead member whose pid the server has since given to this session.
                    objid = _signed(keys.member_objid(pid))
                    sql = "SELECT pg_try_advisory_lock($1, $2)"
                    if await conn.fetchval(sql, keys.member_class, objid):
                        return pid
                    why = "this session's member lock is held by a watch; trying again"
                    await conn.execute("SELECT pg_advisory_unlock_shared($1)", self.key)
            if why != said:
                said = why
                self.log.warning(
                    "shard.join_blocked", reason=why,
                    hint="every replica must run with the same plugin.shards",
                )  # fmt: skip
            if await wait_any([self.stop, self.schema.newer], self.lock.poll_interval):
                raise Stopping if self.stop.is_set() else self.schema.error()

    async def _leave(self, lease: MemberLease, graceful: bool) -> None:
        shards = sorted(lease.shards)
        if graceful:
            try:
                async with asyncio.timeout(self.settings.database.connect_timeout):
                    await lease.conn.execute(QUERIES["shard_leaders_release"], shards)
                    await lease.conn.execute("SELECT pg_advisory_unlock_all()")
                    handover: dict[str, float] = {}
                    if lease.stopping_since is not None:  # the stop to the unlock, runs too
                        since = time.monotonic() - lease.stopping_since
                        handover = {"handover": round(since, 4)}
                    await lease.conn.close()
                for shard in shards:
                    self._released(lease.shards[shard], "stopping", **handover)
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
            await self.store.pool.execute(NOTIFY, why)
        except Exception as exc:
            if not is_database_error(exc):
                raise
            self.log.debug("shard.notify_failed", error=describe(exc))

    # -- the heartbeat --------------------------------------------------------------------

    async def _prove_member(self, lease: MemberLease) -> bool:
        args = (
            lease.backend_pid,
            self.keys.member_class,
            lease.member_objid,
            self.keys.shard_class,
        )
        sent = time.monotonic()
        try:
            state = await ask_between_statements(
                lease.conn,
                lease.transaction_lock,
                lease.statement_lock,
                QUERIES["shard_member_state"],
                *args,
            )
        except (asyncpg.InterfaceError, asyncpg.ConnectionDoesNotExistError):
            if not lease.conn.is_closed():
                raise
            lease.lose("lock connection closed", lock_may_be_free=True)
            return False
        if state is None:
            state = await self.store.pool.fetchval(QUERIES["shard_member_state"], *args)
        return lease.observe(state, sent)

    # -- moving towards the assignment ---------------------------------------------------------

    async def _rebalance(self, lease: MemberLease) -> None:
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
                if self._ended(lease):
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

    @staticmethod
    def _ended(lease: MemberLease) -> bool:
        """Whether the member lease is over (a failure on its connection may be the first
        sign of it, before asyncpg's close callback has run)."""
        lease._closed_already()
        return lease.lost.is_set()

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
                    self._hand_over(lease, shard, "rebalance"), name=f"shard:{shard.shard}:handover"
                )
        wanted = sorted(s for s in mine if s not in lease.shards and view.holders.get(s) is None)
        if wanted:
            await self._acquire(lease, wanted, reason)
        missing = [s for s in mine if s not in lease.shards]
        return not missing and all(s.shard in mine for s in lease.shards.values())

    async def _view(self) -> View:
        rows = await self.store.pool.fetch(
            QUERIES["shard_members"], self.keys.member_class, self.keys.shard_class,
            self.keys.count - 1, self.keys.count,
        )  # fmt: skip
        members = tuple(
            sorted(
                Member(member_name(row["application_name"] or ""), row["pid"])
                for row in rows
                if row["kind"] == "member"
            )
        )
        holders = {row["shard"]: row["pid"] for row in rows if row["kind"] == "shard"}
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
            taken: list[int] = (
                await conn.fetchval(QUERIES["shard_try_lock"], self.keys.shard_class, wanted) or []
            )
            if not taken:
                return
            try:
                tokens, stale = await self._claim(conn, taken)
            except BaseException:
                await self._give_back(lease, taken, locked=True)
                raise
        try:
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
            await self._give_back(lease, taken, locked=False)
            raise
        own = {row["loop"]: waited[_who(row)] for row in stale}
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
                    self._hand_over(lease, lease.shards[shard], "rebalance"),
                    name=f"shard:{shard}:handover",
                )
        self._owned(lease)
        lease.wake_loop()

    async def _give_back(self, lease: MemberLease, shards: list[int], *, locked: bool) -> None:
        """Shards taken whose setup failed: never left held and led by nobody. Their rows
        go, then their locks (or the connection, and every lock with it)."""
        try:
            if locked:  # the caller holds transaction_lock and the statement_lock
                await self._unlock(lease, shards)
            else:
                async with lease.transaction_lock, lease.statement_lock:
                    await self._unlock(lease, shards)
        except BaseException:
            lease.conn.terminate()
            raise

    async def _release_untaken(self, lease: MemberLease, shards: list[int]) -> None:
        self.log.warning("shard.released", shards=shards, reason="never_set_up")
        await self._give_back(lease, shards, locked=False)

    async def _unlock(self, lease: MemberLease, shards: list[int]) -> None:
        if lease.lost.is_set():
            return  # the guard drops the connection, and the locks with it
        await lease.conn.execute(QUERIES["shard_leaders_release"], shards)
        await lease.conn.fetchval(QUERIES["shard_unlock"], self.keys.shard_class, shards)

    async def _settle_all(self, stale: list[Any]) -> dict[tuple[Any, ...], dict[str, Any]]:
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
        other = [row for row in stale if not self._of_this_layout(row["loop"])]
        if other:
            await self.store.pool.execute(
                QUERIES["leaders_forget"], [row["loop"] for row in other],
                [row["backend_pid"] for row in other],
            )  # fmt: skip
        return {who: cast(dict[str, Any], wait) for who, wait in zip(whom, waits, strict=True)}

    def _of_this_layout(self, loop: str) -> bool:
        """A leader row's loop names a shard of this shard count."""
        _, sep, shard = loop.partition("/")
        return bool(sep) and shard.isdigit() and int(shard) < self.keys.count

    async def _claim(
        self, conn: asyncpg.Connection, shards: list[int]
    ) -> tuple[dict[int, int], list[Any]]:
        """Per shard taken, its token; and the rows of every leader of the loop that did
        not hand over and whose session no longer holds what it led. Not only these
        shards' last leaders: a leader of another layout (the loop unsharded, or another
        shard count) may still be stopping runs of schedules that are in these shards
        now. (A dead one's sessions are gone in milliseconds: no wait.)"""
        tokens: dict[int, int] = {}
        me = (self.instance, os.getpid())
        async with conn.transaction():
            stale = [
                row
                for row in await conn.fetch(
                    QUERIES["shard_stale_leaders"], self.loop, self.keys.shard_class
                )
                if (row["instance"], row["pid"]) != me
            ]
            for shard in shards:
                name, key = f"{self.loop}/{shard}", self.keys.lock_key(shard)
                found = await conn.fetchrow(QUERIES["leader_predecessor"], name, key)
                self.schema.check(found["schema_version"], self.log, "lock granted")
                tokens[shard] = await conn.fetchval(QUERIES["fencing_next"], name, self.instance)
                await conn.execute(
                    QUERIES["leader_claim"], name, key, self.instance, socket.gethostname(),
                    os.getpid(), tokens[shard],
                )  # fmt: skip
        return tokens, stale

    async def _hand_over(self, lease: MemberLease, shard: ShardLease, reason: str) -> None:
        """Give ``shard`` up: no more claims, its runs end (or are stopped), their results
        written, its leader row deleted; then its lock goes, and the others hear of it.
        A hand-over that fails half-way ends the membership: the session goes, and every
        lock with it, rather than a shard left held and led by nobody."""
        try:
            await self._give_up(lease, shard, reason)
        except Exception as exc:
            if self._ended(lease):
                return
            self.log.error("shard.handover_failed", shard=shard.shard, error=describe(exc))
            lease.lose(
                f"handing shard {shard.shard} over failed: {describe(exc)}", lock_may_be_free=False
            )

    async def _give_up(self, lease: MemberLease, shard: ShardLease, reason: str) -> None:
        started = time.monotonic()
        # A tick fenced for it before it was marked draining has started its runs by the
        # time it lets the connection go: they are the shard's work from here on.
        async with lease.transaction_lock:
            pass
        pending = {task for task in shard._work if not task.done()}
        if pending and not shard.lost.is_set():
            timeout = self.settings.plugin.handover_timeout
            _, late = await asyncio.wait(pending, timeout=timeout)
            if late:
                shard.lose(
                    f"handed over: runs still running after {timeout:g}s", lock_may_be_free=False
                )
        await shard.stop_work(unblock=lease.conn.terminate)
        shard.unlocking = True
        async with lease.transaction_lock, lease.statement_lock:
            if not lease.lost.is_set():
                await lease.conn.execute(QUERIES["shard_leaders_release"], [shard.shard])
                await lease.conn.fetchval(
                    QUERIES["shard_unlock"], self.keys.shard_class, [shard.shard]
                )
        del lease.shards[shard.shard]
        self._released(shard, reason, handover=round(time.monotonic() - started, 4))
        self._owned(lease)
        await self._notify("shard_released")
        lease.rebalance.set()

    def _released(self, shard: ShardLease, reason: str, **fields: Any) -> None:
        self.metrics.shard_changes.labels(self.loop, "released", reason).inc()
        self.log.info("shard.released", shard=shard.shard, reason=reason, **fields)

    def _owned(self, lease: MemberLease) -> None:
        owned = len(lease.shards)
        self.metrics.shards_owned.labels(self.loop).set(owned)
        self.metrics.leader.labels(self.loop).set(1 if owned else 0)

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
                if self._ended(lease):
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
            await conn.execute("SET statement_timeout = 0")
            objid = _signed(self.keys.member_objid(watched.pid))
            granted = asyncio.ensure_future(
                conn.execute("SELECT pg_advisory_lock($1, $2)", self.keys.member_class, objid)
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
