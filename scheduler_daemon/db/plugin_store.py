"""The plugin loop's contract with the database: typed methods over named queries.

Each method is one named query of the backend's queries file (``plugin_*`` in
``postgres.sql`` / ``sqlite.sql``), called with named parameters inside a transaction the
caller holds (a fenced one, for the loop), and returns dataclasses. A batch, whatever its
size, is one statement on PostgreSQL: it travels as a JSON array of objects, which both
backends unpack in SQL (``jsonb_to_recordset``, ``json_each``). Times in those arrays are
spelled by :func:`~.common.to_db_time`, which both read and SQLite also compares.

Sharded, the transaction's scope (``tx.shards``, set by the fence that opened it) limits
every read and write of schedules and runs to the shards it holds, each checked against
its current fencing token in the same statement.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from .base import Tx
from .common import to_db_time


@dataclass(frozen=True, slots=True)
class RuntimeDefinition:
    """What a runtime schedule's row says to run, and when (declared tasks have none: the
    deployment's declaration says it)."""

    target: str
    args_json: str  # as stored: the cache key of the built task, decoded once
    every_seconds: float | None
    cron: str | None
    timezone: str
    timeout: float
    misfire: str
    jitter: float


@dataclass(frozen=True, slots=True)
class DueSchedule:
    name: str
    next_run_at: datetime
    trigger_requested_at: datetime | None
    runtime: RuntimeDefinition | None  # None: a declared task (config, plugin, built-in)
    shard: int | None = None  # sharded: the shard it belongs to
    definition: str | None = None  # what a claim compares: the row's runtime definition

    def due_at(self) -> datetime:
        """When it is due: its slot, or a trigger's time if sooner."""
        trigger = self.trigger_requested_at
        return self.next_run_at if trigger is None else min(self.next_run_at, trigger)


@dataclass(frozen=True, slots=True)
class Clock:
    """The database's clock at a statement, against ours (``time.monotonic()``): a tick
    plans by it, and a run's end, measured here, is recorded on the database's clock
    without waiting for a statement to stamp it."""

    db_now: datetime
    local: float

    def now(self) -> datetime:
        return self.db_now + timedelta(seconds=time.monotonic() - self.local)


@dataclass(frozen=True, slots=True)
class DueBatch:
    """A window on the schedules, as of one statement: what is due, oldest first, then
    what falls due soon after (the next tick's work, claimed from here in one round trip)."""

    now: datetime  # the database's clock, as of that statement
    due: list[DueSchedule]  # by due_at, then name; some not due yet
    # The earliest slot not due yet, of the schedules the statement did not claim (those
    # it claimed are in ``due``, as they are after the claim).
    next_slot: datetime | None
    full: bool = False  # as many due as the read's limit: more may be due than it holds
    # Our clock: ``now`` happened about halfway through the statement's round trip (half
    # a round trip of error at most, not one).
    local: float = 0.0
    round_trip: float = 0.0

    @property
    def clock(self) -> Clock:
        return Clock(self.now, self.local)

    def oldest_due(self, now: datetime) -> datetime | None:
        slots = [s.next_run_at for s in self.due if s.next_run_at <= now]
        return min(slots, default=None)


@dataclass(frozen=True, slots=True)
class Claim:
    """One schedule's part of a batch claim. ``seen_next`` is the compare-and-set: the
    claim of a schedule whose next_run_at moved since the read does nothing."""

    name: str
    seen_next: datetime
    next_run_at: datetime
    seen_trigger: datetime | None = None  # consumed if still the one read
    seen_definition: str | None = None  # compared too, if given (DueSchedule.definition)
    run_slot: datetime | None = None  # inserted as `running`
    skip_slot: datetime | None = None  # inserted as `skipped_overlap`


@dataclass(frozen=True, slots=True)
class ClaimedRun:
    id: int
    name: str
    slot: datetime
    status: str  # running | skipped_overlap


@dataclass(frozen=True, slots=True)
class Claimed:
    runs: list[ClaimedRun]  # what the claim inserted
    window: DueBatch  # read after it: what the next tick plans from


@dataclass(frozen=True, slots=True)
class RunResult:
    id: int
    name: str
    slot: datetime  # with the id, it finds the run in its day's partition (PostgreSQL)
    status: str
    error: str | None
    finished_at: datetime  # by the database's clock (see loops/plugin.py)


@dataclass(frozen=True, slots=True)
class HistoryStep:
    action: str  # created, dropped, emptied, moved, purged, blocked, busy, idle
    target: str | None  # the table it acted on
    rows: int


@dataclass(frozen=True, slots=True)
class FinishedSchedule:
    name: str
    consecutive_failures: int
    paused: bool
    run_count: int


@dataclass(frozen=True, slots=True)
class AbandonedRun:
    name: str
    slot: datetime
    instance: str


@dataclass(frozen=True, slots=True)
class Declaration:
    name: str
    schedule: str  # its description: a change of it reschedules the task
    first: datetime  # next_run_at of a task seen for the first time (or rescheduled)
    source: str


@dataclass(frozen=True, slots=True)
class DeclarationChange:
    change: str  # registered | rescheduled | activated | shadowed | retired
    name: str


def _storable(text: str | None) -> str | None:
    """Text as PostgreSQL text and JSON can hold it (no NUL, no lone surrogate): one
    target's odd error message must not keep its batch's results from being written."""
    if text is None:
        return None
    return text.replace("\x00", "\\0").encode("utf-8", "replace").decode("utf-8")


def _window(rows: list[dict[str, Any]], limit: int, asked: float, answered: float) -> DueBatch:
    due: list[DueSchedule] = []
    read: list[DueSchedule] = []  # what the window read (not what the claim advanced)
    now: datetime | None = None
    next_slot: datetime | None = None
    for row in rows:
        if row["kind"] == "outlook":
            now, next_slot = row["now"], row["next_run_at"]
        elif row["kind"] != "run":
            due.append(_due_schedule(row))
            if row["kind"] == "due":
                read.append(due[-1])
    assert now is not None  # the outlook row is always there
    due.sort(key=lambda s: (s.due_at(), s.name))
    full = sum(1 for s in read if s.due_at() <= now) >= limit
    return DueBatch(now, due, next_slot, full, (asked + answered) / 2, answered - asked)


def _due_schedule(row: dict[str, Any]) -> DueSchedule:
    runtime = None
    if row["target"] is not None:
        runtime = RuntimeDefinition(
            target=row["target"],
            args_json=row["args"],
            every_seconds=row["every_seconds"],
            cron=row["cron"],
            timezone=row["timezone"],
            timeout=row["timeout_seconds"],
            misfire=row["misfire"],
            jitter=row["jitter_seconds"],
        )
    return DueSchedule(
        row["name"],
        row["next_run_at"],
        row["trigger_requested_at"],
        runtime,
        row.get("shard"),
        row["definition"],
    )


def _json(items: Iterable[dict[str, Any]]) -> str:
    def encode(value: Any) -> Any:
        return to_db_time(value) if isinstance(value, datetime) else value

    return json.dumps([{k: encode(v) for k, v in item.items()} for item in items])


class PluginStore:
    """The plugin loop's statements, inside one transaction (``tx``)."""

    def __init__(self, tx: Tx) -> None:
        self.tx = tx
        scope = tx.shards
        # Every scoped statement takes both: owned NULL means every schedule.
        self._scope: dict[str, Any] = {"owned": None, "k": 1}
        if scope is not None:
            owned = [{"shard": s, "token": t} for s, t in sorted(scope.tokens.items())]
            self._scope = {"owned": json.dumps(owned), "k": scope.count}

    async def now(self) -> datetime:
        rows = await self.tx.query("now")
        value: datetime = rows[0]["now"]
        return value

    async def declare(self, tasks: Sequence[Declaration]) -> list[DeclarationChange]:
        """Make the declared tasks' rows match ``tasks``: new ones registered, changed
        schedules rescheduled, returning ones activated, the others retired (inactive,
        state kept). Runtime schedules are left alone (``shadowed``: a runtime schedule
        holds a declared task's name)."""
        payload = _json(
            {"name": t.name, "schedule": t.schedule, "first": t.first, "source": t.source}
            for t in tasks
        )
        rows = await self.tx.query("plugin_declare", tasks=payload)
        return [DeclarationChange(row["change"], row["name"]) for row in rows]

    async def publish_runnable(self, targets: Iterable[str]) -> None:
        """Replace the set of targets runtime schedules may name."""
        await self.tx.query("plugin_runnable", targets=json.dumps(sorted(set(targets))))

    async def abandon(self, reason: str, keep: Sequence[int]) -> list[AbandonedRun]:
        rows = await self.tx.query("plugin_abandon", reason=reason, keep=list(keep), **self._scope)
        return [AbandonedRun(row["name"], row["slot"], row["instance"]) for row in rows]

    async def due(self, limit: int, ahead: float = 0.0) -> DueBatch:
        """The window alone: a claim of nothing."""
        return (await self.claim("", [], limit=limit, ahead=ahead)).window

    async def claim(
        self, instance: str, claims: Sequence[Claim], *, limit: int = 100, ahead: float = 0.0
    ) -> Claimed:
        """Claim ``claims`` and read the window after them (``plugin_claim``), in one
        statement on PostgreSQL: at most ``limit`` rows read (past the claimed ones), up
        to ``ahead`` seconds past the next slot to come."""
        payload = _json(
            {
                "name": c.name,
                "seen_next": c.seen_next,
                "seen_definition": c.seen_definition,
                "next": c.next_run_at,
                "seen_trigger": c.seen_trigger,
                "run_slot": c.run_slot,
                "skip_slot": c.skip_slot,
            }
            for c in claims
        )
        asked = time.monotonic()
        rows = await self.tx.query(
            "plugin_claim", claims=payload, instance=instance, limit=limit, ahead=ahead,
            **self._scope,
        )  # fmt: skip
        answered = time.monotonic()
        runs = [
            ClaimedRun(row["id"], row["name"], row["slot"], row["status"])
            for row in rows
            if row["kind"] == "run"
        ]
        return Claimed(runs, _window(rows, limit, asked, answered))

    async def refuse(
        self, refused: Mapping[str, str], seen: Mapping[str, DueSchedule] | None = None
    ) -> None:
        """Pause runtime schedules this leader cannot run, each with its reason; one
        ``seen`` (as read) only if its slot and definition are still what was read."""
        seen = seen or {}
        payload = _json(
            {
                "name": name,
                "error": error,
                "seen_next": seen[name].next_run_at if name in seen else None,
                "seen_definition": seen[name].definition if name in seen else None,
            }
            for name, error in refused.items()
        )
        await self.tx.query("plugin_refuse", refused=payload)

    async def finish(
        self, results: Sequence[RunResult], max_failures: int, trim_every: int
    ) -> list[FinishedSchedule]:
        """Write the results, count failures (pausing at ``max_failures`` in a row) and mark
        a schedule's history due a trim every ``trim_every`` of its runs."""
        payload = _json(
            {
                "id": r.id,
                "slot": r.slot,
                "status": r.status,
                "error": _storable(r.error),
                "finished_at": r.finished_at,
            }
            for r in results
        )
        rows = await self.tx.query(
            "plugin_finish",
            results=payload,
            max_failures=max_failures,
            trim_every=trim_every,
            **self._scope,
        )
        return [
            FinishedSchedule(
                row["name"], row["consecutive_failures"], bool(row["paused"]), row["run_count"]
            )
            for row in rows
        ]

    async def maintain_history(
        self, *, older_than: float, ahead_days: int, limit: int, lock_timeout: float
    ) -> HistoryStep:
        """One step of the run history's upkeep by age, in the caller's transaction: on
        PostgreSQL the first of making a day's partition ahead, dropping a day older than
        ``older_than`` seconds (or past and emptied), moving a batch of a pre-partitioning
        table, purging strays of the default partition (migration 0012); on SQLite
        deleting up to ``limit`` finished runs older than that, oldest first. ``idle``:
        nothing left to do; ``blocked``: nothing but a day whose runs sit in the default
        partition; ``busy``: a lock was not had within ``lock_timeout``."""
        rows = await self.tx.query(
            "runs_maintain",
            older_than=older_than,
            ahead_days=ahead_days,
            limit=limit,
            lock_ms=max(1, round(lock_timeout * 1000)),
        )
        if not rows:  # SQLite: a row per run deleted, none when done
            return HistoryStep("idle", None, 0)
        first = rows[0]
        return HistoryStep(first["action"], first["target"], sum(int(r["rows"]) for r in rows))

    async def trims_due(self, limit: int) -> list[str]:
        """Up to ``limit`` schedules whose history is due a trim, in name order."""
        rows = await self.tx.query("plugin_trim_due", limit=limit)
        return [row["name"] for row in rows]

    async def trims_done(self, names: Sequence[str]) -> None:
        await self.tx.query("plugin_trim_done", names=list(names))

    async def trim(self, names: Sequence[str], keep: int) -> int:
        """Delete the finished runs of ``names`` older than their newest ``keep``; return how
        many went."""
        return len(await self.tx.query("plugin_trim", names=list(names), keep=keep))
