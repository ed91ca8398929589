"""Where the suite's time goes, and the order that uses it: heaviest test files first.

``make test`` runs files on three workers, each file on one worker (``--dist loadfile``).
xdist hands files out in the order it is given them, so a minute-long file handed out last
runs alone while the other workers idle. Longest-first keeps them busy to the end; this
module orders the collection by each file's measured time, recorded in
``tests/file_durations.json`` by ``make durations`` (``--record-file-durations``).
Files not in the record go first: a new file may well be a slow one.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

RECORD = Path(__file__).resolve().parents[1] / "file_durations.json"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--record-file-durations",
        metavar="PATH",
        default=None,
        help="write each test file's total time (setup, call, teardown) to PATH as JSON",
    )


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--record-file-durations")
    # Under xdist the controller sees every worker's reports: it alone records.
    if path and not hasattr(config, "workerinput"):
        config.pluginmanager.register(DurationRecorder(Path(path)), "file-durations")


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def heaviest_first(items: list[pytest.Item], seconds: dict[str, float]) -> list[pytest.Item]:
    """The items, files in descending recorded time (unrecorded first), each file's tests
    in their own order."""
    unknown = max(seconds.values(), default=0.0) + 1.0
    return sorted(items, key=lambda item: -seconds.get(file_of(item.nodeid), unknown))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if RECORD.exists():
        items[:] = heaviest_first(items, json.loads(RECORD.read_text()))


class DurationRecorder:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.seconds: defaultdict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[file_of(report.nodeid)] += report.duration

    def pytest_sessionfinish(self, exitstatus: int) -> None:
        # Only a whole, passing run's times; merged, so that running a few files updates
        # theirs and keeps the others'.
        if exitstatus != 0:
            return
        seconds = json.loads(self.path.read_text()) if self.path.exists() else {}
        seconds.update({name: round(total, 1) for name, total in self.seconds.items()})
        ordered = dict(sorted(seconds.items(), key=lambda kv: -kv[1]))
        self.path.write_text(json.dumps(ordered, indent=1) + "\n")
