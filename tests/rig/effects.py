"""Reading back what work did outside the database, and proving no two replicas did it at
once (``scheduler_sample_plugin.effects`` writes the records).

A run's interval is [its first record, its last record]: a run killed outright leaves no
end, and its last beat (every 10 ms) says when it stopped. :func:`check_effects` fails,
with an explanation a person can read, on

- two *different* instances working for one loop (or one ``exclusive`` scope) at times
  that intersect by the one rule of ``rig.overlap`` (one leader running two runs at once
  is its own concurrency, not an overlap);
- a fencing token going backwards: a run that started after a run with a larger token
  (what an external system using the token would refuse);

and refuses data that proves nothing (too few runs, too few instances). ``allow`` names
the runs a test expects to break the rules — the documented frozen-leader window — so that
they are reported, measured and bounded by the test rather than silently ignored.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rig.overlap import find_overlaps
from rig.ticks import FAST_TIMINGS, assert_enough, stamp
from rig.waiting import wait_until

EFFECTS_TARGETS = {
    "async": "scheduler_sample_plugin.effects:probe_async",
    "async_checked": "scheduler_sample_plugin.effects:probe_async_checked",
    "async_stubborn": "scheduler_sample_plugin.effects:probe_async_stubborn",
    "sync": "scheduler_sample_plugin.effects:probe_sync",
    "sync_stubborn": "scheduler_sample_plugin.effects:probe_sync_stubborn",
}


@dataclass(frozen=True, slots=True)
class EffectRun:
    run: str
    loop: str
    kind: str
    instance: str
    token: int | None
    pid: int
    start: float
    end: float
    outcome: str  # "end", "cancelled", or "killed" (no final record)
    extra: Mapping[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        what = self.extra.get("task") or self.kind
        return (
            f"{self.instance} ({what}, token {self.token}, pid {self.pid}) "
            f"[{stamp(self.start)}, {stamp(self.end)}] {self.outcome}"
        )


@dataclass(frozen=True, slots=True)
class EffectsSummary:
    runs: dict[str, dict[str, int]]  # loop -> instance -> runs
    allowed: list[EffectRun]  # runs that broke a rule and were allowed to


def effects_env(log: Path, seconds: float = 0.3) -> dict[str, str]:
    return {"EFFECTS_LOG": str(log), "EFFECTS_SECONDS": f"{seconds:g}"}


def effects_replica_env(
    url: str,
    instance: str,
    log: Path,
    tasks: list[dict[str, str]],
    seconds: float = 0.3,
    timings: Mapping[str, str] = FAST_TIMINGS,
    **extra: str,
) -> dict[str, str]:
    """A replica of `url` named `instance`, with the suite's fast `timings`, whose plugin
    loop ticks every 0.1 s and runs `tasks` (the built-in purge off), their effects probes
    working `seconds` and writing to `log`; then `extra` on top."""
    return {
        "SCHEDULER_DATABASE_URL": url,
        "SCHEDULER_INSTANCE_ID": instance,
        **timings,
        "SCHEDULER_PLUGIN__INTERVAL": "0.1",
        "SCHEDULER_PLUGIN__TASKS": json.dumps(tasks),
        "SCHEDULER_PLUGIN__DISABLED": '["purge_publications", "purge_runs"]',
        **effects_env(log, seconds),
        **extra,
    }


def read_effects(log: Path) -> list[EffectRun]:
    try:
        # Whole lines only: read while replicas work, the last may be half appended.
        lines = log.read_text().split("\n")[:-1]
    except FileNotFoundError:
        return []
    records: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for line in lines:
        entry = json.loads(line)
        records[entry["run"]].append(entry)
    runs = []
    for run, entries in records.items():
        entries.sort(key=lambda e: e["t"])
        first, last = entries[0], entries[-1]
        outcome = last["event"] if last["event"] in ("end", "cancelled") else "killed"
        known = {"run", "loop", "kind", "instance", "token", "pid", "event", "t"}
        runs.append(
            EffectRun(
                run=run,
                loop=first["loop"],
                kind=first["kind"],
                instance=first["instance"],
                token=first["token"],
                pid=first["pid"],
                start=first["t"],
                end=last["t"],
                outcome=outcome,
                extra={k: v for k, v in first.items() if k not in known},
            )
        )
    runs.sort(key=lambda r: (r.start, r.end))
    return runs


def runs_of(log: Path, instance: str) -> list[EffectRun]:
    """`instance`'s runs, in start order."""
    return [run for run in read_effects(log) if run.instance == instance]


def in_progress(
    log: Path, instance: str, started: float = 0.1, young: float = float("inf")
) -> set[str]:
    """The kinds of `instance`'s runs going on right now: no final record yet, a beat
    (every 10 ms) within the last 0.1 s, begun at least `started` s and less than `young`
    s ago."""
    now = time.time()
    return {
        run.kind
        for run in runs_of(log, instance)
        if run.outcome == "killed" and started < now - run.start < young and now - run.end < 0.1
    }


def wait_mid_run(
    log: Path,
    instance: str,
    kinds: Collection[str] = (),
    timeout: float = 20.0,
    young: float = float("inf"),
) -> None:
    """Wait until `instance` is in the middle of a run of each of `kinds` (of some run,
    if none are named): a fault injected now lands inside work. A test that needs the
    fault to land well before a run's end (a run it expects killed, not ended) says how
    recently the runs must have begun: `young` s."""
    wanted = set(kinds)

    def going() -> bool:
        found = in_progress(log, instance, young=young)
        return bool(found) and wanted <= found

    what = f"{sorted(wanted)} runs" if wanted else "a run"
    # Every 50 ms: reading the records back is not free once there are thousands.
    wait_until(going, timeout, f"{instance} to be in the middle of {what}", every=0.05)


def per_schedule(run: EffectRun) -> str:
    """Sharded leadership's exclusion: per schedule (different schedules run at once on
    different replicas, by design)."""
    return f"{run.loop} schedule {run.extra.get('task')}"


def per_shard(run: EffectRun) -> str:
    """Sharded leadership's tokens: each shard has its own."""
    return f"{run.loop} shard {run.extra.get('shard')}"


def check_effects(
    runs: Iterable[EffectRun],
    *,
    min_runs: int,
    min_instances: int = 1,
    allow: Callable[[EffectRun], bool] = lambda run: False,
    exclusive: Callable[[EffectRun], str] = lambda run: run.loop,
    tokens: Callable[[EffectRun], str] = lambda run: run.loop,
) -> EffectsSummary:
    """``exclusive`` names the unit of work no two instances may do at once (a loop, or
    with shards a schedule: :func:`per_schedule`), ``tokens`` the stream in which fencing
    tokens only grow (:func:`per_shard`)."""
    runs = list(runs)
    by_loop: dict[str, list[EffectRun]] = defaultdict(list)
    for run in runs:
        by_loop[run.loop].append(run)
    assert by_loop, "no effect records at all: the probe never ran, so nothing was checked"
    allowed: list[EffectRun] = []
    summary: dict[str, dict[str, int]] = {}
    problems: list[tuple[str, tuple[EffectRun, ...]]] = [
        (
            f"{o.scope}: {o.earlier.describe()} and {o.later.describe()}: "
            f"{o.seconds:.3f}s of work by two instances at once",
            (o.earlier, o.later),
        )
        for o in find_overlaps(runs, scope=exclusive, holder=lambda run: run.instance)
    ]
    for name, items in _grouped(runs, tokens).items():
        problems += [(f"{name}: {text}", who) for text, who in _regressions(items)]
    unexcused = [message for message, who in problems if not any(map(allow, who))]
    assert not unexcused, "\n  ".join(["", *unexcused])
    for _, who in problems:
        allowed += [run for run in who if allow(run) and run not in allowed]
    for loop, items in by_loop.items():
        instances = [run.instance for run in items]
        summary[loop] = assert_enough(loop, instances, min_runs, min_instances, what="runs")
    return EffectsSummary(summary, allowed)


def _grouped(
    runs: Iterable[EffectRun], key: Callable[[EffectRun], str]
) -> dict[str, list[EffectRun]]:
    groups: dict[str, list[EffectRun]] = defaultdict(list)
    for run in runs:
        groups[key(run)].append(run)
    for items in groups.values():
        items.sort(key=lambda r: (r.start, r.end))
    return groups


def _regressions(items: list[EffectRun]) -> list[tuple[str, tuple[EffectRun, ...]]]:
    """In start order, a token never smaller than one already seen."""
    problems: list[tuple[str, tuple[EffectRun, ...]]] = []
    highest: EffectRun | None = None
    for current in items:
        if current.token is None:
            continue
        if highest is not None and current.token < (highest.token or 0):
            problems.append((
                f"{current.describe()} started after {highest.describe()}: "
                "its fencing token went backwards",
                (current,),
            ))  # fmt: skip
        if highest is None or current.token > (highest.token or 0):
            highest = current
    return problems
