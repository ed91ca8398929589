"""The leaders' contract with the database: typed methods over the named queries the
guards of leadership/ run on a connection (``leader_*``, ``lock_*``, ``fencing_next``,
``shard_*`` … in ``postgres.sql`` / ``sqlite.sql``), with named parameters, returning
dataclasses.

``LockStore`` is what both backends share: the ``scheduler_leaders`` row a new leader
reads before it claims it, and the fencing token it draws. ``PgLockStore`` runs on the
asyncpg connection it is given (a lock session, a hold's or a watch's connection) or on
the pool: the session state is the caller's, and so is the discipline around it (the
lease's statement lock, ``ask_between_statements``: nothing here takes a lock of the
caller's). Its settings methods send the named blocks that take no bind parameters
(:func:`~.sqlfiles.formatted`). ``SqliteLockStore`` runs on the connection of one of the
SQLite store's write transactions.

Contract tests: tests/test_store_contract.py (the leaders' lock store), both backends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import aiosqlite

from .base import Tx
from .postgres import PgTx
from .sqlfiles import formatted, positional, queries
from .sqlite import SqliteTx

QUERIES = queries("postgres")


@dataclass(frozen=True, slots=True)
class Predecessor:
    """What a leader just granted its lock reads first: the schema version, and who led
    last and did not hand over (``instance`` None: nobody, or it handed over)."""

    schema_version: int | None
    instance: str | None
    hostname: str | None
    pid: int | None


@dataclass(frozen=True, slots=True)
class Drawn:
    token: int  # the new leader's fencing token
    previous: int | None  # the last one committed (None: the first draw)


@dataclass(frozen=True, slots=True)
class Claimed:
    backend_pid: int  # the lock session's
    acquired_at: datetime


@dataclass(frozen=True, slots=True)
class Competed:
    """Transaction mode's fence: whether this transaction took the lock, its server
    backend (behind a pooler the client cannot know it), the schema version."""

    won: bool
    backend_pid: int
    schema_version: int | None


@dataclass(frozen=True, slots=True)
class InstanceSessions:
    count: int  # an instance's sessions, but the asker's
    waiting: int  # of them, those waiting for the asked lock


@dataclass(frozen=True, slots=True)
class StaleLeader:
    """A leader row whose lock session no longer holds what it led, not handed over."""

    loop: str  # the loop ('plugin') or a shard of it ('plugin/7')
    instance: str
    hostname: str
    pid: int
    backend_pid: int | None


@dataclass(frozen=True, slots=True)
class Layouts:
    others: int  # members started with another shard count
    other_count: int | None  # one such count


@dataclass(frozen=True, slots=True)
class LockHolder:
    """A sharded loop's lock, as the lock manager lists it: a member's (its session's
    pid and name) or a shard's (the shard, its holder's pid)."""

    kind: str  # member | shard
    pid: int
    application_name: str | None
    shard: int | None


@dataclass(frozen=True, slots=True)
class MemberLocks:
    """A sharded member's locks, as its heartbeat asks after them: its member lock
    (``member_class``, ``member_objid``) and the shards' class."""

    member_class: int
    member_objid: int
    shard_class: int


@dataclass(frozen=True, slots=True)
class MemberState:
    member: bool  # the session still holds its member lock
    shards: tuple[int, ...]  # the shards it holds
    members: tuple[int, ...]  # the members' backend pids, in order


class LockStore:
    """The statements both backends' guards run, through ``tx.query`` (named parameters)
    on the connection ``tx`` was made on, in a transaction or not, as the caller holds it."""

    def __init__(self, tx: Tx) -> None:
        self.tx = tx

    async def schema_version(self) -> int | None:
        [row] = await self.tx.query("schema_version")
        version: int | None = next(iter(row.values()))
        return version

    async def predecessor(self, loop: str, key: int) -> Predecessor:
        [row] = await self.tx.query("leader_predecessor", loop=loop, key=key)
        return Predecessor(row["schema_version"], row["instance"], row["hostname"], row["pid"])

    async def draw_token(self, loop: str, instance: str) -> Drawn:
        """The next fencing token of ``loop``'s row (``fencing_next`` says how it grows)."""
        [row] = await self.tx.query("fencing_next", loop=loop, instance=instance)
        return Drawn(row["token"], row["previous"])


def _bound(query: str, params: dict[str, Any]) -> tuple[str, list[Any]]:
    """A named block's text for asyncpg, and ``params`` in its positions: every one of
    its parameters given, none other."""
    text, names = positional("postgres", query)
    if set(names) != set(params):
        raise TypeError(f"{query} takes {sorted(names)}, given {sorted(params)}")
    return text, [params[name] for name in names]


class PgLockStore(LockStore):
    """The PostgreSQL guards' statements, on ``conn``: an asyncpg connection or pool."""

    def __init__(self, conn: Any) -> None:
        super().__init__(PgTx(conn))
        self.conn = conn

    async def _execute(self, query: str, **params: Any) -> None:
        text, args = _bound(query, params)
        await self.conn.execute(text, *args)

    async def _value(self, query: str, **params: Any) -> Any:
        text, args = _bound(query, params)
        return await self.conn.fetchval(text, *args)

    async def _row(self, query: str, **params: Any) -> Any:
        text, args = _bound(query, params)
        return await self.conn.fetchrow(text, *args)

    # -- the session's and the transaction's settings -------------------------------------

    async def limit_session(self, *, stall_ms: int) -> None:
        await self.conn.execute(formatted(QUERIES["session_limits"], stall_ms=stall_ms))

    async def limit_transaction(self, *, stall_ms: int, statement_ms: int) -> None:
        text = QUERIES["transaction_limits"]
        await self.conn.execute(formatted(text, stall_ms=stall_ms, statement_ms=statement_ms))

    async def no_statement_timeout(self) -> None:
        await self._execute("statement_timeout_off")

    async def reset_statement_timeout(self) -> None:
        await self._execute("statement_timeout_reset")

    async def lock_timeout(self, *, milliseconds: int) -> None:
        await self.conn.execute(formatted(QUERIES["lock_timeout_local"], milliseconds=milliseconds))

    async def default_lock_timeout(self) -> None:
        await self._execute("lock_timeout_default")

    # -- the loop's lock, and who holds it --------------------------------------------------

    async def try_lock(self, key: int) -> bool:
        return bool(await self._value("lock_try", key=key))

    async def wait_for_lock(self, key: int, slice_ms: int) -> None:
        await self._execute("lock_wait", key=key, slice_ms=slice_ms)

    async def unlock(self, key: int) -> None:
        await self._execute("lock_unlock", key=key)

    async def holds(self, key: int) -> bool:
        """Whether this session holds ``key`` (the session guard's proof)."""
        return bool(await self._value("lock_held", key=key))

    async def lock_entry(self, key: int, backend_pid: int) -> bool | None:
        """Backend ``backend_pid``'s entry for ``key``: True holds, False waits, None
        neither."""
        granted: bool | None = await self._value("lock_entry", key=key, backend_pid=backend_pid)
        return granted

    async def instance_sessions(self, prefix: str, key: int, *, within: float) -> InstanceSessions:
        """An instance's sessions (``prefix``: its application_name's), answered
        ``within`` seconds (asyncpg's timeout)."""
        text, args = _bound("instance_sessions", {"prefix": prefix, "key": key})
        row = await self.conn.fetchrow(text, *args, timeout=within)
        return InstanceSessions(row["n"], row["waiting"])

    async def compete(self, key: int) -> Competed:
        row = await self._row("fence_compete", key=key)
        return Competed(row["won"], row["backend"], row["schema_version"])

    async def queue_for_lock(self, key: int) -> None:
        """Transaction mode's hand-over: wait for ``key`` at transaction level."""
        await self._execute("hold_queue", key=key)

    async def backend_pid(self, *, within: float | None = None) -> int:
        """This connection's server backend (``within``: asyncpg's timeout, if any)."""
        text, _ = _bound("backend_pid", {})
        pid: int = await self.conn.fetchval(text, timeout=within)
        return pid

    async def now(self) -> datetime:
        value: datetime = await self._value("now")
        return value

    # -- the leaders' rows ------------------------------------------------------------------

    async def claim_leadership(
        self, loop: str, key: int, *, instance: str, hostname: str, pid: int, token: int
    ) -> Claimed:
        """Our row in ``scheduler_leaders``, with this session's backend pid."""
        row = await self._row(
            "leader_claim", loop=loop, key=key, instance=instance, hostname=hostname, pid=pid,
            token=token,
        )  # fmt: skip
        return Claimed(row["backend_pid"], row["acquired_at"])

    async def touch_leadership(
        self, loop: str, key: int, *, instance: str, hostname: str, pid: int, token: int
    ) -> None:
        """Transaction mode: the transaction that won the lock records who ran it."""
        await self._execute(
            "leader_touch", loop=loop, key=key, instance=instance, hostname=hostname, pid=pid,
            token=token,
        )  # fmt: skip

    async def release_leadership(self, loop: str, key: int) -> None:
        """Delete the row this session claimed (a graceful hand-over)."""
        await self._execute("leader_release", loop=loop, key=key)

    async def stale_leaders(self, loop: str, shard_class: int) -> list[StaleLeader]:
        rows = await self.tx.query("shard_stale_leaders", loop=loop, shard_class=shard_class)
        return [StaleLeader(**row) for row in rows]

    async def forget_leaders(self, leaders: Sequence[StaleLeader]) -> None:
        await self._execute(
            "leaders_forget",
            loops=[leader.loop for leader in leaders],
            backend_pids=[leader.backend_pid for leader in leaders],
        )

    # -- sharded leadership: joining, the shards, the member's locks ----------------------------

    async def join_gate(self, shard_class: int, gate: int) -> None:
        await self._execute("shard_join_gate", shard_class=shard_class, gate=gate)

    async def other_layouts(self, member_class: int, layout: int) -> Layouts:
        row = await self.conn.fetchrow(QUERIES["shard_layouts"], member_class, layout)
        return Layouts(row["others"], row["other_count"])

    async def share_loop_key(self, key: int) -> bool:
        return bool(await self._value("shard_join_share", key=key))

    async def unshare_loop_key(self, key: int) -> None:
        await self._execute("shard_join_unshare", key=key)

    async def take_member_lock(self, member_class: int, objid: int) -> bool:
        return bool(await self._value("shard_join_member", member_class=member_class, objid=objid))

    async def leave(self) -> None:
        """Every lock of the session at once (a member's graceful leave)."""
        await self._execute("shard_leave")

    async def notify_members(self, channel: str, why: str) -> None:
        await self._execute("shard_notify", channel=channel, why=why)

    async def watch_member(self, member_class: int, objid: int, slice_ms: int) -> None:
        """Wait until the member lock is granted: its member's session ended."""
        await self._execute(
            "shard_watch", member_class=member_class, objid=objid, slice_ms=slice_ms
        )

    async def lock_holders(
        self, member_class: int, shard_class: int, layout: int, count: int
    ) -> list[LockHolder]:
        rows = await self.conn.fetch(
            QUERIES["shard_members"], member_class, shard_class, layout, count
        )
        return [LockHolder(r["kind"], r["pid"], r["application_name"], r["shard"]) for r in rows]

    async def try_lock_shards(self, shard_class: int, shards: Sequence[int]) -> list[int]:
        """Those of ``shards`` this session took now."""
        taken = await self._value("shard_try_lock", shard_class=shard_class, shards=shards)
        return list(taken or [])

    async def release_shards(self, shards: Sequence[int]) -> None:
        """Delete this session's leader rows of ``shards`` (before their locks go)."""
        await self._execute("shard_leaders_release", shards=shards)

    async def unlock_shards(self, shard_class: int, shards: Sequence[int]) -> int:
        released: int = await self._value("shard_unlock", shard_class=shard_class, shards=shards)
        return released

    async def member_state(self, backend_pid: int, locks: MemberLocks) -> MemberState:
        state = await self._value(
            "shard_member_state", backend_pid=backend_pid, member_class=locks.member_class,
            member_objid=locks.member_objid, shard_class=locks.shard_class,
        )  # fmt: skip
        return MemberState(bool(state["member"]), tuple(state["shards"]), tuple(state["members"]))

    async def supersede(self, loop: str, rows: Sequence[str] | None) -> list[str]:
        """Move the tokens of the other layout's fencing rows on (``fencing_supersede``):
        ``rows``, or (None) every shard's of ``loop``. The rows superseded."""
        found = await self.tx.query("fencing_supersede", loop=loop, rows=rows)
        return [row["loop"] for row in found]


class SqliteLockStore(LockStore):
    """The SQLite guard's statements, on the connection of a write transaction. A leader
    is known by its instance and process (no session to ask)."""

    def __init__(self, conn: aiosqlite.Connection) -> None:
        super().__init__(SqliteTx(conn))

    async def claim_leadership(
        self, loop: str, key: int, *, instance: str, hostname: str, pid: int, token: int
    ) -> None:
        await self.tx.query(
            "leader_claim", loop=loop, key=key, instance=instance, hostname=hostname, pid=pid,
            token=token,
        )  # fmt: skip

    async def heartbeat(self, loop: str, key: int, *, instance: str, pid: int) -> None:
        """Move our row's ``heartbeat_at`` (what ``status`` shows)."""
        await self.tx.query("leader_heartbeat", loop=loop, key=key, instance=instance, pid=pid)

    async def release_leadership(self, loop: str, key: int, *, instance: str, pid: int) -> None:
        await self.tx.query("leader_release", loop=loop, key=key, instance=instance, pid=pid)
