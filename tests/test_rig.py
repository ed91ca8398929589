"""The test rig's own tests: each would fail if the piece it covers silently did nothing."""

from __future__ import annotations

import asyncio
import json
import signal
import sqlite3
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import pytest
from rig.databases import (
    PgServer,
    create_database,
    drop_database,
    new_database_name,
    replace_host_port,
)
from rig.durations import heaviest_first
from rig.overlap import find_overlaps
from rig.pgcluster import PgCluster
from rig.plugin import ci_is_set
from rig.ports import free_port
from rig.processes import Daemons, daemon_env, run_cli, start_replicas
from rig.tcpproxy import TcpProxy
from rig.waiting import wait_until

# How a session that the server ended looks to asyncpg depends on whether the server's
# goodbye (a FATAL message) arrives before the socket closes.
_SESSION_GONE = (asyncpg.PostgresError, asyncpg.InterfaceError, OSError)

# -- the throwaway cluster ----------------------------------------------------------


async def test_cluster_is_ours_and_answers(pg_cluster: PgCluster) -> None:
    conn = await asyncpg.connect(pg_cluster.dsn())
    try:
        assert await conn.fetchval("SELECT 1") == 1
        # Not the system server on 5432: the data directory is the rig's.
        assert await conn.fetchval("SHOW data_directory") == str(pg_cluster.data_dir)
    finally:
        await conn.close()


async def test_restart_ends_sessions_and_serves_new_ones(pg_cluster: PgCluster) -> None:
    port, old_pid = pg_cluster.port, pg_cluster.pid
    before = await asyncpg.connect(pg_cluster.dsn())
    try:
        pg_cluster.restart()
        with pytest.raises(_SESSION_GONE):
            await before.fetchval("SELECT 1")
    finally:
        await before.close()
    assert (pg_cluster.port, pg_cluster.is_running()) == (port, True)
    assert pg_cluster.pid != old_pid
    after = await asyncpg.connect(pg_cluster.dsn())
    try:
        assert await after.fetchval("SELECT 1") == 1
    finally:
        await after.close()


async def test_kill_crashes_and_start_recovers_acknowledged_commits(
    pg_cluster: PgCluster, pg_empty_url: str
) -> None:
    before = await asyncpg.connect(pg_empty_url)
    try:
        await before.execute("CREATE TABLE probe (n int); INSERT INTO probe VALUES (42)")
        pg_cluster.kill()
        assert not pg_cluster.is_running()
        with pytest.raises(_SESSION_GONE):
            await before.fetchval("SELECT 1")
    finally:
        await before.close()
    pg_cluster.start()
    assert "automatic recovery in progress" in pg_cluster.log_tail(20)
    after = await asyncpg.connect(pg_empty_url)
    try:
        assert await after.fetchval("SELECT n FROM probe") == 42
    finally:
        await after.close()


# -- per-test databases -------------------------------------------------------------


@pytest.mark.parametrize("run", [1, 2])
async def test_each_test_gets_its_own_empty_database(
    pg_empty_url: str, run: int, request: pytest.FixtureRequest
) -> None:
    # Both runs create the same table: the second would fail on a shared database.
    conn = await asyncpg.connect(pg_empty_url)
    try:
        assert (
            await conn.fetchval("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'") == 0
        )
        await conn.execute("CREATE TABLE probe (run int)")
        assert (await conn.fetchval("SELECT current_database()")).startswith("t_")
    finally:
        await conn.close()
    assert request.node.get_closest_marker("postgres") is not None


async def test_clone_copies_the_template(pg_server: PgServer) -> None:
    template, clone = new_database_name("tmpl_"), new_database_name()
    await create_database(pg_server.admin_dsn, template)
    try:
        conn = await asyncpg.connect(pg_server.dsn_for(template))
        try:
            await conn.execute("CREATE TABLE from_template (id int)")
        finally:
            await conn.close()
        await create_database(pg_server.admin_dsn, clone, template=template)
        conn = await asyncpg.connect(pg_server.dsn_for(clone))
        try:
            assert await conn.fetchval("SELECT to_regclass('from_template') IS NOT NULL")
        finally:
            await conn.close()
    finally:
        assert await drop_database(pg_server.admin_dsn, clone) == []
        assert await drop_database(pg_server.admin_dsn, template) == []


async def test_leak_check_names_and_ends_leaked_connections(pg_server: PgServer) -> None:
    name = new_database_name()
    await create_database(pg_server.admin_dsn, name)
    leaky = await asyncpg.connect(
        pg_server.dsn_for(name), server_settings={"application_name": "leaky-test"}
    )
    try:
        assert await drop_database(pg_server.admin_dsn, name, grace=0.2) == ["leaky-test"]
        admin = await asyncpg.connect(pg_server.admin_dsn)
        try:
            assert not await admin.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name)
        finally:
            await admin.close()
    finally:
        leaky.terminate()  # its server side has gone already


async def test_leak_check_waits_for_closing_connections(pg_server: PgServer) -> None:
    name = new_database_name()
    await create_database(pg_server.admin_dsn, name)
    conn = await asyncpg.connect(pg_server.dsn_for(name))
    await conn.close()  # the backend may outlive this by a moment: not a leak
    assert await drop_database(pg_server.admin_dsn, name) == []


def test_migrated_databases(database_url: str, request: pytest.FixtureRequest) -> None:
    is_postgres = database_url.startswith("postgresql://")
    assert is_postgres or database_url.startswith("sqlite:////")
    assert (request.node.get_closest_marker("postgres") is not None) == is_postgres


async def test_pg_url_is_migrated(pg_url: str) -> None:
    conn = await asyncpg.connect(pg_url)
    try:
        assert await conn.fetchval("SELECT to_regclass('scheduler_publications') IS NOT NULL")
    finally:
        await conn.close()


def test_sqlite_url_is_migrated(sqlite_url: str) -> None:
    path = sqlite_url.removeprefix("sqlite:///")
    with closing(sqlite3.connect(path)) as conn:
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
    assert "scheduler_publications" in tables


# -- the TCP proxy ------------------------------------------------------------------


async def test_proxy_freezes_and_thaws_a_postgres_connection(
    pg_server: PgServer, pg_empty_url: str, tcp_proxy_factory: Callable[[str, int], TcpProxy]
) -> None:
    proxy = tcp_proxy_factory(pg_server.host, pg_server.port)
    url = replace_host_port(pg_empty_url, "127.0.0.1", proxy.port)
    conn = await asyncpg.connect(url)
    try:
        assert await conn.fetchval("SELECT 1") == 1
        proxy.freeze()
        # Neither a query on an open connection nor a new connection gets through, and
        # nothing is closed: both complete once thawed.
        query = asyncio.ensure_future(conn.fetchval("SELECT 2"))
        connecting = asyncio.ensure_future(asyncpg.connect(url))
        done, _ = await asyncio.wait({query, connecting}, timeout=1.0)
        assert not done
        proxy.thaw()
        assert await asyncio.wait_for(query, 5) == 2
        late = await asyncio.wait_for(connecting, 5)
        await late.close()
    finally:
        await conn.close()


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.close()
    await writer.wait_closed()


async def test_proxy_forwards_bulk_both_ways_and_closes_cleanly() -> None:
    echo = await asyncio.start_server(_echo, "127.0.0.1", 0)
    threads_before = threading.active_count()
    payload = bytes(range(256)) * 16384  # 4 MiB: more than every socket buffer on the way
    try:
        with TcpProxy("127.0.0.1", echo.sockets[0].getsockname()[1]) as proxy:
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            writer.write(payload)
            received = await asyncio.wait_for(reader.readexactly(len(payload)), 10)
            assert received == payload
        # The proxy has closed our connection: EOF, no thread left behind.
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        await writer.wait_closed()
        assert threading.active_count() == threads_before
    finally:
        echo.close()
        await echo.wait_closed()


async def test_proxy_passes_on_a_refused_connection() -> None:
    with TcpProxy("127.0.0.1", free_port()) as proxy:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        await writer.wait_closed()


# -- processes ----------------------------------------------------------------------


def _python(source: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(source)]


_CHATTY = _python(
    """
    import sys, time
    print("not json", file=sys.stderr)
    print('{"event": "tick", "n": 1}', file=sys.stderr)
    print('["json", "but not an object"]', file=sys.stderr)
    print('{"event": "tick", "n": 2}', file=sys.stderr)
    print('{"event": "half a li', end="", file=sys.stderr, flush=True)
    time.sleep(60)
    """
)


def test_daemon_env_drops_our_scheduler_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SCHEDULER_DATABASE_URL", "postgresql://elsewhere/db")
    monkeypatch.setenv("SCHEDULER_LOG__FORMAT", "console")
    env = daemon_env({"SCHEDULER_PUBLISH__INTERVAL": "0.1"})
    assert "SCHEDULER_DATABASE_URL" not in env
    assert env["SCHEDULER_LOG__FORMAT"] == "json"
    assert env["SCHEDULER_HTTP__ENABLED"] == "false"
    assert env["SCHEDULER_PUBLISH__INTERVAL"] == "0.1"
    assert env["PATH"]


def test_wait_for_log_matches_event_and_fields(daemons: Daemons) -> None:
    process = daemons.spawn(_CHATTY, daemon_env({}))
    assert process.wait_for_log("tick", timeout=10, n=2) == {"event": "tick", "n": 2}
    assert process.wait_for_log(("tock", "tick"), timeout=10) == {"event": "tick", "n": 1}
    assert [e["n"] for e in process.log_events()] == [1, 2]
    process.signal(signal.SIGTERM)
    assert process.wait(5) == -signal.SIGTERM
    assert "not json" in process.output()


def test_wait_for_log_timeout_shows_the_output(daemons: Daemons) -> None:
    process = daemons.spawn(_CHATTY, daemon_env({}), name="chatty")
    with pytest.raises(AssertionError, match=r"chatty .*still running.*'tock'") as failure:
        process.wait_for_log("tock", timeout=0.3)
    assert '"n": 2' in str(failure.value)


def test_wait_for_log_fails_at_once_when_the_process_dies(daemons: Daemons) -> None:
    process = daemons.spawn(_python("import sys; sys.exit('boom')"), daemon_env({}))
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"(?s)exited with 1.*boom"):
        process.wait_for_log("never", timeout=30)
    assert time.monotonic() - started < 10


def test_close_kills_even_stopped_processes(tmp_path: Path) -> None:
    with Daemons(tmp_path) as daemons:
        process = daemons.spawn(_python("import time; time.sleep(60)"), daemon_env({}))
        process.signal(signal.SIGSTOP)
    assert process.poll() == -signal.SIGKILL


def test_daemons_start_the_real_daemon_with_json_logs(
    daemons: Daemons, sqlite_empty_url: str
) -> None:
    daemon = daemons.start({"SCHEDULER_DATABASE_URL": sqlite_empty_url})
    daemon.wait_for_log("daemon.started", timeout=20)
    daemon.signal(signal.SIGTERM)
    assert daemon.wait(20) == 0


def test_run_cli_reaches_the_cli() -> None:
    result = run_cli(["--help"], timeout=30)
    assert result.returncode == 0, result.stderr
    assert "migrate" in result.stdout


def test_start_replicas_leader_first_then_standbys_placed(
    daemons: Daemons, sqlite_url: str
) -> None:
    env = {"SCHEDULER_DATABASE_URL": sqlite_url}
    envs = [(name, {**env, "SCHEDULER_INSTANCE_ID": name}) for name in ("one", "two", "three")]
    leader, *standbys = start_replicas(
        daemons, envs, ("run", "--only", "plugin"), leader_first=True
    )
    assert [p.name for p in (leader, *standbys)] == ["one", "two", "three"]
    assert leader.wait_for_log("leader.acquired", timeout=0, loop="plugin")
    for standby in standbys:  # placed when it returned: no waiting here
        assert standby.wait_for_log("leader.waiting", timeout=0, loop="plugin")
    for process in (leader, *standbys):
        process.signal(signal.SIGTERM)
        assert process.wait(20) == 0


# -- the one overlap rule -----------------------------------------------------------


@dataclass(frozen=True)
class _Span:
    holder: str
    start: float
    end: float
    scope: str = "loop"


def _pairs(spans: list[_Span], **options: object) -> list[tuple[str, str]]:
    found = find_overlaps(spans, scope=lambda s: s.scope, **options)  # type: ignore[arg-type]
    return [(f"{o.earlier.holder}{o.earlier.start:g}", f"{o.later.holder}{o.later.start:g}")
            for o in found]  # fmt: skip


def test_the_overlap_rule_touching_ends_moments_holders_and_scopes() -> None:
    by_holder: dict[str, object] = {"holder": lambda s: s.holder}
    # Intersecting: a shared stretch of time, however short.
    assert _pairs([_Span("a", 0, 1), _Span("b", 0.999, 2)], **by_holder) == [("a0", "b0.999")]
    # Touching ends are a hand-over; a moment at another's start or end too.
    touching = [_Span("a", 0, 1), _Span("b", 1, 2), _Span("c", 2, 2), _Span("a", 0, 0)]
    assert _pairs(touching, **by_holder) == []
    # A moment strictly inside another holder's interval is an overlap.
    assert _pairs([_Span("a", 0, 1), _Span("b", 0.5, 0.5)], **by_holder) == [("a0", "b0.5")]
    # Hidden behind a long interval: every pair is found, not only neighbours.
    hidden = [_Span("a", 0, 10), _Span("b", 1, 2), _Span("c", 3, 4)]
    assert _pairs(hidden, **by_holder) == [("a0", "b1"), ("a0", "c3")]
    # One holder's own intervals may intersect, unless every interval is its own holder.
    same = [_Span("a", 0, 1), _Span("a", 0.5, 2)]
    assert _pairs(same, **by_holder) == []
    assert _pairs(same) == [("a0", "a0.5")]
    # Scopes are apart: two loops' leaders may work at once.
    assert _pairs([_Span("a", 0, 1), _Span("b", 0, 1, scope="other")], **by_holder) == []
    with pytest.raises(AssertionError, match="ends before it starts"):
        find_overlaps([_Span("a", 1, 0)])


# -- pytest plugin: selection and CI strictness -------------------------------------

_PYTESTER_INI = """
[pytest]
markers =
    postgres: needs PostgreSQL
    chaos_long: long
"""


def _run_inner(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    # Without the plugins the inner runs do not need (hypothesis alone costs ~1 s).
    plugins = ("-p", "rig.plugin", "-p", "no:hypothesispytest", "-p", "no:asyncio")
    return pytester.runpytest(*plugins, *args)


def test_ci_is_set_reads_true_or_1() -> None:
    assert ci_is_set({"CI": "True"})
    assert ci_is_set({"CI": "1"})
    assert not ci_is_set({"CI": "false"})
    assert not ci_is_set({})


@pytest.mark.parametrize("ci", ["true", ""])
def test_ci_turns_postgres_skips_into_failures(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, ci: str
) -> None:
    monkeypatch.setenv("CI", ci)
    pytester.makeini(_PYTESTER_INI)
    pytester.makeconftest(
        """
        import pytest

        @pytest.fixture(scope="session")
        def pg_server():
            pytest.skip("no PostgreSQL")

        @pytest.fixture
        def pg_url(pg_server):
            return "postgresql://"
        """
    )
    pytester.makepyfile(
        """
        import pytest

        def test_needs_pg_indirectly(pg_url):
            pass

        @pytest.mark.postgres
        def test_marked_and_skips():
            pytest.skip("not today")

        @pytest.mark.postgres
        @pytest.mark.xfail(reason="known")
        def test_marked_and_xfails():
            assert False

        def test_unrelated_skip():
            pytest.skip("fine anywhere")
        """
    )
    result = _run_inner(pytester)
    if ci:
        result.assert_outcomes(errors=1, failed=1, xfailed=1, skipped=1)
        result.stdout.fnmatch_lines(["*CI=true forbids: not today*"])
    else:
        result.assert_outcomes(skipped=3, xfailed=1)


def test_chaos_long_is_deselected_unless_run_long(pytester: pytest.Pytester) -> None:
    pytester.makeini(_PYTESTER_INI)
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.chaos_long
        def test_long():
            pass

        def test_short():
            pass
        """
    )
    _run_inner(pytester).assert_outcomes(passed=1, deselected=1)
    _run_inner(pytester, "--run-long").assert_outcomes(passed=2)


# -- pytest plugin: the suite's time, heaviest files first ----------------------------------


def test_files_are_ordered_heaviest_first_unrecorded_before_all() -> None:
    @dataclass
    class Item:
        nodeid: str

    items = [Item(n) for n in ("a.py::x", "b.py::y", "a.py::z", "new.py::w", "c.py::v")]
    ordered = heaviest_first(items, {"a.py": 5.0, "b.py": 30.0, "c.py": 1.0})  # type: ignore[arg-type]
    assert [item.nodeid for item in ordered] == [
        "new.py::w", "b.py::y", "a.py::x", "a.py::z", "c.py::v",
    ]  # fmt: skip


def test_each_files_time_is_recorded_merged_and_only_from_a_passing_run(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        test_slow="import time\n\ndef test_one():\n    time.sleep(0.2)\n\ndef test_two():\n    pass\n",
        test_quick="def test_three():\n    pass\n",
    )
    record = pytester.path / "durations.json"
    record.write_text(json.dumps({"test_elsewhere.py": 99.0, "test_quick.py": 50.0}))
    result = _run_inner(pytester, "-p", "rig.durations", "--record-file-durations", str(record))
    result.assert_outcomes(passed=3)
    seconds = json.loads(record.read_text())
    assert list(seconds) == ["test_elsewhere.py", "test_slow.py", "test_quick.py"]
    assert seconds["test_slow.py"] >= 0.2
    assert seconds["test_quick.py"] < 50.0, "measured again"
    pytester.makepyfile(test_broken="def test_four():\n    assert False\n")
    result = _run_inner(pytester, "-p", "rig.durations", "--record-file-durations", str(record))
    result.assert_outcomes(passed=3, failed=1)
    assert json.loads(record.read_text()) == seconds, "a failing run records nothing"


# -- failures that explain themselves (rig/scene.py, rig/waiting.py) ---------------------


def test_wait_until_takes_an_empty_list_for_not_yet_and_shows_the_last_value() -> None:
    answers = iter([[], [], ["tick.done"]])
    assert wait_until(lambda: next(answers), 5, "a line", every=0.01) == ["tick.done"]
    with pytest.raises(AssertionError) as failed:
        wait_until(lambda: {"state": "standby"}.get("leader"), 0.05, "a leader", every=0.01)
    assert str(failed.value) == "not within 0.05s: a leader (last: None)"
    calls = iter([RuntimeError("starting"), "up"])

    def flaky() -> str:
        answer = next(calls)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert wait_until(flaky, 5, "up", every=0.01, not_yet=(RuntimeError,)) == "up"


async def test_a_failed_test_shows_its_processes_locks_and_rows(
    pytester: pytest.Pytester, pg_url: str
) -> None:
    holder = await asyncpg.connect(pg_url, server_settings={"application_name": "the-holder"})
    try:
        await holder.execute("SELECT pg_advisory_lock(424242)")
        await holder.execute(
            "INSERT INTO scheduler_leaders (loop, lock_key, instance, hostname, pid,"
            " backend_pid, acquired_at, heartbeat_at, fencing_token)"
            " VALUES ('plugin', 424242, 'ghost-1', 'h', 1, pg_backend_pid(), now(), now(), 7)"
        )
        pytester.makeini(_PYTESTER_INI)
        pytester.makepyfile(
            f"""
            import sys
            from rig.processes import Daemons, daemon_env
            from rig.waiting import wait_until

            def test_fails(scene, tmp_path, request):
                scene.watch_database({pg_url!r})
                daemons = Daemons(tmp_path)
                request.addfinalizer(daemons.close)  # after the report, as conftest's
                scene.watch_daemons(daemons)
                code = "print('a line from the replica', flush=True); import time; time.sleep(30)"
                process = daemons.spawn([sys.executable, "-c", code], daemon_env({{}}))
                wait_until(lambda: "replica" in process.output(), 10, "its line")
                wait_until(lambda: [], 0.05, "a leader")

            def test_passes(scene):
                scene.watch("never read", lambda: 1 / 0)
            """
        )
        result = await asyncio.to_thread(_run_inner, pytester, "-p", "rig.scene")
    finally:
        await holder.close()
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(
        [
            "*not within 0.05s: a leader (last: [])*",
            "*- scene: database t_*",
            "advisory locks: 1 row(s)",
            "*424242*the-holder*",
            "sessions: *",
            "*the-holder*",
            "scheduler_leaders: 1 row(s)",
            "*ghost-1*",
            "*- scene: processes -*",
            "--- daemon1 (pid *, still running, *",
            "a line from the replica",
        ]
    )
    assert "never read" not in result.stdout.str()
