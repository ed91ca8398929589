"""The rig's pytest hooks: which tests run, and why a PostgreSQL test may not skip in CI.

- ``chaos_long`` tests are deselected (not skipped) unless ``--run-long`` is given.
- Every test that needs the ``pg_server`` fixture, directly or not, is marked
  ``postgres``; every test that needs the ``browser`` fixture, ``browser``.
- With ``CI=true`` (or ``1``) a skipped ``postgres`` or ``browser`` test is reported as
  failed: in CI, "no PostgreSQL here" (or "no Chromium here") must not turn that part of
  the suite silently green.

A plugin module rather than conftest code so that tests can load it into pytester.
"""

from __future__ import annotations

import importlib
import os
import shutil
import sys
import tempfile
from collections.abc import Generator, Mapping
from pathlib import Path

import pytest

from .sample_plugin import write_distribution

POSTGRES_FIXTURE = "pg_server"
BROWSER_FIXTURE = "browser"

# The markers whose skips CI=true turns into failures, and what the failure calls them.
CI_MUST_RUN = {"postgres": "PostgreSQL", "browser": "Browser"}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-long",
        action="store_true",
        default=False,
        help="also run the tests marked chaos_long (deselected otherwise)",
    )


_SAMPLE_SITE_KEY = pytest.StashKey[Path]()


def pytest_configure(config: pytest.Config) -> None:
    """Put the sample plugin on the path of the suite and of every process it starts."""
    site = Path(tempfile.mkdtemp(prefix="scheduler-sample-plugin-"))
    config.stash[_SAMPLE_SITE_KEY] = site
    entries = [str(p) for p in write_distribution(site)]
    inherited = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([*entries, *([inherited] if inherited else [])])
    sys.path[:0] = entries
    importlib.invalidate_caches()


def pytest_unconfigure(config: pytest.Config) -> None:
    site = config.stash.get(_SAMPLE_SITE_KEY, None)
    if site is not None:
        shutil.rmtree(site, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        fixturenames = getattr(item, "fixturenames", ())
        if POSTGRES_FIXTURE in fixturenames:
            item.add_marker(pytest.mark.postgres)
        if BROWSER_FIXTURE in fixturenames:
            item.add_marker(pytest.mark.browser)
    if config.getoption("--run-long"):
        return
    long_runs = [item for item in items if item.get_closest_marker("chaos_long")]
    if long_runs:
        config.hook.pytest_deselected(items=long_runs)
        items[:] = [item for item in items if not item.get_closest_marker("chaos_long")]


def ci_is_set(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get("CI", "").strip().lower() in ("true", "1")


def must_run_kind(item: pytest.Item) -> str | None:
    """What CI calls this test if its skips are forbidden ("PostgreSQL", "Browser"), else None."""
    for marker, kind in CI_MUST_RUN.items():
        if item.get_closest_marker(marker) is not None:
            return kind
    return None


def skip_must_fail(
    item: pytest.Item, report: pytest.TestReport, environ: Mapping[str, str] = os.environ
) -> bool:
    """Whether this report is a skip of a PostgreSQL or browser test that CI forbids.

    An expected failure (``xfail``) is reported as a skip too; it is not one here.
    """
    return (
        report.skipped
        and not hasattr(report, "wasxfail")
        and must_run_kind(item) is not None
        and ci_is_set(environ)
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if skip_must_fail(item, report):
        # A skip's longrepr is (path, line, "Skipped: reason").
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        reason = str(reason).removeprefix("Skipped: ")
        report.outcome = "failed"
        report.longrepr = f"{must_run_kind(item)} test skipped, which CI=true forbids: {reason}"
    return report
