"""The job of bench/peers.py's many-schedules comparison, identical for every contestant.

A no-op that records one line per run, outside the database, in a file of its own per
process (``$PEER_RUNS_DIR/<pid>.slots``): ``schedule slot start pid``, the slot (the
scheduled instant as the peer hands it to the job) and the start (``time.time()`` as the
job begins) in seconds since the epoch. One ``os.write`` to a descriptor opened once per
process (``O_APPEND``): the cost of a run is the scheduler's, not the job's.

- ``ours``: scheduler-daemon's async plugin target (``scalejob:ours``, runtime schedule
  rows), the slot from its ``TaskContext``;
- ``aps_job``: APScheduler 4, the schedule id and ``scheduled_fire_time`` from
  ``apscheduler.current_job``;
- ``procrastinate_job``: procrastinate's periodic task, the ``timestamp`` (the cron
  instant, whole seconds) that its periodic deferrer passes, and the schedule id through
  the periodic task's ``task_kwargs``.

Standard library only (each peer's venv imports it).
"""

from __future__ import annotations

import os
import time
from typing import Any

_fd: dict[int, int] = {}  # pid -> descriptor (a forked child opens its own)


def record(schedule: str, slot: float, start: float) -> None:
    pid = os.getpid()
    fd = _fd.get(pid)
    if fd is None:
        path = os.path.join(os.environ["PEER_RUNS_DIR"], f"{pid}.slots")
        fd = _fd[pid] = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, f"{schedule} {slot:.6f} {start:.6f} {pid}\n".encode())


def ready() -> None:
    """The process is up, its schedules known: ``$PEER_RUNS_DIR/<pid>.ready``."""
    path = os.path.join(os.environ["PEER_RUNS_DIR"], f"{os.getpid()}.ready")
    with open(path, "w") as marker:
        marker.write(f"{time.time():.6f}\n")


async def ours(ctx: Any) -> None:
    start = time.time()
    record(ctx.name, ctx.slot.timestamp(), start)


async def aps_job() -> None:
    start = time.time()
    from apscheduler import current_job

    job = current_job.get()
    record(job.schedule_id, job.scheduled_fire_time.timestamp(), start)


async def procrastinate_job(timestamp: int, sid: str) -> None:
    start = time.time()
    record(sid, float(timestamp), start)
