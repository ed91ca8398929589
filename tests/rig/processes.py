"""Real scheduler-daemon processes for acceptance tests, and one-shot CLI runs.

Output goes to files, never pipes: nobody has to drain a pipe for the daemon to make
progress, and what it wrote survives a SIGKILL. The daemon logs one JSON object per
line (structlog) to stderr; ``log_events()`` parses them and skips any other line
(a traceback, a warning printed before logging is configured).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

CLI: tuple[str, ...] = (sys.executable, "-m", "scheduler_daemon")

# Machine-readable logs, no HTTP port to collide on, and prints that reach the file at
# once (a SIGKILLed process cannot flush its buffers). A test's own env overrides these.
DEFAULT_ENV: Mapping[str, str] = {
    "SCHEDULER_LOG__FORMAT": "json",
    "SCHEDULER_HTTP__ENABLED": "false",
    "PYTHONUNBUFFERED": "1",
}

TAIL_LINES = 40


def daemon_env(env: Mapping[str, str]) -> dict[str, str]:
    """Our environment minus every ``SCHEDULER_*`` variable, then the defaults, then `env`.

    Dropping the caller's SCHEDULER_* settings keeps a developer's shell (or the
    SCHEDULER_TEST_DATABASE_URL meant for the rig) from changing what a test runs.
    """
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("SCHEDULER_")}
    merged = {**inherited, **DEFAULT_ENV, **env}
    # A test's own PYTHONPATH goes first; the suite's (the sample plugin) stays behind it.
    if "PYTHONPATH" in env and inherited.get("PYTHONPATH"):
        merged["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], inherited["PYTHONPATH"]])
    return merged


def sitecustomize(directory: Path, code: str) -> str:
    """A ``PYTHONPATH`` entry (`directory`, made here) whose ``sitecustomize`` runs `code`
    as a process starts, before anything of the daemon's is imported: how a test plants a
    fault in a real process."""
    directory.mkdir()
    (directory / "sitecustomize.py").write_text(code)
    return str(directory)


def run_cli(
    args: Sequence[str],
    env: Mapping[str, str] | None = None,
    timeout: float = 60.0,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``scheduler-daemon ARGS`` to completion and capture rc, stdout and stderr.

    Give `cwd` (or a database URL in `env`) unless the default ``./scheduler.db`` in
    the current directory is what you mean.
    """
    return subprocess.run(
        [*CLI, *args],
        env=daemon_env(env or {}),
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


class DaemonProcess:
    """One process started by `Daemons`, its output in files under its own directory."""

    def __init__(self, name: str, popen: subprocess.Popen[bytes], directory: Path) -> None:
        self.name = name
        self.popen = popen
        self.directory = directory
        self._log = _JsonLines(self.stderr_path)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def stdout_path(self) -> Path:
        return self.directory / "stdout.log"

    @property
    def stderr_path(self) -> Path:
        return self.directory / "stderr.log"

    def signal(self, sig: int) -> None:
        """Send `sig` (SIGTERM, SIGKILL, SIGSTOP, SIGCONT...); a no-op once it has exited."""
        self.popen.send_signal(sig)

    def poll(self) -> int | None:
        return self.popen.poll()

    def wait(self, timeout: float = 30.0) -> int:
        """The exit code (negative: killed by that signal); fails the test on timeout."""
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(self.summary(f"still running after {timeout}s")) from None

    def log_events(self) -> list[dict[str, Any]]:
        """Every JSON log line written to stderr so far, parsed."""
        return self._log.read()

    def events(self, name: str) -> list[dict[str, Any]]:
        """The log lines so far whose ``event`` is `name`."""
        return [entry for entry in self.log_events() if entry.get("event") == name]

    def wait_for_log(
        self, event: str | Collection[str], timeout: float = 30.0, **fields: Any
    ) -> dict[str, Any]:
        """The first log line whose ``event`` is `event` (or one of them) and whose
        `fields` match.

        Polls until it appears; fails the test at `timeout`, or as soon as the process
        has exited without writing it. Blocking: from an async test, use
        ``await asyncio.to_thread(daemon.wait_for_log, ...)``.
        """
        wanted_events = {event} if isinstance(event, str) else set(event)
        deadline = time.monotonic() + timeout
        checked = 0
        while True:
            # Read after polling, so a line written just before exiting is still seen.
            exited = self.poll() is not None
            events = self.log_events()
            for entry in events[checked:]:
                if entry.get("event") in wanted_events and all(
                    entry.get(key) == value for key, value in fields.items()
                ):
                    return entry
            checked = len(events)
            if exited or time.monotonic() >= deadline:
                wanted = f"{event!r}" + (f" with {fields}" if fields else "")
                raise AssertionError(self.summary(f"no log event {wanted} after {timeout}s"))
            time.sleep(0.02)

    def output(self) -> str:
        """Everything written so far: stdout, then stderr (the logs, usually the news)."""
        return _read_text(self.stdout_path) + _read_text(self.stderr_path)

    def kill(self) -> None:
        """SIGKILL and reap; SIGCONT first so a SIGSTOPped process dies at once too."""
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)
        self.popen.wait()

    def summary(self, problem: str = "", lines: int = TAIL_LINES) -> str:
        """Its name, pid and state (and `problem`), then the last `lines` lines of its
        output: what a failure says of it."""
        returncode = self.poll()
        state = "still running" if returncode is None else f"exited with {returncode}"
        output = self.output().splitlines()
        return (
            f"{self.name} (pid {self.pid}, {state}, {self.directory})"
            + (f": {problem}" if problem else "")
            + f"\n--- last {min(lines, len(output))} of {len(output)} lines of output ---\n"
            + "\n".join(output[-lines:])
        )

    def __repr__(self) -> str:
        return f"<DaemonProcess {self.name} pid={self.pid} returncode={self.popen.returncode}>"


class Daemons:
    """Starts daemon processes and, on ``close()``, kills whatever is still alive."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.processes: list[DaemonProcess] = []

    def start(
        self,
        env: Mapping[str, str],
        args: Sequence[str] = ("run",),
        name: str | None = None,
    ) -> DaemonProcess:
        """``scheduler-daemon ARGS`` in a new session, with `env` on top of `daemon_env`."""
        return self.spawn([*CLI, *args], daemon_env(env), name)

    def spawn(
        self, argv: Sequence[str], env: Mapping[str, str], name: str | None = None
    ) -> DaemonProcess:
        """Start any command the way `start` starts the daemon (the rig's own tests use it).

        Its working directory is its own, so relative paths (the default SQLite file)
        stay inside it.
        """
        name = name or f"daemon{len(self.processes) + 1}"
        directory = self.directory / name
        directory.mkdir(parents=True, exist_ok=False)  # a reused name would mix logs
        with (
            (directory / "stdout.log").open("wb") as stdout,
            (directory / "stderr.log").open("wb") as stderr,
        ):
            # A new session: signals meant for pytest (Ctrl-C) do not reach it, and it
            # does not get the terminal.
            popen = subprocess.Popen(
                argv,
                env=dict(env),
                cwd=directory,
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                start_new_session=True,
            )
        process = DaemonProcess(name, popen, directory)
        self.processes.append(process)
        return process

    def close(self) -> None:
        for process in self.processes:
            process.kill()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def start_replicas(
    daemons: Daemons,
    envs: Sequence[tuple[str, Mapping[str, str]]],
    args: Sequence[str] = ("run",),
    *,
    loop: str = "plugin",
    ready: str | Collection[str] = ("leader.acquired", "leader.waiting"),
    leader_first: bool = False,
    wrap: Callable[[int, list[str]], Sequence[str]] | None = None,
    timeout: float = 30.0,
) -> list[DaemonProcess]:
    """Start one replica per ``(name, env)`` of `envs`, each running ``scheduler-daemon
    ARGS``, and return them in that order once every one has logged a `ready` event for
    `loop` (by default: it leads, or it waits as a standby).

    `leader_first`: start the first alone and wait until it logs ``leader.acquired`` for
    `loop` before starting the others, so that the first one returned is the leader.
    `wrap(n, argv)`: the command line that replica n really runs (inside network
    namespace n, say), started with `daemon_env` like any other.
    """
    started: list[DaemonProcess] = []
    for n, (name, env) in enumerate(envs):
        if wrap is None:
            started.append(daemons.start(env, args, name=name))
        else:
            started.append(daemons.spawn(wrap(n, [*CLI, *args]), daemon_env(env), name))
        if leader_first and n == 0:
            started[0].wait_for_log("leader.acquired", timeout, loop=loop)
    for process in started:
        process.wait_for_log(ready, timeout, loop=loop)
    return started


class _JsonLines:
    """Parses a growing file of JSON lines incrementally, skipping lines that are not."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._offset = 0
        self._partial = b""
        self._events: list[dict[str, Any]] = []

    def read(self) -> list[dict[str, Any]]:
        try:
            with self._path.open("rb") as file:
                file.seek(self._offset)
                chunk = file.read()
        except FileNotFoundError:
            return []
        self._offset += len(chunk)
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()  # unfinished: completed by a later write
        for line in lines:
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict):
                self._events.append(entry)
        return list(self._events)


def _read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
