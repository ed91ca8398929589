"""Plugin tasks at their edges: a target that never returns, a SQL task longer than the
session's statement timeout."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
from rig.processes import Daemons
from rig.sql import fetch
from rig.ticks import FAST_TIMINGS
from rig.waiting import wait_until

TESTS = str(Path(__file__).resolve().parent)


def test_a_sync_target_that_never_returns_does_not_keep_the_daemon_alive(
    daemons: Daemons, sqlite_url: str
) -> None:
    task = {"name": "stuck", "every": "1h", "target": "plugin_targets:block_forever"}
    process = daemons.start(
        {
            "SCHEDULER_DATABASE_URL": sqlite_url,
            "SCHEDULER_PLUGIN__TASKS": json.dumps([task]),
            "SCHEDULER_SHUTDOWN_TIMEOUT": "1s",
            "PYTHONPATH": TESTS,
        },
        args=["run", "--only", "plugin"],
    )
    process.wait_for_log("task.started", task="stuck")
    started = time.monotonic()
    process.signal(signal.SIGTERM)
    assert process.wait(timeout=20) == 0
    assert time.monotonic() - started < 10


@pytest.mark.postgres
def test_a_sql_task_may_outlast_the_session_statement_timeout(
    daemons: Daemons, pg_url: str
) -> None:
    task = {"name": "long", "every": "1h", "timeout": "10s", "sql": "SELECT pg_sleep(2)"}
    process = daemons.start(
        {
            "SCHEDULER_DATABASE_URL": pg_url,
            "SCHEDULER_DATABASE__STATEMENT_TIMEOUT": "1s",
            "SCHEDULER_PLUGIN__TASKS": json.dumps([task]),
        },
        args=["run", "--only", "plugin"],
    )
    process.wait_for_log("task.succeeded", task="long", timeout=30)
    status = fetch(pg_url, "SELECT status FROM scheduler_plugin_runs WHERE name = 'long'")
    assert status == [{"status": "succeeded"}]


@pytest.mark.postgres
def test_a_sql_task_past_its_own_timeout_is_timed_out(daemons: Daemons, pg_url: str) -> None:
    task = {"name": "long", "every": "1h", "timeout": "1s", "sql": "SELECT pg_sleep(30)"}
    process = daemons.start(
        {"SCHEDULER_DATABASE_URL": pg_url, "SCHEDULER_PLUGIN__TASKS": json.dumps([task])},
        args=["run", "--only", "plugin"],
    )
    process.wait_for_log("task.timed_out", task="long", timeout=30)
    rows = fetch(pg_url, "SELECT status FROM scheduler_plugin_runs WHERE name = 'long'")
    assert rows == [{"status": "timed_out"}]


@pytest.mark.postgres
def test_a_leader_killed_mid_statement_frees_its_lock_promptly(
    daemons: Daemons, pg_url: str
) -> None:
    """The server only notices a dead client between statements, unless it checks: the
    lock connection sets client_connection_check_interval, so a standby takes over while
    the dead leader's 60 s statement would still be running."""
    task = {"name": "long", "every": "1h", "timeout": "2m", "sql": "SELECT pg_sleep(60)"}
    env = {"SCHEDULER_DATABASE_URL": pg_url, "SCHEDULER_PLUGIN__TASKS": json.dumps([task])}
    first = daemons.start(
        env | {"SCHEDULER_INSTANCE_ID": "first"}, args=["run", "--only", "plugin"]
    )
    first.wait_for_log("task.started", task="long")
    second = daemons.start(
        env | {"SCHEDULER_INSTANCE_ID": "second"}, args=["run", "--only", "plugin"]
    )
    second.wait_for_log("leader.waiting")
    killed = time.monotonic()
    first.signal(signal.SIGKILL)
    second.wait_for_log("leader.acquired", timeout=20)
    took = time.monotonic() - killed
    print(f"takeover after SIGKILL mid-statement: {took:.2f} s")
    assert took < 15, "the lock must not wait for the dead leader's statement to end"
    second.wait_for_log("task.abandoned", task="long")  # logged before its commit

    def long_runs() -> list[dict[str, object]]:
        query = "SELECT name, status FROM scheduler_plugin_runs WHERE instance = 'first'"
        return [run for run in fetch(pg_url, query) if run["name"] == "long"]

    wait_until(
        lambda: [r["status"] for r in long_runs()] == ["abandoned"], what="the abandon commit"
    )
    assert long_runs() == [{"name": "long", "status": "abandoned"}]
    runs = fetch(pg_url, "SELECT name, status FROM scheduler_plugin_runs WHERE instance = 'first'")
    # The built-in tasks ran beside it (fenced transactions of their own, not queued
    # behind its statement), and none is left running.
    assert "running" not in {run["status"] for run in runs}, runs


@pytest.mark.postgres
def test_a_deposed_leader_kills_its_stuck_sync_task_and_stands_by(
    daemons: Daemons, pg_url: str, tmp_path: Path
) -> None:
    """SIGSTOP gets the leader evicted; on SIGCONT its sync task (which ignores
    ctx.cancelled) is still running. It runs in a worker process, which the deposed
    leader kills at once; the replica itself carries on, as a standby."""
    pid_file = tmp_path / "worker.pid"
    task = {"name": "stuck", "every": "1h", "target": "plugin_targets:block_forever"}
    env = {
        "SCHEDULER_DATABASE_URL": pg_url,
        "SCHEDULER_PLUGIN__TASKS": json.dumps([task]),
        **FAST_TIMINGS,
        "PYTHONPATH": TESTS,
        "BLOCK_PID_FILE": str(pid_file),
    }
    leader = daemons.start(env | {"SCHEDULER_INSTANCE_ID": "a"}, args=["run", "--only", "plugin"])
    leader.wait_for_log("task.started", task="stuck")
    standby = daemons.start(env | {"SCHEDULER_INSTANCE_ID": "b"}, args=["run", "--only", "plugin"])
    standby.wait_for_log("leader.waiting")
    deadline = time.monotonic() + 10
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    worker = int(pid_file.read_text())
    leader.signal(signal.SIGSTOP)
    standby.wait_for_log("leader.acquired", timeout=30)
    leader.signal(signal.SIGCONT)
    leader.wait_for_log("leader.lost", timeout=15)
    deadline = time.monotonic() + 5
    while Path(f"/proc/{worker}").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not Path(f"/proc/{worker}").exists(), "the stuck worker outlived the leadership"
    time.sleep(0.5)
    assert leader.poll() is None, leader.output()[-2000:]
    standby.wait_for_log("task.abandoned", task="stuck")
    leader.signal(signal.SIGTERM)
    assert leader.wait(timeout=20) == 0


@pytest.mark.postgres
def test_shutdown_timeout_holds_when_the_stop_lands_in_a_waiting_tick(
    daemons: Daemons, pg_url: str
) -> None:
    """A 20 s SQL task holds the lock connection, so the tick after it waits; SIGTERM
    then cancels that tick at shutdown_timeout. The cancellation must not count as a
    graceful stop that waits for the run to finish: the daemon exits within the budget."""
    task = {"name": "long", "every": "1h", "timeout": "1m", "sql": "SELECT pg_sleep(20)"}
    env = {
        "SCHEDULER_DATABASE_URL": pg_url,
        **FAST_TIMINGS,
        "SCHEDULER_SHUTDOWN_TIMEOUT": "2",
        "SCHEDULER_PLUGIN__INTERVAL": "0.1",
        "SCHEDULER_PLUGIN__TASKS": json.dumps([task]),
        "SCHEDULER_PLUGIN__DISABLED": '["purge_publications", "purge_runs"]',
    }
    process = daemons.start(env, args=["run", "--only", "plugin"])
    process.wait_for_log("task.started", task="long", timeout=30)
    time.sleep(1.0)
    stopped = time.monotonic()
    process.signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0
    took = time.monotonic() - stopped
    print(f"\nstopped {took:.1f}s after SIGTERM (shutdown_timeout 2 s, the SQL task had 19 s left)")
    assert took < 10


@pytest.mark.postgres
def test_transaction_mode_sql_task_may_outlast_the_pools_command_timeout(
    daemons: Daemons, pg_url: str
) -> None:
    """In transaction mode a SQL task runs on a pooled connection, whose asyncpg
    command_timeout (statement_timeout + connect_timeout) must not cut it short."""
    task = {"name": "long", "every": "1h", "timeout": "10s", "sql": "SELECT pg_sleep(3)"}
    env = {
        "SCHEDULER_DATABASE_URL": pg_url,
        "SCHEDULER_LOCK__MODE": "transaction",
        **FAST_TIMINGS,
        "SCHEDULER_DATABASE__STATEMENT_TIMEOUT": "1",
        "SCHEDULER_DATABASE__CONNECT_TIMEOUT": "1",
        "SCHEDULER_PLUGIN__TASKS": json.dumps([task]),
        "SCHEDULER_PLUGIN__DISABLED": '["purge_publications", "purge_runs"]',
    }
    process = daemons.start(env, args=["run", "--only", "plugin"])
    process.wait_for_log("task.succeeded", task="long", timeout=30)
    rows = fetch(pg_url, "SELECT status FROM scheduler_plugin_runs WHERE name = 'long'")
    assert rows == [{"status": "succeeded"}]
    process.signal(signal.SIGTERM)
    assert process.wait(timeout=20) == 0
