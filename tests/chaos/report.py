"""A chaos run's report: ``report.md`` for people, ``report.json`` (the same numbers) for
tools and later comparison, ``timeline.png`` for the shape of the run.

Failover time, per fault kind, is fault start to the next work by *another* instance in
each loop the faulted replica was leading then (its restarted self is another instance:
a new process). A fault of PostgreSQL itself fails no replica, so for those it is the time
to the next work by any instance once one was granted the lock again (every session ended
with the fault). A fault whose loop saw no work by another instance
within its window (fault end + recovery allowance) *kept* its leader: a short SIGSTOP, a
bad link, a standby's fault. Where the replicas logged ``leader.acquired``, the takeover
(fault start to the next acquisition by another instance) is reported beside it: the
publish loop's next work also waits for the next publication due.

With sharded leadership the unit of leadership is the shard: a fault's failover is
counted per shard the faulted instance owned then (its ``shard.acquired`` lines), to the
next work in that shard by another instance (and the takeover to that shard's next
``shard.acquired`` by another instance); the timeline draws a row per shard.

Membership faults: a *scale_down* is measured as any fault of the replica it stops (its
loops or shards, handed over on its graceful leave). A *scale_up*'s time is its *join*:
fault start to the first work by the instance it started (takeover: to its first
acquisition of a loop or a shard); *kept* when the new member did no work within the
fault's window (unsharded, a joining replica is a standby: that is the normal case).

Faults in effect at once are listed as pairs, by their recorded windows (which kinds, how
long together, whether the nemesis planned them as a pair), and drawn in red on the
timeline's row of faults, in two lanes.
"""

from __future__ import annotations

import json
import re
from bisect import bisect_left
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos.checker import CheckResult, Stats, Violation, merge_spans, scope_of, task_shards
from chaos.history import LOOPS, Fault, History, LeaderEvent, clock, overlapping_faults

# Work by one instance with gaps shorter than this is drawn as one stretch of leadership.
JOIN_GAP = 2.0


@dataclass(slots=True)
class FailoverTimes:
    failover: list[float] = field(default_factory=list)  # seconds, one per (fault, loop)
    takeover: list[float] = field(default_factory=list)
    kept: int = 0
    not_leading: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "failover": Stats.of(self.failover).as_dict(),
            "takeover": Stats.of(self.takeover).as_dict(),
            "kept": self.kept,
            "not_leading": self.not_leading,
        }


def write_report(history: History, result: CheckResult, directory: Path) -> dict[str, Path]:
    """Write the three files into `directory`; return their paths by name."""
    directory.mkdir(parents=True, exist_ok=True)
    numbers = summarize(history, result)
    paths = {
        "json": directory / "report.json",
        "markdown": directory / "report.md",
        "timeline": directory / "timeline.png",
    }
    paths["json"].write_text(json.dumps(numbers, indent=2, sort_keys=True) + "\n")
    paths["markdown"].write_text(markdown(numbers, result))
    draw_timeline(history, result, paths["timeline"])
    return paths


def summarize(history: History, result: CheckResult) -> dict[str, Any]:
    meta = history.meta
    pubs = result.publications
    return {
        "run": {
            "seed": meta.seed,
            "duration": meta.duration,
            "replicas": meta.replicas,
            "shards": meta.shards,
            "network_namespaces": meta.get("network_namespaces"),
            "rtt_ms": meta.rtt_ms,
            "link_rtt_ms": meta.get("link_rtt_ms") or {},
            "start": meta.start,
            "end": meta.end,
            "instances": sorted({r.instance for r in history.runs}),
        },
        "faults": {
            "total": len(history.faults),
            "by_kind": dict(sorted(Counter(f.kind for f in history.faults).items())),
            "overlapping": _overlapping(history),
        },
        "failover": {kind: t.as_dict() for kind, t in sorted(failover_times(history).items())},
        "publications": {
            "scheduled": pubs.scheduled,
            "due": pubs.due,
            "published": pubs.published,
            "lost": pubs.lost,
            "duplicated": pubs.duplicated,
            "pending": pubs.pending,
            "allowed_lost": pubs.allowed_lost,
            "allowed_repeated": pubs.allowed_repeated,
            "by_source": {
                source: {
                    "effects": c.effects,
                    "publications": c.publications,
                    "repeated": c.repeated,
                    "missing": c.missing,
                }
                for source, c in pubs.by_source.items()
            },
        },
        "runs": _runs(history),
        "lateness": {
            loop: {side: stats.as_dict() for side, stats in sides.items()}
            for loop, sides in result.lateness.items()
        },
        "violations": _listing(result.violations),
        "allowed": _listing(result.allowed),
        "final_locks": None if history.final_locks is None else len(history.final_locks),
        "notes": list(result.notes),
    }


def _overlapping(history: History) -> dict[str, Any]:
    """The pairs of faults in effect at once, by their windows: how many, of which kinds
    (in the order they began), for how long together, and each one."""
    pairs = overlapping_faults(history.faults)
    by_pair: dict[str, list[float]] = defaultdict(list)
    for first, second, together in pairs:
        by_pair[f"{first.kind} + {second.kind}"].append(together)
    return {
        "count": len(pairs),
        "planned": sum(1 for f in history.faults if f.during is not None),
        "by_pair": {
            pair: {"count": len(times), "together": Stats.of(times).as_dict()}
            for pair, times in sorted(by_pair.items())
        },
        "items": [
            {
                "first": first.describe(),
                "second": second.describe(),
                "together": round(together, 3),
                "planned": second.during is not None and second.during == first.id,
            }
            for first, second, together in pairs
        ],
    }


def _runs(history: History) -> dict[str, Any]:
    records = Counter(r.source for r in history.runs)
    by_kind: Counter[str] = Counter()
    by_task: Counter[str] = Counter()
    # One run seen by two kinds of record (the daemon's row, the probe's own) counts once,
    # by the kind of work the probe saw ("record": the daemon's row alone says nothing).
    units: dict[tuple[Any, ...], set[str]] = defaultdict(set)
    for index, run in enumerate(history.runs):
        if run.did_work:
            key = (run.loop, run.task, run.slot_time, run.instance) if run.slot else (index,)
            if key not in units:
                by_task[f"{run.loop}/{run.task or run.kind}"] += 1
            units[key].add(run.kind)
    for kinds in units.values():
        by_kind[min(kinds - {"record"}, default="record")] += 1
    return {
        "records": dict(sorted(records.items())),
        "by_kind": dict(sorted(by_kind.items())),
        "by_task": dict(sorted(by_task.items())),
        "by_outcome": dict(sorted(Counter(r.outcome for r in history.runs).items())),
    }


def _listing(items: Sequence[Violation]) -> dict[str, Any]:
    return {
        "count": len(items),
        "by_kind": dict(sorted(Counter(v.kind for v in items).items())),
        "items": [
            {"kind": v.kind, "loop": v.loop, "at": v.at, "explanation": v.explanation}
            for v in items
        ],
    }


# -- failover ----------------------------------------------------------------------------


def scopes(history: History) -> list[str]:
    """The units of leadership: the loops, or with sharded leadership the publish loop and
    each shard of the plugin loop that anyone owned or worked in (``plugin shard 3``)."""
    if history.meta.shards <= 1:
        return list(LOOPS)
    shards = task_shards(history)[0]
    found = {f"plugin shard {e.shard}" for e in history.leaders if e.shard is not None}
    found |= {scope_of(history, r, shards) for r in history.runs if r.loop == "plugin"}
    return ["publish", *sorted(found, key=_natural)]


def _in_scope(event: LeaderEvent, scope: str) -> bool:
    if event.shard is not None:
        return scope == f"{event.loop} shard {event.shard}"
    return scope == event.loop


def failover_times(history: History) -> dict[str, FailoverTimes]:
    work = _work(history)
    times: dict[str, FailoverTimes] = defaultdict(FailoverTimes)
    for fault in history.faults:
        entry = times[fault.kind]
        limit = fault.end + history.meta.recovery(fault.kind)
        if fault.kind == "scale_up":
            _join(history, work, fault, limit, entry)
            continue
        led = False
        for scope in scopes(history):
            if scope.startswith("plugin shard") and not work.get(scope):
                continue  # a shard with no tasks: nothing there to fail over
            before = None if fault.on_database else _leader_at(history, work, scope, fault.start)
            if not fault.on_database and not fault.hits(before):
                continue
            led = True
            taken = min(
                (
                    e.at
                    for e in history.leaders
                    if _in_scope(e, scope)
                    and e.event == "acquired"
                    and e.instance != before
                    and fault.start < e.at <= limit
                ),
                default=None,
            )
            if taken is not None:
                entry.takeover.append(taken - fault.start)
            # After a fault of PostgreSQL every session is gone: work that began before
            # anyone was granted the lock again was claimed before the fault.
            since = taken if fault.on_database and taken is not None else fault.start
            nxt = _next_work(work.get(scope, []), since, limit, other_than=before)
            if nxt is not None:
                entry.failover.append(nxt - fault.start)
            else:
                entry.kept += 1
        if not led:
            entry.not_leading += 1
    return dict(times)


def _join(
    history: History,
    work: dict[str, list[tuple[float, str]]],
    fault: Fault,
    limit: float,
    entry: FailoverTimes,
) -> None:
    """A scale_up: from its start to the new member's first acquisition and first work."""
    joined = fault.instance
    acquired = [
        e.at
        for e in history.leaders
        if e.instance == joined and e.event == "acquired" and fault.start <= e.at <= limit
    ]
    if acquired:
        entry.takeover.append(min(acquired) - fault.start)
    began = [
        t
        for items in work.values()
        for t, who in items[bisect_left(items, (fault.start, "")) :]
        if who == joined and t <= limit
    ]
    if began:
        entry.failover.append(min(began) - fault.start)
    else:
        entry.kept += 1


def _work(history: History) -> dict[str, list[tuple[float, str]]]:
    """When each piece of work began, by whom, per loop (per shard: see `scopes`), in time
    order."""
    shards = task_shards(history)[0]
    work: dict[str, list[tuple[float, str]]] = {scope: [] for scope in scopes(history)}
    for run in history.runs:
        if run.did_work:
            scope = scope_of(history, run, shards)
            work.setdefault(scope, []).append((run.start, run.instance))
    for effect in history.publish_effects:
        if effect.source != "notify" and effect.instance is not None:
            work["publish"].append((effect.at, effect.instance))
    for items in work.values():
        items.sort()
    return work


def _next_work(
    work: Sequence[tuple[float, str]], since: float, limit: float, other_than: str | None
) -> float | None:
    """When work by anyone but `other_than` first began in [since, limit]."""
    for began, who in work[bisect_left(work, (since, "")) :]:
        if began > limit:
            return None
        if who != other_than:
            return began
    return None


def _leader_at(
    history: History, work: dict[str, list[tuple[float, str]]], scope: str, at: float
) -> str | None:
    """Who led `scope` (a loop, or a shard) at `at`: by its log lines where there are any,
    else by its work."""
    events = sorted((e for e in history.leaders if _in_scope(e, scope)), key=lambda e: e.at)
    if events:
        leader = None
        for event in events:
            if event.at > at:
                break
            if event.event == "acquired":
                leader = event.instance
            elif event.instance == leader:
                leader = None
        return leader
    earlier = [who for t, who in work.get(scope, []) if t <= at]
    return earlier[-1] if earlier else None


# -- report.md ----------------------------------------------------------------------------


def markdown(numbers: dict[str, Any], result: CheckResult, limit: int = 100) -> str:
    run = numbers["run"]
    verdict = (
        f"**{numbers['violations']['count']} violation(s)**"
        if numbers["violations"]["count"]
        else "**no violations**"
    )
    out = [
        f"# Chaos run: seed {run['seed']}, {run['duration']:g} s, {run['replicas']} replicas",
        "",
        f"{clock(run['start'])} to {clock(run['end'])} UTC, {len(run['instances'])} "
        f"instances (processes) did work. Verdict: {verdict}; "
        f"{numbers['allowed']['count']} allowed by the documented limits.",
        "",
        *_links(run),
        "![timeline](timeline.png)",
        "",
        "## Faults",
        "",
        *_table(["kind", "count"], [[k, n] for k, n in numbers["faults"]["by_kind"].items()]),
        f"| total | {numbers['faults']['total']} |",
        "",
        *_overlaps(numbers["faults"]["overlapping"], limit),
        "",
        "## Failover",
        "",
        "Fault start to the next work by another instance in each loop (sharded: each "
        "shard) the faulted replica led (PostgreSQL faults: by any instance); *takeover* "
        "is to the next `leader.acquired` (`shard.acquired`) by another instance; *kept*: "
        "no other instance worked within the fault's window. A scale_up's is its join: "
        "to the new member's first work (takeover: its first acquisition); kept: it did "
        "no work in the window.",
        "",
        *_table(
            [
                "kind",
                "failovers",
                "p50 s",
                "p99 s",
                "max s",
                "takeover p50 s",
                "kept",
                "not leading",
            ],
            [
                [
                    kind,
                    t["failover"]["count"],
                    _s(t["failover"]["p50"]),
                    _s(t["failover"]["p99"]),
                    _s(t["failover"]["max"]),
                    _s(t["takeover"]["p50"]),
                    t["kept"],
                    t["not_leading"],
                ]
                for kind, t in numbers["failover"].items()
            ],
        ),
        "",
        "## Publications",
        "",
        *_publications(numbers["publications"]),
        "",
        "## Runs",
        "",
        *_table(["task", "runs"], [[k, n] for k, n in numbers["runs"]["by_task"].items()]),
        "",
        "By kind: "
        + _pairs(numbers["runs"]["by_kind"])
        + ". Records: "
        + _pairs(numbers["runs"]["records"])
        + ". Outcomes: "
        + _pairs(numbers["runs"]["by_outcome"])
        + ".",
        "",
        "## Lateness",
        "",
        "Work due to work begun; inside = the span touches a fault window (fault start to "
        "end + recovery allowance, or the start-up).",
        "",
        *_table(
            [
                "loop",
                "inside: n",
                "p50 s",
                "p99 s",
                "max s",
                "outside: n",
                "p50 s",
                "p99 s",
                "max s",
            ],
            [
                [loop, *_stats(sides["inside"]), *_stats(sides["outside"])]
                for loop, sides in numbers["lateness"].items()
            ],
        ),
        "",
        "## Violations",
        "",
        *_items(result.violations, limit),
        "",
        "## Allowed",
        "",
        *_items(result.allowed, limit),
        "",
        f"Advisory locks left after every replica stopped: {numbers['final_locks']}.",
    ]
    out += ["", "## Notes", "", *(f"- {n}" for n in numbers["notes"])] if numbers["notes"] else []
    return "\n".join(out) + "\n"


def _links(run: dict[str, Any]) -> list[str]:
    """The replicas' links: a standing delay or none (or loopback), and what was measured."""
    if run["network_namespaces"] is False:
        return ["Links: loopback (no network namespaces here): no partitions, no bad links, "
                "no standing delay.", ""]  # fmt: skip
    if run["network_namespaces"] is None and not run["rtt_ms"]:
        return []  # a history that does not say
    if run["rtt_ms"]:
        text = (
            f"Links: {run['rtt_ms']:g} ms RTT standing on every replica's link, the whole run "
            f"({run['rtt_ms'] / 2:g} ms each way; a netem fault's delay adds to it)."
        )
    else:
        text = "Links: no standing delay."
    measured = [
        f"{min(values):.2f}-{max(values):.2f} ms at the {when}"
        for when, by_replica in run["link_rtt_ms"].items()
        if (values := [v for v in by_replica.values() if v is not None])
    ]
    if measured:
        text += " Round trip measured (TCP handshake): " + ", ".join(measured) + "."
    return [text, ""]


def _overlaps(o: dict[str, Any], limit: int) -> list[str]:
    lines = [
        "### Overlapping faults",
        "",
        f"{o['count']} pair(s) of faults in effect at once, by their recorded windows "
        f"({o['planned']} planned as a pair: the second started during the first).",
    ]
    if not o["count"]:
        return lines
    rows = [
        [pair, p["count"], _s(p["together"]["p50"]), _s(p["together"]["max"])]
        for pair, p in o["by_pair"].items()
    ]
    lines += ["", *_table(["first + second", "pairs", "together p50 s", "max s"], rows), ""]
    lines += [
        f"- {item['first']}; {item['second']}: {item['together']:.3f} s together"
        + ("" if item["planned"] else " (not planned as a pair)")
        for item in o["items"][:limit]
    ]
    if len(o["items"]) > limit:
        lines.append(f"- … and {len(o['items']) - limit} more (report.json has them all)")
    return lines


def _publications(p: dict[str, Any]) -> list[str]:
    lines = [
        f"{p['scheduled']} scheduled, {p['due']} due before the horizon, {p['published']} "
        f"published, **{p['lost']} lost, {p['duplicated']} duplicated**, {p['pending']} "
        f"pending; allowed: {p['allowed_lost']} lost, {p['allowed_repeated']} repeated.",
        "",
    ]
    rows = [
        [source, c["effects"], c["publications"], c["repeated"], c["missing"]]
        for source, c in p["by_source"].items()
    ]
    return lines + _table(["witness", "sightings", "publications", "seen twice+", "missed"], rows)


def _items(items: Sequence[Violation], limit: int) -> list[str]:
    if not items:
        return ["None."]
    lines = [f"- **{v.kind}**: {v.explanation}" for v in items[:limit]]
    if len(items) > limit:
        lines.append(f"- … and {len(items) - limit} more (report.json has them all)")
    return lines


def _table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines


def _stats(stats: dict[str, Any]) -> list[str]:
    return [str(stats["count"]), _s(stats["p50"]), _s(stats["p99"]), _s(stats["max"])]


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _pairs(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {n}" for k, n in counts.items()) or "none"


# -- timeline.png -------------------------------------------------------------------------


def leader_spans(history: History) -> dict[str, list[tuple[str, float, float]]]:
    """Per loop (shard), (instance, start, end) of each leadership its log lines tell of:
    from ``acquired`` to its ``released``/``lost``, its process's exit, or the next
    acquisition."""
    exits = {e.instance: e.at for e in history.exits}
    spans: dict[str, list[tuple[str, float, float]]] = {scope: [] for scope in scopes(history)}
    for loop in spans:
        events = sorted((e for e in history.leaders if _in_scope(e, loop)), key=lambda e: e.at)
        for index, event in enumerate(events):
            if event.event != "acquired":
                continue
            end = min(exits.get(event.instance, history.meta.end), history.meta.end)
            for later in events[index + 1 :]:
                if later.event == "acquired" or later.instance == event.instance:
                    end = min(end, later.at)
                    break
            spans[loop].append((event.instance, event.at, max(end, event.at)))
    return spans


def work_spans(history: History) -> dict[str, list[tuple[str, float, float]]]:
    """Per loop (shard), (instance, start, end) of stretches of work by one instance."""
    shards = task_shards(history)[0]
    raw: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    for run in history.runs:
        if run.did_work:
            raw[(scope_of(history, run, shards), run.instance)].append((run.start, run.work_end))
    for effect in history.publish_effects:
        if effect.source != "notify" and effect.instance is not None:
            raw[("publish", effect.instance)].append((effect.at, effect.at))
    spans: dict[str, list[tuple[str, float, float]]] = {scope: [] for scope in scopes(history)}
    for (loop, instance), items in raw.items():
        joined = merge_spans((a, b + JOIN_GAP) for a, b in items)
        spans.setdefault(loop, []).extend((instance, a, b - JOIN_GAP) for a, b in joined)
    return spans


def draw_timeline(history: History, result: CheckResult, path: Path) -> None:
    # The object API, not pyplot: no global figure state, no display needed.
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    meta = history.meta
    t0 = meta.start
    rows = {scope: index for index, scope in enumerate(reversed(scopes(history)))}
    leaders, work = leader_spans(history), work_spans(history)
    named = {i for spans in (leaders, work) for s in spans.values() for i, _, _ in s}
    instances = sorted(named, key=_natural)
    palette = [colormaps["tab20"](n) for n in range(20)]
    colour = {name: palette[n % len(palette)] for n, name in enumerate(instances)}
    figure = Figure(figsize=(14, 4.2 + 0.25 * max(0, len(rows) - 2)), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for loop, y in rows.items():
        for name, start, end in leaders.get(loop, []):
            axes.broken_barh(
                [(start - t0, end - start)],
                (y - 0.38, 0.76),
                facecolors=colour[name],
                alpha=0.25,
                linewidth=0,
            )
        for name, start, end in work.get(loop, []):
            width = max(end - start, meta.duration / 1500)  # a moment stays visible
            axes.broken_barh(
                [(start - t0, width)], (y - 0.18, 0.36), facecolors=colour[name], linewidth=0
            )
    # Faults: shaded over the loops, and each a bar on a row of its own, in one of two
    # lanes, those in effect together with another in red (their labels too: above the
    # lane-0 fault's start on its left, the lane-1 fault's on its right).
    together = {id(f) for pair in overlapping_faults(history.faults) for f in pair[:2]}
    fault_row = len(rows)
    for fault, lane in fault_lanes(history.faults):
        _shade(axes, fault, t0, meta.duration, lane, id(fault) in together)
        start = fault.start - t0
        width = max(fault.end - fault.start, meta.duration / 400)
        axes.broken_barh(
            [(start, width)],
            (fault_row - 0.4 + 0.42 * lane, 0.36),
            facecolors="firebrick" if id(fault) in together else "dimgrey",
            linewidth=0,
        )
    for items, marker, tint in (
        (result.allowed, "+", "darkorange"),
        (result.violations, "x", "red"),
    ):
        points = [(v.at - t0, _row(rows, v)) for v in items if v.at is not None]
        if points:
            xs, ys = zip(*points, strict=True)
            axes.scatter(xs, ys, marker=marker, color=tint, s=70, zorder=5, linewidths=2)
    axes.set_yticks([*rows.values(), fault_row], [*rows, "faults"])
    axes.set_ylim(-0.6, fault_row + 1.6)  # room above the rows for the fault labels
    axes.set_xlim(0, max(meta.end - t0, 1.0))
    axes.set_xlabel(f"seconds since {clock(t0)} UTC")
    axes.set_title(
        f"seed {meta.seed}: {len(history.faults)} faults "
        f"({len(overlapping_faults(history.faults))} overlapping pairs), "
        f"{len(result.violations)} violations, {len(result.allowed)} allowed"
    )
    handles: list[Any] = [Patch(color=colour[name], label=name) for name in instances[:30]]
    handles += [
        Patch(color="grey", alpha=0.25, label="fault"),
        Patch(color="firebrick", label="overlapping faults"),
        Line2D([], [], marker="x", color="red", linestyle="", label="violation"),
        Line2D([], [], marker="+", color="darkorange", linestyle="", label="allowed"),
    ]
    axes.legend(
        handles=handles,
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=7,
        ncols=1 + len(handles) // 18,
    )
    figure.savefig(path, dpi=110)


def _row(rows: dict[str, int], violation: Violation) -> float:
    """A violation's row: its loop's, or (sharded) that of the first shard it names."""
    found = re.search(r"plugin shard \d+", violation.explanation)
    if found and found.group(0) in rows:
        return rows[found.group(0)]
    return rows.get(violation.loop or "", 0.5)


def _natural(name: str) -> list[Any]:
    """``r1.2`` before ``r1.10``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def fault_lanes(faults: Sequence[Fault]) -> list[tuple[Fault, int]]:
    """Each fault with its lane on the timeline: the first lane free at its start (two
    suffice while no more than two faults are in effect at once; a third would share)."""
    ends: list[float] = []
    placed: list[tuple[Fault, int]] = []
    for fault in sorted(faults, key=lambda f: (f.start, f.end)):
        lane = next((n for n, end in enumerate(ends) if end < fault.start), len(ends))
        if lane == len(ends):
            ends.append(fault.end)
        ends[lane] = fault.end
        placed.append((fault, min(lane, 1)))
    return placed


def _shade(
    axes: Any, fault: Fault, t0: float, duration: float, lane: int = 0, together: bool = False
) -> None:
    start = fault.start - t0
    end = max(fault.end - t0, start + duration / 400)  # an instant fault stays visible
    axes.axvspan(start, end, color="grey", alpha=0.25, linewidth=0)
    # x in data, y in axes fraction: the label hangs from the top, inside the picture.
    axes.text(
        start,
        0.98,
        fault.kind,
        rotation=90,
        fontsize=6,
        va="top",
        ha="right" if lane == 0 else "left",
        color="firebrick" if together else "black",
        transform=axes.get_xaxis_transform(),
    )
