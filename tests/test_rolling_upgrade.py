"""A rolling upgrade, the way compose and Kubernetes deploy (issue 13, item 8): replicas of
this build keep running while a newer build starts, migrates and joins the election, and
then the old ones are SIGTERMed one at a time. The rule under test: **an older replica
never leads on a schema newer than the newest migration it carries** (schema_gate.py).

"The next build" is this package copied into a temporary directory that goes first on
PYTHONPATH, carrying one more migration: additive, as the expand step of an
expand/contract change is, and stamping with the server's clock the moment it ran. A
migration waits for every fenced transaction in flight, and every later one sees it, so
that stamp partitions time: work committed by an old replica is older than the stamp,
work of a new one newer. The evidence is the database's (publications, the ``sql``
publisher's audit rows, claimed plugin slots), the work's own wall-clock records outside
the database (``rig.effects``), the lock manager (sampled during the roll) and the logs.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from rig.effects import (
    EFFECTS_TARGETS,
    check_effects,
    effects_env,
    effects_replica_env,
    read_effects,
)
from rig.processes import DaemonProcess, Daemons, daemon_env, run_cli
from rig.sql import fetch, scalar
from rig.ticks import (
    FAST_TIMINGS,
    PLUGIN_ONLY,
    RIG_APP,
    create_tick_log,
    event_time,
    first_leader,
    pg_env,
    pg_ticks,
    probe_env,
    stop_all,
)
from rig.waiting import wait_until
from test_http import http_get

import scheduler_daemon
from scheduler_daemon.config.url import Backend
from scheduler_daemon.db.sqlfiles import migrations, queries
from scheduler_daemon.loops import plugin, publish

pytestmark = pytest.mark.processes

# This build's newest migration, per backend (each numbers its own 1..n).
THIS_BUILD: dict[Backend, int] = {
    "postgres": migrations("postgres")[-1].version,
    "sqlite": migrations("sqlite")[-1].version,
}

PROBE_MIGRATION: dict[Backend, str] = {
    "postgres": """
-- A synthetic next migration (tests/test_rolling_upgrade.py): additive, like the expand
-- step of an expand/contract change. Its row says, by the server's clock, when it ran.
ALTER TABLE scheduler_publications ADD COLUMN upgrade_note text;
CREATE TABLE scheduler_upgrade_probe (
    migrated_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
INSERT INTO scheduler_upgrade_probe DEFAULT VALUES;
""",
    "sqlite": """
-- A synthetic next migration (tests/test_rolling_upgrade.py); see the PostgreSQL one.
ALTER TABLE scheduler_publications ADD COLUMN upgrade_note TEXT;
CREATE TABLE scheduler_upgrade_probe (
    migrated_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);
INSERT INTO scheduler_upgrade_probe DEFAULT VALUES;
""",
}


@dataclass(frozen=True)
class NextBuild:
    path: Path  # a directory holding the next build's scheduler_daemon package
    versions: dict[Backend, int]  # its newest migration, per backend

    @property
    def version(self) -> int:  # PostgreSQL's, the usual case
        return self.versions["postgres"]

    def env(self, **env: str) -> dict[str, str]:
        """A daemon's environment that runs the next build (rig.processes.daemon_env keeps
        a test's PYTHONPATH in front of the suite's; Daemons starts each process in a
        directory of its own, so the checkout's package is not found first)."""
        return {"PYTHONPATH": str(self.path), **env}

    def cli(self, args: Sequence[str], **env: str) -> subprocess.CompletedProcess[str]:
        """``scheduler-daemon ARGS`` of the next build; not run from the checkout, whose
        package ``python -m`` would import first."""
        return run_cli(args, self.env(**env), cwd=self.path)


@pytest.fixture(scope="module")
def next_build(tmp_path_factory: pytest.TempPathFactory) -> NextBuild:
    """This package plus the next migration. Numbered after this build's newest, so it
    keeps the rule that migrations are numbered 1..n, whatever other migrations land."""
    root = tmp_path_factory.mktemp("next-build")
    package = root / "scheduler_daemon"
    source = Path(scheduler_daemon.__file__).parent
    shutil.copytree(source, package, ignore=shutil.ignore_patterns("__pycache__"))
    versions = {backend: newest + 1 for backend, newest in THIS_BUILD.items()}
    for backend, version in versions.items():
        migration = package / "migrations" / backend / f"{version:04d}_upgrade_probe.sql"
        migration.write_text(PROBE_MIGRATION[backend])
    return NextBuild(root, versions)


def test_the_next_build_is_what_the_processes_run(next_build: NextBuild) -> None:
    """The copy, not the installed package, is imported with the next build's env; and a
    migration wakes the leaders on the channels the loops listen to."""
    where = subprocess.run(
        [sys.executable, "-c", "import scheduler_daemon; print(scheduler_daemon.__file__)"],
        env=daemon_env(next_build.env()), cwd=next_build.path, capture_output=True,
        text=True, check=True,
    ).stdout.strip()  # fmt: skip
    assert Path(where).is_relative_to(next_build.path), where
    wake_leaders = queries("postgres")["migration_wake_leaders"]
    assert f"'{publish.WAKE_CHANNEL}'" in wake_leaders
    assert f"'{plugin.WAKE_CHANNEL}'" in wake_leaders


# -- an old replica on a newer schema ---------------------------------------------------


def test_an_old_replica_on_a_newer_schema_stays_an_honest_standby(
    database_url: str, daemons: Daemons, next_build: NextBuild
) -> None:
    """Started against a schema the next build migrated: it logs ``schema.newer`` with both
    versions, contends for no lock, says why on /readyz, /status and ``status``, does not
    keep a new replica from leading, and exits 0 on SIGTERM."""
    url = database_url
    backend: Backend = "sqlite" if url.startswith("sqlite") else "postgres"
    known, newer_version = THIS_BUILD[backend], next_build.versions[backend]
    migrated = next_build.cli(["migrate"], SCHEDULER_DATABASE_URL=url)
    assert migrated.returncode == 0, migrated.stderr
    assert f"schema at version {newer_version}" in migrated.stdout
    http = {"SCHEDULER_HTTP__ENABLED": "true", "SCHEDULER_HTTP__PORT": "0"}
    base = {"SCHEDULER_DATABASE_URL": url, **FAST_TIMINGS}
    old = daemons.start({**base, **http, "SCHEDULER_INSTANCE_ID": "old-1"}, name="old-1")
    newer = old.wait_for_log("schema.newer")
    assert (newer["schema_version"], newer["newest_migration"]) == (newer_version, known)
    assert newer["noticed"] == "startup"
    old.wait_for_log("daemon.started")
    port = old.wait_for_log("http.started")["port"]

    status, body = http_get(port, "/readyz")
    assert status == 503, body
    ready = json.loads(body)
    assert ready["reason"].startswith("outdated: schema at version"), ready
    assert (ready["schema_version"], ready["expected_schema_version"]) == (
        newer_version, known,
    )  # fmt: skip
    status, body = http_get(port, "/status")
    assert status == 200, body
    assert json.loads(body)["replica"] == {
        "instance": "old-1",
        "loops": {"publish": "outdated", "plugin": "outdated"},
        "outdated": {"schema_version": newer_version, "newest_migration": known},
    }
    shown = run_cli(["status"], {"SCHEDULER_DATABASE_URL": url})
    assert shown.returncode == 0, shown.stderr
    assert f"newer than this build's newest migration (v{known})" in shown.stdout

    new = daemons.start(next_build.env(**base, SCHEDULER_INSTANCE_ID="new-1"), name="new-1")
    for loop in ("publish", "plugin"):
        new.wait_for_log("leader.acquired", loop=loop)
    if backend == "postgres":
        # Not even waiting: no lock connection of its own in the lock manager's view.
        holders = fetch(url, "SELECT a.application_name FROM pg_locks l "
                             "JOIN pg_stat_activity a ON a.pid = l.pid "
                             "WHERE l.locktype = 'advisory'")  # fmt: skip
        assert sorted(row["application_name"] for row in holders) == [
            "scheduler-daemon/new-1/lock:plugin", "scheduler-daemon/new-1/lock:publish",
        ]  # fmt: skip
    shown = json.loads(run_cli(["status", "--json"], {"SCHEDULER_DATABASE_URL": url}).stdout)
    assert {loop["leader"]["instance"] for loop in shown["loops"].values()} == {"new-1"}
    events = {entry["event"] for entry in old.log_events()}
    assert not events & {"leader.waiting", "leader.acquired"}, sorted(events)
    assert old.poll() is None
    stop_all([old, new])


# -- the migration waits for the tick in flight -----------------------------------------

GATE_KEY = 4242  # an advisory lock the test holds to keep the old leader's tick in flight
# A plugin SQL task, run in the old leader's fenced transaction: it records its interval
# in tick_log, waiting in between until the test lets go of GATE_KEY.
GATED_PROBE = (
    "INSERT INTO tick_log (instance, started) "
    "VALUES (current_setting('application_name'), clock_timestamp()); "
    f"SELECT pg_advisory_xact_lock_shared({GATE_KEY}); "
    "UPDATE tick_log SET ended = clock_timestamp() WHERE id = currval('tick_log_id_seq')"
)
MIGRATE_WAITING = """
SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.relation = 'scheduler_schema_version'::regclass AND NOT l.granted
  AND l.mode = 'AccessExclusiveLock' AND a.application_name LIKE 'scheduler-daemon/%/migrate'
"""


@pytest.mark.postgres
def test_the_migration_waits_for_the_tick_in_flight_and_no_old_tick_runs_after_it(
    pg_url: str, daemons: Daemons, next_build: NextBuild
) -> None:
    """The old leader is inside a SQL task (a fenced transaction) that the test holds up.
    A migration waits for it, and gives up after its lock timeout (exit 75, nothing
    applied, the old leader none the wiser); a second one is applied once the tick
    committed. The old leader starts no tick after that (its fence sees the newer version):
    it steps down, lets its lock go, and stays up."""
    asyncio.run(create_tick_log(pg_url))
    with AdvisoryLock(pg_url, GATE_KEY):
        old = daemons.start(
            {**pg_env(pg_url, "old-1"), **probe_env(GATED_PROBE, every="0.2s")},
            PLUGIN_ONLY, name="old-1",
        )  # fmt: skip
        old.wait_for_log("task.started", task="probe")
        env = next_build.env(SCHEDULER_DATABASE_URL=pg_url)

        timed_out = daemons.start(env, ("migrate",), name="migrate-1")
        wait_until(lambda: scalar(pg_url, MIGRATE_WAITING), 20, "the migration to wait")
        asked = time.time()
        assert timed_out.wait(30) == 75, timed_out.output()
        gave_up = time.time() - asked
        assert "lock timeout" in timed_out.output(), timed_out.output()
        assert (
            scalar(pg_url, "SELECT max(version) FROM scheduler_schema_version")
            == THIS_BUILD["postgres"]
        )

        migrating = daemons.start(env, ("migrate",), name="migrate-2")
        wait_until(lambda: scalar(pg_url, MIGRATE_WAITING), 20, "the migration to wait")
        time.sleep(0.3)
        assert migrating.poll() is None, migrating.output()  # still waiting for the tick
        released = time.time()
    assert migrating.wait(30) == 0, migrating.output()
    assert f"schema at version {next_build.version}" in migrating.output()
    migrated_at = migration_time(pg_url)
    notice = old.wait_for_log("schema.newer", loop="plugin")
    assert notice["schema_version"] == next_build.version
    wait_until(lambda: not lock_holders(pg_url), 10, "the old leader to let its lock go")
    time.sleep(0.6)  # due every 0.2 s: a tick after the migration would show by now
    ticks = asyncio.run(pg_ticks(pg_url))
    assert len(ticks) == 1, ticks  # the one in flight throughout, committed
    assert released < ticks[0].end < migrated_at, (released, ticks, migrated_at)
    assert not [e for e in old.log_events() if e.get("event") == "tick.failed"]
    assert old.poll() is None
    print(f"\nthe first migration gave up {gave_up:.2f}s after it was seen waiting; the "
          f"second was applied {(migrated_at - ticks[0].end) * 1000:.1f} ms after the tick "
          f"in flight ended; the old leader noticed "
          f"{(event_time(notice) - migrated_at) * 1000:.1f} ms after it ran")  # fmt: skip
    stop_all([old])


class AdvisoryLock:
    """An advisory lock held by the test on a connection of its own for the ``with``."""

    def __init__(self, url: str, key: int) -> None:
        self.url = url
        self.key = key
        self._release = threading.Event()
        self._held = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._hold()), daemon=True)

    async def _hold(self) -> None:
        conn = await asyncpg.connect(self.url, server_settings=RIG_APP)
        try:
            await conn.execute("SELECT pg_advisory_lock($1)", self.key)
            self._held.set()
            await asyncio.to_thread(self._release.wait)
        finally:
            await conn.close()

    def __enter__(self) -> AdvisoryLock:
        self._thread.start()
        assert self._held.wait(10), "could not take the advisory lock"
        return self

    def __exit__(self, *exc: object) -> None:
        self._release.set()
        self._thread.join(10)


# -- the roll ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One step of a roll: start a new replica, or SIGTERM one (an old one, or, with
    ``leader_of``, whoever leads that loop now)."""

    start: str | None = None
    stop: str | None = None
    leader_of: str | None = None
    pause: float = 0.3


FAST_ROLL = (
    Step(start="new-1"),
    Step(stop="old-1"),
    Step(stop="old-2"),
    Step(stop="old-3"),
)
# The old publish leader first (maxUnavailable style): an old standby takes over, and the
# new build migrates under it; a second new replica; the old ones (one already gone); and
# then the new publish leader, handing over to the other new replica.
LONG_ROLL = (
    Step(leader_of="publish", pause=2.0),
    Step(start="new-1", pause=2.0),
    Step(start="new-2", pause=2.0),
    Step(stop="old-1", pause=1.0),
    Step(stop="old-2", pause=1.0),
    Step(stop="old-3", pause=2.0),
    Step(leader_of="publish", pause=2.0),
)


def workload_env(url: str, instance: str, effects: Path, **extra: str) -> dict[str, str]:
    """Both loops: publications through the ``sql`` publisher into ``audit`` and the
    ``effects`` publisher (outside work, with the token); a 0.3 s async plugin task every
    0.4 s recording its runs outside the database."""
    tasks = [{"name": "probe", "every": "0.4s", "timeout": "20s",
              "target": EFFECTS_TARGETS["async"]}]  # fmt: skip
    return effects_replica_env(
        url,
        instance,
        effects,
        tasks,
        0.3,
        SCHEDULER_PUBLISH__PUBLISHERS='["sql", "effects"]',
        SCHEDULER_PUBLISH__SQL__STATEMENT=(
            "INSERT INTO audit SELECT * FROM unnest($1::bigint[], $2::text[])"
        ),
        SCHEDULER_PUBLISH__SQL__PARAMS='["id", "key"]',
        EFFECTS_PUBLISH_SECONDS="0.02",
        **extra,
    )


@pytest.mark.postgres
def test_a_rolling_upgrade_neither_overlaps_nor_loses_nor_doubles(
    pg_url: str, daemons: Daemons, next_build: NextBuild, tmp_path: Path
) -> None:
    # Three old replicas, two loops: one of them led neither when the migration ran, and
    # is granted a lock after it (the old leader steps down, the queue moves on to it).
    roll(pg_url, daemons, next_build, tmp_path, FAST_ROLL, seconds=6, granted_after=True)


@pytest.mark.postgres
@pytest.mark.chaos_long
def test_a_long_rolling_upgrade_with_leaders_stopped_on_both_sides(
    pg_url: str, daemons: Daemons, next_build: NextBuild, tmp_path: Path
) -> None:
    roll(pg_url, daemons, next_build, tmp_path, LONG_ROLL, seconds=30)


@pytest.mark.postgres
@pytest.mark.chaos_long
def test_a_rolling_upgrade_in_transaction_mode(
    pg_url: str, daemons: Daemons, next_build: NextBuild, tmp_path: Path
) -> None:
    """The fence is each transaction's lock; plugin runs are held by transactions of their
    own. (Debug logs: transaction mode logs its per-tick leadership changes there.)"""
    mode = {"SCHEDULER_LOCK__MODE": "transaction", "SCHEDULER_LOG__LEVEL": "debug"}
    roll(pg_url, daemons, next_build, tmp_path, FAST_ROLL, seconds=8, env=mode)


def roll(
    url: str,
    daemons: Daemons,
    next_build: NextBuild,
    tmp_path: Path,
    steps: Sequence[Step],
    seconds: float,
    granted_after: bool = False,
    env: dict[str, str] | None = None,
) -> None:
    effects = tmp_path / "effects.jsonl"
    fetch(url, "CREATE TABLE audit (publication_id bigint NOT NULL, key text NOT NULL)")
    # One due every 100 ms from a second from now, for `seconds`: before, during and after.
    rows = int(seconds * 10)
    fetch(url, "INSERT INTO scheduler_publications (key, publish_at) SELECT 'p' || g, "
               "now() + interval '1 s' + g * interval '100 ms' "
               f"FROM generate_series(1, {rows}) g")  # fmt: skip
    replicas: dict[str, DaemonProcess] = {}

    def start(instance: str, env: dict[str, str]) -> None:
        replicas[instance] = daemons.start(env, name=instance)

    extra = env or {}
    # Where a standby waits on the lock, it says so; in transaction mode each tick competes.
    joined = "loop.started" if extra.get("SCHEDULER_LOCK__MODE") == "transaction" else (
        "leader.waiting"
    )  # fmt: skip
    for n in (1, 2, 3):
        start(f"old-{n}", workload_env(url, f"old-{n}", effects, **extra))
    for loop in ("publish", "plugin"):
        first_leader(list(replicas.values()), loop)
    wait_until(lambda: len(read_effects(effects)) >= 4, 20, "work by the old replicas")

    with LockSampler(url) as sampler:
        migrated_logged = None
        for step in steps:
            if step.start is not None:
                replica_env = workload_env(url, step.start, effects, **extra)
                start(step.start, next_build.env(**replica_env))
                line = replicas[step.start].wait_for_log("db.migrated")
                if migrated_logged is None:
                    assert line["applied"] == [next_build.version], line
                    migrated_logged = event_time(line)
                for loop in ("publish", "plugin"):
                    # It has joined both elections before the roll goes on.
                    replicas[step.start].wait_for_log(joined, loop=loop)
            else:
                name = step.stop or current_leader(url, step.leader_of or "")
                if replicas[name].poll() is not None:
                    assert replicas[name].poll() == 0, name  # an earlier step stopped it
                    continue
                replicas[name].signal(signal.SIGTERM)
                assert replicas[name].wait(30) == 0, replicas[name].output()[-3000:]
            time.sleep(step.pause)
        wait_until(
            lambda: scalar(url, "SELECT count(*) FROM scheduler_publications "
                                "WHERE status = 'scheduled'") == 0,
            seconds + 30, "every publication published",
        )  # fmt: skip
        newest = [name for name in replicas if name.startswith("new-")]
        wait_until(
            lambda: sum(r.instance in newest for r in read_effects(effects)) >= 4,
            20, "work by the new replicas",
        )  # fmt: skip
    stop_all([process for process in replicas.values() if process.poll() is None])
    assert migrated_logged is not None
    migrated_at = migration_time(url)
    old = {name for name in replicas if name.startswith("old-")}
    report: list[str] = []

    # Each publication published once, by whichever build led at the time: an old replica
    # before the migration ran, a new one after it.
    published = fetch(url, "SELECT id, status, attempts, published_by, "
                           "extract(epoch FROM published_at)::float8 AS at "
                           "FROM scheduler_publications ORDER BY id")  # fmt: skip
    assert len(published) == rows
    assert {(row["status"], row["attempts"]) for row in published} == {("published", 1)}
    audit = Counter(row["publication_id"] for row in fetch(url, "SELECT * FROM audit"))
    assert audit == Counter(row["id"] for row in published), "a publication lost or doubled"
    by_old = [row["at"] for row in published if row["published_by"] in old]
    by_new = [row["at"] for row in published if row["published_by"] not in old]
    assert by_old, "the old replicas published nothing: the roll proved nothing"
    assert max(by_old) < migrated_at < min(by_new), (max(by_old), migrated_at, min(by_new))
    report.append(f"publications: {len(by_old)} by old replicas, {len(by_new)} by new ones")

    # Slots claimed once, in the database and outside it; the old build's claims all made
    # before the migration ran (the runs they started may begin just after it, and are
    # stopped when their leader steps down).
    runs = fetch(url, "SELECT name, slot, instance, status, "
                      "extract(epoch FROM started_at)::float8 AS claimed "
                      "FROM scheduler_plugin_runs")  # fmt: skip
    claimed_old = [row["claimed"] for row in runs if row["instance"] in old]
    assert claimed_old, "no slot claimed by the old build"
    assert max(claimed_old) < migrated_at
    assert min(row["claimed"] for row in runs if row["instance"] not in old) > migrated_at
    records = read_effects(effects)
    slots = Counter(
        (run.extra["task"], run.extra["slot"]) for run in records if run.loop == "plugin"
    )
    assert max(slots.values()) == 1, [slot for slot, n in slots.items() if n > 1]
    summary = check_effects(records, min_runs=8, min_instances=2)
    for loop, counts in summary.runs.items():
        assert set(counts) & old, (loop, counts)
        assert set(counts) - old, (loop, counts)
    late = [
        r for r in records if r.instance in old and r.loop == "plugin" and r.start > migrated_at
    ]
    report.append(f"plugin runs: {dict(summary.runs['plugin'])}; old runs claimed before and "
                  f"started after the migration: {[r.outcome for r in late]}")  # fmt: skip

    # Who held each loop's lock, as the lock manager said: the old build, then the new one,
    # never back; the old leader gone soon after the migration ran.
    for loop in ("publish", "plugin"):
        holders = [(t, who) for t, each, who in sampler.samples if each == loop]
        switched = next((t for t, who in holders if who not in old), None)
        assert switched is not None, f"{loop}: no new replica led while sampled"
        back = [(t, who) for t, who in holders if t > switched and who in old]
        assert not back, f"{loop}: an old replica led again after a new one: {back}"
        last_old = max((t for t, who in holders if who in old), default=None)
        if last_old is not None:
            assert last_old - migrated_at < 5.0, f"{loop}: old leader held on {last_old}"
            report.append(f"{loop}: an old leader last seen holding the lock "
                          f"{(last_old - migrated_at) * 1000:+.0f} ms from the migration "
                          "(sampled every 50 ms)")  # fmt: skip
        acquired = min(
            event_time(e) for name, process in replicas.items() if name not in old
            for e in process.log_events()
            if e.get("event") == "leader.acquired" and e.get("loop") == loop
        )  # fmt: skip
        report.append(f"{loop}: a new replica led {(acquired - migrated_at) * 1000:.0f} ms "
                      "after the migration ran")  # fmt: skip

    # Every old replica found out and said so; none was granted leadership after it.
    noticed = []
    for name in sorted(old):
        process = replicas[name]
        notices = [e for e in process.log_events() if e.get("event") == "schema.newer"]
        if process.poll() == 0 and not notices:
            # Stopped before the migration (the long roll's first step): nothing to notice.
            assert event_time(process.log_events()[-1]) < migrated_logged, name
            continue
        assert [(e["schema_version"], e["newest_migration"]) for e in notices] == [
            (next_build.version, THIS_BUILD["postgres"])
        ], name
        noticed.append(notices[0]["noticed"])
        report += [
            f"{name} handed {e['loop']} over {(event_time(e) - migrated_at) * 1000:.0f} ms "
            "after the migration ran"
            for e in process.log_events()
            if e.get("event") == "leader.stepped_down" and "outdated" in str(e.get("reason"))
        ]
        acquired = [
            event_time(e) for e in process.log_events() if e.get("event") == "leader.acquired"
        ]
        assert all(t < migrated_logged for t in acquired), (name, acquired, migrated_logged)
    assert "fence" in noticed, noticed  # the old leader, by the fence of its next tick
    if granted_after:
        assert "lock granted" in noticed, noticed
    report.append(f"old replicas noticed the newer schema by: {noticed}")
    print("\n" + "\n".join(report))


def test_on_sqlite_the_old_leader_hands_over_once_the_next_build_migrated(
    sqlite_url: str, daemons: Daemons, next_build: NextBuild, tmp_path: Path
) -> None:
    """One file, flock guards: the old plugin leader's next fenced transaction (after the
    new build's BEGIN IMMEDIATE migration) sees the newer schema; it lets its flock go and
    stays up; the new replica leads. No overlap outside the database, each slot claimed
    once, the old build's claims all older than the migration."""
    effects = tmp_path / "effects.jsonl"
    env = {
        "SCHEDULER_DATABASE_URL": sqlite_url,
        **FAST_TIMINGS,
        "SCHEDULER_PLUGIN__INTERVAL": "0.1",
        "SCHEDULER_PLUGIN__TASKS": json.dumps(
            [{"name": "probe", "every": "0.3s", "target": EFFECTS_TARGETS["async"]}]
        ),
        "SCHEDULER_PLUGIN__DISABLED": '["purge_publications", "purge_runs"]',
        **effects_env(effects, 0.2),
    }
    old = daemons.start({**env, "SCHEDULER_INSTANCE_ID": "old-1"}, PLUGIN_ONLY, name="old-1")
    old.wait_for_log("leader.acquired", loop="plugin")
    wait_until(lambda: len(read_effects(effects)) >= 2, 20, "runs by the old leader")
    new = daemons.start(
        next_build.env(**env, SCHEDULER_INSTANCE_ID="new-1"), PLUGIN_ONLY, name="new-1"
    )
    assert new.wait_for_log("db.migrated")["applied"] == [next_build.versions["sqlite"]]
    notice = old.wait_for_log("schema.newer")
    assert notice["noticed"] == "fence", notice
    new.wait_for_log("leader.acquired", loop="plugin")
    wait_until(
        lambda: sum(r.instance == "new-1" for r in read_effects(effects)) >= 2,
        20, "runs by the new leader",
    )  # fmt: skip
    assert old.poll() is None
    stop_all([old, new])
    migrated_at = migration_time(sqlite_url)
    runs = fetch(sqlite_url, "SELECT instance, started_at FROM scheduler_plugin_runs")
    claimed = {name: [sqlite_time(r["started_at"]) for r in runs if r["instance"] == name]
               for name in ("old-1", "new-1")}  # fmt: skip
    assert max(claimed["old-1"]) < migrated_at < min(claimed["new-1"]), claimed
    records = read_effects(effects)
    assert max(Counter(r.extra["slot"] for r in records).values()) == 1
    check_effects(records, min_runs=4, min_instances=2)
    print(f"\nold leader noticed {(event_time(notice) - migrated_at) * 1000:.0f} ms after the "
          "migration ran")  # fmt: skip


def migration_time(url: str) -> float:
    """When the probe migration ran, by the database's clock (seconds since the epoch)."""
    if url.startswith("sqlite"):
        return sqlite_time(scalar(url, "SELECT migrated_at FROM scheduler_upgrade_probe"))
    at: float = scalar(
        url, "SELECT extract(epoch FROM migrated_at)::float8 FROM scheduler_upgrade_probe"
    )
    return at


def sqlite_time(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def lock_holders(url: str) -> list[dict[str, Any]]:
    return fetch(url, "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted")


def current_leader(url: str, loop: str) -> str:
    rows = wait_until(
        lambda: fetch(url, "SELECT instance FROM scheduler_leaders WHERE loop = $1", loop),
        10, f"a leader of {loop}",
    )  # fmt: skip
    name: str = rows[0]["instance"]
    return name


# Each loop's lock holder that claimed leadership (a leaders row for its backend): an old
# replica granted the lock on the newer schema claims nothing and is not counted.
HOLDERS = """
SELECT extract(epoch FROM clock_timestamp())::float8 AS t, s.loop, s.instance
FROM pg_locks l
JOIN scheduler_leaders s ON s.backend_pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
  AND l.classid = ((s.lock_key >> 32) & 4294967295)::oid
  AND l.objid = (s.lock_key & 4294967295)::oid
"""


class LockSampler:
    """Asks the lock manager who holds each loop's lock every 50 ms, in a thread of its
    own, until the ``with`` block ends: ``samples`` is [(server time, loop, instance)]."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.samples: list[tuple[float, str, str]] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        conn = await asyncpg.connect(self.url, server_settings=RIG_APP)
        try:
            while not self._done.is_set():
                for row in await conn.fetch(HOLDERS):
                    self.samples.append((row["t"], row["loop"], row["instance"]))
                await asyncio.sleep(0.05)
        finally:
            await conn.close()

    def __enter__(self) -> LockSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(10)
        assert not self._thread.is_alive()
