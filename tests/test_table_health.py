"""The operator sees table health (issue 30): the scheduler's tables' sizes, dead rows and
vacuums, and what holds the database's oldest snapshot (which no VACUUM cleans past), in
`scheduler-daemon status`, ``/status`` and ``/metrics``.

Real databases throughout: the statistics are the server's own, the held snapshot a
session of the test's that keeps a REPEATABLE READ transaction open.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import sqlite3
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import pytest
from prometheus_client.parser import text_string_to_metric_families
from rig.databases import run_sync
from rig.processes import Daemons, run_cli
from rig.sql import execute
from rig.waiting import until, wait_until

from scheduler_daemon import http, status
from scheduler_daemon.config.settings import Settings
from scheduler_daemon.db.base import SCHEDULER_TABLES, SnapshotHolder, TableHealth
from scheduler_daemon.db.connect import open_store
from scheduler_daemon.db.postgres import PostgresStore
from scheduler_daemon.http import HttpServer
from scheduler_daemon.logs import get_logger
from scheduler_daemon.metrics import Metrics
from scheduler_daemon.status import collect_status, render_status, summarize, tables_report

pytestmark = pytest.mark.usefixtures("clean_env")  # conftest.py

# The holder's name, as another application would set it: no scheduler-daemon prefix.
HOLDER = "report-job"
TABLE_LINE = re.compile(
    r"^(?:tables)?\s+(\w+) \d+(?:\.\d)? (?:bytes|kB|MB), [\d,]+ live, (?:<1|\d+)% dead, "
    r"(?:never vacuumed|vacuumed \S+( \S+)? ago)$",
    re.M,
)


@asynccontextmanager
async def held_snapshot(dsn: str) -> AsyncIterator[asyncpg.Connection]:
    """A session that took a snapshot and keeps it: REPEATABLE READ, after a SELECT."""
    conn = await asyncpg.connect(dsn, server_settings={"application_name": HOLDER})
    try:
        transaction = conn.transaction(isolation="repeatable_read")
        await transaction.start()
        await conn.fetchval("SELECT count(*) FROM scheduler_publications")
        yield conn
        await transaction.rollback()
    finally:
        await conn.close()


def status_json(url: str) -> dict[str, Any]:
    result = run_cli(["status", "--json"], {"SCHEDULER_DATABASE_URL": url})
    assert result.returncode == 0, result.stderr
    report: dict[str, Any] = json.loads(result.stdout)
    return report


def by_table(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["table"]: t for t in report["tables"]["tables"]}


# -- PostgreSQL: the tables ------------------------------------------------------------


def test_status_shows_each_table_with_its_size_dead_rows_and_vacuums(pg_url: str) -> None:
    report = status_json(pg_url)
    section = report["tables"]
    assert [t["table"] for t in section["tables"]] == list(SCHEDULER_TABLES)
    assert section["database_file"] is None  # SQLite's
    for table in section["tables"]:
        assert table["bytes"] > 0, table  # at least its indexes' first pages
        assert 0 <= table["dead_ratio"] <= 1, table

    # Rows that die show up as dead, until a VACUUM removes them (the test's, at its own
    # moment: autovacuum, which 200 dead rows would call, is off for this table here).
    execute(
        pg_url,
        "ALTER TABLE scheduler_publications SET (autovacuum_enabled = off)",
        "INSERT INTO scheduler_publications (payload, publish_at) "
        "SELECT '{}', now() + interval '1 day' FROM generate_series(1, 300)",
        "DELETE FROM scheduler_publications WHERE id % 3 <> 0",
    )
    dead = wait_until(
        lambda: (lambda t: t if t["dead_rows"] >= 200 else None)(
            by_table(status_json(pg_url))["scheduler_publications"]
        ),
        what="the deleted publications counted as dead rows",
    )
    assert dead["live_rows"] == 100, dead
    ratio = dead["dead_rows"] / (dead["dead_rows"] + 100)
    assert dead["dead_ratio"] == pytest.approx(ratio, abs=1e-4)  # to 4 places

    execute(pg_url, "VACUUM scheduler_publications")
    vacuumed = wait_until(
        lambda: (lambda t: t if t["last_vacuum"] is not None else None)(
            by_table(status_json(pg_url))["scheduler_publications"]
        ),
        what="the VACUUM in the statistics",
    )
    assert (vacuumed["dead_rows"], vacuumed["dead_ratio"]) == (0, 0), vacuumed
    assert vacuumed["vacuum_count"] >= 1, vacuumed
    assert vacuumed["vacuum_age"] >= 0, vacuumed

    text = run_cli(["status"], {"SCHEDULER_DATABASE_URL": pg_url})
    assert text.returncode == 0, text.stderr
    assert [m[1] for m in TABLE_LINE.finditer(text.stdout)] == list(SCHEDULER_TABLES), text.stdout
    assert re.search(r"^tables\s+scheduler_plugin_tasks ", text.stdout, re.M), text.stdout
    assert re.search(
        r"^\s+scheduler_publications [\d.]+ \S+, 100 live, 0% dead, vacuumed \S+ ago$",
        text.stdout,
        re.M,
    ), text.stdout
    assert "oldest snapshot" not in text.stdout  # nothing held one for a minute


# -- PostgreSQL: the oldest snapshot ---------------------------------------------------


async def test_a_held_snapshot_is_named_with_its_holder_and_age(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = Settings(database_url=pg_url)
    store = await open_store(settings)
    try:
        async with held_snapshot(pg_url) as holder:
            pid = holder.get_server_pid()

            async def holders_report() -> dict[str, Any] | None:
                report = await collect_status(store, settings)
                oldest = report["tables"]["oldest_snapshot"]
                return report if oldest is not None and oldest["name"] == HOLDER else None

            report = await until(holders_report, "the test's snapshot as the oldest")
            oldest = report["tables"]["oldest_snapshot"]
            assert oldest["kind"] == "session"
            assert oldest["state"] == "idle in transaction"
            assert oldest["backend_pid"] == pid
            assert oldest["instance"] is None  # not a replica's session
            assert oldest["xmin_age"] >= 0
            assert oldest["held_for"] > 0
            assert report["tables"]["snapshot_seconds"] == oldest["held_for"]

            # Its age is measured, not a constant: it grows while the snapshot is held.
            first = oldest["held_for"]

            async def older() -> float | None:
                again = (await collect_status(store, settings))["tables"]["oldest_snapshot"]
                assert again["backend_pid"] == pid, again
                return again["held_for"] if again["held_for"] > first else None

            await until(older, "the held snapshot's age to grow")

            # The text names it once it has held the snapshot past the threshold (60 s by
            # default: lowered here, rather than waiting a minute).
            monkeypatch.setattr(status, "SNAPSHOT_SHOWN_AFTER", 0.0)
            text = render_status(report)
            assert re.search(
                rf"^\s+oldest snapshot held for \d+s, by session {HOLDER}, idle in "
                r"transaction: VACUUM cannot remove rows that died since$",
                text,
                re.M,
            ), text

            # The network's summary keeps its kind and age, not another client's name.
            summary = summarize(report)["tables"]["oldest_snapshot"]
            assert summary == {
                key: oldest[key] for key in ("kind", "instance", "state", "xmin_age", "held_for")
            }
            assert HOLDER not in json.dumps(summarize(report))

        async def let_go() -> bool:
            report = await collect_status(store, settings)
            oldest = report["tables"]["oldest_snapshot"]
            return oldest is None or oldest["backend_pid"] != pid

        await until(let_go, "the snapshot gone from the report once its transaction ended")
    finally:
        await store.close()


# -- PostgreSQL: /metrics ----------------------------------------------------------------


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        body = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(body)
        for sample in family.samples
    }


def test_metrics_export_table_sizes_dead_ratios_and_the_oldest_snapshot(
    daemons: Daemons, pg_url: str
) -> None:
    daemon = daemons.start(
        {
            "SCHEDULER_DATABASE_URL": pg_url,
            "SCHEDULER_HTTP__ENABLED": "true",
            "SCHEDULER_HTTP__HOST": "127.0.0.1",
            "SCHEDULER_HTTP__PORT": "0",
        }
    )
    port = daemon.wait_for_log("http.started", timeout=60)["port"]
    daemon.wait_for_log("daemon.started", timeout=60)

    async def scraped_while_held() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        # Held from before the scrape's read, which is the first: the gauge sees it.
        async with held_snapshot(pg_url):
            return await asyncio.to_thread(scrape, port)

    samples = run_sync(scraped_while_held())
    for table in SCHEDULER_TABLES:
        labels = (("table", table),)
        assert samples[("scheduler_table_bytes", labels)] > 0, table
        assert 0 <= samples[("scheduler_table_dead_ratio", labels)] <= 1, table
    assert samples[("scheduler_oldest_snapshot_seconds", ())] > 0

    daemon.signal(signal.SIGTERM)
    assert daemon.wait(45) == 0


@asynccontextmanager
async def served(database_url: str) -> AsyncIterator[tuple[HttpServer, aiohttp.ClientSession]]:
    settings = Settings(database_url=database_url, http={"port": 0})
    store = await open_store(settings)
    try:
        async with (
            HttpServer(settings, store, Metrics(), get_logger()) as server,
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
        ):
            yield server, session
    finally:
        await store.close()


async def test_scrapes_read_the_tables_at_most_every_30s_and_a_failed_read_keeps_them(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with served(pg_url) as (server, session):
        store = server.store
        assert isinstance(store, PostgresStore)
        real = store.table_health
        reads = 0
        failing = False

        async def counted() -> TableHealth:
            nonlocal reads
            reads += 1
            if failing:
                raise ConnectionResetError("the database went away")
            return await real()

        store.table_health = counted  # type: ignore[method-assign]

        async def get_metrics() -> str:
            url = f"http://127.0.0.1:{server.port}/metrics"
            async with session.get(url) as response:
                assert response.status == 200
                return await response.text()

        # A burst, then one more: one read between them (the next is due in 30 s).
        await asyncio.gather(*(get_metrics() for _ in range(5)))
        await get_metrics()
        assert reads == 1
        registry = server.metrics.registry
        labels = {"table": "scheduler_plugin_tasks"}
        size = registry.get_sample_value("scheduler_table_bytes", labels)
        assert size is not None
        assert size > 0

        # Due again, and the read fails: the scrape answers, with the values it had.
        monkeypatch.setattr(http, "TABLES_REFRESH", 0.0)
        failing = True
        body = await get_metrics()
        assert reads == 2
        assert registry.get_sample_value("scheduler_table_bytes", labels) == size
        assert 'scheduler_table_bytes{table="scheduler_plugin_tasks"}' in body
        assert "scheduler_database_up 1.0" in body  # the probe is not the table read


# -- SQLite ----------------------------------------------------------------------------------


def test_sqlite_status_shows_the_database_files_size_and_free_pages(sqlite_url: str) -> None:
    path = Path(sqlite_url.removeprefix("sqlite:///"))
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        # Rows of a few kB each, then deleted: their pages go to the free list.
        conn.execute(
            "INSERT INTO scheduler_publications (payload, publish_at) "
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 200) "
            "SELECT json_object('pad', hex(randomblob(2000))), '2099-01-01T00:00:00Z' FROM n"
        )
        conn.execute("DELETE FROM scheduler_publications")
        [page_count, page_size] = conn.execute(
            "SELECT page_count, page_size FROM pragma_page_count(), pragma_page_size()"
        ).fetchone()
    finally:
        conn.close()

    section = status_json(sqlite_url)["tables"]
    assert section["tables"] is None  # no per-table statistics
    assert section["oldest_snapshot"] is None  # nor a VACUUM horizon
    assert section["snapshot_seconds"] is None
    file = section["database_file"]
    assert file["bytes"] == page_count * page_size
    assert file["page_size"] == page_size
    assert file["free_pages"] > 0  # what the deleted rows left
    assert file["wal_bytes"] is None or file["wal_bytes"] >= 0

    text = run_cli(["status"], {"SCHEDULER_DATABASE_URL": sqlite_url})
    assert text.returncode == 0, text.stderr
    assert re.search(
        rf"^tables\s+database file [\d.]+ (?:kB|MB), {file['free_pages']:,} free pages "
        r"\([\d.]+ (?:kB|MB)\)(?:, write-ahead log [\d.]+ (?:bytes|kB|MB))?$",
        text.stdout,
        re.M,
    ), text.stdout


# -- the report's rules, on crafted data ---------------------------------------------------


def holder(**fields: Any) -> SnapshotHolder:
    defaults: dict[str, Any] = {
        "kind": "session",
        "name": "scheduler-daemon/alpha/pool",
        "state": "active",
        "backend_pid": 4242,
        "xmin_age": 3,
        "held_for": 90.0,
    }
    return SnapshotHolder(**(defaults | fields))


def test_a_replicas_session_is_named_by_its_instance_in_the_summary() -> None:
    section = tables_report(TableHealth((), holder(), None, 90.0))
    assert section["oldest_snapshot"]["instance"] == "alpha"
    summary = summarize({"tables": section})["tables"]
    assert summary["oldest_snapshot"] == {
        "kind": "session",
        "instance": "alpha",
        "state": "active",
        "xmin_age": 3,
        "held_for": 90.0,
    }
    assert "4242" not in json.dumps(summary)  # its backend pid


def test_the_oldest_snapshot_line_appears_past_its_threshold() -> None:
    def lines(oldest: SnapshotHolder) -> list[str]:
        return status._render_tables(tables_report(TableHealth((), oldest, None, None)))

    assert lines(holder(held_for=30.0)) == []
    assert lines(holder(held_for=843.0)) == [
        f"{'':<10} oldest snapshot held for 14m 3s, by session scheduler-daemon/alpha/pool, "
        "active: VACUUM cannot remove rows that died since"
    ]
    # A slot has no start time: its age in transactions decides, and is what it shows.
    slot = {"kind": "replication slot", "name": "standby1", "state": "inactive"}
    assert lines(holder(**slot, held_for=None, xmin_age=10)) == []
    assert lines(holder(**slot, held_for=None, xmin_age=125_000)) == [
        f"{'':<10} oldest snapshot 125,000 transactions old, by replication slot standby1, "
        "inactive: VACUUM cannot remove rows that died since"
    ]
