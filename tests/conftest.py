"""Fixtures: databases (SQLite and PostgreSQL), daemon processes, TCP proxies.

PostgreSQL comes from ``SCHEDULER_TEST_DATABASE_URL`` (an admin DSN to a server where
databases may be created and dropped) or else from a throwaway cluster started once per
session. Each test gets its own database, cloned from a template that the product's own
``migrate`` command built once per session, and dropped after a connection-leak check.

Browser tests get Debian's Chromium driven by Playwright (``browser``, ``new_page``,
``page``); see `rig.browser`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import structlog
from rig.browser import DEFAULT_TIMEOUT_MS, BrowserUnavailable, launched_chromium
from rig.databases import (
    PgServer,
    copy_sqlite,
    create_database,
    drop_database,
    migrate,
    new_database_name,
    run_sync,
    sqlite_url_for,
)
from rig.pgcluster import PgCluster, find_pg_bindir
from rig.processes import Daemons
from rig.tcpproxy import TcpProxy

if TYPE_CHECKING:
    from playwright.sync_api import Browser, BrowserContext, Page
    from rig.scene import Scene  # a plugin (below): imported first by pytest, to rewrite

pytest_plugins = ["pytester", "rig.plugin", "rig.durations", "rig.scene"]

PG_TEMPLATE = "scheduler_template"

# Fixtures whose teardown checks for leaked connections; see `daemons`.
_DATABASE_FIXTURES = ("pg_url", "pg_empty_url", "database_url")


# -- PostgreSQL ---------------------------------------------------------------------


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    external = os.environ.get("SCHEDULER_TEST_DATABASE_URL")
    if external:
        yield PgServer(admin_dsn=external, cluster=None)
        return
    bindir = find_pg_bindir()
    if bindir is None:
        pytest.skip("no PostgreSQL server binaries, and SCHEDULER_TEST_DATABASE_URL is unset")
    with PgCluster(bindir) as cluster:
        yield PgServer(admin_dsn=cluster.dsn(), cluster=cluster)


@pytest.fixture
def pg_cluster(pg_server: PgServer) -> Iterator[PgCluster]:
    """The throwaway cluster, for tests that restart or kill PostgreSQL; running again after."""
    if pg_server.cluster is None:
        pytest.skip("restart/kill need the throwaway cluster, not SCHEDULER_TEST_DATABASE_URL")
    yield pg_server.cluster
    pg_server.ensure_running()


@pytest.fixture(scope="session")
def pg_template(pg_server: PgServer) -> Iterator[str]:
    """The name of a database migrated by ``scheduler-daemon migrate``, to clone from."""
    # A run that was killed may have left one behind.
    run_sync(drop_database(pg_server.admin_dsn, PG_TEMPLATE, grace=0))
    run_sync(create_database(pg_server.admin_dsn, PG_TEMPLATE))
    migrate(pg_server.dsn_for(PG_TEMPLATE))
    yield PG_TEMPLATE
    pg_server.ensure_running()
    run_sync(drop_database(pg_server.admin_dsn, PG_TEMPLATE, grace=0))


def _throwaway_database(server: PgServer, template: str | None, scene: Scene) -> Iterator[str]:
    """A new database for one test; afterwards, fail the test if a connection leaked."""
    name = new_database_name()
    run_sync(create_database(server.admin_dsn, name, template=template))
    url = server.dsn_for(name)
    scene.watch_database(url)
    yield url
    server.ensure_running()
    leaked = run_sync(drop_database(server.admin_dsn, name))
    if leaked:
        pytest.fail(f"connections to {name} still open after the test: {leaked}")


@pytest.fixture
def pg_url(pg_server: PgServer, pg_template: str, scene: Scene) -> Iterator[str]:
    """The URL of a migrated PostgreSQL database of this test's own."""
    yield from _throwaway_database(pg_server, pg_template, scene)


@pytest.fixture
def pg_empty_url(pg_server: PgServer, scene: Scene) -> Iterator[str]:
    """The URL of an empty (not migrated) PostgreSQL database of this test's own."""
    yield from _throwaway_database(pg_server, None, scene)


# -- SQLite -------------------------------------------------------------------------


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sqlite-template") / "template.db"
    migrate(sqlite_url_for(path))
    return path


@pytest.fixture
def sqlite_url(sqlite_template: Path, tmp_path: Path, scene: Scene) -> str:
    """The URL of a migrated SQLite database of this test's own (``sqlite:////abs/path``)."""
    path = tmp_path / "scheduler.db"
    copy_sqlite(sqlite_template, path)
    url = sqlite_url_for(path)
    scene.watch_database(url)
    return url


@pytest.fixture
def sqlite_empty_url(tmp_path: Path) -> str:
    """The URL of a SQLite database that does not exist yet."""
    return sqlite_url_for(tmp_path / "scheduler.db")


# -- both backends ------------------------------------------------------------------


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest) -> str:
    """A migrated database URL of each backend; the PostgreSQL case is marked ``postgres``.

    Resolved lazily so that the SQLite case runs without PostgreSQL.
    """
    fixture = "sqlite_url" if request.param == "sqlite" else "pg_url"
    url: str = request.getfixturevalue(fixture)
    return url


# -- the environment ---------------------------------------------------------------


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``SCHEDULER_*`` variable of the developer's shell reaches ``Settings()`` in this
    process (processes the rig starts get none anyway: `rig.processes.daemon_env`). A
    module asks for it with ``pytestmark = pytest.mark.usefixtures("clean_env")``."""
    for name in list(os.environ):
        if name.startswith("SCHEDULER_"):
            monkeypatch.delenv(name)


# -- logging -----------------------------------------------------------------------


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """For tests that call ``configure_logging``: structlog's defaults, the root logger's
    handlers and level, and the warnings capture are put back afterwards."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        structlog.reset_defaults()
        for handler in root.handlers:
            if handler not in handlers:
                root.removeHandler(handler)
                handler.close()
        root.setLevel(level)
        logging.captureWarnings(False)


# -- processes and network ----------------------------------------------------------


@pytest.fixture
def daemons(request: pytest.FixtureRequest, tmp_path: Path, scene: Scene) -> Iterator[Daemons]:
    """Starts daemon processes (``daemons.start(env)``); kills the survivors afterwards."""
    # Fixtures are torn down in reverse order of setup. Setting the test's databases up
    # first means the daemons are killed before those databases' leak check runs, even
    # when the test lists `daemons` first.
    for name in _DATABASE_FIXTURES:
        if name in request.fixturenames:
            request.getfixturevalue(name)
    with Daemons(tmp_path / "daemons") as started:
        scene.watch_daemons(started)
        yield started


@pytest.fixture
def tcp_proxy_factory() -> Iterator[Callable[[str, int], TcpProxy]]:
    """``tcp_proxy_factory(host, port)`` starts a `TcpProxy`; all are closed afterwards."""
    with ExitStack() as stack:
        yield lambda host, port: stack.enter_context(TcpProxy(host, port))


# -- browser -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """A headless Chromium (the OS package's, via Playwright), one per test module.

    Skips with the reason when Playwright or Chromium is missing. Per module, not per
    session: while it is up, ``asyncio.run`` and async tests fail in this thread (see
    `rig.browser`), so keep a module that uses it to sync tests.
    """
    with ExitStack() as stack:
        try:
            started = stack.enter_context(launched_chromium())
        except BrowserUnavailable as exc:
            pytest.skip(str(exc))
        yield started


@pytest.fixture
def new_page(browser: Browser) -> Iterator[Callable[..., Page]]:
    """``new_page(**context_options)``: a page in a fresh browser context of its own.

    The options are ``Browser.new_context``'s: ``http_credentials={"username": ...,
    "password": ...}``, ``timezone_id="Europe/Berlin"``, ``locale="de-DE"``,
    ``base_url=...`` and so on. Every context is closed after the test.
    """
    contexts: list[BrowserContext] = []

    def make(**context_options: Any) -> Page:
        context = browser.new_context(**context_options)
        contexts.append(context)
        context.set_default_timeout(DEFAULT_TIMEOUT_MS)
        return context.new_page()

    try:
        yield make
    finally:
        for context in contexts:
            context.close()


@pytest.fixture
def page(new_page: Callable[..., Page]) -> Page:
    """A page in a fresh browser context with the defaults (``new_page()``)."""
    return new_page()
