"""docs/guarantees.md names real things: every repository path it mentions exists, every
``path::test_name`` is a test defined in that file, every bare ``test_name`` is defined
somewhere under tests/, and its relative links resolve. Pure: files only, no database."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "guarantees.md"

# A backticked repository path, optionally with ``::test_name`` and a parametrize id:
# `scheduler_daemon/loops/publish.py`, `tests/test_failover.py::test_x[session]`.
PATH = re.compile(
    r"`((?:scheduler_daemon|tests|docs|bench|deploy)/[\w./-]*)(?:::(\w+)(?:\[[^\]`]*\])?)?`"
)
# A bare test name in backticks (not after ``::``), with an optional parametrize id.
BARE_TEST = re.compile(r"(?<![:\w])`(test_\w+)(?:\[[^\]`]*\])?`")
# A Markdown link to a file of this repository (no scheme, not only a fragment).
LINK = re.compile(r"\]\((?![a-z][a-z0-9+.-]*:)([^)#\s]+)(?:#[^)\s]*)?\)")


def defines(source: str, name: str) -> bool:
    return re.search(rf"^\s*(?:async\s+)?def\s+{re.escape(name)}\s*\(", source, re.M) is not None


def test_every_path_and_test_it_names_exists() -> None:
    text = DOC.read_text()
    named = PATH.findall(text)
    assert len(named) >= 40, f"too few paths found to prove anything: {len(named)}"
    missing, undefined = [], []
    for path, test in named:
        target = ROOT / path
        if not (target.is_dir() if path.endswith("/") else target.is_file()):
            missing.append(path)
        elif test and not defines(target.read_text(), test):
            undefined.append(f"{path}::{test}")
    assert not missing, f"docs/guarantees.md names paths that do not exist: {sorted(set(missing))}"
    assert not undefined, f"docs/guarantees.md names tests that are not defined: {undefined}"


def test_every_bare_test_name_is_defined_under_tests() -> None:
    names = set(BARE_TEST.findall(DOC.read_text()))
    sources = [p.read_text() for p in (ROOT / "tests").rglob("test_*.py")]
    undefined = sorted(n for n in names if not any(defines(s, n) for s in sources))
    assert not undefined, f"docs/guarantees.md names tests defined nowhere: {undefined}"


def test_its_relative_links_resolve() -> None:
    targets = LINK.findall(DOC.read_text())
    assert targets, "no links found"
    broken = sorted({t for t in targets if not (DOC.parent / t).resolve().exists()})
    assert not broken, f"docs/guarantees.md links to files that do not exist: {broken}"


def test_each_of_the_eight_promises_has_its_section() -> None:
    headings = re.findall(r"^### (\d)\. ", DOC.read_text(), re.M)
    assert headings == [str(n) for n in range(1, 9)], headings


def test_the_pattern_catches_what_it_must() -> None:
    """The regexes are not vacuous: a made-up path and test are caught."""
    sample = "see `tests/test_failover.py::test_nope[session]` and `scheduler_daemon/nope.py`"
    assert PATH.findall(sample) == [
        ("tests/test_failover.py", "test_nope"),
        ("scheduler_daemon/nope.py", ""),
    ]
    assert not defines((ROOT / "tests" / "test_failover.py").read_text(), "test_nope")
    assert BARE_TEST.findall("`test_a[x]` and `p.py::test_b`") == ["test_a"]
