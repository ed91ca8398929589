"""Clock skew: replicas whose clocks are minutes off (libfaketime) schedule, publish and run
slots by the database's clock, and hand over to and from a replica with a true clock
without a duplicate or a missed slot.

libfaketime (Debian's ``faketime`` package) is preloaded into the daemon: ``FAKETIME=+5m``
moves ``time.time()``, ``datetime.now()`` and the log timestamps five minutes ahead, while
``FAKETIME_DONT_FAKE_MONOTONIC=1`` leaves the monotonic clock alone, which asyncio's
timers (and so every sleep, timeout and heartbeat) run on. The database, on this machine,
keeps the true time. A replica that judged due-ness by its own clock would publish five
minutes early (ahead) or late (behind); its slots would fall five minutes off the time the
database stamps their runs with.

Log timestamps of a skewed replica are skewed too, so nothing here compares them with
another process's: who leads is read from the lock manager, times from the database.
"""

from __future__ import annotations

import collections
import glob
import itertools
import json
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from rig.databases import run_sync
from rig.processes import DaemonProcess, Daemons, run_cli
from rig.sql import fetch, leader_of
from rig.ticks import (
    assert_no_overlap,
    create_tick_log,
    event_time,
    pg_env,
    pg_ticks,
    stop_all,
)
from rig.waiting import wait_until

pytestmark = pytest.mark.postgres

SKEW = 300.0  # seconds: the "+5m" and "-5m" below
SLOT_PERIOD = 1.0
# A published row's lateness (published_at - publish_at) on a healthy leader: the NOTIFY
# wakes it at once; the bound is slack for a loaded machine, not a measurement.
LATENESS_BOUND = 2.0


def libfaketime() -> str:
    found = sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))
    if not found:
        pytest.skip("libfaketime not installed (Debian: apt-get install faketime)")
    return found[0]


def clock(offset: str | None) -> dict[str, str]:
    """The environment that moves a process's wall clock by `offset` ("+5m", "-5m")."""
    if offset is None:
        return {}
    return {
        "LD_PRELOAD": libfaketime(),
        "FAKETIME": offset,
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }


def replica_env(url: str, name: str, offset: str | None) -> dict[str, str]:
    """A replica with the tick probe (rig.ticks, every 0.2 s) and a task whose slots fall
    every second, on PostgreSQL, its clock moved by `offset`."""
    env = pg_env(
        url,
        name,
        SCHEDULER_PLUGIN__DISABLED='["purge_publications", "purge_runs"]',
        **clock(offset),
    )
    slots = {"name": "slots", "every": f"{SLOT_PERIOD:g}s", "sql": "SELECT 1"}
    env["SCHEDULER_PLUGIN__TASKS"] = json.dumps(
        [*json.loads(env["SCHEDULER_PLUGIN__TASKS"]), slots]
    )
    return env


def wait_leading(url: str, name: str) -> None:
    def leads_both() -> bool:
        return all(leader_of(url, loop) == name for loop in ("publish", "plugin"))

    wait_until(leads_both, 30, f"{name} leading both loops")


def assert_skewed(process: DaemonProcess, seconds: float) -> None:
    """The precondition: the daemon's own clock (its log timestamps) is off by about
    `seconds`; otherwise this test would prove nothing."""
    started = process.wait_for_log("daemon.started")
    offset = event_time(started) - time.time()
    assert abs(offset - seconds) < 30, f"{process.name}: clock off by {offset:.0f}s"


def schedule_in(url: str, seconds: float, key: str, offset: str | None) -> None:
    """`scheduler-daemon schedule --at +Ns` from a client whose clock is off by `offset`."""
    env = {"SCHEDULER_DATABASE_URL": url, **clock(offset)}
    result = run_cli(["schedule", "--at", f"+{seconds:g}s", "--key", key], env)
    assert result.returncode == 0, result.stderr


def schedule_due_in(url: str, seconds: float, key: str) -> None:
    """An application's plain INSERT, due `seconds` from the database's now."""
    fetch(
        url,
        "INSERT INTO scheduler_publications (key, publish_at) "
        "VALUES ($1, now() + make_interval(secs => $2))",
        key,
        seconds,
    )


def publications(url: str) -> list[dict[str, Any]]:
    return fetch(
        url,
        "SELECT key, status, attempts, published_by, created_at, publish_at, published_at "
        "FROM scheduler_publications ORDER BY id",
    )


def wait_published(url: str, keys: list[str], timeout: float = 20.0) -> list[dict[str, Any]]:
    def done() -> list[dict[str, Any]]:
        rows = [row for row in publications(url) if row["key"] in keys]
        return (
            rows if len(rows) == len(keys) and all(r["status"] == "published" for r in rows) else []
        )

    try:
        return wait_until(done, timeout, f"{keys} published")
    except AssertionError:
        waiting = [
            f"{row['key']} due {(row['publish_at'] - row['created_at']).total_seconds():+.1f}s "
            f"after it was scheduled, {row['status']}"
            for row in publications(url) if row["key"] in keys and row["status"] != "published"
        ]  # fmt: skip
        raise AssertionError(f"not published within {timeout:g}s: {waiting}") from None


def assert_on_time(row: dict[str, Any], leader: str) -> None:
    """Published by `leader`, never before it was due by the database's clock, and soon
    after."""
    late = (row["published_at"] - row["publish_at"]).total_seconds()
    assert row["published_by"] == leader, row
    assert 0 <= late < LATENESS_BOUND, f"{row['key']}: published {late:+.3f}s after due: {row}"
    assert row["attempts"] == 1, row


def assert_slots_on_the_database_clock(url: str, min_instances: int) -> dict[str, int]:
    """The `slots` task's runs: one per slot, each slot one period after the one before
    (none missed, none twice), each run started by the database's clock within a period
    of its slot (a slot computed from a skewed clock would be minutes off)."""
    runs = fetch(
        url,
        "SELECT slot, instance, status, started_at FROM scheduler_plugin_runs "
        "WHERE name = 'slots' ORDER BY slot",
    )
    assert len(runs) >= 5, runs
    period = timedelta(seconds=SLOT_PERIOD)
    for earlier, later in itertools.pairwise(runs):
        assert later["slot"] - earlier["slot"] == period, (
            f"slot {later['slot']} follows {earlier['slot']}: missed or repeated"
        )
    for run in runs:
        assert run["status"] == "succeeded", run
        started = (run["started_at"] - run["slot"]).total_seconds()
        assert 0 <= started < SLOT_PERIOD + 0.5, (
            f"run of slot {run['slot']} started {started:+.3f}s"
        )
    by_instance: dict[str, int] = {}
    for run in runs:
        by_instance[run["instance"]] = by_instance.get(run["instance"], 0) + 1
    assert len(by_instance) >= min_instances, by_instance
    return by_instance


@pytest.fixture
def url(pg_url: str) -> str:
    run_sync(create_tick_log(pg_url))
    return pg_url


def test_skewed_replicas_follow_the_database_clock(url: str, daemons: Daemons) -> None:
    """A leader five minutes ahead, then one with a true clock, then one five minutes
    behind, each taking over from the one before (SIGTERM): publications scheduled `+3s`
    by clients ahead, behind and true are each published about 3 s later, once; the slots
    run each second on the database's clock, none missed or repeated. Each successor is
    the only standby when its predecessor hands over: standbys are granted the lock in no
    fixed order (docs/leadership.md)."""
    ahead = daemons.start(replica_env(url, "ahead", "+5m"), name="ahead")
    wait_leading(url, "ahead")
    normal = daemons.start(replica_env(url, "normal", None), name="normal")
    for loop in ("publish", "plugin"):
        normal.wait_for_log("leader.waiting", loop=loop)

    # The skewed clients' `+3s` counts from the database's clock, as the true one's does.
    keys = {"from-true": None, "from-ahead": "+5m", "from-behind": "-5m"}
    with ThreadPoolExecutor(len(keys)) as pool:
        list(pool.map(lambda item: schedule_in(url, 3, *item), keys.items()))
    assert_skewed(ahead, +SKEW)
    for row in wait_published(url, list(keys)):
        wait = (row["publish_at"] - row["created_at"]).total_seconds()
        assert 2.0 < wait <= 3.0, f"{row['key']}: due {wait:+.3f}s after it was scheduled"
        assert_on_time(row, "ahead")

    # Ahead -> true -> behind, each handing over on SIGTERM; each new leader publishes a
    # row due a second after it took over, and runs a slot or two meanwhile.
    behind: DaemonProcess | None = None
    for old, new in ((ahead, "normal"), (normal, "behind")):
        if new == "behind":
            behind = daemons.start(replica_env(url, "behind", "-5m"), name="behind")
            assert_skewed(behind, -SKEW)
            for loop in ("publish", "plugin"):
                behind.wait_for_log("leader.waiting", loop=loop)
        old.signal(signal.SIGTERM)
        assert old.wait(30) == 0, old.output()[-3000:]
        wait_leading(url, new)
        schedule_due_in(url, 1.2, f"to-{new}")
        assert_on_time(wait_published(url, [f"to-{new}"])[0], new)
    assert behind is not None
    stop_all([behind])

    runs = assert_slots_on_the_database_clock(url, min_instances=3)
    ticks = assert_no_overlap(run_sync(pg_ticks(url)), min_ticks=10, min_instances=3)
    print(f"\nslots by instance: {runs}; probe ticks: {ticks}")
    rows = publications(url)
    assert len(rows) == 5, rows
    assert all(row["status"] == "published" for row in rows), rows


ROUNDS = 12
ROUND_SECONDS = 3.0
PUBLISH_EVERY = 0.25
# After a SIGKILL the lock moves in tens of milliseconds; this is slack, not a measurement.
TAKEOVER_BOUND = 5.0


@pytest.mark.chaos_long
def test_skewed_and_true_replicas_through_repeated_kills(url: str, daemons: Daemons) -> None:
    """Three replicas (five minutes ahead, true, five minutes behind), the plugin loop's
    leader SIGKILLed or SIGTERMed every few seconds and replaced by a new replica with the
    same clock, publications due every 0.25 s throughout: each is published once, never
    before it was due, within TAKEOVER_BOUND; every slot runs once, none missed."""
    rng = random.Random(13)
    clocks = {"ahead": "+5m", "true": None, "behind": "-5m"}
    running: dict[str, DaemonProcess] = {}
    started: dict[str, int] = {}

    def start(base: str) -> None:
        started[base] = started.get(base, 0) + 1
        name = f"{base}-{started[base]}"
        process = daemons.start(replica_env(url, name, clocks[base]), name=name)
        # Up, signal handlers and all: a SIGTERM before that is no handover to test.
        process.wait_for_log("leader.waiting", loop="plugin")
        running[name] = process

    for base in clocks:
        start(base)
    count = int(ROUNDS * ROUND_SECONDS / PUBLISH_EVERY)
    fetch(
        url,
        "INSERT INTO scheduler_publications (key, publish_at) SELECT 'p-' || g, "
        "now() + make_interval(secs => 2 + g * $1::float8) FROM generate_series(1, $2) g",
        PUBLISH_EVERY,
        count,
    )
    faults = []
    for _ in range(ROUNDS):
        time.sleep(ROUND_SECONDS * rng.uniform(0.7, 1.3))
        leader = wait_until(lambda: leader_of(url, "plugin"), 30, "a plugin leader")
        victim = running.pop(leader)
        how = rng.choice([signal.SIGKILL, signal.SIGTERM])
        victim.signal(how)
        victim.wait(30)
        faults.append(f"{how.name} {leader}")
        start(leader.rsplit("-", 1)[0])
    keys = [f"p-{i}" for i in range(1, count + 1)]
    rows = wait_published(url, keys, timeout=60)
    stop_all(list(running.values()))

    print(f"\nfaults: {faults}")
    print(f"published by: {collections.Counter(row['published_by'] for row in rows)}")
    for row in rows:
        late = (row["published_at"] - row["publish_at"]).total_seconds()
        assert 0 <= late < TAKEOVER_BOUND, f"{row['key']} published {late:+.3f}s after due: {row}"
        assert row["attempts"] == 1, row
    publishers = {row["published_by"].rsplit("-", 1)[0] for row in rows}
    assert publishers == set(clocks), publishers
    runs = fetch(
        url,
        "SELECT slot, instance, status FROM scheduler_plugin_runs WHERE name = 'slots' ORDER BY slot",
    )
    period = timedelta(seconds=SLOT_PERIOD)
    gaps = [
        (a["slot"], b["slot"])
        for a, b in itertools.pairwise(runs)
        if b["slot"] - a["slot"] != period
    ]
    assert gaps == [], f"missed or repeated slots: {gaps}"
    assert {run["status"] for run in runs} <= {"succeeded", "abandoned"}, runs
    summary = assert_no_overlap(run_sync(pg_ticks(url)), min_ticks=50, min_instances=len(clocks))
    print(f"probe ticks: {summary}")
