"""The plugin loop end to end, on SQLite and PostgreSQL: the real daemon (in process, so a
test can start, stop and restart it in well under a second), real databases, real CLI
processes for `tasks ...`, and one real daemon process for the sample plugin's entry point.

Evidence is read from the database (`scheduler_plugin_runs`, `scheduler_plugin_tasks`),
which is what the guarantees are about, plus `plugin_targets.calls()` for what ran where
(sync targets run in worker processes, which record their calls to a file).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import threading
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from itertools import pairwise
from pathlib import Path
from typing import Any

import asyncpg
import plugin_targets
import pytest
import structlog
from plugin_targets import CALLS, PROBE_DDL, PROBE_TABLE
from rig.databases import RIG_APP
from rig.processes import Daemons, run_cli
from rig.scene import TAIL_LINES, Scene
from rig.sql import BLOCKED_BY, Db
from rig.waiting import until
from structlog.testing import capture_logs

from scheduler_daemon.config.settings import Settings
from scheduler_daemon.daemon import Daemon
from scheduler_daemon.db.plugin_store import Claim, Claimed, PluginStore
from scheduler_daemon.db.sqlfiles import positional
from scheduler_daemon.logs import get_logger
from scheduler_daemon.loops.plugin import PluginWork
from scheduler_daemon.plugins.tasks import Cron

TERMINAL = {"succeeded", "failed", "timed_out", "skipped_overlap", "abandoned"}


pytestmark = pytest.mark.usefixtures("clean_env")  # conftest.py


@pytest.fixture(autouse=True)
def calls(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    # Worker processes get the daemon's environment as it is when a run starts.
    monkeypatch.setenv(plugin_targets.CALLS_FILE_ENV, str(tmp_path / "calls.jsonl"))
    CALLS.clear()
    yield
    CALLS.clear()


@pytest.fixture(autouse=True)
def logs(scene: Scene) -> Iterator[list[dict[str, Any]]]:
    """Every log event of the in-process daemons, at every level (and none printed but the
    last ones, in the scene of a test that failed)."""
    saved = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    try:
        with capture_logs() as events:
            scene.watch(
                "in-process daemon log",
                lambda: "\n".join(str(event) for event in events[-TAIL_LINES:]),
            )
            yield events
    finally:
        structlog.configure(**saved)


# -- the database, from the test's side --------------------------------------------------


@pytest.fixture
def db(database_url: str) -> Db:
    return Db(database_url)


async def at_least(db: Db, name: str, status: str, count: int, within: float = 20.0) -> None:
    seen: Counter[str] = Counter()

    async def enough() -> bool:
        seen.clear()
        seen.update(await db.statuses(name))
        return seen[status] >= count

    try:
        await until(enough, f"{count} {status} runs of {name}", within)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; its runs by status: {dict(seen)}") from None


# -- the daemon, in process ----------------------------------------------------------------


def make_settings(database_url: str, tasks: list[dict[str, Any]], **overrides: Any) -> Settings:
    plugin = {
        "interval": 0.1,
        "tasks": tasks,
        "disabled": [
            "purge_publications",
            "purge_runs",
        ],  # the built-in: only where a test wants it
        **overrides.pop("plugin", {}),
    }
    return Settings(
        database_url=database_url,
        instance_id=overrides.pop("instance_id", "replica-1"),
        shutdown_timeout=5,
        http={"enabled": False},
        publish={"enabled": False},
        plugin=plugin,
        **overrides,
    )


@asynccontextmanager
async def running(
    database_url: str, tasks: list[dict[str, Any]], **overrides: Any
) -> AsyncIterator[Daemon]:
    """A daemon running only the plugin loop; stopped (and checked to exit 0) on exit."""
    settings = make_settings(database_url, tasks, **overrides)
    daemon = Daemon(settings, get_logger(instance=settings.instance_id), only="plugin")
    run = asyncio.create_task(daemon.run(), name="daemon")
    started = asyncio.create_task(daemon.started.wait())
    await asyncio.wait({run, started}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
    if not started.done():
        started.cancel()
        if run.done():
            raise AssertionError(f"the daemon exited before starting: {run.result()!r}")
        daemon.request_stop("test: too slow to start")
        await asyncio.wait_for(run, 30)
        raise AssertionError("the daemon did not start within 30s")
    try:
        yield daemon
    finally:
        daemon.request_stop("test")
        code = await asyncio.wait_for(run, 30)
    assert code == 0


def task(name: str, **declaration: Any) -> dict[str, Any]:
    return {"name": name, **declaration}


async def cli(database_url: str, *args: str) -> tuple[int, str, str]:
    """`scheduler-daemon ARGS` as a process, without blocking the in-process daemon."""
    result = await asyncio.to_thread(run_cli, list(args), {"SCHEDULER_DATABASE_URL": database_url})
    return result.returncode, result.stdout, result.stderr


def ticks(daemon: Daemon) -> float:
    value = daemon.metrics.registry.get_sample_value(
        "scheduler_ticks_total", {"loop": "plugin", "result": "ok"}
    )
    return value or 0.0


def events(logs: list[dict[str, Any]], name: str, **fields: Any) -> list[dict[str, Any]]:
    return [
        e
        for e in logs
        if e["event"] == name and all(e.get(key) == value for key, value in fields.items())
    ]


# -- runs, targets, statuses ------------------------------------------------------------


def ran(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs that ran. A slot that comes due while the task's previous run is still in
    flight is recorded ``skipped_overlap`` instead (never two runs of one schedule at once;
    test_overlapping_slot_is_skipped proves the rule). A sync target runs in a worker
    process, which a busy machine can keep past a 300 ms period (seen with two suites
    side by side, and before that at 300 ms alone): any slot of such a task may be one."""
    return [run for run in runs if run["status"] != "skipped_overlap"]


async def test_interval_task_runs_each_slot_once(database_url: str, db: Db) -> None:
    tasks = [
        task("async", every="300ms", target="plugin_targets:tick"),
        task("sync", every="300ms", target="plugin_targets:tick_sync"),
        task("bare", every="300ms", target="plugin_targets:no_context"),
    ]
    async with running(database_url, tasks):
        for name in ("async", "sync", "bare"):
            await at_least(db, name, "succeeded", 4)

    period = timedelta(milliseconds=300)
    for name in ("async", "sync", "bare"):
        runs = await db.runs(name)
        slots = [run["slot"] for run in runs]
        assert len(slots) == len(set(slots)), f"{name}: a slot ran twice"
        assert {run["status"] for run in ran(runs)} == {"succeeded"}, runs
        assert all(run["instance"] == "replica-1" and run["finished_at"] for run in runs)
        # Slots keep the phase of the first: whole periods apart (more than one only if a
        # tick came a whole period late, which the misfire policy turned into one run).
        for earlier, later in pairwise(slots):
            assert (later - earlier) % period == timedelta(0), (earlier, later)
        state = await db.task(name)
        assert state["run_count"] == len(ran(runs))
        assert (state["last_status"], state["consecutive_failures"]) == ("succeeded", 0)
        assert state["last_slot"] == ran(runs)[-1]["slot"]
        assert state["next_run_at"] > slots[-1]

    # What ran where: async targets on the event loop, sync ones in worker processes (one
    # per run), each once per recorded run, with the context of its slot.
    recorded = plugin_targets.calls()
    by_kind = {kind: [c for c in recorded if c.kind == kind] for kind in ("async", "sync")}
    for kind in ("async", "sync"):
        assert [c.slot for c in by_kind[kind]] == [r["slot"] for r in ran(await db.runs(kind))]
    main = threading.main_thread().name
    assert all(c.in_task and c.thread == main and c.pid == os.getpid() for c in by_kind["async"])
    assert all(not c.in_task and c.pid != os.getpid() for c in by_kind["sync"])
    assert len({c.pid for c in by_kind["sync"]}) == len(by_kind["sync"])
    bare = [c for c in recorded if c.kind == "no_context"]
    assert len(bare) == len(ran(await db.runs("bare")))
    assert all(c.name is None for c in bare)  # called without the context


async def test_a_steady_tick_is_one_statement(pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Session mode: each tick plans its claim from what the last tick's statement read
    (the window), so once the leader has taken over, a tick that claims a slot sends one
    statement, which also reads the next window; and no tick runs for nothing in between
    (a run's end, its result written: nothing waits for them)."""
    ticks: list[list[tuple[int, int]]] = []  # per tick: (claims sent, runs claimed)
    tick, claim = PluginWork.tick, PluginStore.claim

    async def counted_tick(self: PluginWork, *args: Any) -> float | None:
        ticks.append([])
        return await tick(self, *args)

    async def counted_claim(
        self: PluginStore, instance: str, claims: Sequence[Claim], **window: Any
    ) -> Claimed:
        result = await claim(self, instance, claims, **window)
        ticks[-1].append((len(claims), len(result.runs)))
        return result

    monkeypatch.setattr(PluginWork, "tick", counted_tick)
    monkeypatch.setattr(PluginStore, "claim", counted_claim)
    async with running(pg_url, [task("steady", every="200ms", target="plugin_targets:tick")]):
        await at_least(Db(pg_url), "steady", "succeeded", 12)
    first = next(i for i, statements in enumerate(ticks) if any(runs for _, runs in statements))
    steady = ticks[first + 1 :]
    # One statement a tick; two (a read first) only after a tick that failed, which
    # nothing here should make happen more than once.
    assert sum(len(statements) > 1 for statements in steady) <= 1, ticks
    claiming = [statements for statements in steady if statements[-1][1]]
    assert len(claiming) >= 10, ticks
    # A tick for nothing sends no claim: the take-over's notification arriving after the
    # first claim is one. (A claim sent a hair before its slot by the database's clock is
    # one statement too, and the slot's next tick claims it.)
    assert sum(1 for statements in steady if not statements[-1][0]) <= 3, ticks


async def test_a_claim_the_database_refuses_waits_for_the_next_slot(pg_url: str) -> None:
    """A due slot whose claim the database refuses while its row stays as read (here a
    run left `running` by an instance the leader does not know of): the loop does not
    spin on it, tick after tick; it tries again at the schedule's next slot."""
    db = Db(pg_url)
    async with running(
        pg_url, [task("blocked", every="1s", target="plugin_targets:tick")]
    ) as daemon:
        await at_least(db, "blocked", "succeeded", 1)
        await db.fetch(
            "INSERT INTO scheduler_plugin_runs (name, slot, instance, status) "
            "VALUES ('blocked', now() - interval '1 hour', 'ghost', 'running')"
        )
        before = ticks(daemon)
        await asyncio.sleep(3.0)  # three slots, each refused
        spent = ticks(daemon) - before
    # A tick a slot or so; spinning, it would be one every tick spacing (150 in 3 s).
    assert spent <= 25, spent


async def test_cron_task_is_registered_with_its_next_slot(database_url: str, db: Db) -> None:
    cron = Cron("0 3 * * *", "Europe/Berlin")
    before = cron.first(datetime.now(UTC))
    tasks = [
        task("nightly", cron="0 3 * * *", timezone="Europe/Berlin", target="plugin_targets:tick"),
        # croniter's optional sixth field is seconds: a cron task we can watch run.
        task("two-seconds", cron="* * * * * */2", target="plugin_targets:tick"),
    ]
    async with running(database_url, tasks):
        await at_least(db, "two-seconds", "succeeded", 2, within=15)
        nightly = await db.task("nightly")
    after = cron.first(datetime.now(UTC))
    assert nightly["schedule"] == "cron 0 3 * * * Europe/Berlin"
    assert nightly["next_run_at"] in {before, after}
    assert await db.runs("nightly") == []
    for run in await db.runs("two-seconds"):
        assert run["slot"].second % 2 == 0
        assert run["slot"].microsecond == 0


async def test_sql_task(database_url: str, db: Db) -> None:
    await db.fetch(PROBE_DDL)
    insert = (
        f"INSERT INTO {PROBE_TABLE} (name, slot_text, instance, at_text) "
        "VALUES ('sql', 'from-sql', 'sql', 'x')"
    )
    tasks = [
        task("sql", every="300ms", sql=insert),
        task("broken-sql", every="300ms", sql="INSERT INTO no_such_table VALUES (1)"),
    ]
    async with running(database_url, tasks, plugin={"max_consecutive_failures": 100}):
        await at_least(db, "sql", "succeeded", 3)
        await at_least(db, "broken-sql", "failed", 2)
    probes = await db.fetch(f"SELECT * FROM {PROBE_TABLE}")
    assert len(probes) == (await db.statuses("sql"))["succeeded"]
    [error] = {run["error"] for run in await db.runs("broken-sql")}
    assert "no_such_table" in error


async def test_failures_are_recorded_and_isolated(database_url: str, db: Db) -> None:
    tasks = [
        task("failing", every="300ms", target="plugin_targets:fail"),
        task("failing-sync", every="300ms", target="plugin_targets:fail_sync"),
        task("own-timeout-error", every="300ms", target="plugin_targets:raise_timeout_error"),
        task("healthy", every="300ms", target="plugin_targets:tick"),
    ]
    async with running(database_url, tasks, plugin={"max_consecutive_failures": 100}):
        for name in ("failing", "failing-sync", "own-timeout-error"):
            await at_least(db, name, "failed", 3)
        await at_least(db, "healthy", "succeeded", 3)

    expected = {
        "failing": "RuntimeError: boom for failing",
        "failing-sync": "ValueError: sync boom",
        # A TimeoutError of the target's own is a failure, not the task's timeout.
        "own-timeout-error": "TimeoutError: upstream did not answer",
    }
    for name, error in expected.items():
        runs = ran(await db.runs(name))
        assert {(run["status"], run["error"]) for run in runs} == {("failed", error)}
        state = await db.task(name)
        assert (state["last_status"], state["last_error"]) == ("failed", error)
        assert state["consecutive_failures"] == len(runs)
        assert not state["paused"]
    assert set(await db.statuses("healthy")) == {"succeeded"}


async def test_timeout_is_recorded_and_the_loop_goes_on(
    database_url: str, db: Db, logs: list[dict[str, Any]]
) -> None:
    # The sync target's timeout leaves its worker time to start on a loaded machine (a
    # fork from the forkserver): a run timed out before its target was called would say
    # nothing of how a sync target is stopped.
    tasks = [
        task("hangs", every="500ms", timeout="300ms", target="plugin_targets:hang"),
        task("hangs-sync", every="1500ms", timeout="1s", target="plugin_targets:hang_sync"),
        task("healthy", every="300ms", target="plugin_targets:tick"),
    ]
    async with running(database_url, tasks, plugin={"max_consecutive_failures": 100}):
        await at_least(db, "hangs", "timed_out", 2)
        await at_least(db, "hangs-sync", "timed_out", 2)
        await at_least(db, "healthy", "succeeded", 5)

    for name, timeout in (("hangs", "0.3s"), ("hangs-sync", "1s")):
        # On a busy machine stopping a timed-out run can outlast the time to the next
        # slot, which is then skipped_overlap, recorded: never run beside it, never lost.
        runs = await db.runs(name)
        assert {run["status"] for run in runs} <= {"timed_out", "skipped_overlap"}
        runs = [run for run in runs if run["status"] == "timed_out"]
        assert {run["error"] for run in runs} == {f"timed out after {timeout}"}
        for run in runs:  # the timeout ended it: not the next tick, not the shutdown
            assert run["finished_at"] - run["started_at"] < timedelta(seconds=3)
    # The sync target's worker was told to stop (SIGTERM sets ctx.cancelled), and it did.
    assert sum(c.kind == "hang_sync_saw_cancel" for c in plugin_targets.calls()) >= 2
    assert events(logs, "task.timed_out", task="hangs")


async def test_overlapping_slot_is_skipped(database_url: str, db: Db) -> None:
    # `slow` takes 1.5 s; its slots come every 400 ms.
    tasks = [task("slow", every="400ms", target="plugin_targets:slow")]
    async with running(database_url, tasks):
        await at_least(db, "slow", "succeeded", 2, within=20)
        await at_least(db, "slow", "skipped_overlap", 3)

    runs = await db.runs("slow")
    assert len({run["slot"] for run in runs}) == len(runs)
    executed = [run for run in runs if run["status"] == "succeeded"]
    for earlier, later in pairwise(executed):
        assert later["started_at"] >= earlier["finished_at"], "two runs of one task overlapped"
    for run in runs:
        if run["status"] == "skipped_overlap":
            assert run["finished_at"] is not None
    assert sum(c.kind == "slow" for c in plugin_targets.calls()) == len(executed)


# -- restarts, downtime, configuration changes -------------------------------------------


async def test_misfire_after_downtime(
    database_url: str, db: Db, logs: list[dict[str, Any]]
) -> None:
    period = timedelta(minutes=1)
    tasks = [
        task("catch-up", every="1m", misfire="run_once", target="plugin_targets:tick"),
        task("skipper", every="1m", misfire="skip", target="plugin_targets:tick"),
    ]
    async with running(database_url, tasks):  # new interval tasks run at once
        await at_least(db, "catch-up", "succeeded", 1)
        await at_least(db, "skipper", "succeeded", 1)
    first_slot = {name: (await db.runs(name))[0]["slot"] for name in ("catch-up", "skipper")}

    # Five minutes of "downtime": the slot the database says is next is 5 periods old.
    missed = {}
    for name in ("catch-up", "skipper"):
        state = await db.task(name)
        missed[name] = state["next_run_at"] - 5 * period
        await db.fetch(
            "UPDATE scheduler_plugin_tasks SET next_run_at = $1 WHERE name = $2",
            missed[name],
            name,
        )

    async with running(database_url, tasks):
        await at_least(db, "catch-up", "succeeded", 2)

        async def skipper_moved() -> bool:
            return bool((await db.task("skipper"))["next_run_at"] > missed["skipper"])

        await until(skipper_moved, "the skip task's next_run_at to move on")
        await asyncio.sleep(1.0)  # ten more ticks: no burst of the other missed slots
        now = await db.now()
        states = {name: await db.task(name) for name in ("catch-up", "skipper")}

    catch_up = await db.runs("catch-up")
    assert len(catch_up) == 2  # the first run, then exactly one catch-up
    assert catch_up[1]["slot"] == missed["catch-up"]  # it ran the oldest missed slot
    # The skip task: only its first run; the missed slots were passed over.
    assert [run["slot"] for run in await db.runs("skipper")] == [first_slot["skipper"]]
    for name, state in states.items():
        assert state["next_run_at"] > now, name
        assert (state["next_run_at"] - missed[name]) % period == timedelta(0), "phase lost"
        assert state["next_run_at"] - now <= period
    assert len(events(logs, "task.misfired", task="catch-up", policy="run_once")) == 1
    assert len(events(logs, "task.misfired", task="skipper", policy="skip")) == 1


async def test_restart_does_not_rewrite_next_run_at(database_url: str, db: Db) -> None:
    tasks = [
        task("hourly", every="1h", target="plugin_targets:tick"),
        task("nightly", cron="0 3 * * *", timezone="America/New_York", sql="SELECT 1"),
    ]
    seen = []
    for _ in range(3):
        async with running(database_url, tasks):
            await at_least(db, "hourly", "succeeded", 1)
            await asyncio.sleep(0.3)  # a few ticks of the restarted leader
            seen.append({name: await db.task(name) for name in ("hourly", "nightly")})
    for name in ("hourly", "nightly"):
        assert len({state[name]["next_run_at"] for state in seen}) == 1, name
        assert {state[name]["run_count"] for state in seen} == {1 if name == "hourly" else 0}
    assert len(await db.runs("hourly")) == 1

    # A changed schedule is a new schedule: it starts afresh (an interval task runs now).
    changed = [task("hourly", every="2h", target="plugin_targets:tick"), tasks[1]]
    async with running(database_url, changed):
        await at_least(db, "hourly", "succeeded", 2)
        state = await db.task("hourly")
    assert state["schedule"] == "every 7200s"
    assert state["next_run_at"] - state["last_slot"] == timedelta(hours=2)


async def test_removed_task_becomes_inactive_and_keeps_its_state(database_url: str, db: Db) -> None:
    both = [
        task("stays", every="1h", target="plugin_targets:tick"),
        task("goes", every="1h", target="plugin_targets:tick"),
    ]
    async with running(database_url, both):
        await at_least(db, "goes", "succeeded", 1)
        await at_least(db, "stays", "succeeded", 1)
    before = await db.task("goes")
    assert before["active"]

    async with running(database_url, both[:1]):

        async def deactivated() -> bool:
            return not (await db.task("goes"))["active"]

        await until(deactivated, "the removed task to become inactive")
    after = await db.task("goes")
    for column in ("next_run_at", "run_count", "last_status", "last_slot", "schedule"):
        assert after[column] == before[column], column
    assert len(await db.runs("goes")) == 1  # its history stays too

    code, out, _ = await cli(database_url, "tasks", "list")
    assert code == 0
    assert re.search(r"^goes\s+inactive\s", out, re.MULTILINE), out

    # Declared again: active again, same slot, no re-run.
    async with running(database_url, both):

        async def reactivated() -> bool:
            return bool((await db.task("goes"))["active"])

        await until(reactivated, "the task to come back")
    again = await db.task("goes")
    assert (again["next_run_at"], again["run_count"]) == (before["next_run_at"], 1)


async def test_takeover_abandons_runs_left_running(
    database_url: str, db: Db, logs: list[dict[str, Any]]
) -> None:
    # A run some earlier leader claimed and never finished (it was killed mid-run).
    slot = datetime(2026, 1, 1, 12, tzinfo=UTC)
    await db.fetch(
        "INSERT INTO scheduler_plugin_runs (name, slot, instance, status) "
        "VALUES ('crashed', $1, 'dead-replica', 'running')",
        slot,
    )
    tasks = [task("crashed", every="1h", target="plugin_targets:tick")]
    async with running(database_url, tasks):
        await at_least(db, "crashed", "abandoned", 1)
        await at_least(db, "crashed", "succeeded", 1)  # the task itself carries on
    [abandoned] = [run for run in await db.runs("crashed") if run["status"] == "abandoned"]
    assert (abandoned["slot"], abandoned["instance"]) == (slot, "dead-replica")
    assert abandoned["finished_at"] is not None
    assert "lost the lock" in abandoned["error"]
    assert events(logs, "task.abandoned", task="crashed", run_instance="dead-replica")


# -- operating tasks ------------------------------------------------------------------


async def test_auto_pause_after_consecutive_failures(
    database_url: str, db: Db, logs: list[dict[str, Any]]
) -> None:
    tasks = [
        task("flaky", every="300ms", target="plugin_targets:fail"),
        task("healthy", every="300ms", target="plugin_targets:tick"),
    ]
    async with running(database_url, tasks, plugin={"max_consecutive_failures": 3}):

        async def paused() -> bool:
            return (await db.statuses("flaky"))["failed"] > 0 and (await db.task("flaky"))["paused"]

        await until(paused, "the failing task to be paused")
        healthy_before = (await db.statuses("healthy"))["succeeded"]
        # Three periods, by the healthy task's runs: a paused task does not run.
        await at_least(db, "healthy", "succeeded", healthy_before + 3)
        assert await db.statuses("flaky") == Counter(failed=3)
        assert (await db.statuses("healthy"))["succeeded"] > healthy_before
        [paused_event] = events(logs, "task.auto_paused", task="flaky")
        assert paused_event["failures"] == 3
        assert paused_event["hint"] == "scheduler-daemon tasks resume flaky"

        code, out, _ = await cli(database_url, "tasks", "list", "--json")
        assert code == 0
        [listed] = [row for row in json.loads(out) if row["name"] == "flaky"]
        assert (listed["paused"], listed["consecutive_failures"]) in {(True, 3), (1, 3)}

        # Resuming clears the count: three more tries before the next pause.
        code, out, _ = await cli(database_url, "tasks", "resume", "flaky")
        assert (code, out) == (0, "flaky: resumed\n")
        await at_least(db, "flaky", "failed", 6)
        await until(paused, "the task to be paused again")
        await asyncio.sleep(0.5)
    assert await db.statuses("flaky") == Counter(failed=6)


async def test_tasks_cli_list_pause_trigger_resume(database_url: str, db: Db) -> None:
    tasks = [
        task("hourly", every="1h", target="plugin_targets:tick"),
        task("nightly", cron="0 3 * * *", timezone="Europe/Berlin", target="plugin_targets:tick"),
    ]
    async with running(database_url, tasks) as daemon:
        await at_least(db, "hourly", "succeeded", 1)
        hourly = await db.task("hourly")

        code, out, err = await cli(database_url, "tasks", "list")
        assert code == 0, err
        lines = out.splitlines()
        assert lines[0].split()[:2] == ["TASK", "STATE"]
        assert re.search(r"^hourly\s+active\s+\S+\s+succeeded\s+1\s+every 3600s$", out, re.M)
        assert re.search(
            r"^nightly\s+active\s+\S+\s+-\s+0\s+cron 0 3 \* \* \* Europe/Berlin$", out, re.M
        )

        # trigger: one run, now, claimed as a slot of its own; the schedule is untouched.
        code, out, _ = await cli(database_url, "tasks", "trigger", "nightly")
        assert (code, out) == (0, "nightly: triggered\n")
        await at_least(db, "nightly", "succeeded", 1)
        [triggered] = await db.runs("nightly")
        nightly = await db.task("nightly")
        assert nightly["trigger_requested_at"] is None  # consumed
        assert nightly["next_run_at"] > triggered["slot"]  # still the next 03:00
        assert nightly["next_run_at"] == Cron("0 3 * * *", "Europe/Berlin").next_after(
            triggered["slot"]
        )

        # pause: no more runs, and a trigger waits for resume (without spinning the loop).
        code, out, _ = await cli(database_url, "tasks", "pause", "hourly")
        assert (code, out) == (0, "hourly: paused\n")
        code, out, _ = await cli(database_url, "tasks", "trigger", "hourly")
        assert code == 0
        ticks_before = ticks(daemon)
        await asyncio.sleep(1.5)
        assert len(await db.runs("hourly")) == 1
        assert ticks(daemon) - ticks_before < 40, "the loop spins on a paused task's trigger"
        code, out, _ = await cli(database_url, "tasks", "list")
        assert re.search(r"^hourly\s+paused\s", out, re.M)

        code, out, _ = await cli(database_url, "tasks", "resume", "hourly")
        assert (code, out) == (0, "hourly: resumed\n")
        await at_least(db, "hourly", "succeeded", 2)
        await asyncio.sleep(0.5)
        after = await db.task("hourly")

    runs = await db.runs("hourly")
    assert len(runs) == 2  # the first run, then the trigger: once
    assert runs[1]["slot"] != hourly["next_run_at"]  # a slot of its own
    assert after["next_run_at"] == hourly["next_run_at"]  # schedule untouched
    assert after["trigger_requested_at"] is None

    for action in ("pause", "resume", "trigger"):
        code, out, err = await cli(database_url, "tasks", action, "no-such-task")
        assert code == 65, (action, out, err)
        assert err.strip() == (
            "scheduler-daemon: no task named 'no-such-task' (see `scheduler-daemon tasks list`)"
        )


async def test_trigger_waits_for_a_free_place(database_url: str, db: Db) -> None:
    # One place: `busy` (1.5 s) takes it at once; a trigger of `other` meanwhile waits
    # for the place instead of being dropped, and the loop does not spin while it waits.
    tasks = [
        task("busy", every="1h", target="plugin_targets:slow"),
        task("other", cron="0 3 * * *", target="plugin_targets:tick"),
    ]
    async with running(database_url, tasks, plugin={"concurrency": 1}) as daemon:

        async def busy_started() -> bool:
            return any(c.kind == "slow" for c in plugin_targets.calls())

        await until(busy_started, "busy to start")
        ticks_before = ticks(daemon)
        await db.fetch(
            "UPDATE scheduler_plugin_tasks SET trigger_requested_at = $1 WHERE name = 'other'",
            await db.now(),
        )
        await at_least(db, "other", "succeeded", 1)
        assert ticks(daemon) - ticks_before < 40, "the loop spins while the trigger waits"
    [busy] = await db.runs("busy")
    [other] = await db.runs("other")
    assert other["started_at"] >= busy["finished_at"]


async def test_trigger_and_due_slot_in_one_tick_run_once(database_url: str, db: Db) -> None:
    # The state a leader finds after downtime: the slot is due and a trigger is pending.
    # One of them runs; the other overlaps it and is skipped, never run alongside.
    due = datetime.now(UTC) - timedelta(seconds=30)
    await db.fetch(
        "INSERT INTO scheduler_plugin_tasks (name, schedule, next_run_at, trigger_requested_at) "
        "VALUES ('slow', 'every 3600s', $1, $2)",
        due,
        due + timedelta(seconds=10),
    )
    tasks = [task("slow", every="1h", target="plugin_targets:slow")]
    async with running(database_url, tasks):
        await at_least(db, "slow", "succeeded", 1)
        await asyncio.sleep(0.3)
    assert await db.statuses("slow") == Counter(succeeded=1, skipped_overlap=1)
    assert sum(c.kind == "slow" for c in plugin_targets.calls()) == 1
    state = await db.task("slow")
    assert state["trigger_requested_at"] is None
    assert state["next_run_at"] == due + timedelta(hours=1)


# -- at scale: overload, arguments ------------------------------------------------------


async def test_overload_serves_every_schedule_oldest_first_and_reports_lag(
    database_url: str, db: Db, logs: list[dict[str, Any]]
) -> None:
    # 30 schedules every 300 ms, each run 100 ms, 2 places: about a fifth of the slots
    # fit. Oldest slot first, so every schedule progresses (declared order once starved
    # the last ones for ever), misfires are said, and the lag shows.
    names = [f"s{i:02d}" for i in range(30)]
    tasks = [task(name, every="300ms", target="plugin_targets:brief") for name in names]
    lags: list[float] = []
    async with running(database_url, tasks, plugin={"concurrency": 2}) as daemon:
        for _ in range(40):  # 4 s: about 13 periods
            await asyncio.sleep(0.1)
            lag = daemon.metrics.registry.get_sample_value("scheduler_plugin_lag_seconds")
            lags.append(lag or 0.0)
    runs = Counter(row["name"] for row in await db.runs() if row["status"] == "succeeded")
    assert set(runs) == set(names), f"starved: {sorted(set(names) - set(runs))}"
    assert max(lags) > 0.3, lags
    assert events(logs, "task.misfired") or events(logs, "plugin.misfired")
    for name in names:  # never two runs of one schedule at once
        executed = [r for r in await db.runs(name) if r["status"] == "succeeded"]
        for earlier, later in pairwise(executed):
            assert later["started_at"] >= earlier["finished_at"] - timedelta(milliseconds=5)


async def test_args_reach_async_and_sync_targets(database_url: str, db: Db) -> None:
    tasks = [
        task("a", every="1h", target="plugin_targets:brief", args={"seconds": 0, "k": "v"}),
        task("s", every="1h", target="plugin_targets:brief_sync", args={"n": [1, 2]}),
    ]
    async with running(database_url, tasks):
        await at_least(db, "a", "succeeded", 1)
        await at_least(db, "s", "succeeded", 1)
    kinds = {c.kind for c in plugin_targets.calls()}
    assert 'brief:{"k": "v", "seconds": 0}' in kinds
    assert 'brief_sync:{"n": [1, 2]}' in kinds


async def test_a_trigger_waiting_for_its_run_does_not_hold_up_other_schedules(
    database_url: str, db: Db
) -> None:
    # `slow` runs 1.5 s and is triggered again meanwhile: the trigger waits for that run to
    # end. `soon`, due 0.8 s in, must run on time, not when `slow` ends (a leader that
    # slept "until a run ends" for the trigger's sake held it up: PostgreSQL's listening
    # leader sleeps up to a minute).
    tasks = [
        task("slow", every="1h", target="plugin_targets:slow"),
        task("soon", cron="0 3 * * *", target="plugin_targets:tick"),
    ]
    async with running(database_url, tasks):

        async def slow_started() -> bool:
            return any(c.kind == "slow" for c in plugin_targets.calls())

        await until(slow_started, "slow to start")
        now = await db.now()
        await db.fetch(  # known to the leader (it is told of a slot moved earlier)
            "UPDATE scheduler_plugin_tasks SET next_run_at = $1 WHERE name = 'soon'",
            now + timedelta(milliseconds=800),
        )
        await asyncio.sleep(0.2)
        await db.fetch(  # then a tick sees this trigger wait for slow's run
            "UPDATE scheduler_plugin_tasks SET trigger_requested_at = $1 WHERE name = 'slow'",
            await db.now(),
        )
        await at_least(db, "soon", "succeeded", 1, within=10)
        await at_least(db, "slow", "succeeded", 2, within=10)  # the trigger ran after
    [first, second] = [r for r in await db.runs("slow") if r["status"] == "succeeded"]
    [soon] = await db.runs("soon")
    assert soon["started_at"] < first["finished_at"], "soon waited for slow's run to end"
    assert second["started_at"] >= first["finished_at"]


async def test_a_runtime_row_no_schedule_can_follow_is_refused_alone(
    database_url: str, db: Db, logs: list[dict[str, Any]]
) -> None:
    # Rows written by hand that the database accepts but no replica can follow: each is
    # paused with its reason, and every other schedule goes on (one such row once failed
    # every tick).
    tasks = [task("healthy", every="300ms", target="plugin_targets:tick")]
    overrides = {"plugin": {"runnable": ["plugin_targets:tick"]}}
    async with running(database_url, tasks, **overrides):
        await at_least(db, "healthy", "succeeded", 1)
        insert = (
            "INSERT INTO scheduler_plugin_tasks (name, target, cron, args) "
            "VALUES ($1, 'plugin_targets:tick', $2, $3)"
        )
        await db.fetch(insert, "bad-cron", "every full moon", "{}")
        if db.backend == "postgres":  # jsonb takes nesting Python's json cannot read
            deep = "[" * 3000 + "]" * 3000
            await db.fetch(insert, "deep-args", "* * * * *", '{"a": ' + deep + "}")
        before = (await db.statuses("healthy"))["succeeded"]
        await at_least(db, "healthy", "succeeded", before + 3)
    refused = ["bad-cron", *(["deep-args"] if db.backend == "postgres" else [])]
    for name in refused:
        row = await db.task(name)
        assert row["paused"], row
        assert row["last_status"] == "failed"
        assert row["last_error"]
        assert await db.runs(name) == []
    assert {e["task"] for e in events(logs, "task.refused")} == set(refused)


# -- built-in and plugin tasks ---------------------------------------------------------


async def test_purge_publications(database_url: str, db: Db) -> None:
    now = datetime.now(UTC)
    rows = {
        "old-published": ("published", now - timedelta(days=40)),
        "old-cancelled": ("cancelled", now - timedelta(days=31)),
        "old-failed": ("failed", now - timedelta(days=90)),
        "old-scheduled": ("scheduled", now - timedelta(days=40)),  # overdue, never purged
        "new-published": ("published", now - timedelta(days=29)),
        "future": ("scheduled", now + timedelta(days=1)),
    }
    for key, (status, publish_at) in rows.items():
        await db.fetch(
            "INSERT INTO scheduler_publications (key, payload, publish_at, status) "
            "VALUES ($1, '{}', $2, $3)",
            key,
            publish_at,
            status,
        )
    async with running(database_url, [], plugin={"disabled": []}):
        await at_least(db, "purge_publications", "succeeded", 1)
        state = await db.task("purge_publications")
    left = {row["key"] for row in await db.fetch("SELECT key FROM scheduler_publications")}
    assert left == {"old-scheduled", "new-published", "future"}
    assert state["schedule"] == "every 600s"
    assert state["next_run_at"] - state["last_slot"] == timedelta(minutes=10)


async def test_purge_publications_in_batches(database_url: str, db: Db) -> None:
    old = datetime.now(UTC) - timedelta(days=60)
    if db.backend == "postgres":
        await db.fetch(
            "INSERT INTO scheduler_publications (key, publish_at, status) "
            "SELECT 'k' || n, $1::timestamptz, 'published' FROM generate_series(1, 2500) n",
            old,
        )
    else:
        await db.fetch(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 2500) "
            "INSERT INTO scheduler_publications (key, payload, publish_at, status) "
            "SELECT 'k' || i, '{}', $1, 'published' FROM n",
            old,
        )
    async with running(database_url, [], plugin={"disabled": []}):
        await at_least(db, "purge_publications", "succeeded", 1)
    assert await db.fetch("SELECT count(*) AS n FROM scheduler_publications") == [{"n": 0}]


async def test_history_is_trimmed_to_its_count_off_the_tick_each_task_at_its_own_phase(
    database_url: str, db: Db
) -> None:
    """plugin.history = 4: the results' write marks a task due a trim every 4 of its runs,
    at its own phase (a hash of its name: tasks made together, whose counts move in step,
    come due apart), and the built-in purge_runs trims the marked ones to their newest 4.
    Nothing is trimmed by the results' write itself."""
    names = [f"t{i}" for i in range(6)]
    tasks = [task(n, every="100ms", target="plugin_targets:tick") for n in names]

    async def twelve_runs_each() -> bool:
        rows = await db.fetch("SELECT run_count FROM scheduler_plugin_tasks WHERE name LIKE 't%'")
        return len(rows) == len(names) and all(r["run_count"] >= 12 for r in rows)

    plugin = {"history": 4, "disabled": ["purge_publications"]}
    async with running(database_url, tasks, plugin=plugin):
        await at_least(db, "purge_runs", "succeeded", 1)  # its first slot: at start
        await until(twelve_runs_each, "12 runs of every task", within=60)
        await db.fetch("UPDATE scheduler_plugin_tasks SET paused = true WHERE name LIKE 't%'")

        async def settled() -> bool:
            rows = await db.fetch(
                "SELECT count(*) AS n FROM scheduler_plugin_runs WHERE status = 'running'"
                " AND name LIKE 't%'"
            )
            return rows[0]["n"] == 0

        await until(settled, "no run of the paused tasks in flight", within=30)
        assert len(await db.runs("t0")) > 4, "nothing trimmed on the tick's path"
        code, _, err = await cli(database_url, "tasks", "trigger", "purge_runs")
        assert code == 0, err
        await at_least(db, "purge_runs", "succeeded", 2)
    kept = {n: len(await db.runs(n)) for n in names}
    assert kept == dict.fromkeys(names, 4)
    flags = await db.fetch(
        "SELECT count(*) AS n FROM scheduler_plugin_tasks WHERE history_trim_due"
    )
    assert flags == [{"n": 0}], "each mark cleared once trimmed"
    # Each comes due when its run count plus its phase is a multiple of 4: the phases
    # differ (PostgreSQL: the name's hash; SQLite: the rowid, consecutive for tasks made
    # together).
    phase = "shard_hash" if db.backend == "postgres" else "rowid"
    phases = await db.fetch(
        f"SELECT {phase} % 4 AS p FROM scheduler_plugin_tasks WHERE name LIKE 't%'"
    )
    assert len({abs(row["p"]) for row in phases}) > 1, phases


async def test_purge_runs_deletes_history_older_than_its_max_age(database_url: str, db: Db) -> None:
    """On PostgreSQL these runs, older than the days the history's partitions were made
    for, are in its default partition, where age goes row by row as on SQLite (whole
    days: tests/test_runs_partitions.py)."""
    now = datetime.now(UTC)
    runs = {  # name: (status, started how long ago)
        "old-succeeded": ("succeeded", timedelta(days=8)),
        "old-failed": ("failed", timedelta(days=3)),
        # Left `running` by a leader that died: the new leader closes it (abandoned), and
        # then it is history like any other.
        "old-orphan": ("running", timedelta(days=9)),
        "young": ("succeeded", timedelta(minutes=30)),
    }
    for name, (status, age) in runs.items():
        await db.fetch(
            "INSERT INTO scheduler_plugin_runs (name, slot, instance, started_at, status) "
            "VALUES ($1, $2, 'old', $2, $3)",
            name,
            now - age,
            status,
        )
    plugin = {"disabled": ["purge_publications"], "history_max_age": "2h"}
    async with running(database_url, [], plugin=plugin):
        await at_least(db, "purge_runs", "succeeded", 1)
        state = await db.task("purge_runs")
    left = {row["name"] for row in await db.fetch("SELECT name FROM scheduler_plugin_runs")}
    assert left == {"young", "purge_runs"}
    assert state["schedule"] == "every 60s"


async def test_purge_runs_goes_on_in_batches_past_what_it_keeps_and_stops_at_young_runs(
    database_url: str, db: Db
) -> None:
    """A young run at the lowest id (one still going among the oldest would sit there the
    same way) is in every batch's window: the purge keeps it and goes on, batch after
    batch, through 2,500 old runs; it stops at the 10 young ones after them."""
    old = datetime.now(UTC) - timedelta(days=30)
    young = datetime.now(UTC) - timedelta(hours=1)
    for first, when, count in ((0, young, 1), (1, old, 2500), (2501, young, 10)):
        if db.backend == "postgres":
            await db.fetch(
                "INSERT INTO scheduler_plugin_runs (name, slot, instance, started_at, status) "
                "SELECT 'r' || n, $1::timestamptz, 'old', $1::timestamptz, 'succeeded' "
                "FROM generate_series($2::int, $2::int + $3::int - 1) n",
                when,
                first,
                count,
            )
        else:
            await db.fetch(
                "WITH RECURSIVE n(i) AS (SELECT $2 UNION ALL SELECT i + 1 FROM n "
                "WHERE i < $2 + $3 - 1) "
                "INSERT INTO scheduler_plugin_runs (name, slot, instance, started_at, status) "
                "SELECT 'r' || i, $1, 'old', $1, 'succeeded' FROM n",
                when,
                first,
                count,
            )
    async with running(database_url, [], plugin={"disabled": ["purge_publications"]}):
        await at_least(db, "purge_runs", "succeeded", 1)
    rows = await db.fetch(
        "SELECT name FROM scheduler_plugin_runs WHERE instance = 'old' ORDER BY id"
    )
    assert [row["name"] for row in rows] == ["r0", *(f"r{i}" for i in range(2501, 2511))]


@pytest.mark.processes
async def test_sample_plugin_task_runs_from_its_entry_point(
    database_url: str, db: Db, daemons: Daemons
) -> None:
    env = {
        "SCHEDULER_DATABASE_URL": database_url,
        "SCHEDULER_PLUGIN__INTERVAL": "0.1",
        "SCHEDULER_PLUGIN__DISABLED": '["purge_publications", "purge_runs"]',
        "SCHEDULER_SAMPLE_PLUGIN": "1",
        "SCHEDULER_INSTANCE_ID": "sample-host",
    }
    daemon = daemons.start(env, ["run", "--only", "plugin"])
    registered = await asyncio.to_thread(
        daemon.wait_for_log, "task.registered", task="sample.greet"
    )
    assert registered["source"] == "plugin:sample"
    await asyncio.to_thread(daemon.wait_for_log, "task.succeeded", task="sample.greet")
    await asyncio.to_thread(daemon.wait_for_log, "sample.greeted", instance="sample-host")
    daemon.signal(signal.SIGTERM)
    assert await asyncio.to_thread(daemon.wait, 30) == 0

    greet = await db.runs("sample.greet")
    assert greet
    assert greet[0]["status"] == "succeeded"
    assert {run["instance"] for run in greet} == {"sample-host"}
    [greetings] = await db.fetch("SELECT count(*) AS n FROM sample_plugin_greetings")
    assert greetings["n"] == sum(run["status"] == "succeeded" for run in greet)
    tidy = await db.task("sample.tidy")
    assert tidy["schedule"] == "cron 30 3 * * * Europe/Berlin"
    assert tidy["next_run_at"] == Cron("30 3 * * *", "Europe/Berlin").next_after(tidy["created_at"])


@pytest.mark.postgres
@pytest.mark.parametrize("mode", ["session", "transaction"])
async def test_a_pause_inside_a_fenced_transaction_is_not_taken_for_a_frozen_leader(
    pg_url: str, mode: str
) -> None:
    """The server ends a lock session (session mode) or a transaction (transaction mode)
    silent for stall_timeout (3 s here). A task awaiting something else for 4 s inside
    ctx.transaction() is alive: the heartbeat talks on the connection between its
    statements, so the run commits and the leader keeps its lock."""
    db_pg = Db(pg_url)
    await db_pg.fetch(PROBE_DDL)
    timings = {
        "heartbeat_interval": 0.5, "stop_grace": 0.5, "stall_timeout": 3, "keepalive_idle": 1,
        "keepalive_interval": 1, "keepalive_count": 3, "tcp_user_timeout": 4, "mode": mode,
    }  # fmt: skip
    tasks = [task("pause", every="1h", target="plugin_targets:pause_in_transaction")]
    async with running(pg_url, tasks, lock=timings) as daemon:
        await at_least(db_pg, "pause", "succeeded", 1, within=20)
        lost = daemon.metrics.registry.get_sample_value(
            "scheduler_leadership_changes_total", {"loop": "plugin", "event": "lost"}
        )
    # In transaction mode the ticks that find the run's hold holding the lock count as
    # "lost" turns; what would show a server-ended hold is the run's rows rolled back.
    assert not lost or mode == "transaction"
    rows = await db_pg.fetch(f"SELECT at_text FROM {PROBE_TABLE} ORDER BY at_text DESC")
    assert [row["at_text"] for row in rows] == ["before", "after"]


@pytest.mark.postgres
async def test_a_result_that_cannot_be_recorded_is_closed_by_the_same_leader(pg_url: str) -> None:
    """Sticky mode: a run whose result could not be written (here a trigger refuses it)
    must not stay `running` for the rest of the leadership, holding its schedule: the
    leader's next tick marks it abandoned, and the schedule runs on."""
    db_pg = Db(pg_url)
    await db_pg.fetch(
        """
        CREATE FUNCTION refuse_first_result() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF NEW.status = 'succeeded' AND NEW.id = (
                SELECT min(id) FROM scheduler_plugin_runs WHERE name = NEW.name
            ) THEN
                RAISE EXCEPTION 'refused for the test';
            END IF;
            RETURN NEW;
        END $$
        """
    )
    await db_pg.fetch(
        "CREATE TRIGGER refuse_first_result BEFORE UPDATE ON scheduler_plugin_runs "
        "FOR EACH ROW EXECUTE FUNCTION refuse_first_result()"
    )
    try:
        # Due again before its orphan is closed (its result is retried for ~0.2 s): the
        # tick that closes the orphan must run it then, not wait for a result that never
        # comes (it slept LISTENING_MAX_SLEEP, 60 s: seen only on a busy machine at 0.3 s).
        tasks = [task("kept", every="0.1s", target="plugin_targets:tick")]
        async with running(pg_url, tasks) as daemon:
            await at_least(db_pg, "kept", "succeeded", 2, within=20)
            lost = daemon.metrics.registry.get_sample_value(
                "scheduler_leadership_changes_total", {"loop": "plugin", "event": "lost"}
            )
        runs = await db_pg.runs("kept")
        assert runs[0]["status"] == "abandoned", runs[0]
        assert not lost, "closed by the leader that ran it, not by a successor"
    finally:
        await db_pg.fetch("DROP TRIGGER refuse_first_result ON scheduler_plugin_runs")


# -- the leader's own statement aborted by a deadlock (db/postgres.sql, "Row locks") -------


@asynccontextmanager
async def holder(pg_url: str) -> AsyncIterator[asyncpg.Connection]:
    """A transaction of the test's, for row locks. Its deadlock_timeout is a minute: of a
    deadlock it makes with the leader, the leader's statement (waiting for its second,
    the server's default) is the one the server detects it in, and aborts."""
    conn = await asyncpg.connect(Db(pg_url).url.postgres_dsn, server_settings=RIG_APP)
    try:
        with contextlib.suppress(asyncpg.InsufficientPrivilegeError):  # not a superuser
            await conn.execute("SET deadlock_timeout = '60s'")
        async with conn.transaction():
            yield conn
    finally:
        await conn.close()


async def waiting_on(pg_url: str, conn: asyncpg.Connection, query: str) -> dict[str, Any]:
    """The session that waits for a lock ``conn`` holds, running the named ``query`` (by
    its text's start: the server keeps only the first 1 kB of a statement's)."""
    start = positional("postgres", query)[0][:200]

    async def blocked() -> dict[str, Any] | None:
        rows = await Db(pg_url).fetch(BLOCKED_BY, conn.get_server_pid())
        return next((row for row in rows if row["query"].startswith(start)), None)

    found: dict[str, Any] = await until(blocked, f"{query} waiting on the test", 30)
    return found


@pytest.mark.postgres
async def test_a_result_write_aborted_by_a_deadlock_is_written_on_retry(
    pg_url: str, logs: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The write of a result (its run's row, then its schedule's) in a deadlock with a
    transaction that locks the schedule's row, then the run's: the server aborts the
    write, the batch writes it again (plugin_runs.RESULT_ATTEMPTS), and the run ends
    `succeeded`; the schedule runs again. A result no attempt can write is closed as
    abandoned, and its schedule runs on: the test above,
    test_a_result_that_cannot_be_recorded_is_closed_by_the_same_leader."""
    monkeypatch.setattr(plugin_targets, "GATE", gate := asyncio.Event())
    db_pg = Db(pg_url)
    tasks = [task("held", every="1h", target="plugin_targets:gated")]  # runs at once
    async with running(pg_url, tasks):
        await at_least(db_pg, "held", "running", 1)
        [run] = await db_pg.runs("held")
        async with holder(pg_url) as conn:
            await conn.execute("SELECT FROM scheduler_plugin_tasks WHERE name = 'held' FOR UPDATE")
            gate.set()  # the run ends: its result's write takes the run's row, then waits
            await waiting_on(pg_url, conn, "plugin_finish")
            # The run's row, which the write holds: the server aborts the write.
            ids = await conn.fetch(
                "SELECT id FROM scheduler_plugin_runs WHERE id = $1 AND slot = $2 FOR UPDATE",
                run["id"],
                run["slot"],
            )
            assert [row["id"] for row in ids] == [run["id"]], "still running"
        await at_least(db_pg, "held", "succeeded", 1)
        await db_pg.fetch(
            "UPDATE scheduler_plugin_tasks SET trigger_requested_at = now() WHERE name = 'held'"
        )
        await at_least(db_pg, "held", "succeeded", 2)
    retries = events(logs, "task.results_retry")
    assert [e["error"].split(":")[0] for e in retries] == ["DeadlockDetectedError"], retries
    assert not events(logs, "task.result_not_recorded")
    first = (await db_pg.runs("held"))[0]
    assert (first["id"], first["status"]) == (run["id"], "succeeded")


@pytest.mark.postgres
async def test_a_claim_aborted_by_a_deadlock_is_claimed_again(
    pg_url: str, logs: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tick's claim (of two schedules, whose rows it locks in name order) in a deadlock
    with a transaction that locks the second, then the first: the server aborts the
    claim, the tick fails (`tick.failed`) and the next one claims the same slots. Here
    both schedules' runs are in flight (gated), so each slot due is claimed as skipped;
    once the runs end, the slots after run."""
    monkeypatch.setattr(plugin_targets, "GATE", gate := asyncio.Event())
    db_pg = Db(pg_url)
    tasks = [task(name, every="1s", target="plugin_targets:gated") for name in ("dl-a", "dl-b")]
    async with running(pg_url, tasks) as daemon:
        for name in ("dl-a", "dl-b"):
            await at_least(db_pg, name, "running", 1)
        async with holder(pg_url) as conn:
            await conn.execute("SELECT FROM scheduler_plugin_tasks WHERE name = 'dl-b' FOR UPDATE")
            # The next tick: it claims both due slots, has locked dl-a, waits for dl-b.
            await waiting_on(pg_url, conn, "plugin_claim")
            slots = {
                row["name"]: row["next_run_at"]
                for row in await conn.fetch("SELECT name, next_run_at FROM scheduler_plugin_tasks")
            }
            await conn.execute("SELECT FROM scheduler_plugin_tasks WHERE name = 'dl-a' FOR UPDATE")

        # The server aborted the claim (our FOR UPDATE got the row): the daemon hears of it
        # a moment later, not necessarily before we look.
        async def tick_failed() -> bool:
            failed = daemon.metrics.registry.get_sample_value(
                "scheduler_ticks_total", {"loop": "plugin", "result": "failed"}
            )
            return failed == 1

        await until(tick_failed, "the tick whose claim was aborted to fail", 30)

        async def deadlocks() -> int:
            [row] = await db_pg.fetch(
                "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"
            )
            return int(row["deadlocks"])

        await until(deadlocks, "the server's count of deadlocks to say so", 30)

        async def claimed_again() -> bool:
            runs = {(r["name"], r["slot"]) for r in await db_pg.runs()}
            return all((name, slot) in runs for name, slot in slots.items())

        await until(claimed_again, f"the slots of the aborted claim claimed: {slots}", 30)
        gate.set()
        for name in ("dl-a", "dl-b"):
            await at_least(db_pg, name, "succeeded", 2)
    assert len(events(logs, "tick.failed")) == 1
    for name, slot in slots.items():
        [again] = [r for r in await db_pg.runs(name) if r["slot"] == slot]
        assert again["status"] in ("skipped_overlap", "succeeded"), again
