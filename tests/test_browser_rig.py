"""The browser rig: Debian's Chromium, driven by Playwright, follows server-sent events.

The smoke test serves a page from aiohttp (in a thread of its own, since the sync
Playwright API owns this one) whose script listens on an ``EventSource``; text pushed
through an aiohttp ``StreamResponse`` must appear on the page without a reload. The other
tests check the rig's choices without a browser, so they run in the main pytest stage.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest
from aiohttp import web
from rig.browser import (
    CHROMIUM_ENV,
    BrowserUnavailable,
    chromium_args,
    find_chromium,
)

if TYPE_CHECKING:
    from playwright.sync_api import Page

PAGE = """<!doctype html>
<html>
<head><meta charset="utf-8"><title>SSE smoke</title></head>
<body>
<p id="state">connecting</p>
<p id="status">nothing yet</p>
<script>
  window.loadedOnce = true;
  const events = new EventSource("/events");
  events.onopen = () => { document.getElementById("state").textContent = "open"; };
  events.addEventListener("status", (event) => {
    document.getElementById("status").textContent = event.data;
  });
</script>
</body>
</html>
"""


class SseServer:
    """An aiohttp server on 127.0.0.1 (a free port) in a background thread: ``/`` is
    `PAGE`, ``/events`` an event stream of what `push` is given."""

    def __init__(self) -> None:
        self.page_loads = 0
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._queues: set[asyncio.Queue[str | None]] = set()
        self._ready = threading.Event()
        self._stopped: asyncio.Event | None = None
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="sse-server", daemon=True)

    def __enter__(self) -> SseServer:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the SSE server did not start in 10 s")
        if self._failed is not None:
            self._thread.join(10)
            raise RuntimeError("the SSE server did not start") from self._failed
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._loop.call_soon_threadsafe(self._stop)
        self._thread.join(10)
        if self._failed is not None:
            raise RuntimeError("the SSE server failed") from self._failed

    def push(self, message: str) -> None:
        """Send `message` as a ``status`` event to every open stream."""
        self._loop.call_soon_threadsafe(self._broadcast, message)

    def _broadcast(self, message: str | None) -> None:
        for queue in self._queues:
            queue.put_nowait(message)

    def _stop(self) -> None:
        self._broadcast(None)  # ends the open streams, so cleanup need not wait on them
        assert self._stopped is not None
        self._stopped.set()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as exc:  # handed to __enter__, which raises it in the test
            self._failed = exc
        finally:
            self._ready.set()
            self._loop.close()

    async def _serve(self) -> None:
        self._stopped = asyncio.Event()
        app = web.Application()
        app.router.add_get("/", self._page)
        app.router.add_get("/events", self._events)
        runner = web.AppRunner(app, shutdown_timeout=2.0)
        await runner.setup()
        try:
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            host, port = runner.addresses[0][:2]
            self.url = f"http://{host}:{port}/"
            self._ready.set()
            await self._stopped.wait()
        finally:
            await runner.cleanup()

    async def _page(self, request: web.Request) -> web.Response:
        self.page_loads += 1
        return web.Response(text=PAGE, content_type="text/html")

    async def _events(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        queue: asyncio.Queue[str | None] = asyncio.Queue()
        self._queues.add(queue)
        try:
            await response.write(b": connected\n\n")
            while (message := await queue.get()) is not None:
                await response.write(f"event: status\ndata: {message}\n\n".encode())
        except ConnectionResetError:
            pass  # the page went away
        finally:
            self._queues.discard(queue)
        return response


@pytest.fixture
def sse_server() -> Iterator[SseServer]:
    with SseServer() as server:
        yield server


@pytest.mark.browser
def test_page_shows_server_sent_text_without_a_reload(sse_server: SseServer, page: Page) -> None:
    from playwright.sync_api import expect

    started = time.monotonic()
    page.goto(sse_server.url)
    expect(page.locator("#state")).to_have_text("open")
    expect(page.locator("#status")).to_have_text("nothing yet")

    sse_server.push("leader: replica-1")
    expect(page.locator("#status")).to_have_text("leader: replica-1")
    sse_server.push("leader: replica-2")
    expect(page.locator("#status")).to_have_text("leader: replica-2")

    assert page.evaluate("window.loadedOnce === true")
    assert sse_server.page_loads == 1
    assert time.monotonic() - started < 5


@pytest.mark.browser
def test_new_page_takes_context_options(new_page: Callable[..., Page]) -> None:
    berlin = new_page(timezone_id="Europe/Berlin", locale="de-DE")
    assert berlin.evaluate("Intl.DateTimeFormat().resolvedOptions().timeZone") == "Europe/Berlin"
    assert berlin.evaluate("navigator.language") == "de-DE"


# -- the rig's choices, without a browser --------------------------------------------


def test_chromium_env_overrides_the_search() -> None:
    assert find_chromium({CHROMIUM_ENV: "/bin/sh"}) == "/bin/sh"
    with pytest.raises(BrowserUnavailable, match=CHROMIUM_ENV):
        find_chromium({CHROMIUM_ENV: "/nonexistent/chromium"})


def test_no_sandbox_only_as_root() -> None:
    assert "--no-sandbox" in chromium_args(euid=0)
    assert "--no-sandbox" not in chromium_args(euid=1000)
    assert "--disable-dev-shm-usage" in chromium_args(euid=1000)


_PYTESTER_INI = """
[pytest]
markers =
    postgres: needs PostgreSQL
    browser: needs Chromium
    chaos_long: long
"""


@pytest.mark.parametrize("ci", ["true", ""])
def test_ci_turns_browser_skips_into_failures(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, ci: str
) -> None:
    monkeypatch.setenv("CI", ci)
    pytester.makeini(_PYTESTER_INI)
    pytester.makeconftest(
        """
        import pytest

        @pytest.fixture(scope="module")
        def browser():
            pytest.skip("no Chromium")

        @pytest.fixture
        def page(browser):
            return object()
        """
    )
    pytester.makepyfile(
        """
        import pytest

        def test_needs_the_browser_unmarked(page):
            pass

        @pytest.mark.browser
        def test_marked_and_skips():
            pytest.skip("not today")

        def test_unrelated_skip():
            pytest.skip("fine anywhere")
        """
    )
    plugins = ("-p", "rig.plugin", "-p", "no:hypothesispytest", "-p", "no:asyncio")
    result = pytester.runpytest(*plugins)
    if ci:
        result.assert_outcomes(errors=1, failed=1, skipped=1)
        result.stdout.fnmatch_lines(["*Browser test skipped, which CI=true forbids: not today*"])
    else:
        result.assert_outcomes(skipped=3)
    # A test that needs the browser fixture is marked browser, so `-m "not browser"` drops it.
    deselected = pytester.runpytest(*plugins, "-m", "not browser")
    deselected.assert_outcomes(skipped=1, deselected=2)
