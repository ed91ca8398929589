"""Real peers across a real network (issue 31): APScheduler 4 and procrastinate at the
round-trip times bench/latency.py measures our daemon at, read beside it.

Per RTT (0, 2, 10, 40 ms by default) and per peer, one after another: a fresh database
on a throwaway, durable cluster listening on the host's end of the rig's links
(tests/rig/netns.py), and 3 processes of the peer, each in a network namespace of its
own, behind the links bench/latency.py puts our replicas behind: every connection
crosses its link, which delays each direction by RTT/2 (`Namespaces.impair`: a process
holding the packets in a netfilter queue, this kernel has no netem; at RTT 0 there is no
such process). The peers are bench/peers.py's many-schedules programs, installed from
PyPI at its pins into venvs of their own under bench/.peers/ (`ensure_venv`), each with
its defaults:

- **APScheduler 4** (`bench/peers/apscheduler_scale.py`): 1,000 schedules of one task,
  `IntervalTrigger(seconds=10, start_time=T0 + i * 10 ms)`: exactly our workload (1,000
  every 10 s, spread over the period). A setup process adds them on the host, not behind
  a link (the adding is not measured), then 3 schedulers with both roles run,
  SQLAlchemyDataStore on asyncpg and AsyncpgEventBroker, all defaults. Among those,
  `max_running_jobs` = 1 *per task*: all 1,000 schedules name one function, so one of
  its jobs runs at a time across the 3 (`--contestants apscheduler-unlimited` lifts it);
- **procrastinate** (`bench/peers/procrastinate_scale.py`): periodic tasks are code and
  its cron has whole seconds, so the nearest it can say is 1,000 periodic tasks every
  10 s on the ten phases of the period (cron `* * * * * P-59/10`, P = i mod 10): 100 due
  at each whole second rather than one every 10 ms. Each of the 3 workers declares all
  1,000 and runs the periodic deferrer; worker defaults (concurrency 1, LISTEN/NOTIFY and
  a 5 s poll; `--contestants procrastinate-c100` sets concurrency 100).

The job (bench/peers/scalejob.py) appends `schedule slot start pid` to a file per process
as it begins, outside the database: start is its own wall clock, slot the instant the
peer hands it (APScheduler's scheduled_fire_time, procrastinate's cron timestamp).
Lateness = start - slot (one clock: the namespaces share the host's, the database runs
on it).

Once every process has written its ready file (schedules declared or scheduler up), at
least one whole period of warm-up, then a window of whole periods (--seconds, rounded up
to a multiple of 10 s); the processes are stopped 5 s after it. Per (peer, RTT), tallied
by bench/peers.py's `tally_slots`: runs/s (runs that started in the window) against the
100 needed, lateness p50/p99/max of each window slot's first run (whenever it ran before
the stop), window slots not run, duplicates (runs of a (schedule, slot) beyond the
first, over the whole run), runs in the window per process, CPU of the 3 process trees
and of the delay processes over the window (100% = one core), the 1-minute load. RTT
measured: the median of 20 `SELECT 1` from inside namespace 0 (bench/latency.py's
probe), before the peer's processes start (idle) and after the window (under load).

**Ours is not re-run**: its rows are read from latency.json (the --out directory's if
there is one, else bench/results/), measured by bench/latency.py under a heavier load
(the same 1,000 async schedules, plus 20 `sql` tasks every second and 20 publications a
second) on the same links. `--contestants ours ...` also runs ours here, in this
harness (`run --only plugin`, defaults, the 1,000 as runtime schedule rows).

    python -m bench.latency_peers [--quick] [--out DIR] [--rtts 0,2,10,40] [--seconds N]
                                  [--contestants NAME ...]

--seconds: the measured window of each case (default 30; --quick: RTTs 0 and 10, 10 s).
The processes' logs and run files stay under bench/results/.work/latency_peers/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg

from bench.common import (
    DURABLE,
    RESULTS,
    ROOT,
    PgCluster,
    drop_database,
    find_pg_bindir,
    netns,
    save_results,
)
from bench.growth import code_version, fmt_s
from bench.latency import measure_rtt, rtt_arguments
from bench.peers import (
    PEER_ENVS,
    SCALE_CONTESTANTS,
    SCALE_GRACE,
    SCALE_PERIOD,
    SCALE_PROCESSES,
    ScaleArena,
    ScaleContestant,
    cpu_seconds,
    ensure_venv,
    our_versions,
    pinned,
    read_slots,
    scale_database,
    scale_ready,
    scale_setup,
    scale_window,
    stop_all,
    tally_slots,
    tree,
    until,
)

SCHEDULES = 1_000  # every SCALE_PERIOD (10 s): bench/latency.py's async workload
READY_WITHIN = 180.0  # s for the processes to come up behind a 40 ms link
DEFAULT_CONTESTANTS = ("apscheduler", "procrastinate")
DB = "bench_latency_peers"
WORK = RESULTS / ".work" / "latency_peers"


@dataclass(kw_only=True)
class LinkedArena(ScaleArena):
    """bench/peers.py's arena, its process n in namespace n, connecting across its link."""

    net: netns.Namespaces

    def prefix(self, n: int) -> list[str]:
        return self.net.argv(n, [])

    def process_dsn(self, n: int) -> str:
        return self.net.dsn(n, self.dsn)


def set_links(net: netns.Namespaces, rtt_ms: float) -> None:
    """Each direction of every link delayed by RTT/2, as bench/latency.py's cases are."""
    for n in range(len(net.hosts)):
        if rtt_ms:
            net.impair(n, delay_ms=rtt_ms / 2)
        else:
            net.clear(n)


Grid = tuple[float, list[float], int, int, tuple[float, float]]  # tally_slots' arguments


async def observe(arena: LinkedArena, periods: int) -> tuple[dict[str, Any], Grid]:
    """Schedules created, the processes started and ready, then the window measured; the
    caller stops them. Returns the measurements and where the window's slots are."""
    t0, offsets, setup_s = await scale_setup(arena)
    began = time.monotonic()
    for _ in range(SCALE_PROCESSES):
        arena.spawn()
    await scale_ready(arena, READY_WITHIN)
    ready_at = time.time()
    startup_s = time.monotonic() - began
    first, w0, w1 = scale_window(t0, ready_at, periods)
    await until(w0)
    pids = [pid for p in arena.live() for pid in tree(p.pid)]
    delayers = [h.delayer.pid for h in arena.net.hosts if h.delayer is not None]
    cpu0, delay0, m0 = cpu_seconds(pids), cpu_seconds(delayers), time.monotonic()
    await until(w1)
    cpu1, delay1, elapsed = cpu_seconds(pids), cpu_seconds(delayers), time.monotonic() - m0
    load = os.getloadavg()[0]
    alive = len(arena.live())
    await until(w1 + SCALE_GRACE)  # late runs of the window's slots still count
    measured = {
        "setup_s": setup_s,
        "startup_s": startup_s,
        "warmup_s": w0 - ready_at,
        "window_s": w1 - w0,
        "cpu_percent": 100 * (cpu1 - cpu0) / elapsed,
        "delay_cpu_percent": 100 * (delay1 - delay0) / elapsed,
        "load_average": load,
        "processes_alive_at_end": alive,
    }
    return measured, (t0, offsets, first, periods, (w0, w1))


async def case(
    admin: str,
    net: netns.Namespaces,
    contestant: ScaleContestant,
    python: str,
    rtt_ms: float,
    periods: int,
) -> dict[str, Any]:
    set_links(net, rtt_ms)
    dsn = await scale_database(admin, contestant, DB)
    workdir = WORK / f"rtt{rtt_ms:g}-{contestant.name}"
    shutil.rmtree(workdir, ignore_errors=True)
    arena = LinkedArena(contestant, SCHEDULES, dsn, workdir, python, net=net)
    arena.runs_dir.mkdir(parents=True)
    try:
        rtt_idle = await measure_rtt(net, dsn)  # before any process of the peer runs
        measured, grid = await observe(arena, periods)
        measured["rtt_loaded_ms"] = await measure_rtt(net, dsn)  # they still run
    finally:
        await stop_all([arena])
        await drop_database(admin, DB, grace=0)
    # Read once they are stopped: a window slot run before the stop counts.
    tally = tally_slots(read_slots(arena.runs_dir), *grid)
    return {"rtt_idle_ms": rtt_idle} | measured | tally


async def run(
    admin: str,
    net: netns.Namespaces,
    contestants: Sequence[ScaleContestant],
    pythons: dict[str, str],
    rtts: Sequence[float],
    periods: int,
) -> dict[str, Any]:
    conn = await asyncpg.connect(admin)
    try:
        postgres = await conn.fetchval("SHOW server_version")
    finally:
        await conn.close()
    results: dict[str, Any] = {
        "code": code_version(),
        "postgres": postgres,
        "processes": SCALE_PROCESSES,
        "schedules": SCHEDULES,
        "period_s": SCALE_PERIOD,
        "window_s": periods * SCALE_PERIOD,
        "rtts": list(rtts),
        "cases": [],
    }
    for rtt in rtts:
        for contestant in contestants:
            name = contestant.name
            print(f"bench.latency_peers: RTT {rtt:g} ms, {name}", flush=True)
            r: dict[str, Any] = {"name": name, "label": contestant.label, "rtt_set_ms": rtt}
            python = pythons[contestant.venv] if contestant.venv else sys.executable
            try:
                r |= await case(admin, net, contestant, python, rtt, periods)
            except RuntimeError as error:  # a peer that cannot keep up is a result too
                r["error"] = str(error)
            results["cases"].append(r)
            print(f"bench.latency_peers:   {row(r)}", flush=True)
    return results


# -- ours, from bench/latency.py's results ----------------------------------------------


def ours_from(out: Path) -> dict[str, Any] | None:
    """bench/latency.py's latency.json (the --out directory's, else bench/results/'s),
    its async workload's numbers as rows of this table."""
    path = next((p for p in (out / "latency.json", RESULTS / "latency.json") if p.exists()), None)
    if path is None:
        return None
    latency = json.loads(path.read_text())
    return {
        "path": str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path),
        "date": latency["date"],
        "commit": latency["code"]["commit"],
        "changed": latency["code"]["changed"],
        "window_s": latency["seconds"],
        "warmup_s": latency["warmup_s"],
        "rows": [ours_row(c) for c in latency["cases"]],
    }


def ours_row(c: dict[str, Any]) -> dict[str, Any]:
    a = c["async"]
    return {
        "name": "ours",
        "label": "ours (bench/latency.py)",
        "rtt_set_ms": c["rtt_set_ms"],
        "rtt_idle_ms": c["rtt_idle_ms"],
        "rtt_loaded_ms": c["rtt_loaded_ms"],
        "runs_per_s": a["runs_per_second"],
        "runs_per_s_needed": SCHEDULES / SCALE_PERIOD,
        "lateness_s": a["lateness_s"],
        "slots_expected": a["slots_expected"],
        "slots_not_run": a["slots_not_run"],
        "duplicates": a["duplicates"],
        "runners": c["plugin_runners"],
        "cpu_percent": c["replicas_cpu_percent"],
        "delay_cpu_percent": c["delay_cpu_percent"],
        "load_average": c["load_average"],
        "exited_early": c["exited_early"],
    }


# -- the report ----------------------------------------------------------------------------


def runners(r: dict[str, Any]) -> str:
    """A peer: its runs in the window per process; ours: the replica(s) that ran them."""
    if "window_runs_by_process" in r:
        return " / ".join(f"{n:,}" for n in r["window_runs_by_process"]) or "none"
    return ", ".join(r["runners"]) or "-"


def row(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"| {r['rtt_set_ms']:g} ms | {r['label']} | error: {r['error']} |" + " |" * 10
    late, dup = r["lateness_s"], r["duplicates"]
    return (
        f"| {r['rtt_set_ms']:g} ms | {r['label']} "
        f"| {r['rtt_idle_ms']:.1f} / {r['rtt_loaded_ms']:.1f} ms | {r['runs_per_s']:.1f} "
        f"| {fmt_s(late['p50'])} | {fmt_s(late['p99'])} | {fmt_s(late['max'])} "
        f"| {r['slots_not_run']} of {r['slots_expected']} "
        f"| {'**' + str(dup) + '**' if dup else 0} | {runners(r)} "
        f"| {r['cpu_percent']:.0f}% | {r['delay_cpu_percent']:.0f}% | {r['load_average']:.1f} |"
    )


def rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """By RTT, ours (read) first, then the contestants in the order they ran."""
    ours = (results.get("ours_from_latency") or {}).get("rows", [])
    return [
        r for rtt in results["rtts"] for r in [*ours, *results["cases"]] if r["rtt_set_ms"] == rtt
    ]


def notes(results: dict[str, Any]) -> list[str]:
    lines = []
    for r in rows(results):
        where = f"RTT {r['rtt_set_ms']:g} ms, {r['label']}"
        if r.get("schedules_without_run"):
            lines.append(f"- {where}: {r['schedules_without_run']} of {SCHEDULES} schedules "
                         "had no run in the window.")  # fmt: skip
        if r.get("off_grid_runs"):
            lines.append(f"- {where}: {r['off_grid_runs']} runs off their schedule's grid.")
        if r.get("processes_alive_at_end", SCALE_PROCESSES) < SCALE_PROCESSES:
            lines.append(f"- {where}: only {r['processes_alive_at_end']} processes alive "
                         "at the window's end.")  # fmt: skip
        if r.get("exited_early"):
            lines.append(f"- {where}: replicas exited early: {r['exited_early']}.")
    return lines


def ours_sentence(results: dict[str, Any]) -> str:
    ours = results.get("ours_from_latency")
    if ours is None:
        return "Ours: no latency.json to read (run `python -m bench.latency` first)."
    changed = (
        f", with uncommitted changes to {', '.join(ours['changed'])}" if ours["changed"] else ""
    )
    return (
        f"**Ours is read, not re-run**: `{ours['path']}` ({ours['date']}, commit "
        f"{ours['commit'][:12]}{changed}), bench/latency.py's async workload on the same "
        "links: 1,000 runtime schedules every 10 s spread over the period, 3 replicas "
        "(both loops, pool 10) that also ran 20 `sql` tasks a second and 20 publications "
        f"a second; {ours['window_s']:g} s window after a {ours['warmup_s']:g} s warm-up; "
        "its CPU is the 3 replicas'."
    )


def report(results: dict[str, Any]) -> str:
    code, versions = results["code"], results["versions"]
    peers = "; ".join(pinned(env) for env in versions.values() if "freeze" in env)
    lines = [
        f"# Beside real peers across a real network ({results['date']}, {results['machine']})",
        "",
        f"Commit {code['commit'][:12]}"
        + (f", with uncommitted changes to {', '.join(code['changed'])}" if code["changed"] else "")
        + f". Per RTT and contestant, one after another: {results['processes']} processes, "
        "each in a network namespace whose link to PostgreSQL "
        f"{results['postgres']} (durable, this host) delays each direction by RTT/2, "
        f"{results['schedules']:,} schedules every {results['period_s']:g} s of a no-op "
        "async job that notes its own start (wall clock) in a file, outside the database. "
        f"Peers from PyPI, each in its own venv: {peers}; their defaults but what the "
        "contestant column names. APScheduler 4: `IntervalTrigger(seconds=10)`, schedule i "
        "from T0 + i·10 ms, one task for all (its default `max_running_jobs` is 1 per "
        "task: one job at a time across the 3). procrastinate: cron has whole seconds, so "
        "the 1,000 are on the ten phases of the period (100 due at each whole second); "
        "workers at concurrency 1 by default. "
        f"{results['window_s']:g} s measured after at least one period of warm-up. "
        "Lateness: the job's own start - slot, each window slot's first run; not run: "
        f"window slots without a run {SCALE_GRACE:g} s after the window; duplicates: runs "
        "of a slot beyond the first, whole run. *Measured*: median `SELECT 1` from a "
        "namespace, idle / under load. *Runners*: a peer's runs in the window per process; "
        "ours, the replica that ran them. CPU: the 3 processes, 100% = one core; *delay*: "
        "the rig's userspace delay processes. Method: bench/latency_peers.py.",
        "",
        ours_sentence(results),
        "",
        "| RTT | contestant | measured | runs/s (of 100) | lateness p50 | p99 | max "
        "| not run | duplicates | runners | CPU | delay CPU | load |",
        "|" + "---|" * 13,
        *[row(r) for r in rows(results)],
        "",
        *notes(results),
    ]
    return "\n".join(lines).rstrip("\n") + "\n"


# -- main ----------------------------------------------------------------------------------


def arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = rtt_arguments("bench.latency_peers")
    parser.add_argument(
        "--contestants",
        nargs="+",
        choices=[c.name for c in SCALE_CONTESTANTS],
        default=list(DEFAULT_CONTESTANTS),
        help="bench/peers.py's many-schedules contestants (default: the two peers, "
        "defaults; ours is read from latency.json, 'ours' runs it here as well)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = arguments(argv)
    rtts = args.rtts or ([0.0, 10.0] if args.quick else [0.0, 2.0, 10.0, 40.0])
    seconds = args.seconds or (10.0 if args.quick else 30.0)
    periods = max(1, math.ceil(seconds / SCALE_PERIOD))  # slots lie on a 10 s grid
    contestants = [c for c in SCALE_CONTESTANTS if c.name in args.contestants]
    why_not = netns.unavailable()
    bindir = find_pg_bindir()
    if why_not or bindir is None:
        sys.exit(f"bench.latency_peers: {why_not or 'no PostgreSQL server binaries'}")
    versions = {c.venv: ensure_venv(PEER_ENVS[c.venv]) for c in contestants if c.venv}
    versions["ours"] = our_versions()
    pythons = {name: env["python"] for name, env in versions.items() if "python" in env}
    with ExitStack() as stack:
        settings = DURABLE | {"listen_addresses": "*"}  # the namespaces reach the host's end
        cluster = stack.enter_context(PgCluster(bindir, settings=settings))
        netns.trust_namespaces(cluster)
        net = stack.enter_context(netns.Namespaces(SCALE_PROCESSES))
        results = asyncio.run(run(cluster.dsn(), net, contestants, pythons, rtts, periods))
    results["versions"] = versions
    results["ours_from_latency"] = ours_from(args.out)
    save_results("latency_peers", results, report, args.out)


if __name__ == "__main__":
    main()
