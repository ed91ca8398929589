"""The chaos suite: real replicas under a seeded nemesis, judged by the history checker.

``make test`` runs the short deterministic slice (fixed seeds, each about a minute, each
guaranteed a partition and a primary failover among its faults); ``make chaos SEED=…
DURATION=… REPLICAS=…`` runs one long run with every fault kind (the soak). Every run
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
from chaos.history import History
from chaos.nemesis import ALL_KINDS, FaultKind
from chaos.report import write_report

ROOT = Path(__file__).resolve().parents[2]

# Each seed of the slice is guaranteed these kinds (more may be drawn): between them the
# slice covers a silent partition, both kinds of primary failover, kills, stalls, a
# PostgreSQL crash and a skewed clock, in about a minute each.
SLICE: dict[int, tuple[FaultKind, ...]] = {
    11: ("partition", "failover_sync", "sigkill", "sigstop"),
    12: ("partition", "failover_async", "pg_restart_immediate", "clock_skew", "sigterm"),
}
SLICE_SECONDS = 45.0


def run_and_check(config: ChaosConfig) -> tuple[History, Path]:
    with ChaosRun(config) as run:
        path = run.run()
    history = History.load(path)
    result = check(history)
    write_report(history, result, config.directory)
    report = (config.directory / "report.md").read_text()
    assert not result.violations, f"violations (run directory {config.directory}):\n{report}"
    return history, config.directory


@pytest.mark.processes
@pytest.mark.parametrize("seed", sorted(SLICE))
def test_chaos_slice(seed: int, tmp_path: Path) -> None:
    config = ChaosConfig(
        seed=seed,
        duration=SLICE_SECONDS,
        replicas=3,
        directory=tmp_path / f"chaos-{seed}",
        guaranteed=SLICE[seed],
        mean_gap=1.5,
    )
    history, directory = run_and_check(config)
    # A run that injected nothing, or whose work never moved between instances, proves
    # nothing: the guaranteed faults happened and leadership changed hands in both loops.
    kinds = {fault.kind for fault in history.faults}
    assert set(SLICE[seed]) - {"partition"} <= kinds or not history.meta.get("network_namespaces")
    if history.meta.get("network_namespaces"):
        assert set(SLICE[seed]) <= kinds, (kinds, directory)
    for loop in ("publish", "plugin"):
        workers = {run.instance for run in history.runs if run.loop == loop}
        assert len(workers) >= 2, f"only {workers} did {loop} work: {directory}"
    assert len(history.publications) >= 50, directory


@pytest.mark.chaos_long
@pytest.mark.processes
def test_chaos_soak() -> None:
    """``make chaos SEED=… DURATION=… REPLICAS=…``: every fault kind, a long run."""
    seed = int(os.environ.get("CHAOS_SEED") or time.time_ns() % 100_000)
    duration = float(os.environ.get("CHAOS_DURATION") or 300)
    replicas = int(os.environ.get("CHAOS_REPLICAS") or 5)
    out = Path(os.environ.get("CHAOS_OUT") or ROOT / "chaos-runs")
    directory = out / f"seed-{seed}-{int(duration)}s-{replicas}r-{time.strftime('%Y%m%dT%H%M%S')}"
    print(f"chaos run: seed {seed}, {duration:g} s, {replicas} replicas -> {directory}")
    config = ChaosConfig(
        seed=seed,
        duration=duration,
        replicas=replicas,
        directory=directory,
        guaranteed=ALL_KINDS,
    )
    run_and_check(config)
