"""The nemesis's plan of overlapping faults, where two faults may hit one replica, and how
overlapping windows reach the checker and the report: pure, no processes, no database.

The plan is episodes of one fault or of two that overlap (any two kinds but two of
PostgreSQL), each pair's inner fault inside its outer's hold, episodes one after another
with their recovery between; it is a function of the seed. Two faults on one replica
compose or move the second elsewhere, as :func:`chaos.nemesis.share_replica` says. The
history's windows are what the checker's allowances use, merged and never widened.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path

import pytest
from rig.netns import Impairment

from chaos.checker import check, fault_windows, merge_spans
from chaos.environment import on_top, standing_delay
from chaos.history import Fault, History, overlapping_faults
from chaos.nemesis import (
    ALL_KINDS,
    DATABASE_FAULTS,
    LINK_FAULTS,
    MEMBERSHIP_FAULTS,
    MIN_RUNNING,
    PROCESS_FAULTS,
    FaultKind,
    Intent,
    ReplicaState,
    _recovery,
    choose_replica,
    episodes,
    may_overlap,
    plan,
    planned_pairs,
    share_replica,
)
from chaos.report import fault_lanes, markdown, summarize, write_report
from chaos.test_chaos import (
    SHARDED_PAIRS,
    SHARDED_SEED,
    SLICE,
    SLICE_RTT_MS,
    SLICE_SECONDS,
    SOAK_PAIRS,
    slice_config,
)
from chaos.test_checker import at, crafted, plugin_run, swap_run

SOAK = 1800.0


def soak_plan(seed: int, **options: object) -> list[Intent]:
    return plan(seed, SOAK, ALL_KINDS, **options)  # type: ignore[arg-type]


# -- the plan ------------------------------------------------------------------------------


def test_the_plan_is_a_function_of_the_seed() -> None:
    assert soak_plan(7) == soak_plan(7)
    assert soak_plan(7) != soak_plan(8)


@pytest.mark.parametrize("seed", range(20))
def test_episodes_are_one_fault_or_two_that_overlap_one_after_another(seed: int) -> None:
    intents = soak_plan(seed, warmup=4.0, cooldown=8.0)
    assert [intent.id for intent in intents] == list(range(len(intents)))
    assert {intent.kind for intent in intents} <= set(ALL_KINDS)
    previous_end: float | None = None
    previous_recovery = 0.0
    for group in episodes(intents):
        outer = group[0]
        assert outer.during is None
        assert outer.offset == 0.0
        end = outer.at + outer.duration
        if len(group) == 2:
            inner = group[1]
            # Inside the outer's hold (a hold of nothing: at once, while it is healed).
            assert inner.during == outer.id
            assert may_overlap(outer.kind, inner.kind)
            if outer.duration:
                assert 0.1 * outer.duration - 0.01 <= inner.offset <= 0.9 * outer.duration + 0.01
            else:
                assert inner.offset == 0.0
            assert inner.at == pytest.approx(outer.at + inner.offset, abs=0.002)
            end = max(end, inner.at + inner.duration)
            if inner.target == "outer":
                assert outer.kind not in DATABASE_FAULTS
                assert share_replica(outer.kind, inner.kind)
        else:
            assert len(group) == 1
        # Never three at once: an episode starts after the last one and its recovery.
        if previous_end is not None:
            assert outer.at >= previous_end + previous_recovery - 0.002
        assert outer.at >= 4.0
        assert end <= SOAK - 8.0 + 0.002
        previous_end = end
        previous_recovery = max(_recovery(intent.kind) for intent in group)
    for intent in intents:
        assert (intent.target == "postgres") == (intent.kind in DATABASE_FAULTS)
        assert (intent.target == "spare") == (intent.kind == "scale_up")
        assert 0 <= intent.pick < 1
        assert (intent.skew_minutes != 0) == (intent.kind == "clock_skew")


def test_how_often_an_episode_is_a_pair() -> None:
    assert planned_pairs(soak_plan(3, overlap=0.0)) == []
    every = soak_plan(3, overlap=1.0)
    assert all(len(group) == 2 for group in episodes(every))
    pairs = sum(len(planned_pairs(soak_plan(seed))) for seed in range(20))
    groups = sum(len(episodes(soak_plan(seed))) for seed in range(20))
    assert 0.3 < pairs / groups < 0.5  # OVERLAP = 0.4
    # Faults of PostgreSQL alone have no partner they may overlap with.
    alone = plan(3, SOAK, sorted(DATABASE_FAULTS), overlap=1.0)  # type: ignore[arg-type]
    assert alone
    assert planned_pairs(alone) == []


def test_every_pair_of_kinds_but_two_faults_of_postgresql_is_drawn_in_either_order() -> None:
    drawn = {pair for seed in range(60) for pair in planned_pairs(soak_plan(seed))}
    possible = {(a, b) for a, b in itertools.product(ALL_KINDS, repeat=2) if may_overlap(a, b)}
    assert drawn == possible
    assert len(possible) == 12 * 12 - 16


def test_guaranteed_pairs_are_drawn_first_and_their_kinds_need_no_fault_alone() -> None:
    pairs: tuple[tuple[FaultKind, FaultKind], ...] = (
        ("partition", "sigkill"),
        ("sigkill", "netem"),
    )
    intents = plan(5, 60, ALL_KINDS, guaranteed=("partition", "failover_sync"),
                   guaranteed_pairs=pairs, overlap=0.0)  # fmt: skip
    groups = [tuple(i.kind for i in group) for group in episodes(intents)]
    assert sorted(groups[:3]) == sorted([*pairs, ("failover_sync",)])
    # A pair that may not overlap is not placed; neither is a kind not on offer.
    refused = plan(5, 60, ("sigkill", "pg_restart_fast", "failover_sync"),
                   guaranteed_pairs=(("pg_restart_fast", "failover_sync"), ("partition", "sigkill")),
                   overlap=0.0)  # fmt: skip
    assert planned_pairs(refused) == []


@pytest.mark.parametrize("seed", sorted(SLICE))
def test_the_slice_plans_its_guarantees_within_its_length(seed: int, tmp_path: Path) -> None:
    config = slice_config(seed, tmp_path)
    intents = plan(config.seed, SLICE_SECONDS, config.kinds, mean_gap=config.mean_gap,
                   overlap=config.overlap, guaranteed=config.guaranteed,
                   guaranteed_pairs=config.guaranteed_pairs)  # fmt: skip
    kinds, pairs = SLICE[seed]
    assert set(kinds) <= {intent.kind for intent in intents}
    assert set(pairs) <= set(planned_pairs(intents))
    # The slice asserts that both loops' work moved between instances: that needs a fault
    # that hands leadership over aimed at each loop's leader (a freeze shorter than
    # stall_timeout, a failover, or a random target may leave a leader where it was).
    by_id = {intent.id: intent for intent in intents}
    hands_over = {"sigkill", "sigterm", "partition", "scale_down", "clock_skew"}
    aimed = {
        by_id[intent.during].target if intent.target == "outer" and intent.during is not None
        else intent.target
        for intent in intents
        # A partition hands over only if it outlasts the server's release of the cut-off
        # leader's lock: about 4 s with the slice's timings (keepalive 1 + 3 x 1 s).
        if intent.kind in hands_over and (intent.kind != "partition" or intent.duration >= 4.5)
    }  # fmt: skip
    assert {"leader:publish", "leader:plugin"} <= aimed


def test_the_sharded_run_plans_every_kind_and_its_membership_pairs() -> None:
    intents = plan(SHARDED_SEED, 150.0, ALL_KINDS, guaranteed=ALL_KINDS,
                   guaranteed_pairs=SHARDED_PAIRS)  # fmt: skip
    assert {intent.kind for intent in intents} == set(ALL_KINDS)
    assert set(SHARDED_PAIRS) <= set(planned_pairs(intents))


def test_the_soak_plans_every_kind_and_its_pairs() -> None:
    intents = plan(2028, SOAK, ALL_KINDS, guaranteed=ALL_KINDS, guaranteed_pairs=SOAK_PAIRS)
    assert {intent.kind for intent in intents} == set(ALL_KINDS)
    assert set(SOAK_PAIRS) <= set(planned_pairs(intents))


# -- two faults on one replica ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("active", "new", "composes"),
    [
        # A link and a process are different things: any of each.
        *((a, b, True) for a in sorted(LINK_FAULTS) for b in sorted(PROCESS_FAULTS)),
        *((b, a, True) for a in sorted(LINK_FAULTS) for b in sorted(PROCESS_FAULTS)),
        # One link: the cut and the bad link are kept apart by the rig; two of one would
        # end each other early.
        ("partition", "netem", True),
        ("netem", "partition", True),
        ("partition", "partition", False),
        ("netem", "netem", False),
        # One process: a frozen one may be killed or restarted, nothing else composes.
        ("sigstop", "sigkill", True),
        ("sigstop", "sigterm", True),
        ("sigstop", "clock_skew", True),
        ("sigstop", "scale_down", True),  # a frozen replica leaves (SIGCONT, SIGTERM)
        ("sigstop", "sigstop", False),
        *(
            (a, b, False)
            for a in ("sigkill", "sigterm", "clock_skew", "scale_down")
            for b in sorted(PROCESS_FAULTS)
        ),
        # A replica a scale_up started is a replica like any other while it runs.
        *(("scale_up", b, True) for b in sorted(PROCESS_FAULTS | LINK_FAULTS)),
    ],
)
def test_which_faults_may_hit_one_replica_at_once(
    active: FaultKind, new: FaultKind, composes: bool
) -> None:
    assert share_replica(active, new) is composes


def test_no_two_faults_of_postgresql_overlap() -> None:
    for a, b in itertools.product(ALL_KINDS, repeat=2):
        assert may_overlap(a, b) is not (a in DATABASE_FAULTS and b in DATABASE_FAULTS)


R1_PARTITIONED = [
    ReplicaState("r1", alive=True, active=("partition",)),
    ReplicaState("r2", alive=True),
    ReplicaState("r3", alive=True),
]


def test_a_fault_hits_where_it_was_aimed_when_it_composes_with_what_is_there() -> None:
    # The partitioned leader killed, frozen, or given a bad link besides.
    for kind in ("sigkill", "sigstop", "clock_skew", "netem"):
        assert choose_replica(kind, "r1", 0.0, R1_PARTITIONED) == "r1"  # type: ignore[arg-type]


def test_a_fault_that_would_undo_another_goes_elsewhere_by_its_pick() -> None:
    assert choose_replica("partition", "r1", 0.0, R1_PARTITIONED) == "r2"
    assert choose_replica("partition", "r1", 0.99, R1_PARTITIONED) == "r3"
    frozen = [ReplicaState("r1", True, ("sigstop",)), ReplicaState("r2", True)]
    assert choose_replica("sigkill", "r1", 0.5, frozen) == "r1"  # a frozen process killed
    assert choose_replica("sigstop", "r1", 0.5, frozen) == "r2"  # not frozen twice
    assert choose_replica("sigstop", None, 0.0, frozen) == "r2"


def test_a_process_being_taken_down_is_no_target_but_its_link_is_when_aimed_at() -> None:
    down = [ReplicaState("r1", alive=False, active=("sigkill",)), ReplicaState("r2", True)]
    for kind in PROCESS_FAULTS - {"scale_down"}:  # (which would leave fewer than two)
        assert choose_replica(kind, "r1", 0.0, down) == "r2"
    # Its link cut while it is down: its next process comes up behind the cut.
    assert choose_replica("partition", "r1", 0.0, down) == "r1"
    # Not when aimed elsewhere (at random): a link with no process behind it hits nothing.
    assert choose_replica("partition", None, 0.0, down) == "r2"
    assert choose_replica("sigkill", None, 0.0, [ReplicaState("r1", False, ("sigterm",))]) is None


# -- overlapping windows -----------------------------------------------------------------


def fault(
    kind: str,
    target: str,
    start: float,
    end: float,
    *,
    instance: str | None = None,
    id: int | None = None,
    during: int | None = None,
    **extra: object,
) -> Fault:
    return Fault(kind, target, at(start), at(end), instance, id, during, extra)


def test_overlapping_faults_are_the_pairs_whose_windows_meet() -> None:
    partition = fault("partition", "r2", 10.0, 17.0, id=0)
    kill = fault("sigkill", "r2", 12.0, 13.1, instance="r2.1", id=1, during=0)
    failover = fault("failover_sync", "postgres", 16.0, 19.0, id=2)  # staggered, unplanned
    later = fault("sigstop", "r1", 30.0, 31.0, id=3)
    pairs = overlapping_faults([later, failover, kill, partition])
    assert [(a.kind, b.kind, round(t, 3)) for a, b, t in pairs] == [
        ("partition", "sigkill", 1.1),
        ("partition", "failover_sync", 1.0),
    ]
    # An instant fault inside another's window is in effect with it, for a moment.
    restart = fault("pg_restart_fast", "postgres", 12.5, 12.5)
    assert [(a.kind, b.kind) for a, b, _ in overlapping_faults([partition, restart])] == [
        ("partition", "pg_restart_fast")
    ]
    lanes = {f.id: lane for f, lane in fault_lanes([partition, kill, failover, later])}
    assert lanes == {0: 0, 1: 1, 2: 1, 3: 0}


def test_overlapping_windows_merge_and_are_never_widened() -> None:
    history = crafted()
    history.faults += [
        fault("partition", "r2", 10.0, 17.0, id=0),
        fault("sigkill", "r2", 12.0, 13.1, instance="r2.1", id=1, during=0),
    ]
    recovery = history.meta.recovery_allowance
    windows = merge_spans((a, b) for a, b, _ in fault_windows(history))
    assert (at(10.0), at(17.0 + recovery)) in windows  # the union, no more
    # Work late from the partition's window into the quiet after it: what lies outside
    # the union counts against the bound.
    swap_run(history, plugin_run(22, "external"), start=at(22.0 + 2.6))
    swap_run(history, plugin_run(22, "db"), start=at(22.0 + 2.6))
    result = check(history)
    assert result.kinds() == ["late"], result.explain()
    assert "task probe" in result.violations[0].explanation


@pytest.mark.parametrize(("sigstop_end", "allowed"), [(29.45, False), (35.0, True)])
def test_a_freeze_another_fault_ended_early_allows_only_until_then(
    sigstop_end: float, allowed: bool
) -> None:
    """r1.1 frozen at 29.4 s for a planned 5.6 s, but a SIGTERM of it sent SIGCONT first, at
    29.45 s: the harness records its SIGSTOP as ending there (``ended_by``), and r1.1's work
    on until 30.6 s, past that moment plus the documented 1 s, is an overlap with r2.1's.
    Recorded with its planned end (35 s), the same history would have been allowed."""
    history = crafted()
    history.faults.append(
        fault("sigstop", "r1", 29.4, sigstop_end, instance="r1.1", id=0, ended_by="sigterm")
    )
    swap_run(history, plugin_run(29, "external"), end=at(30.6))
    result = check(history)
    if allowed:
        assert result.ok, result.explain()
        assert [a.kind for a in result.allowed] == ["frozen_leader"]
    else:
        assert result.kinds() == ["overlap"], result.explain()


def test_the_report_shows_overlapping_faults(tmp_path: Path) -> None:
    history = crafted()
    history.faults += [
        fault("partition", "r2", 10.0, 17.0, id=0),
        fault("sigkill", "r2", 12.0, 13.1, instance="r2.1", id=1, during=0),
        fault("netem", "r1", 40.0, 43.0, id=2, delay_ms=80, loss_pct=0),
        fault("pg_restart_fast", "postgres", 42.5, 42.9, id=3),  # staggered, not planned
    ]
    result = check(history)
    paths = write_report(history, result, tmp_path / "report")
    overlapping = json.loads(paths["json"].read_text())["faults"]["overlapping"]
    assert overlapping["count"] == 2
    assert overlapping["planned"] == 1
    assert overlapping["by_pair"]["partition + sigkill"]["count"] == 1
    assert overlapping["by_pair"]["netem + pg_restart_fast"]["together"]["max"] == pytest.approx(
        0.4
    )
    assert [item["planned"] for item in overlapping["items"]] == [True, False]
    report = paths["markdown"].read_text()
    assert "### Overlapping faults" in report
    assert "2 pair(s) of faults in effect at once" in report
    assert "| partition + sigkill | 1 | 1.100 | 1.100 |" in report
    assert "sigkill of r2.1 at" in report
    assert "(not planned as a pair)" in report
    assert paths["timeline"].stat().st_size > 10_000


# -- the standing link delay ---------------------------------------------------------------


def test_the_slice_runs_one_seed_over_distant_links() -> None:
    assert sorted(SLICE_RTT_MS.values()) == [0.0, 10.0]
    assert {seed: slice_config(seed, Path("x")).rtt_ms for seed in SLICE} == SLICE_RTT_MS


def test_a_standing_round_trip_is_half_each_way_and_a_bad_link_comes_on_top() -> None:
    """The rig delays each direction once: 10 ms more a round trip is 5 ms each way. A bad
    link keeps the distance the link had: delays and jitter ranges add, losses compound."""
    standing = standing_delay(10)
    assert standing == Impairment(delay_ms=5.0)
    assert standing_delay(0) == Impairment()
    with pytest.raises(ValueError, match="round trip"):
        standing_delay(-1)
    bad = Impairment(delay_ms=120, jitter_ms=30, loss_pct=5)
    assert on_top(standing, bad) == Impairment(delay_ms=125, jitter_ms=30, loss_pct=5)
    assert on_top(Impairment(), bad) == bad
    lossy = Impairment(delay_ms=5, jitter_ms=2, loss_pct=10)
    assert on_top(lossy, Impairment(loss_pct=10)) == Impairment(5, 2, 19)


def _linked(history: History, **meta: object) -> str:
    history.meta = replace(history.meta, extra={**history.meta.extra, **meta})
    return markdown(summarize(history, check(history)), check(history))


def test_the_report_names_the_links_standing_delay_and_what_was_measured() -> None:
    history = crafted(rtt_ms=10.0)
    measured = {"start": {"r1": 10.4, "r2": 10.9}, "end": {"r1": 10.3, "r2": None}}
    report = _linked(history, network_namespaces=True, link_rtt_ms=measured)
    assert (
        "Links: 10 ms RTT standing on every replica's link, the whole run (5 ms each way; a "
        "netem fault's delay adds to it). Round trip measured (TCP handshake): 10.40-10.90 "
        "ms at the start, 10.30-10.30 ms at the end." in report
    )
    assert summarize(history, check(history))["run"]["rtt_ms"] == 10.0
    assert "Links: no standing delay." in _linked(crafted(), network_namespaces=True)
    assert "Links: loopback" in _linked(crafted(), network_namespaces=False)
    assert "Links:" not in _linked(crafted())  # a history that does not say


# -- membership: scale_up and scale_down ------------------------------------------------------

FIVE = [ReplicaState(f"r{n}", alive=True) for n in (1, 2, 3)] + [
    ReplicaState("r4", alive=False, spare=True),
    ReplicaState("r5", alive=False, spare=True),
]


def test_a_scale_up_starts_a_spare_replica_never_a_running_one() -> None:
    assert choose_replica("scale_up", None, 0.0, FIVE) == "r4"
    assert choose_replica("scale_up", None, 0.99, FIVE) == "r5"
    assert choose_replica("scale_up", "r1", 0.0, FIVE) == "r4"  # never where it was aimed
    # A spare already being started by the other fault of the pair: the other spare.
    starting = [*FIVE[:3], ReplicaState("r4", False, ("scale_up",), spare=True), FIVE[4]]
    assert choose_replica("scale_up", None, 0.0, starting) == "r5"
    # Both spares running (the configured count + 2): nothing more is started.
    assert choose_replica("scale_up", None, 0.5, FIVE[:3]) is None


def test_no_other_fault_hits_a_spare_that_is_not_running() -> None:
    for kind in sorted(PROCESS_FAULTS | LINK_FAULTS):
        assert choose_replica(kind, "r4", 0.99, FIVE) in ("r1", "r2", "r3")


def test_a_scale_down_leaves_at_least_two_replicas_running() -> None:
    assert MIN_RUNNING == 2
    assert choose_replica("scale_down", "r2", 0.0, FIVE) == "r2"
    one_down = [ReplicaState("r1", False, ("scale_down",)), *FIVE[1:]]
    assert choose_replica("scale_down", "r1", 0.0, one_down) is None  # two left: no
    assert choose_replica("scale_down", "r2", 0.0, one_down) is None
    # A replica that a scale_up added counts: four running, one may leave.
    joined = [*one_down[:3], ReplicaState("r4", True, ("scale_up",)), FIVE[4]]
    assert choose_replica("scale_down", "r4", 0.0, joined) == "r4"
    # A frozen replica may leave (a SIGTERM continues it first); a leaving one not twice.
    frozen = [ReplicaState("r1", True, ("sigstop",)), *FIVE[1:]]
    assert choose_replica("scale_down", "r1", 0.0, frozen) == "r1"
    assert choose_replica("scale_down", "r1", 0.0, joined) == "r2"


def test_membership_faults_are_drawn_and_aimed_as_the_nemesis_says() -> None:
    intents = [intent for seed in range(10) for intent in soak_plan(seed)]
    for kind in MEMBERSHIP_FAULTS:
        mine = [intent for intent in intents if intent.kind == kind]
        assert len(mine) > 20, kind
        assert all(4.0 <= intent.duration <= 15.0 for intent in mine)
    ups = [intent for intent in intents if intent.kind == "scale_up"]
    assert {intent.target for intent in ups} == {"spare"}
    downs = [intent for intent in intents if intent.kind == "scale_down"]
    assert {intent.target for intent in downs} >= {"leader:publish", "leader:plugin", "random"}
    # An inner fault aimed at the replica a scale_up just added: a kill of a new member.
    pairs = [group for seed in range(30) for group in episodes(soak_plan(seed)) if len(group) == 2]
    assert any(o.kind == "scale_up" and i.target == "outer" for o, i in pairs)
    assert not any(i.kind == "scale_up" and i.target != "spare" for _, i in pairs)
    # Membership faults are about a sixth of the draws (weights 2 + 2 of 23).
    share = sum(intent.kind in MEMBERSHIP_FAULTS for intent in intents) / len(intents)
    assert 0.1 < share < 0.25


def test_a_plan_without_membership_faults_draws_none() -> None:
    kinds = [kind for kind in ALL_KINDS if kind not in MEMBERSHIP_FAULTS]
    intents = plan(4, SOAK, kinds)
    assert not {intent.kind for intent in intents} & MEMBERSHIP_FAULTS
