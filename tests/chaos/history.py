"""What a chaos run did, as records: the checker's and the report's only input.

A :class:`History` is built by the harness and written to a run directory's
``history.jsonl`` (one JSON object per line, each with a ``"type"``), so that a run can be
checked again later, by a newer checker, without running it again:

``meta``           the run: seed, duration, replicas, start and end (wall clock), the
                   checker's settings (see :class:`Meta`) and ``expected_slots`` (each plugin
                   task's period, seconds); any other key is kept in ``extra``.
``fault``          kind, target (a replica's name, or ``"postgres"``), start, end; and,
                   from the harness, ``instance`` (the process a process fault hit),
                   ``id`` (its place in the plan) and ``during`` (the id of the fault it
                   was planned to start inside of: two faults at once). The windows are
                   what really happened: two faults overlap where their windows do.
``publication``    id, key, via (``sql`` / ``api``), publish_at (the wall clock of the
                   database time it is due), created.
``publish_effect`` one sighting of a publication having been published: ``id`` (the
                   publication's), source (``audit``: the row the ``sql`` publisher wrote;
                   ``notify``: a message on the notify stream; ``external``: a Python
                   publisher's record outside the database), instance, token, at.
``run``            one run of loop work: loop, task, slot (ISO 8601, or null), kind, source
                   (``db`` / ``external``), instance, token, start, end, outcome; and
                   ``shard`` (sharded leadership: the shard its record names, else null).
``leader``         loop, instance, event (``acquired`` / ``released`` / ``lost``), at, token:
                   from the replicas' ``leader.*`` log lines; with ``shard`` (not null),
                   from their ``shard.*`` lines: one shard of the plugin loop changed owner.
``exit``           a replica process ended: instance, code, at; ``signal`` (``SIGTERM`` /
                   ``SIGKILL``: what the harness ended it with), ``forced`` (a SIGTERM not
                   answered in time, then SIGKILL), ``unbidden`` (it exited before anyone
                   asked). Histories older than these fields have the code alone.
``observer_gap``   source, start, end: a witness that was not watching (the notify listener
                   reconnecting), so a publication it missed then is not a loss.
``final_locks``    ``locks``: the advisory locks still held after every replica stopped.

Every time is wall clock, seconds since the epoch, on this host's real clock: the harness
puts records from a replica whose clock it skewed back on the real one. A fault's target
names a replica; its processes are its *incarnations*, named ``<replica>.<n>`` (or the
fault says which one it hit in ``instance``).

Loading is strict about what it knows (record types, fault kinds, sources, loops), so a
typo in the harness fails the load instead of silently checking nothing.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

from rig.effects import EffectRun

from chaos.nemesis import ALL_KINDS

FAULT_KINDS: frozenset[str] = frozenset(ALL_KINDS)
LOOPS = ("publish", "plugin")
SOURCES = ("audit", "notify", "external")
RUN_SOURCES = ("db", "external")
LEADER_EVENTS = ("acquired", "released", "lost")
# What each witness of a publication promises (docs/publishing.md): the audit row and the
# notify message commit with the state flip, exactly once; a Python publisher's side effect
# is repeated by a crash between it and the commit, at least once.
POLICIES = ("exactly_once", "at_least_once", "at_most_once")
DEFAULT_SOURCES: Mapping[str, str] = {
    "audit": "exactly_once",
    "notify": "exactly_once",
    "external": "at_least_once",
}
DATABASE = "postgres"


class HistoryError(ValueError):
    """A history file that cannot be read as one."""


def clock(epoch: float | None) -> str:
    """``HH:MM:SS.mmm`` (UTC), the form every explanation uses."""
    if epoch is None:
        return "?"
    return datetime.fromtimestamp(epoch, UTC).strftime("%H:%M:%S.%f")[:-3]


def parse_slot(slot: str | None) -> float | None:
    if slot is None:
        return None
    moment = datetime.fromisoformat(slot)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


@dataclass(frozen=True, slots=True)
class Meta:
    TYPE: ClassVar[str] = "meta"

    seed: int
    duration: float
    replicas: int
    start: float
    end: float
    expected_slots: Mapping[str, float] = field(default_factory=dict)
    # Lateness outside fault windows above this is a violation (seconds).
    lateness_bound: float = 2.0
    # A fault's window lasts this long after its end (and per kind, where given).
    recovery_allowance: float = 6.0
    recovery_by_kind: Mapping[str, float] = field(default_factory=dict)
    # Asynchronous replication: commits this many seconds before a failover_async may be
    # lost or repeated. None: no asynchronous failover was on offer.
    async_window: float | None = None
    # Work due within `grace` of the end (or of `stopping`) may not have happened yet.
    grace: float = 5.0
    # The replicas' start-up counts as a fault window of this length.
    startup: float = 10.0
    # When the harness began stopping the replicas (default: end).
    stopping: float | None = None
    # The documented window of a frozen leader resumed after its eviction: it stops its
    # work within this many seconds of SIGCONT (docs/leadership.md).
    frozen_window: float = 1.0
    # Work may look this much early (timestamps from two clocks of one host).
    early_tolerance: float = 0.05
    # A publication's effects are recorded inside its publish transaction; the commit, which
    # sends its NOTIFY, comes up to this many seconds later. A witness whose connection
    # broke that soon after an effect may have lost the notification with its session.
    commit_window: float = 0.5
    # Sharded leadership of the plugin loop: the shard count (1: one leader), and each
    # task's shard where the harness could ask the database (records carry theirs too).
    shards: int = 1
    task_shards: Mapping[str, int] = field(default_factory=dict)
    # The standing delay on every replica's link for the whole run: milliseconds added to
    # each round trip (0: a clean link, and every history older than the setting). The
    # harness adds what it measured (``link_rtt_ms``, at the start and the end) to extra.
    rtt_ms: float = 0.0
    sources: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_SOURCES))
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for source, policy in self.sources.items():
            _expect("meta source", source, SOURCES)
            _expect(f"meta policy of {source}", policy, POLICIES)

    def get(self, key: str, default: Any = None) -> Any:
        """A setting by name, known or extra (``meta.get("network_namespaces")``)."""
        if key in _field_names(Meta):
            return getattr(self, key)
        return self.extra.get(key, default)

    @property
    def horizon(self) -> float:
        """Work due before this must have happened."""
        last = self.end if self.stopping is None else min(self.end, self.stopping)
        return last - self.grace

    def recovery(self, kind: str) -> float:
        return self.recovery_by_kind.get(kind, self.recovery_allowance)


@dataclass(frozen=True, slots=True)
class Fault:
    TYPE: ClassVar[str] = "fault"

    kind: str
    target: str
    start: float
    end: float
    instance: str | None = None  # the incarnation hit, when the harness knows it
    id: int | None = None  # its place in the nemesis's plan
    during: int | None = None  # the id of the fault it was planned to start inside of
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _expect("fault kind", self.kind, FAULT_KINDS)

    @property
    def on_database(self) -> bool:
        return self.target == DATABASE

    def hits(self, instance: str | None) -> bool:
        """Whether `instance` is the process this fault hit."""
        if instance is None or self.on_database:
            return False
        if self.instance is not None:
            return instance == self.instance
        return instance == self.target or instance.startswith(self.target + ".")

    def describe(self) -> str:
        span = (
            clock(self.start)
            if self.end == self.start
            else f"{clock(self.start)} to {clock(self.end)}"
        )
        detail = "".join(f", {k} {v}" for k, v in self.extra.items())
        return f"{self.kind} of {self.instance or self.target} at {span}{detail}"


def overlapping_faults(faults: Iterable[Fault]) -> list[tuple[Fault, Fault, float]]:
    """Each pair of faults in effect at once, by their recorded windows (the one that
    began first, the other, and for how long both were), in the order they began."""
    ordered = sorted(faults, key=lambda f: (f.start, f.end))
    pairs: list[tuple[Fault, Fault, float]] = []
    for index, first in enumerate(ordered):
        for second in ordered[index + 1 :]:
            if second.start > first.end:
                break
            pairs.append((first, second, min(first.end, second.end) - second.start))
    return pairs


@dataclass(frozen=True, slots=True)
class Publication:
    TYPE: ClassVar[str] = "publication"

    id: int | None
    key: str
    via: str
    publish_at: float
    created: float
    acknowledged: bool = True  # the scheduling request's commit returned
    in_database: bool = True  # found in scheduler_publications at the end
    status: str | None = None  # its status there
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _expect("publication via", self.via, ("sql", "api"))

    def describe(self) -> str:
        return (
            f"publication {self.id} (key {self.key!r}, via {self.via}, "
            f"created {clock(self.created)}, due {clock(self.publish_at)})"
        )


@dataclass(frozen=True, slots=True)
class PublishEffect:
    TYPE: ClassVar[str] = "publish_effect"

    id: int  # the publication's id
    source: str
    instance: str | None  # None: the witness cannot tell (a notify message)
    token: int | None
    at: float
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _expect("publish_effect source", self.source, SOURCES)

    def describe(self) -> str:
        who = f" by {self.instance}" if self.instance else ""
        return (
            f"{self.source} of publication {self.id}{who} (token {self.token}) at {clock(self.at)}"
        )


@dataclass(frozen=True, slots=True)
class Run:
    TYPE: ClassVar[str] = "run"

    loop: str
    task: str | None
    slot: str | None
    kind: str
    source: str
    instance: str
    token: int | None
    start: float
    end: float | None  # None: not known
    outcome: str
    shard: int | None = None  # the shard its record names (sharded leadership)
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _expect("run loop", self.loop, LOOPS)
        _expect("run source", self.source, RUN_SOURCES)

    @property
    def slot_time(self) -> float | None:
        return parse_slot(self.slot)

    @property
    def did_work(self) -> bool:
        """A slot skipped because its previous run was still going was never run."""
        return self.outcome != "skipped_overlap"

    @property
    def work_end(self) -> float:
        """When its work is known to have ended. An ``abandoned`` row's end is when the
        *next* leader closed it, not when this run stopped: unknown, like no end."""
        if self.end is None or self.outcome == "abandoned":
            return self.start
        return max(self.end, self.start)

    def describe(self) -> str:
        what = self.task or self.kind
        slot = f" slot {clock(self.slot_time)}" if self.slot else ""
        end = clock(self.end) if self.end is not None and self.outcome != "abandoned" else "?"
        shard = f", shard {self.shard}" if self.shard is not None else ""
        return (
            f"{self.loop} {what}{slot} by {self.instance} ({self.kind}, {self.source} record, "
            f"token {self.token}{shard}) [{clock(self.start)}, {end}] {self.outcome}"
        )


@dataclass(frozen=True, slots=True)
class LeaderEvent:
    TYPE: ClassVar[str] = "leader"

    loop: str
    instance: str
    event: str
    at: float
    token: int | None = None
    shard: int | None = None  # a shard of the loop changed owner (None: the whole loop)
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _expect("leader loop", self.loop, LOOPS)
        _expect("leader event", self.event, LEADER_EVENTS)

    def describe(self) -> str:
        what = self.loop if self.shard is None else f"{self.loop} shard {self.shard}"
        return f"{self.instance} {self.event} {what} (token {self.token}) at {clock(self.at)}"


@dataclass(frozen=True, slots=True)
class ProcessExit:
    TYPE: ClassVar[str] = "exit"

    instance: str
    code: int | None
    at: float
    # What ended it: "SIGTERM" or "SIGKILL" from the harness (None: not recorded, as in
    # older histories); forced: a SIGTERM it did not answer within the harness's wait,
    # then SIGKILL; unbidden: it had exited before the harness asked anything of it.
    signal: str | None = None
    forced: bool = False
    unbidden: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        why = " unbidden" if self.unbidden else f" after {self.signal}" if self.signal else ""
        forced = ", killed after waiting for it" if self.forced else ""
        return f"{self.instance} exited ({self.code}){why}{forced} at {clock(self.at)}"


@dataclass(frozen=True, slots=True)
class ObserverGap:
    TYPE: ClassVar[str] = "observer_gap"

    source: str
    start: float
    end: float
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _expect("observer_gap source", self.source, SOURCES)

    def meets(self, start: float, end: float) -> bool:
        """Whether the witness was not watching at some moment from start to end."""
        return self.start <= end and start <= self.end

    def describe(self) -> str:
        return f"{self.source} not watching {clock(self.start)} to {clock(self.end)}"


Record = Fault | Publication | PublishEffect | Run | LeaderEvent | ProcessExit | ObserverGap


@dataclass(slots=True)
class History:
    meta: Meta
    faults: list[Fault] = field(default_factory=list)
    publications: list[Publication] = field(default_factory=list)
    publish_effects: list[PublishEffect] = field(default_factory=list)
    runs: list[Run] = field(default_factory=list)
    leaders: list[LeaderEvent] = field(default_factory=list)
    exits: list[ProcessExit] = field(default_factory=list)
    observer_gaps: list[ObserverGap] = field(default_factory=list)
    # None: never collected (the checker says so); []: collected, none held.
    final_locks: list[dict[str, Any]] | None = None

    def _lists(self) -> dict[str, list[Any]]:
        return {
            Fault.TYPE: self.faults,
            Publication.TYPE: self.publications,
            PublishEffect.TYPE: self.publish_effects,
            Run.TYPE: self.runs,
            LeaderEvent.TYPE: self.leaders,
            ProcessExit.TYPE: self.exits,
            ObserverGap.TYPE: self.observer_gaps,
        }

    @classmethod
    def load(cls, path: Path) -> History:
        meta: Meta | None = None
        entries: list[tuple[int, dict[str, Any]]] = []
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except ValueError as exc:
                raise HistoryError(f"{path}:{number}: not JSON ({exc})") from None
            if not isinstance(entry, dict) or "type" not in entry:
                raise HistoryError(f"{path}:{number}: not an object with a 'type'")
            if entry["type"] == Meta.TYPE:
                if meta is not None:
                    raise HistoryError(f"{path}:{number}: a second meta record")
                meta = _build(Meta, entry, f"{path}:{number}")
            else:
                entries.append((number, entry))
        if meta is None:
            raise HistoryError(f"{path}: no meta record")
        history = cls(meta)
        lists = history._lists()
        types = {
            t.TYPE: t
            for t in (Fault, Publication, PublishEffect, Run, LeaderEvent, ProcessExit, ObserverGap)
        }
        for number, entry in entries:
            kind = entry["type"]
            where = f"{path}:{number}"
            if kind == "final_locks":
                locks = entry.get("locks")
                if not isinstance(locks, list):
                    raise HistoryError(f"{where}: final_locks without a list of locks")
                history.final_locks = [*(history.final_locks or []), *locks]
            elif kind in types:
                lists[kind].append(_build(types[kind], entry, where))
            else:
                raise HistoryError(f"{where}: unknown record type {kind!r}")
        return history

    def dump(self, path: Path) -> None:
        with path.open("w") as out:
            out.write(_line(self.meta))
            for records in self._lists().values():
                for record in records:
                    out.write(_line(record))
            if self.final_locks is not None:
                out.write(json.dumps({"type": "final_locks", "locks": self.final_locks}) + "\n")

    def add_effects(
        self,
        runs: Iterable[EffectRun],
        skews: Mapping[str, float] | None = None,
        publication_id: Callable[[str], int] | None = None,
    ) -> None:
        """Add the probe's records outside the database (``rig.effects.read_effects``): a
        run per record, and a publish effect per publication a publisher batch carried.
        `skews` puts a skewed instance's times back on the real clock. `publication_id`
        names a publication by its key instead of the database id the batch carried (an
        asynchronous failover rewinds the id sequence; keys are never reused)."""
        for effect in runs:
            skew = (skews or {}).get(effect.instance, 0.0)
            start, end = effect.start - skew, effect.end - skew
            self.runs.append(
                Run(
                    loop=effect.loop,
                    task=effect.extra.get("task"),
                    slot=effect.extra.get("slot"),
                    kind=effect.kind,
                    source="external",
                    instance=effect.instance,
                    token=effect.token,
                    start=start,
                    end=end,
                    outcome=effect.outcome,
                    shard=effect.extra.get("shard"),
                    extra={"run": effect.run, "pid": effect.pid},
                )
            )
            if publication_id is not None:
                idents = [publication_id(key) for key in effect.extra.get("keys", ())]
            else:
                idents = list(effect.extra.get("ids", ()))
            for ident in idents:
                self.publish_effects.append(
                    PublishEffect(ident, "external", effect.instance, effect.token, start)
                )


def _field_names(cls: type[Any]) -> frozenset[str]:
    return frozenset(f.name for f in fields(cls))


def _build(cls: type[Any], entry: Mapping[str, Any], where: str) -> Any:
    names = _field_names(cls)
    known = {k: v for k, v in entry.items() if k in names and k != "type"}
    rest = {k: v for k, v in entry.items() if k not in names and k != "type"}
    if rest:
        known["extra"] = {**known.get("extra", {}), **rest}
    for name in ("start", "end", "at", "publish_at", "created"):
        value = known.get(name)
        if isinstance(value, int | float) and not math.isfinite(value):
            raise HistoryError(f"{where}: {cls.TYPE} {name} is {value}")
    try:
        return cls(**known)
    except (TypeError, ValueError) as exc:
        raise HistoryError(f"{where}: not a {cls.TYPE} record: {exc}") from None


def _line(record: Any) -> str:
    body: dict[str, Any] = {"type": record.TYPE}
    for f in fields(record):
        value = getattr(record, f.name)
        if f.name == "extra":
            body.update(value)
        else:
            body[f.name] = dict(value) if isinstance(value, Mapping) else value
    return json.dumps(body) + "\n"


def _expect(what: str, value: object, allowed: Iterable[str]) -> None:
    options = sorted(allowed)
    if value not in options:
        raise ValueError(f"{what} {value!r} is not one of {', '.join(options)}")
