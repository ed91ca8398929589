"""The chaos suite: real replicas under a seeded nemesis, judged by the history checker.

``make test`` runs the short deterministic slice (fixed seeds, each about a minute, each
guaranteed a partition, a primary failover, a change of membership and overlapping faults
among its faults; one over links with a standing 10 ms round trip);
``make chaos SEED=… DURATION=… REPLICAS=… SHARDS=… RTT_MS=…`` runs one long run with every
fault kind (the soak), the plugin loop in SHARDS shards (default 1: one leader), each
replica's link RTT_MS milliseconds longer a round trip (default 0); ``make test-long``
runs a sharded run with replicas joining and leaving among the other faults. Every run
leaves its directory (history, report, timeline picture, each replica's logs) behind; a
failure names it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from chaos.checker import check
from chaos.harness import ChaosConfig, ChaosRun
from chaos.history import History, overlapping_faults
from chaos.nemesis import ALL_KINDS, FaultKind
from chaos.report import write_report

ROOT = Path(__file__).resolve().parents[2]

# Each seed of the slice is guaranteed these kinds and these overlapping (outer, inner)
# pairs (more may be drawn): between them the slice covers a silent partition, both kinds
# of primary failover, kills, stalls, a PostgreSQL crash, a skewed clock and replicas
# joining and leaving, and faults that overlap: a SIGKILL during a partition, a SIGSTOP
# during a primary failover, a SIGTERM during a partition, a clock step during a
# PostgreSQL crash and a leave while a new replica is there, in about a minute each.
SLICE: dict[int, tuple[tuple[FaultKind, ...], tuple[tuple[FaultKind, FaultKind], ...]]] = {
    19: (
        ("partition", "failover_sync", "sigkill", "sigstop"),
        (
            ("partition", "sigkill"),
            ("failover_sync", "sigstop"),
            # A replica joins and another leaves while it is there (with three replicas a
            # scale_down needs all three running besides: at least two stay).
            ("scale_up", "scale_down"),
        ),
    ),
    12: (
        ("partition", "failover_async", "pg_restart_immediate", "clock_skew", "sigterm"),
        # A replica leaves for a while (its shards handed over) during a partition.
        (("partition", "scale_down"), ("pg_restart_immediate", "clock_skew")),
    ),
}
SLICE_SECONDS = 45.0
# How many shards each seed's plugin loop runs in: one seed with one leader (the default
# deployment), one sharded, in the same time.
SLICE_SHARDS: dict[int, int] = {19: 1, 12: 8}
# The standing round trip each seed's links carry (ms; ChaosConfig.rtt_ms): one seed with
# replicas a distance from their database (10 ms, as across zones), one on clean links.
SLICE_RTT_MS: dict[int, float] = {19: 10.0, 12: 0.0}
# A bad link (netem) adds at least this to a round trip (50 ms each way at the least):
# a link measured below standing + this after the run is back at its standing delay.
LEAST_BAD_LINK_MS = 100.0

# The soak's pairs, each drawn at least once beside the random ones (every kind is too):
# the incidents the nemesis was taught overlap for.
SOAK_PAIRS: tuple[tuple[FaultKind, FaultKind], ...] = (
    ("partition", "sigkill"),  # the partitioned leader killed: its successor comes up cut
    ("pg_restart_fast", "clock_skew"),  # a clock step while PostgreSQL restarts
    ("failover_sync", "sigstop"),  # a leader frozen while there is no primary
    ("failover_async", "partition"),  # a leader cut off while commits are lost
    ("sigstop", "sigkill"),  # a frozen process killed (a liveness probe)
    ("netem", "partition"),  # a bad link that then goes dead
    ("sigkill", "netem"),  # a restart onto a bad link
    ("pg_restart_immediate", "sigterm"),  # a graceful stop while PostgreSQL crashes
    ("scale_up", "sigkill"),  # a replica that has just joined is killed
)


def run_and_check(config: ChaosConfig) -> tuple[History, Path]:
    with ChaosRun(config) as run:
        path = run.run()
    history = History.load(path)
    result = check(history)
    write_report(history, result, config.directory)
    report = (config.directory / "report.md").read_text()
    assert not result.violations, f"violations (run directory {config.directory}):\n{report}"
    return history, config.directory


def slice_config(seed: int, directory: Path) -> ChaosConfig:
    kinds, pairs = SLICE[seed]
    return ChaosConfig(
        seed=seed,
        duration=SLICE_SECONDS,
        replicas=3,
        directory=directory,
        guaranteed=kinds,
        guaranteed_pairs=pairs,
        mean_gap=1.5,
        shards=SLICE_SHARDS[seed],
        rtt_ms=SLICE_RTT_MS[seed],
    )


@pytest.mark.processes
@pytest.mark.parametrize("seed", sorted(SLICE))
def test_chaos_slice(seed: int, tmp_path: Path) -> None:
    history, directory = run_and_check(slice_config(seed, tmp_path / f"chaos-{seed}"))
    # A run that injected nothing, or whose work never moved between instances, proves
    # nothing: the guaranteed faults happened, the guaranteed pairs overlapped (by their
    # recorded windows), and leadership changed hands in both loops.
    guaranteed, pairs = SLICE[seed]
    network = bool(history.meta.get("network_namespaces"))
    kinds = {fault.kind for fault in history.faults}
    wanted = set(guaranteed) if network else set(guaranteed) - {"partition", "netem"}
    assert wanted <= kinds, (kinds, directory)
    overlapped = {(a.kind, b.kind) for a, b, _ in overlapping_faults(history.faults)}
    for pair in pairs:
        if network or not {"partition", "netem"} & set(pair):
            assert pair in overlapped, (pair, overlapped, directory)
    for loop in ("publish", "plugin"):
        workers = {run.instance for run in history.runs if run.loop == loop}
        assert len(workers) >= 2, f"only {workers} did {loop} work: {directory}"
    assert len(history.publications) >= 50, directory
    if SLICE_SHARDS[seed] > 1:
        assert_sharded(history, directory)
    if network:
        assert_standing_delay(history, SLICE_RTT_MS[seed], directory)


def assert_standing_delay(history: History, rtt_ms: float, directory: Path) -> None:
    """Every replica's link (the spares' too) had the standing round trip before the first
    fault, and had it again after the last heal: no fault of a link left it clean, or bad.
    A held packet cannot come back early, so the standing delay is an exact lower bound."""
    assert history.meta.rtt_ms == rtt_ms, (history.meta.rtt_ms, directory)
    measured = history.meta.get("link_rtt_ms") or {}
    assert set(measured) == {"start", "end"}, (measured, directory)
    for when, links in measured.items():
        assert len(links) >= history.meta.replicas, (when, links, directory)
        for replica, rtt in links.items():
            assert rtt is not None, f"{replica}'s link not measured at the {when}: {directory}"
            assert rtt >= rtt_ms, f"{replica}'s link at the {when}: {rtt} ms < {rtt_ms} ms"
            assert rtt < rtt_ms + LEAST_BAD_LINK_MS, (
                f"{replica}'s link at the {when}: {rtt} ms, a bad link left on ({directory})"
            )


def assert_sharded(history: History, directory: Path) -> None:
    """The run really was sharded: Python records carry shards, several shards had work
    and shards changed owner (the per-shard rules were exercised, not vacuous)."""
    shards = {run.shard for run in history.runs if run.shard is not None}
    assert len(shards) >= 2, (shards, directory)
    owners: dict[int, set[str]] = {}
    for event in history.leaders:
        if event.shard is not None and event.event == "acquired":
            owners.setdefault(event.shard, set()).add(event.instance)
    moved = any(len(instances) > 1 for instances in owners.values())
    assert moved, f"no shard ever changed owner: {directory}"


# The sharded run of `make test-long`: replicas join and leave (and a new member is killed,
# a frozen one leaves, a leaving one's shards move during a partition) among the faults.
SHARDED_SEED = 31
SHARDED_PAIRS: tuple[tuple[FaultKind, FaultKind], ...] = (
    ("scale_up", "sigkill"),  # a member that has just joined is killed
    ("sigstop", "scale_down"),  # a frozen member leaves
    ("partition", "scale_up"),  # a member joins while another is cut off
    ("scale_down", "failover_sync"),  # a member leaves while the primary fails over
)


@pytest.mark.chaos_long
@pytest.mark.processes
def test_chaos_sharded(tmp_path: Path) -> None:
    """Sharded leadership (8 shards, 4 replicas) under every fault kind, with replicas
    joining and leaving: no shard's work by two instances at once, each slot once, and
    every shard's tokens only growing."""
    directory = tmp_path / f"chaos-sharded-{SHARDED_SEED}"
    config = ChaosConfig(
        seed=SHARDED_SEED,
        duration=150.0,
        replicas=4,
        directory=directory,
        guaranteed=ALL_KINDS,
        guaranteed_pairs=SHARDED_PAIRS,
        shards=8,
    )
    history, _ = run_and_check(config)
    assert_sharded(history, directory)
    kinds = {fault.kind for fault in history.faults}
    assert {"scale_up", "scale_down"} <= kinds, (kinds, directory)


@pytest.mark.chaos_long
@pytest.mark.processes
def test_chaos_soak() -> None:
    """``make chaos SEED=… DURATION=… REPLICAS=… SHARDS=… RTT_MS=…``: every fault kind and
    the soak's pairs of overlapping faults beside the random ones, a long run."""
    seed = int(os.environ.get("CHAOS_SEED") or time.time_ns() % 100_000)
    duration = float(os.environ.get("CHAOS_DURATION") or 300)
    replicas = int(os.environ.get("CHAOS_REPLICAS") or 5)
    shards = int(os.environ.get("CHAOS_SHARDS") or 1)
    rtt_ms = float(os.environ.get("CHAOS_RTT_MS") or 0)
    out = Path(os.environ.get("CHAOS_OUT") or ROOT / "chaos-runs")
    sharded = f"-{shards}k" if shards > 1 else ""
    distant = f"-{rtt_ms:g}ms" if rtt_ms else ""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    directory = out / f"seed-{seed}-{int(duration)}s-{replicas}r{sharded}{distant}-{stamp}"
    print(
        f"chaos run: seed {seed}, {duration:g} s, {replicas} replicas, {shards} shard(s), "
        f"links {rtt_ms:g} ms RTT standing -> {directory}"
    )
    config = ChaosConfig(
        seed=seed,
        duration=duration,
        replicas=replicas,
        directory=directory,
        guaranteed=ALL_KINDS,
        guaranteed_pairs=SOAK_PAIRS,
        shards=shards,
        rtt_ms=rtt_ms,
    )
    history, _ = run_and_check(config)
    if shards > 1:
        assert_sharded(history, directory)
    if rtt_ms and history.meta.get("network_namespaces"):
        assert_standing_delay(history, rtt_ms, directory)
