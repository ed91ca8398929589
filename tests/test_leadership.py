"""Leadership with real processes: one leader per loop, on each backend and in each mode.

Every exclusion claim is checked the same way: a probe task records each run of guarded
work as an interval, and `assert_no_overlap` (tests/rig/ticks.py) fails on two
intervals of one loop that intersect by the one rule of tests/rig/overlap.py, and on data
too thin to prove anything.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import time
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from rig.databases import run_sync
from rig.processes import DaemonProcess, Daemons, run_cli
from rig.sql import LOCK_HOLDERS, afetch
from rig.ticks import (
    FAST_TIMINGS,
    PLUGIN_ONLY,
    RIG_APP,
    SQLITE_PROBE_SQL,
    Interval,
    assert_no_overlap,
    create_sqlite_tick_log,
    create_tick_log,
    first_leader,
    pg_env,
    pg_probe_sql,
    pg_ticks,
    probe_env,
    python_probe_env,
    python_ticks,
    sqlite_tick_count,
    stop_all,
    wait_for_event,
    wait_for_ticks,
)
from rig.waiting import wait_until

from scheduler_daemon.config.values import (
    DEFAULT_PLUGIN_KEY,
    DEFAULT_PUBLISH_KEY,
    lock_key_from_name,
)


async def lock_holders(dsn: str, key: int) -> list[dict[str, Any]]:
    """Who holds (granted) and who waits for advisory lock `key`, from pg_locks."""
    return await afetch(dsn, LOCK_HOLDERS, key)


def wait_for_lock_state(
    dsn: str, key: int, *, granted: int, waiting: int, timeout: float = 20.0
) -> list[dict[str, Any]]:
    def matching() -> list[dict[str, Any]] | None:
        rows = run_sync(lock_holders(dsn, key))
        held = sum(r["granted"] for r in rows)
        return rows if (held, len(rows) - held) == (granted, waiting) else None

    rows: list[dict[str, Any]] = wait_until(
        matching, timeout, f"key {key}: {granted} holder(s), {waiting} waiting", 0.05
    )
    return rows


# -- the checker itself -----------------------------------------------------------------


def _iv(instance: str, start: float, end: float, loop: str = "plugin") -> Interval:
    return Interval(loop, instance, start, end)


def test_overlap_checker_catches_overlaps_and_refuses_thin_data() -> None:
    clean = [_iv("a", 0, 1), _iv("b", 1, 2), _iv("a", 2.5, 3), _iv("c", 3, 4)]
    assert assert_no_overlap(clean, min_ticks=4, min_instances=3) == {
        "plugin": {"a": 2, "b": 1, "c": 1}
    }
    broken = {
        "two leaders at once": [_iv("a", 0, 1), _iv("b", 0.9, 2)],
        "a re-entrant tick": [_iv("a", 0, 1), _iv("a", 0.5, 0.7)],
        "two leaders at once.*\n.*two leaders at once": [
            _iv("a", 0, 10), _iv("b", 1, 2), _iv("c", 3, 4)  # hidden behind a long interval
        ],
        # A moment (start = end) strictly inside another's tick.
        "and b started at .*two leaders at once": [_iv("a", 0, 1), _iv("b", 0.5, 0.5)],
    }  # fmt: skip
    for message, intervals in broken.items():
        with pytest.raises(AssertionError, match=message):
            assert_no_overlap(intervals, min_ticks=1)
    # Touching ends are a hand-over, not an overlap; so is a moment at another's end.
    assert_no_overlap([_iv("a", 0, 1), _iv("b", 1, 1), _iv("b", 1, 2)], min_ticks=3)
    with pytest.raises(AssertionError, match="ends before it starts"):
        assert_no_overlap([_iv("a", 1, 0)], min_ticks=1)
    # Loops are checked separately: the two loops' leaders may well overlap.
    assert_no_overlap([_iv("a", 0, 1, "plugin"), _iv("b", 0, 1, "publish")], min_ticks=1)
    with pytest.raises(AssertionError, match="no intervals"):
        assert_no_overlap([], min_ticks=0)
    with pytest.raises(AssertionError, match="too little"):
        assert_no_overlap(clean, min_ticks=5)
    with pytest.raises(AssertionError, match="instances"):
        assert_no_overlap([_iv("a", 0, 1), _iv("a", 1, 2)], min_ticks=2, min_instances=2)


# -- 1. mutual exclusion ----------------------------------------------------------------


def _hand_over(processes: list[DaemonProcess], leader: DaemonProcess) -> float:
    """SIGTERM the leader halfway: a run whose handover moment is checked too. Returns
    when it was stopped."""
    stopped_at = time.time()
    leader.signal(signal.SIGTERM)
    assert leader.wait(30) == 0, leader.output()[-3000:]
    successors = [p for p in processes if p is not leader]
    first_leader_since(successors, stopped_at)
    return stopped_at


def first_leader_since(processes: list[DaemonProcess], since: float) -> DaemonProcess:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        for process in processes:
            try:
                wait_for_event(process, "leader.acquired", after=since, timeout=0, loop="plugin")
            except AssertionError:
                continue
            return process
        time.sleep(0.05)
    raise AssertionError("nobody took over: " + "; ".join(p.output()[-500:] for p in processes))


@pytest.mark.chaos_long  # no overlap, 5 replicas: the chaos slice shows it in `make test`
def test_five_replicas_session_mode_never_overlap(pg_url: str, daemons: Daemons) -> None:
    run_sync(create_tick_log(pg_url))
    replicas = [
        daemons.start(pg_env(pg_url, f"r{n}"), PLUGIN_ONLY, name=f"r{n}") for n in range(1, 6)
    ]
    leader = first_leader(replicas)
    wait_for_ticks(pg_url, 10, instance=leader.name)
    handed_over = _hand_over(replicas, leader)
    wait_for_ticks(pg_url, 10, since=handed_over)
    stop_all(replicas)

    summary = assert_no_overlap(run_sync(pg_ticks(pg_url)), min_ticks=20, min_instances=2)
    print(f"session mode, 5 replicas: ticks per instance {summary['plugin']}")
    # Sticky leadership: only the first leader and its successor ever ran the work.
    assert len(summary["plugin"]) == 2, summary


@pytest.mark.chaos_long  # `make test-long`: kept out of `make test`'s 10 minutes
def test_five_replicas_transaction_mode_never_overlap(pg_url: str, daemons: Daemons) -> None:
    run_sync(create_tick_log(pg_url))
    env = {"SCHEDULER_LOCK__MODE": "transaction", "SCHEDULER_LOG__LEVEL": "debug"}
    replicas = [
        daemons.start(pg_env(pg_url, f"r{n}", **env), PLUGIN_ONLY, name=f"r{n}")
        for n in range(1, 6)
    ]
    first_leader(replicas)
    wait_for_ticks(pg_url, 20)
    stop_all(replicas)
    # Not sticky: every tick competes afresh, so the work moves between replicas.
    ticks = run_sync(pg_ticks(pg_url))
    summary = assert_no_overlap(ticks, min_ticks=20, min_instances=2)
    print(f"transaction mode, 5 replicas: ticks per instance {summary['plugin']}")
    # A claimed slot's run waits for the lock rather than failing because another
    # replica's tick held it for a moment: every run succeeded, each committed one row.
    runs = run_sync(probe_runs(pg_url))
    assert {r["status"] for r in runs} == {"succeeded"}, runs
    assert len(runs) == len(ticks)


async def probe_runs(dsn: str) -> list[dict[str, Any]]:
    return await afetch(
        dsn,
        "SELECT slot, instance, status, error FROM scheduler_plugin_runs "
        "WHERE name = 'probe' ORDER BY slot",
    )


@pytest.mark.chaos_long  # `make test-long`: kept out of `make test`'s 10 minutes
def test_three_processes_on_one_sqlite_file_never_overlap(
    sqlite_url: str, daemons: Daemons, tmp_path: Path
) -> None:
    database = Path(sqlite_url.removeprefix("sqlite:///"))
    create_sqlite_tick_log(database)
    probe_log = tmp_path / "probe.jsonl"
    # The Python probe runs outside any transaction: SQLite itself serialises writers,
    # so only work done outside the database can show a second leader.
    tasks = json.loads(python_probe_env(probe_log)["SCHEDULER_PLUGIN__TASKS"])
    tasks.append({"name": "sql-probe", "every": "0.2s", "sql": SQLITE_PROBE_SQL})
    env = {
        "SCHEDULER_DATABASE_URL": sqlite_url,
        **python_probe_env(probe_log),
        "SCHEDULER_PLUGIN__TASKS": json.dumps(tasks),
        "SCHEDULER_LOCK__HEARTBEAT_INTERVAL": "0.5",
    }
    replicas = [
        daemons.start({**env, "SCHEDULER_INSTANCE_ID": f"s{n}"}, PLUGIN_ONLY, name=f"s{n}")
        for n in range(1, 4)
    ]
    leader = first_leader(replicas)
    wait_for_ticks(probe_log, 10, instance=leader.name)
    handed_over = _hand_over(replicas, leader)
    wait_for_ticks(probe_log, 10, since=handed_over)
    wait_until(lambda: sqlite_tick_count(database) >= 25, 30, "25 runs of the SQL task")
    stop_all(replicas)

    summary = assert_no_overlap(python_ticks(probe_log), min_ticks=20, min_instances=2)
    print(f"sqlite, 3 processes: ticks per instance {summary['plugin']}")
    assert sqlite_tick_count(database) >= 25  # the SQL task ran in the leader's transaction too
    for replica in replicas:  # and nobody saw "database is locked" on the way
        assert "database is locked" not in replica.output()


@pytest.mark.parametrize(
    "mode", ["session", pytest.param("transaction", marks=pytest.mark.chaos_long)]
)
def test_healthy_work_longer_than_stall_timeout_is_not_evicted(
    pg_url: str, daemons: Daemons, mode: str
) -> None:
    """stall_timeout (3 s) is how long the lock session may be silent, not how long its
    work may take: a 4 s SQL task (a statement running, not idle) runs to the end."""
    run_sync(create_tick_log(pg_url))
    env = {
        "SCHEDULER_LOCK__MODE": mode,
        "SCHEDULER_LOG__LEVEL": "debug",
        **probe_env(pg_probe_sql(4.0), every="10s"),
    }
    replicas = [daemons.start(pg_env(pg_url, n, **env), PLUGIN_ONLY, name=n) for n in ("w1", "w2")]
    first_leader(replicas)
    wait_for_ticks(pg_url, 1, timeout=20)
    stop_all(replicas)
    for replica in replicas:
        evictions = [e for e in replica.log_events() if e["event"] == "leader.evicted"]
        assert not evictions, evictions
    assert_no_overlap(run_sync(pg_ticks(pg_url)), min_ticks=1)
    assert [r["status"] for r in run_sync(probe_runs(pg_url))] == ["succeeded"]


# -- 2. the pool trap -------------------------------------------------------------------

TRAP_KEY = 0x5EED_7EA9


async def test_a_session_lock_through_a_pool_is_no_lock_but_the_guards_is(
    pg_url: str, daemons: Daemons
) -> None:
    leader = daemons.start(pg_env(pg_url, "guard"), PLUGIN_ONLY, name="guard")
    first_leader([leader])
    pool = await asyncpg.create_pool(pg_url, min_size=1, max_size=1, server_settings=RIG_APP)
    other = await asyncpg.connect(pg_url, server_settings=RIG_APP)
    dedicated = await asyncpg.connect(pg_url, server_settings=RIG_APP)
    try:
        # The naive port: take the session lock through the pool...
        await pool.fetchval("SELECT pg_advisory_lock($1)", TRAP_KEY)
        pooled_pid = await pool.fetchval("SELECT pg_backend_pid()")
        # ...and it is gone the moment the connection went back: asyncpg's reset ran
        # pg_advisory_unlock_all(), though that session is still open.
        assert await lock_holders(pg_url, TRAP_KEY) == []
        assert await other.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE pid = $1", pooled_pid
        )
        # Another connection gets it at once: no exclusion at all.
        assert await other.fetchval("SELECT pg_try_advisory_lock($1)", TRAP_KEY) is True
        assert await other.fetchval("SELECT pg_advisory_unlock($1)", TRAP_KEY) is True

        # The other trap: lock on one connection, unlock on another. The unlock fails
        # ("you don't own a lock") and the lock stays stranded on the first.
        await dedicated.fetchval("SELECT pg_advisory_lock($1)", TRAP_KEY)
        assert await pool.fetchval("SELECT pg_advisory_unlock($1)", TRAP_KEY) is False
        assert [r["granted"] for r in await lock_holders(pg_url, TRAP_KEY)] == [True]
        assert await other.fetchval("SELECT pg_try_advisory_lock($1)", TRAP_KEY) is False
        await dedicated.fetchval("SELECT pg_advisory_unlock($1)", TRAP_KEY)

        # The guard's dedicated connection does hold the plugin lock, and keeps it.
        for _ in range(3):
            holders = await lock_holders(pg_url, DEFAULT_PLUGIN_KEY)
            assert [(h["granted"], h["application_name"]) for h in holders] == [
                (True, "scheduler-daemon/guard/lock:plugin")
            ]
            assert (
                await other.fetchval("SELECT pg_try_advisory_lock($1)", DEFAULT_PLUGIN_KEY) is False
            )
            await asyncio.sleep(0.3)
    finally:
        await dedicated.close()
        await other.close()
        await pool.close()
    stop_all([leader])


# -- 8. status --------------------------------------------------------------------------


def test_status_shows_the_leader_and_both_standbys_for_each_loop(
    pg_url: str, daemons: Daemons
) -> None:
    env = {"SCHEDULER_DATABASE_URL": pg_url, **FAST_TIMINGS}
    first = daemons.start({**env, "SCHEDULER_INSTANCE_ID": "alpha"}, name="alpha")
    for loop in ("publish", "plugin"):
        first.wait_for_log("leader.acquired", loop=loop)
    others = [
        daemons.start({**env, "SCHEDULER_INSTANCE_ID": name}, name=name)
        for name in ("beta", "gamma")
    ]
    for key in (DEFAULT_PUBLISH_KEY, DEFAULT_PLUGIN_KEY):
        wait_for_lock_state(pg_url, key, granted=1, waiting=2)
    time.sleep(1.2)  # a heartbeat or two since

    result = run_cli(["status", "--json"], {"SCHEDULER_DATABASE_URL": pg_url})
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert (report["backend"], report["lock_mode"]) == ("postgres", "session")
    for loop, key in (("publish", DEFAULT_PUBLISH_KEY), ("plugin", DEFAULT_PLUGIN_KEY)):
        info = report["loops"][loop]
        assert info["lock_key"] == key
        leader = info["leader"]
        assert leader["instance"] == "alpha"
        assert leader["host"] == socket.gethostname()
        assert leader["pid"] == first.pid
        assert None not in (leader["since"], leader["last_heartbeat"])
        assert 0 <= leader["heartbeat_age"] < 3, leader  # heartbeats every 0.5 s
        assert leader["fencing_token"] >= 1, leader
        assert sorted(s["instance"] for s in info["standbys"]) == ["beta", "gamma"]

    text = run_cli(["status"], {"SCHEDULER_DATABASE_URL": pg_url})
    assert text.returncode == 0, text.stderr
    for loop in ("publish", "plugin"):
        assert re.search(
            rf"^{loop}\s+leader alpha \(host {re.escape(socket.gethostname())}, "
            rf"pid {first.pid}, since \S+, heartbeat \d+\.\ds ago, fencing token \d+\)$",
            text.stdout,
            re.M,
        ), text.stdout
    standby_lines = re.findall(r"^\s+standbys 2: (\S+), (\S+)$", text.stdout, re.M)
    assert [sorted(names) for names in standby_lines] == [["beta", "gamma"]] * 2, text.stdout
    stop_all([first, *others])


# -- 10. lock keys ----------------------------------------------------------------------


def test_a_named_lock_key_contends_only_with_replicas_using_the_same_name(
    pg_url: str, daemons: Daemons
) -> None:
    """Two replicas keyed ``myapp/plugin`` elect one leader between them; a replica on
    the default key leads on its own, and neither leadership disturbs the other."""
    run_sync(create_tick_log(pg_url))
    named = {"SCHEDULER_LOCK__KEYS__PLUGIN": "myapp/plugin"}
    replicas = [
        daemons.start(pg_env(pg_url, "named1", **named), PLUGIN_ONLY, name="named1"),
        daemons.start(pg_env(pg_url, "named2", **named), PLUGIN_ONLY, name="named2"),
        daemons.start(pg_env(pg_url, "plain"), PLUGIN_ONLY, name="plain"),
    ]
    named_key = lock_key_from_name("myapp/plugin")
    assert named_key not in (DEFAULT_PLUGIN_KEY, DEFAULT_PUBLISH_KEY)
    settled = time.time()
    named_rows = wait_for_lock_state(pg_url, named_key, granted=1, waiting=1)
    plain_rows = wait_for_lock_state(pg_url, DEFAULT_PLUGIN_KEY, granted=1, waiting=0)
    assert plain_rows[0]["application_name"] == "scheduler-daemon/plain/lock:plugin"
    named_leader = named_rows[0]["application_name"].split("/")[1]
    assert named_leader in ("named1", "named2")

    # Both leaders stay leaders: several heartbeats (0.5 s) later nobody stepped down.
    time.sleep(3)
    assert wait_for_lock_state(pg_url, named_key, granted=1, waiting=1) == named_rows
    assert wait_for_lock_state(pg_url, DEFAULT_PLUGIN_KEY, granted=1, waiting=0) == plain_rows
    for replica in replicas:
        changes = [
            e["event"]
            for e in replica.log_events()
            if e["event"] in ("leader.lost", "leader.stepped_down", "leader.evicted")
        ]
        assert not changes, f"{replica.name}: {changes}\n{replica.output()[-2000:]}"
    stop_all(replicas)
    # The two deployments share the database's schedules (docs/leadership.md: separate
    # deployments need separate databases), so the probe ran under either key, by one
    # of the two leaders at a time: the database allows one running run per schedule,
    # whichever lock its leader holds.
    ticks = [t for t in run_sync(pg_ticks(pg_url)) if t.start >= settled]
    assert {t.instance for t in ticks} <= {named_leader, "plain"}
    assert_no_overlap(ticks, min_ticks=1)
