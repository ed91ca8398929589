"""What an idle cluster asks of the database, read off the server's own statement log.

Three real replicas with nothing due: each standby waits in one statement and sends
nothing else; the leader, with no work running, sends one read-only proof per
`lock.quiet_proof_interval` on its lock connection and nothing through its pool; the server logs no ERROR. An idle plugin
leader sleeps until its next slot, and `tasks trigger` / `tasks resume` still wake it at
once (a NOTIFY from the tasks table). Commit rates are the benchmark's business
(bench/idle.py); here each statement is accounted for.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from rig.databases import PgServer, run_sync
from rig.processes import Daemons, run_cli
from rig.sql import afetch, execute
from rig.ticks import (
    FAST_TIMINGS,
    PLUGIN_ONLY,
    event_time,
    first_leader,
    stop_all,
    wait_for_event,
)

pytestmark = [pytest.mark.postgres, pytest.mark.processes]

HEARTBEAT = float(FAST_TIMINGS["SCHEDULER_LOCK__HEARTBEAT_INTERVAL"])
# With no work running, the leader proves at this pace (1 s here), not every heartbeat.
QUIET = max(HEARTBEAT, float(FAST_TIMINGS["SCHEDULER_LOCK__STALL_TIMEOUT"]) / 3)
# A task whose next slot is a year away: an idle plugin loop.
FAR_TASK = [{"name": "yearly", "cron": "0 0 1 1 *", "sql": "SELECT 1"}]
# "2026-12-01 15:41:42.321 UTC [13380] scheduler-daemon/r2/lock:publish: LOG:  execute …"
LOG_LINE = re.compile(r"^\S+ \S+ \S+ \[\d+\] (?P<app>\S*): (?P<level>[A-Z]+):  (?P<text>.*)")


@pytest.fixture
def logged_url(pg_server: PgServer, pg_url: str) -> tuple[str, Path]:
    """pg_url, with every statement of its sessions in the throwaway cluster's log."""
    if pg_server.cluster is None:
        pytest.skip("reads the server log: needs the throwaway cluster")
    name = pg_url.rsplit("/", 1)[1]
    execute(pg_server.admin_dsn, f"ALTER DATABASE \"{name}\" SET log_statement = 'all'")
    return pg_url, pg_server.cluster.log_path


def server_log_since(path: Path, offset: int, apps: str) -> list[re.Match[str]]:
    """The log lines since byte `offset` of sessions whose application_name contains
    `apps` (a marker in the test's instance ids)."""
    with path.open("rb") as log:
        log.seek(offset)
        text = log.read().decode(errors="replace")
    lines = (LOG_LINE.match(line) for line in text.splitlines())
    return [line for line in lines if line is not None and apps in line["app"]]


def replica_env(url: str, instance: str, **extra: str) -> dict[str, str]:
    return {
        "SCHEDULER_DATABASE_URL": url,
        "SCHEDULER_INSTANCE_ID": instance,
        **FAST_TIMINGS,
        "SCHEDULER_PLUGIN__TASKS": json.dumps(FAR_TASK),
        **extra,
    }


def test_idle_standbys_send_nothing_and_the_quiet_leader_proves_at_its_pace(
    logged_url: tuple[str, Path], daemons: Daemons
) -> None:
    url, log_path = logged_url
    replicas = [
        daemons.start(replica_env(url, f"idlecost-{n}"), PLUGIN_ONLY, name=f"idlecost-{n}")
        for n in range(3)
    ]
    leader = first_leader(replicas)
    for replica in replicas:
        wait_for_event(replica, "leader.waiting" if replica is not leader else "leader.acquired")
    time.sleep(2.0)  # the leader's first ticks and its takeover bookkeeping are over
    offset = log_path.stat().st_size
    window = 8 * HEARTBEAT
    time.sleep(window)
    lines = server_log_since(log_path, offset, "idlecost-")
    stop_all(replicas)

    statements = Counter(line["app"] for line in lines if line["level"] == "LOG")
    problems = [line[0] for line in lines if line["level"] in ("ERROR", "FATAL", "WARNING")]
    assert not problems, problems
    leader_lock = f"scheduler-daemon/{leader.name}/lock:plugin"
    # Every statement in the window is the leader's heartbeat on its lock connection; at
    # most one plugin tick (a fenced transaction, proving the lock too) may fall in it.
    others = {app: n for app, n in statements.items() if app != leader_lock}
    assert others == {}, f"only the leader's lock session may talk: {statements}"
    proofs = [line for line in lines if "this session still holds the key" in line["text"]]
    # Quiet proofs only (4 in the window), not one per heartbeat_interval (8); one more
    # if a tick fell in the window (it starts on a fresh proof).
    assert window / QUIET - 2 <= len(proofs) <= window / QUIET + 1, statements


def test_an_idle_plugin_leader_sleeps_until_its_slot_yet_hears_trigger_and_resume(
    logged_url: tuple[str, Path], daemons: Daemons
) -> None:
    """plugin.interval 30 s: a leader that polled would start a triggered run up to
    30 s (and, sleeping until its yearly slot, up to a minute) late."""
    url = logged_url[0]
    env = replica_env(
        url, "wakeup-1", SCHEDULER_PLUGIN__INTERVAL="30s", SCHEDULER_LOG__LEVEL="debug"
    )
    leader = daemons.start(env, PLUGIN_ONLY, name="wakeup-1")
    acquired = wait_for_event(leader, "leader.acquired", loop="plugin")
    # Its first tick done, the leader sleeps until its next slot (or 30 s).
    wait_for_event(leader, "tick.done", after=event_time(acquired), loop="plugin")
    runs = [e for e in leader.log_events() if e.get("event") == "task.started"]
    assert [e for e in runs if e.get("task") == "yearly"] == []

    cli_env = {"SCHEDULER_DATABASE_URL": url}
    asked = time.time()
    assert run_cli(["tasks", "trigger", "yearly"], cli_env).returncode == 0
    started = wait_for_event(leader, "task.started", after=asked, timeout=10, task="yearly")
    print(f"\ntrigger -> run started {(event_time(started) - asked) * 1000:.0f} ms")

    assert run_cli(["tasks", "pause", "yearly"], cli_env).returncode == 0
    assert run_cli(["tasks", "trigger", "yearly"], cli_env).returncode == 0
    time.sleep(1.0)  # paused: the trigger waits
    asked = time.time()
    assert run_cli(["tasks", "resume", "yearly"], cli_env).returncode == 0
    resumed = wait_for_event(leader, "task.started", after=asked, timeout=10, task="yearly")
    print(
        f"resume of a triggered task -> run started {(event_time(resumed) - asked) * 1000:.0f} ms"
    )
    stop_all([leader])


def test_a_lost_listen_connection_is_reopened_and_wake_ups_still_arrive(
    logged_url: tuple[str, Path], daemons: Daemons
) -> None:
    """publish.interval 30 s: the leader trusts its LISTEN connection to wake it. When that
    connection is terminated, the leader looks at once, reopens it, and a row scheduled
    1 s ahead afterwards is still published on time (not up to a minute late)."""
    url = logged_url[0]
    env = {
        "SCHEDULER_DATABASE_URL": url,
        "SCHEDULER_INSTANCE_ID": "relisten-1",
        **FAST_TIMINGS,
        "SCHEDULER_PUBLISH__INTERVAL": "30s",
    }
    leader = daemons.start(env, ("run", "--only", "publish"), name="relisten-1")
    wait_for_event(leader, "leader.acquired", loop="publish")
    listener = "scheduler-daemon/relisten-1/listen"
    # The connection is there before the leader subscribes (a standby holds it): wait for
    # the LISTEN itself, so that what is terminated is a connection the leader trusts.
    listening = (
        f"SELECT pid FROM pg_stat_activity WHERE application_name = '{listener}' "
        "AND query LIKE 'LISTEN%'"
    )
    wait_until_listening = time.monotonic() + 10
    while not run_sync(afetch(url, listening)):
        assert time.monotonic() < wait_until_listening, "no LISTEN on its connection"
        time.sleep(0.05)
    run_sync(afetch(url, f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                       f"WHERE application_name = '{listener}'"))  # fmt: skip
    reopened = time.monotonic() + 10
    while not run_sync(_backends(url, listener)):
        assert time.monotonic() < reopened, "the LISTEN connection was not reopened"
        time.sleep(0.05)
    time.sleep(0.5)

    scheduled = run_cli(["schedule", "--at", "+1s"], {"SCHEDULER_DATABASE_URL": url})
    assert scheduled.returncode == 0, scheduled.stderr
    late = 0.0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        rows = run_sync(afetch(url, "SELECT extract(epoch FROM published_at - publish_at) AS late "
                                    "FROM scheduler_publications WHERE published_at IS NOT NULL"))  # fmt: skip
        if rows:
            late = float(rows[0]["late"])
            break
        time.sleep(0.05)
    else:
        raise AssertionError("not published within 10 s: the wake-up was lost")
    print(f"\nafter the LISTEN connection was reopened: published {late * 1000:.0f} ms late")
    stop_all([leader])


@pytest.mark.parametrize("drop", ["unsubscribe", "close", "cancel"])
async def test_no_listen_connection_outlives_its_last_channel_dropped_while_it_opened(
    pg_url: str, monkeypatch: pytest.MonkeyPatch, drop: str
) -> None:
    """A loop stops leading (unsubscribe), the daemon stops (close) or the subscribing loop
    is cancelled while the listener is still opening its connection for that loop: the
    connection it was opening is closed, not kept LISTENing for nobody."""
    from scheduler_daemon.config.settings import Settings
    from scheduler_daemon.db.connect import open_store
    from scheduler_daemon.db.listen import Listener
    from scheduler_daemon.db.postgres import PostgresStore
    from scheduler_daemon.logs import get_logger

    settings = Settings(database_url=pg_url, instance_id="race-1")  # type: ignore[arg-type]
    store = await open_store(settings)
    assert isinstance(store, PostgresStore)
    listener = Listener(store, get_logger())
    connected, proceed = asyncio.Event(), asyncio.Event()
    real_add_listener = asyncpg.Connection.add_listener

    async def wait_then_add_listener(conn: asyncpg.Connection, *args: Any) -> None:
        connected.set()
        await proceed.wait()  # the connection is open, not yet the listener's
        await real_add_listener(conn, *args)

    monkeypatch.setattr(asyncpg.Connection, "add_listener", wait_then_add_listener)
    try:
        subscribing = asyncio.create_task(listener.subscribe("scheduler_due", print))
        await asyncio.wait_for(connected.wait(), 10)
        assert await _backends(pg_url, "scheduler-daemon/race-1/listen") == 1
        if drop == "cancel":
            subscribing.cancel()
            with pytest.raises(asyncio.CancelledError):
                await subscribing
        else:
            listener.unsubscribe("scheduler_due") if drop == "unsubscribe" else listener.close()
            proceed.set()
            await asyncio.wait_for(subscribing, 10)
        assert not listener.listening
        deadline = time.monotonic() + 10  # terminate() closes the socket; the server follows
        while await _backends(pg_url, "scheduler-daemon/race-1/listen"):
            assert time.monotonic() < deadline, "a LISTEN connection with no channel is open"
            await asyncio.sleep(0.05)
    finally:
        proceed.set()
        listener.close()
        await store.close()


async def _backends(dsn: str, application_name: str) -> int:
    rows = await afetch(
        dsn, f"SELECT pid FROM pg_stat_activity WHERE application_name = '{application_name}'"
    )
    return len(rows)


async def test_session_mode_refuses_a_server_without_idle_session_timeout(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL 13 has no idle_session_timeout, which is what evicts a frozen leader:
    session mode exits 78 there, naming the version and the way out."""
    from scheduler_daemon.config.settings import Settings
    from scheduler_daemon.daemon import Daemon
    from scheduler_daemon.db.postgres import PostgresStore
    from scheduler_daemon.errors import ConfigError
    from scheduler_daemon.logs import get_logger

    async def thirteen(_store: PostgresStore) -> tuple[int, int]:
        return (13, 16)

    monkeypatch.setattr(PostgresStore, "server_version", thirteen)
    settings = Settings(database_url=pg_url)  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as refused:
        await Daemon(settings, get_logger()).preflight()
    assert str(refused.value) == (
        "lock.mode: 'session' needs PostgreSQL 14 or later (idle_session_timeout is what "
        "ends a stalled leader's session); the server is 13.16. Upgrade it, or set "
        "SCHEDULER_LOCK__MODE=transaction."
    )
    transaction = Settings(database_url=pg_url, lock={"mode": "transaction"})  # type: ignore[arg-type]
    assert await Daemon(transaction, get_logger()).preflight() is not None


async def test_an_opened_listener_is_kept_with_no_channel_and_listens_on_it_when_asked(
    pg_url: str,
) -> None:
    """The daemon opens its listener at start (db/listen.py): a standby holds the
    connection, idle, and when it takes over, subscribing LISTENs on that same connection
    (no new connection's setup in the takeover); it stays open when the leader stops
    leading, and goes at shutdown."""
    from scheduler_daemon.config.settings import Settings
    from scheduler_daemon.db.connect import open_store
    from scheduler_daemon.db.listen import Listener
    from scheduler_daemon.db.postgres import PostgresStore
    from scheduler_daemon.logs import get_logger

    name = "scheduler-daemon/warm-1/listen"
    settings = Settings(database_url=pg_url, instance_id="warm-1")  # type: ignore[arg-type]
    store = await open_store(settings)
    assert isinstance(store, PostgresStore)
    listener = Listener(store, get_logger())
    try:
        await listener.open()
        assert listener.listening
        pids = await afetch(
            pg_url, f"SELECT pid FROM pg_stat_activity WHERE application_name = '{name}'"
        )
        assert len(pids) == 1, "one connection, open before anything subscribed"
        heard: list[str] = []
        await listener.subscribe("warm_channel", heard.append)
        again = await afetch(
            pg_url, f"SELECT pid FROM pg_stat_activity WHERE application_name = '{name}'"
        )
        assert again == pids, "the subscription LISTENs on the connection already open"
        await store.pool.execute("NOTIFY warm_channel, 'due'")
        deadline = time.monotonic() + 10
        while "due" not in heard:
            assert time.monotonic() < deadline, f"no notification heard: {heard}"
            await asyncio.sleep(0.02)
        listener.unsubscribe("warm_channel")  # stepped down: a standby again
        assert listener.listening
        assert await _backends(pg_url, name) == 1
        listener.close()
        deadline = time.monotonic() + 10
        while await _backends(pg_url, name):
            assert time.monotonic() < deadline, "the connection outlived close()"
            await asyncio.sleep(0.05)
    finally:
        listener.close()
        await store.close()
