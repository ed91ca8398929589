"""The operations endpoints over real HTTP: the real server on an ephemeral port, a real
aiohttp client, real SQLite and PostgreSQL databases."""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from rig.pgcluster import PgCluster
from structlog.testing import capture_logs

from scheduler_daemon.config import Settings
from scheduler_daemon.daemon import Daemon
from scheduler_daemon.db.connect import open_store
from scheduler_daemon.db.sqlfiles import migrations
from scheduler_daemon.db.url import Backend
from scheduler_daemon.errors import ConfigError
from scheduler_daemon.http import HttpServer
from scheduler_daemon.logs import get_logger
from scheduler_daemon.metrics import Metrics
from scheduler_daemon.status import collect_status

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "scheduler-daemon.json"
OPENMETRICS = "application/openmetrics-text; version=1.0.0"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # Settings() reads SCHEDULER_* variables: a developer's shell must not leak in.
    for name in list(os.environ):
        if name.startswith("SCHEDULER_"):
            monkeypatch.delenv(name)


def make_settings(database_url: str, **overrides: Any) -> Settings:
    return Settings(database_url=database_url, http={"port": 0}, **overrides)


class Served:
    def __init__(self, server: HttpServer, metrics: Metrics, session: aiohttp.ClientSession):
        self.server = server
        self.metrics = metrics
        self.session = session
        self.base = f"http://127.0.0.1:{server.port}"

    async def get(self, path: str, **headers: str) -> tuple[int, str, aiohttp.ClientResponse]:
        async with self.session.get(self.base + path, headers=headers) as response:
            return response.status, await response.text(), response


@asynccontextmanager
async def serving(
    database_url: str, stopping: asyncio.Event | None = None
) -> AsyncIterator[Served]:
    settings = make_settings(database_url)
    store = await open_store(settings)
    metrics = Metrics()
    try:
        async with (
            HttpServer(settings, store, metrics, get_logger(), stopping) as server,
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
        ):
            yield Served(server, metrics, session)
    finally:
        await store.close()


def latest_version(backend: Backend) -> int:
    return migrations(backend)[-1].version


def database_up(metrics: Metrics) -> float | None:
    return metrics.registry.get_sample_value("scheduler_database_up")


# -- every endpoint, both backends ---------------------------------------------------------


async def test_all_endpoints(database_url: str) -> None:
    backend: Backend = "sqlite" if database_url.startswith("sqlite") else "postgres"
    async with serving(database_url) as served:
        status, body, _ = await served.get("/healthz")
        assert (status, body) == (200, "ok\n")

        status, body, response = await served.get("/readyz")
        assert status == 200, body
        assert response.content_type == "application/json"
        assert json.loads(body) == {
            "status": "ready",
            "reason": None,
            "schema_version": latest_version(backend),
            "expected_schema_version": latest_version(backend),
        }
        assert database_up(served.metrics) == 1

        status, body, response = await served.get("/metrics")
        assert status == 200
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        assert "scheduler_database_up 1.0" in body
        assert 'scheduler_build_info{version="' in body

        status, body, _ = await served.get("/status")
        assert status == 200
        report = json.loads(body)
        expected = await collect_status(served.server.store, served.server.settings)
        assert report == json.loads(json.dumps(expected))
        assert report["backend"] == backend
        assert set(report["loops"]) == {"publish", "plugin"}

        status, _, _ = await served.get("/nope")
        assert status == 404


async def test_metrics_speaks_openmetrics_when_asked(sqlite_url: str) -> None:
    async with serving(sqlite_url) as served:
        status, body, response = await served.get("/metrics", Accept=OPENMETRICS)
    assert status == 200
    assert response.headers["Content-Type"].startswith("application/openmetrics-text")
    assert body.rstrip().endswith("# EOF")


async def test_metrics_come_from_the_daemons_own_registry(sqlite_url: str) -> None:
    async with serving(sqlite_url) as served:
        served.metrics.leader.labels("publish").set(1)
        _, body, _ = await served.get("/metrics")
    assert 'scheduler_leader{loop="publish"} 1.0' in body
    # Nothing from prometheus_client's global default registry (process_*, python_gc_*).
    assert "python_gc_" not in body
    assert "process_cpu" not in body


async def test_status_and_errors_never_show_the_password(
    pg_url: str, pg_cluster: PgCluster
) -> None:
    # The throwaway cluster trusts local connections, so any password gets in.
    with_password = pg_url.replace("postgresql://postgres@", "postgresql://postgres:s3cret@")
    assert with_password != pg_url
    async with serving(with_password) as served:
        answers = [await served.get(path) for path in ("/status", "/readyz")]
        pg_cluster.stop()
        answers += [await served.get(path) for path in ("/status", "/readyz", "/metrics")]
    assert [status for status, _, _ in answers] == [200, 200, 503, 503, 200]
    for _, body, _ in answers:
        assert "s3cret" not in body
    assert json.loads(answers[0][1])["database"].startswith("postgresql://postgres:***@")


# -- readiness ------------------------------------------------------------------------


async def test_readyz_needs_a_migrated_schema(sqlite_empty_url: str) -> None:
    async with serving(sqlite_empty_url) as served:
        status, body, _ = await served.get("/readyz")
        healthz, _, _ = await served.get("/healthz")
    assert status == 503
    answer = json.loads(body)
    assert answer["status"] == "not ready"
    assert answer["schema_version"] is None
    assert f"expects {latest_version('sqlite')}" in answer["reason"]
    assert healthz == 200  # alive, just not ready
    assert database_up(served.metrics) == 1  # the database answered; the schema is the issue


async def test_readyz_is_503_while_stopping(sqlite_url: str) -> None:
    stopping = asyncio.Event()
    async with serving(sqlite_url, stopping) as served:
        assert (await served.get("/readyz"))[0] == 200
        stopping.set()
        status, body, _ = await served.get("/readyz")
    assert status == 503
    assert json.loads(body)["reason"] == "stopping"


async def wait_for_status(served: Served, path: str, wanted: int, within: float) -> float:
    """Poll ``path`` until it answers ``wanted``; return the slowest answer's duration."""
    deadline = time.monotonic() + within
    slowest = 0.0
    while True:
        started = time.monotonic()
        status, body, _ = await served.get(path)
        slowest = max(slowest, time.monotonic() - started)
        if status == wanted:
            return slowest
        assert time.monotonic() < deadline, f"{path} still {status} after {within}s: {body}"
        await asyncio.sleep(0.05)


async def test_readyz_follows_postgres_down_and_up(pg_url: str, pg_cluster: PgCluster) -> None:
    async with serving(pg_url) as served:
        await wait_for_status(served, "/readyz", 200, within=5)
        assert database_up(served.metrics) == 1

        pg_cluster.stop()
        status, body, _ = await served.get("/readyz")
        assert status == 503, body
        assert json.loads(body)["reason"].startswith("database")
        assert database_up(served.metrics) == 0
        # The loop still answers, and no probe waits longer than the probe timeout.
        assert (await served.get("/healthz"))[0] == 200
        _, metrics, _ = await served.get("/metrics")
        assert "scheduler_database_up 0.0" in metrics
        status, body, _ = await served.get("/status")
        assert status == 503
        assert json.loads(body)["error"].startswith("database")

        pg_cluster.start()
        slowest = await wait_for_status(served, "/readyz", 200, within=15)
        assert slowest < 3.0
        assert database_up(served.metrics) == 1


async def test_concurrent_probes_share_one_query(sqlite_url: str) -> None:
    async with serving(sqlite_url) as served:
        calls = 0
        real = served.server.store.schema_version

        async def counted() -> int | None:
            nonlocal calls
            calls += 1
            await asyncio.sleep(0.2)
            return await real()

        served.server.store.schema_version = counted  # type: ignore[method-assign]
        answers = await asyncio.gather(*(served.get("/readyz") for _ in range(10)))
    assert [status for status, _, _ in answers] == [200] * 10
    assert calls == 1


# -- robustness -----------------------------------------------------------------------


async def test_a_slow_client_does_not_stall_the_server(sqlite_url: str) -> None:
    async with serving(sqlite_url) as served:
        # Half a request, never finished, and a finished one whose answer is never read.
        stalled_reader, stalled = await asyncio.open_connection("127.0.0.1", served.server.port)
        stalled.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        _, unread = await asyncio.open_connection("127.0.0.1", served.server.port)
        unread.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 50)
        await asyncio.gather(stalled.drain(), unread.drain())
        started = time.monotonic()
        assert (await served.get("/healthz"))[0] == 200
        assert time.monotonic() - started < 1.0
        stop_started = time.monotonic()
    # Stopping does not wait on those clients longer than the server's shutdown timeout.
    assert time.monotonic() - stop_started < 5.0
    assert await asyncio.wait_for(stalled_reader.read(), 5) == b""
    for writer in (stalled, unread):
        writer.close()
        await writer.wait_closed()


async def test_port_in_use_is_a_config_error(sqlite_url: str) -> None:
    async with serving(sqlite_url) as served:
        settings = Settings(database_url=sqlite_url, http={"port": served.server.port})
        second = HttpServer(settings, served.server.store, Metrics(), get_logger())
        with pytest.raises(
            ConfigError, match=rf"http: cannot listen on 127\.0\.0\.1:{second.settings.http.port}"
        ):
            await second.start()


async def test_started_event_names_host_and_bound_port(sqlite_url: str) -> None:
    with capture_logs() as events:
        async with serving(sqlite_url) as served:
            port = served.server.port
    started = [e for e in events if e["event"] == "http.started"]
    assert started == [
        {"event": "http.started", "host": "127.0.0.1", "port": port, "log_level": "info"}
    ]
    assert port != 0
    assert any(e["event"] == "http.stopped" for e in events)


# -- inside the daemon ------------------------------------------------------------------


async def test_daemon_serves_http_while_running(sqlite_url: str) -> None:
    # A short shutdown_timeout bounds the test should a tick hang.
    settings = make_settings(sqlite_url, shutdown_timeout=2)
    daemon = Daemon(settings, get_logger())
    run = asyncio.create_task(daemon.run())
    try:
        await asyncio.wait_for(daemon.started.wait(), 20)
        assert daemon.http is not None
        async with aiohttp.ClientSession() as session:
            base = f"http://127.0.0.1:{daemon.http.port}"
            async with session.get(base + "/healthz") as response:
                assert response.status == 200
            async with session.get(base + "/metrics") as response:
                body = await response.text()
        # Standbys export zeros too, so "no leader" alerts see every loop.
        assert 'scheduler_leader{loop="publish"}' in body
        assert 'scheduler_leader{loop="plugin"}' in body
    finally:
        daemon.request_stop("test")
        assert await asyncio.wait_for(run, 30) == 0
    with pytest.raises(RuntimeError, match="not running"):
        _ = daemon.http.port


async def test_daemon_without_http(sqlite_url: str) -> None:
    settings = Settings(
        database_url=sqlite_url,
        http={"enabled": False},
        publish={"enabled": False},
        plugin={"enabled": False},
    )
    daemon = Daemon(settings, get_logger())
    run = asyncio.create_task(daemon.run())
    await asyncio.wait_for(daemon.started.wait(), 20)
    assert daemon.http is None
    daemon.request_stop("test")
    assert await asyncio.wait_for(run, 10) == 0


# -- the Grafana dashboard only queries what /metrics exposes ------------------------------

_NAME = re.compile(r"\bscheduler_[a-zA-Z0-9_]*[a-zA-Z0-9]")
# The series each family type puts in the text exposition, by the name on its TYPE line.
_SERIES_SUFFIXES = {
    "counter": ("",),  # the TYPE line already names the _total series
    "gauge": ("",),
    "untyped": ("",),
    "info": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
}


def exposed_series(exposition: str) -> set[str]:
    """Every series name the exposition declares, whether or not it has samples yet.

    A labelled family (``scheduler_plugin_runs_total{task,result}``) shows no sample until
    something is counted, but its ``# TYPE`` line is always there, so the names come from
    those lines and the series names each type implies.
    """
    names: set[str] = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names.update(name + suffix for suffix in _SERIES_SUFFIXES[kind])
    return names


def dashboard_exprs(dashboard: dict[str, Any]) -> list[str]:
    exprs: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str):
                exprs.append(node["expr"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(dashboard)
    return exprs


def test_exposed_series_reads_type_lines() -> None:
    exposition = (
        "# TYPE scheduler_ticks_total counter\n"
        "# TYPE scheduler_tick_duration_seconds histogram\n"
        "# TYPE scheduler_leader gauge\n"
    )
    assert exposed_series(exposition) == {
        "scheduler_ticks_total",
        "scheduler_tick_duration_seconds_bucket",
        "scheduler_tick_duration_seconds_sum",
        "scheduler_tick_duration_seconds_count",
        "scheduler_leader",
    }


async def test_dashboard_queries_only_exposed_metrics(sqlite_url: str) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = dashboard_exprs(dashboard)
    queried = {name for expr in exprs for name in _NAME.findall(expr)}
    async with serving(sqlite_url) as served:
        _, body, _ = await served.get("/metrics")
    exposed = exposed_series(body)
    # The parser agrees the exposition is well formed.
    assert list(text_string_to_metric_families(body))
    assert queried <= exposed, f"queried but never exposed: {sorted(queried - exposed)}"
    # And the dashboard covers what operators need (issue #6).
    for needed in (
        "scheduler_leader",
        "scheduler_ticks_total",
        "scheduler_tick_duration_seconds_bucket",
        "scheduler_publication_lateness_seconds_bucket",
        "scheduler_publications_published_total",
        "scheduler_publications_failed_total",
        "scheduler_plugin_runs_total",
        "scheduler_heartbeat_failures_total",
        "scheduler_evictions_total",
        "scheduler_database_up",
    ):
        assert needed in queried, f"the dashboard has no panel on {needed}"
