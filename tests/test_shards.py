"""Sharded leadership with real processes (leadership/shards.py): the promises per schedule.

Replicas share 8 shards of 16 schedules (every 0.5 s, each run working 0.7 s outside the
database and writing wall-clock records, ``scheduler_sample_plugin.effects``: a schedule's
next slot falls due while its run still works, so a hand-over that did not wait for the
runs in flight would show as an overlap) through a
member joining, a graceful leave (SIGTERM), a SIGKILL, a SIGSTOP long enough for the
server to evict the frozen member, and a PostgreSQL restart. The records must show:

- no schedule's runs overlapping across replicas (different schedules do run at once on
  different replicas: that is the point), except the frozen member's runs after it
  resumed, the one window no process can close (docs/leadership.md), which is bounded;
- each slot run at most once, and no schedule without a run for longer than a failover;
- fencing tokens that only grow within each shard.

And the lock manager must show every shard led again after each change, by the members
the assignment wants. A replica started with another shard count stands by.
"""

from __future__ import annotations

import itertools
import json
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
from rig.effects import (
    EFFECTS_TARGETS,
    EffectRun,
    check_effects,
    effects_env,
    per_schedule,
    per_shard,
    read_effects,
    wait_mid_run,
)
from rig.pgcluster import PgCluster
from rig.processes import DaemonProcess, Daemons, run_cli
from rig.sql import fetch
from rig.ticks import FAST_TIMINGS, PLUGIN_ONLY, event_time, stop_all, wait_for_event
from rig.waiting import wait_until

from scheduler_daemon.config.values import DEFAULT_PLUGIN_KEY
from scheduler_daemon.leadership.shard_keys import ShardKeys

pytestmark = [pytest.mark.postgres, pytest.mark.processes]

SHARDS = 8
SCHEDULES = 16
PERIOD = 0.5
WORK = 0.7
STALL_TIMEOUT = float(FAST_TIMINGS["SCHEDULER_LOCK__STALL_TIMEOUT"])
KEYS = ShardKeys(DEFAULT_PLUGIN_KEY, SHARDS)
# The longest a schedule may go without a run: a frozen member's shards wait for the
# server to evict it (stall_timeout), then for the settle of a predecessor still connected
# (stop_grace and a little); a period, and slack for a loaded machine on top.
GAP_BOUND = STALL_TIMEOUT + 2.0 + PERIOD + 3.0


def replica_env(url: str, instance: str, log: Path, shards: int = SHARDS) -> dict[str, str]:
    tasks = [
        {"name": f"s{i:02d}", "every": f"{PERIOD:g}s", "timeout": "20s",
         "target": EFFECTS_TARGETS["async"]}
        for i in range(SCHEDULES)
    ]  # fmt: skip
    return {
        "SCHEDULER_DATABASE_URL": url,
        "SCHEDULER_INSTANCE_ID": instance,
        **FAST_TIMINGS,
        "SCHEDULER_PLUGIN__SHARDS": str(shards),
        "SCHEDULER_PLUGIN__HANDOVER_TIMEOUT": "5s",
        "SCHEDULER_PLUGIN__INTERVAL": "0.1",
        "SCHEDULER_PLUGIN__TASKS": json.dumps(tasks),
        "SCHEDULER_PLUGIN__DISABLED": '["purge_publications", "purge_runs"]',
        **effects_env(log, WORK),
    }


def owners(url: str) -> dict[int, str]:
    """Shard -> the instance whose lock session holds it, from the lock manager."""
    rows = fetch(
        url,
        "SELECT l.objid::int AS shard, a.application_name FROM pg_locks l "
        "JOIN pg_stat_activity a ON a.pid = l.pid "
        "WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.granted "
        "AND l.classid = $1::bigint::oid AND l.objid::bigint < $2",
        KEYS.shard_class,
        SHARDS,
    )
    return {row["shard"]: row["application_name"].split("/")[1] for row in rows}


def all_led_by(url: str, members: set[str], what: str, timeout: float = 30.0) -> float:
    """Wait until every shard is led, by `members` only, each leading its fair share at
    most; return how long that took."""
    started = time.monotonic()
    cap = -(-SHARDS // len(members))

    def settled() -> bool:
        led = owners(url)
        shares = Counter(led.values())
        return len(led) == SHARDS and set(shares) == members and max(shares.values()) <= cap

    wait_until(settled, timeout, f"every shard led by {sorted(members)} ({what})")
    return time.monotonic() - started


def work_by(log: Path, members: set[str], runs: int = 2) -> None:
    """Wait until each of `members` has begun `runs` runs from now on: every configuration
    of the cluster does work that the checks below then cover."""
    since = time.time()

    def done() -> bool:
        begun = Counter(r.instance for r in read_effects(log) if r.start >= since)
        return all(begun[member] >= runs for member in members)

    wait_until(done, 30, f"{runs} runs by each of {sorted(members)}", every=0.1)


def test_shards_keep_every_promise_per_schedule_through_join_leave_kill_freeze_and_restart(
    pg_cluster: PgCluster, pg_url: str, daemons: Daemons, tmp_path: Path
) -> None:
    log = tmp_path / "effects.jsonl"

    def start(name: str, shards: int = SHARDS) -> DaemonProcess:
        return daemons.start(replica_env(pg_url, name, log, shards), PLUGIN_ONLY, name)

    r1, r2, r3 = start("r1"), start("r2"), start("r3")
    taken = {"start": all_led_by(pg_url, {"r1", "r2", "r3"}, "three members")}
    work_by(log, {"r1", "r2", "r3"})

    r4 = start("r4")
    joined = time.monotonic()
    taken["join"] = all_led_by(pg_url, {"r1", "r2", "r3", "r4"}, "r4 joined")
    print(f"\nr4 led its share {time.monotonic() - joined:.2f}s after it was started")
    work_by(log, {"r1", "r2", "r3", "r4"})

    r1.signal(signal.SIGTERM)  # a graceful leave, runs in flight
    assert r1.wait(30) == 0, r1.output()[-3000:]
    taken["leave"] = all_led_by(pg_url, {"r2", "r3", "r4"}, "r1 left")
    work_by(log, {"r2", "r3", "r4"})

    wait_mid_run(log, "r2")
    r2.signal(signal.SIGKILL)
    taken["kill"] = all_led_by(pg_url, {"r3", "r4"}, "r2 killed")
    work_by(log, {"r3", "r4"})

    wait_mid_run(log, "r3")
    frozen_at = time.time()
    r3.signal(signal.SIGSTOP)
    taken["evicted"] = all_led_by(pg_url, {"r4"}, "r3 frozen and evicted")
    work_by(log, {"r4"})  # while r3 is still frozen
    resumed_at = time.time()
    r3.signal(signal.SIGCONT)
    wait_for_event(r3, "leader.lost", after=frozen_at, loop="plugin", timeout=15)
    wait_for_event(r3, "shard.acquired", after=resumed_at, loop="plugin", timeout=30)
    taken["rejoin"] = all_led_by(pg_url, {"r3", "r4"}, "r3 rejoined")
    # `status` reads the same from the lock manager, whatever its own config says.
    shown = run_cli(["status", "--json"], {"SCHEDULER_DATABASE_URL": pg_url})
    assert shown.returncode == 0, shown.stderr
    plugin = json.loads(shown.stdout)["loops"]["plugin"]
    assert (plugin["shards"], plugin["member_count"], plugin["balance"]["unled"]) == (SHARDS, 2, 0)
    assert sorted(m["instance"] for m in plugin["members"]) == ["r3", "r4"]
    assert {o["shard"]: o["instance"] for o in plugin["shard_owners"]} == owners(pg_url)
    work_by(log, {"r3", "r4"})

    pg_cluster.restart()  # every session ends: every member joins again, tokens move on
    taken["pg_restart"] = all_led_by(pg_url, {"r3", "r4"}, "after a PostgreSQL restart", 60)
    work_by(log, {"r3", "r4"})

    # Another shard count never shares the loop: it waits, and says why.
    other = start("r5", shards=4)
    wait_for_event(other, "shard.join_blocked", loop="plugin", timeout=30)
    time.sleep(1.0)
    assert set(owners(pg_url).values()) == {"r3", "r4"}
    print("seconds until every shard was led again:", {k: round(v, 2) for k, v in taken.items()})
    stop_all([r3, r4, other])

    runs = read_effects(log)
    # What r3 did after SIGCONT and before it noticed is the documented window.
    frozen = [r for r in runs if r.instance == "r3" and r.start < frozen_at < r.end]
    summary = check_effects(
        runs,
        min_runs=100,
        min_instances=4,
        exclusive=per_schedule,
        tokens=per_shard,
        allow=lambda run: run in frozen,
    )
    for run in summary.allowed:
        assert run.end - resumed_at < 1.0, f"{run.describe()} went on after SIGCONT"
    twice = [slot for slot, n in Counter(_slot(r) for r in runs).items() if n > 1]
    assert not twice, f"slots run twice: {twice[:5]}"
    assert all(r.extra.get("shard") is not None for r in runs)
    by_schedule: dict[str, list[float]] = {}
    for run in runs:
        by_schedule.setdefault(str(run.extra["task"]), []).append(run.start)
    assert len(by_schedule) == SCHEDULES
    ended = max(r.end for r in runs)
    for name, starts in by_schedule.items():
        starts.sort()
        gaps = [b - a for a, b in itertools.pairwise(starts)] + [ended - starts[-1]]
        assert max(gaps) < GAP_BOUND, f"{name} went {max(gaps):.1f}s without a run"
    left = fetch(pg_url, "SELECT count(*) AS n FROM scheduler_plugin_runs WHERE status = 'running'")
    assert left[0]["n"] == 0, "every run cut off was closed by its shard's next owner"
    # Each leave and each death moved shards, and their owners said so.
    acquired = [
        entry
        for process in (r1, r2, r3, r4)
        for entry in process.log_events()
        if entry.get("event") == "shard.acquired"
    ]
    reasons = Counter(entry["reason"] for entry in acquired)
    assert reasons["join"] >= 4, reasons
    assert reasons["member_gone"], reasons
    assert all(event_time(e) < time.time() for e in acquired)


def _slot(run: EffectRun) -> tuple[str, str]:
    return (str(run.extra["task"]), str(run.extra["slot"]))
