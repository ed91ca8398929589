"""Sync plugin targets run in a worker process of their own, one per run.

Why a process: a thread cannot be stopped. When a replica loses leadership, or a run
passes its timeout, a sync target on a thread runs on beside the new leader's runs; a
process can be stopped for real (SIGTERM, then SIGKILL to its process group), so "the
run is over" can mean "no code of this run is executing any more".

Workers come from ``multiprocessing``'s *forkserver*: a small server process, started
once, that has imported the daemon (and the preloaded modules) and forks a fresh worker
per run. Forking the daemon itself is not an option: it has threads (a fork copies the
locks they hold, not the threads) and sockets (the PostgreSQL session that holds the
lock). ``spawn`` would start a new interpreter and import everything again per run.

What ties a worker to the daemon, beyond the exit status the forkserver reports:

- **its own process group** (``setpgid`` first thing), so that signals reach whatever it
  started too (``subprocess.Popen`` grandchildren), and so that Ctrl-C on the daemon's
  terminal does not reach it: the daemon decides when it stops;
- **a lifeline**: the read end of a pipe whose only write end the daemon holds. A thread
  of the worker blocks on it; EOF means the daemon is gone (even SIGKILLed: the kernel
  closes its fds), and the worker kills its group at once. The daemon's PostgreSQL
  session, hence its lock, ends when it dies; its sync work must end too;
- **the frozen-parent check**: the same thread reads the daemon's state in
  ``/proc/<pid>/stat`` every 50 ms and stops its group (SIGSTOP) while the daemon is
  stopped. A SIGSTOPped leader is evicted by the server after ``stall_timeout``; its
  worker must not go on working meanwhile. The daemon, once running again, resumes the
  worker (SIGCONT) only while its lease is still fresh; otherwise it kills it.

Waiting costs no thread: the forkserver writes the worker's exit status to a pipe (the
process's ``sentinel``), which the event loop watches with ``add_reader``.

This module is the daemon's side: ``Workers`` starts a worker per run, supervises it
(resumes it, stops it: SIGTERM, grace, SIGKILL), reaps it and reads its outcome. What runs
inside the worker (its ties to the daemon above, the target, the report back) is
plugins/worker_process.py, which the worker imports by name.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import fcntl
import inspect
import json
import multiprocessing
import os
import pickle
import signal
import struct
import termios
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from ..errors import describe
from . import worker_process
from .worker_process import WorkerJob, warm_up, worker_main

# How often the daemon looks at a running worker (to resume one it froze while frozen
# itself). Short enough that a resumed daemon's worker waits little; the only cost is a
# timer and a read of /proc per tick.
RESUME_INTERVAL = 0.1


class WorkerFailed(Exception):
    """The target raised in the worker, or the worker died.

    ``error`` is one line: the target's exception (``"ValueError: boom"``, passwords
    redacted), or what became of the worker (``"worker killed by signal 9"``, ``"worker
    exited with code 3"``). ``traceback`` is the worker's traceback text, or None.
    """

    def __init__(self, error: str, traceback: str | None = None) -> None:
        super().__init__(error)
        self.error = error
        self.traceback = traceback


def check_picklable(target: Callable[..., Any]) -> str | None:
    """None if ``target`` can be sent to a worker, else why not (one line, for a config
    error).

    A worker receives its target by reference (module and qualified name) and imports it,
    so the target must be reachable by import: a module-level function, a class's method
    or static/class method. A lambda or a nested function cannot be found that way. A
    bound method of an instance, a ``functools.partial`` or a callable object would pickle
    *by value*: each run would get a private copy of the object, so state the target
    keeps on it would silently stop being shared between runs; those are refused too.
    """
    name = str(getattr(target, "__qualname__", None) or getattr(target, "__name__", ""))
    why: str | None = None
    try:
        sent = pickle.loads(pickle.dumps(target))
    except Exception as exc:  # PicklingError, AttributeError (local objects), TypeError…
        if "<lambda>" in name:
            why = "a lambda"
        elif "<locals>" in name:
            why = "defined inside a function"
        else:
            why = f"it cannot be pickled: {describe(exc)}"
    else:
        # A function or class comes back as the very object; a classmethod as an equal
        # bound method (same class, same function). Anything else was copied by value.
        if sent is not target and sent != target:
            if inspect.ismethod(target):
                why = "a method bound to an object, which each run would get a copy of"
            else:
                why = "an object, which each run would get a copy of"
    if why is None:
        return None
    return (
        "sync targets run in a worker process, so they must be importable module-level "
        f"callables: {target!r} is not ({why})"
    )


@dataclass(eq=False)
class _Run:
    """One worker process, from start to reaped."""

    process: BaseProcess
    pid: int
    lifeline: Connection  # our write end; never written, closed once the worker is dead
    results: Connection  # our read end of the worker's result pipe
    exited: asyncio.Future[None]  # done once the worker process is dead
    output: bytearray = field(default_factory=bytearray)
    lost: bool = False  # the forkserver vanished: no exit status will ever come
    failure: WorkerFailed | None = None
    reaped: bool = False


# Every Workers with runs, for the exit hook below.
_all_workers: weakref.WeakSet[Workers] = weakref.WeakSet()
_exit_hook_registered = False


def _kill_all_at_exit() -> None:
    """At interpreter exit, SIGKILL every worker still running (a run nobody awaited to
    its end). Their lifelines would end them once this process is gone, but a worker the
    frozen-parent check stopped cannot read its lifeline; and sooner is better."""
    for workers in list(_all_workers):
        for run in list(workers._runs.values()):
            _signal(run, signal.SIGKILL)


class Workers:
    """The worker-process machinery of one daemon.

    ``start()`` once when the daemon starts: it starts the forkserver and waits until it
    has imported what workers need, so the first run does not pay for it. ``close()`` at
    the end: it kills whatever worker is still running.

    The forkserver itself is ``multiprocessing``'s and process-wide: every ``Workers`` of
    one process shares it (in tests, several in-process daemons), so ``close()`` leaves it
    running, and ``preload`` only takes effect if this ``start()`` is what starts it. It
    holds no lock and no connection; it exits when the daemon does. It inherits the
    daemon's environment as it was when it started; each worker gets the daemon's
    current ``sys.path``, working directory and environment.

    On Python 3.11 the forkserver does not apply the ``sys.path`` multiprocessing hands
    it: a preloaded module reachable only through an entry added to ``sys.path`` at run
    time (rather than through ``PYTHONPATH`` or site-packages) is silently not preloaded,
    and each worker imports it itself (correct, only slower).

    A daemon started as ``python -m package.module`` (other than a package's
    ``__main__``) makes every worker re-run that module first (multiprocessing's fixup of
    the main module; about 9 ms a run on a small machine). The daemon's own entry points,
    the ``scheduler-daemon`` script and ``python -m scheduler_daemon``, do not.

    Call ``start()`` before ``run()``: a run without it works, but starts the forkserver
    itself, blocking the event loop meanwhile.
    """

    def __init__(self, preload: Sequence[str] = ()) -> None:
        self.preload = tuple(preload)
        self._context = multiprocessing.get_context("forkserver")
        self._runs: dict[int, _Run] = {}

    async def start(self) -> None:
        global _exit_hook_registered
        # '__main__' is multiprocessing's own default: a daemon started as a script has
        # it imported once in the forkserver, rather than once per worker. The worker's
        # side is what every worker imports (its entry point is found by name); this side
        # too, for a worker whose main module is run again in it and imports it.
        preload = ["__main__", worker_process.__name__, __name__, *self.preload]
        self._context.set_forkserver_preload(preload)
        if not _exit_hook_registered:
            atexit.register(_kill_all_at_exit)
            _exit_hook_registered = True
        _all_workers.add(self)
        # A throwaway worker: its start returns once the forkserver has imported the
        # preloaded modules. Blocking, so off the event loop.
        await asyncio.to_thread(self._warm_up)

    def _warm_up(self) -> None:
        process = self._context.Process(target=warm_up, name="worker:warm-up")
        process.start()
        process.join()
        process.close()

    async def close(self) -> None:
        """Kill every worker still running (their ``run()`` calls, if anyone still awaits
        them, then raise or return as usual) and wait until they are dead and reaped."""
        runs = list(self._runs.values())
        for run in runs:
            _signal(run, signal.SIGKILL)
        for run in runs:
            await _wait_dead(run)
            self._reap(run)
        _all_workers.discard(self)

    async def run(
        self,
        job: WorkerJob,
        *,
        lock_may_be_free: asyncio.Event,
        proven_recently: Callable[[], bool],
        grace: float,
    ) -> None:
        """Run ``job.target`` in a new worker process; return once it returned; raise
        :class:`WorkerFailed` if it raised or the worker died.

        Cancelling this coroutine stops the worker. If ``lock_may_be_free`` is set (the lock may be
        free already: another replica may be running), its process group is SIGKILLed at
        once; otherwise it is sent SIGTERM (the target sees ``ctx.cancelled``) and given
        ``grace`` seconds to return, then SIGKILLed (at once if ``lock_may_be_free`` becomes set
        meanwhile). Either way ``CancelledError`` is raised only once the worker is dead
        and reaped; further cancellations while it dies are absorbed (``lock_may_be_free`` is how to
        hurry it).

        While the worker runs, every ``RESUME_INTERVAL``: if ``proven_recently()`` (the lease is
        still good), a worker stopped by the frozen-parent check is resumed.

        Whatever the outcome, processes the worker started and left in its process group
        are killed when it ends: nothing of a run outlives it.
        """
        run = self._launch(job)
        try:
            await self._supervise(run, lock_may_be_free, proven_recently, grace)
        finally:
            if not run.exited.done():  # only if _supervise itself failed
                _signal(run, signal.SIGKILL)
            await _wait_dead(run)
            failure = self._reap(run)
        if failure is not None:
            raise failure

    def _launch(self, job: WorkerJob) -> _Run:
        try:
            # Pickled here rather than by multiprocessing, so that a target the worker
            # cannot import is reported by the worker as the run's error (the worker
            # unpickles it inside its own error handling).
            blob = pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise WorkerFailed(
                check_picklable(job.target) or f"cannot send the job to a worker: {describe(exc)}"
            ) from None
        loop = asyncio.get_running_loop()
        # Both pipes are O_CLOEXEC on our side: nothing we spawn inherits them, so the
        # lifeline's write end is held by this process alone. multiprocessing sends the
        # worker's ends over the forkserver's socket (SCM_RIGHTS); the forkserver closes
        # its copies right after forking (tests/test_worker.py checks that).
        lifeline_r, lifeline_w = self._context.Pipe(duplex=False)
        results_r, results_w = self._context.Pipe(duplex=False)
        process = self._context.Process(
            target=worker_main,
            args=(blob, os.getpid(), dict(os.environ), lifeline_r, results_w),
            name=f"worker:{job.name}",
        )
        try:
            # Blocks the event loop for the round trip to the forkserver, which forks
            # (a few milliseconds; bench/worker_overhead.py measures it). Only if the
            # forkserver had died would it start a new one here, and wait while that
            # imports the preloaded modules.
            process.start()
        except Exception as exc:
            lifeline_w.close()
            results_r.close()
            raise WorkerFailed(f"cannot start a worker: {describe(exc)}") from None
        finally:
            lifeline_r.close()  # the worker has its own copies now
            results_w.close()
        # multiprocessing polls the processes it lists as children whenever another one
        # starts (and in active_children()), reading their exit status from the sentinel
        # itself. Only we may read it: we tell a real exit from a dead forkserver by
        # whether a status is there to read. We join and close it ourselves.
        _children: set[BaseProcess] = getattr(multiprocessing.process, "_children", set())
        _children.discard(process)
        assert process.pid is not None
        run = _Run(process, process.pid, lifeline_w, results_r, loop.create_future())
        self._runs[run.pid] = run
        os.set_blocking(results_r.fileno(), False)
        loop.add_reader(process.sentinel, self._on_sentinel, run)
        loop.add_reader(results_r.fileno(), _read_output, run)
        return run

    async def _supervise(
        self,
        run: _Run,
        lock_may_be_free: asyncio.Event,
        proven_recently: Callable[[], bool],
        grace: float,
    ) -> None:
        try:
            while not run.exited.done():
                await asyncio.wait([run.exited], timeout=RESUME_INTERVAL)
                if not run.exited.done() and proven_recently():
                    _resume(run)
        except BaseException:  # cancelled (or proven_recently() failed): stop the worker first
            await self._stop(run, lock_may_be_free, proven_recently, grace)
            raise

    async def _stop(
        self,
        run: _Run,
        lock_may_be_free: asyncio.Event,
        proven_recently: Callable[[], bool],
        grace: float,
    ) -> None:
        loop = asyncio.get_running_loop()
        if not lock_may_be_free.is_set() and not run.exited.done():
            _signal(run, signal.SIGTERM)
            deadline = loop.time() + grace
            gone_waiter = asyncio.ensure_future(lock_may_be_free.wait())
            waiters: set[asyncio.Future[Any]] = {run.exited, gone_waiter}
            try:
                while not run.exited.done() and not lock_may_be_free.is_set():
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        break
                    # Already stopping, within a bounded grace: a further cancellation
                    # changes nothing (see run()).
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.wait(
                            waiters,
                            timeout=min(RESUME_INTERVAL, remaining),
                            return_when=asyncio.FIRST_COMPLETED,
                        )
                    # A worker frozen with its daemon must run to see ctx.cancelled; but
                    # only resume it while the lease is still good.
                    if not run.exited.done() and _safely(proven_recently):
                        _resume(run)
            finally:
                gone_waiter.cancel()
        if not run.exited.done():
            _signal(run, signal.SIGKILL)

    def _on_sentinel(self, run: _Run) -> None:
        """The forkserver wrote the worker's exit status, or closed the pipe (it died)."""
        loop = asyncio.get_running_loop()
        loop.remove_reader(run.process.sentinel)
        if _readable_bytes(run.process.sentinel) > 0:
            # The forkserver reaps the worker before reporting its status: it is dead.
            if not run.exited.done():
                run.exited.set_result(None)
            return
        # EOF: the forkserver is gone (killed), and with it the only report of the
        # worker's end; the worker itself may well be running still. Kill it (and its
        # group), then watch its pid until it is gone.
        run.lost = True
        _signal(run, signal.SIGKILL)
        _watch_pid(run, loop)

    def _reap(self, run: _Run) -> WorkerFailed | None:
        """Collect a dead worker: its result, its exit status, every fd. Idempotent."""
        if run.reaped:
            return run.failure
        run.reaped = True
        loop = asyncio.get_running_loop()
        loop.remove_reader(run.process.sentinel)
        _read_output(run)  # whatever is left in the pipe: the worker wrote it all before exit
        loop.remove_reader(run.results.fileno())
        run.process.join(0)
        # Anything the worker started and left behind in its group ends with the run.
        # (Its pid is still the group's id while any of them lives, so it cannot have
        # been reused; with none left this finds nothing.)
        _signal(run, signal.SIGKILL, leftovers=True)
        run.failure = _failure(run)
        run.process.close()
        run.results.close()
        run.lifeline.close()
        self._runs.pop(run.pid, None)
        return run.failure


def _failure(run: _Run) -> WorkerFailed | None:
    outcome: Any = None
    if run.output:
        try:
            outcome = json.loads(run.output)
        except ValueError:  # cut short: the worker died while writing it
            outcome = None
    if isinstance(outcome, dict):
        if outcome.get("ok"):
            return None
        return WorkerFailed(str(outcome.get("error")), outcome.get("traceback"))
    if run.lost:
        return WorkerFailed("worker lost: the forkserver exited while it ran")
    code = run.process.exitcode
    if code is not None and code < 0:
        return WorkerFailed(f"worker killed by signal {-code}")
    return WorkerFailed(f"worker exited with code {code}")


def _read_output(run: _Run) -> None:
    """Drain the result pipe without blocking. Read as it comes rather than after the
    exit: a result larger than the pipe's buffer would otherwise block the worker's
    write, and so its exit, for ever."""
    if run.results.closed:
        return
    fd = run.results.fileno()
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return
        if not chunk:  # EOF: the worker (and any child holding a copy) closed it
            asyncio.get_running_loop().remove_reader(fd)
            return
        run.output += chunk


def _signal(run: _Run, sig: int, leftovers: bool = False) -> None:
    """Send ``sig`` to the worker's process group (to the worker alone if it has not made
    its group yet: then it has started nothing)."""
    if run.exited.done() and not leftovers:
        return  # dead and reaped (by the forkserver, or init): its pid may be another's
    try:
        os.killpg(run.pid, sig)
        return
    except ProcessLookupError:
        pass
    except PermissionError:  # a member we may not signal (setuid); the others got it
        return
    if leftovers:
        return  # no group left, and the worker itself is gone
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(run.pid, sig)


def _resume(run: _Run) -> None:
    """SIGCONT the worker's group if the worker is stopped (or /proc cannot tell us).
    Not sent blindly every tick: a grandchild with a SIGCONT handler would see each."""
    if _proc_state(run.pid) in (None, "T"):
        _signal(run, signal.SIGCONT)


def _safely(proven_recently: Callable[[], bool]) -> bool:
    try:
        return bool(proven_recently())
    except Exception:
        return False  # already stopping: a broken check only withholds the resume


async def _wait_dead(run: _Run) -> None:
    """Wait for the worker's death, whatever cancellations come meanwhile: the caller
    must not go on as if the run were over while its code still executes."""
    while not run.exited.done():
        try:
            await asyncio.wait([run.exited])
        except asyncio.CancelledError:
            continue  # re-raised by run() once the worker is dead


def _watch_pid(run: _Run, loop: asyncio.AbstractEventLoop, delay: float = 0.01) -> None:
    """Poll until a worker whose forkserver died is gone (or a zombie: it executes
    nothing). Slow path; only after the forkserver was killed."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(run.pid, os.WNOHANG)  # ours to reap if we are its new parent (pid 1)
    if _proc_state(run.pid) in ("Z", "X", "gone"):
        run.exited.set_result(None)
        return
    if _proc_state(run.pid) is None:  # no /proc: ask the kernel whether it exists
        try:
            os.kill(run.pid, 0)
        except ProcessLookupError:
            run.exited.set_result(None)
            return
    _signal(run, signal.SIGKILL)
    loop.call_later(delay, _watch_pid, run, loop, min(delay * 2, RESUME_INTERVAL))


def _proc_state(pid: int) -> str | None:
    """A process's state letter from /proc ('R', 'S', 'T', 'Z', …), "gone" if it does not
    exist, or None where there is no /proc (not Linux)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return "gone" if os.path.isdir("/proc/self") else None
    except OSError:
        return None
    # "pid (comm) state ...": comm may hold spaces and parentheses; the state follows
    # the last ')'.
    fields = text.rpartition(")")[2].split()
    return fields[0] if fields else None


def _readable_bytes(fd: int) -> int:
    buffer = fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0")
    return int(struct.unpack("i", buffer)[0])
