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
    second.wait_for_log("task.abandoned", task="long")
    runs = fetch(pg_url, "SELECT name, status FROM scheduler_plugin_runs WHERE instance = 'first'")
    assert {"name": "long", "status": "abandoned"} in runs
    assert {run["status"] for run in runs} == {"abandoned"}


@pytest.mark.postgres
def test_a_deposed_leader_with_a_stuck_sync_task_exits_instead_of_running_beside_the_new(
    daemons: Daemons, pg_url: str
) -> None:
    """SIGSTOP gets the leader evicted; on SIGCONT its sync task (which ignores
    ctx.cancelled) is still running: the process must exit 70, not become a standby."""
    task = {"name": "stuck", "every": "1h", "target": "plugin_targets:block_forever"}
    env = {
        "SCHEDULER_DATABASE_URL": pg_url,
        "SCHEDULER_PLUGIN__TASKS": json.dumps([task]),
        **FAST_TIMINGS,
        "PYTHONPATH": TESTS,
    }
    leader = daemons.start(env | {"SCHEDULER_INSTANCE_ID": "a"}, args=["run", "--only", "plugin"])
    leader.wait_for_log("task.started", task="stuck")
    standby = daemons.start(env | {"SCHEDULER_INSTANCE_ID": "b"}, args=["run", "--only", "plugin"])
    standby.wait_for_log("leader.waiting")
    leader.signal(signal.SIGSTOP)
    standby.wait_for_log("leader.acquired", timeout=30)
    leader.signal(signal.SIGCONT)
    assert leader.wait(timeout=30) == 70
    died = leader.wait_for_log("loop.died")
    assert "stuck" in died["error"]
