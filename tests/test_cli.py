"""The command line as users meet it: exit codes, one-line errors, no leaked secrets."""

from __future__ import annotations

import asyncio
import json
import secrets
import signal
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import asyncpg
import pytest
from rig.commands import CONNECTING_COMMANDS, REFUSAL_ENV, REFUSED_WITHIN
from rig.databases import PgServer, with_user
from rig.ports import free_port
from rig.processes import DaemonProcess, Daemons, run_cli, sitecustomize
from rig.sql import execute

from scheduler_daemon.config.settings import Settings
from scheduler_daemon.config.url import DatabaseUrl
from scheduler_daemon.db.connect import (
    explain_database_error,
    is_login_refused,
    is_transient,
    within_startup_budget,
)
from scheduler_daemon.errors import EXIT_CONFIG, LoginRefused, PrivilegeRefused
from scheduler_daemon.logs import get_logger


def test_check_config_prints_the_effective_config_without_secrets(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text('[publish]\ninterval = "2s"\n[http]\nport = 9999\n')
    env = {
        "SCHEDULER_DATABASE_URL": "postgresql://app:hunter2@db.internal:5432/app",
        "SCHEDULER_HTTP__PORT": "9100",
        "SCHEDULER_PUBLISH__PUBLISHERS": '["webhook"]',
        "SCHEDULER_PUBLISH__WEBHOOK__URL": "https://example.invalid/hook",
        "SCHEDULER_PUBLISH__WEBHOOK__SECRET": "s3cr3t-hmac",
    }
    result = run_cli(["check-config", "--config", str(config)], env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "hunter2" not in result.stdout
    assert "s3cr3t-hmac" not in result.stdout
    shown = json.loads(result.stdout)
    assert shown["database_url"] == "postgresql://app:***@db.internal:5432/app"
    assert shown["publish"]["interval"] == 2.0  # from the file
    assert shown["http"]["port"] == 9100  # env beats file
    names = [task["name"] for task in shown["plugin"]["effective_tasks"]]
    assert "purge_publications" in names


def test_check_config_redacts_the_webhook_url(tmp_path: Path) -> None:
    env = {
        "SCHEDULER_PUBLISH__PUBLISHERS": '["webhook"]',
        "SCHEDULER_PUBLISH__WEBHOOK__URL": "https://bot:pa55@hooks.example.com/T0/B0/t0ken",
        "SCHEDULER_PUBLISH__WEBHOOK__SECRET": "s3cr3t-hmac",
    }
    result = run_cli(["check-config"], env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for secret in ("pa55", "t0ken", "s3cr3t-hmac", "bot:"):
        assert secret not in result.stdout
    webhook = json.loads(result.stdout)["publish"]["webhook"]
    assert webhook["url"] == "https://hooks.example.com/***"
    assert webhook["secret"] == "**********"


@pytest.mark.parametrize(
    "args",
    [["schedule", "--at", "+1h"], ["cancel", "1"], ["tasks", "list"], ["tasks", "pause", "x"]],
)
def test_one_shot_commands_exit_69_when_the_database_is_down(
    tmp_path: Path, args: list[str]
) -> None:
    url = f"postgresql://app:hunter2@127.0.0.1:{free_port()}/app"
    # Their own budget: `run`'s startup_budget does not apply to them.
    env = {
        "SCHEDULER_DATABASE_URL": url,
        "SCHEDULER_DATABASE__COMMAND_BUDGET": "1s",
        "SCHEDULER_DATABASE__STARTUP_BUDGET": "1h",
    }
    result = run_cli(args, env, cwd=tmp_path)
    assert result.returncode == 69, result.stderr
    assert "hunter2" not in result.stderr + result.stdout
    assert "Traceback" not in result.stderr
    # Retries are logged as JSON events; the refusal itself is one plain line, last.
    lines = result.stderr.strip().splitlines()
    plain = [line for line in lines if not line.startswith("{")]
    assert plain == [lines[-1]], result.stderr
    assert lines[-1].startswith("scheduler-daemon: database postgresql://app:***@127.0.0.1:")
    assert "unreachable for 1s (database.command_budget)" in lines[-1]


@pytest.mark.parametrize(
    ("error", "refused"),
    [
        (asyncpg.InvalidPasswordError('password authentication failed for user "app"'), True),
        (asyncpg.InvalidAuthorizationSpecificationError('role "app" does not exist'), True),
        (asyncpg.InvalidAuthorizationSpecificationError("no pg_hba.conf entry"), True),
        (asyncpg.InvalidCatalogNameError('database "app" does not exist'), True),
        (asyncpg.CannotConnectNowError("the database system is starting up"), False),
        (asyncpg.TooManyConnectionsError("sorry, too many clients already"), False),
        (asyncpg.InsufficientPrivilegeError("permission denied for table x"), False),
        (asyncpg.UndefinedTableError('relation "x" does not exist'), False),
        (ConnectionRefusedError(111, "Connection refused"), False),
        (TimeoutError(), False),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, BaseException) else str(value),
)
def test_login_refusals_are_told_apart_from_unavailability(
    error: BaseException, refused: bool
) -> None:
    assert is_login_refused(error) is refused
    if refused:
        assert not is_transient(error), "a refusal must never be retried"


async def test_a_refused_login_is_not_retried() -> None:
    settings = Settings(
        database_url="postgresql://app:hunter2@db.invalid/app",
        database={"startup_budget": 30},
    )
    attempts = 0

    async def attempt() -> None:
        nonlocal attempts
        attempts += 1
        raise asyncpg.InvalidPasswordError('password authentication failed for user "app"')

    with pytest.raises(LoginRefused) as info:
        await within_startup_budget(attempt, settings, get_logger(), failed_event="db.x")
    assert attempts == 1
    assert info.value.exit_code == EXIT_CONFIG
    assert str(info.value) == (
        "database_url postgresql://app:***@db.invalid/app: the database refused the login: "
        'password authentication failed for user "app"'
    )


def test_sigterm_during_startup_retries_exits_promptly(daemons: Daemons) -> None:
    url = f"postgresql://app@127.0.0.1:{free_port()}/app"
    process = daemons.start({"SCHEDULER_DATABASE_URL": url})
    process.wait_for_log("db.connect_failed")
    process.signal(signal.SIGTERM)
    assert process.wait(timeout=10) == 0


# Holds the import of the CLI for 3 s (a meta path finder runs before any import is
# found): the daemon's own signal handlers are not up yet, only the entry point's.
SLOW_CLI_IMPORT = """
import sys, time

class SlowCli:
    def find_spec(self, name, path=None, target=None):
        if name == "scheduler_daemon.cli":
            time.sleep(3)
        return None

sys.meta_path.insert(0, SlowCli())
"""


def test_sigterm_before_the_daemon_is_up_exits_0(daemons: Daemons, tmp_path: Path) -> None:
    """A stop that lands while Python still imports the daemon: was the signal's default
    action (exit -15), as for a replica scaled down just after it started."""
    process = daemons.start({"PYTHONPATH": sitecustomize(tmp_path / "slow", SLOW_CLI_IMPORT)})
    time.sleep(1.5)  # inside the held import, well after Python itself started
    process.signal(signal.SIGTERM)
    assert process.wait(timeout=15) == 0, process.output()
    assert not process.log_events(), "it stopped before it started"


def test_run_ticks_on_sqlite_default_and_sigterm_exits_0(daemons: Daemons) -> None:
    """`make run`: no configuration at all, the SQLite file in the working directory."""
    process = daemons.start({"SCHEDULER_PLUGIN__INTERVAL": "0.2", "SCHEDULER_LOG__LEVEL": "debug"})
    process.wait_for_log("daemon.started")
    process.wait_for_log("tick.done", loop="plugin")
    process.wait_for_log("leader.acquired", loop="publish")
    assert (process.directory / "scheduler.db").exists()
    started = time.monotonic()
    process.signal(signal.SIGTERM)
    assert process.wait(timeout=15) == 0
    assert time.monotonic() - started < 10
    events = [e["event"] for e in process.log_events()]
    assert events.index("daemon.stopping") < events.index("daemon.stopped")
    assert all(e.get("instance") for e in process.log_events()), "every line names the instance"


def test_sigterm_cancels_a_tick_past_the_shutdown_timeout(daemons: Daemons) -> None:
    # A query that never ends, on the leader's connection.
    task = {"name": "stuck", "every": "1s", "timeout": "1h",
            "sql": "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) "
                   "SELECT count(*) FROM c"}  # fmt: skip
    process = daemons.start(
        {
            "SCHEDULER_PLUGIN__TASKS": json.dumps([task]),
            "SCHEDULER_SHUTDOWN_TIMEOUT": "1s",
            "SCHEDULER_PUBLISH__ENABLED": "false",
        }
    )
    process.wait_for_log("task.started", task="stuck")
    started = time.monotonic()
    process.signal(signal.SIGTERM)
    assert process.wait(timeout=20) == 0
    assert time.monotonic() - started < 15


def test_second_signal_forces_exit(daemons: Daemons) -> None:
    task = {"name": "stuck", "every": "1s", "timeout": "1h",
            "sql": "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) "
                   "SELECT count(*) FROM c"}  # fmt: skip
    process = daemons.start(
        {"SCHEDULER_PLUGIN__TASKS": json.dumps([task]), "SCHEDULER_PUBLISH__ENABLED": "false"}
    )
    process.wait_for_log("task.started", task="stuck")
    process.signal(signal.SIGTERM)
    process.wait_for_log("daemon.stopping")
    process.signal(signal.SIGINT)
    assert process.wait(timeout=20) == 130


def test_schedule_cancel_status_round_trip(tmp_path: Path, sqlite_url: str) -> None:
    env = {"SCHEDULER_DATABASE_URL": sqlite_url}
    first = run_cli(["schedule", "--at", "+1h", "--payload", '{"post": 1}', "--key", "p1"], env)
    assert first.returncode == 0, first.stderr
    again = run_cli(["schedule", "--at", "+2h", "--key", "p1"], env)
    assert again.returncode == 0
    assert again.stdout == first.stdout
    assert "already scheduled" in again.stderr
    publication_id = first.stdout.strip()

    status = run_cli(["status", "--json"], env)
    assert json.loads(status.stdout)["publications"]["scheduled"] == 1

    cancelled = run_cli(["cancel", publication_id], env)
    assert cancelled.returncode == 0
    assert json.loads(cancelled.stdout)["status"] == "cancelled"
    twice = run_cli(["cancel", publication_id], env)
    assert twice.returncode == 65
    assert "cancelled, not scheduled" in twice.stderr
    unknown = run_cli(["cancel", "99999"], env)
    assert unknown.returncode == 65
    assert "no publication with id 99999" in unknown.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--at", "2030-01-01T00:00:00"], "give a timezone"),
        (["--at", "tomorrow"], "not an ISO 8601 time"),
        (["--at", "+1h", "--payload", "{not json"], "not valid JSON"),
    ],
)
def test_schedule_rejects_bad_input(sqlite_url: str, args: list[str], message: str) -> None:
    result = run_cli(["schedule", *args], {"SCHEDULER_DATABASE_URL": sqlite_url})
    assert result.returncode == 65
    assert message in result.stderr


@pytest.mark.postgres
def test_ten_concurrent_migrations_apply_each_once(daemons: Daemons, pg_empty_url: str) -> None:
    processes = [
        daemons.start({"SCHEDULER_DATABASE_URL": pg_empty_url}, args=["migrate"]) for _ in range(10)
    ]
    outputs = []
    for process in processes:
        assert process.wait(timeout=60) == 0, process.output()
        outputs.append((process.directory / "stdout.log").read_text())
    # Each migration by one process: those in a transaction together, and one outside a
    # transaction (0014, CREATE INDEX CONCURRENTLY) by whichever process reaches it first.
    applied = [
        name.strip()
        for line in outputs
        if "nothing to apply" not in line
        for name in line[line.index("(") + 1 : line.rindex(")")].split(",")
    ]
    assert sorted(applied) == sorted(set(applied)), f"a migration applied twice: {outputs}"

    import asyncio

    import asyncpg

    async def versions() -> list[int]:
        conn = await asyncpg.connect(pg_empty_url)
        try:
            rows = await conn.fetch("SELECT version FROM scheduler_schema_version ORDER BY 1")
        finally:
            await conn.close()
        return [row["version"] for row in rows]

    from scheduler_daemon.db.sqlfiles import migrations

    assert asyncio.run(versions()) == [m.version for m in migrations("postgres")]
    assert sorted(applied) == sorted(f"{m.version:04d}_{m.name}" for m in migrations("postgres"))


def test_ten_concurrent_migrations_on_sqlite(daemons: Daemons, sqlite_empty_url: str) -> None:
    processes = [
        daemons.start({"SCHEDULER_DATABASE_URL": sqlite_empty_url}, args=["migrate"])
        for _ in range(10)
    ]
    outputs = []
    for process in processes:
        assert process.wait(timeout=60) == 0, process.output()
        outputs.append((process.directory / "stdout.log").read_text())
    assert sum("nothing to apply" not in line for line in outputs) == 1, outputs


def test_version(tmp_path: Path) -> None:
    result = run_cli(["--version"], cwd=tmp_path)
    assert result.returncode == 0
    assert "scheduler-daemon" in result.stdout


@pytest.mark.postgres
def test_a_transient_migration_failure_is_retried(daemons: Daemons, pg_empty_url: str) -> None:
    """Another migrator holds the migration lock past our statement timeout: the daemon
    retries within its startup budget instead of exiting."""
    import asyncio

    import asyncpg

    from scheduler_daemon.db.postgres_migrate import MIGRATION_LOCK_KEY

    async def hold_lock_while_starting() -> DaemonProcess:
        conn = await asyncpg.connect(pg_empty_url)
        try:
            async with conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock($1)", MIGRATION_LOCK_KEY)
                process = daemons.start(
                    {
                        "SCHEDULER_DATABASE_URL": pg_empty_url,
                        "SCHEDULER_DATABASE__STATEMENT_TIMEOUT": "1s",
                    }
                )
                await asyncio.to_thread(process.wait_for_log, "db.migrate_failed", timeout=30)
        finally:
            await conn.close()
        return process

    process = asyncio.run(hold_lock_while_starting())
    process.wait_for_log("daemon.started", timeout=30)
    assert process.poll() is None


@pytest.mark.postgres
@pytest.mark.processes
def test_sigterm_while_migrating_waits_on_the_migration_lock_exits_0_at_once(
    daemons: Daemons, pg_empty_url: str
) -> None:
    """Another replica migrating holds the migration lock: startup waits on it (up to
    database.startup_budget, retried past each statement timeout) and SIGTERM ends the
    wait and the process at once, exit 0, with nothing applied and no session left."""
    from scheduler_daemon.db.postgres_migrate import MIGRATION_LOCK_KEY

    hold = f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK_KEY})"
    _sigterm_while_startup_waits(daemons, pg_empty_url, hold)


@pytest.mark.postgres
@pytest.mark.processes
def test_sigterm_while_startup_waits_on_the_version_table_exits_0_at_once(
    daemons: Daemons, pg_url: str
) -> None:
    """The same while reading which migrations are applied waits on another migration's
    lock on the version table (its ALTERs in flight)."""
    hold = "LOCK TABLE scheduler_schema_version IN ACCESS EXCLUSIVE MODE"
    _sigterm_while_startup_waits(daemons, pg_url, hold)


@pytest.mark.postgres
async def test_a_stop_while_the_grants_are_checked_ends_startup_at_once(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The grant check is the last step before the loops start; a stop requested while it
    waits (a slow database: here, one that never answers) ends startup with exit 0."""
    from scheduler_daemon.daemon import Daemon
    from scheduler_daemon.db.postgres import PostgresStore

    checking, cancelled = asyncio.Event(), asyncio.Event()

    async def never_answers(*_args: object) -> None:
        checking.set()
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()

    monkeypatch.setattr(PostgresStore, "refuse_missing_grants", never_answers)
    settings = Settings(
        database_url=pg_url,  # type: ignore[arg-type]
        http={"enabled": False},
        database={"startup_budget": 600},
    )
    daemon = Daemon(settings, get_logger())
    running = asyncio.create_task(daemon.run())
    await asyncio.wait_for(checking.wait(), 30)
    daemon.request_stop("SIGTERM")
    assert await asyncio.wait_for(running, 30) == 0
    assert cancelled.is_set()
    assert not daemon.started.is_set()


def _sigterm_while_startup_waits(daemons: Daemons, url: str, hold: str) -> None:
    async def sigterm_while_waiting() -> DaemonProcess:
        holder, watcher = await asyncpg.connect(url), await asyncpg.connect(url)
        try:
            async with holder.transaction():
                await holder.execute(hold)
                process = daemons.start(
                    {
                        "SCHEDULER_DATABASE_URL": url,
                        "SCHEDULER_INSTANCE_ID": "startup-1",
                        "SCHEDULER_DATABASE__STARTUP_BUDGET": "10m",
                    }
                )
                deadline = time.monotonic() + 30
                while not await watcher.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                    "AND application_name = 'scheduler-daemon/startup-1/migrate'"
                ):
                    assert process.poll() is None, process.output()[-3000:]
                    assert time.monotonic() < deadline, process.output()[-3000:]
                    await asyncio.sleep(0.05)
                process.signal(signal.SIGTERM)
                # The budget is 10 minutes, the statement timeout 30 s: an exit within this
                # bound is the stop, not a timeout; and the lock is still held.
                code = await asyncio.to_thread(process.wait, 20)
                assert code == 0, process.output()[-3000:]
            deadline = time.monotonic() + 10  # the server notices the closed sockets
            while await watcher.fetchval(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE application_name LIKE 'scheduler-daemon/startup-1/%'"
            ):
                assert time.monotonic() < deadline, "the exited daemon's sessions outlive it"
                await asyncio.sleep(0.05)
            return process
        finally:
            await holder.close()
            await watcher.close()

    process = asyncio.run(sigterm_while_waiting())
    events = [e.get("event") for e in process.log_events()]
    assert "daemon.stopping" in events
    assert "db.migrated" not in events, events
    assert "daemon.started" not in events, events


@pytest.mark.parametrize(
    "url_fixture", ["sqlite_empty_url", pytest.param("pg_empty_url", marks=pytest.mark.postgres)]
)
def test_preflight_checks_and_migrates_like_run(
    request: pytest.FixtureRequest, url_fixture: str, tmp_path: Path
) -> None:
    """The compose preflight: what `run` checks before its loops, migrations included."""
    url: str = request.getfixturevalue(url_fixture)
    env = {"SCHEDULER_DATABASE_URL": url}
    result = run_cli(["preflight"], env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "preflight passed" in result.stdout
    assert "schema version None" not in result.stdout
    status = run_cli(["status", "--json"], env, cwd=tmp_path)
    assert status.returncode == 0, status.stderr  # migrated: the schema is there


def test_preflight_exits_as_run_would(tmp_path: Path) -> None:
    unreachable = {
        "SCHEDULER_DATABASE_URL": f"postgresql://app@127.0.0.1:{free_port()}/app",
        "SCHEDULER_DATABASE__STARTUP_BUDGET": "1s",
    }
    result = run_cli(["preflight"], unreachable, cwd=tmp_path)
    assert result.returncode == 69, result.stderr
    assert "Traceback" not in result.stderr
    config = tmp_path / "bad.toml"
    config.write_text('[[plugin.tasks]]\nname = "x"\ntarget = "no.such:module"\nevery = "1s"\n')
    result = run_cli(["preflight", "--config", str(config)], cwd=tmp_path)
    assert result.returncode == 78, result.stderr
    assert "no.such" in result.stderr
    assert not (tmp_path / "scheduler.db").exists()  # refused before touching the database


# -- issue 11.2: every command failure is one line and a sysexits code, never a traceback ---


def assert_one_line(result: subprocess.CompletedProcess[str], code: int, *phrases: str) -> str:
    """`result` exited `code` with no traceback and exactly one plain (non-JSON) line on
    stderr, the last, holding every phrase; returns that line."""
    assert result.returncode == code, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr + result.stdout
    lines = result.stderr.strip().splitlines()
    plain = [line for line in lines if not line.startswith("{")]
    assert plain == lines[-1:], result.stderr
    for phrase in phrases:
        assert phrase in lines[-1], (phrase, lines[-1])
    return lines[-1]


# Every command that reads or writes the schema (`run` and `migrate` create it instead).
SCHEMA_COMMANDS = [
    ["status"],
    ["status", "--json"],
    ["schedule", "--at", "+1h"],
    ["cancel", "1"],
    ["tasks", "list"],
    ["tasks", "list", "--json"],
    ["tasks", "pause", "x"],
]


@pytest.mark.parametrize("args", SCHEMA_COMMANDS, ids=" ".join)
def test_commands_on_a_missing_sqlite_file_say_run_migrate_and_leave_no_file(
    tmp_path: Path, args: list[str]
) -> None:
    """`cd $(mktemp -d) && scheduler-daemon status`: was rc 1, a 63-line sqlite3
    traceback and an empty scheduler.db left behind."""
    result = run_cli(args, cwd=tmp_path)
    assert_one_line(result, 66, "schema not found", "run `scheduler-daemon migrate`")
    assert list(tmp_path.iterdir()) == [], "nothing may be created"


def test_commands_on_an_empty_sqlite_file_say_run_migrate(tmp_path: Path) -> None:
    (tmp_path / "scheduler.db").touch()  # what the old version left behind
    for args in SCHEMA_COMMANDS:
        result = run_cli(args, cwd=tmp_path)
        assert_one_line(result, 66, "schema not found (no such table: scheduler_", "migrate`")


@pytest.mark.postgres
def test_commands_on_an_unmigrated_postgres_database_say_run_migrate(
    tmp_path: Path, pg_empty_url: str
) -> None:
    """Was rc 1 and a 64-68 line UndefinedTableError traceback."""
    for args in SCHEMA_COMMANDS:
        result = run_cli(args, {"SCHEDULER_DATABASE_URL": pg_empty_url}, cwd=tmp_path)
        assert_one_line(
            result, 66, 'schema not found (relation "scheduler_', "run `scheduler-daemon migrate`"
        )


@pytest.fixture
def unprivileged_url(pg_url: str, pg_server: PgServer) -> Iterator[tuple[str, str]]:
    """A role that may log in to the migrated database and do nothing else."""
    role = f"nopriv_{secrets.token_hex(4)}"
    execute(pg_server.admin_dsn, f"CREATE ROLE {role} LOGIN")
    try:
        yield with_user(pg_url, role), role
    finally:
        execute(pg_server.admin_dsn, f"DROP ROLE {role}")


@pytest.mark.postgres
def test_a_role_without_privileges_exits_78_naming_what_was_denied(
    tmp_path: Path, unprivileged_url: tuple[str, str]
) -> None:
    """Was rc 1 and a 48-65 line InsufficientPrivilegeError traceback (`run`: 69)."""
    url, role = unprivileged_url
    for args in [*CONNECTING_COMMANDS, ["cancel", "1"], ["tasks", "pause", "x"]]:
        started = time.monotonic()
        result = run_cli(args, {"SCHEDULER_DATABASE_URL": url, **REFUSAL_ENV}, cwd=tmp_path)
        elapsed = time.monotonic() - started
        line = assert_one_line(result, 78, "permission denied for ", "(SQLSTATE 42501)", role)
        assert "table scheduler_" in line or "schema public" in line, line
        assert "db.migrate_failed" not in result.stderr, "a missing privilege is not retried"
        assert elapsed < REFUSED_WITHIN, (args, elapsed)


def test_one_shot_commands_wait_the_command_budget_not_the_startup_budget(
    tmp_path: Path,
) -> None:
    """An unreachable database: was 60 s (database.startup_budget) before exit 69."""
    url = f"postgresql://app@127.0.0.1:{free_port()}/app"
    started = time.monotonic()
    result = run_cli(["status"], {"SCHEDULER_DATABASE_URL": url}, cwd=tmp_path)
    elapsed = time.monotonic() - started
    assert_one_line(result, 69, "unreachable for 5s (database.command_budget)")
    assert 4.5 <= elapsed < 15, elapsed


def _hold_write_lock(url: str) -> sqlite3.Connection:
    """Another process's long write transaction: SQLite's write lock, taken and kept."""
    conn = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")
    conn.execute("UPDATE scheduler_publications SET attempts = attempts")
    return conn


def test_sqlite_reads_do_not_wait_for_a_writer(tmp_path: Path, sqlite_url: str) -> None:
    """`status` and `tasks list` took the write lock to read: 30 s, then a traceback.

    The writer holds its lock until the end of the test, so a read that waited for it
    could only fail (after the busy timeout): succeeding is the proof, whatever the time
    a CLI process takes on a busy machine (5.8 s was seen, with two suites side by side)."""
    holder = _hold_write_lock(sqlite_url)
    try:
        env = {"SCHEDULER_DATABASE_URL": sqlite_url}
        for args in (
            ["status"],
            ["status", "--json"],
            ["tasks", "list"],
            ["tasks", "list", "--json"],
        ):
            result = run_cli(args, env, cwd=tmp_path)
            assert result.returncode == 0, (args, result.stderr)
    finally:
        holder.close()


def test_sqlite_writes_against_a_held_lock_exit_75_in_one_line(
    tmp_path: Path, sqlite_url: str
) -> None:
    """20 parallel `schedule` calls against a writer that held the lock past busy_timeout
    all ended in tracebacks (rc 1)."""
    env = {"SCHEDULER_DATABASE_URL": sqlite_url, "SCHEDULER_DATABASE__STATEMENT_TIMEOUT": "1s"}
    holder = _hold_write_lock(sqlite_url)
    try:
        commands = [["schedule", "--at", "+1h"]] * 6 + [["tasks", "pause", "x"], ["cancel", "1"]]
        with ThreadPoolExecutor(len(commands)) as pool:
            results = list(pool.map(lambda args: run_cli(args, env, cwd=tmp_path), commands))
    finally:
        holder.close()
    for result in results:
        assert_one_line(result, 75, "database is locked", "nothing was changed, try again")
    # Nothing was scheduled; with the lock free again, scheduling works.
    assert json.loads(run_cli(["status", "--json"], env).stdout)["publications"]["scheduled"] == 0
    assert run_cli(["schedule", "--at", "+1h"], env).returncode == 0


def test_sqlite_status_says_standbys_are_not_visible(sqlite_url: str) -> None:
    env = {"SCHEDULER_DATABASE_URL": sqlite_url}
    text = run_cli(["status"], env)
    assert text.returncode == 0, text.stderr
    assert text.stdout.count("standbys unknown (not visible on SQLite)") == 2, text.stdout
    report = json.loads(run_cli(["status", "--json"], env).stdout)
    assert {loop["standbys"] for loop in report["loops"].values()} == {None}


def test_a_lock_file_that_cannot_be_opened_exits_78_naming_it(
    daemons: Daemons, sqlite_url: str
) -> None:
    """Was retried for ever, one `loop.db_error` warning after another."""
    lock = Path(sqlite_url.removeprefix("sqlite:///") + ".publish.lock")
    lock.mkdir()  # root can open any file; nobody can open a directory for writing
    process = daemons.start({"SCHEDULER_DATABASE_URL": sqlite_url})
    assert process.wait(timeout=20) == 78
    output = process.output()
    assert "Traceback" not in output
    assert "loop.db_error" not in output
    last = output.strip().splitlines()[-1]
    assert last.startswith(f"scheduler-daemon: lock file {lock} (for the publish loop)"), last
    assert "Is a directory" in last


@pytest.mark.parametrize(
    ("error", "exit_code", "phrase"),
    [
        (sqlite3.OperationalError("database is locked"), 75, "try again"),
        (asyncpg.LockNotAvailableError("canceling statement due to lock timeout"), 75, "try"),
        (asyncpg.DeadlockDetectedError("deadlock detected"), 75, "try again"),
        (asyncpg.InsufficientPrivilegeError("permission denied for table x"), 78, "42501"),
        (asyncpg.InvalidPasswordError("password authentication failed"), 78, "refused"),
        (asyncpg.UndefinedTableError('relation "x" does not exist'), 66, "migrate`"),
        (sqlite3.OperationalError("no such table: scheduler_x"), 66, "migrate`"),
        (ConnectionResetError(104, "Connection reset by peer"), 69, "reset"),
        (asyncpg.UniqueViolationError("duplicate key"), 70, "UniqueViolationError"),
        (sqlite3.DatabaseError("database disk image is malformed"), 70, "malformed"),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, BaseException) else str(value),
)
def test_database_errors_are_explained(error: BaseException, exit_code: int, phrase: str) -> None:
    url = DatabaseUrl.parse("postgresql://app:hunter2@db/app")
    explained = explain_database_error(error, url)
    assert explained is not None
    assert explained.exit_code == exit_code
    assert phrase in str(explained)
    assert "hunter2" not in str(explained)
    assert explain_database_error(ValueError("a bug"), url) is None


async def test_a_missing_privilege_is_not_retried() -> None:
    settings = Settings(database_url="postgresql://app@db.invalid/app")
    attempts = 0

    async def attempt() -> None:
        nonlocal attempts
        attempts += 1
        raise asyncpg.InsufficientPrivilegeError("permission denied for schema public")

    with pytest.raises(PrivilegeRefused) as info:
        await within_startup_budget(attempt, settings, get_logger(), failed_event="db.x")
    assert attempts == 1
    assert info.value.exit_code == EXIT_CONFIG
    assert "permission denied for schema public (SQLSTATE 42501)" in str(info.value)
    assert "'app'" in str(info.value)


def test_a_missing_sqlite_directory_is_configuration(tmp_path: Path) -> None:
    """No restart creates the directory: 78, which supervisors do not restart (was 69)."""
    url = f"sqlite:///{tmp_path / 'no-such-dir' / 'scheduler.db'}"
    for args in (["run"], ["migrate"], ["status"]):
        result = run_cli(args, {"SCHEDULER_DATABASE_URL": url}, cwd=tmp_path)
        assert result.returncode == 78, (args, result.stderr)
        assert "does not exist" in result.stderr
        assert "Traceback" not in result.stderr
