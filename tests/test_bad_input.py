"""Promise 8's proof: bad input never stops the daemon (README promise 8,
docs/guarantees.md "8. Bad input never stops the daemon"). Real processes, but for a
command's own bug, which runs a made-up command in click's runner.

One line a clause, and the test that proves it:

- invalid config exits 78 at once, one line naming the key:
  `test_invalid_config_exits_78_naming_the_key`, `test_invalid_config_file_exits_78`;
- a login the database refuses exits 78 at once, never retried, from every command that
  connects: `test_wrong_password_exits_78_at_once`, `test_unknown_role_exits_78_at_once`,
  `test_unknown_database_exits_78_at_once` (a privilege refused after the login:
  `tests/test_cli.py::test_a_role_without_privileges_exits_78_naming_what_was_denied`);
- an unreachable database is retried with backoff, exit 69 past the startup budget:
  `test_unreachable_database_retries_then_exits_69`;
- a failing or hung publisher or plugin task is recorded as failed (a publisher call
  cancelled after `publish.publisher_timeout`, a task after its `timeout`) and the rest
  go on, in one daemon that goes on running and exits 0:
  `test_failing_and_hung_work_fails_alone_beside_healthy_work`;
- a bug ends the daemon, exit 70, with its traceback logged:
  `test_a_bug_in_a_loop_ends_the_daemon_with_70_and_a_traceback` (a bug planted in a real
  daemon's plugin loop); a tick that raises is the one exception, retried next interval
  with its traceback logged while the other loop goes on:
  `test_a_tick_that_raises_is_logged_with_its_traceback_and_retried`; a command's bug is
  one line and 70: `test_a_bug_is_one_line_and_exit_70`.

The detail lives elsewhere: `tests/test_publish_errors.py` (which publisher errors fail a
row, which roll a batch back, the cap on retries), `tests/test_plugin_loop.py` (failed and
timed-out runs, sync targets, auto-pause), `tests/test_loop_runner.py` (database errors
retried, a bug ends the loop), `tests/test_fuzz_config.py` (any environment, TOML or
bytes: 0 or 78 in one line) and `tests/test_hostile_input.py` (command lines, payloads,
rows written by hand, databases that never answer).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import click
import pytest
from click.testing import CliRunner
from plugin_targets import TARGETS_ENV
from rig.commands import CONNECTING_COMMANDS, REFUSAL_ENV, REFUSED_WITHIN
from rig.databases import PgServer, replace_dbname, run_sync, with_user
from rig.pgcluster import PgCluster
from rig.ports import free_port
from rig.processes import Daemons, run_cli, sitecustomize
from rig.sql import execute, fetch
from rig.waiting import wait_until

from scheduler_daemon.cli.common import handles_errors
from scheduler_daemon.errors import EXIT_CONFIG

# -- invalid config: 78 at once, one line naming the key --------------------------------

BAD_VALUES = [
    ({"SCHEDULER_PUBLISH__INTERVAL": "-1"}, "publish.interval"),
    ({"SCHEDULER_PUBLISH__BATCH_SIZE": "many"}, "publish.batch_size"),
    ({"SCHEDULER_DATABASE_URL": "redis://localhost/0"}, "database_url"),
    ({"SCHEDULER_LOCK__MODE": "sometimes"}, "lock.mode"),
    ({"SCHEDULER_LOCK__HEARTBEAT_INTERVAL": "30s"}, "lock"),
    ({"SCHEDULER_PUBLISH__PUBLISHERS": "notify"}, "publish"),
]


@pytest.mark.parametrize("command", [["check-config"], ["run"], ["migrate"]])
@pytest.mark.parametrize(("env", "key"), BAD_VALUES)
def test_invalid_config_exits_78_naming_the_key(
    tmp_path: Path, command: list[str], env: dict[str, str], key: str
) -> None:
    result = run_cli(command, env, cwd=tmp_path)
    assert result.returncode == 78, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert key in lines[0]
    assert not (tmp_path / "scheduler.db").exists(), "nothing may happen on bad config"


@pytest.mark.parametrize(
    ("toml", "key"),
    [
        ("[publish\ninterval = 1\n", "invalid TOML"),
        ("[publish]\nintreval = 1\n", "publish.intreval: unknown key"),
        ("[[plugin.tasks]]\nname = 'x'\nevery = '1s'\ntarget = 'no.such.module:f'\n", "'x'"),
    ],
)
def test_invalid_config_file_exits_78(tmp_path: Path, toml: str, key: str) -> None:
    config = tmp_path / "config.toml"
    config.write_text(toml)
    result = run_cli(["check-config", "--config", str(config)], cwd=tmp_path)
    assert result.returncode == 78
    assert key in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


# -- a login the database refuses is configuration: exit 78 at once, never retried ---------


def assert_refused_login(tmp_path: Path, url: str, what: str, secret: str | None = None) -> None:
    """Every connecting command exits 78 within seconds, one plain line naming `what`."""
    for args in CONNECTING_COMMANDS:
        started = time.monotonic()
        result = run_cli(args, {"SCHEDULER_DATABASE_URL": url, **REFUSAL_ENV}, cwd=tmp_path)
        elapsed = time.monotonic() - started
        assert result.returncode == EXIT_CONFIG, (args, result.returncode, result.stderr)
        assert elapsed < REFUSED_WITHIN, (args, elapsed)
        lines = result.stderr.strip().splitlines()
        assert "db.connect_failed" not in result.stderr, f"{args}: retried\n{result.stderr}"
        assert "Traceback" not in result.stderr
        plain = [line for line in lines if not line.startswith("{")]
        assert plain == [lines[-1]], result.stderr
        assert "refused the login" in lines[-1], lines[-1]
        assert what in lines[-1], lines[-1]
        if secret is not None:
            assert secret not in result.stderr + result.stdout


def test_unknown_database_exits_78_at_once(tmp_path: Path, pg_server: PgServer) -> None:
    name = f"no_such_db_{secrets.token_hex(4)}"
    url = replace_dbname(pg_server.admin_dsn, name)
    assert_refused_login(tmp_path, url, f'database "{name}" does not exist')


def test_unknown_role_exits_78_at_once(tmp_path: Path, pg_server: PgServer) -> None:
    role = f"no_such_role_{secrets.token_hex(4)}"
    url = with_user(pg_server.admin_dsn, role)
    assert_refused_login(tmp_path, url, f'role "{role}" does not exist')


async def _wait_for_password_auth(dsn: str) -> None:
    """pg_reload_conf() only signals the postmaster: wait until a wrong password fails."""
    deadline = time.monotonic() + 10
    while True:
        try:
            conn = await asyncpg.connect(dsn)
        except asyncpg.InvalidPasswordError:
            return
        await conn.close()
        assert time.monotonic() < deadline, "pg_hba.conf reload did not take effect"
        await asyncio.sleep(0.05)


@pytest.fixture
def password_role(pg_cluster: PgCluster, pg_server: PgServer) -> Iterator[tuple[str, str]]:
    """A role that must log in with its password (scram-sha-256), though the throwaway
    cluster trusts everyone else: a pg_hba.conf rule for this role alone, first."""
    role, password = f"pw_{secrets.token_hex(4)}", secrets.token_hex(8)
    execute(pg_server.admin_dsn, f"CREATE ROLE {role} LOGIN SUPERUSER PASSWORD '{password}'")
    hba = pg_cluster.data_dir / "pg_hba.conf"
    original = hba.read_text()
    rule = f"host all {role} {pg_cluster.host}/32 scram-sha-256\n"
    hba.write_text(rule + original)  # rewritten in place: the server's user keeps owning it
    try:
        execute(pg_server.admin_dsn, "SELECT pg_reload_conf()")
        run_sync(_wait_for_password_auth(with_user(pg_server.admin_dsn, role, "wrong")))
        yield role, password
    finally:
        hba.write_text(original)
        pg_server.ensure_running()
        execute(pg_server.admin_dsn, "SELECT pg_reload_conf()", f"DROP ROLE {role}")


def test_wrong_password_exits_78_at_once(
    tmp_path: Path, pg_url: str, password_role: tuple[str, str]
) -> None:
    role, password = password_role
    url = with_user(pg_url, role, "hunter2")
    assert_refused_login(
        tmp_path, url, f'password authentication failed for user "{role}"', secret="hunter2"
    )
    # The right password gets in: the refusal above was about the password.
    right = run_cli(
        ["status", "--json"], {"SCHEDULER_DATABASE_URL": with_user(pg_url, role, password)}
    )
    assert right.returncode == 0, right.stderr


# -- an unreachable database: retried with backoff, 69 past the startup budget ----------


def test_unreachable_database_retries_then_exits_69(daemons: Daemons) -> None:
    url = f"postgresql://app:hunter2@127.0.0.1:{free_port()}/app"
    started = time.monotonic()
    process = daemons.start(
        {"SCHEDULER_DATABASE_URL": url, "SCHEDULER_DATABASE__STARTUP_BUDGET": "3s"}
    )
    assert process.wait(timeout=30) == 69
    elapsed = time.monotonic() - started
    assert 3 <= elapsed < 25, elapsed
    retries = process.events("db.connect_failed")
    assert len(retries) >= 3, "it must retry with backoff before giving up"
    delays = [e["retry_in"] for e in retries]
    assert max(delays[:3]) < max(delays), f"backoff should grow: {delays}"
    output = process.output()
    assert "hunter2" not in output
    assert "app:***@" in output
    assert "database.startup_budget" in output.strip().splitlines()[-1]


# -- failing and hung work: recorded as failed, the rest go on --------------------------

HUNG_PUBLISHER_ERROR = (
    "PublisherTimedOut: publisher 'sample' timed out after 1s (publish.publisher_timeout)"
)


@pytest.mark.postgres
@pytest.mark.processes
def test_failing_and_hung_work_fails_alone_beside_healthy_work(
    daemons: Daemons, pg_url: str
) -> None:
    """One daemon, both loops, at the same time: a publisher that raises on one row and
    hangs on another, among healthy rows; a task that raises and one that hangs, beside a
    healthy one. Each bad piece is recorded as failed with its error, everything healthy
    is done, work that comes afterwards is done too, and the daemon runs on until SIGTERM
    (exit 0)."""
    url = pg_url
    fetch(url, "CREATE TABLE sample_publisher_audit (publication_id bigint, instance text)")
    payloads: list[dict[str, Any]] = [{"n": n} for n in range(12)]
    payloads[3] = {"raise": "OSError"}  # the sample publisher's endpoint fails
    payloads[7] = {"hang": True}  # the sample publisher's endpoint never answers
    rows = fetch(
        url,
        "INSERT INTO scheduler_publications (key, payload, publish_at) "
        "SELECT 'b' || n, p, now() FROM jsonb_array_elements($1::jsonb) "
        "WITH ORDINALITY AS a(p, n) RETURNING id, key",
        json.dumps(payloads),
    )
    ids = {row["key"]: row["id"] for row in rows}
    raising, hanging = ids["b4"], ids["b8"]
    healthy_rows = sorted(set(ids.values()) - {raising, hanging})

    tasks = [
        {"name": "healthy", "every": "300ms", "target": "plugin_targets:tick"},
        {"name": "failing", "every": "300ms", "target": "plugin_targets:fail"},
        {"name": "hanging", "every": "500ms", "timeout": "300ms", "target": "plugin_targets:hang"},
    ]
    process = daemons.start(
        {
            **TARGETS_ENV,
            "SCHEDULER_DATABASE_URL": url,
            "SCHEDULER_LOCK__HEARTBEAT_INTERVAL": "0.5",
            "SCHEDULER_PUBLISH__INTERVAL": "0.2",
            "SCHEDULER_PUBLISH__PUBLISHERS": '["sample"]',
            "SCHEDULER_PUBLISH__PUBLISHER_TIMEOUT": "1s",
            "SCHEDULER_PLUGIN__INTERVAL": "0.1",
            "SCHEDULER_PLUGIN__TASKS": json.dumps(tasks),
            "SCHEDULER_PLUGIN__DISABLED": '["purge_publications", "purge_runs"]',
            # Not auto-paused while the test counts its failures.
            "SCHEDULER_PLUGIN__MAX_CONSECUTIVE_FAILURES": "100",
        }
    )

    def publications() -> dict[int, dict[str, Any]]:
        found = fetch(url, "SELECT id, status, last_error FROM scheduler_publications")
        return {row["id"]: row for row in found}

    def runs(name: str) -> list[dict[str, Any]]:
        return fetch(
            url,
            "SELECT status, error, started_at, finished_at FROM scheduler_plugin_runs "
            "WHERE name = $1 ORDER BY id",
            name,
        )

    def count(name: str, status: str) -> int:
        return sum(run["status"] == status for run in runs(name))

    # The publish loop: every healthy row published, each bad row failed with its error.
    wait_until(
        lambda: all(row["status"] != "scheduled" for row in publications().values()),
        timeout=60,
        what="every due publication handled",
    )
    done = publications()
    assert {i for i, row in done.items() if row["status"] == "published"} == set(healthy_rows)
    assert {i: row["last_error"] for i, row in done.items() if row["status"] == "failed"} == {
        raising: f"OSError: the sample publisher's endpoint failed for {raising}",
        hanging: HUNG_PUBLISHER_ERROR,
    }
    audited = fetch(url, "SELECT publication_id FROM sample_publisher_audit")
    assert sorted(row["publication_id"] for row in audited) == healthy_rows

    # The plugin loop: the failing task fails, the hung one is timed out, again and again.
    wait_until(lambda: count("failing", "failed") >= 2, 60, "2 failed runs of 'failing'")
    wait_until(lambda: count("hanging", "timed_out") >= 2, 60, "2 timed_out runs of 'hanging'")
    bad_runs = [run for name in ("failing", "hanging") for run in runs(name)]
    last_bad_end = max(run["finished_at"] for run in bad_runs if run["finished_at"])

    # The rest go on: a healthy run that started after those ended succeeds, and a
    # publication due now is published.
    wait_until(
        lambda: any(
            run["status"] == "succeeded" and run["started_at"] > last_bad_end
            for run in runs("healthy")
        ),
        60,
        "a healthy run after the failures and timeouts",
    )
    [later] = fetch(
        url,
        "INSERT INTO scheduler_publications (key, payload, publish_at) "
        "VALUES ('later', '{}', now()) RETURNING id",
    )
    wait_until(
        lambda: publications()[later["id"]]["status"] == "published",
        60,
        "a publication due after the failures",
    )

    # What was recorded, run by run (a run still going has no status of its own yet).
    ended = {"succeeded", "failed", "timed_out", "skipped_overlap"}
    for name, status, error in [
        ("healthy", "succeeded", None),
        ("failing", "failed", "RuntimeError: boom for failing"),
        ("hanging", "timed_out", "timed out after 0.3s"),
    ]:
        recorded = {(run["status"], run["error"]) for run in runs(name) if run["status"] in ended}
        # A run that outlasts its next slot on a busy machine makes it skipped_overlap:
        # recorded, not lost.
        assert (status, error) in recorded, (name, recorded)
        assert {s for s, e in recorded if (s, e) != (status, error)} <= {"skipped_overlap"}, (
            name,
            recorded,
        )

    assert process.poll() is None, "the daemon must still be running"
    assert not process.events("tick.failed")
    process.signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0
    assert not process.events("tick.failed")


# -- a bug: exit 70, one line -----------------------------------------------------------

# Planted in the daemon's process before it starts (Python imports sitecustomize from the
# path at start-up): a method of the plugin loop raises what no database error looks like.
PLANTED_BUG = """
import scheduler_daemon.loops.plugin as plugin

async def planted(self, *args):
    raise ZeroDivisionError("a bug planted by the test")

plugin.PluginWork.{method} = planted
"""


def plant_bug(tmp_path: Path, method: str) -> str:
    """A PYTHONPATH entry that makes PluginWork.`method` raise."""
    return sitecustomize(tmp_path / "planted", PLANTED_BUG.format(method=method))


@pytest.mark.postgres
@pytest.mark.processes
def test_a_bug_in_a_loop_ends_the_daemon_with_70_and_a_traceback(
    daemons: Daemons, pg_url: str, tmp_path: Path
) -> None:
    """A bug escaping the loop's leadership (here its leadership_started hook) is not
    retried like database trouble: loop.crashed with its traceback, the daemon stops and
    exits 70, for its supervisor to restart it; its locks go with it."""
    env = {
        "SCHEDULER_DATABASE_URL": pg_url,
        "PYTHONPATH": plant_bug(tmp_path, "leadership_started"),
    }
    process = daemons.start(env)
    assert process.wait(timeout=60) == 70, process.output()
    [crashed] = process.events("loop.crashed")
    assert crashed["loop"] == "plugin"
    assert crashed["error"] == "ZeroDivisionError: a bug planted by the test"
    assert "Traceback" in crashed["exception"]
    assert "sitecustomize.py" in crashed["exception"]
    assert not process.events("loop.db_error"), "a bug is not retried"
    # Its locks go with its sessions, which end as the process does: no standby waits.
    held = (
        "SELECT count(*) AS n FROM pg_locks WHERE locktype = 'advisory' AND granted "
        "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    )
    wait_until(lambda: fetch(pg_url, held) == [{"n": 0}], 10, "its locks freed")


@pytest.mark.postgres
@pytest.mark.processes
def test_a_tick_that_raises_is_logged_with_its_traceback_and_retried(
    daemons: Daemons, pg_url: str, tmp_path: Path
) -> None:
    """A tick is one attempt at the loop's work, and a failing one is retried next
    interval (tick.failed, with its traceback, and the SchedulerTicksFailing alert): the
    daemon keeps its other loop going and stops cleanly."""
    env = {
        "SCHEDULER_DATABASE_URL": pg_url,
        "SCHEDULER_PLUGIN__INTERVAL": "0.2",
        "PYTHONPATH": plant_bug(tmp_path, "tick"),
    }
    process = daemons.start(env)
    wait_until(lambda: len(process.events("tick.failed")) >= 3, 60, "three failed ticks")
    failed = process.events("tick.failed")
    assert {e["loop"] for e in failed} == {"plugin"}
    assert "ZeroDivisionError: a bug planted by the test" in failed[0]["exception"]
    [row] = fetch(
        pg_url,
        "INSERT INTO scheduler_publications (key, payload, publish_at) "
        "VALUES ('beside', '{}', now()) RETURNING id",
    )
    wait_until(
        lambda: (
            fetch(pg_url, "SELECT status FROM scheduler_publications WHERE id = $1", row["id"])
            == [{"status": "published"}]
        ),
        60,
        "the publish loop goes on",
    )
    assert process.poll() is None
    process.signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0


def test_a_bug_is_one_line_and_exit_70() -> None:
    @click.command()
    @handles_errors
    def broken() -> None:
        raise RuntimeError("something impossible")

    result = CliRunner().invoke(broken, [])
    assert result.exit_code == 70
    assert result.output == (
        "scheduler-daemon: internal error (a bug; SCHEDULER_LOG__LEVEL=debug prints the "
        "traceback): RuntimeError: something impossible\n"
    )
