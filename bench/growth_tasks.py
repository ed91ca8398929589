"""Targets for the benchmarks' async Python tasks (bench/ is put on PYTHONPATH, so the
targets are ``growth_tasks:noop``, ``growth_tasks:half_second`` and so on)."""

from __future__ import annotations

import asyncio
import os
import time

from scheduler_daemon.plugins.context import TaskContext

# bench/shards.py: a directory where tenth_second records each run, outside the database.
RECORDS = "BENCH_RUN_RECORDS"


async def noop(ctx: TaskContext) -> None:
    """Does nothing: what is measured is the scheduler's own cost per run."""
    del ctx


async def half_second(ctx: TaskContext) -> None:
    """Waits 0.5 s, as an async I/O target would: the overload case of bench/scale.py
    caps plugin.concurrency so that only about a tenth of what is due fits."""
    del ctx
    await asyncio.sleep(0.5)


async def five_ms_cpu(ctx: TaskContext) -> None:
    """Spins for 5 ms of this thread's CPU time, holding the event loop throughout (a
    CPU-bound async target: bench/shards.py, where replicas add cores)."""
    del ctx
    until = time.thread_time() + 0.005
    while time.thread_time() < until:
        pass


async def tenth_second(ctx: TaskContext) -> None:
    """Waits 0.1 s, as an async I/O target would (bench/shards.py). With BENCH_RUN_RECORDS
    set, it appends a line to <dir>/<pid>.runs at its start and another at its end (or
    its cancellation), wall clock: the runs as the work itself saw them, so that overlap
    is judged outside the database (a SIGKILLed process writes no end: its death is)."""
    records = os.environ.get(RECORDS)
    if records is None:
        await asyncio.sleep(0.1)
        return
    path = os.path.join(records, f"{os.getpid()}.runs")
    key = f"{ctx.name} {ctx.slot.timestamp():.6f} {ctx.instance} {ctx.shard}"
    _append(path, f"start {key} {time.time():.6f}\n")
    try:
        await asyncio.sleep(0.1)
    finally:
        _append(path, f"end {key} {time.time():.6f}\n")


def _append(path: str, line: str) -> None:
    # One write of one short line with O_APPEND: whole, whatever else writes the file.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


# bench/sustained.py: a directory where stamp records each run as the target saw it.
STAMPS = "BENCH_STAMPS"


async def stamp(ctx: TaskContext) -> None:
    """Does nothing but write one line: its schedule, its slot, and the wall clock as the
    target was called. Lateness is measured by the work itself, outside the database,
    in the clock of the machine it runs on (the benchmark's: same host)."""
    directory = os.environ.get(STAMPS)
    if directory is not None:
        line = f"{ctx.name} {ctx.slot.timestamp():.6f} {time.time():.6f} {ctx.instance}\n"
        _append(os.path.join(directory, f"{os.getpid()}.stamps"), line)


# bench/latency.py: a directory where probe records each run, outside the database.
PROBES = "BENCH_PROBES"


async def probe(ctx: TaskContext) -> None:
    """Notes the wall clock as it was called, waits 1 ms (an async target's I/O), then
    writes one line: instance, schedule, slot and that start. The line comes after the
    wait so that a run is recorded only once it has really run."""
    started = time.time()
    await asyncio.sleep(0.001)
    directory = os.environ.get(PROBES)
    if directory is not None:
        line = f"{ctx.instance} {ctx.name} {ctx.slot.timestamp():.6f} {started:.6f}\n"
        _append(os.path.join(directory, f"{os.getpid()}.probes"), line)
