"""The hot tables stay vacuumable: nothing the daemon leaves open holds back the database's
xmin horizon (issue 30).

A statement that waits holds its snapshot; a standby waiting for the loop's lock in one
`SELECT pg_advisory_lock(...)` held it for as long as it stood by, and no VACUUM could
remove a row version that died meanwhile: 10,000 schedules bloated their table fivefold
in five minutes. Each case runs real replicas, makes dead row versions once the standby
(or a sharded member's watch) waits, and asks VACUUM whether it can remove them.
"""

from __future__ import annotations

import asyncio
import re

import asyncpg
from rig.databases import RIG_APP, run_sync
from rig.processes import Daemons, start_replicas
from rig.sql import execute, fetch
from rig.ticks import FAST_TIMINGS, PLUGIN_ONLY
from rig.waiting import until, wait_until

# Well past the daemon's wait slice (LOCK_WAIT_SLICE_MS, 1 s): generous for a busy machine.
REMOVABLE_WITHIN = 30.0
NOT_YET = re.compile(r"(\d+) are dead but not yet removable")


def churn(dsn: str) -> None:
    """Dead row versions, made now: a row of a table of the test's own, updated 20 times."""
    execute(
        dsn,
        "CREATE TABLE IF NOT EXISTS rig_churn (x int)",
        "INSERT INTO rig_churn VALUES (0)",
        *["UPDATE rig_churn SET x = x + 1"] * 20,
    )


async def not_yet_removable(dsn: str) -> int:
    """VACUUM's own count of the dead versions it had to leave (someone's snapshot may
    still see them)."""
    conn = await asyncpg.connect(dsn, server_settings=RIG_APP)
    notices: list[str] = []
    conn.add_log_listener(lambda _conn, message: notices.append(message.message))
    try:
        await conn.execute("VACUUM (VERBOSE) rig_churn")
    finally:
        await conn.close()
    counts = [int(m.group(1)) for text in notices for m in NOT_YET.finditer(text)]
    assert counts, f"VACUUM VERBOSE said nothing of dead rows: {notices}"
    return sum(counts)


def waiting_sessions(dsn: str, like: str) -> int:
    rows = fetch(
        dsn,
        "SELECT count(*) AS n FROM pg_stat_activity "
        "WHERE application_name LIKE $1 AND wait_event_type = 'Lock'",
        like,
    )
    return int(rows[0]["n"])


def replica_env(url: str, instance: str, **extra: str) -> dict[str, str]:
    return {
        "SCHEDULER_DATABASE_URL": url,
        "SCHEDULER_INSTANCE_ID": instance,
        **FAST_TIMINGS,
        **extra,
    }


def assert_vacuum_removes_what_dies_now(dsn: str) -> None:
    churn(dsn)
    left: list[int] = []

    def removable() -> bool:
        left.append(run_sync(not_yet_removable(dsn)))
        return left[-1] == 0

    wait_until(removable, REMOVABLE_WITHIN, "VACUUM to remove the dead row versions", every=0.5)


def test_a_waiting_standby_does_not_hold_back_vacuum(pg_url: str, daemons: Daemons) -> None:
    start_replicas(
        daemons, [(n, replica_env(pg_url, n)) for n in ("v1", "v2")], PLUGIN_ONLY, leader_first=True
    )
    wait_until(lambda: waiting_sessions(pg_url, "%/lock:plugin") == 1, 20, "the standby to wait")
    assert_vacuum_removes_what_dies_now(pg_url)


def test_a_sharded_members_watch_does_not_hold_back_vacuum(pg_url: str, daemons: Daemons) -> None:
    envs = [(n, replica_env(pg_url, n, SCHEDULER_PLUGIN__SHARDS="4")) for n in ("w1", "w2")]
    start_replicas(daemons, envs, PLUGIN_ONLY)
    wait_until(
        lambda: waiting_sessions(pg_url, "%/watch:plugin") == 2,
        30,
        "each member to watch the other",
    )
    assert_vacuum_removes_what_dies_now(pg_url)


def test_vacuum_is_held_back_by_a_plain_advisory_wait(pg_url: str) -> None:
    """The measuring stick of the two tests above: a session waiting in one
    `SELECT pg_advisory_lock` does hold the horizon (so their VACUUM can tell)."""

    async def scenario() -> int:
        holder = await asyncpg.connect(pg_url, server_settings=RIG_APP)
        waiter = await asyncpg.connect(pg_url, server_settings=RIG_APP)
        try:
            await holder.execute("SELECT pg_advisory_lock(7301)")
            waiting = asyncio.ensure_future(waiter.execute("SELECT pg_advisory_lock(7301)"))
            await until(
                lambda: holder.fetchval(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                ),
                "the plain wait to queue",
            )
            await asyncio.to_thread(churn, pg_url)
            await asyncio.sleep(1.5)  # past a slice: the daemon's wait would have let go
            left = await not_yet_removable(pg_url)
            await holder.execute("SELECT pg_advisory_unlock(7301)")
            await waiting
            return left
        finally:
            await holder.close()
            await waiter.close()

    assert run_sync(scenario()) > 0
