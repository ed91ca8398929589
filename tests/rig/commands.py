"""The CLI's commands two ways, with one outcome: in this process (click's runner, fast,
for many examples) and as a real process (``run_cli``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from click.testing import CliRunner

from rig.processes import DEFAULT_ENV, run_cli
from scheduler_daemon.cli import cli


@dataclass(frozen=True)
class Outcome:
    code: int
    stdout: str
    stderr: str

    @property
    def line(self) -> str:
        """The last line of stderr: the one a refusal is."""
        return self.stderr.strip().splitlines()[-1] if self.stderr.strip() else ""


def invoke(args: list[str], env: Mapping[str, str]) -> Outcome:
    """``scheduler-daemon ARGS`` in this process. An exception that reaches click's runner
    would have been a traceback on a terminal."""
    # The real processes' defaults too (JSON logs, HTTP off), so that both see one config.
    result = CliRunner().invoke(cli, args, env={**DEFAULT_ENV, **env})
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(
            f"{args} with {env!r}: a traceback ({result.exception!r})"
        ) from result.exception
    return Outcome(result.exit_code, result.stdout, result.stderr)


def real(
    args: list[str], env: Mapping[str, str], cwd: Path | None = None, timeout: float = 60
) -> Outcome:
    """``scheduler-daemon ARGS`` as a process of its own."""
    result = run_cli(args, env, cwd=cwd, timeout=timeout)
    return Outcome(result.returncode, result.stdout, result.stderr)


# Every command that connects; `run` goes through the daemon (HTTP off, see DEFAULT_ENV).
CONNECTING_COMMANDS = [
    ["run"],
    ["preflight"],
    ["migrate"],
    ["status", "--json"],
    ["schedule", "--at", "+1h"],
    ["tasks", "list"],
]
# Long enough that a retried refusal could not pass for a fast one.
REFUSAL_ENV = {"SCHEDULER_DATABASE__STARTUP_BUDGET": "30s"}
# A refusal "at once" ends well inside that budget: the rest is room for starting a CLI
# process on a busy machine (5.8 s seen with two suites side by side).
REFUSED_WITHIN = 20.0
