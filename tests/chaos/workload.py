"""The chaos run's workload: what the replicas are asked to do, and how it is fed and watched.

Publish loop
    Publications due throughout the run, scheduled half through plain SQL and half through
    the client API (``schedule_in`` on the application's own connection), each with a key
    (so a retried request is never a second publication). Every batch goes to three
    publishers, which are three independent witnesses of one publication:
    ``sql`` (an append-only audit row, in the publishing transaction, with the instance and
    the publish loop's fencing token), ``notify`` (a message the feeder's own LISTEN
    connection records), and the sample plugin's ``effects`` publisher (wall-clock records in
    a file, outside any database).

Plugin loop
    Three tasks with short periods: an SQL task (a database-time interval with the plugin
    loop's token), an async Python target and a sync Python target (worker process), both
    writing wall-clock records outside the database (``scheduler_sample_plugin.effects``).
    The daemon's own ``scheduler_plugin_runs`` rows are the database's view of every run.
    With sharded leadership (``SCHEDULER_PLUGIN__SHARDS`` > 1) the workload adds async
    tasks (``shard_probe_<n>``) so that the schedules spread over the shards, each Python
    record carries its run's shard (``ctx.shard``) and that shard's token, and the SQL task
    reads its own shard's token (``plugin/<shard>``, its shard computed as the daemon
    does, by ``scheduler_shard_hash``).

The feeder and the listener run in one thread with their own event loop and reconnect
through every fault; a request whose outcome is unknown (the connection died during the
commit) is retried with the same key, and what the database holds decides in the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
from rig.effects import EFFECTS_TARGETS, effects_env
from rig.ticks import RIG_APP

from scheduler_daemon.client import schedule_in

NOTIFY_CHANNEL = "chaos_published"
KEY_PREFIX = "chaos-"

WORKLOAD_DDL = """
CREATE TABLE chaos_audit (
    publication_id bigint NOT NULL,
    key            text,
    instance       text NOT NULL,
    token          bigint,
    at             timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE chaos_sql_runs (
    id       bigserial PRIMARY KEY,
    instance text NOT NULL,
    token    bigint,
    slot     timestamptz,
    started  timestamptz NOT NULL,
    ended    timestamptz
);
"""

# In the publishing transaction: one audit row per publication of the batch. The key goes
# in too: an asynchronous failover rewinds the id sequence, so ids are reused, keys never.
AUDIT_STATEMENT = (
    "INSERT INTO chaos_audit (publication_id, key, instance, token) "
    "SELECT unnest($1::bigint[]), unnest($2::text[]), current_setting('application_name'), "
    "(SELECT token FROM scheduler_fencing WHERE loop = 'publish')"
)

# In a fenced transaction of the plugin leader: an interval of database time, held open
# 50 ms, with the slot (its run row was claimed, `running`, just before) and the token of
# `fence` (the plugin loop's row; sharded, the row of the SQL task's own shard).
SQL_TASK = (
    "INSERT INTO chaos_sql_runs (instance, token, slot, started) VALUES "
    "(current_setting('application_name'), "
    "(SELECT token FROM scheduler_fencing WHERE loop = {fence}), "
    "(SELECT max(slot) FROM scheduler_plugin_runs WHERE name = 'sql_probe' "
    "AND status = 'running'), clock_timestamp()); "
    "SELECT pg_sleep(0.05); "
    "UPDATE chaos_sql_runs SET ended = clock_timestamp() "
    "WHERE id = currval('chaos_sql_runs_id_seq')"
)


def sql_task(shards: int = 1) -> str:
    """The SQL task's statement for a deployment of `shards` shards."""
    if shards <= 1:
        return SQL_TASK.format(fence="'plugin'")
    return SQL_TASK.format(fence=f"'plugin/' || (scheduler_shard_hash('sql_probe') % {shards})")


# The SQL statement that says which shard each task is in (the daemon's own rule).
SHARD_OF_TASKS = (
    "SELECT name, scheduler_shard_hash(name) % $2 AS shard FROM unnest($1::text[]) AS name"
)


def tasks(shards: int = 1, extra_tasks: int = 0) -> list[dict[str, str]]:
    """The three probes, and `extra_tasks` async ones (every second) to fill the shards."""
    declared = [
        {"name": "sql_probe", "every": "1s", "sql": sql_task(shards), "timeout": "10s"},
        {"name": "async_probe", "every": "0.5s", "target": EFFECTS_TARGETS["async"],
         "timeout": "10s"},
        {"name": "sync_probe", "every": "1s", "target": EFFECTS_TARGETS["sync"], "timeout": "10s"},
    ]  # fmt: skip
    declared += [
        {"name": f"shard_probe_{n}", "every": "1s", "target": EFFECTS_TARGETS["async"],
         "timeout": "10s"}
        for n in range(1, extra_tasks + 1)
    ]  # fmt: skip
    return declared


def task_periods(extra_tasks: int = 0) -> dict[str, float]:
    """The period of each task, in seconds, for the checker's expected slots."""
    periods = {"sql_probe": 1.0, "async_probe": 0.5, "sync_probe": 1.0}
    periods |= {f"shard_probe_{n}": 1.0 for n in range(1, extra_tasks + 1)}
    return periods


TASK_PERIODS: Mapping[str, float] = task_periods()


def replica_env(
    url: str, instance: str, effects_log: Path, *, shards: int = 1, extra_tasks: int = 0
) -> dict[str, str]:
    """Both loops, the three publishers and the tasks; timings as the rig's FAST_TIMINGS
    plus short loop intervals (the caller adds those); `shards` shards of the plugin loop
    (1: one leader, the daemon's default, not set)."""
    sharding = {"SCHEDULER_PLUGIN__SHARDS": str(shards)} if shards > 1 else {}
    return {
        "SCHEDULER_DATABASE_URL": url,
        "SCHEDULER_INSTANCE_ID": instance,
        "SCHEDULER_PUBLISH__INTERVAL": "0.5",
        "SCHEDULER_PUBLISH__BATCH_SIZE": "50",
        "SCHEDULER_PUBLISH__PUBLISHERS": '["sql", "notify", "effects"]',
        "SCHEDULER_PUBLISH__SQL__STATEMENT": AUDIT_STATEMENT,
        "SCHEDULER_PUBLISH__SQL__PARAMS": '["id", "key"]',
        "SCHEDULER_PUBLISH__NOTIFY__CHANNEL": NOTIFY_CHANNEL,
        "SCHEDULER_PLUGIN__INTERVAL": "0.2",
        "SCHEDULER_PLUGIN__TASKS": json.dumps(tasks(shards, extra_tasks)),
        "SCHEDULER_PLUGIN__DISABLED": '["purge_publications", "purge_runs"]',
        # Every run row stays for the checker (the default keeps the last 1,000 per task).
        "SCHEDULER_PLUGIN__HISTORY": "1000000",
        "EFFECTS_PUBLISH_SECONDS": "0.02",
        **effects_env(effects_log, 0.15),
        **sharding,
    }


@dataclass
class Scheduled:
    """A publication the feeder saw acknowledged (its commit returned)."""

    id: int
    key: str
    via: str  # "sql" or "api"
    publish_at: float
    created: float


@dataclass
class FeedLog:
    scheduled: list[Scheduled] = field(default_factory=list)
    notified: list[tuple[str, float]] = field(default_factory=list)  # (key, wall clock)
    # When the listener was not listening: (from its last good ping, to LISTEN again).
    listen_gaps: list[tuple[float, float]] = field(default_factory=list)
    errors: list[tuple[float, str]] = field(default_factory=list)
    uncertain: list[str] = field(default_factory=list)  # keys whose commit was not confirmed


class Feeder:
    """Schedules publications at a steady rate and listens to the notify publisher, in a
    thread of its own, until ``stop()``. Survives every fault by reconnecting."""

    def __init__(self, dsn: str, rng: random.Random, rate: float = 5.0) -> None:
        self.dsn = dsn
        self.rate = rate
        self.log = FeedLog()
        self._rng = rng
        self._sequence = 0
        self._stopping = threading.Event()
        self._closing = threading.Event()
        self.failure: BaseException | None = None  # what ended the thread, if not close()
        self._thread = threading.Thread(target=self._main, name="chaos-feeder", daemon=True)
        self._lock = threading.Lock()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop scheduling new publications; the listener goes on until ``close()``."""
        self._stopping.set()

    def close(self, timeout: float = 30.0) -> None:
        """Stop listening too, and wait for the thread."""
        self._stopping.set()
        self._closing.set()
        self._thread.join(timeout)

    def snapshot(self) -> FeedLog:
        with self._lock:
            return FeedLog(
                list(self.log.scheduled),
                list(self.log.notified),
                list(self.log.listen_gaps),
                list(self.log.errors),
                list(self.log.uncertain),
            )

    # -- the thread ------------------------------------------------------------------

    def _main(self) -> None:
        try:
            asyncio.run(self._run())
        except BaseException as exc:  # kept for the harness: a dead witness is no evidence
            self.failure = exc
            raise

    async def _run(self) -> None:
        listener = asyncio.create_task(self._listen(), name="chaos-listener")
        try:
            await self._feed()
            await asyncio.to_thread(self._closing.wait)
        finally:
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener

    async def _connect(self) -> asyncpg.Connection:
        conn: asyncpg.Connection = await asyncpg.connect(
            self.dsn, timeout=2, command_timeout=5, server_settings=RIG_APP
        )
        return conn

    async def _feed(self) -> None:
        conn: asyncpg.Connection | None = None
        pending: tuple[str, str, float] | None = None  # a request to retry: key, via, due in
        while not self._stopping.is_set():
            if pending is None:
                self._sequence += 1
                via = "sql" if self._sequence % 2 else "api"
                pending = (f"{KEY_PREFIX}{self._sequence}", via, self._rng.uniform(0.3, 3.0))
            key, via, due_in = pending
            try:
                if conn is None or conn.is_closed():
                    conn = await self._connect()
                scheduled = await self._schedule(conn, key, via, due_in)
            # Any failure at all: under faults asyncpg also raises its InternalClientError
            # (a timed-out call leaves the protocol mid-operation). The feeder is the
            # application here, and applications retry.
            except Exception as exc:
                with self._lock:
                    self.log.errors.append((time.time(), f"{type(exc).__name__}: {exc}"))
                    if key not in self.log.uncertain:
                        self.log.uncertain.append(key)
                if conn is not None:
                    conn.terminate()
                    conn = None
                await asyncio.sleep(0.2)
                continue  # the same key again: created or found, never twice
            with self._lock:
                self.log.scheduled.append(scheduled)
                if key in self.log.uncertain:
                    self.log.uncertain.remove(key)
            pending = None
            await asyncio.sleep(self._rng.expovariate(self.rate))
        if conn is not None:
            conn.terminate()

    async def _schedule(
        self, conn: asyncpg.Connection, key: str, via: str, due_in: float
    ) -> Scheduled:
        payload = {"key": key, "via": via}
        async with conn.transaction():
            if via == "sql":
                row = await conn.fetchrow(
                    "WITH new AS (INSERT INTO scheduler_publications (key, payload, publish_at) "
                    "VALUES ($1, $2::text::jsonb, now() + $3 * interval '1 s') "
                    "ON CONFLICT (key) DO NOTHING RETURNING id, publish_at, created_at) "
                    "SELECT * FROM new UNION ALL SELECT id, publish_at, created_at "
                    "FROM scheduler_publications WHERE key = $1 LIMIT 1",
                    key,
                    json.dumps(payload),
                    due_in,
                )
                assert row is not None
                ident, publish_at, created = row["id"], row["publish_at"], row["created_at"]
            else:
                now: datetime = await conn.fetchval("SELECT now()")
                result = await schedule_in(conn, now + timedelta(seconds=due_in), payload, key=key)
                ident = result.publication.id
                publish_at = result.publication.publish_at
                created = result.publication.created_at
        return Scheduled(ident, key, via, _epoch(publish_at), _epoch(created))

    async def _listen(self) -> None:
        """LISTEN, and know when we were not: a notification sent while the connection
        was down is gone for good (NOTIFY is at most once per listener), so the gaps go
        into the history and the checker does not count what fell into them as lost."""
        last_ok = time.time()
        while True:
            conn: asyncpg.Connection | None = None
            try:
                conn = await self._connect()
                await conn.add_listener(NOTIFY_CHANNEL, self._on_notify)
                now = time.time()
                with self._lock:
                    self.log.listen_gaps.append((last_ok, now))
                last_ok = now
                # asyncpg learns of a dead connection only when it talks: ask now and then.
                while True:
                    await asyncio.sleep(0.25)
                    await conn.fetchval("SELECT 1", timeout=2)
                    last_ok = time.time()
            except asyncio.CancelledError:
                if conn is not None:
                    conn.terminate()
                raise
            except Exception:  # whatever broke the connection: a gap, then listen again
                if conn is not None:
                    conn.terminate()
                await asyncio.sleep(0.1)

    def _on_notify(self, conn: Any, pid: int, channel: str, payload: str) -> None:
        at = time.time()
        try:
            message = json.loads(payload)
        except ValueError:
            return
        key = message.get("key") if isinstance(message, dict) else None
        if isinstance(key, str) and key.startswith(KEY_PREFIX):
            with self._lock:
                self.log.notified.append((key, at))


def _epoch(value: datetime) -> float:
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.timestamp()
