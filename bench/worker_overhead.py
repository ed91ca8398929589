"""Per-run overhead of a sync plugin target: a worker process per run against a thread.

``python -m bench.worker_overhead [--runs N] [--write]``

A no-op target (``os.getpid``, called without arguments) is run N times (200 by
default) each way, alternating in blocks of 20 so that both see the same machine:

- **worker**: ``Workers.run`` (scheduler_daemon/plugins/workers.py): a process forked by
  the forkserver, its lifeline, its context and logging set up, the result sent back,
  the exit reported and reaped;
- **thread**: ``run_in_daemon_thread``, the path sync targets took before worker
  processes: a new daemon thread per run. Copied below as it was in
  scheduler_daemon/plugins/tasks.py (commit c043575), which no longer has it.

Each figure is the wall time of one awaited run, from the call to its return. Also
measured: the cold start of the machinery (``Workers.start()``: the forkserver started
and its modules imported), and how long a run's start blocks the event loop (the round
trip to the forkserver, synchronous in ``Workers.run``).

Numbers depend on the machine and on its load: compare the two columns of one run, not
runs across machines. ``--write`` stores them under bench/results/ as well.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from scheduler_daemon.config.settings import LogSettings
from scheduler_daemon.plugins.worker_process import WorkerJob
from scheduler_daemon.plugins.workers import Workers, _Run

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
BLOCK = 20


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(seconds: list[float]) -> dict[str, float]:
    ms = [value * 1000 for value in seconds]
    return {
        "runs": len(ms),
        "median_ms": statistics.median(ms),
        "p95_ms": percentile(ms, 0.95),
        "max_ms": max(ms),
        "mean_ms": statistics.fmean(ms),
    }


async def run_in_daemon_thread(
    function: Callable[..., Any],
    args: tuple[Any, ...],
    name: str,
    on_thread: Callable[[threading.Thread], None] | None = None,
) -> Any:
    """The thread path as it was in scheduler_daemon/plugins/tasks.py at c043575 (the
    code unchanged)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(error: BaseException | None, result: Any) -> None:
        if future.done():  # the awaiting task was cancelled meanwhile
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        try:
            result = function(*args)
        except BaseException as exc:
            loop.call_soon_threadsafe(settle, exc, None)
        else:
            loop.call_soon_threadsafe(settle, None, result)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    if on_thread is not None:
        on_thread(thread)
    return await future


class TimedWorkers(Workers):
    """Workers that note how long each run's start held the event loop."""

    launches: list[float]

    def _launch(self, job: WorkerJob) -> _Run:
        started = time.perf_counter()
        try:
            return super()._launch(job)
        finally:
            self.launches.append(time.perf_counter() - started)


def noop_job() -> WorkerJob:
    return WorkerJob(
        target=os.getpid,
        pass_context=False,
        name="bench.noop",
        slot=datetime.now(UTC),
        instance="bench",
        fencing_token=1,
        log=LogSettings(format="json", level="warning"),
        log_context={"task": "bench.noop", "loop": "plugin", "instance": "bench"},
    )


async def timed(call: Callable[[], Awaitable[Any]]) -> float:
    started = time.perf_counter()
    await call()
    return time.perf_counter() - started


async def measure(runs: int) -> dict[str, Any]:
    workers = TimedWorkers()
    workers.launches = []
    started = time.perf_counter()
    await workers.start()
    cold_start = time.perf_counter() - started
    never_gone = asyncio.Event()

    def fresh() -> bool:
        return True

    async def in_worker() -> None:
        await workers.run(noop_job(), lock_may_be_free=never_gone, proven_recently=fresh, grace=5.0)

    async def in_thread() -> None:
        await run_in_daemon_thread(os.getpid, (), name="task:bench.noop")

    for _ in range(5):  # warm both paths up
        await in_worker()
        await in_thread()
    workers.launches.clear()
    worker_times: list[float] = []
    thread_times: list[float] = []
    while len(worker_times) < runs:
        block = min(BLOCK, runs - len(worker_times))
        worker_times += [await timed(in_worker) for _ in range(block)]
        thread_times += [await timed(in_thread) for _ in range(block)]
    await workers.close()
    return {
        "worker": summary(worker_times),
        "thread": summary(thread_times),
        "worker_start_blocks_loop": summary(workers.launches),
        "cold_start_ms": cold_start * 1000,
    }


def report(results: dict[str, Any]) -> str:
    worker, thread, launch = (
        results["worker"],
        results["thread"],
        results["worker_start_blocks_loop"],
    )
    lines = [
        f"# Sync target overhead ({results['date']}, {results['machine']}, "
        f"{results['cpus']} cpus, Python {results['python']})",
        "",
        f"A no-op sync target, {worker['runs']} runs each way, alternating in blocks of "
        f"{BLOCK}; wall time of one awaited run.",
        "",
        "| | worker process per run | daemon thread per run (before) |",
        "|---|---|---|",
        f"| median | {worker['median_ms']:.2f} ms | {thread['median_ms']:.3f} ms |",
        f"| p95 | {worker['p95_ms']:.2f} ms | {thread['p95_ms']:.3f} ms |",
        f"| max | {worker['max_ms']:.2f} ms | {thread['max_ms']:.3f} ms |",
        "",
        f"Event loop blocked while a worker starts: median {launch['median_ms']:.2f} ms, "
        f"p95 {launch['p95_ms']:.2f} ms. Cold start (`Workers.start()`: forkserver "
        f"started, modules preloaded): {results['cold_start_ms']:.0f} ms.",
    ]
    return "\n".join(lines) + "\n"


def measure_here(runs: int) -> None:
    """The measurement, in the interpreter ``main()`` starts; prints JSON."""
    print(json.dumps(asyncio.run(measure(runs))))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.worker_overhead")
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="20 runs")
    parser.add_argument("--write", action="store_true", help="also write the results")
    parser.add_argument("--out", type=Path, default=RESULTS)
    arguments = parser.parse_args(argv)
    if arguments.quick:
        arguments.runs = 20
    # Measured in a fresh interpreter started with -c, not in this one: started as
    # `python -m bench.worker_overhead`, every worker would first re-run this module as
    # its __main__ (multiprocessing's main-module fixup; ~9 ms a run here). The daemon's
    # own entry points (the `scheduler-daemon` script, `python -m scheduler_daemon`)
    # do not cause that, so it is no part of what a run costs.
    measured = subprocess.run(
        [sys.executable, "-c", f"import {__spec__.name} as b; b.measure_here({arguments.runs})"],
        cwd=ROOT,
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    results: dict[str, Any] = json.loads(measured.stdout.strip().splitlines()[-1])
    results |= {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "load_average": os.getloadavg(),
    }
    text = report(results)
    if arguments.write:
        arguments.out.mkdir(parents=True, exist_ok=True)
        (arguments.out / "worker_overhead.json").write_text(json.dumps(results, indent=2) + "\n")
        (arguments.out / "worker_overhead.md").write_text(text)
    print(text)
    print(f"load average after the run: {results['load_average']}", file=sys.stderr)


if __name__ == "__main__":
    main()
