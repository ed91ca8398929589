"""What a failed test shows beside its assertion: the state of everything it set up.

A test that waits on real processes fails with a line such as "no leader.acquired within
30s". Why is rarely in that line: a replica that exited, a lock held by a session nobody
expected, a row in the wrong state. CI's output is all a reader of a failed run has, so
each test gets a :class:`Scene` (the ``scene`` fixture) that the fixtures tell what they
set up: the daemon processes (``Daemons``), the PostgreSQL and SQLite databases, and
anything a test adds with :meth:`Scene.watch` (a systemd host's journal, a compose
project's logs). When the test fails, in its setup or its body, the plugin hook below asks
each of them for its state at that moment and adds it to the report as a section of its
own ("scene: daemon1", "scene: database t_1a2b..."), which pytest prints with the failure.

Each witness bounds its own reads (a connect and statement timeout, a docker command's
timeout), and its failure is reported in its place: a scene never hides the test's own
error, and a server that is down makes its section say so.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from rig.databases import RIG_APP, run_sync

# Lines of each process's output, and rows of each query, a section shows at most.
TAIL_LINES = 30
MAX_ROWS = 40
# Per witness: long enough for a loaded machine, short enough that a dead server costs
# the report little.
WITNESS_TIMEOUT = 10.0

SCENE_KEY = pytest.StashKey["Scene"]()


@dataclass
class Scene:
    """The witnesses of one test, in the order they were added."""

    witnesses: list[tuple[str, Callable[[], str]]] = field(default_factory=list)

    def watch(self, title: str, describe: Callable[[], str]) -> None:
        """On failure, add ``describe()`` to the report under "scene: `title`"."""
        self.witnesses.append((title, describe))

    def watch_daemons(self, daemons: Any) -> None:
        """Every process `daemons` (a ``rig.processes.Daemons``) started, as it is then."""
        self.watch("processes", lambda: describe_processes(daemons.processes))

    def watch_database(self, url: str) -> None:
        """The lock holders, sessions and leader rows of the database at `url`."""
        name = url.rsplit("/", 1)[-1]
        self.watch(f"database {name}", lambda: describe_database(url))

    def sections(self) -> list[tuple[str, str]]:
        return [(f"scene: {title}", _read(describe)) for title, describe in self.witnesses]


def _read(describe: Callable[[], str]) -> str:
    began = time.monotonic()
    try:
        text = describe()
    except Exception as exc:  # the scene reports; it never replaces the test's error
        text = f"(could not be read: {type(exc).__name__}: {exc})"
    spent = time.monotonic() - began
    return text if spent < 1 else f"{text}\n(read in {spent:.1f}s)"


def describe_processes(processes: list[Any]) -> str:
    if not processes:
        return "(none started)"
    return "\n".join(f"--- {process.summary(lines=TAIL_LINES)}" for process in processes)


# Every advisory lock in this database, granted first, with its session: who leads what,
# and who waits. The key is shown as the daemon configures it (classid << 32 | objid).
PG_LOCKS = """
SELECT (l.classid::bigint << 32 | l.objid::bigint) AS key, l.pid, l.granted,
       a.application_name, a.client_addr, a.state, a.wait_event,
       round(extract(epoch FROM now() - a.state_change)::numeric, 2) AS state_for_s
FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory'
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
ORDER BY key, l.granted DESC, l.pid
"""
PG_SESSIONS = """
SELECT pid, application_name, client_addr, state, wait_event_type, wait_event,
       round(extract(epoch FROM now() - backend_start)::numeric, 2) AS age_s,
       round(extract(epoch FROM now() - state_change)::numeric, 2) AS state_for_s,
       left(regexp_replace(query, '\\s+', ' ', 'g'), 100) AS query
FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid()
ORDER BY backend_start
"""
LEADERS = "SELECT * FROM scheduler_leaders ORDER BY 1, 2"
# What a PostgreSQL database's section shows, in order.
PG_QUERIES = (
    ("advisory locks", PG_LOCKS),
    ("sessions", PG_SESSIONS),
    ("scheduler_leaders", LEADERS),
)


def psql_scene() -> list[str]:
    """psql's options that print the same, where the rig has no route to the server (a
    container's database): run them inside, after ``-U USER -d DATABASE``."""
    return ["-P", "pager=off", *(arg for _, sql in PG_QUERIES for arg in ("-c", sql))]


def describe_database(url: str) -> str:
    if url.startswith("sqlite"):
        return _describe_sqlite(url)
    return run_sync(asyncio.wait_for(_describe_postgres(url), WITNESS_TIMEOUT))


async def _describe_postgres(url: str) -> str:
    conn = await asyncpg.connect(url, server_settings=RIG_APP, timeout=WITNESS_TIMEOUT)
    try:
        parts = []
        for title, sql in PG_QUERIES:
            try:
                rows = [dict(row) for row in await conn.fetch(sql)]
            except asyncpg.UndefinedTableError:
                rows = []
                title += " (no such table)"
            parts.append(format_rows(title, rows))
        return "\n".join(parts)
    finally:
        await conn.close()


def _describe_sqlite(url: str) -> str:
    path = Path(url.removeprefix("sqlite:///"))
    if not path.exists():
        return f"{path}: no such file"
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=WITNESS_TIMEOUT)
    conn.row_factory = sqlite3.Row
    try:
        rows = [dict(row) for row in conn.execute(LEADERS)]
        return format_rows("scheduler_leaders", rows)
    except sqlite3.OperationalError as exc:
        return f"scheduler_leaders: {exc}"
    finally:
        conn.close()


def format_rows(title: str, rows: list[dict[str, Any]]) -> str:
    """`rows` as aligned text under `title`, at most MAX_ROWS of them."""
    if not rows:
        return f"{title}: (none)"
    columns = list(rows[0])
    shown = [[_cell(row.get(c)) for c in columns] for row in rows[:MAX_ROWS]]
    widths = [max(len(c), *(len(r[i]) for r in shown)) for i, c in enumerate(columns)]
    lines = [f"{title}: {len(rows)} row(s)"]
    lines.append("  " + " | ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    lines += ["  " + " | ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in shown]
    if len(rows) > MAX_ROWS:
        lines.append(f"  ... {len(rows) - MAX_ROWS} more")
    return "\n".join(lines)


def _cell(value: Any) -> str:
    text = "" if value is None else str(value)
    return text if len(text) <= 60 else text[:57] + "..."


# -- the plugin ---------------------------------------------------------------------


@pytest.fixture
def scene(request: pytest.FixtureRequest) -> Scene:
    """This test's scene: fixtures and tests add witnesses; a failure shows them."""
    found = request.node.stash.get(SCENE_KEY, None)
    if found is None:
        found = request.node.stash[SCENE_KEY] = Scene()
    return found


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    found = item.stash.get(SCENE_KEY, None)
    # Teardown has already stopped what the witnesses would describe; setup and call
    # failures are taken while it still runs.
    if found is not None and report.failed and report.when in ("setup", "call"):
        for title, text in found.sections():
            report.sections.append((title, text))
    return report
