"""The worker process's side: what runs inside the child that runs one sync target.

The daemon's side (plugins/workers.py: ``Workers``) starts the child through
``multiprocessing``'s forkserver with :func:`worker_main` as its target, passed by
reference: the child imports this module by name to find it. So it stays light (what a
run needs and nothing of the daemon's machinery), and the forkserver preloads it, so a
run does not pay for the import. Here: the child's ties to the daemon (its own process
group, the lifeline, SIGTERM as ``ctx.cancelled``, the frozen-parent check), its logging
set up as the daemon's, the target called, and the outcome written back as one JSON
object. plugins/workers.py's docstring says why a process, and how the two sides fit.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import multiprocessing.forkserver
import os
import pickle
import select
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from ..config.settings import LogSettings
from ..errors import describe
from ..logs import configure_logging, get_logger
from .context import TaskContext

# How often a worker looks at the daemon's state. A stopped daemon's worker is stopped
# within this (plus scheduling), far below any sensible stall_timeout.
FROZEN_CHECK_INTERVAL = 0.05
# Bounds on what a failure sends back: an exception's message can be arbitrarily large.
MAX_ERROR_CHARS = 16_000
MAX_TRACEBACK_CHARS = 64_000

_STOPPED_STATES = frozenset("Tt")  # stopped by a signal ('T') or at a ptrace stop ('t')


@dataclass(frozen=True, slots=True)
class WorkerJob:
    """Everything a worker needs to run one slot of a task. Sent pickled, so every field
    must pickle; ``target`` is pickled by reference (its module and qualified name), and
    the worker imports it (see plugins/workers.py's ``check_picklable``)."""

    target: Callable[..., Any]
    pass_context: bool  # call target(ctx), or target()
    name: str  # the task's name
    slot: datetime
    instance: str
    fencing_token: int
    log: LogSettings  # the daemon's, so the worker logs the same way
    log_context: dict[str, Any] = field(default_factory=dict)  # bound on the ctx's logger
    args: dict[str, Any] = field(default_factory=dict)  # ctx.args
    shard: int | None = None  # ctx.shard


def warm_up() -> None:
    """What Workers.start() runs: nothing (the point is the forkserver's preloading)."""


def worker_main(
    blob: bytes,
    daemon_pid: int,
    environment: dict[str, str],
    lifeline: Connection,
    results: Connection,
) -> None:
    """The worker process: set up its ties to the daemon, run the target, report, exit."""
    # First: a group of our own, before anything can start a child outside it.
    os.setpgid(0, 0)
    # The forkserver's environment is the daemon's as it was when the forkserver started;
    # a target on a thread would see the daemon's current one, and so does a worker.
    os.environ.clear()
    os.environ.update(environment)
    _forget_forkserver()
    for fd in (lifeline.fileno(), results.fileno()):
        os.set_inheritable(fd, False)  # a grandchild started with close_fds=False
    cancelled = threading.Event()
    signals_r, signals_w = os.pipe()
    os.set_blocking(signals_r, False)
    os.set_blocking(signals_w, False)
    # SIGTERM means "please stop": set ctx.cancelled and let the target return (the
    # daemon SIGKILLs after its grace). The event is set by the watcher thread, not in
    # the handler: a handler runs between two bytecodes of the main thread, which may
    # hold the event's own lock (inside ctx.cancelled.wait()) and would deadlock. The
    # C-level handler writes the signal number to the wakeup fd at once, even while
    # the main thread is stuck in C code; the Python handler writes it again (late, but
    # it survives a target that installs a wakeup fd of its own).
    signal.signal(signal.SIGTERM, lambda signum, frame: _poke(signals_w, signum))
    signal.set_wakeup_fd(signals_w)
    threading.Thread(
        target=_watch_daemon,
        args=(lifeline.fileno(), signals_r, daemon_pid, cancelled),
        name="worker:lifeline",
        daemon=True,
    ).start()
    outcome = _call(blob, cancelled)
    view = memoryview(json.dumps(outcome).encode())
    with contextlib.suppress(OSError):  # EPIPE: the daemon is gone, and so are we
        while view:
            view = view[os.write(results.fileno(), view) :]
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    # Nothing else must run: not the atexit hooks of the forkserver's image, not
    # multiprocessing's own exit code, not the target's non-daemon threads.
    os._exit(0)


def _call(blob: bytes, cancelled: threading.Event) -> dict[str, Any]:
    try:
        job: WorkerJob = pickle.loads(blob)  # imports the target: may fail, reported
        configure_logging(job.log, instance=job.instance)
        ctx = TaskContext(
            name=job.name,
            slot=job.slot,
            instance=job.instance,
            log=get_logger(**job.log_context),
            fencing_token=job.fencing_token,
            args=job.args,
            shard=job.shard,
            lease=None,  # no fenced transaction outside the daemon's own connection
            cancelled=cancelled,
        )
        value = job.target(ctx) if job.pass_context else job.target()
        if inspect.isawaitable(value):
            if inspect.iscoroutine(value):
                value.close()  # no "never awaited" warning on top of the error
            raise TypeError("returned an awaitable: make the target `async def`")
    except BaseException as exc:  # SystemExit and KeyboardInterrupt are failures too
        try:
            error = describe(exc)
        except Exception:  # an exception whose str() raises
            error = f"{type(exc).__name__}: <unprintable>"
        return {
            "ok": False,
            "error": error[:MAX_ERROR_CHARS],
            "traceback": traceback.format_exc()[-MAX_TRACEBACK_CHARS:],
        }
    return {"ok": True}


def _forget_forkserver() -> None:
    """Close the worker's copy of the forkserver's "alive" pipe.

    multiprocessing hands every process the forkserver starts a copy of the write end
    whose EOF tells the forkserver that its clients are gone. Held by a worker, it keeps
    the forkserver alive after the daemon died, and the forkserver keeps the worker from
    being orphaned: a worker stopped by the frozen-parent check (so deaf to its lifeline)
    would then stay stopped for ever. Without it the forkserver exits with the daemon,
    the stopped worker's process group is orphaned, and the kernel sends it SIGHUP and
    SIGCONT: it dies, or wakes up and finds its lifeline closed.
    """
    server = multiprocessing.forkserver._forkserver
    fd = getattr(server, "_forkserver_alive_fd", None)
    if isinstance(fd, int):
        setattr(server, "_forkserver_alive_fd", None)  # noqa: B010
        with contextlib.suppress(OSError):
            os.close(fd)


def _poke(fd: int, signum: int) -> None:
    # Full (the watcher has a SIGTERM to read already) or closed: nothing to add.
    with contextlib.suppress(OSError):
        os.write(fd, bytes([signum]))


def _watch_daemon(lifeline: int, signals: int, daemon_pid: int, cancelled: threading.Event) -> None:
    """The worker's watcher thread: lifeline, SIGTERM, frozen parent."""
    stat = Path(f"/proc/{daemon_pid}/stat")
    check_frozen = stat.exists()  # no /proc (not Linux): no frozen-parent check
    poller = select.poll()
    poller.register(lifeline, select.POLLIN)
    poller.register(signals, select.POLLIN)
    timeout_ms = int(FROZEN_CHECK_INTERVAL * 1000) if check_frozen else None
    while True:
        for fd, _events in poller.poll(timeout_ms):
            if fd == lifeline:
                # The daemon never writes to it: readable (or hung up) means EOF, the
                # daemon is gone. Nothing of its work may outlive it.
                os.killpg(0, signal.SIGKILL)
            elif fd == signals:
                try:
                    received = os.read(signals, 512)
                except BlockingIOError:
                    received = b""
                if signal.SIGTERM in received:
                    cancelled.set()
        if check_frozen and _state_of(stat) in _STOPPED_STATES:
            # Stops this thread too; the daemon sends SIGCONT when it may go on.
            os.killpg(0, signal.SIGSTOP)


def _state_of(stat: Path) -> str | None:
    try:
        fields = stat.read_text().rpartition(")")[2].split()
    except OSError:  # gone: the lifeline says so too
        return None
    return fields[0] if fields else None
