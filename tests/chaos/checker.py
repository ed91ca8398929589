"""The chaos suite's checker: what a run's history proves, and where it breaks a promise.

:func:`check` returns every violation with an explanation a person who did not write the
test can follow (ids, instances, tokens, times as ``HH:MM:SS.mmm`` UTC), never a bare
boolean. Violation kinds:

``duplicate_publication``  a witness that promises at most once saw a publication twice.
``lost_publication``       a publication due before the horizon that a witness never saw,
                           or an acknowledged one the database no longer holds.
``unknown_publication``    an effect of a publication the history never scheduled.
``duplicate_slot``         one plugin slot (task, slot) run twice, by one kind of record.
``overlap``                two instances doing one loop's work at times that intersect by
                           the one rule of ``rig.overlap`` (touching ends do not; with
                           sharded leadership, one *shard's* work: see below).
``token_regression``       a fencing token smaller than one already seen in that loop (in
                           that shard).
``token_reused``           one token in one loop (shard) held by two different instances.
``wrong_shard``            sharded: a run in another shard than its task's, or a Python
                           record of a run with no shard.
``lock_left``              an advisory lock held after every replica stopped.
``unclean_stop``           a replica that did not exit 0 on SIGTERM (or had to be killed
                           after the harness's wait), or that exited unbidden.
``early``                  work before it was due (due-ness must follow the database clock).
``late``                   lateness outside fault windows above ``meta.lateness_bound``.
``incomplete_history``     a history that cannot prove anything it is asked to.

What the documented limits allow is reported in ``allowed``, with its own explanation,
rather than dropped: effects and claims within ``meta.async_window`` s before an
asynchronous-replication failover may be lost or repeated, and so may tokens; an
at-least-once witness may see a publication again; a frozen leader resumed after its
eviction works on for up to ``meta.frozen_window`` s; a witness that was not watching
(an ``observer_gap``) may miss what happened meanwhile.

A run is one unit of work however many records saw it: the daemon's row and the probe's
own record of one slot by one instance are merged for the overlap check, and duplicates
are counted per kind of record, since across kinds they are the same run seen twice.
Lateness is measured from when work was due (a publication's ``publish_at``, a run's slot)
to when it began; slots never run between two runs, from the first of them to when the
misfire policy could have given them up (a period before the next slot run, at the
earliest); a task that stopped running, from its next slot to the horizon. Only the part of
that span outside every fault window (fault start to fault end + recovery allowance, and
the replicas' start-up) counts against the bound.

Sharded leadership (``meta.shards`` > 1): each schedule is in one shard, each shard has one
owner at a time, and different shards legitimately work at once on different replicas.
So the plugin loop's "one instance at a time" rule and its token stream are per shard: a
run's shard is the one its record names (``ctx.shard``), else its task's (from the
database, ``meta.task_shards``, or from the task's other records); a run whose shard
cannot be known is held to its schedule's own rule (one instance at a time per task).
Shard tokens come from the runs and the ``shard.acquired`` lines; the member-level
``leader.acquired`` of the plugin loop carries no token for work then and is left out.
"""

from __future__ import annotations

import math
import signal
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from rig.overlap import find_overlaps

from chaos.history import (
    RUN_SOURCES,
    Fault,
    History,
    LeaderEvent,
    Publication,
    PublishEffect,
    Record,
    Run,
    clock,
)


@dataclass(frozen=True, slots=True)
class Violation:
    kind: str
    explanation: str
    items: tuple[Record, ...] = ()
    at: float | None = None  # when it happened, for the timeline
    loop: str | None = None


@dataclass(frozen=True, slots=True)
class Stats:
    count: int
    p50: float | None
    p99: float | None
    max: float | None

    @classmethod
    def of(cls, values: Iterable[float]) -> Stats:
        ordered = sorted(values)
        if not ordered:
            return cls(0, None, None, None)
        return cls(len(ordered), percentile(ordered, 0.5), percentile(ordered, 0.99), ordered[-1])

    def as_dict(self) -> dict[str, Any]:
        return {"count": self.count, "p50": self.p50, "p99": self.p99, "max": self.max}


def percentile(ordered: Sequence[float], q: float) -> float:
    """Nearest rank: a value that occurred, never an interpolation between two."""
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


@dataclass(frozen=True, slots=True)
class SourceCounts:
    effects: int  # sightings
    publications: int  # distinct publications seen
    repeated: int  # publications seen more than once
    missing: int  # publications due that it never saw


@dataclass(frozen=True, slots=True)
class PublicationCounts:
    scheduled: int
    due: int
    published: int  # seen by at least one witness
    lost: int
    duplicated: int
    pending: int  # not due before the horizon, not published
    allowed_lost: int
    allowed_repeated: int
    by_source: Mapping[str, SourceCounts]


@dataclass(slots=True)
class CheckResult:
    violations: list[Violation]
    allowed: list[Violation]
    lateness: dict[str, dict[str, Stats]]  # loop -> "inside" / "outside" fault windows
    publications: PublicationCounts
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def kinds(self) -> list[str]:
        return sorted({v.kind for v in self.violations})

    def explain(self, limit: int = 50) -> str:
        lines = [f"{len(self.violations)} violation(s)"]
        lines += [f"- [{v.kind}] {v.explanation}" for v in self.violations[:limit]]
        if len(self.violations) > limit:
            lines.append(f"… and {len(self.violations) - limit} more")
        if self.allowed:
            counts: dict[str, int] = defaultdict(int)
            for item in self.allowed:
                counts[item.kind] += 1
            lines.append("allowed: " + ", ".join(f"{k} {n}" for k, n in sorted(counts.items())))
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)


def check(history: History) -> CheckResult:
    checker = _Checker(history)
    counts = checker.publications()
    checker.shards()
    checker.slots()
    checker.overlaps()
    checker.tokens()
    checker.locks()
    checker.stops()
    checker.plugin_lateness()
    checker.completeness()
    return CheckResult(
        violations=sorted(checker.violations, key=_order),
        allowed=sorted(checker.allowed, key=_order),
        lateness={
            loop: {where: Stats.of(values) for where, values in sides.items()}
            for loop, sides in checker.lateness.items()
        },
        publications=counts,
        notes=checker.notes,
    )


def _order(violation: Violation) -> tuple[float, str]:
    return (violation.at if violation.at is not None else math.inf, violation.kind)


# -- time spans ------------------------------------------------------------------------


def merge_spans(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def uncovered(start: float, end: float, merged: Sequence[tuple[float, float]]) -> float:
    """How much of [start, end] lies outside every span."""
    if end <= start:
        return 0.0
    covered = sum(max(0.0, min(end, b) - max(start, a)) for a, b in merged)
    return max(0.0, end - start - covered)


def touches(start: float, end: float, merged: Sequence[tuple[float, float]]) -> bool:
    return any(a <= end and b >= start for a, b in merged)


def fault_windows(history: History) -> list[tuple[float, float, str]]:
    """Each fault's window, and the start-up's: where lateness is the fault's doing."""
    meta = history.meta
    windows = [(meta.start, meta.start + meta.startup, "startup")]
    windows += [(f.start, f.end + meta.recovery(f.kind), f.kind) for f in history.faults]
    return windows


# -- the checks ------------------------------------------------------------------------


def task_shards(history: History) -> tuple[dict[str, int], list[tuple[str, set[int]]]]:
    """Each plugin task's shard (sharded leadership; {} otherwise), and the tasks whose
    records name more than one (with the database's, from ``meta.task_shards``): a
    schedule's shard is fixed by its name, so that is a bug."""
    if history.meta.shards <= 1:
        return {}, []
    named: dict[str, set[int]] = defaultdict(set)
    for task, shard in history.meta.task_shards.items():
        named[task].add(shard)
    for run in history.runs:
        if run.loop == "plugin" and run.task is not None and run.shard is not None:
            named[run.task].add(run.shard)
    shards = {task: next(iter(found)) for task, found in named.items() if len(found) == 1}
    # Where they disagree, the database's rule decides (the records are the suspects).
    shards |= {t: s for t, s in history.meta.task_shards.items() if len(named[t]) > 1}
    return shards, sorted((t, found) for t, found in named.items() if len(found) > 1)


def scope_of(history: History, record: Run, shards: Mapping[str, int]) -> str:
    """Where one instance at a time is the rule for this run: its loop; with sharded
    leadership, a plugin run's shard (``plugin shard 3``), or its task where its shard
    cannot be known (``plugin task x``)."""
    if record.loop != "plugin" or history.meta.shards <= 1:
        return record.loop
    shard = record.shard if record.shard is not None else shards.get(record.task or "")
    if shard is not None:
        return f"plugin shard {shard}"
    return f"plugin task {record.task or record.kind}"


@dataclass(slots=True)
class _Unit:
    """One piece of work by one instance, however many records saw it."""

    loop: str
    instance: str
    start: float
    end: float
    records: list[Run | PublishEffect]
    scope: str = ""  # where one instance at a time is the rule (see `scope_of`)

    def describe(self) -> str:
        """The work and each record of it, so that one can see which record shows what."""
        first = self.records[0]
        if isinstance(first, PublishEffect):
            return first.describe()
        what = first.task or first.kind
        slot = f" slot {clock(first.slot_time)}" if first.slot else ""
        seen = "; ".join(
            f"{r.source} record [{clock(r.start)}, {clock(r.work_end)}] {r.outcome}, "
            f"token {r.token}"
            for r in self.records
            if isinstance(r, Run)
        )
        return f"{self.loop} {what}{slot} by {self.instance} ({seen})"


class _Checker:
    def __init__(self, history: History) -> None:
        self.history = history
        self.meta = history.meta
        self.violations: list[Violation] = []
        self.allowed: list[Violation] = []
        self.notes: list[str] = []
        self.lateness: dict[str, dict[str, list[float]]] = {
            loop: {"inside": [], "outside": []} for loop in ("publish", "plugin")
        }
        self.windows = merge_spans((a, b) for a, b, _ in fault_windows(history))
        self.task_shards, self.shard_conflicts = task_shards(history)
        window = self.meta.async_window
        self.async_faults = [f for f in history.faults if f.kind == "failover_async"]
        if self.async_faults and window is None:
            self.notes.append(
                "failover_async faults but no meta.async_window: nothing they lose or "
                "repeat is allowed"
            )

    def flag(
        self,
        kind: str,
        text: str,
        items: Sequence[Record] = (),
        at: float | None = None,
        loop: str | None = None,
    ) -> None:
        self.violations.append(Violation(kind, text, tuple(items), at, loop))

    def allow(
        self,
        kind: str,
        text: str,
        items: Sequence[Record] = (),
        at: float | None = None,
        loop: str | None = None,
    ) -> None:
        self.allowed.append(Violation(kind, text, tuple(items), at, loop))

    def async_fault(self, at: float) -> Fault | None:
        """The asynchronous failover whose window holds `at`: [start - window, end]."""
        window = self.meta.async_window or 0.0
        for fault in self.async_faults:
            if fault.start - window <= at <= fault.end:
                return fault
        return None

    def async_repeat(self, times: Sequence[float]) -> Fault | None:
        """The failover that explains these sightings of one thing: each but the last in
        its window, each next one after it began (the first commit was lost with the old
        primary and the work done again)."""
        fault = None
        for earlier, later in pairwise(times):
            fault = self.async_fault(earlier)
            if fault is None or later < fault.start:
                return None
        return fault

    def _window_note(self, fault: Fault) -> str:
        return (
            f"within the async-replication window ({self.meta.async_window:g} s) of "
            f"{fault.describe()}"
        )

    def _late(self, loop: str, due: float, began: float) -> float:
        """Record a lateness; return the part of it outside every fault window."""
        side = "inside" if touches(due, began, self.windows) else "outside"
        self.lateness[loop][side].append(began - due)
        return uncovered(due, began, self.windows)

    # 1. publications: each once per witness, none lost ---------------------------------

    def publications(self) -> PublicationCounts:
        meta, history = self.meta, self.history
        by_id: dict[int, list[PublishEffect]] = defaultdict(list)
        for effect in history.publish_effects:
            by_id[effect.id].append(effect)
        known = {p.id for p in history.publications if p.id is not None}
        for ident in sorted(set(by_id) - known):
            seen = sorted(by_id[ident], key=lambda e: e.at)
            self.flag(
                "unknown_publication",
                f"publication {ident} was published but the history never scheduled it: "
                + "; ".join(e.describe() for e in seen),
                seen,
                seen[0].at,
                "publish",
            )
        tally = _Tally(tuple(meta.sources))
        for publication in history.publications:
            if publication.status == "cancelled":
                continue
            effects = sorted(
                by_id.get(publication.id, []) if publication.id is not None else [],
                key=lambda e: e.at,
            )
            due = publication.publish_at <= meta.horizon
            tally.count(publication, effects, due)
            self._early(publication, effects)
            self._repeats(publication, effects, tally)
            if due or (publication.acknowledged and not publication.in_database):
                self._losses(publication, effects, tally, due)
            if effects:
                work = [e for e in effects if e.source != "notify"] or effects
                first = min(work, key=lambda e: e.at)
                outside = self._late("publish", publication.publish_at, first.at)
                if outside > meta.lateness_bound:
                    self.flag(
                        "late",
                        f"{publication.describe()} was first published at "
                        f"{clock(first.at)} ({first.describe()}): "
                        f"{first.at - publication.publish_at:.3f} s late, {outside:.3f} s of "
                        f"it outside any fault window (bound {meta.lateness_bound:g} s)",
                        [publication, first],
                        first.at,
                        "publish",
                    )
        return tally.result()

    def _early(self, publication: Publication, effects: Sequence[PublishEffect]) -> None:
        for effect in effects:
            ahead = publication.publish_at - effect.at
            if ahead > self.meta.early_tolerance:
                self.flag(
                    "early",
                    f"{effect.describe()}: {ahead:.3f} s before {publication.describe()} was due",
                    [publication, effect],
                    effect.at,
                    "publish",
                )

    def _repeats(
        self, publication: Publication, effects: Sequence[PublishEffect], tally: _Tally
    ) -> None:
        for source, policy in self.meta.sources.items():
            seen = [e for e in effects if e.source == source]
            if len(seen) < 2:
                continue
            listing = "; ".join(e.describe() for e in seen)
            text = f"{publication.describe()} seen {len(seen)} times by {source}: {listing}"
            fault = self.async_repeat([e.at for e in seen])
            if fault is not None:
                self.allow(
                    "repeated_publication",
                    f"{text}, {self._window_note(fault)}",
                    [publication, *seen],
                    seen[1].at,
                    "publish",
                )
                tally.allowed_repeated.add(publication.key)
            elif policy == "at_least_once":
                self.allow(
                    "repeated_publication",
                    f"{text} ({source} is at least once)",
                    [publication, *seen],
                    seen[1].at,
                    "publish",
                )
                tally.allowed_repeated.add(publication.key)
            else:
                self.flag(
                    "duplicate_publication",
                    f"{text}: published twice",
                    [publication, *seen],
                    seen[1].at,
                    "publish",
                )
                tally.duplicated.add(publication.key)

    def _losses(
        self, publication: Publication, effects: Sequence[PublishEffect], tally: _Tally, due: bool
    ) -> None:
        seen = {e.source for e in effects}
        problems: list[str] = []
        if publication.acknowledged and not publication.in_database:
            problems.append("its scheduling was acknowledged but the database no longer holds it")
        elif due and publication.status not in (None, "published"):
            problems.append(f"its status at the end is {publication.status!r}")
        for source, policy in self.meta.sources.items():
            if not due or source in seen or policy == "at_most_once":
                continue
            gap = self._unwatched(source, publication, effects)
            if gap is not None:
                self.allow(
                    "unobserved_publication",
                    f"{publication.describe()} not seen by {source}, which was not "
                    f"watching then ({gap})",
                    [publication, *effects],
                    publication.publish_at,
                    "publish",
                )
                continue
            problems.append(f"{source} never saw it")
        if not problems:
            return
        others = "; ".join(e.describe() for e in effects) or "no witness saw it at all"
        text = f"{publication.describe()}: {', '.join(problems)} ({others})"
        fault = next(
            (
                f
                for at in [publication.created, *(e.at for e in effects)]
                if (f := self.async_fault(at)) is not None
            ),
            None,
        )
        if fault is not None:
            self.allow(
                "lost_publication",
                f"{text}, {self._window_note(fault)}",
                [publication, *effects],
                publication.publish_at,
                "publish",
            )
            tally.allowed_lost.add(publication.key)
        else:
            self.flag(
                "lost_publication", text, [publication, *effects], publication.publish_at, "publish"
            )
            tally.lost.add(publication.key)

    def _unwatched(
        self, source: str, publication: Publication, effects: Sequence[PublishEffect]
    ) -> str | None:
        # The last effect, not any: an attempt rolled back (its NOTIFY never sent) leaves
        # effects outside the database, and the republish that committed came after them.
        last = max((e.at for e in effects), default=publication.publish_at)
        lead = self.meta.commit_window
        for gap in self.history.observer_gaps:
            if gap.source == source and gap.meets(last, last + lead):
                return gap.describe()
        return None

    # 2. plugin slots: each run at most once ---------------------------------------------

    def slots(self) -> None:
        for (task, _), runs in _by_slot(self.history.runs).items():
            for source in RUN_SOURCES:
                recs = sorted(
                    (r for r in runs if r.source == source and r.did_work), key=lambda r: r.start
                )
                if len(recs) < 2:
                    continue
                text = (
                    f"task {task} slot {recs[0].slot} ran {len(recs)} "
                    f"times ({source} records): " + "; ".join(r.describe() for r in recs)
                )
                fault = self.async_repeat([r.start for r in recs])
                if fault is not None:
                    self.allow(
                        "repeated_slot",
                        f"{text}, {self._window_note(fault)}",
                        recs,
                        recs[1].start,
                        "plugin",
                    )
                else:
                    self.flag("duplicate_slot", text, recs, recs[1].start, "plugin")
            for run in runs:
                slot_time = run.slot_time
                if slot_time is not None and slot_time - run.start > self.meta.early_tolerance:
                    self.flag(
                        "early",
                        f"{run.describe()}: started {slot_time - run.start:.3f} s before its slot",
                        [run],
                        run.start,
                        "plugin",
                    )

    # 3. one instance at a time per loop (per shard) -------------------------------------

    def shards(self) -> None:
        """Sharded: every run in its task's one shard, and every Python record naming it."""
        if self.meta.shards <= 1:
            return
        for task, found in self.shard_conflicts:
            database = self.meta.task_shards.get(task)
            odd = sorted(
                (r for r in self.history.runs if r.task == task and r.shard is not None),
                key=lambda r: (r.shard == database, r.start),
            )
            self.flag(
                "wrong_shard",
                f"task {task} ran in shards {sorted(found)} (the database puts it in shard "
                f"{database}), but a schedule's shard is fixed by its name: "
                + "; ".join(r.describe() for r in odd[:3]),
                odd[:20],
                odd[0].start if odd else None,
                "plugin",
            )
        unsharded = [
            r
            for r in self.history.runs
            if r.loop == "plugin" and r.source == "external" and r.shard is None
        ]
        if unsharded:
            self.flag(
                "wrong_shard",
                f"{len(unsharded)} Python run record(s) of the plugin loop carry no shard "
                f"(ctx.shard) though it has {self.meta.shards} shards, e.g. "
                + "; ".join(r.describe() for r in unsharded[:3]),
                unsharded[:20],
                unsharded[0].start,
                "plugin",
            )

    def overlaps(self) -> None:
        """The one rule of ``rig.overlap``: per scope, no two instances' units intersect."""
        units = _units(self.history, self.task_shards)
        for found in find_overlaps(units, scope=lambda u: u.scope, holder=lambda u: u.instance):
            self._overlap(found.scope, found.earlier, found.later)

    def _overlap(self, scope: str, a: _Unit, b: _Unit) -> None:
        both = min(a.end, b.end) - max(a.start, b.start)
        loop = a.loop
        text = (
            f"{scope}: {a.describe()} and {b.describe()}: two instances doing {scope} work "
            f"at once for {max(both, 0.0):.3f} s"
        )
        items = [*a.records, *b.records]
        for fault in self.history.faults:
            if fault.kind != "sigstop":
                continue
            for frozen, other in ((a, b), (b, a)):
                resumed = frozen.end - fault.end
                if (
                    fault.hits(frozen.instance)
                    and frozen.start < fault.start
                    and other.start >= fault.start
                    and frozen.end <= fault.end + self.meta.frozen_window
                ):
                    self.allow(
                        "frozen_leader",
                        f"{text}; {frozen.instance} was frozen ({fault.describe()}) and "
                        f"stopped {max(resumed, 0.0):.3f} s after it resumed (documented "
                        f"window {self.meta.frozen_window:g} s)",
                        items,
                        b.start,
                        loop,
                    )
                    return
        self.flag("overlap", text, items, b.start, loop)

    # 4. fencing tokens never go backwards ----------------------------------------------

    def tokens(self) -> None:
        """Per loop, or sharded per (plugin, shard): never backwards, never one token for
        two instances."""
        streams: dict[tuple[str, str], list[tuple[float, int, Record]]] = defaultdict(list)
        sharded = self.meta.shards > 1
        for run in self.history.runs:
            if run.token is not None and run.did_work:
                scope = scope_of(self.history, run, self.task_shards)
                streams[(scope, "work")].append((run.start, run.token, run))
        for effect in self.history.publish_effects:
            if effect.token is not None:
                # A notify message's time is when the listener got it, after the commit:
                # comparable with other messages (delivered in commit order), not with work.
                stream = "notify" if effect.source == "notify" else "work"
                streams[("publish", stream)].append((effect.at, effect.token, effect))
        for event in self.history.leaders:
            if event.event != "acquired" or event.token is None:
                continue
            if event.shard is not None:
                streams[(f"{event.loop} shard {event.shard}", "work")].append(
                    (event.at, event.token, event)
                )
            elif not (sharded and event.loop == "plugin"):
                streams[(event.loop, "work")].append((event.at, event.token, event))
        for (loop, stream), items in streams.items():
            items.sort(key=lambda item: item[0])
            self._token_stream(loop, stream, items)

    def _token_stream(
        self, loop: str, stream: str, items: Sequence[tuple[float, int, Record]]
    ) -> None:
        """One violation per stale (instance, token) after one larger token, however many
        records it left, interleaved or not."""
        highest: tuple[float, int, Record] | None = None
        episodes: dict[tuple[Any, ...], tuple[tuple[float, int, Record], list[Record]]] = {}
        reused: dict[tuple[Any, ...], tuple[tuple[float, int, Record], list[Record]]] = {}
        for item in items:
            if highest is None or item[1] > highest[1]:
                highest = item
            elif item[1] < highest[1]:
                key = (_who(item[2]), id(highest[2]))
                episodes.setdefault(key, (highest, []))[1].append(item[2])
            elif _who(item[2])[0] not in (None, _who(highest[2])[0]):
                # The same token, another instance: a token never repeats for another owner.
                key = (_who(item[2]), id(highest[2]))
                reused.setdefault(key, (highest, []))[1].append(item[2])
        for larger, records in episodes.values():
            self._token_episode(loop, stream, larger, records)
        for first, records in reused.values():
            self._token_reused(loop, stream, first, records)

    def _token_reused(
        self, loop: str, stream: str, first: tuple[float, int, Record], episode: Sequence[Record]
    ) -> None:
        at, token, record = first
        shown = "; ".join(r.describe() for r in episode[:3])
        more = f" (and {len(episode) - 3} more)" if len(episode) > 3 else ""
        text = (
            f"{loop} ({stream} records): {shown}{more} came after {record.describe()} with the "
            f"same token {token}: one token held by two instances"
        )
        fault = self.async_fault(at)
        later = _time(episode[0])
        if fault is not None and later >= fault.start:
            self.allow("token_reused", f"{text}, {self._window_note(fault)}",
                       [record, *episode], later, _loop(loop))  # fmt: skip
        else:
            self.flag("token_reused", text, [record, *episode], later, _loop(loop))

    def _token_episode(
        self, loop: str, stream: str, highest: tuple[float, int, Record], episode: Sequence[Record]
    ) -> None:
        at, token, record = highest
        first = episode[0]
        shown = "; ".join(r.describe() for r in episode[:3])
        more = f" (and {len(episode) - 3} more)" if len(episode) > 3 else ""
        text = (
            f"{loop} ({stream} records): {shown}{more} came after {record.describe()}, "
            f"whose token {token} is larger: the fencing token went backwards"
        )
        fault = self.async_fault(at)
        first_at = _time(first)
        if fault is not None and first_at >= fault.start:
            self.allow(
                "token_regression",
                f"{text}, {self._window_note(fault)}",
                [record, *episode],
                first_at,
                _loop(loop),
            )
        else:
            self.flag("token_regression", text, [record, *episode], first_at, _loop(loop))

    # 5. nothing left behind --------------------------------------------------------------

    def stops(self) -> None:
        """Promise 7: a SIGTERM is a graceful stop, exit 0 (docs/operations.md's exit
        codes); a replica never exits by itself under faults it is meant to ride out."""
        expected = {"SIGTERM": 0, "SIGKILL": -signal.SIGKILL}
        for exit in self.history.exits:
            if exit.unbidden or exit.forced:
                clean = False
            elif exit.signal is None:  # an older history: the code alone
                clean = exit.code in expected.values()
            else:
                clean = exit.code == expected.get(exit.signal)
            if not clean:
                self.flag("unclean_stop", exit.describe(), [exit], exit.at)

    def locks(self) -> None:
        locks = self.history.final_locks
        if locks is None:
            self.flag(
                "incomplete_history",
                "the history has no final_locks record: whether a lock was left behind "
                "after every replica stopped was never looked at",
            )
            return
        for lock in locks:
            detail = ", ".join(f"{k} {v}" for k, v in lock.items())
            self.flag(
                "lock_left",
                f"an advisory lock still held after every replica stopped: {detail}",
                at=self.meta.end,
            )

    # 6. plugin lateness, skipped slots included -----------------------------------------

    def plugin_lateness(self) -> None:
        meta = self.meta
        slots: dict[str, dict[float, list[Run]]] = defaultdict(dict)
        for (task, slot_time), runs in _by_slot(self.history.runs).items():
            slots[task][slot_time] = runs
        for task in sorted(set(slots) | set(meta.expected_slots)):
            period = meta.expected_slots.get(task)
            previous: float | None = None
            for slot_time in sorted(slots.get(task, {})):
                first = min(slots[task][slot_time], key=lambda r: r.start)
                outside = self._late("plugin", slot_time, first.start)
                if outside > meta.lateness_bound:
                    self.flag(
                        "late",
                        f"task {task}: {first.describe()} began {first.start - slot_time:.3f} s "
                        f"after its slot, {outside:.3f} s of it outside any fault window "
                        f"(bound {meta.lateness_bound:g} s)",
                        [first],
                        first.start,
                        "plugin",
                    )
                if period and previous is not None and slot_time - previous > 1.5 * period:
                    self._skipped(task, period, previous, first)
                previous = slot_time
            if period:
                self._stalled(task, period, previous)

    def _skipped(self, task: str, period: float, previous: float, first: Run) -> None:
        """Slots between two runs were never run: the misfire policy gives up on slots
        only once a whole period has passed without a run, and the next slot it plans is
        the first after that moment, so it gave them up at one period before the next slot
        at the earliest. Lateness: from the first skipped slot to that moment."""
        slot_time = first.slot_time
        assert slot_time is not None
        due, given_up = previous + period, slot_time - period
        outside = uncovered(due, given_up, self.windows)
        if outside <= self.meta.lateness_bound:
            return
        missed = round((slot_time - previous) / period) - 1
        self.flag(
            "late",
            f"task {task}: {missed} slot(s) due from {clock(due)} on were never run; the next "
            f"run was {first.describe()}, so they were given up no earlier than "
            f"{clock(given_up)}, {outside:.3f} s outside any fault window "
            f"(bound {self.meta.lateness_bound:g} s)",
            [first],
            due,
            "plugin",
        )

    def _stalled(self, task: str, period: float, last: float | None) -> None:
        meta = self.meta
        due = last + period if last is not None else meta.start + period
        outside = uncovered(due, meta.horizon, self.windows)
        if outside <= meta.lateness_bound:
            return
        since = f"after its slot {clock(last)}" if last is not None else "at all"
        self.flag(
            "late",
            f"task {task} (every {period:g} s) never ran {since}: the slot due at "
            f"{clock(due)} had not begun by {clock(meta.horizon)}, {outside:.3f} s of it "
            f"outside any fault window (bound {meta.lateness_bound:g} s)",
            at=due,
            loop="plugin",
        )

    # data that proves nothing -----------------------------------------------------------

    def completeness(self) -> None:
        meta = self.meta
        if meta.end <= meta.start:
            self.flag(
                "incomplete_history",
                f"the run ends ({clock(meta.end)}) before it starts ({clock(meta.start)})",
            )
        if not self.history.publications and not self.history.runs:
            self.flag("incomplete_history", "no publications and no runs: nothing was checked")


class _Tally:
    def __init__(self, sources: Sequence[str]) -> None:
        self.sources = sources
        self.scheduled = self.due = self.published = self.pending = 0
        self.effects: dict[str, int] = defaultdict(int)
        self.seen: dict[str, int] = defaultdict(int)
        self.repeated: dict[str, int] = defaultdict(int)
        self.missing: dict[str, int] = defaultdict(int)
        self.lost: set[str] = set()
        self.duplicated: set[str] = set()
        self.allowed_lost: set[str] = set()
        self.allowed_repeated: set[str] = set()

    def count(self, publication: Publication, effects: Sequence[PublishEffect], due: bool) -> None:
        self.scheduled += 1
        self.due += due
        self.published += bool(effects)
        self.pending += not due and not effects
        for source in self.sources:
            mine = sum(e.source == source for e in effects)
            self.effects[source] += mine
            self.seen[source] += mine > 0
            self.repeated[source] += mine > 1
            self.missing[source] += due and not mine

    def result(self) -> PublicationCounts:
        return PublicationCounts(
            scheduled=self.scheduled,
            due=self.due,
            published=self.published,
            lost=len(self.lost),
            duplicated=len(self.duplicated),
            pending=self.pending,
            allowed_lost=len(self.allowed_lost),
            allowed_repeated=len(self.allowed_repeated),
            by_source={
                s: SourceCounts(self.effects[s], self.seen[s], self.repeated[s], self.missing[s])
                for s in self.sources
            },
        )


def _by_slot(runs: Iterable[Run]) -> dict[tuple[str, float], list[Run]]:
    """Plugin runs by (task, slot), the slot as an instant (two spellings, one key)."""
    grouped: dict[tuple[str, float], list[Run]] = defaultdict(list)
    for run in runs:
        slot_time = run.slot_time
        if run.loop == "plugin" and run.task is not None and slot_time is not None:
            grouped[(run.task, round(slot_time, 6))].append(run)
    return dict(grouped)


def _units(history: History, shards: Mapping[str, int]) -> list[_Unit]:
    """The units of work, each with its scope (see `scope_of`)."""
    merged: dict[tuple[Any, ...], _Unit] = {}
    for index, run in enumerate(history.runs):
        if not run.did_work:
            continue
        slot_time = run.slot_time
        key: tuple[Any, ...] = (
            (run.loop, run.task, slot_time, run.instance)
            if slot_time is not None
            else ("run", index)
        )
        unit = merged.get(key)
        if unit is None:
            scope = scope_of(history, run, shards)
            merged[key] = _Unit(run.loop, run.instance, run.start, run.work_end, [run], scope)
        else:
            unit.start, unit.end = min(unit.start, run.start), max(unit.end, run.work_end)
            unit.records.append(run)
    for index, effect in enumerate(history.publish_effects):
        # A notify message's time is its delivery, not when the work was done.
        if effect.source != "notify" and effect.instance is not None:
            merged[("effect", index)] = _Unit(
                "publish", effect.instance, effect.at, effect.at, [effect], "publish"
            )
    return list(merged.values())


def _loop(scope: str) -> str:
    """The loop of a scope (``plugin shard 3`` -> ``plugin``)."""
    return scope.split(" ", 1)[0]


def _who(record: Record) -> tuple[str | None, int | None]:
    if isinstance(record, Run | PublishEffect | LeaderEvent):
        return (record.instance, record.token)
    return (None, None)


def _time(record: Record) -> float:
    if isinstance(record, Run):
        return record.start
    if isinstance(record, PublishEffect | LeaderEvent):
        return record.at
    return record.start if isinstance(record, Fault) else math.nan
