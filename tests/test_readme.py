"""The README's commands, run as written."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rig.processes import Daemons, run_cli

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def shell_blocks() -> list[str]:
    return re.findall(r"```sh\n(.*?)```", README.read_text(), flags=re.S)


def test_three_replicas_on_one_host_start_as_written(pg_url: str, daemons: Daemons) -> None:
    """The "start as many as you like" snippet: three replicas, one leader, two standbys."""
    (block,) = [b for b in shell_blocks() if "export SCHEDULER_DATABASE_URL=" in b]
    lines = block.strip().splitlines()
    assert lines[0].startswith("export SCHEDULER_DATABASE_URL=postgresql://")
    assert lines[-1] == "scheduler-daemon status"
    # The reader's database is ours; the rest runs unchanged, then waits for its replicas.
    script = "\n".join([f"export SCHEDULER_DATABASE_URL={pg_url}", *lines[1:-1], "wait"])
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])
    shell = daemons.spawn(
        ["bash", "-c", script],
        {"PATH": path, "SCHEDULER_LOG__FORMAT": "json", "PYTHONUNBUFFERED": "1"},
        name="readme",
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert shell.poll() is None, shell.output()[-3000:]
            result = run_cli(["status", "--json"], {"SCHEDULER_DATABASE_URL": pg_url})
            assert result.returncode == 0, result.stderr
            loops = json.loads(result.stdout)["loops"]
            if all(i["leader"] and len(i["standbys"]) == 2 for i in loops.values()):
                break
            assert time.monotonic() < deadline, f"{loops}\n{shell.output()[-3000:]}"
            time.sleep(0.3)
        # No replica refused to start (a port clash is an error line, then exit 78).
        errors = [line for line in shell.output().splitlines() if '"level": "error"' in line]
        assert not errors, errors
    finally:
        # The replicas are the shell's children, in its session: stop them all.
        os.killpg(shell.popen.pid, signal.SIGTERM)
    shell.wait(60)

    def stopped() -> int:
        return sum(e["event"] == "daemon.stopped" for e in shell.log_events())

    deadline = time.monotonic() + 60
    while stopped() < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert stopped() == 3, shell.output()[-3000:]


@pytest.mark.parametrize("needle", ['export PATH="$PWD/.venv/bin:$PATH"'])
def test_the_quick_start_says_where_the_command_lives(needle: str) -> None:
    assert any(needle in block for block in shell_blocks())
    assert (Path(sys.executable).parent / "scheduler-daemon").exists()


def test_make_run_loads_no_test_plugin(tmp_path: Path) -> None:
    """The venv `make run` uses has no sample publisher or tasks: only the suite sees them."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = (
        "import importlib.metadata as m; print(sorted(e.name for g in"
        " ('scheduler_daemon.plugins', 'scheduler_daemon.publishers')"
        " for e in m.entry_points(group=g)))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert "sample" not in result.stdout
    assert "effects" not in result.stdout
    # While the suite itself does see them.
    assert (
        "sample"
        in subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path
        ).stdout
    )


def test_the_performance_page_shows_the_committed_results(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/performance.md's tables are bench/results/*.md as committed (`make bench`
    refreshes them; `python -m bench.docs` does it by hand), and every result has its
    block."""
    monkeypatch.syspath_prepend(str(ROOT))
    from bench import docs

    page = docs.DOC.read_text()
    assert docs.render(page) == page, "run `.venv/bin/python -m bench.docs`"
    shown = {match[2] for match in docs.BLOCK.finditer(page)}
    results = {path.stem for path in (ROOT / "bench" / "results").glob("*.md")}
    assert shown == results
