"""External tools the tests drive (hadolint, Docker Compose, promtool, ...)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from .plugin import ci_is_set


def find_tool(name: str, installed_by: str) -> str:
    """A tool from the venv (the dev extra installs it) or PATH.

    Missing, the test skips, except under CI, where the dev extra (or .ci/run) must have
    installed it.
    """
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        message = f"{name} not found (installed by {installed_by})"
        if ci_is_set():
            pytest.fail(message)
        pytest.skip(message)
    return found
