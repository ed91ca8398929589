"""A real browser for tests: Debian's Chromium, driven by Playwright's sync API.

Playwright's own browser builds are never downloaded (no ``playwright install``): the
browser is the OS package's, given to Playwright as ``executable_path``. It is
``$SCHEDULER_TEST_CHROMIUM`` when set, else the first of /usr/bin/chromium,
/usr/bin/chromium-browser and ``chromium`` / ``chromium-browser`` on PATH. Where there is
none, or Playwright is not installed, the ``browser`` fixture skips with the reason; under
``CI=true`` such a skip of a ``browser`` test is a failure (see `rig.plugin`).

The sync API marks its event loop as the thread's running loop from its first call until it
stops, so while a browser is up, ``asyncio.run`` and pytest-asyncio tests in the same
thread fail ("cannot be called from a running event loop"). The fixtures therefore keep
one browser per test module, not per session, and a module with browser tests holds sync
tests only; coroutines the test needs run in another thread (as `rig.databases.run_sync`
does).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from playwright.sync_api import Browser

CHROMIUM_ENV = "SCHEDULER_TEST_CHROMIUM"
CHROMIUM_PATHS = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
CHROMIUM_NAMES = ("chromium", "chromium-browser")

# What a page may take before a test gives up on it (Playwright's default is 30 s).
DEFAULT_TIMEOUT_MS = 10_000


class BrowserUnavailable(RuntimeError):
    """No Chromium or no Playwright here; the message says which, for the skip."""


def _executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def find_chromium(environ: Mapping[str, str] = os.environ) -> str:
    """The path of the Chromium to drive; raises `BrowserUnavailable` when there is none."""
    override = environ.get(CHROMIUM_ENV, "").strip()
    if override:
        found = override if _executable(override) else shutil.which(override)
        if found is None:
            raise BrowserUnavailable(f"{CHROMIUM_ENV}={override} is not an executable")
        return found
    for path in CHROMIUM_PATHS:
        if _executable(path):
            return path
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found is not None:
            return found
    raise BrowserUnavailable(
        f"no Chromium: none of {', '.join(CHROMIUM_PATHS)} nor {'/'.join(CHROMIUM_NAMES)} on"
        f" PATH (Debian: apt-get install chromium; or set {CHROMIUM_ENV})"
    )


def chromium_args(euid: int | None = None) -> list[str]:
    """Command-line flags for a headless Chromium in a container.

    Containers give /dev/shm 64 MB, which Chromium outgrows; and its sandbox refuses to
    start as root, so root (only) runs without it.
    """
    args = ["--disable-dev-shm-usage"]
    if (os.geteuid() if euid is None else euid) == 0:
        args.append("--no-sandbox")
    return args


@contextmanager
def launched_chromium(executable: str | None = None, **launch_options: Any) -> Iterator[Browser]:
    """Start Playwright and a headless Chromium; both stop when the block ends.

    Raises `BrowserUnavailable` when Playwright is not installed or there is no Chromium.
    """
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as exc:
        raise BrowserUnavailable(f"Playwright for Python is not installed: {exc}") from exc
    path = executable if executable is not None else find_chromium()
    options: dict[str, Any] = {"headless": True, "args": chromium_args()}
    options.update(launch_options)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=path, **options)
        try:
            yield browser
        finally:
            browser.close()
