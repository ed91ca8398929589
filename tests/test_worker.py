"""Worker processes for sync plugin targets (scheduler_daemon.plugins.workers, .worker_process).

Real processes throughout, no mocks. The targets are the module-level functions below:
a worker imports them by name (``test_worker``, pytest puts tests/ on ``sys.path``).
A target learns where to leave evidence from its logger's bound context
(``log_context={"out": ...}``, read back with ``structlog.get_context(ctx.log)``), the
one channel a job carries for free, and writes JSON there, atomically.

The lifeline and frozen-parent tests need a parent that can be killed and stopped: a
small script (``PARENT_SCRIPT``) started with subprocess, playing the daemon.

Every wait is bounded, with generous slack (a 2-core machine running other suites);
the bounds only catch "never", and the measured times are printed (``pytest -s``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import multiprocessing.forkserver
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import structlog

from scheduler_daemon.config.settings import LogSettings
from scheduler_daemon.plugins.context import TaskContext
from scheduler_daemon.plugins.worker_process import WorkerJob
from scheduler_daemon.plugins.workers import (
    WorkerFailed,
    Workers,
    check_picklable,
)

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/stat").exists(), reason="checks processes through /proc (Linux)"
)

TESTS_DIR = Path(__file__).resolve().parent
SLOT = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
BOUND = 20.0  # seconds: "it happens", on a slow, busy machine


# -- targets (run in worker processes) ------------------------------------------------


def _out(ctx: TaskContext) -> Path:
    return Path(structlog.get_context(ctx.log)["out"])


def _write(path: Path, **data: Any) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(data))
    temporary.replace(path)  # a reader sees all of it or nothing


def nothing() -> None:
    return None


def no_parameters() -> None:
    raise LookupError("called with no arguments")


def raises(ctx: TaskContext) -> None:
    raise ValueError("boom")


def records_context(ctx: TaskContext) -> None:
    _write(
        _out(ctx),
        name=ctx.name,
        slot=ctx.slot.isoformat(),
        instance=ctx.instance,
        fencing_token=ctx.fencing_token,
        lease_is_none=ctx.lease is None,
        cancelled=ctx.cancelled.is_set(),
        pid=os.getpid(),
        pgid=os.getpgid(0),
        probe_env=os.environ.get("WORKER_TEST_PROBE"),
    )


def logs(ctx: TaskContext) -> None:
    ctx.log.info("probe.logged", answer=42)


def waits_for_cancel(ctx: TaskContext) -> None:
    out = _out(ctx)
    _write(out, pid=os.getpid())
    deadline = time.monotonic() + 120
    while not ctx.cancelled.wait(0.02):
        if time.monotonic() > deadline:
            return
    _write(out, pid=os.getpid(), saw_cancelled=True)


def sleeps(ctx: TaskContext) -> None:
    """Ignores ctx.cancelled (SIGTERM still sets it)."""
    _write(_out(ctx), pid=os.getpid())
    time.sleep(120)


def ignores_sigterm(ctx: TaskContext) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _write(_out(ctx), pid=os.getpid())
    time.sleep(120)


def spawns_grandchild(ctx: TaskContext) -> None:
    child = subprocess.Popen(["sleep", "60"])
    _write(_out(ctx), pid=os.getpid(), grandchild=child.pid)
    if structlog.get_context(ctx.log).get("then") == "return":
        return
    time.sleep(120)


def returns_awaitable(ctx: TaskContext) -> Any:
    async def later() -> None:
        pass

    return later()


def exits(ctx: TaskContext) -> None:
    os._exit(3)


def kills_itself(ctx: TaskContext) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class Holder:
    def method(self) -> None:
        pass

    @staticmethod
    def static() -> None:
        pass

    @classmethod
    def klass(cls) -> None:
        pass


HOLDER = Holder()


# -- helpers --------------------------------------------------------------------------


def make_job(
    target: Callable[..., Any], out: Path | None = None, pass_context: bool = True, **bound: Any
) -> WorkerJob:
    context = {"task": "probe", "slot": SLOT.isoformat(), "loop": "plugin", "tick": 1}
    if out is not None:
        context["out"] = str(out)
    return WorkerJob(
        target=target,
        pass_context=pass_context,
        name="probe",
        slot=SLOT,
        instance="test-instance",
        fencing_token=7,
        log=LogSettings(format="json", level="info"),
        log_context={**context, "instance": "test-instance", **bound},
    )


def always() -> bool:
    return True


async def run(workers: Workers, job: WorkerJob, grace: float = 5.0) -> None:
    async with asyncio.timeout(BOUND):
        await workers.run(
            job, lock_may_be_free=asyncio.Event(), proven_recently=always, grace=grace
        )


async def wait_for(path: Path, key: str = "pid", within: float = BOUND) -> dict[str, Any]:
    """What a target wrote to ``path``, once it holds ``key``."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        data = _read_json(path)
        if key in data:
            return data
        await asyncio.sleep(0.01)
    raise AssertionError(f"{path} has no {key!r} after {within:g}s")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    return data


def state(pid: int) -> str | None:
    """The process's state letter, None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    return text.rpartition(")")[2].split()[0]


def dead(pid: int) -> bool:
    return state(pid) in (None, "Z", "X")  # a zombie executes nothing


def poll(condition: Callable[[], bool], timeout: float = BOUND) -> float:
    """Seconds until ``condition()`` held; fails past ``timeout``."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"not within {timeout:g}s")
        time.sleep(0.005)
    return time.monotonic() - started


def kill_group(pid: int) -> None:
    for kill in (os.killpg, os.kill):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            kill(pid, signal.SIGKILL)


@pytest.fixture
async def workers() -> AsyncIterator[Workers]:
    workers = Workers(preload=[__name__])
    await workers.start()
    yield workers
    await workers.close()


# -- running --------------------------------------------------------------------------


async def test_a_target_that_returns(workers: Workers) -> None:
    await run(workers, make_job(nothing, pass_context=False))


async def test_a_target_without_parameters_is_called_without_arguments(
    workers: Workers,
) -> None:
    with pytest.raises(WorkerFailed) as failed:
        await run(workers, make_job(no_parameters, pass_context=False))
    assert failed.value.error == "LookupError: called with no arguments"


async def test_a_raising_target_fails_with_one_line_and_the_traceback(workers: Workers) -> None:
    with pytest.raises(WorkerFailed) as failed:
        await run(workers, make_job(raises))
    assert failed.value.error == "ValueError: boom"
    assert str(failed.value) == "ValueError: boom"
    assert failed.value.traceback is not None
    assert 'raise ValueError("boom")' in failed.value.traceback
    assert failed.value.traceback.rstrip().endswith("ValueError: boom")


async def test_the_context_arrives(
    workers: Workers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The environment too: the daemon's as it is now, not the forkserver's from its start.
    monkeypatch.setenv("WORKER_TEST_PROBE", "now")
    out = tmp_path / "ctx.json"
    await run(workers, make_job(records_context, out))
    seen = json.loads(out.read_text())
    assert seen == {
        "name": "probe",
        "slot": SLOT.isoformat(),
        "instance": "test-instance",
        "fencing_token": 7,
        "lease_is_none": True,
        "cancelled": False,
        "pid": seen["pid"],
        "pgid": seen["pid"],  # a process group of its own
        "probe_env": "now",
    }
    assert seen["pid"] != os.getpid()


async def test_runs_side_by_side(workers: Workers, tmp_path: Path) -> None:
    outs = [tmp_path / f"{index}.json" for index in range(4)]
    await asyncio.gather(*(run(workers, make_job(records_context, out)) for out in outs))
    pids = {json.loads(out.read_text())["pid"] for out in outs}
    assert len(pids) == 4


async def test_a_target_returning_an_awaitable_fails(workers: Workers) -> None:
    with pytest.raises(WorkerFailed) as failed:
        await run(workers, make_job(returns_awaitable))
    assert failed.value.error == ("TypeError: returned an awaitable: make the target `async def`")


async def test_a_worker_that_dies_fails_with_how(workers: Workers) -> None:
    with pytest.raises(WorkerFailed) as exited:
        await run(workers, make_job(exits))
    assert exited.value.error == "worker exited with code 3"
    assert exited.value.traceback is None
    with pytest.raises(WorkerFailed) as killed:
        await run(workers, make_job(kills_itself))
    assert killed.value.error == "worker killed by signal 9"


async def test_a_target_that_cannot_be_sent_fails_without_a_worker(workers: Workers) -> None:
    with pytest.raises(WorkerFailed) as failed:
        await run(workers, make_job(lambda ctx: None))
    assert failed.value.error.startswith("sync targets run in a worker process")
    assert "(a lambda)" in failed.value.error
    assert workers._runs == {}


async def test_a_target_the_worker_cannot_import_fails_with_the_import_error(
    workers: Workers, tmp_path: Path
) -> None:
    # A module the daemon has imported and the worker cannot find (deleted since).
    module = tmp_path / "only_here_worker_probe.py"
    module.write_text("def target(ctx):\n    pass\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import only_here_worker_probe  # type: ignore[import-not-found]

        module.unlink()
        with pytest.raises(WorkerFailed) as failed:
            await run(workers, make_job(only_here_worker_probe.target))
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("only_here_worker_probe", None)
    assert failed.value.error == "ModuleNotFoundError: No module named 'only_here_worker_probe'"
    assert failed.value.traceback is not None


async def test_log_lines_of_the_worker_are_json_with_the_bound_fields(tmp_path: Path) -> None:
    # The worker's stderr is the daemon's: run the daemon's part in a process of its own
    # whose stderr is a file (not a terminal, so "auto" means JSON).
    with Parent(tmp_path, "logs") as parent:
        parent.wait(BOUND)
        assert parent.returncode == 0, parent.stderr()
    lines = [json.loads(line) for line in parent.stderr().splitlines() if line.startswith("{")]
    logged = [line for line in lines if line.get("event") == "probe.logged"]
    assert len(logged) == 1, parent.stderr()
    assert logged[0] | {"timestamp": "-"} == {
        "event": "probe.logged",
        "answer": 42,
        "level": "info",
        "task": "probe",
        "slot": SLOT.isoformat(),
        "loop": "plugin",
        "tick": 1,
        "instance": "parent-script",
        "out": str(parent.out),
        "timestamp": "-",
    }


# -- stopping -------------------------------------------------------------------------


async def cancel(task: asyncio.Task[None]) -> float:
    """Cancel ``task``; the seconds until it ended, raising CancelledError."""
    started = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(BOUND * 3):
            await task
    return time.monotonic() - started


async def test_cancelled_when_gone_the_worker_is_killed_at_once(
    workers: Workers, tmp_path: Path
) -> None:
    out = tmp_path / "out.json"
    lock_may_be_free = asyncio.Event()
    task = asyncio.create_task(
        workers.run(
            make_job(ignores_sigterm, out),
            lock_may_be_free=lock_may_be_free,
            proven_recently=always,
            grace=60,
        )
    )
    pid = (await wait_for(out))["pid"]
    lock_may_be_free.set()
    elapsed = await cancel(task)
    print(f"\ngone + cancel -> worker dead and reaped in {elapsed * 1000:.1f} ms")
    assert dead(pid)  # "done" means dead
    assert elapsed < 5.0
    assert workers._runs == {}


async def test_cancelled_the_target_sees_ctx_cancelled_and_returns(
    workers: Workers, tmp_path: Path
) -> None:
    out = tmp_path / "out.json"
    task = asyncio.create_task(
        workers.run(
            make_job(waits_for_cancel, out),
            lock_may_be_free=asyncio.Event(),
            proven_recently=always,
            grace=60,
        )
    )
    pid = (await wait_for(out))["pid"]
    elapsed = await cancel(task)
    print(f"\nSIGTERM -> target returned, worker reaped in {elapsed * 1000:.1f} ms")
    assert json.loads(out.read_text()) == {"pid": pid, "saw_cancelled": True}
    assert dead(pid)
    assert elapsed < 30.0  # well inside the grace: it stopped by itself


async def test_cancelled_a_target_ignoring_it_is_killed_at_the_grace(
    workers: Workers, tmp_path: Path
) -> None:
    out = tmp_path / "out.json"
    task = asyncio.create_task(
        workers.run(
            make_job(sleeps, out),
            lock_may_be_free=asyncio.Event(),
            proven_recently=always,
            grace=1.0,
        )
    )
    pid = (await wait_for(out))["pid"]
    started = time.monotonic()
    task.cancel()
    await asyncio.sleep(0.3)
    task.cancel()  # a second cancellation is absorbed: the grace still runs out first
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(BOUND):
            await task
    elapsed = time.monotonic() - started
    print(f"\nSIGTERM ignored -> SIGKILL after {elapsed:.2f} s (grace 1 s)")
    assert dead(pid)
    assert 0.9 <= elapsed < 10.0


async def test_gone_during_the_grace_kills_at_once(workers: Workers, tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    lock_may_be_free = asyncio.Event()
    task = asyncio.create_task(
        workers.run(
            make_job(ignores_sigterm, out),
            lock_may_be_free=lock_may_be_free,
            proven_recently=always,
            grace=120,
        )
    )
    pid = (await wait_for(out))["pid"]
    task.cancel()
    await asyncio.sleep(0.3)
    assert not task.done()  # waiting out the grace
    started = time.monotonic()
    lock_may_be_free.set()
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(BOUND):
            await task
    elapsed = time.monotonic() - started
    print(f"\ngone during the grace -> worker dead in {elapsed * 1000:.1f} ms")
    assert dead(pid)
    assert elapsed < 5.0


async def test_a_timeout_around_run_is_a_timeout(workers: Workers, tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(1.0):
            await workers.run(
                make_job(waits_for_cancel, out),
                lock_may_be_free=asyncio.Event(),
                proven_recently=always,
                grace=30,
            )
    assert json.loads(out.read_text())["saw_cancelled"] is True


async def test_a_grandchild_dies_with_the_worker(workers: Workers, tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    lock_may_be_free = asyncio.Event()
    task = asyncio.create_task(
        workers.run(
            make_job(spawns_grandchild, out),
            lock_may_be_free=lock_may_be_free,
            proven_recently=always,
            grace=60,
        )
    )
    seen = await wait_for(out, "grandchild")
    try:
        assert not dead(seen["grandchild"])
        lock_may_be_free.set()
        await cancel(task)
        assert dead(seen["pid"])
        # Reparented to init when the worker died, then reaped: poll.
        poll(lambda: dead(seen["grandchild"]), timeout=5.0)
    finally:
        kill_group(seen["pid"])


async def test_a_grandchild_left_behind_by_a_returning_target_is_killed(
    workers: Workers, tmp_path: Path
) -> None:
    out = tmp_path / "out.json"
    await run(workers, make_job(spawns_grandchild, out, then="return"))
    grandchild = json.loads(out.read_text())["grandchild"]
    try:
        poll(lambda: dead(grandchild), timeout=5.0)
    finally:
        kill_group(grandchild)


async def test_close_kills_what_still_runs(workers: Workers, tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    task = asyncio.create_task(
        workers.run(
            make_job(ignores_sigterm, out),
            lock_may_be_free=asyncio.Event(),
            proven_recently=always,
            grace=60,
        )
    )
    pid = (await wait_for(out))["pid"]
    async with asyncio.timeout(BOUND):
        await workers.close()
    assert dead(pid)
    with pytest.raises(WorkerFailed) as failed:
        await task
    assert failed.value.error == "worker killed by signal 9"


async def test_a_worker_whose_forkserver_dies_is_killed_and_reported(
    workers: Workers, tmp_path: Path
) -> None:
    # The forkserver reports a worker's exit; killed, it never will. The worker must not
    # be taken for dead meanwhile: it is killed, and waited for.
    out = tmp_path / "out.json"
    task = asyncio.create_task(
        workers.run(
            make_job(ignores_sigterm, out),
            lock_may_be_free=asyncio.Event(),
            proven_recently=always,
            grace=60,
        )
    )
    pid = (await wait_for(out))["pid"]
    server = multiprocessing.forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
    os.kill(server, signal.SIGKILL)
    with pytest.raises(WorkerFailed) as failed:
        async with asyncio.timeout(BOUND):
            await task
    assert failed.value.error == "worker lost: the forkserver exited while it ran"
    assert dead(pid)
    # multiprocessing starts a new forkserver once it sees the old one exited (a zombie
    # it can reap); until then it would still try the old one's socket.
    await asyncio.to_thread(poll, lambda: dead(server))
    await run(workers, make_job(nothing, pass_context=False))  # on a new forkserver


# -- the daemon's death and freezing --------------------------------------------------

PARENT_SCRIPT = """
import asyncio
import sys
from datetime import UTC, datetime

import test_worker
from scheduler_daemon.config.settings import LogSettings
from scheduler_daemon.plugins.worker_process import WorkerJob
from scheduler_daemon.plugins.workers import Workers


async def main() -> None:
    target, out = sys.argv[1], sys.argv[2]
    workers = Workers(preload=["test_worker"])
    await workers.start()
    job = WorkerJob(
        target=getattr(test_worker, target),
        pass_context=True,
        name="probe",
        slot=test_worker.SLOT,
        instance="parent-script",
        fencing_token=7,
        log=LogSettings(format="auto", level="info"),
        log_context={
            "task": "probe", "slot": test_worker.SLOT.isoformat(), "loop": "plugin",
            "tick": 1, "instance": "parent-script", "out": out,
        },
    )
    await workers.run(job, lock_may_be_free=asyncio.Event(), proven_recently=lambda: True, grace=5)
    await workers.close()


if __name__ == "__main__":
    asyncio.run(main())
"""


class Parent:
    """The daemon's part, in a process of its own (so that it can be killed, stopped)."""

    def __init__(self, tmp_path: Path, target: str) -> None:
        script = tmp_path / "parent.py"
        script.write_text(PARENT_SCRIPT)
        self.out = tmp_path / "out.json"
        self._stderr_path = tmp_path / "parent.stderr"
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), os.environ["PYTHONPATH"]]),
        }
        with self._stderr_path.open("wb") as stderr:
            self.process = subprocess.Popen(
                [sys.executable, str(script), target, str(self.out)],
                env=env,
                cwd=tmp_path,
                stdin=subprocess.DEVNULL,
                stdout=stderr,
                stderr=stderr,
            )
        self.worker_pid: int | None = None

    def __enter__(self) -> Parent:
        return self

    def __exit__(self, *_: object) -> None:
        self.process.kill()
        self.process.wait()
        if self.worker_pid is not None:
            kill_group(self.worker_pid)

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    def wait(self, timeout: float) -> None:
        self.process.wait(timeout)

    def stderr(self) -> str:
        return self._stderr_path.read_text()

    def worker(self) -> dict[str, Any]:
        """What the target wrote once running (its pid), waiting for it."""
        deadline = time.monotonic() + BOUND * 2  # the parent's start-up included
        while time.monotonic() < deadline:
            if self.out.exists():
                data: dict[str, Any] = json.loads(self.out.read_text())
                self.worker_pid = data["pid"]
                return data
            if self.process.poll() is not None:
                raise AssertionError(f"the parent exited: {self.stderr()}")
            time.sleep(0.01)
        raise AssertionError(f"no worker: {self.stderr()}")


def test_a_worker_dies_with_its_daemon_even_sigkilled(tmp_path: Path) -> None:
    with Parent(tmp_path, "spawns_grandchild") as parent:
        seen = parent.worker()
        parent.process.send_signal(signal.SIGKILL)
        parent.wait(BOUND)
        elapsed = poll(lambda: dead(seen["pid"]))
        print(f"\ndaemon SIGKILLed -> worker gone in {elapsed * 1000:.0f} ms")
        poll(lambda: dead(seen["grandchild"]), timeout=5.0)
        assert elapsed < 5.0  # ~1 s is the promise; the rest is slack for a busy machine


def test_a_frozen_daemon_freezes_its_worker(tmp_path: Path) -> None:
    with Parent(tmp_path, "sleeps") as parent:
        pid = parent.worker()["pid"]
        assert state(pid) != "T"

        parent.process.send_signal(signal.SIGSTOP)
        elapsed = poll(lambda: state(pid) == "T")
        print(f"\ndaemon SIGSTOPped -> worker stopped in {elapsed * 1000:.0f} ms")
        assert elapsed < 3.0  # ~0.5 s is the promise

        # Resumed, the daemon resumes its worker (its lease is fresh: proven_recently() is True).
        parent.process.send_signal(signal.SIGCONT)
        elapsed = poll(lambda: state(pid) not in ("T", None))
        print(f"daemon SIGCONTed -> worker running again in {elapsed * 1000:.0f} ms")

        # Frozen, then killed: the stopped worker cannot read its lifeline, but it is not
        # left stopped for ever (its forkserver exits with the daemon; the orphaned
        # process group gets SIGHUP and SIGCONT from the kernel).
        parent.process.send_signal(signal.SIGSTOP)
        poll(lambda: state(pid) == "T")
        parent.process.send_signal(signal.SIGKILL)
        parent.wait(BOUND)
        elapsed = poll(lambda: dead(pid))
        print(f"frozen daemon SIGKILLed -> stopped worker gone in {elapsed * 1000:.0f} ms")


async def test_the_lifeline_write_end_is_held_by_the_daemon_alone(
    workers: Workers, tmp_path: Path
) -> None:
    out = tmp_path / "out.json"
    lock_may_be_free = asyncio.Event()
    task = asyncio.create_task(
        workers.run(
            make_job(sleeps, out),
            lock_may_be_free=lock_may_be_free,
            proven_recently=always,
            grace=60,
        )
    )
    try:
        pid = (await wait_for(out))["pid"]
        lifeline = workers._runs[pid].lifeline
        holders = pipe_holders(os.fstat(lifeline.fileno()).st_ino)
        assert holders == {(os.getpid(), "w"), (pid, "r")}
        forkserver = multiprocessing.forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
        assert forkserver not in {holder for holder, _ in holders}
    finally:
        lock_may_be_free.set()
        await cancel(task)


def pipe_holders(inode: int) -> set[tuple[int, str]]:
    """(pid, "r" or "w") for every fd, in every process we can see, on pipe ``inode``."""
    holders = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fds = list((proc / "fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(fd) != f"pipe:[{inode}]":
                    continue
                info = (proc / "fdinfo" / fd.name).read_text()
            except OSError:
                continue
            flags = int(info.split("flags:")[1].split()[0], 8)
            holders.add((int(proc.name), "w" if flags & os.O_ACCMODE == os.O_WRONLY else "r"))
    return holders


# -- leaks ----------------------------------------------------------------------------


def open_fds() -> list[str]:
    return sorted(
        f"{fd.name}->{os.readlink(fd)}"
        for fd in Path("/proc/self/fd").iterdir()
        if fd.name.isdigit() and _readable(fd)
    )


def _readable(fd: Path) -> bool:
    try:
        os.readlink(fd)
    except OSError:  # the fd listing /proc/self/fd itself, closed meanwhile
        return False
    return True


def children_of(pids: set[int]) -> Iterator[tuple[int, str]]:
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) in pids:
            yield int(proc.name), fields[0]


async def test_no_fd_or_process_is_left_behind(workers: Workers, tmp_path: Path) -> None:
    await run(workers, make_job(nothing, pass_context=False))  # whatever opens lazily
    before = open_fds()
    started = time.monotonic()
    for index in range(50):
        if index % 10 == 1:
            with pytest.raises(WorkerFailed):
                await run(workers, make_job(raises))
        elif index % 10 == 2:
            with pytest.raises(WorkerFailed):
                await run(workers, make_job(kills_itself))
        elif index % 10 == 3:
            out = tmp_path / f"{index}.json"
            task = asyncio.create_task(
                workers.run(
                    make_job(sleeps, out),
                    lock_may_be_free=asyncio.Event(),
                    proven_recently=always,
                    grace=0.1,
                )
            )
            await wait_for(out)
            await cancel(task)
        else:
            await run(workers, make_job(nothing, pass_context=False))
    print(f"\n50 runs in {time.monotonic() - started:.2f} s")
    assert open_fds() == before
    assert workers._runs == {}
    forkserver = multiprocessing.forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
    # The forkserver reaps its workers; none is left, running or zombie; nor any zombie
    # of ours.
    assert list(children_of({forkserver})) == []
    assert [child for child in children_of({os.getpid()}) if child[1] == "Z"] == []


# -- check_picklable ------------------------------------------------------------------


def test_importable_targets_are_accepted() -> None:
    assert check_picklable(records_context) is None
    assert check_picklable(nothing) is None
    assert check_picklable(Holder.static) is None
    assert check_picklable(Holder.klass) is None
    assert check_picklable(Holder.method) is None  # a function reached through its class
    assert check_picklable(os.getpid) is None


def test_targets_that_cannot_be_imported_are_refused_with_a_reason() -> None:
    def closure(ctx: TaskContext) -> None:
        pass

    class Local:
        def run(self) -> None:
            pass

    prefix = (
        "sync targets run in a worker process, so they must be importable module-level callables: "
    )
    cases: list[tuple[Callable[..., Any], str]] = [
        (lambda ctx: None, "(a lambda)"),
        (closure, "(defined inside a function)"),
        (Local().run, "(defined inside a function)"),
        (HOLDER.method, "(a method bound to an object, which each run would get a copy of)"),
        (functools.partial(nothing), "(an object, which each run would get a copy of)"),
    ]
    for target, why in cases:
        reason = check_picklable(target)
        assert reason is not None, target
        assert reason.startswith(prefix + repr(target)), reason
        assert reason.endswith(why), reason
        assert "\n" not in reason
