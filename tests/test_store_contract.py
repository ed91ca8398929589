"""The loops' store contract, on both backends: the plugin loop's (db/plugin_store.py), the
publish loop's and the webhook outbox's (db/publications.py), the schedule actions
(db/schedules.py); and the leaders' lock store (db/lock_store.py): the leaders row and the
fencing tokens on both, the lock manager's answers on PostgreSQL.

Each typed method against a real database: what the loops rely on, including the rules
the database enforces whatever the leaders think (one run per (name, slot), at most one
running run per schedule: graphile-worker #621 was a batch claim that broke the second).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest
from rig.waiting import until

from scheduler_daemon.client import Client
from scheduler_daemon.config.settings import Settings
from scheduler_daemon.db.base import Store
from scheduler_daemon.db.lock_store import PgLockStore, Predecessor, SqliteLockStore
from scheduler_daemon.db.plugin_store import (
    Claim,
    Declaration,
    DueSchedule,
    PluginStore,
    RunResult,
)
from scheduler_daemon.db.postgres import PostgresStore
from scheduler_daemon.db.publications import PublishStore
from scheduler_daemon.db.schedules import ScheduleStore
from scheduler_daemon.db.sqlfiles import migrations, queries
from scheduler_daemon.db.sqlite import SqliteStore


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[Store]:
    async with Client.connect(Settings(database_url=database_url)) as client:
        yield client.store


async def now_of(store: Store) -> datetime:
    async with store.transaction() as tx:
        return await PluginStore(tx).now()


async def add(store: Store, name: str, next_run_at: datetime, **columns: Any) -> None:
    """A declared task's row (no target), as the leader's declare writes one."""
    async with store.transaction() as tx:
        await tx.run(
            _sql(
                store,
                "INSERT INTO scheduler_plugin_tasks (name, schedule, next_run_at, source) VALUES ($1, 'every 10s', $2, 'config')",
            ),
            name,
            next_run_at,
        )
        for column, value in columns.items():
            await tx.run(
                _sql(store, f"UPDATE scheduler_plugin_tasks SET {column} = $2 WHERE name = $1"),
                name,
                value,
            )


def as_json(store: Store, value: Any) -> Any:
    """A jsonb parameter: asyncpg's codec (the store's) encodes it; SQLite takes text."""
    return value if store.backend == "postgres" else json.dumps(value)


def _sql(store: Store, text: str) -> str:
    return text if store.backend == "postgres" else text.replace("$", "?")


async def rows(store: Store, sql: str, *args: Any) -> list[dict[str, Any]]:
    # The named-query machinery is the store's; a test's own SELECTs go through fetch of a
    # throwaway named query would be overkill: plain statements via the store's tx.run
    # return nothing, so read with the backend's driver through a readonly transaction.
    async with store.transaction(readonly=True) as tx:
        conn = tx.conn  # type: ignore[attr-defined]
        if store.backend == "postgres":
            return [dict(r) for r in await conn.fetch(sql, *args)]
        from scheduler_daemon.db.sqlite import from_db_row, to_db_value

        params = tuple(to_db_value(a) for a in args)
        async with conn.execute(sql.replace("$", "?"), params) as cursor:
            return [from_db_row(r) for r in await cursor.fetchall()]


def test_both_backends_define_the_plugin_queries() -> None:
    plugin = {name for name in queries("postgres") if name.startswith("plugin_")}
    assert plugin == {name for name in queries("sqlite") if name.startswith("plugin_")}
    assert {"plugin_claim", "plugin_finish", "plugin_trim"} <= plugin
    assert "runs_maintain" in queries("postgres")
    assert "runs_maintain" in queries("sqlite")


async def test_due_is_oldest_first_and_limited(store: Store) -> None:
    now = await now_of(store)
    for i in range(6):
        await add(store, f"t{i}", now - timedelta(seconds=60 - i))
    await add(store, "later", now + timedelta(hours=1))
    await add(store, "paused", now - timedelta(hours=1), paused=True)
    async with store.transaction() as tx:
        batch = await PluginStore(tx).due(limit=3)
    assert [s.name for s in batch.due] == ["t0", "t1", "t2"]
    assert batch.oldest_due(batch.now) == batch.due[0].next_run_at
    assert batch.next_slot == now + timedelta(hours=1)
    assert all(s.runtime is None for s in batch.due)


async def test_a_triggered_schedule_is_due_before_its_slot(store: Store) -> None:
    now = await now_of(store)
    await add(store, "yearly", now + timedelta(days=300), trigger_requested_at=now)
    async with store.transaction() as tx:
        batch = await PluginStore(tx).due(limit=10)
    [due] = batch.due
    assert due.name == "yearly"
    assert due.trigger_requested_at == now


async def test_a_claim_that_starts_a_run_compares_the_trigger_it_saw(store: Store) -> None:
    """A trigger that came after the tick's read: a claim that would start a run without
    it does nothing (the next tick sees both); a claim that only skips a slot is not held
    back by it, and leaves it waiting. This, with next_run_at, is what keeps two claims of
    one schedule from both starting a run (a partitioned history has no unique index to)."""
    now = await now_of(store)
    slot = now - timedelta(seconds=5)
    nxt = slot + timedelta(seconds=10)
    await add(store, "t", slot, trigger_requested_at=now)
    await add(store, "s", slot, trigger_requested_at=now)
    async with store.transaction() as tx:
        claimed = (
            await PluginStore(tx).claim(
                "r1",
                [
                    Claim("t", seen_next=slot, next_run_at=nxt, run_slot=slot),
                    Claim("s", seen_next=slot, next_run_at=nxt, skip_slot=slot),
                ],
            )
        ).runs
    assert [(c.name, c.status) for c in claimed] == [("s", "skipped_overlap")]
    tasks = await rows(
        store,
        "SELECT name, next_run_at, trigger_requested_at FROM "
        "scheduler_plugin_tasks WHERE name IN ('s', 't') ORDER BY name",
    )
    assert tasks == [
        {"name": "s", "next_run_at": nxt, "trigger_requested_at": now},
        {"name": "t", "next_run_at": slot, "trigger_requested_at": now},
    ]
    async with store.transaction() as tx:  # read again: the trigger seen, and consumed
        claimed = (
            await PluginStore(tx).claim(
                "r1", [Claim("t", seen_next=slot, next_run_at=nxt, seen_trigger=now, run_slot=slot)]
            )
        ).runs
    assert [(c.name, c.status) for c in claimed] == [("t", "running")]


async def test_claim_is_compare_and_set_and_one_running_run_per_schedule(store: Store) -> None:
    now = await now_of(store)
    slot = now - timedelta(seconds=5)
    await add(store, "a", slot)
    await add(store, "b", slot)
    nxt = slot + timedelta(seconds=10)
    async with store.transaction() as tx:
        claimed = (
            await PluginStore(tx).claim(
                "r1",
                [
                    Claim("a", seen_next=slot, next_run_at=nxt, run_slot=slot),
                    # Read before someone moved it: the claim does nothing for it.
                    Claim("b", seen_next=slot - timedelta(hours=1), next_run_at=nxt, run_slot=slot),
                ],
            )
        ).runs
    assert [(c.name, c.status) for c in claimed] == [("a", "running")]
    # The same schedule again, a new slot, while its first run is still running: the
    # database refuses the second running run (graphile-worker #621), and two claims of
    # one schedule in one batch take one run at most.
    async with store.transaction() as tx:
        again = (
            await PluginStore(tx).claim(
                "r1",
                [Claim("a", seen_next=nxt, next_run_at=nxt + timedelta(seconds=10), run_slot=nxt)],
            )
        ).runs
    assert again == []
    running = await rows(store, "SELECT name FROM scheduler_plugin_runs WHERE status = 'running'")
    assert running == [{"name": "a"}]
    # Nor is the schedule moved past the slot it could not run: it stays due (a slot lost
    # to a run left `running` would be lost silently).
    [task] = await rows(
        store, "SELECT next_run_at, run_count FROM scheduler_plugin_tasks WHERE name = 'a'"
    )
    assert task == {"next_run_at": nxt, "run_count": 1}
    # The slot itself can never be taken twice, even moved back to it by hand.
    async with store.transaction() as tx:
        await PluginStore(tx).finish(
            [RunResult(claimed[0].id, "a", claimed[0].slot, "succeeded", None, now)],
            max_failures=5,
            trim_every=100,
        )
        await tx.run(
            _sql(store, "UPDATE scheduler_plugin_tasks SET next_run_at = $1 WHERE name = 'a'"), slot
        )
    async with store.transaction() as tx:
        twice = (
            await PluginStore(tx).claim(
                "r2", [Claim("a", seen_next=slot, next_run_at=nxt, run_slot=slot)]
            )
        ).runs
    assert twice == []
    assert await rows(store, "SELECT count(*) AS n FROM scheduler_plugin_runs") == [{"n": 1}]


async def test_a_claim_never_advances_a_schedule_before_its_slot(store: Store) -> None:
    """A tick plans from the window an earlier statement read, on its own estimate of the
    database's clock: a claim of a slot not due yet by the database's clock does nothing,
    and the window read with it still holds the schedule, for the next tick."""
    now = await now_of(store)
    soon = now + timedelta(seconds=30)
    await add(store, "early", soon)
    async with store.transaction() as tx:
        result = await PluginStore(tx).claim(
            "r1", [Claim("early", soon, soon + timedelta(seconds=10), run_slot=soon)], ahead=1
        )
    assert result.runs == []
    assert [(d.name, d.next_run_at) for d in result.window.due] == [("early", soon)]
    assert await rows(store, "SELECT count(*) AS n FROM scheduler_plugin_runs") == [{"n": 0}]


async def test_a_run_starts_at_its_claim_not_at_its_transactions_start(store: Store) -> None:
    """A claim in a transaction begun before the slot (a take-over's, a sharded member's):
    the run it inserts started when the claim ran, after its slot, as the clock guard
    decided it (a run recorded as started before its slot would be an early run)."""
    insert = "INSERT INTO scheduler_plugin_tasks (name, schedule, next_run_at, source) VALUES ('s', 'every 10s', $1, 'config')"
    async with store.transaction() as tx:
        began = await PluginStore(tx).now()  # the transaction's start, on both backends
        slot = began + timedelta(milliseconds=300)
        await tx.run(_sql(store, insert), slot)
        past = slot + timedelta(milliseconds=50) - datetime.now(UTC)  # the server's clock
        await asyncio.sleep(max(0.0, past.total_seconds()))
        claimed = await PluginStore(tx).claim(
            "r1", [Claim("s", slot, slot + timedelta(seconds=10), run_slot=slot)]
        )
    assert [r.name for r in claimed.runs] == ["s"]
    [run] = await rows(store, "SELECT started_at FROM scheduler_plugin_runs")
    assert run["started_at"] >= slot > began


async def test_the_window_holds_the_next_ticks_work_and_what_the_claim_changed(
    store: Store,
) -> None:
    """The window read with a claim: what is due, then what falls due within ``ahead`` of
    the next slot to come (not beyond), and each schedule the claim advanced as it is
    after the claim (a tick plans its next claim from it, in one round trip)."""
    now = await now_of(store)
    slot = now - timedelta(seconds=5)
    await add(store, "claimed", slot)
    await add(store, "waiting", slot - timedelta(seconds=1))  # due, not claimed
    await add(store, "next", now + timedelta(seconds=20))
    await add(store, "with-next", now + timedelta(seconds=21))
    await add(store, "beyond", now + timedelta(seconds=40))
    nxt = now + timedelta(hours=1)
    async with store.transaction() as tx:
        result = await PluginStore(tx).claim(
            "r1", [Claim("claimed", slot, nxt, run_slot=slot)], limit=10, ahead=5
        )
    assert [(r.name, r.status) for r in result.runs] == [("claimed", "running")]
    window = result.window
    assert [(d.name, d.next_run_at) for d in window.due] == [
        ("waiting", slot - timedelta(seconds=1)),
        ("next", now + timedelta(seconds=20)),
        ("with-next", now + timedelta(seconds=21)),
        ("claimed", nxt),
    ]
    assert not window.full
    assert window.oldest_due(window.now) == slot - timedelta(seconds=1)
    # As many due as the limit: more may be due than the window holds.
    async with store.transaction() as tx:
        assert (await PluginStore(tx).due(limit=1)).full


async def test_a_claim_compares_the_definition_it_saw(store: Store) -> None:
    """A runtime schedule changed after the window was read (its args): the claim does
    nothing for it, and the window read with that claim carries the new definition. A
    schedule read long before its slot never runs what it no longer says."""
    async with store.transaction() as tx:
        await PluginStore(tx).publish_runnable(["pkg.mod:ok"])
        await tx.run(
            _sql(
                store,
                "INSERT INTO scheduler_plugin_tasks (name, target, every_seconds, args) "
                "VALUES ('r', 'pkg.mod:ok', 5, $1)",
            ),
            as_json(store, {"n": 1}),
        )
    async with store.transaction() as tx:
        [seen] = (await PluginStore(tx).due(limit=10)).due
    async with store.transaction() as tx:
        await tx.run(
            _sql(store, "UPDATE scheduler_plugin_tasks SET args = $1 WHERE name = 'r'"),
            as_json(store, {"n": 2}),
        )

    def claim_of(due: DueSchedule) -> Claim:
        later = due.next_run_at + timedelta(seconds=5)
        return Claim("r", due.next_run_at, later, run_slot=due.next_run_at,
                     seen_definition=due.definition)  # fmt: skip

    async with store.transaction() as tx:
        stale = await PluginStore(tx).claim("r1", [claim_of(seen)])
    assert stale.runs == []
    [fresh] = stale.window.due
    assert fresh.definition != seen.definition
    assert fresh.runtime is not None
    assert json.loads(fresh.runtime.args_json) == {"n": 2}
    async with store.transaction() as tx:
        claimed = await PluginStore(tx).claim("r1", [claim_of(fresh)])
    assert [r.name for r in claimed.runs] == ["r"]


async def test_a_schedule_paused_after_the_read_is_not_claimed(store: Store) -> None:
    now = await now_of(store)
    await add(store, "p", now, paused=True)  # paused between the tick's read and its claim
    async with store.transaction() as tx:
        claimed = (
            await PluginStore(tx).claim(
                "r1", [Claim("p", now, now + timedelta(seconds=10), run_slot=now)]
            )
        ).runs
    assert claimed == []


async def test_trigger_and_skip_slots(store: Store) -> None:
    now = await now_of(store)
    slot = now - timedelta(seconds=5)
    trigger = now - timedelta(seconds=1)
    await add(store, "a", slot, trigger_requested_at=trigger)
    async with store.transaction() as tx:
        claimed = (
            await PluginStore(tx).claim(
                "r1",
                [
                    Claim(
                        "a",
                        slot,
                        slot + timedelta(seconds=10),
                        seen_trigger=trigger,
                        run_slot=slot,
                        skip_slot=trigger,
                    )
                ],
            )
        ).runs
    assert sorted((c.status, c.slot) for c in claimed) == [
        ("running", slot),
        ("skipped_overlap", trigger),
    ]
    [task] = await rows(
        store, "SELECT trigger_requested_at, run_count, last_status FROM scheduler_plugin_tasks"
    )
    assert task["trigger_requested_at"] is None
    assert (task["run_count"], task["last_status"]) == (1, "running")


async def test_finish_counts_failures_pauses_and_trims(store: Store) -> None:
    now = await now_of(store)
    await add(store, "f", now - timedelta(minutes=10))
    slots = [now - timedelta(minutes=10) + timedelta(seconds=i) for i in range(5)]
    due: list[list[str]] = []  # after each result: the schedules marked due a trim
    for i, slot in enumerate(slots):
        async with store.transaction() as tx:
            plugin = PluginStore(tx)
            [run] = (
                await plugin.claim(
                    "r1", [Claim("f", slot, slots[i + 1] if i < 4 else now, run_slot=slot)]
                )
            ).runs
            finished = await plugin.finish(
                [RunResult(run.id, "f", slot, "failed", "boom\x00" if i == 0 else "boom", now)],
                max_failures=3,
                trim_every=2,
            )
            due.append(await plugin.trims_due(limit=10))
        assert finished[0].consecutive_failures == i + 1
        assert finished[0].paused == (i + 1 >= 3)
        assert finished[0].run_count == i + 1
        async with store.transaction() as tx:  # a paused schedule is claimed no more
            await tx.run("UPDATE scheduler_plugin_tasks SET paused = false")
    # Marked due a trim within its first 2 runs (at its phase), and so until trimmed.
    assert due[1] == due[2] == due[3] == due[4] == ["f"], due
    async with store.transaction() as tx:
        plugin = PluginStore(tx)
        assert await plugin.trim(["f"], keep=2) == 3
        await plugin.trims_done(["f"])
        assert await plugin.trims_due(limit=10) == []
    kept = await rows(store, "SELECT slot FROM scheduler_plugin_runs ORDER BY slot")
    assert [r["slot"] for r in kept] == slots[-2:]


async def test_abandon_keeps_the_callers_own_runs(store: Store) -> None:
    now = await now_of(store)
    await add(store, "x", now)
    await add(store, "y", now)
    async with store.transaction() as tx:
        claimed = (
            await PluginStore(tx).claim(
                "r1", [Claim(n, now, now + timedelta(seconds=10), run_slot=now) for n in ("x", "y")]
            )
        ).runs
    mine = [c.id for c in claimed if c.name == "x"]
    async with store.transaction() as tx:
        abandoned = await PluginStore(tx).abandon("gone", mine)
    assert [(a.name, a.instance) for a in abandoned] == [("y", "r1")]


async def test_declare_registers_reschedules_retires_and_leaves_runtime_rows(store: Store) -> None:
    now = await now_of(store)
    first = now + timedelta(seconds=30)
    async with store.transaction() as tx:
        plugin = PluginStore(tx)
        await plugin.publish_runnable(["pkg.mod:fn"])
        changes = await plugin.declare(
            [
                Declaration("keep", "every 10s", first, "config"),
                Declaration("go", "every 10s", first, "config"),
            ]
        )
    assert sorted((c.change, c.name) for c in changes) == [
        ("registered", "go"),
        ("registered", "keep"),
    ]
    async with store.transaction() as tx:
        await tx.run(
            _sql(
                store,
                "INSERT INTO scheduler_plugin_tasks (name, target, every_seconds) VALUES ($1, $2, 5)",
            ),
            "runtime-1",
            "pkg.mod:fn",
        )
    later = now + timedelta(hours=1)
    async with store.transaction() as tx:
        changes = await PluginStore(tx).declare(
            [
                Declaration("keep", "every 20s", later, "config"),
                Declaration("runtime-1", "every 1s", later, "config"),
            ]
        )
    assert sorted((c.change, c.name) for c in changes) == [
        ("rescheduled", "keep"), ("retired", "go"), ("shadowed", "runtime-1"),
    ]  # fmt: skip
    state = {
        r["name"]: r
        for r in await rows(
            store, "SELECT name, next_run_at, active, target FROM scheduler_plugin_tasks"
        )
    }
    assert state["keep"]["next_run_at"] == later
    assert not state["go"]["active"]
    assert state["runtime-1"]["target"] == "pkg.mod:fn"
    assert state["runtime-1"]["active"]


async def test_runtime_rows_name_only_runnable_targets(store: Store) -> None:
    async with store.transaction() as tx:
        await PluginStore(tx).publish_runnable(["pkg.mod:ok"])
    insert = _sql(
        store,
        "INSERT INTO scheduler_plugin_tasks (name, target, every_seconds, args) VALUES ($1, $2, 5, $3)",
    )
    with pytest.raises(Exception, match="scheduler_plugin_tasks_target_check"):
        async with store.transaction() as tx:
            await tx.run(insert, "evil", "os:system", as_json(store, {"command": "id"}))
    async with store.transaction() as tx:
        await tx.run(insert, "good", "pkg.mod:ok", as_json(store, {"n": 1}))
    with pytest.raises(Exception, match="scheduler_plugin_tasks_target_check"):
        async with store.transaction() as tx:
            await tx.run(
                _sql(store, "UPDATE scheduler_plugin_tasks SET target = $1 WHERE name = 'good'"),
                "os:system",
            )
    async with store.transaction() as tx:
        batch = await PluginStore(tx).due(limit=10)
    [good] = batch.due  # next_run_at defaults to now: due at once
    assert good.runtime is not None
    assert (good.runtime.target, json.loads(good.runtime.args_json)) == ("pkg.mod:ok", {"n": 1})
    assert good.runtime.every_seconds == 5
    # And a row that breaks the runtime rules is refused by the database too.
    with pytest.raises(Exception, match="scheduler_plugin_tasks_runtime_check"):
        async with store.transaction() as tx:
            await tx.run(
                _sql(
                    store,
                    "INSERT INTO scheduler_plugin_tasks (name, target, every_seconds, cron) VALUES ('both', $1, 5, '* * * * *')",
                ),
                "pkg.mod:ok",
            )


async def test_refuse_pauses_with_the_reason(store: Store) -> None:
    now = await now_of(store)
    await add(store, "r", now)
    async with store.transaction() as tx:
        await PluginStore(tx).refuse({"r": "target 'x:y' is not runnable on this replica"})
    [row] = await rows(store, "SELECT paused, last_status, last_error FROM scheduler_plugin_tasks")
    assert bool(row["paused"])
    assert row["last_status"] == "failed"
    assert "not runnable" in row["last_error"]


async def test_a_refusal_is_of_the_schedule_as_it_was_read(store: Store) -> None:
    """A tick plans from a window an earlier statement read: a runtime schedule refused
    on what it said then, but fixed since (here its target, now a runnable one), is not
    paused; one still as it was read is."""
    async with store.transaction() as tx:
        await PluginStore(tx).publish_runnable(["pkg.mod:ok", "pkg.mod:also"])
        for name in ("fixed", "broken"):
            await tx.run(
                _sql(
                    store,
                    "INSERT INTO scheduler_plugin_tasks (name, target, every_seconds) "
                    "VALUES ($1, 'pkg.mod:ok', 5)",
                ),
                name,
            )
    async with store.transaction() as tx:
        seen = {due.name: due for due in (await PluginStore(tx).due(limit=10)).due}
    async with store.transaction() as tx:
        await tx.run(
            _sql(store, "UPDATE scheduler_plugin_tasks SET target = $1 WHERE name = 'fixed'"),
            "pkg.mod:also",
        )
    async with store.transaction() as tx:
        await PluginStore(tx).refuse({"fixed": "no", "broken": "no"}, seen)
    state = await rows(store, "SELECT name, paused FROM scheduler_plugin_tasks ORDER BY name")
    assert [(r["name"], bool(r["paused"])) for r in state] == [("broken", True), ("fixed", False)]


async def test_a_sharded_scope_keeps_to_its_shards_while_their_tokens_are_current(
    pg_url: str,
) -> None:
    """Sharded leadership's per-statement fencing (db/postgres.sql): a transaction scoped to
    shards reads and claims their schedules only, and a shard whose token is no longer
    its current one (a new owner drew another) gets nothing claimed, recorded or
    abandoned, whatever the connection holds."""
    from scheduler_daemon.db.base import ShardScope

    async with Client.connect(Settings(database_url=pg_url)) as client:
        store = client.store
        now = await now_of(store)
        for i in range(40):
            await add(store, f"s{i}", now - timedelta(seconds=5))
        found = await rows(
            store, "SELECT name, shard_hash % 4 AS shard FROM scheduler_plugin_tasks"
        )
        shard_of = {row["name"]: row["shard"] for row in found if row["name"].startswith("s")}
        assert set(shard_of.values()) == {0, 1, 2, 3}, "40 names fall into every shard"
        async with store.transaction() as tx:
            for shard, token in ((0, 10), (1, 20), (2, 30), (3, 40)):
                await tx.run(
                    "INSERT INTO scheduler_fencing (loop, token, instance, epoch) "
                    "VALUES ($1, $2, 'test', 0)",
                    f"plugin/{shard}",
                    token,
                )

        async with store.transaction() as tx:

            def scoped(tokens: dict[int, int]) -> PluginStore:
                tx.shards = ShardScope(4, tokens)
                return PluginStore(tx)

            due = await scoped({0: 10, 1: 20}).due(100)
            assert {d.name for d in due.due} == {n for n, s in shard_of.items() if s in (0, 1)}
            assert all(d.shard == shard_of[d.name] for d in due.due)
            # Shard 1's token is 21 now: another owner took it.
            await tx.run("UPDATE scheduler_fencing SET token = 21 WHERE loop = 'plugin/1'")
            claims = [
                Claim(d.name, d.next_run_at, now + timedelta(hours=1), run_slot=d.next_run_at)
                for d in due.due
            ]
            claimed = (await scoped({0: 10, 1: 20}).claim("me", claims)).runs
            assert claimed, "shard 0 claims"
            assert {c.name for c in claimed} == {n for n, s in shard_of.items() if s == 0}
            results = [RunResult(c.id, c.name, c.slot, "succeeded", None, now) for c in claimed]
            assert await scoped({0: 11}).finish(results, 5, 100) == [], "shard 0's token is 10"
            assert await scoped({0: 11}).abandon("gone", []) == []
            assert len(await scoped({0: 10}).finish(results, 5, 100)) == len(results)


# -- the publish loop's store (db/publications.py) ------------------------------------------


async def publications(store: Store, *seconds_from_now: float) -> list[int]:
    """Rows scheduled ``seconds`` from the database's now (negative: due), in order."""
    now = await now_of(store)
    ids = []
    for seconds in seconds_from_now:
        result = await store.schedule(now + timedelta(seconds=seconds), '{"n": 1}', None)
        ids.append(result.publication.id)
    return ids


def test_both_backends_define_the_publish_queries() -> None:
    names = {
        "publish_due", "publish_due_ids", "publish_one", "publication_fail", "next_due_in",
        "publication_retry", "purge_publications", "outbox_add", "outbox_due",
        "outbox_next_in", "outbox_delivered", "outbox_retry", "outbox_failed",
        "publication_undelivered",
    }  # fmt: skip
    assert names <= set(queries("postgres"))
    assert names <= set(queries("sqlite"))


async def test_take_due_flips_the_oldest_due_rows_up_to_the_limit(store: Store) -> None:
    late, early, later, future = await publications(store, -5, -10, -1, 60)
    async with store.transaction() as tx:
        taken = await PublishStore(tx).take_due(limit=2, instance="me")
        upcoming = await PublishStore(tx).next_due()
    assert [row.id for row in taken] == [early, late], "publish_at order, at most the limit"
    assert all(row.published_at >= row.publish_at for row in taken)
    assert taken[0].payload == {"n": 1}
    assert upcoming.seconds is not None
    assert upcoming.seconds < 0, "`later` is still due"
    found = {
        row["id"]: row
        for row in await rows(store, "SELECT id, status, published_by, attempts FROM scheduler_publications")
    }  # fmt: skip
    assert {i: found[i]["status"] for i in (early, late, later, future)} == {
        early: "published", late: "published", later: "scheduled", future: "scheduled",
    }  # fmt: skip
    assert (found[early]["published_by"], found[early]["attempts"]) == ("me", 1)
    async with store.transaction() as tx:
        assert [r.id for r in await PublishStore(tx).take_due(limit=10, instance="me")] == [later]
        upcoming = await PublishStore(tx).next_due()
    assert upcoming.seconds is not None
    assert 50 < upcoming.seconds <= 60.001, "`future` next (julianday rounding)"
    async with store.transaction() as tx:
        await PublishStore(tx).take_due(limit=10, instance="me")  # nothing due
        assert await PublishStore(tx).take_due(limit=10, instance="me") == []


async def test_row_by_row_takes_each_and_fail_records_why(store: Store) -> None:
    first, second = await publications(store, -2, -1)
    async with store.transaction() as tx:
        publish = PublishStore(tx)
        assert await publish.due_ids(limit=10) == [first, second]
        one = await publish.take_one(id=first, instance="me")
        assert one is not None
        assert one.id == first
        assert await publish.take_one(id=first, instance="me") is None, "no longer scheduled"
        await publish.fail(id=second, error="unreadable row: boom")
    found = await rows(
        store, "SELECT status, published_at, last_error FROM scheduler_publications WHERE id = $1",
        second,
    )  # fmt: skip
    assert found == [
        {"status": "failed", "published_at": None, "last_error": "unreadable row: boom"}
    ]
    async with store.transaction() as tx:
        assert await PublishStore(tx).retry_failed(id=second)
        assert not await PublishStore(tx).retry_failed(id=first), "published, not failed"
        [again] = await PublishStore(tx).take_due(limit=10, instance="me")
    assert again.id == second, "retried: due again"


async def test_the_webhook_outbox_owes_retries_and_gives_up(store: Store) -> None:
    [publication] = await publications(store, -1)
    async with store.transaction() as tx:
        publish = PublishStore(tx)
        assert await publish.next_webhook_in() is None, "nothing owed"
        await publish.take_due(limit=1, instance="me")
        await publish.owe_webhooks([publication])
        await publish.owe_webhooks([publication])  # owed once
        [owed] = await publish.webhooks_due(limit=10)
    assert (owed.publication.id, owed.attempts, owed.publication.payload) == (
        publication,
        0,
        {"n": 1},
    )
    async with store.transaction() as tx:
        await PublishStore(tx).webhook_retry(id=publication, delay=30, error="HTTP 500")
        assert await PublishStore(tx).webhooks_due(limit=10) == [], "not due for 30 s"
        seconds = await PublishStore(tx).next_webhook_in()
    assert seconds is not None
    # SQLite subtracts julianday() doubles: tens of microseconds of rounding either way.
    assert 25 < seconds <= 30.001
    due_again = await now_of(store) - timedelta(seconds=1)
    async with store.transaction() as tx:
        sql = _sql(store, "UPDATE scheduler_webhook_outbox SET next_attempt_at = $1")
        await tx.run(sql, due_again)
        [owed] = await PublishStore(tx).webhooks_due(limit=10)
        assert owed.attempts == 1
        await PublishStore(tx).webhook_gave_up(id=publication, error="HTTP 500")
    [outbox] = await rows(
        store, "SELECT status, attempts, last_error FROM scheduler_webhook_outbox"
    )
    assert outbox == {"status": "failed", "attempts": 2, "last_error": "HTTP 500"}
    [row] = await rows(store, "SELECT status, last_error FROM scheduler_publications")
    assert row == {"status": "failed", "last_error": "webhook: HTTP 500"}


async def test_a_delivered_webhook_is_owed_no_more(store: Store) -> None:
    [publication] = await publications(store, -1)
    async with store.transaction() as tx:
        await PublishStore(tx).take_due(limit=1, instance="me")
        await PublishStore(tx).owe_webhooks([publication])
        await PublishStore(tx).webhook_delivered(id=publication)
        assert await PublishStore(tx).webhooks_due(limit=10) == []
        assert await PublishStore(tx).next_webhook_in() is None
    [outbox] = await rows(store, "SELECT status, attempts FROM scheduler_webhook_outbox")
    assert outbox == {"status": "delivered", "attempts": 1}


async def test_purge_deletes_finished_rows_past_retention_only(store: Store) -> None:
    old_done, old_waiting, new_done = await publications(store, -7200, -7100, -10)
    async with store.transaction() as tx:
        for publication in (old_done, new_done):
            await PublishStore(tx).take_one(id=publication, instance="me")
        assert await PublishStore(tx).purge(older_than=3600, limit=10) == 1
    left = {row["id"] for row in await rows(store, "SELECT id FROM scheduler_publications")}
    assert left == {old_waiting, new_done}, "a scheduled row is never purged"


async def test_pause_resume_and_trigger_name_a_schedule_or_say_none(store: Store) -> None:
    await add(store, "t", await now_of(store), consecutive_failures=3)
    async with store.transaction() as tx:
        schedules = ScheduleStore(tx)
        assert await schedules.pause("t")
        assert not await schedules.pause("nope")
        assert (await schedules.get("t")).paused  # type: ignore[union-attr]
        assert await schedules.resume("t")
        assert not await schedules.resume("nope")
        assert await schedules.trigger("t")
        assert not await schedules.trigger("nope")
        record = await schedules.get("t")
    assert record is not None
    assert not record.paused
    assert record.consecutive_failures == 0, "resumed: its failures in a row forgotten"
    assert record.trigger_requested_at is not None


async def test_take_due_skips_rows_another_transaction_holds(pg_url: str) -> None:
    """PostgreSQL: a row locked by another transaction is passed over, not waited for, and
    next_due says so (the caller looks again soon)."""
    async with Client.connect(Settings(database_url=pg_url)) as client:
        store = client.store
        first, second = await publications(store, -2, -1)
        async with store.transaction() as holder:
            await holder.run("SELECT 1 FROM scheduler_publications WHERE id = $1 FOR UPDATE", first)
            async with store.transaction() as tx:
                taken = await PublishStore(tx).take_due(limit=10, instance="me")
                upcoming = await PublishStore(tx).next_due()
        assert [row.id for row in taken] == [second]
        assert upcoming.skipped


# -- the leaders' lock store (db/lock_store.py) ---------------------------------------------

LOOP, KEY = "plugin", 0x5C4ED


@asynccontextmanager
async def lock_store(store: Store) -> AsyncIterator[PgLockStore | SqliteLockStore]:
    """A guard's statements on a connection of its own: a PostgreSQL session outside the
    pool (no transaction: each statement commits), or a SQLite write transaction."""
    if isinstance(store, PostgresStore):
        conn = await store.connect_dedicated("lock:test")
        try:
            yield PgLockStore(conn)
        finally:
            await conn.close()
        return
    assert isinstance(store, SqliteStore)
    async with store.write_transaction() as conn:
        yield SqliteLockStore(conn)


async def test_a_leader_claims_its_row_reads_it_back_and_only_it_releases_it(
    store: Store,
) -> None:
    newest = migrations(store.backend)[-1].version
    async with lock_store(store) as locks:
        assert await locks.schema_version() == newest
        nobody = Predecessor(schema_version=newest, instance=None, hostname=None, pid=None)
        assert await locks.predecessor(LOOP, KEY) == nobody
        first = await locks.draw_token(LOOP, "a")
        await locks.claim_leadership(
            LOOP, KEY, instance="a", hostname="host-a", pid=7, token=first.token
        )
        assert await locks.predecessor(LOOP, KEY) == Predecessor(newest, "a", "host-a", 7)
        assert await locks.predecessor(LOOP, KEY + 1) == nobody, "a row per loop and key"
        # The next leader claims the same row: it is the next one's predecessor now.
        second = await locks.draw_token(LOOP, "b")
        claimed = await locks.claim_leadership(
            LOOP, KEY, instance="b", hostname="host-b", pid=8, token=second.token
        )
        assert await locks.predecessor(LOOP, KEY) == Predecessor(newest, "b", "host-b", 8)
        if isinstance(locks, PgLockStore):
            assert isinstance(store, PostgresStore)
            assert claimed is not None
            assert claimed.backend_pid == await locks.backend_pid(), "the lock session's"
            # Known by its lock session: another session's release leaves the row.
            await PgLockStore(store.pool).release_leadership(LOOP, KEY)
            kept = await locks.predecessor(LOOP, KEY)
            await locks.release_leadership(LOOP, KEY)
        else:
            assert claimed is None
            # Known by its instance and process: the leader before's release leaves it.
            await locks.release_leadership(LOOP, KEY, instance="a", pid=7)
            kept = await locks.predecessor(LOOP, KEY)
            await locks.release_leadership(LOOP, KEY, instance="b", pid=8)
        assert kept.instance == "b"
        assert await locks.predecessor(LOOP, KEY) == nobody, "handed over: nobody to wait for"


async def test_fencing_tokens_grow_with_every_draw_each_loop_its_own(store: Store) -> None:
    async with lock_store(store) as locks:
        first = await locks.draw_token(LOOP, "a")
        second = await locks.draw_token(LOOP, "b")
        await locks.draw_token("publish", "b")  # another loop's row
        third = await locks.draw_token(LOOP, "c")
    assert first.token < second.token < third.token
    assert (second.previous, third.previous) == (first.token, second.token)


async def test_lock_held_and_lock_entry_tell_the_holder_a_waiter_and_neither(
    pg_url: str,
) -> None:
    """PostgreSQL: the session guard's proof (lock_held, asked by the session itself) and
    the lock manager's entry for another backend (lock_entry: held, waiting, neither)."""
    first, second = [await asyncpg.connect(pg_url) for _ in range(2)]
    try:
        holder, waiter = PgLockStore(first), PgLockStore(second)
        holder_pid, waiter_pid = await holder.backend_pid(), await waiter.backend_pid()
        assert not await holder.holds(KEY)
        assert await waiter.lock_entry(KEY, holder_pid) is None, "neither holds nor waits"
        assert await holder.try_lock(KEY)
        assert await holder.holds(KEY)
        assert await waiter.lock_entry(KEY, holder_pid) is True
        assert not await waiter.holds(KEY), "held, by another session"
        assert not await waiter.try_lock(KEY)
        waiting = asyncio.ensure_future(waiter.wait_for_lock(KEY, slice_ms=100))

        async def queued() -> bool:
            return await holder.lock_entry(KEY, waiter_pid) is False

        await until(queued, "the waiter queued for the lock", within=5, every=0.01)
        await holder.unlock(KEY)
        await asyncio.wait_for(waiting, 5)  # granted the moment the holder let go
        assert await waiter.holds(KEY)
        assert await holder.lock_entry(KEY, waiter_pid) is True
        assert not await holder.holds(KEY)
    finally:
        for conn in (first, second):
            conn.terminate()


async def test_a_transaction_competes_for_the_lock_for_as_long_as_it_lasts(pg_url: str) -> None:
    """PostgreSQL, transaction mode: the lock, this backend and the schema version in one
    statement; the lock ends with the transaction."""
    first, second = [await asyncpg.connect(pg_url) for _ in range(2)]
    try:
        one, other = PgLockStore(first), PgLockStore(second)
        async with first.transaction():
            won = await one.compete(KEY)
            assert won.won
            assert won.backend_pid == await one.backend_pid()
            assert won.schema_version == migrations("postgres")[-1].version
            async with second.transaction():
                assert not (await other.compete(KEY)).won
        async with second.transaction():
            assert (await other.compete(KEY)).won, "committed: the lock went with it"
    finally:
        for conn in (first, second):
            conn.terminate()
