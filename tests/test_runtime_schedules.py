"""Runtime schedules, from the application's side (docs/plugins.md, "Schedules as data"):
``Client.add_schedule|remove_schedule|get_schedule``, ``add_schedule_in`` and
``remove_schedule_in`` inside the application's transaction, the CLI's ``tasks
add|show|remove``, and plain SQL; on SQLite and PostgreSQL, against the real daemon in
process (as tests/test_plugin_loop.py runs it).

Evidence: the rows of ``scheduler_plugin_tasks`` / ``scheduler_plugin_runs``, and what
the targets received (``plugin_targets.ARGS``, ``plugin_targets.CALLS``).
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import plugin_targets
import pytest
from rig.databases import PgServer, replace_user, run_sync
from rig.processes import run_cli
from rig.sql import Db
from rig.waiting import until

from scheduler_daemon.client import (
    Client,
    add_schedule_in,
    remove_schedule_in,
    validate_runtime_schedule,
)
from scheduler_daemon.config.settings import MAX_TASK_NAME_LENGTH, PluginTaskSettings, Settings
from scheduler_daemon.config.url import DatabaseUrl
from scheduler_daemon.daemon import Daemon
from scheduler_daemon.db.schedules import ScheduleStore
from scheduler_daemon.errors import InvalidInput, NotFound
from scheduler_daemon.logs import get_logger

PLUGINS_DOC = Path(__file__).resolve().parent.parent / "docs" / "plugins.md"

RECORD_ARGS = "plugin_targets:record_args"
SLOW = "plugin_targets:slow"  # an async target that takes 1.5 s
TICK = "plugin_targets:tick"


pytestmark = pytest.mark.usefixtures("clean_env")  # conftest.py


@pytest.fixture(autouse=True)
def calls() -> Iterator[None]:
    plugin_targets.CALLS.clear()
    plugin_targets.ARGS.clear()
    plugin_targets.SLOT_ARGS.clear()
    yield
    plugin_targets.CALLS.clear()
    plugin_targets.ARGS.clear()
    plugin_targets.SLOT_ARGS.clear()


# -- the database, from the test's side (plain SQL, `$1` parameters on both) -----------


async def runs(url: str, name: str) -> list[dict[str, Any]]:
    return await Db(url).fetch("SELECT id, slot, status, error FROM scheduler_plugin_runs WHERE name = $1 "
        "ORDER BY id", name,
    )  # fmt: skip


async def declare_runnable(url: str, *targets: str) -> None:
    """What a plugin leader does when it takes over (tests without a daemon)."""
    for target in targets:
        await Db(url).fetch("INSERT INTO scheduler_runnable_targets (target) VALUES ($1)", target)


# -- the daemon and the client, in process ----------------------------------------------


def settings_for(url: str, **plugin: Any) -> Settings:
    return Settings(
        database_url=url,
        instance_id="replica-1",
        shutdown_timeout=5,
        http={"enabled": False},
        publish={"enabled": False},
        plugin={"interval": 0.1, "disabled": ["purge_publications", "purge_runs"], **plugin},
    )


@asynccontextmanager
async def running(url: str, **plugin: Any) -> AsyncIterator[Daemon]:
    """The plugin loop leading, its runnable targets published; stopped (exit 0) after."""
    settings = settings_for(url, **plugin)
    daemon = Daemon(settings, get_logger(instance=settings.instance_id), only="plugin")
    run = asyncio.create_task(daemon.run(), name="daemon")
    try:
        expected = set(plugin.get("runnable", []))

        async def published() -> bool:
            assert not run.done(), f"the daemon exited: {run.result()!r}"
            rows = await Db(url).fetch("SELECT target FROM scheduler_runnable_targets")
            return expected <= {row["target"] for row in rows}

        await until(published, "the leader to publish its runnable targets", within=30)
        yield daemon
    finally:
        daemon.request_stop("test")
        code = await asyncio.wait_for(run, 30)
    assert code == 0


@asynccontextmanager
async def client_for(url: str) -> AsyncIterator[Client]:
    async with Client.connect(settings_for(url)) as client:
        yield client


# -- validation, before anything reaches a database ---------------------------------------


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"name": " "}, "name must not be empty"),
        ({"name": "x" * (MAX_TASK_NAME_LENGTH + 1)}, "over the limit of 500"),
        ({"name": "a\x00b"}, "name holds a NUL character"),
        ({"every": None}, "give exactly one of 'every' and 'cron'"),
        ({"cron": "* * * * *"}, "give exactly one of 'every' and 'cron'"),
        ({"every": "soon"}, "every: not a duration: 'soon'"),
        ({"every": 0}, "every: Input should be greater than 0"),
        ({"every": None, "cron": "61 * * * *"}, "invalid cron expression '61 * * * *'"),
        ({"every": None, "cron": "0 0 30 2 *"}, "never matches a date"),
        ({"timezone": "Mars/Olympus"}, "unknown timezone 'Mars/Olympus'"),
        ({"target": "os.system"}, "is not of the form 'package.module:function'"),
        ({"target": "os:system; rm -rf /"}, "is not of the form 'package.module:function'"),
        ({"args": [1, 2]}, "args must be a JSON object, not list"),
        ({"args": {"x": float("nan")}}, "args is not JSON-serialisable"),
        ({"args": {"x": "\x00"}}, "args holds a NUL character"),
        (
            {"args": {"x": "y" * 100}, "max_args_bytes": 50},
            "args is 108 bytes, over the limit of 50",
        ),
        ({"timeout": timedelta(0)}, "timeout: Input should be greater than 0"),
        ({"misfire": "twice"}, "misfire: Input should be 'run_once' or 'skip'"),
        ({"jitter": -1}, "jitter: Input should be greater than or equal to 0"),
        ({"start": datetime(2027, 1, 1)}, "start must be timezone-aware"),
    ],
)
def test_validation_refuses_before_the_database(parameters: dict[str, Any], message: str) -> None:
    request: dict[str, Any] = {"name": "feed-1", "target": TICK, "every": "30s"} | parameters
    name = request.pop("name")
    with pytest.raises(InvalidInput) as refused:
        validate_runtime_schedule(name, **request)
    assert message in str(refused.value)


def test_validation_accepts_and_normalises() -> None:
    valid = validate_runtime_schedule(
        "feed-1", target=TICK, cron="*/5 * * * *", timezone="Europe/Berlin",
        args={"feed": 1}, timeout=timedelta(minutes=2), jitter="10s", misfire="skip",
    )  # fmt: skip
    assert (valid.every_seconds, valid.cron, valid.timezone) == (
        None,
        "*/5 * * * *",
        "Europe/Berlin",
    )
    assert (valid.timeout_seconds, valid.jitter_seconds, valid.misfire) == (120.0, 10.0, "skip")
    assert valid.args_json == '{"feed":1}'
    assert valid.definition().schedule == "cron */5 * * * * Europe/Berlin jitter 10s"
    # The first slot is the schedule's own: a cron one at its next match (plus the jitter
    # fixed for this name); an interval one at once, jitter apart.
    now = datetime(2027, 1, 1, 9, 1, tzinfo=UTC)
    first = valid.definition().first_slot(now)
    assert (
        datetime(2027, 1, 1, 9, 5, tzinfo=UTC) <= first < datetime(2027, 1, 1, 9, 5, 10, tzinfo=UTC)
    )
    every = validate_runtime_schedule("feed-1", target=TICK, every=30)
    assert every.definition().first_slot(now) == now
    # No jitter, said explicitly, is no jitter (config's own `jitter = "0s"` too).
    assert validate_runtime_schedule("x", target=TICK, every=1, jitter="0s").jitter_seconds == 0
    assert PluginTaskSettings(name="x", every=1, target=TICK, jitter=0).jitter == 0


# -- the daemon runs what the application adds ---------------------------------------------


async def test_an_added_schedule_runs_with_its_args(database_url: str) -> None:
    declared = {"name": "declared", "every": "1h", "target": TICK}
    async with (
        running(database_url, runnable=[RECORD_ARGS], tasks=[declared]),
        client_for(database_url) as client,
    ):
        args = {"feed": 42, "tags": ["a", "b"], "nested": {"ok": True}}
        added = await client.add_schedule(
            "feed-42", every="300ms", target=RECORD_ARGS, args=args, timeout="5s"
        )
        assert added.created
        row = added.schedule
        assert (row.source, row.target, row.args, row.every_seconds) == (
            "runtime", RECORD_ARGS, args, 0.3
        )  # fmt: skip
        assert (row.timeout_seconds, row.misfire, row.jitter_seconds) == (5.0, "run_once", 0.0)
        assert row.runtime
        assert not row.paused
        assert row.active

        async def ran_twice() -> list[dict[str, Any]]:
            done = [r for r in await runs(database_url, "feed-42") if r["status"] == "succeeded"]
            return done if len(done) >= 2 else []

        await until(ran_twice, "two runs of the runtime schedule")
        assert plugin_targets.ARGS[:2] == [("feed-42", args), ("feed-42", args)]

        # A row inserted with plain SQL runs as well, due at once, with its args.
        await Db(database_url).fetch(
            "INSERT INTO scheduler_plugin_tasks (name, target, args, every_seconds) "
            f"VALUES ('by-sql', '{RECORD_ARGS}', '{{\"via\": \"sql\"}}', 3600)",
        )

        async def ran_by_sql() -> bool:
            return ("by-sql", {"via": "sql"}) in plugin_targets.ARGS

        await until(ran_by_sql, "the row inserted by SQL to run")

        # A row whose target got into the runnable table behind the leader's back (it
        # publishes its own set only when it takes over) is refused by the leader: paused,
        # with the reason, and never run.
        await declare_runnable(database_url, "plugin_targets:hang")
        await Db(database_url).fetch(
            "INSERT INTO scheduler_plugin_tasks (name, target, every_seconds) "
            "VALUES ('sneaky', 'plugin_targets:hang', 1)",
        )

        async def refused() -> Any:
            state = await client.get_schedule("sneaky")
            return state is not None and state.paused and state

        sneaky = await until(refused, "the leader to refuse the undeclared target")
        assert "not runnable on this replica" in (sneaky.last_error or "")
        assert await runs(database_url, "sneaky") == []
        assert not [c for c in plugin_targets.CALLS if c.kind == "hang"]
        declared_row = await client.get_schedule("declared")
        assert declared_row is not None
        assert (declared_row.source, declared_row.target) == ("config", None)


async def test_a_change_reaches_every_slot_claimed_after_it(database_url: str) -> None:
    """The leader plans a tick's claim from what its last statement read, up to a slot
    ahead (loops/plugin.py), so a schedule can change between that read and the claim. The
    claim compares the row's definition too: every slot that fell due after a change of
    ``args`` (made by plain SQL, as an application would) ran with the new ones."""
    async with (
        running(database_url, runnable=[RECORD_ARGS]),
        client_for(database_url) as client,
    ):
        await client.add_schedule("changing", every="200ms", target=RECORD_ARGS, args={"v": 1})

        def runs_with(version: int, after: datetime | None = None) -> int:
            return sum(
                1
                for name, slot, args in plugin_targets.SLOT_ARGS
                if name == "changing" and args == {"v": version}
                and (after is None or slot > after)
            )  # fmt: skip

        async def ran_v1() -> bool:
            return runs_with(1) >= 2

        await until(ran_v1, "two runs with the first args")
        await Db(database_url).fetch(
            "UPDATE scheduler_plugin_tasks SET args = '{\"v\": 2}' WHERE name = 'changing'"
        )
        changed = datetime.now(UTC)  # the database's clock is this machine's

        async def ran_v2() -> bool:
            return runs_with(2, after=changed) >= 3

        await until(ran_v2, "three runs with the new args")
    late = [
        (slot, args)
        for name, slot, args in plugin_targets.SLOT_ARGS
        if name == "changing" and slot > changed and args != {"v": 2}
    ]
    assert late == [], "a slot due after the change ran with what the schedule said before"


async def test_an_unknown_target_is_refused_at_insert(database_url: str) -> None:
    await declare_runnable(database_url, TICK)
    async with client_for(database_url) as client:
        with pytest.raises(InvalidInput) as refused:
            await client.add_schedule("evil", every="1s", target="os:system", args={"c": "id"})
        message = str(refused.value)
        assert "target 'os:system' is not runnable" in message
        assert "plugin.runnable" in message
        assert await client.get_schedule("evil") is None
        # The same request naming a runnable target passes: the refusal was the target's.
        assert (await client.add_schedule("fine", every="1s", target=TICK)).created

    # Plain SQL meets the trigger, on an insert and on an update of the target.
    with pytest.raises(Exception, match="scheduler_plugin_tasks_target_check"):
        await Db(database_url).fetch(
            "INSERT INTO scheduler_plugin_tasks (name, target, every_seconds) "
            "VALUES ('evil', 'os:system', 1)",
        )
    with pytest.raises(Exception, match="scheduler_plugin_tasks_target_check"):
        await Db(database_url).fetch("UPDATE scheduler_plugin_tasks SET target = 'os:system'")
    rows = await Db(database_url).fetch("SELECT name, target FROM scheduler_plugin_tasks")
    assert rows == [{"name": "fine", "target": TICK}]


class RacedPastTheLookup:
    """A transaction whose lookup found the target runnable: as for a writer whose target
    left the runnable set (a leader took over with another config) just after it looked."""

    def __init__(self, tx: Any) -> None:
        self.tx = tx

    async def query(self, query: str, **params: Any) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = await self.tx.query(query, **params)
        if query == "schedule_lookup":
            rows[0]["runnable"] = True
        return rows


async def test_the_triggers_refusal_is_invalid_input_too(database_url: str) -> None:
    request = validate_runtime_schedule("evil", every=1, target="os:system")
    async with client_for(database_url) as client:
        with pytest.raises(InvalidInput) as refused:
            async with client.store.transaction() as tx:
                await ScheduleStore(RacedPastTheLookup(tx)).add(  # type: ignore[arg-type]
                    request.definition(), replace=False
                )
        assert await client.get_schedule("evil") is None
    assert "target 'os:system' is not runnable" in str(refused.value)
    assert "plugin.runnable" in str(refused.value)


async def test_names_replace_and_declared_tasks(database_url: str) -> None:
    await declare_runnable(database_url, TICK, RECORD_ARGS)
    # A declared task's row, as a leader registers it.
    slot = datetime(2030, 1, 1, tzinfo=UTC)
    await Db(database_url).fetch(
        "INSERT INTO scheduler_plugin_tasks (name, schedule, next_run_at, source) "
        "VALUES ('nightly', 'cron 0 3 * * * UTC', $1, 'config')",
        slot,
    )
    async with client_for(database_url) as client:
        first = await client.add_schedule(
            "report", cron="0 3 * * *", timezone="Europe/Berlin", target=TICK, args={"v": 1}
        )
        before = first.schedule
        assert before.next_run_at > datetime.now(UTC)  # the next 03:00 in Berlin
        assert before.next_run_at.astimezone(UTC).hour in (1, 2)

        with pytest.raises(InvalidInput, match="a schedule named 'report' already exists"):
            await client.add_schedule("report", every="1s", target=TICK)
        # Replaced, same schedule: the definition changes, the slot stays.
        replaced = await client.add_schedule(
            "report", cron="0 3 * * *", timezone="Europe/Berlin", target=RECORD_ARGS,
            args={"v": 2}, timeout="1m", replace=True,
        )  # fmt: skip
        assert not replaced.created
        after = replaced.schedule
        assert (after.target, after.args, after.timeout_seconds) == (RECORD_ARGS, {"v": 2}, 60.0)
        assert after.next_run_at == before.next_run_at
        # A given start moves it; so does another schedule.
        start = datetime(2031, 5, 6, 7, 8, 9, tzinfo=UTC)
        moved = await client.add_schedule(
            "report", cron="0 3 * * *", timezone="Europe/Berlin", target=TICK, start=start,
            replace=True,
        )  # fmt: skip
        assert moved.schedule.next_run_at == start
        rescheduled = await client.add_schedule("report", every="1h", target=TICK, replace=True)
        assert rescheduled.schedule.next_run_at < start
        assert rescheduled.schedule.schedule == "every 3600s"

        # Declared tasks are never written through this API, replace or not.
        for replace in (False, True):
            with pytest.raises(InvalidInput, match="'nightly' is a task the deployment declares"):
                await client.add_schedule("nightly", every="1s", target=TICK, replace=replace)
        with pytest.raises(NotFound, match="'nightly' is a task the deployment declares"):
            await client.remove_schedule("nightly")
        nightly = await client.get_schedule("nightly")
        assert nightly is not None
        assert (nightly.target, nightly.next_run_at, nightly.source) == (None, slot, "config")

        with pytest.raises(NotFound, match="no schedule named 'nope'"):
            await client.remove_schedule("nope")
        paused = await client.pause_schedule("report")
        assert paused.paused
        assert not (await client.resume_schedule("report")).paused
        removed = await client.remove_schedule("report")
        assert removed.name == "report"
        assert await client.get_schedule("report") is None
        assert [row.name for row in await client.list_schedules()] == ["nightly"]


async def test_removed_while_running_ends_normally_and_never_runs_again(
    database_url: str,
) -> None:
    declared = {"name": "declared", "every": "300ms", "target": TICK}
    async with (
        running(database_url, runnable=[SLOW], tasks=[declared]),
        client_for(database_url) as client,
    ):
        await client.add_schedule("slowpoke", every="300ms", target=SLOW)

        async def in_flight() -> bool:
            return any(r["status"] == "running" for r in await runs(database_url, "slowpoke"))

        await until(in_flight, "the runtime schedule's run to start")
        removed = await client.remove_schedule("slowpoke")
        assert removed.target == SLOW
        at_removal = await runs(database_url, "slowpoke")
        [running_run] = [r for r in at_removal if r["status"] == "running"]

        async def finished() -> bool:
            rows = await runs(database_url, "slowpoke")
            return all(r["status"] != "running" for r in rows)

        await until(finished, "the removed schedule's run to end")
        declared_before = len(await runs(database_url, "declared"))

        async def three_periods() -> bool:  # the declared task's runs: the same period
            return len(await runs(database_url, "declared")) >= declared_before + 3

        await until(three_periods, "three periods of the removed schedule")
        after = await runs(database_url, "slowpoke")
        assert [r["id"] for r in after] == [r["id"] for r in at_removal], "scheduled again"
        [ended] = [r for r in after if r["id"] == running_run["id"]]
        assert (ended["status"], ended["error"]) == ("succeeded", None)
        assert len([c for c in plugin_targets.CALLS if c.kind == "slow"]) == 1
        assert await client.get_schedule("slowpoke") is None
        # The declared task beside it went on.
        assert len(await runs(database_url, "declared")) > declared_before


# -- inside the application's transaction (PostgreSQL) -------------------------------------


@pytest.mark.postgres
async def test_add_and_remove_schedule_in_follow_the_applications_transaction(
    pg_url: str,
) -> None:
    await declare_runnable(pg_url, TICK)
    conn = await asyncpg.connect(DatabaseUrl.parse(pg_url).postgres_dsn)
    try:
        transaction = conn.transaction()
        await transaction.start()
        added = await add_schedule_in(conn, "tenant-1", every="1m", target=TICK,
                                      args={"tenant": 1})  # fmt: skip
        assert added.created
        assert added.schedule.args == {"tenant": 1}
        await transaction.rollback()
        assert await Db(pg_url).fetch("SELECT name FROM scheduler_plugin_tasks") == []

        async with conn.transaction():
            # Refused before anything is written: the transaction is still usable.
            with pytest.raises(InvalidInput, match="not runnable"):
                await add_schedule_in(conn, "evil", every="1m", target="os:system")
            with pytest.raises(InvalidInput, match="every: not a duration"):
                await add_schedule_in(conn, "bad", every="soon", target=TICK)
            await add_schedule_in(conn, "tenant-1", every="1m", target=TICK, args={"tenant": 1})
            # Not committed yet: others do not see it.
            assert await Db(pg_url).fetch("SELECT name FROM scheduler_plugin_tasks") == []
        [row] = await Db(pg_url).fetch("SELECT name, target, args FROM scheduler_plugin_tasks")
        assert (row["name"], row["target"], json.loads(row["args"])) == (
            "tenant-1", TICK, {"tenant": 1}
        )  # fmt: skip

        transaction = conn.transaction()
        await transaction.start()
        await remove_schedule_in(conn, "tenant-1")
        await transaction.rollback()
        assert len(await Db(pg_url).fetch("SELECT name FROM scheduler_plugin_tasks")) == 1
        async with conn.transaction():
            with pytest.raises(NotFound):
                await remove_schedule_in(conn, "nope")
            assert (await remove_schedule_in(conn, "tenant-1")).name == "tenant-1"
        assert await Db(pg_url).fetch("SELECT name FROM scheduler_plugin_tasks") == []

        with pytest.raises(RuntimeError, match="needs a transaction open"):
            await add_schedule_in(conn, "tenant-2", every="1m", target=TICK)
        with pytest.raises(TypeError, match="needs an asyncpg connection"):
            await remove_schedule_in(object(), "tenant-1")
    finally:
        await conn.close()


@pytest.fixture
def app_role(pg_server: PgServer) -> Iterator[str]:
    """A login role with no grant yet; dropped after the test's database (requested first,
    so torn down last)."""
    name = f"app_{secrets.token_hex(4)}"
    run_sync(Db(pg_server.admin_dsn).fetch(f"CREATE ROLE {name} LOGIN"))
    yield name
    run_sync(Db(pg_server.admin_dsn).fetch(f"DROP ROLE IF EXISTS {name}"))


@pytest.mark.postgres
async def test_an_application_role_needs_only_the_documented_grants(
    app_role: str, pg_url: str
) -> None:
    """docs/security.md, Other clients: adding takes SELECT, INSERT on the tasks and SELECT
    on the runnable targets; replace, pause and resume UPDATE; remove DELETE."""
    await declare_runnable(pg_url, TICK)
    app_url = replace_user(pg_url, app_role)
    await Db(pg_url).fetch(f"GRANT SELECT, INSERT ON scheduler_plugin_tasks TO {app_role}")
    async with client_for(app_url) as client:
        with pytest.raises(asyncpg.InsufficientPrivilegeError, match="scheduler_runnable_targets"):
            await client.add_schedule("tenant-1", every="1m", target=TICK)
        await Db(pg_url).fetch(f"GRANT SELECT ON scheduler_runnable_targets TO {app_role}")
        assert (await client.add_schedule("tenant-1", every="1m", target=TICK)).created
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await client.add_schedule("tenant-1", every="2m", target=TICK, replace=True)
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await client.remove_schedule("tenant-1")
        await Db(pg_url).fetch(f"GRANT UPDATE ON scheduler_plugin_tasks TO {app_role}")
        replaced = await client.add_schedule("tenant-1", every="2m", target=TICK, replace=True)
        assert replaced.schedule.every_seconds == 120.0
        assert (await client.pause_schedule("tenant-1")).paused
        assert not (await client.resume_schedule("tenant-1")).paused
        await Db(pg_url).fetch(f"GRANT DELETE ON scheduler_plugin_tasks TO {app_role}")
        await client.remove_schedule("tenant-1")
        assert await client.get_schedule("tenant-1") is None
        # And the runnable set stays the leader's: the application cannot add to it.
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await Db(app_url).fetch("INSERT INTO scheduler_runnable_targets VALUES ('os:system')")


# -- the command line -------------------------------------------------------------------


def cli(url: str, *args: str) -> tuple[int, str, str]:
    result = run_cli(list(args), {"SCHEDULER_DATABASE_URL": url})
    return result.returncode, result.stdout, result.stderr


async def test_cli_add_show_list_remove(database_url: str) -> None:
    await declare_runnable(database_url, TICK)
    code, out, err = await asyncio.to_thread(
        cli, database_url, "tasks", "add", "feed-7", "--every", "90s", "--target", TICK,
        "--args", '{"feed": 7}', "--jitter", "5s", "--misfire", "skip",
    )  # fmt: skip
    assert code == 0, err
    assert re.fullmatch(r"feed-7: added, next run \S+\n", out), out

    code, out, err = await asyncio.to_thread(
        cli, database_url, "tasks", "add", "feed-7", "--every", "90s", "--target", "os:system"
    )
    assert code == 65
    assert "a schedule named 'feed-7' already exists" in err
    assert len(err.strip().splitlines()) == 1

    code, out, err = await asyncio.to_thread(cli, database_url, "tasks", "show", "feed-7", "--json")
    assert code == 0, err
    shown = json.loads(out)
    assert {k: shown[k] for k in ("name", "source", "target", "args", "misfire", "paused")} == {
        "name": "feed-7", "source": "runtime", "target": TICK, "args": {"feed": 7},
        "misfire": "skip", "paused": False,
    }  # fmt: skip
    assert (shown["every_seconds"], shown["jitter_seconds"]) == (90.0, 5.0)
    assert shown["schedule"] == "every 90s jitter 5s"

    code, out, err = await asyncio.to_thread(cli, database_url, "tasks", "list")
    assert code == 0, err
    assert re.search(rf"^feed-7\s+active\s.*every 90s jitter 5s -> {TICK} \(runtime\)$", out, re.M)

    code, out, err = await asyncio.to_thread(cli, database_url, "tasks", "remove", "feed-7")
    assert (code, out) == (0, "feed-7: removed\n"), err
    code, out, err = await asyncio.to_thread(cli, database_url, "tasks", "show", "feed-7")
    assert code == 65
    assert err.strip() == (
        "scheduler-daemon: no task named 'feed-7' (see `scheduler-daemon tasks list`)"
    )


async def test_cli_lists_tasks_a_page_at_a_time_and_says_how_many(database_url: str) -> None:
    """`tasks list --limit N` prints N tasks in name order and the --after that gives the
    next page; every listing ends with how many tasks there are; --json is one array
    (read and printed a page at a time, LIST_PAGE rows each)."""
    await declare_runnable(database_url, TICK)
    names = [f"page-{i}" for i in range(5)]
    async with client_for(database_url) as client:
        for name in names:
            await client.add_schedule(name, target=TICK, every=3600)

    def run(*args: str) -> str:
        code, out, err = cli(database_url, "tasks", "list", *args)
        assert code == 0, err
        return out

    def listed(out: str) -> list[str]:
        return [line.split()[0] for line in out.splitlines()[1:-1]]

    first = await asyncio.to_thread(run, "--limit", "2")
    assert listed(first) == names[:2]
    assert first.splitlines()[-1] == "2 of 5 tasks; the next: --after page-1"
    second = await asyncio.to_thread(run, "--limit", "2", "--after", "page-1")
    assert listed(second) == names[2:4]
    last = await asyncio.to_thread(run, "--limit", "2", "--after", "page-3")
    assert listed(last) == names[4:]
    assert last.splitlines()[-1] == "1 of 5 tasks"  # no next page
    exact = await asyncio.to_thread(run, "--limit", "5")  # exactly what is left: no next
    assert listed(exact) == names
    assert exact.splitlines()[-1] == "5 tasks"
    everything = await asyncio.to_thread(run)
    assert listed(everything) == names
    assert everything.splitlines()[-1] == "5 tasks"

    as_json = json.loads(await asyncio.to_thread(run, "--json", "--after", "page-2"))
    assert [row["name"] for row in as_json] == names[3:]
    assert json.loads(await asyncio.to_thread(run, "--json", "--after", "page-4")) == []
    assert [row["name"] for row in json.loads(await asyncio.to_thread(run, "--json"))] == names


async def test_cli_refuses_an_undeclared_target(sqlite_url: str) -> None:
    code, out, err = await asyncio.to_thread(
        cli, sqlite_url, "tasks", "add", "x", "--every", "1m", "--target", "subprocess:run"
    )
    assert (code, out) == (65, "")
    assert "target 'subprocess:run' is not runnable" in err
    assert "plugin.runnable" in err


# -- the documented SQL -------------------------------------------------------------------


def documented_sql() -> list[str]:
    """docs/plugins.md, "In plain SQL": the PostgreSQL inserts, the SQLite insert, and the
    statements that operate a schedule (written for PostgreSQL)."""
    text = PLUGINS_DOC.read_text()
    section = text[text.index("### In plain SQL") :]
    section = section[: section.index("\n## ")]
    return re.findall(r"```sql\n(.*?)```", section, flags=re.S)


def statements(block: str) -> list[str]:
    without_comments = re.sub(r"--[^\n]*", "", block)
    return [s.strip() for s in without_comments.split(";") if s.strip()]


async def test_the_documented_sql_works(database_url: str) -> None:
    postgres_inserts, sqlite_insert, operate = documented_sql()
    postgres = database_url.startswith("postgresql")
    await declare_runnable(database_url, "feeds.jobs:refresh", "reports.jobs:weekly")
    for statement in statements(postgres_inserts if postgres else sqlite_insert):
        await Db(database_url).fetch(statement)
    async with client_for(database_url) as client:
        feed = await client.get_schedule("feed-42")
        assert feed is not None
        assert feed.runtime
        assert (feed.args, feed.every_seconds, feed.jitter_seconds) == ({"feed": 42}, 300.0, 30.0)
        assert feed.next_run_at <= datetime.now(UTC)  # due at once
        for statement in statements(operate):
            if not postgres:
                statement = statement.replace("now()", "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')")
            await Db(database_url).fetch(statement)
            if "paused = true" in statement:
                paused = await client.get_schedule("feed-42")
                assert paused is not None
                assert paused.paused
            if "args =" in statement:
                changed = await client.get_schedule("feed-42")
                assert changed is not None
                assert changed.args == {"feed": 43}
                assert not changed.paused
                assert changed.trigger_requested_at is not None
        assert await client.get_schedule("feed-42") is None
        if postgres:
            report = await client.get_schedule("report")
            assert report is not None
            assert report.next_run_at == datetime(2027, 1, 4, 5, tzinfo=UTC)
