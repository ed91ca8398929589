"""The leases of sharded leadership: a replica's membership (``MemberLease``, on its lock
session) and its leadership of each shard it holds (``ShardLease``).

A member's ticks run under the ``MemberLease``, over its active shards; each shard's runs
are that ``ShardLease``'s work, stopped when the shard is lost or handed over.

The lock connection only holds and proves the member's locks (the heartbeat's answer,
``observe``, says which shards are still held and whether the members changed). Every
fenced transaction of a member (``MemberLease.fenced``) runs on a pooled connection,
several at once, and checks in its first statement each shard it is for
(:class:`ShardCheck`): the shard's fencing row FOR SHARE, its token still the one this
member drew when it took the shard. The shard's next owner draws a new token before its
first claim, which waits for those transactions and fails every later one: the loop's
token fence (leadership/session_lease.py), per shard. leadership/shards.py (the guard)
joins, watches and leaves; leadership/shard_rebalance.py takes and hands over.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Collection, Coroutine, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from ..db.base import ShardScope
from ..db.lock_store import MemberState
from ..db.postgres import PgTx
from ..db.sqlfiles import formatted, queries
from .assignment import Member
from .base import ClaimScope, LeadershipLost, Lease, WriteGroup
from .lease_state import LeaseState
from .session_lease import FenceCheck, SessionLease
from .shard_keys import ShardKeys

if TYPE_CHECKING:
    from ..metrics import Metrics

T = TypeVar("T")
QUERIES = queries("postgres")

# Why a member looked again, as NOTIFY payloads and the `reason` of shard.acquired.
REASONS = frozenset({"member_joined", "member_left", "member_gone", "shard_released"})


@dataclass(frozen=True, slots=True)
class View:
    """The members and the shards' holders, as the lock manager listed them."""

    members: tuple[Member, ...]
    holders: dict[int, int]  # shard -> backend pid


@dataclass(frozen=True, slots=True)
class ShardCheck:
    """The fence of a member's transaction (leadership/session_lease.py's
    :class:`FenceCheck`): each of ``leases``' shards' fencing rows of ``loop`` FOR SHARE,
    each token still the one its lease drew (``scheduler_fence_shards``, migration 0016).
    ``require_all``: a shard superseded refuses the transaction; else it goes on for the
    others."""

    loop: str
    member: MemberLease
    leases: tuple[ShardLease, ...]
    require_all: bool

    @property
    def token(self) -> int | None:
        return self.leases[0].fencing_token if len(self.leases) == 1 else None

    @property
    def narrows(self) -> bool:
        return not self.require_all

    @property
    def scope(self) -> ShardScope:
        tokens = {s.shard: s.fencing_token for s in self.leases}
        return ShardScope(self.member.keys.count, tokens)

    def statement(self, *, stall_ms: int, check_ms: int, newest: int) -> str:
        ordered = sorted(self.leases, key=lambda lease: lease.shard)
        locks = self.member.locks
        return formatted(
            QUERIES["shard_token_fence"], stall_ms=stall_ms, check_ms=check_ms, loop=self.loop,
            member_pid=self.member.backend_pid, member_class=locks.member_class,
            member_objid=locks.member_objid, shards=tuple(s.shard for s in ordered),
            tokens=tuple(s.fencing_token for s in ordered), newest=newest,
        )  # fmt: skip

    def superseded(self, detail: str) -> FenceCheck:
        if detail == "member":
            reason = "its lock session no longer holds the member lock"
            self.member.lose(reason, lock_may_be_free=True)
            raise LeadershipLost(reason)
        gone = {int(shard) for shard in detail.split(",") if shard.strip()}
        lost = [lease for lease in self.leases if lease.shard in gone]
        if not lost:  # not an answer about these shards: nothing to go on with
            raise LeadershipLost(f"the shard fence refused shards {detail!r}")
        for lease in lost:
            lease.lose("a newer owner drew its shard's fencing token", lock_may_be_free=True)
        if self.require_all:
            raise LeadershipLost("a newer owner drew its shard's fencing token")
        rest = tuple(lease for lease in self.leases if lease.shard not in gone)
        return ShardCheck(self.loop, self.member, rest, self.require_all)


class ShardLease(LeaseState):
    """Leadership of one shard: its runs are its work, stopped when it is lost or handed
    over; its fencing token is the shard's."""

    shard: int

    def __init__(self, member: MemberLease, shard: int, token: int) -> None:
        super().__init__(token, member.settings, member.log.bind(shard=shard), self._report)
        self.member = member
        self.shard = shard
        self.acquired_at = time.monotonic()
        self.draining = False  # being handed over: claim nothing more
        self.unlocking = False  # its lock is being let go: the heartbeat must not judge it

    def _report(self, reason: str, lock_may_be_free: bool) -> None:
        self.member.shard_lost(self, reason, lock_may_be_free)

    @property
    def scope(self) -> ShardScope:
        return ShardScope(self.member.keys.count, {self.shard: self.fencing_token})

    def proven_recently(self) -> bool:
        return not self.lost.is_set() and self.member.proven_recently()

    def transaction(self, *, only_ours: bool = False) -> AbstractAsyncContextManager[PgTx]:
        return self.member.fenced([self], only_ours=only_ours, require_all=True)

    async def run_sql(self, sql: str, statement_timeout: float) -> None:
        fenced = self.member.fenced([self], only_ours=False, require_all=True, lazy=True)
        async with fenced as tx:
            await tx.execute(sql, statement_timeout=statement_timeout)

    def spawn(
        self, work: Coroutine[Any, Any, T], name: str, *, service: bool = False
    ) -> asyncio.Task[T]:
        task = super().spawn(work, name, service=service)
        self.member.adopt(task)  # and the member's: its end stops everything
        return task

    def write_group(self) -> WriteGroup:
        return self.member  # the member's shards write their results together


class MemberLease(SessionLease):
    """A replica's membership of a sharded loop, on its lock session, and the shards it
    leads. Ticks run under it, over its active shards; runs under their shard's lease."""

    def __init__(self, *args: Any, keys: ShardKeys, metrics: Metrics, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.keys = keys
        self.metrics = metrics
        self.member_objid = keys.member_objid(self.backend_pid)
        self.locks = keys.member_locks(self.backend_pid)
        self.shards: dict[int, ShardLease] = {}
        self.claiming = asyncio.Lock()  # a tick's claim, until its runs are started
        self.view: View | None = None
        self.rebalance = asyncio.Event()  # look at the members again now
        self.rebalance_reason: str | None = None  # what asked, when it says (the watch)
        self.stopping_since: float | None = None  # when the daemon's stop reached it
        self.view_changed = asyncio.Event()  # for the watch: its member may have changed
        # The plugin loop's wake-up (``wake_on_gain``): a shard taken is claimed for at
        # once, not at the loop's next planned tick.
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

    def claim_scope(self, *, self_fenced: bool) -> ClaimScope:
        # A member's statements do not fence themselves: one transaction fences all its
        # active shards at once.
        shards = self.active_shards()
        leases: dict[int | None, Lease] = {s.shard: s for s in shards}
        return ClaimScope(self._claiming(shards), False, leases)

    @asynccontextmanager
    async def _claiming(self, shards: Sequence[ShardLease]) -> AsyncIterator[PgTx]:
        # Held until the tick has started what it claimed (the tick starts its runs as
        # soon as this ends, without awaiting): a hand-over waits for it, and then finds
        # every run of its shard among the shard's work.
        async with self.claiming, self.fenced(shards, only_ours=True) as tx:
            yield tx

    def wake_on_gain(self, wake: Callable[[], None]) -> None:
        self.wake_loop = wake

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

    def transaction(self, *, only_ours: bool = False) -> AbstractAsyncContextManager[PgTx]:
        return self.fenced(self.active_shards(), only_ours=only_ours)

    async def run_sql(self, sql: str, statement_timeout: float) -> None:
        # In a transaction for all its shards (its shards' runs have their own), not
        # SessionLease's, fenced by the loop's row.
        await LeaseState.run_sql(self, sql, statement_timeout)

    def statements(self) -> AbstractAsyncContextManager[PgTx]:
        # No statement of a member fences itself: a transaction does, for its shards.
        return self.fenced(self.active_shards(), only_ours=True)

    @asynccontextmanager
    async def fenced(
        self,
        shards: Sequence[ShardLease],
        *,
        only_ours: bool,
        require_all: bool = False,
        lazy: bool = False,
    ) -> AsyncIterator[PgTx]:
        """A fenced transaction on a pooled connection, for ``shards`` (those of them whose
        token is still their shard's: a shard found superseded is lost from here on;
        ``require_all``: then the transaction is refused). Its PgTx carries their scope,
        which the plugin loop's statements keep to. Several run at once; none on the lock
        connection, which only holds and proves the locks."""
        check = ShardCheck(self.fence.loop, self, tuple(shards), require_all)
        opened = self.fence.transaction(only_ours=only_ours, check=check, lazy=lazy)
        async with self._while_held(opened) as tx:
            yield tx

    def fenced_together(self, leases: Collection[Lease]) -> AbstractAsyncContextManager[PgTx]:
        # By identity: a shard handed over is no longer among ours, nor fenced for.
        return self.fenced([s for s in self.shards.values() if s in leases], only_ours=True)

    def unblock_shard(self, shard: ShardLease) -> None:
        """Drop the connections of the transactions fenced for ``shard`` (its stopped
        work may wait on them), not the member's others."""
        self.fence.terminate(shard.shard)

    def observe(self, state: MemberState, sent: float) -> bool:
        """Take in a heartbeat's answer (asked at ``sent``): shards it no longer lists are
        lost, a different member list asks for a rebalance. Whether we are a member."""
        held = set(state.shards)
        for shard in list(self.shards.values()):
            judged = shard.acquired_at < sent and not shard.unlocking
            if judged and shard.shard not in held and not shard.lost.is_set():
                shard.lose("heartbeat: its shard lock is no longer held", lock_may_be_free=True)
        self.note_members(state.members)
        return state.member

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

    def ended(self) -> bool:
        """Whether the member lease is over (a failure on its connection may be the first
        sign of it, before asyncpg's close callback has run)."""
        self._closed_already()
        return self.lost.is_set()
