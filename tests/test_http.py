"""The operations endpoints over real HTTP: the real server on an ephemeral port, a real
aiohttp client, real SQLite and PostgreSQL databases."""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import signal
import socket
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import asyncpg
import pytest
from prometheus_client.parser import text_string_to_metric_families
from rig.databases import PgServer, run_sync, with_user
from rig.pgcluster import PgCluster
from rig.ports import free_port
from rig.processes import DaemonProcess, Daemons, run_cli
from structlog.testing import capture_logs

from scheduler_daemon.config.settings import Settings
from scheduler_daemon.config.url import Backend
from scheduler_daemon.daemon import Daemon
from scheduler_daemon.db.connect import open_store
from scheduler_daemon.db.sqlfiles import migrations
from scheduler_daemon.errors import ConfigError
from scheduler_daemon.http import HttpServer
from scheduler_daemon.logs import get_logger
from scheduler_daemon.metrics import Metrics
from scheduler_daemon.status import collect_status, replica_status, summarize

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "scheduler-daemon.json"
OPENMETRICS = "application/openmetrics-text; version=1.0.0"


pytestmark = pytest.mark.usefixtures("clean_env")  # conftest.py


def make_settings(database_url: str, **overrides: Any) -> Settings:
    http = {"port": 0, **overrides.pop("http", {})}
    return Settings(database_url=database_url, http=http, **overrides)


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
    database_url: str, stopping: asyncio.Event | None = None, **overrides: Any
) -> AsyncIterator[Served]:
    settings = make_settings(database_url, **overrides)
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
        replica = replica_status(served.server.settings, served.metrics)
        # The tables' statistics are of the moment (ages, counts): read twice, they may
        # differ; their shape may not (tests/test_table_health.py checks the values).
        tables = report.pop("tables")
        summary = json.loads(json.dumps(summarize(expected) | {"replica": replica}))
        assert_same_keys_where_present(tables, summary.pop("tables"))
        assert report == summary
        assert report["backend"] == backend
        assert set(report["loops"]) == {"publish", "plugin"}
        assert "database" not in report  # the summary: see test_status_summary_*

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
    # The detailed report is the one that names the database at all.
    async with serving(with_password, http={"status_detail": True}) as served:
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
        # The driver's message (host, port, user) stays in the log: the network sees this.
        port = str(urlsplit(pg_url).port)
        assert "127.0.0.1" not in body
        assert port not in body
        assert database_up(served.metrics) == 0
        # The loop still answers, and no probe waits longer than the probe timeout.
        assert (await served.get("/healthz"))[0] == 200
        _, metrics, _ = await served.get("/metrics")
        assert "scheduler_database_up 0.0" in metrics
        status, body, _ = await served.get("/status")
        assert status == 503
        assert json.loads(body)["error"].startswith("database")
        assert "127.0.0.1" not in body
        assert port not in body

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


# -- startup: the port is bound before the database is awaited ------------------------------


def unreachable_database() -> str:
    return f"postgresql://app:hunter2@127.0.0.1:{free_port()}/app"


def http_get(port: int, path: str) -> tuple[int, str]:
    """A blocking GET, for tests that drive real processes; any status is an answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        with error:
            return error.code, error.read().decode()


def plain_lines(process: DaemonProcess) -> list[str]:
    """What the process wrote that is not a JSON log line: the one-line refusal."""
    return [line for line in process.output().splitlines() if not line.startswith("{")]


def test_a_port_clash_exits_78_before_the_database_is_tried(daemons: Daemons) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        # The default startup budget (60 s): binding after connecting would wait it out.
        process = daemons.start(
            {
                "SCHEDULER_DATABASE_URL": unreachable_database(),
                "SCHEDULER_HTTP__ENABLED": "true",
                "SCHEDULER_HTTP__PORT": str(port),
            }
        )
        assert process.wait(timeout=20) == 78
        elapsed = time.monotonic() - started
    assert elapsed < 5, elapsed
    [line] = plain_lines(process)
    assert line.startswith(f"scheduler-daemon: http: cannot listen on 127.0.0.1:{port}: "), line
    assert "address already in use" in line
    assert not [e for e in process.log_events() if e.get("event") == "db.connect_failed"]


def test_probes_answer_while_the_database_is_unreachable(daemons: Daemons) -> None:
    process = daemons.start(
        {
            "SCHEDULER_DATABASE_URL": unreachable_database(),
            "SCHEDULER_HTTP__ENABLED": "true",
            "SCHEDULER_HTTP__PORT": "0",
        }
    )
    port = process.wait_for_log("http.started", timeout=15)["port"]
    process.wait_for_log("db.connect_failed", timeout=15)  # retrying, within its budget
    assert http_get(port, "/healthz") == (200, "ok\n")  # the event loop is alive

    status, body = http_get(port, "/readyz")
    assert status == 503
    assert json.loads(body) == {
        "status": "not ready",
        "reason": "starting: connecting to the database",
        "schema_version": None,
        "expected_schema_version": latest_version("postgres"),
    }
    status, body = http_get(port, "/metrics")
    assert status == 200
    assert "scheduler_database_up 0.0" in body
    status, body = http_get(port, "/status")
    assert (status, json.loads(body)) == (503, {"error": "starting: connecting to the database"})
    assert process.poll() is None
    assert "hunter2" not in process.output()

    process.signal(signal.SIGTERM)
    assert process.wait(timeout=15) == 0


def test_readyz_names_each_startup_phase_until_the_loops_run(
    daemons: Daemons, pg_empty_url: str
) -> None:
    """Connected, but another migrator holds the migration lock: ``migrating``; then
    ready, with ``/status`` answering from the database."""
    from scheduler_daemon.db.postgres_migrate import MIGRATION_LOCK_KEY

    def reason(port: int) -> str | None:
        status, body = http_get(port, "/readyz")
        answer: str | None = json.loads(body)["reason"]
        assert (status == 200) == (answer is None), body
        return answer

    async def scenario() -> tuple[DaemonProcess, int]:
        conn = await asyncpg.connect(pg_empty_url)
        try:
            async with conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock($1)", MIGRATION_LOCK_KEY)
                process = daemons.start(
                    {
                        "SCHEDULER_DATABASE_URL": pg_empty_url,
                        "SCHEDULER_HTTP__ENABLED": "true",
                        "SCHEDULER_HTTP__PORT": "0",
                    }
                )
                started = await asyncio.to_thread(process.wait_for_log, "http.started")
                port = started["port"]
                deadline = time.monotonic() + 15
                while (now := await asyncio.to_thread(reason, port)) != "starting: migrating":
                    assert now == "starting: connecting to the database", now
                    assert time.monotonic() < deadline, now
                    await asyncio.sleep(0.05)
                status, body = await asyncio.to_thread(http_get, port, "/status")
                assert (status, json.loads(body)) == (503, {"error": "starting: migrating"})
        finally:
            await conn.close()
        return process, port

    process, port = asyncio.run(scenario())
    process.wait_for_log("daemon.started", timeout=30)
    assert reason(port) is None
    status, body = http_get(port, "/status")
    assert status == 200
    assert json.loads(body)["schema_version"] == latest_version("postgres")
    process.signal(signal.SIGTERM)
    assert process.wait(timeout=15) == 0


async def test_a_server_without_a_store_is_starting_until_attached(sqlite_url: str) -> None:
    settings = make_settings(sqlite_url)
    store = await open_store(settings)
    metrics = Metrics()
    try:
        async with (
            HttpServer(settings, None, metrics, get_logger()) as server,
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
        ):
            served = Served(server, metrics, session)
            server.starting("connecting to the database")
            assert (await served.get("/healthz"))[:2] == (200, "ok\n")
            status, body, _ = await served.get("/readyz")
            assert (status, json.loads(body)["reason"]) == (
                503,
                "starting: connecting to the database",
            )
            assert "scheduler_database_up 0.0" in (await served.get("/metrics"))[1]
            status, body, _ = await served.get("/status")
            assert (status, json.loads(body)) == (
                503,
                {"error": "starting: connecting to the database"},
            )

            server.attach(store)
            assert (await served.get("/readyz"))[0] == 200
            assert (await served.get("/status"))[0] == 200

            server.detach()  # the store is about to close
            status, body, _ = await served.get("/readyz")
            assert (status, json.loads(body)["reason"]) == (503, "stopping")
            assert (await served.get("/status"))[0] == 503
    finally:
        await store.close()


# -- what the network sees on /status -----------------------------------------------------

# What the summary must never show: connection details, host names, process ids.
CONNECTION_KEYS = {"database", "host", "pid", "backend_pid", "client_addr"}


def walk(node: Any) -> Iterator[tuple[str | None, Any]]:
    """Every (key, value) in a JSON document, list items with key None."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield key, value
            yield from walk(value)
    elif isinstance(node, list):
        for value in node:
            yield None, value
            yield from walk(value)


def assert_same_keys_where_present(summary: Any, full: Any, at: str = "") -> None:
    """The summary's shape is the full report's, pruned: no key of its own, same types."""
    if isinstance(summary, dict):
        if full is None and at.endswith(_OF_THE_MOMENT):
            return
        assert isinstance(full, dict), at
        assert set(summary) <= set(full), f"{at}: {set(summary) - set(full)} not in the full"
        for key, value in summary.items():
            assert_same_keys_where_present(value, full[key], f"{at}.{key}")
    elif isinstance(summary, list):
        assert isinstance(full, list), at
        assert len(summary) == len(full), at
        for index, (a, b) in enumerate(zip(summary, full, strict=True)):
            assert_same_keys_where_present(a, b, f"{at}[{index}]")
    else:
        assert (summary is None) == (full is None) or at.endswith(_OF_THE_MOMENT), at


# Values that two reports read a moment apart may have or lack: a heartbeat's age, a
# table's first vacuum, a snapshot held at one instant and not at the other.
_OF_THE_MOMENT = ("_age", ".last_vacuum", ".held_for", ".oldest_snapshot")


@pytest.fixture
def status_role(pg_server: PgServer) -> Iterator[str]:
    """A login role with a name no other text in a report could contain (the rig's own
    user, ``postgres``, is also the name of the backend)."""
    role = f"sd_status_{secrets.token_hex(4)}"

    async def admin(statement: str) -> None:
        conn = await asyncpg.connect(pg_server.admin_dsn)
        try:
            await conn.execute(statement)
        finally:
            await conn.close()

    run_sync(admin(f"CREATE ROLE {role} LOGIN SUPERUSER"))
    yield role
    pg_server.ensure_running()
    run_sync(admin(f"DROP ROLE {role}"))


def test_status_summary_shows_the_network_no_connection_details(
    daemons: Daemons, pg_url: str, status_role: str
) -> None:
    url = with_user(pg_url, status_role, "s3cret")  # trust auth: any password gets in
    dbname = urlsplit(pg_url).path.lstrip("/")
    common = {"SCHEDULER_DATABASE_URL": url, "SCHEDULER_HTTP__ENABLED": "true"}
    common["SCHEDULER_HTTP__PORT"] = "0"
    summary_replica = daemons.start({**common, "SCHEDULER_INSTANCE_ID": "replica-a"})
    summary_replica.wait_for_log("daemon.started")
    detail_replica = daemons.start(
        {**common, "SCHEDULER_INSTANCE_ID": "replica-b", "SCHEDULER_HTTP__STATUS_DETAIL": "true"}
    )
    detail_replica.wait_for_log("daemon.started")
    ports = [p.wait_for_log("http.started")["port"] for p in (summary_replica, detail_replica)]

    # Both replicas compete for both loops: one leads, the other waits.
    deadline = time.monotonic() + 15
    while True:
        status, body = http_get(ports[1], "/status")
        assert status == 200, body
        detail = json.loads(body)
        if all(
            loop["leader"] is not None and loop["standby_count"] == 1
            for loop in detail["loops"].values()
        ):
            break
        assert time.monotonic() < deadline, detail
        time.sleep(0.1)
    status, body = http_get(ports[0], "/status")
    assert status == 200
    summary = json.loads(body)

    # The detailed report (opt-in) and the CLI's have what the summary must not.
    cli = run_cli(["status", "--json"], {"SCHEDULER_DATABASE_URL": url})
    assert cli.returncode == 0, cli.stderr
    full = json.loads(cli.stdout)
    pids = {summary_replica.pid, detail_replica.pid}
    for report, text in ((detail, json.dumps(detail)), (full, cli.stdout)):
        for shown in (status_role, dbname, "127.0.0.1"):
            assert shown in text
        assert {key for key, _ in walk(report)} >= CONNECTION_KEYS
        leaders = {loop["leader"]["pid"] for loop in report["loops"].values()}
        assert leaders
        assert leaders <= pids
        assert "s3cret" not in text
    assert "replica" not in full  # the CLI is no replica; each HTTP answer names its own
    assert detail["replica"]["instance"] == "replica-b"

    # The summary has none of it: no user, database, address, host name or pid.
    for secret in (status_role, dbname, "127.0.0.1", "s3cret"):
        assert secret not in body, f"{secret!r} in the summary: {body}"
    assert json.dumps(socket.gethostname()) not in body  # as a value: "host": "<name>"
    assert not CONNECTION_KEYS & {key for key, _ in walk(summary)}, summary
    backend_pids = {
        who["backend_pid"]
        for loop in detail["loops"].values()
        for who in [loop["leader"], *loop["standbys"]]
    }
    # No number in it is a pid (as text they could collide with a timestamp's digits).
    # Not counting the tables' sizes and row counts, which may equal one by chance; the
    # snapshot holder's backend_pid is left out by its key (CONNECTION_KEYS, above).
    outside_tables = {key: value for key, value in summary.items() if key != "tables"}
    numbers = {value for _, value in walk(outside_tables) if isinstance(value, int)}
    assert not numbers & (pids | backend_pids), summary

    # What it does have: who leads each loop, since when, the token; the standbys; itself.
    assert summary["schema_version"] == latest_version("postgres")
    assert summary["replica"] == {
        "instance": "replica-a",
        "loops": {
            name: "leader" if loop["leader"]["instance"] == "replica-a" else "standby"
            for name, loop in detail["loops"].items()
        },
    }
    for name, loop in summary["loops"].items():
        leader = loop["leader"]
        assert leader["instance"] == detail["loops"][name]["leader"]["instance"]
        assert leader["fencing_token"] == detail["loops"][name]["leader"]["fencing_token"]
        assert leader["since"] == detail["loops"][name]["leader"]["since"]
        assert loop["standby_count"] == 1
        assert [s["instance"] for s in loop["standbys"]] == [
            s["instance"] for s in detail["loops"][name]["standbys"]
        ]
    # A strict subset of the full report's shape, so one tool reads both.
    assert_same_keys_where_present(summary, detail)
    assert_same_keys_where_present({k: v for k, v in summary.items() if k != "replica"}, full)

    for process in (detail_replica, summary_replica):
        process.signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0


async def test_status_summary_on_sqlite(sqlite_url: str) -> None:
    async with serving(sqlite_url) as served:
        full = await collect_status(served.server.store, served.server.settings)
        _, body, _ = await served.get("/status")
    summary = json.loads(body)
    assert not CONNECTION_KEYS & {key for key, _ in walk(summary)}
    assert sqlite_url.split("///", 1)[1] not in body  # the file's path
    assert_same_keys_where_present({k: v for k, v in summary.items() if k != "replica"}, full)
    assert summary["replica"]["loops"] == {"publish": "off", "plugin": "off"}

    async with serving(sqlite_url, http={"status_detail": True}) as served:
        _, body, _ = await served.get("/status")
    detail = json.loads(body)
    assert detail.pop("replica")["instance"] == served.server.settings.instance_id
    assert detail == json.loads(json.dumps(full))


def test_summarize_keeps_only_what_it_allows() -> None:
    leader = {"instance": "a", "host": "h", "pid": 1, "since": "t", "fencing_token": 3}
    report = {
        "database": "postgresql://u:***@h/db",
        "backend": "postgres",
        "schema_version": 9,
        "loops": {
            "publish": {
                "lock_key": 5,
                "leader": leader | {"new_secret_field": "x"},
                "standbys": [{"instance": "b", "backend_pid": 7, "client_addr": "10.0.0.2"}],
                "standby_count": 1,
                "backlog": 0,
            },
        },
        "something_added_later": {"host": "h"},
    }
    assert summarize(report) == {
        "backend": "postgres",
        "schema_version": 9,
        "loops": {
            "publish": {
                "lock_key": 5,
                "leader": {"instance": "a", "since": "t", "fencing_token": 3},
                "standbys": [{"instance": "b"}],
                "standby_count": 1,
                "backlog": 0,
            },
        },
    }


def test_summarize_a_sharded_loop_keeps_no_host_pid_or_address() -> None:
    owner = {"shard": 0, "instance": "a", "host": "h", "pid": 1, "backend_pid": 9,
             "since": "t", "fencing_token": 3, "changes": 2}  # fmt: skip
    report = {
        "loops": {
            "plugin": {
                "lock_key": 5, "shards": 2, "leader": None, "member_count": 1,
                "members": [{"instance": "a", "backend_pid": 9, "shards": [0, 1]}],
                "shard_owners": [owner, owner | {"shard": 1}],
                "balance": {"led": 2, "unled": 0}, "owner_changes": 4,
                "standbys": [], "standby_count": 0,
            },
        },
    }  # fmt: skip
    plugin = summarize(report)["loops"]["plugin"]
    assert plugin["members"] == [{"instance": "a", "shards": [0, 1]}]
    assert plugin["shard_owners"][1] == {
        "shard": 1, "instance": "a", "since": "t", "fencing_token": 3, "changes": 2,
    }  # fmt: skip
    assert (plugin["shards"], plugin["member_count"], plugin["owner_changes"]) == (2, 1, 4)
    assert plugin["balance"] == {"led": 2, "unled": 0}


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
