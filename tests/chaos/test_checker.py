"""The chaos checker and report on crafted histories: pure, no processes, no database.

A clean history passes; each kind of broken promise, planted once, is reported as exactly
that violation with an explanation naming what broke; the documented limits (the
asynchronous-replication window, a frozen leader's resumption, at-least-once external
effects, a witness that was not watching) are reported as allowed instead. Generated
clean histories never fail, and one planted duplicate always does.
"""

from __future__ import annotations

import gzip
import json
import random
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rig.effects import read_effects
from scheduler_sample_plugin.effects import Recorder

from chaos.checker import CheckResult, check
from chaos.history import (
    FAULT_KINDS,
    LOOPS,
    Fault,
    History,
    HistoryError,
    LeaderEvent,
    Meta,
    ObserverGap,
    ProcessExit,
    Publication,
    PublishEffect,
    Run,
    clock,
)
from chaos.report import write_report

T0 = 1_700_000_000.0  # 22:13:20 UTC
HANDOVER = 29.5  # r1.1 is SIGKILLed; r2.1 takes both loops over 0.2 s later


def at(seconds: float) -> float:
    return T0 + seconds


def iso(seconds: float) -> str:
    return datetime.fromtimestamp(at(seconds), UTC).isoformat()


def leader(seconds: float) -> tuple[str, int]:
    return ("r1.1", 1) if seconds < HANDOVER else ("r2.1", 2)


def crafted(**meta: Any) -> History:
    """60 s, two replicas, one SIGKILL of the leader at 29.5 s. Plugin: task ``probe`` every
    second (slots 2..57 s), each run seen by the daemon's row and by the probe's own
    record. Publish: publications 1..20 due every 2.5 s from 3.25 s, each seen by all three
    witnesses; publication 21 is due after the horizon (55 s) and not published yet."""
    base = Meta(
        seed=7,
        duration=60,
        replicas=2,
        start=T0,
        end=at(60),
        expected_slots={"probe": 1.0},
        lateness_bound=2.0,
        recovery_allowance=3.0,
        grace=5.0,
        startup=4.5,
    )
    history = History(replace(base, **meta), final_locks=[])
    history.faults.append(Fault("sigkill", "r1", at(HANDOVER), at(HANDOVER)))
    history.exits.append(ProcessExit("r1.1", -9, at(HANDOVER), "SIGKILL"))
    for loop in LOOPS:
        history.leaders.append(LeaderEvent(loop, "r1.1", "acquired", at(0.5), 1))
        history.leaders.append(LeaderEvent(loop, "r2.1", "acquired", at(HANDOVER + 0.2), 2))
    for n in range(2, 58):
        who, token = leader(n)
        start = at(n + 0.02)
        history.runs.append(
            Run(
                "plugin",
                "probe",
                iso(n),
                "record",
                "db",
                who,
                None,
                start - 0.01,
                start + 0.3,
                "succeeded",
            )
        )
        history.runs.append(
            Run(
                "plugin",
                "probe",
                iso(n),
                "async",
                "external",
                who,
                token,
                start,
                start + 0.28,
                "end",
            )
        )
    for ident in range(1, 21):
        due = 3.25 + 2.5 * (ident - 1)
        who, token = leader(due)
        history.publications.append(
            Publication(
                ident, f"chaos-{ident}", "sql" if ident % 2 else "api", at(due), at(due - 2)
            )
        )
        history.runs.append(
            Run(
                "publish",
                None,
                None,
                "publisher",
                "external",
                who,
                token,
                at(due + 0.05),
                at(due + 0.07),
                "end",
            )
        )
        history.publish_effects += [
            PublishEffect(ident, "external", who, token, at(due + 0.05)),
            PublishEffect(ident, "audit", who, token, at(due + 0.08)),
            PublishEffect(ident, "notify", None, None, at(due + 0.1)),
        ]
    history.publications.append(Publication(21, "chaos-21", "api", at(58), at(50)))
    return history


def only(result: CheckResult, kind: str, *names: str) -> str:
    """The one violation, of `kind`, whose explanation names every one of `names`."""
    assert result.kinds() == [kind], result.explain()
    text = "\n".join(v.explanation for v in result.violations)
    for name in names:
        assert name in text, f"{name!r} not in {text!r}"
    return text


def swap_run(history: History, match: Callable[[Run], bool], **changes: Any) -> Run:
    index = next(i for i, run in enumerate(history.runs) if match(run))
    history.runs[index] = replace(history.runs[index], **changes)
    return history.runs[index]


def plugin_run(slot: int, source: str) -> Callable[[Run], bool]:
    return lambda run: run.loop == "plugin" and run.slot == iso(slot) and run.source == source


def effects_of(history: History, ident: int) -> list[PublishEffect]:
    return [e for e in history.publish_effects if e.id == ident]


# -- a clean history -------------------------------------------------------------------


def test_a_clean_history_passes_and_counts_what_it_saw() -> None:
    result = check(crafted())
    assert result.ok, result.explain()
    assert result.allowed == []
    counts = result.publications
    assert (counts.scheduled, counts.due, counts.published, counts.pending) == (21, 20, 20, 1)
    assert (counts.lost, counts.duplicated) == (0, 0)
    assert {s: c.effects for s, c in counts.by_source.items()} == {
        "audit": 20,
        "notify": 20,
        "external": 20,
    }
    assert result.lateness["plugin"]["outside"].count == 50
    assert result.lateness["publish"]["outside"].max == pytest.approx(0.05)


# -- each violation, planted once --------------------------------------------------------


def test_a_publication_published_twice() -> None:
    history = crafted()
    history.publish_effects.append(PublishEffect(3, "audit", "r1.1", 1, at(8.85)))
    only(
        check(history),
        "duplicate_publication",
        "publication 3",
        "audit",
        "r1.1",
        clock(at(8.85)),
        "chaos-3",
    )


def test_a_publication_never_published() -> None:
    history = crafted()
    history.publish_effects = [e for e in history.publish_effects if e.id != 5]
    text = only(check(history), "lost_publication", "publication 5", "chaos-5", clock(at(13.25)))
    assert "audit never saw it" in text
    assert "no witness saw it at all" in text


def test_an_acknowledged_publication_the_database_forgot_is_lost() -> None:
    history = crafted()
    history.publications[20] = replace(history.publications[20], in_database=False)
    only(check(history), "lost_publication", "publication 21", "no longer holds it")


def test_a_slot_run_twice() -> None:
    history = crafted()
    history.runs.append(
        Run("plugin", "probe", iso(10), "async", "external", "r1.1", 1, at(10.5), at(10.6), "end")
    )
    only(
        check(history),
        "duplicate_slot",
        f"task probe slot {iso(10)}",
        "ran 2 times",
        "external records",
        clock(at(10.5)),
    )


def test_two_instances_at_once_in_external_records() -> None:
    history = crafted()
    swap_run(history, plugin_run(29, "external"), end=at(30.1))
    text = only(check(history), "overlap", "r1.1", "r2.1", clock(at(30.1)), "plugin")
    assert "external record [22:13:49.020, 22:13:50.100]" in text


def test_two_instances_at_once_in_database_records() -> None:
    history = crafted()
    swap_run(history, plugin_run(29, "db"), end=at(30.1))
    text = only(check(history), "overlap", "r1.1", "r2.1", "plugin")
    assert "db record [22:13:49.010, 22:13:50.100] succeeded" in text


def test_a_fencing_token_going_backwards() -> None:
    history = crafted()
    swap_run(history, plugin_run(40, "external"), token=1)
    only(
        check(history), "token_regression", "r2.1", "token 1", "token 2 is larger", clock(at(40.02))
    )


def test_a_lock_left_after_every_replica_stopped() -> None:
    history = crafted()
    history.final_locks = [
        {"objid": 2073845566, "pid": 4242, "application_name": "scheduler-daemon/r2.1/lock:plugin"}
    ]
    only(check(history), "lock_left", "2073845566", "r2.1/lock:plugin")


def test_late_publication_outside_any_fault_window() -> None:
    history = crafted()
    history.publish_effects = [
        replace(e, at=e.at + 4) if e.id == 8 else e for e in history.publish_effects
    ]
    only(check(history), "late", "publication 8", "4.050 s late", "bound 2 s")


def test_late_run_outside_any_fault_window() -> None:
    history = crafted()
    for source in ("db", "external"):
        run = next(r for r in history.runs if plugin_run(15, source)(r))
        swap_run(history, plugin_run(15, source), start=run.start + 4, end=run.work_end + 4)
    only(check(history), "late", "task probe", "began 4.010 s after", clock(at(15)))


def test_skipped_slots_outside_any_fault_window_are_late() -> None:
    history = crafted()
    history.runs = [r for r in history.runs if r.slot not in {iso(n) for n in range(15, 20)}]
    only(
        check(history),
        "late",
        "task probe",
        "5 slot(s) due from 22:13:35.000 on were never run",
        "4.000 s outside",
    )


def test_a_task_that_stopped_running_is_late() -> None:
    history = crafted()
    history.runs = [r for r in history.runs if r.slot_time is None or r.slot_time < at(40)]
    only(check(history), "late", "task probe", "never ran after its slot 22:13:59.000")


def test_work_before_it_was_due() -> None:
    history = crafted()
    history.publish_effects = [
        replace(e, at=at(12.0)) if e.id == 5 and e.source == "audit" else e
        for e in history.publish_effects
    ]
    only(check(history), "early", "publication 5", "1.250 s before")


def test_a_publication_nobody_scheduled() -> None:
    history = crafted()
    history.publish_effects.append(PublishEffect(999, "audit", "r1.1", 1, at(9.5)))
    only(check(history), "unknown_publication", "publication 999")


def test_a_history_that_never_looked_for_locks_proves_nothing() -> None:
    history = crafted()
    history.final_locks = None
    only(check(history), "incomplete_history", "final_locks")


# -- the documented limits: allowed, reported, never silent --------------------------------


def _async_window(kind: str) -> History:
    """A primary failover at 8.6 s, window 1 s: [7.6 s, 9.0 s] holds publication 3's first
    commits (8.30 s, 8.33 s) and slot 8's run."""
    history = crafted(async_window=1.0)
    history.faults.append(Fault(kind, "postgres", at(8.6), at(9.0)))
    return history


@pytest.mark.parametrize(
    ("kind", "outcome"), [("failover_async", "allowed"), ("failover_sync", "violation")]
)
def test_a_repeat_inside_the_async_window_is_allowed(kind: str, outcome: str) -> None:
    history = _async_window(kind)
    history.publish_effects.append(PublishEffect(3, "audit", "r1.1", 1, at(9.4)))
    result = check(history)
    if outcome == "violation":
        only(result, "duplicate_publication", "publication 3")
        return
    assert result.ok, result.explain()
    assert [a.kind for a in result.allowed] == ["repeated_publication"]
    assert "async-replication window (1 s) of failover_async" in result.allowed[0].explanation
    assert result.publications.allowed_repeated == 1


def test_a_publication_lost_inside_the_async_window_is_allowed() -> None:
    history = _async_window("failover_async")
    history.publications[3] = replace(history.publications[3], created=at(8.0), in_database=False)
    history.publish_effects = [e for e in history.publish_effects if e.id != 4]
    result = check(history)
    assert result.ok, result.explain()
    assert [a.kind for a in result.allowed] == ["lost_publication"]
    assert "publication 4" in result.allowed[0].explanation
    assert result.publications.allowed_lost == 1
    assert result.publications.lost == 0


@pytest.mark.parametrize("kind", ["failover_async", "failover_sync"])
def test_a_token_regression_inside_the_async_window_is_allowed(kind: str) -> None:
    history = _async_window(kind)
    swap_run(history, plugin_run(8, "external"), token=3)  # handed out by the lost primary
    result = check(history)
    if kind == "failover_sync":
        only(result, "token_regression", "token 3 is larger")
        return
    assert result.ok, result.explain()
    assert {a.kind for a in result.allowed} == {"token_regression"}


def test_a_repeated_external_effect_is_at_least_once() -> None:
    history = crafted()
    history.publish_effects.append(PublishEffect(3, "external", "r1.1", 1, at(8.9)))
    result = check(history)
    assert result.ok, result.explain()
    assert [a.kind for a in result.allowed] == ["repeated_publication"]
    assert "external is at least once" in result.allowed[0].explanation


@pytest.mark.parametrize(("resumed_for", "allowed"), [(0.3, True), (1.5, False)])
def test_a_frozen_leader_may_work_on_only_within_the_documented_window(
    resumed_for: float, allowed: bool
) -> None:
    history = crafted()
    history.faults.append(Fault("sigstop", "r1", at(29.4), at(30.05)))
    swap_run(history, plugin_run(29, "external"), end=at(30.05 + resumed_for))
    result = check(history)
    if not allowed:
        assert result.kinds() == ["overlap"], result.explain()
        return
    assert result.ok, result.explain()
    [frozen] = result.allowed
    assert frozen.kind == "frozen_leader"
    assert "stopped 0.300 s after it resumed" in frozen.explanation


# Publication 4's last effect before its commit is at 10.83; its commit may follow within
# the commit window (0.5 s): a gap that starts by then may have lost its NOTIFY. One that
# covers only its first effect (10.80: an attempt that may have been rolled back) ended
# before the commit that counts, and excuses nothing.
@pytest.mark.parametrize(
    ("gap", "excused"),
    [((10.0, 11.5), True), ((11.2, 11.5), True), (None, False), ((11.4, 11.5), False),
     ((10.7, 10.81), False)],
    ids=["over", "at_commit", "none", "after", "earlier_effect_only"],
)  # fmt: skip
def test_a_witness_that_was_not_watching_misses_nothing(
    gap: tuple[float, float] | None, excused: bool
) -> None:
    history = crafted()
    history.publish_effects = [
        e for e in history.publish_effects if not (e.id == 4 and e.source == "notify")
    ]
    if gap is not None:
        history.observer_gaps.append(ObserverGap("notify", at(gap[0]), at(gap[1])))
    result = check(history)
    if not excused:
        only(result, "lost_publication", "publication 4", "notify never saw it")
        return
    assert result.ok, result.explain()
    assert [a.kind for a in result.allowed] == ["unobserved_publication"]


@pytest.mark.parametrize(
    ("signal", "code", "forced", "unbidden", "clean"),
    [
        ("SIGTERM", 0, False, False, True),
        ("SIGKILL", -9, False, False, True),
        ("SIGTERM", 1, False, False, False),  # a graceful stop that failed
        ("SIGTERM", -9, True, False, False),  # no exit within the harness's wait: killed
        ("SIGKILL", 70, False, False, False),  # it had died of a bug before the kill came
        (None, 70, False, True, False),  # exited unbidden (a bug, or gave up on the database)
        ("SIGTERM", 0, False, True, False),  # exited 0 unbidden: nobody asked it to stop
        (None, 0, False, False, True),  # a history from before signals were recorded
        (None, 70, False, False, False),  # ... judged by its code alone
    ],
)
def test_a_sigterm_ends_in_exit_0_and_no_replica_exits_unbidden(
    signal: str | None, code: int, forced: bool, unbidden: bool, clean: bool
) -> None:
    history = crafted()
    history.exits.append(ProcessExit("r2.1", code, at(59), signal, forced, unbidden))
    result = check(history)
    if clean:
        assert result.ok, result.explain()
        return
    only(result, "unclean_stop", f"r2.1 exited ({code})")


# -- generated histories ------------------------------------------------------------------

NAMES = ("r1.1", "r2.1", "r3.1", "r1.2", "r2.2")
QUIET_KINDS = sorted(FAULT_KINDS - {"failover_async"})


@st.composite
def clean_histories(draw: st.DrawFn) -> History:
    """Sequential leaders with growing tokens, each slot run once and each publication
    published once, on time; faults at some of the handovers. Hypothesis draws the shape
    (length, period, how often leadership moves and faults strike); a seeded generator
    lays out the details, since drawing each of hundreds of times is slow."""
    duration = draw(st.floats(20, 90))
    period = draw(st.sampled_from([0.5, 1.0, 2.0]))
    moves = draw(st.floats(0, 0.3))
    faults = draw(st.floats(0, 1))
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    meta = Meta(
        seed=rng.randrange(1000),
        duration=duration,
        replicas=3,
        start=T0,
        end=at(duration),
        expected_slots={"probe": period},
        lateness_bound=2.0,
        recovery_allowance=3.0,
        grace=5.0,
        startup=3.0,
    )
    history = History(meta, final_locks=[])
    token = 0

    def handover(loop: str, previous: str | None, when: float) -> tuple[str, int]:
        nonlocal token
        token += rng.randint(1, 3)
        who = rng.choice([n for n in NAMES if n != previous])
        history.leaders.append(LeaderEvent(loop, who, "acquired", when, token))
        if previous is not None and rng.random() < faults:
            kind = rng.choice(QUIET_KINDS)
            target = "postgres" if kind.startswith(("pg_", "failover")) else previous[:2]
            history.faults.append(Fault(kind, target, when - 0.05, when - 0.05))
        return who, token

    who: str | None = None
    slots = [1.0 + i * period for i in range(int((duration - 1) / period))]
    for slot in slots:
        if who is None or rng.random() < moves:
            who, mine = handover("plugin", who, at(slot - 0.2 * period))
        start = at(slot + rng.uniform(0, 0.1 * period))
        end = start + 0.3 * period
        history.runs.append(
            Run("plugin", "probe", iso(slot), "record", "db", who, None, start, end, "succeeded")
        )
        history.runs.append(
            Run("plugin", "probe", iso(slot), "sync", "external", who, mine, start, end, "end")
        )
    who, moment, ident = None, 1.0, 0
    while True:
        moment += rng.uniform(0.05, 2.0)
        if moment > duration - meta.grace:
            break
        if who is None or rng.random() < moves:
            who, mine = handover("publish", who, at(moment - 0.02))
        ident += 1
        due = moment - rng.uniform(0, 0.5)
        history.publications.append(Publication(ident, f"k{ident}", "sql", at(due), at(0)))
        history.runs.append(
            Run(
                "publish",
                None,
                None,
                "publisher",
                "external",
                who,
                mine,
                at(moment),
                at(moment + 0.02),
                "end",
            )
        )
        history.publish_effects += [
            PublishEffect(ident, "external", who, mine, at(moment)),
            PublishEffect(ident, "audit", who, mine, at(moment + 0.005)),
            PublishEffect(ident, "notify", None, None, at(moment + 0.01)),
        ]
    for extra in range(rng.randint(0, 3)):  # due after the horizon: not expected yet
        ident += 1
        history.publications.append(
            Publication(ident, f"k{ident}", "api", at(duration - 1 + extra / 10), at(0))
        )
    return history


@settings(max_examples=40, deadline=None)
@given(clean_histories())
def test_generated_clean_histories_never_violate(history: History) -> None:
    result = check(history)
    assert result.ok, result.explain()


@settings(max_examples=40, deadline=None)
@given(clean_histories(), st.data())
def test_one_planted_duplicate_always_violates(history: History, data: st.DataObject) -> None:
    witnessed = [e for e in history.publish_effects if e.source in ("audit", "notify")]
    kind = data.draw(st.sampled_from(["publication", "slot"] if witnessed else ["slot"]))
    later = data.draw(st.floats(0.001, 30.0))
    if kind == "publication":
        effect = data.draw(st.sampled_from(witnessed))
        instance = data.draw(st.sampled_from(NAMES)) if effect.source == "audit" else None
        history.publish_effects.append(replace(effect, instance=instance, at=effect.at + later))
        expected, name = "duplicate_publication", f"publication {effect.id} "
    else:
        run = data.draw(st.sampled_from([r for r in history.runs if r.loop == "plugin"]))
        instance = data.draw(st.sampled_from(NAMES))
        history.runs.append(
            replace(
                run, instance=instance, start=run.start + later, end=(run.end or run.start) + later
            )
        )
        expected, name = "duplicate_slot", f"task probe slot {run.slot} "
    result = check(history)
    assert expected in result.kinds(), result.explain()
    assert any(name in v.explanation for v in result.violations if v.kind == expected)


# -- the history file ------------------------------------------------------------------------


def test_a_history_survives_its_file(tmp_path: Path) -> None:
    history = crafted(async_window=0.5, extra={"network_namespaces": True})
    history.observer_gaps.append(ObserverGap("notify", at(1), at(2)))
    history.dump(tmp_path / "history.jsonl")
    again = History.load(tmp_path / "history.jsonl")
    assert again == history
    assert again.meta.get("network_namespaces") is True
    assert check(again) == check(history)


def test_the_harness_records_load_as_written(tmp_path: Path) -> None:
    """Flat meta with keys of the harness's own, fault details, exits, notify sightings
    without an instance: all kept, none refused."""
    lines = [
        {
            "type": "meta",
            "seed": 11,
            "duration": 45.0,
            "replicas": 3,
            "start": T0,
            "end": at(60),
            "lateness_bound": 2.0,
            "recovery_allowance": 6.0,
            "async_window": None,
            "expected_slots": {"probe": 1.0},
            "network_namespaces": True,
            "skews": {"r2.2": 120},
        },
        {
            "type": "fault",
            "kind": "netem",
            "target": "r2",
            "start": at(5),
            "end": at(8),
            "delay_ms": 120,
            "loss_pct": 5,
        },
        {
            "type": "publish_effect",
            "id": 1,
            "source": "notify",
            "instance": None,
            "token": None,
            "at": at(3),
        },
        {"type": "exit", "instance": "r2.1", "code": 0, "at": at(9), "signal": "SIGTERM"},
        {"type": "final_locks", "locks": []},
    ]
    path = tmp_path / "history.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    history = History.load(path)
    assert history.meta.get("skews") == {"r2.2": 120}
    assert history.meta.recovery("netem") == 6.0
    assert history.faults[0].extra == {"delay_ms": 120, "loss_pct": 5}
    assert history.faults[0].hits("r2.3")
    assert not history.faults[0].hits("r22.1")
    assert history.publish_effects[0].instance is None
    assert history.final_locks == []


@pytest.mark.parametrize(
    ("line", "error"),
    [
        (
            {"type": "fault", "kind": "sigkil", "target": "r1", "start": T0, "end": T0},
            "fault kind 'sigkil' is not one of",
        ),
        ({"type": "runs", "loop": "plugin"}, "unknown record type 'runs'"),
        ({"type": "run", "loop": "plugin"}, "not a run record"),
    ],
)
def test_a_history_file_that_is_not_one_is_refused(
    tmp_path: Path, line: dict[str, object], error: str
) -> None:
    path = tmp_path / "history.jsonl"
    meta = {"type": "meta", "seed": 1, "duration": 1, "replicas": 1, "start": T0, "end": T0}
    path.write_text(json.dumps(meta) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(HistoryError, match=error) as raised:
        History.load(path)
    assert "history.jsonl:2" in str(raised.value)


def test_the_probes_records_become_runs_and_effects(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sample plugin's own recorder writes them, rig.effects reads them, and a skewed
    instance's times are put back on the real clock."""
    monkeypatch.setenv("EFFECTS_LOG", str(tmp_path / "effects.jsonl"))
    run = Recorder("plugin", "async", "r2.2", 7, task="probe", slot=iso(3))
    batch = Recorder("publish", "publisher", "r2.2", 4, ids=[5, 6])
    for record in (run, batch):
        record.write("start")
        record.write("end")
    history = crafted()
    before = len(history.runs)
    history.add_effects(read_effects(tmp_path / "effects.jsonl"), {"r2.2": 120.0})
    plugin, publish = sorted(history.runs[before:], key=lambda r: r.loop)
    assert (plugin.task, plugin.slot, plugin.token, plugin.outcome) == ("probe", iso(3), 7, "end")
    assert publish.loop == "publish"
    assert publish.token == 4
    assert [(e.id, e.source, e.instance) for e in history.publish_effects[-2:]] == [
        (5, "external", "r2.2"),
        (6, "external", "r2.2"),
    ]
    assert abs(plugin.start + 120.0 - datetime.now(UTC).timestamp()) < 60


# -- the report --------------------------------------------------------------------------


def test_the_report_has_the_numbers_of_the_history(tmp_path: Path) -> None:
    history = crafted()
    history.publish_effects.append(PublishEffect(3, "audit", "r1.1", 1, at(8.85)))
    # A PostgreSQL restart at 40 s: every session ends; r2.1 is granted both locks again.
    history.faults.append(Fault("pg_restart_fast", "postgres", at(40.0), at(40.1)))
    history.leaders += [LeaderEvent(loop, "r2.1", "acquired", at(40.3)) for loop in LOOPS]
    result = check(history)
    paths = write_report(history, result, tmp_path / "report")
    assert paths["timeline"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert paths["timeline"].stat().st_size > 10_000
    numbers = json.loads(paths["json"].read_text())
    assert numbers["faults"] == {
        "total": 2,
        "by_kind": {"pg_restart_fast": 1, "sigkill": 1},
        "overlapping": {"count": 0, "planned": 0, "by_pair": {}, "items": []},
    }
    # The SIGKILLed r1.1 led both loops: r2.1 worked next in plugin at 30.01 s (its row of
    # slot 30), in publish at 30.80 s (publication 12); it logged leader.acquired at 29.7 s.
    assert numbers["failover"]["sigkill"] == {
        "failover": {"count": 2, "p50": pytest.approx(0.51), "p99": pytest.approx(1.30),
                     "max": pytest.approx(1.30)},
        "takeover": {"count": 2, "p50": pytest.approx(0.2), "p99": pytest.approx(0.2),
                     "max": pytest.approx(0.2)},
        "kept": 0,
        "not_leading": 0,
    }  # fmt: skip
    # After the restart, work once the lock was granted again (40.3 s): publication 16's
    # batch at 40.80 s, slot 41's row at 41.01 s.
    restart = numbers["failover"]["pg_restart_fast"]
    assert restart["failover"] == {"count": 2, "p50": pytest.approx(0.80), "p99": pytest.approx(1.01),
                                   "max": pytest.approx(1.01)}  # fmt: skip
    assert restart["takeover"]["max"] == pytest.approx(0.3)
    assert numbers["publications"] | {"by_source": None} == {
        "scheduled": 21,
        "due": 20,
        "published": 20,
        "lost": 0,
        "duplicated": 1,
        "pending": 1,
        "allowed_lost": 0,
        "allowed_repeated": 0,
        "by_source": None,
    }
    assert numbers["publications"]["by_source"]["audit"] == {
        "effects": 21,
        "publications": 20,
        "repeated": 1,
        "missing": 0,
    }
    assert numbers["runs"]["by_task"] == {"plugin/probe": 56, "publish/publisher": 20}
    assert numbers["runs"]["by_kind"] == {"async": 56, "publisher": 20}
    assert numbers["runs"]["records"] == {"db": 56, "external": 76}
    assert numbers["violations"]["by_kind"] == {"duplicate_publication": 1}
    # Inside a fault window: plugin slots 2-4 s (start-up), 30-32 s (the kill's window) and
    # 40-43 s (the restart's); publications due at 3.25 s, 30.75 s and 40.75 s.
    lateness = numbers["lateness"]
    assert [lateness["plugin"][side]["count"] for side in ("inside", "outside")] == [10, 46]
    assert [lateness["publish"][side]["count"] for side in ("inside", "outside")] == [3, 17]
    report = paths["markdown"].read_text()
    assert "duplicate_publication" in report
    assert "publication 3" in report
    assert "| sigkill | 2 | 0.510 | 1.300 | 1.300 | 0.200 | 0 | 0 |" in report


# -- sharded leadership: the rules are per shard ---------------------------------------------

SHARDS = {"a": 0, "b": 1, "c": 0}  # four shards; tasks a and c share shard 0
LEAVE = 29.5  # r1.1 leaves (scale_down); r2.1 takes shard 0 over 0.2 s later


def shard_owner(shard: int, seconds: float) -> tuple[str, int]:
    if shard == 1:
        return ("r2.1", 11)
    return ("r1.1", 10) if seconds < LEAVE else ("r2.1", 12)


def crafted_sharded(**meta: Any) -> History:
    """60 s, two replicas, four shards. Tasks a and c (shard 0) and b (shard 1) run every
    second, a and b at the same moments: shard 0 on r1.1 (token 10) until it leaves at
    29.5 s, then on r2.1 (token 12); shard 1 on r2.1 (token 11) throughout, so r1.1 and
    r2.1 work at once all the time in different shards. Each run is seen by the daemon's
    row (no shard) and the probe's record (its shard and that shard's token). The members'
    own plugin ``leader.acquired`` lines carry tokens that mean nothing for work (r2.1's
    is smaller than r1.1's)."""
    base = Meta(
        seed=9,
        duration=60,
        replicas=2,
        start=T0,
        end=at(60),
        expected_slots=dict.fromkeys(SHARDS, 1.0),
        lateness_bound=2.0,
        recovery_allowance=3.0,
        grace=5.0,
        startup=4.5,
        shards=4,
        task_shards=SHARDS,
    )
    history = History(replace(base, **meta), final_locks=[])
    history.faults.append(Fault("scale_down", "r1", at(LEAVE), at(45.0), "r1.1"))
    history.exits.append(ProcessExit("r1.1", 0, at(LEAVE + 0.1), "SIGTERM"))
    history.leaders += [
        LeaderEvent("plugin", "r1.1", "acquired", at(0.4), 5),
        LeaderEvent("plugin", "r2.1", "acquired", at(0.45), 3),
        LeaderEvent("plugin", "r1.1", "acquired", at(0.5), 10, shard=0),
        LeaderEvent("plugin", "r2.1", "acquired", at(0.6), 11, shard=1),
        LeaderEvent("plugin", "r1.1", "released", at(LEAVE + 0.05), None, shard=0),
        LeaderEvent("plugin", "r2.1", "acquired", at(LEAVE + 0.2), 12, shard=0),
    ]
    for n in range(2, 58):
        for task, offset in (("a", 0.02), ("b", 0.03), ("c", 0.4)):
            shard = SHARDS[task]
            who, token = shard_owner(shard, n + offset)
            start = at(n + offset)
            history.runs += [
                Run("plugin", task, iso(n), "record", "db", who, None, start - 0.01,
                    start + 0.3, "succeeded"),
                Run("plugin", task, iso(n), "async", "external", who, token, start,
                    start + 0.28, "end", shard=shard),
            ]  # fmt: skip
    return history


def sharded_run(task: str, slot: int, source: str) -> Callable[[Run], bool]:
    return lambda r: r.task == task and r.slot == iso(slot) and r.source == source


def test_a_clean_sharded_history_passes_with_shards_working_at_once() -> None:
    history = crafted_sharded()
    result = check(history)
    assert result.ok, result.explain()
    # The same work judged as one plugin leader: two instances at once all the time.
    unsharded = check(replace(history, meta=replace(history.meta, shards=1, task_shards={})))
    assert "overlap" in unsharded.kinds()


def test_two_instances_in_one_shard_at_once_is_an_overlap_even_across_tasks() -> None:
    """r2.1 runs task c's slot 20 (shard 0, at 20.4 s) while r1.1 owns shard 0, and r1.1's
    run of task a's slot 20 goes on until 20.5 s: two tasks, one shard, two instances."""
    history = crafted_sharded()
    swap_run(history, sharded_run("a", 20, "external"), end=at(20.5))
    swap_run(history, sharded_run("c", 20, "external"), instance="r2.1", token=None)
    swap_run(history, sharded_run("c", 20, "db"), instance="r2.1")
    text = only(check(history), "overlap", "plugin shard 0", "r1.1", "r2.1")
    assert "plugin a slot" in text
    assert "plugin c slot" in text


def test_a_schedule_whose_shard_is_unknown_is_held_to_its_own_runs() -> None:
    """Without the database's map and with no shard in any record, a task's runs by two
    instances at once are still an overlap (its schedule's), other tasks' are not."""
    history = crafted_sharded(task_shards={})
    history.runs = [replace(r, shard=None) if r.task == "b" else r for r in history.runs]
    result = check(history)
    assert "overlap" not in result.kinds(), result.explain()
    swap_run(history, sharded_run("b", 10, "external"), instance="r1.1", end=at(11.1))
    swap_run(history, sharded_run("b", 10, "db"), instance="r1.1")
    text = "\n".join(v.explanation for v in check(history).violations if v.kind == "overlap")
    assert "plugin task b" in text


def test_a_shard_token_going_backwards() -> None:
    history = crafted_sharded()
    swap_run(history, sharded_run("a", 40, "external"), token=11)
    only(check(history), "token_regression", "plugin shard 0", "token 11", "token 12 is larger")


def test_tokens_of_different_shards_are_not_compared() -> None:
    """Shard 1's token 11 comes after shard 0's 12 all through the run's second half, and
    the members' plugin leader lines go backwards: none of it is a regression."""
    result = check(crafted_sharded())
    assert "token_regression" not in result.kinds(), result.explain()


def test_a_shard_token_given_to_two_owners() -> None:
    history = crafted_sharded()
    history.leaders = [
        replace(e, token=10) if e.shard == 0 and e.instance == "r2.1" else e
        for e in history.leaders
    ]
    history.runs = [replace(r, token=10) if r.token == 12 else r for r in history.runs]
    only(check(history), "token_reused", "plugin shard 0", "same token 10", "r2.1")


def test_a_run_in_another_shard_than_its_task() -> None:
    history = crafted_sharded()
    swap_run(history, sharded_run("b", 12, "external"), shard=3)
    only(check(history), "wrong_shard", "task b", "shards [1, 3]", "shard 3")


def test_a_sharded_run_record_without_its_shard() -> None:
    history = crafted_sharded()
    swap_run(history, sharded_run("b", 12, "external"), shard=None)
    only(check(history), "wrong_shard", "1 Python run record", "carry no shard")


def test_the_report_counts_failover_per_shard_and_the_join_of_a_new_member(
    tmp_path: Path,
) -> None:
    history = crafted_sharded()
    # r3.1 joins at 50 s (scale_up): it takes shard 2 at 50.6 s and works there at 51 s.
    history.faults.append(Fault("scale_up", "r3", at(50.0), at(52.0), "r3.1"))
    history.leaders.append(LeaderEvent("plugin", "r3.1", "acquired", at(50.6), 13, shard=2))
    history.runs.append(
        Run("plugin", "d", iso(51), "async", "external", "r3.1", 13, at(51.0), at(51.2),
            "end", shard=2)
    )  # fmt: skip
    history = replace(history, meta=replace(history.meta, task_shards={**SHARDS, "d": 2}))
    result = check(history)
    paths = write_report(history, result, tmp_path / "report")
    numbers = json.loads(paths["json"].read_text())
    # r1.1 owned shard 0 (only) when it left at 29.5 s: r2.1 took it at 29.7 s and began
    # its first run there at 30.01 s (the daemon's row of a's slot 30).
    down = numbers["failover"]["scale_down"]
    assert down["failover"]["count"] == 1
    assert down["failover"]["max"] == pytest.approx(0.51)
    assert down["takeover"]["max"] == pytest.approx(0.2)
    up = numbers["failover"]["scale_up"]
    assert up["failover"]["max"] == pytest.approx(1.0)
    assert up["takeover"]["max"] == pytest.approx(0.6)
    assert numbers["run"]["shards"] == 4
    assert paths["timeline"].stat().st_size > 10_000


# -- the committed soaks ---------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]
SOAKS = sorted((ROOT / "bench" / "results" / "chaos").glob("*/history.jsonl.gz"))


@pytest.mark.parametrize("path", SOAKS, ids=[p.parent.name for p in SOAKS])
def test_the_committed_soaks_still_pass_the_checker(path: Path, tmp_path: Path) -> None:
    """docs/reliability.md reports them as 0 violations: a rule added or changed since
    must hold on them too (or the report be rerun)."""
    plain = tmp_path / "history.jsonl"
    plain.write_bytes(gzip.decompress(path.read_bytes()))
    result = check(History.load(plain))
    assert result.ok, result.explain()
