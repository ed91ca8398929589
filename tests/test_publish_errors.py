"""Publisher errors: what rolls a batch back for a retry, what fails a row, and the cap
that keeps one poison row from holding the publish loop up for ever.

The rule (scheduler_daemon/loops/publish.py, ``_run_publishers``): whatever a publisher
raises is a publisher failure (row by row, the rows failing again are marked failed);
only a database error that says "not now" rolls the batch back, and a batch rolled back
``TRANSIENT_BATCH_ATTEMPTS`` times in a row is isolated row by row, where that error
fails its row.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest
from rig.processes import Daemons
from rig.sql import fetch, scalar
from rig.waiting import wait_until
from test_publish import start

from scheduler_daemon.config.settings import Settings
from scheduler_daemon.db.connect import is_transient, is_transient_database_error
from scheduler_daemon.leadership import LeadershipLost
from scheduler_daemon.logs import get_logger
from scheduler_daemon.loops.base import Tick
from scheduler_daemon.loops.publish import TRANSIENT_BATCH_ATTEMPTS, PublishWork
from scheduler_daemon.metrics import Metrics
from scheduler_daemon.publishers import Published

# -- helpers ------------------------------------------------------------------------


def now_sql(url: str) -> str:
    return "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')" if url.startswith("sqlite") else "now()"


def insert_due(url: str, payloads: Sequence[dict[str, Any]], prefix: str) -> list[int]:
    """Rows due now, keyed prefix1, prefix2, …; their ids in that order."""
    values = ", ".join(
        f"('{prefix}{n}', '{json.dumps(payload)}', {now_sql(url)})"
        for n, payload in enumerate(payloads, 1)
    )
    fetch(url, f"INSERT INTO scheduler_publications (key, payload, publish_at) VALUES {values}")
    rows = fetch(url, "SELECT id, key FROM scheduler_publications WHERE key LIKE $1", prefix + "%")
    ids = {row["key"]: row["id"] for row in rows}
    return [ids[f"{prefix}{n}"] for n in range(1, len(payloads) + 1)]


def pending(url: str) -> int:
    return int(
        scalar(url, "SELECT count(*) FROM scheduler_publications WHERE status = 'scheduled'")
    )


def by_status(url: str, status: str) -> list[dict[str, Any]]:
    return fetch(
        url,
        "SELECT id, key, last_error FROM scheduler_publications WHERE status = $1 ORDER BY id",
        status,
    )


# -- real daemons -------------------------------------------------------------------


@pytest.mark.parametrize("error", ["OSError", "TimeoutError"])
def test_python_publisher_network_error_fails_only_its_row(
    daemons: Daemons, database_url: str, error: str
) -> None:
    """A Python publisher's own OSError/TimeoutError on one row (its endpoint refuses that
    payload) used to roll the batch back for ever, holding up every row due behind it.
    Now it is a publisher failure: the row fails with its error, the rest publish."""
    url = database_url
    fetch(url, "CREATE TABLE sample_publisher_audit (publication_id bigint, instance text)")
    payloads: list[dict[str, Any]] = [{"n": n} for n in range(40)]
    payloads[3] = {"raise": error}  # in the first batch: the other 3 batches wait behind it
    ids = insert_due(url, payloads, "p")
    poison = ids[3]
    process = start(
        daemons, url, SCHEDULER_PUBLISH__PUBLISHERS='["sample"]', SCHEDULER_PUBLISH__BATCH_SIZE="10"
    )
    wait_until(lambda: pending(url) == 0, timeout=20, what="every due row handled")
    assert by_status(url, "failed") == [
        {
            "id": poison,
            "key": "p4",
            "last_error": f"{error}: the sample publisher's endpoint failed for {poison}",
        }
    ]
    published = [row["id"] for row in by_status(url, "published")]
    assert published == [i for i in ids if i != poison]
    audited = fetch(url, "SELECT publication_id FROM sample_publisher_audit")
    assert sorted(row["publication_id"] for row in audited) == published

    # The loop goes on: a row scheduled afterwards publishes too.
    [later] = insert_due(url, [{"n": "later"}], "later")
    wait_until(lambda: pending(url) == 0, timeout=10, what="the row scheduled afterwards")
    assert by_status(url, "published")[-1]["id"] == later

    failed_batches = process.events("publish.batch_failed")
    assert len(failed_batches) == 1
    assert failed_batches[0]["error"].startswith(f"{error}:")
    assert [e["publication_id"] for e in process.events("publish.row_failed")] == [poison]
    assert not process.events("publish.batch_retry"), "not a database error: no retry"
    assert not process.events("tick.failed")


def test_a_publisher_that_hangs_times_out_and_fails_only_its_row(
    daemons: Daemons, database_url: str
) -> None:
    """A publisher call that never returns used to stop publishing for good (and in
    session mode the heartbeat kept the hung leader in office). Now the call is cancelled
    after publish.publisher_timeout: the batch is retried row by row, the row that hangs
    again fails saying so, and the rows behind it publish."""
    url = database_url
    fetch(url, "CREATE TABLE sample_publisher_audit (publication_id bigint, instance text)")
    payloads: list[dict[str, Any]] = [{"n": n} for n in range(20)]
    payloads[3] = {"hang": True}
    ids = insert_due(url, payloads, "h")
    hung = ids[3]
    process = start(
        daemons, url, SCHEDULER_PUBLISH__PUBLISHERS='["sample"]',
        SCHEDULER_PUBLISH__BATCH_SIZE="10", SCHEDULER_PUBLISH__PUBLISHER_TIMEOUT="1s",
    )  # fmt: skip
    wait_until(lambda: pending(url) == 0, timeout=30, what="every due row handled")
    timed_out = (
        "PublisherTimedOut: publisher 'sample' timed out after 1s (publish.publisher_timeout)"
    )
    assert by_status(url, "failed") == [{"id": hung, "key": "h4", "last_error": timed_out}]
    assert [row["id"] for row in by_status(url, "published")] == [i for i in ids if i != hung]
    assert [e["error"] for e in process.events("publish.batch_failed")] == [timed_out]
    assert not process.events("tick.failed")


@pytest.mark.postgres
@pytest.mark.parametrize("mode", ["row", "batch"])
def test_sql_statement_timeout_on_one_row_is_bounded(
    daemons: Daemons, pg_url: str, mode: str
) -> None:
    """A `sql` publisher whose statement hits the statement timeout on one row: a
    QueryCanceledError is the database saying "not now", so the batch is retried, but
    only TRANSIENT_BATCH_ATTEMPTS times; then the batch is isolated and the row fails."""
    fetch(pg_url, "CREATE TABLE audit (publication_id bigint NOT NULL)")
    ids = insert_due(pg_url, [{"n": n} for n in range(20)], "s")
    poison = ids[5]
    if mode == "row":
        sleep = f"CASE WHEN $1::bigint = {poison} THEN 10 ELSE 0 END"
        insert = "SELECT $1::bigint"
    else:
        sleep = f"CASE WHEN {poison} = ANY($1::bigint[]) THEN 10 ELSE 0 END"
        insert = "SELECT unnest($1::bigint[])"
    statement = f"WITH s AS (SELECT pg_sleep({sleep})) INSERT INTO audit {insert} FROM s"
    started = time.monotonic()
    process = start(
        daemons,
        pg_url,
        SCHEDULER_PUBLISH__PUBLISHERS='["sql"]',
        SCHEDULER_PUBLISH__SQL__STATEMENT=statement,
        SCHEDULER_PUBLISH__SQL__PARAMS='["id"]',
        SCHEDULER_PUBLISH__SQL__MODE=mode,
        SCHEDULER_DATABASE__STATEMENT_TIMEOUT="0.5s",
    )
    wait_until(lambda: pending(pg_url) == 0, timeout=30, what="every due row handled")
    # Three rolled-back attempts and the isolated run, each stopped after 0.5s.
    assert time.monotonic() - started < 20
    [failed] = by_status(pg_url, "failed")
    assert failed["id"] == poison
    assert "QueryCanceledError" in failed["last_error"]
    assert "statement timeout" in failed["last_error"]
    published = [row["id"] for row in by_status(pg_url, "published")]
    assert published == [i for i in ids if i != poison]
    audited = fetch(pg_url, "SELECT publication_id FROM audit ORDER BY publication_id")
    assert [row["publication_id"] for row in audited] == published

    [later] = insert_due(pg_url, [{"n": "later"}], "later")
    wait_until(lambda: pending(pg_url) == 0, timeout=10, what="the row scheduled afterwards")
    assert by_status(pg_url, "published")[-1]["id"] == later

    retries = process.events("publish.batch_retry")
    assert [e["attempt"] for e in retries] == list(range(1, TRANSIENT_BATCH_ATTEMPTS + 1))
    assert all("statement timeout" in e["error"] for e in retries)
    [isolated] = process.events("publish.batch_isolated")
    assert isolated["attempts"] == TRANSIENT_BATCH_ATTEMPTS
    assert [e["publication_id"] for e in process.events("publish.row_failed")] == [poison]


# -- the decisions, without processes ----------------------------------------------


def test_only_database_errors_that_say_not_now_are_transient() -> None:
    transient: list[BaseException] = [
        asyncpg.DeadlockDetectedError("deadlock detected"),
        asyncpg.SerializationError("could not serialize access"),
        asyncpg.LockNotAvailableError("lock timeout"),
        asyncpg.QueryCanceledError("canceling statement due to statement timeout"),
        asyncpg.AdminShutdownError("terminating connection due to administrator command"),
        asyncpg.CannotConnectNowError("the database system is starting up"),
        asyncpg.TooManyConnectionsError("too many clients"),
        asyncpg.ConnectionDoesNotExistError("connection was closed in the middle of operation"),
        asyncpg.InterfaceError("connection is closed"),
        sqlite3.OperationalError("database is locked"),
    ]
    for exc in transient:
        assert is_transient_database_error(exc), exc
        assert is_transient(exc), exc  # connect/migrate retry these too
    wrapped = RuntimeError("publisher gave up")
    wrapped.__cause__ = asyncpg.DeadlockDetectedError("deadlock detected")
    assert is_transient_database_error(wrapped)

    not_transient: list[BaseException] = [
        OSError("connection refused by the publisher's endpoint"),
        ConnectionResetError(),
        TimeoutError(),
        ValueError("bad payload"),
        asyncpg.CheckViolationError("check"),
        asyncpg.UniqueViolationError("duplicate key"),
        # A value the server refuses (SQLSTATE 22), and one the driver cannot encode (a
        # client-side DataError, an InterfaceError): about the row, not the moment.
        asyncpg.exceptions.DataError("invalid input syntax for type integer"),
        asyncpg.exceptions._base.DataError("invalid input for query argument $1"),
        sqlite3.IntegrityError("CHECK constraint failed"),
        sqlite3.OperationalError("no such table: audit"),
    ]
    for exc in not_transient:
        assert not is_transient_database_error(exc), exc
    context_only = ValueError("unrelated")
    context_only.__context__ = asyncpg.DeadlockDetectedError("handled earlier")
    assert not is_transient_database_error(context_only)
    # Opening a connection is another matter: there a socket error means the database.
    assert is_transient(OSError("connection refused"))
    assert is_transient(TimeoutError())


class FakeTx:
    """The savepoint semantics _run_publishers relies on; `alive = False` is a lost
    connection (every statement, the savepoint's rollback included, raises)."""

    def __init__(self) -> None:
        self.alive = True
        self.failed: dict[int, str] = {}

    def _check(self) -> None:
        if not self.alive:
            raise asyncpg.InterfaceError("cannot call Transaction.__aexit__(): connection closed")

    @asynccontextmanager
    async def savepoint(self) -> AsyncIterator[None]:
        self._check()
        try:
            yield
        except BaseException:
            self._check()
            raise

    async def query(self, query: str, **params: Any) -> list[dict[str, Any]]:
        self._check()
        assert query == "publication_fail"
        self.failed[params["id"]] = params["error"]
        return []


class FakePublisher:
    name = "fake"

    def __init__(self, errors: dict[int, Callable[[], BaseException]]) -> None:
        self.errors = errors  # publication id -> the exception it raises in any batch
        self.calls: list[list[int]] = []
        self.kill: FakeTx | None = None  # the connection dies with the first error

    async def publish(self, tx: Any, rows: Sequence[Published]) -> None:
        self.calls.append([row.id for row in rows])
        for row in rows:
            if row.id in self.errors:
                if self.kill is not None:
                    self.kill.alive = False
                raise self.errors[row.id]()


def batch_of(*ids: int) -> list[Published]:
    at = datetime(2030, 1, 1, tzinfo=UTC)
    return [Published(i, f"k{i}", {}, at, at) for i in ids]


class FreshLease:
    """A lease whose last proof is as fresh as ``fresh`` says."""

    def __init__(self, proven_recently: bool = True) -> None:
        self.is_fresh = proven_recently
        self.reason = None if proven_recently else "heartbeat 9.0s late (process stalled)"

    def proven_recently(self) -> bool:
        return self.is_fresh


def tick(lease: FreshLease | None = None) -> Tick:
    return Tick("publish", 1, get_logger(), lease or FreshLease())  # type: ignore[arg-type]


def work_with(publisher: FakePublisher, **publish: Any) -> PublishWork:
    settings = Settings(publish=publish)
    return PublishWork(None, settings, [publisher], Metrics(), get_logger())  # type: ignore[arg-type]


async def test_publisher_oserror_is_a_row_failure() -> None:
    publisher = FakePublisher({2: lambda: OSError("endpoint refused")})
    work, tx = work_with(publisher), FakeTx()
    failed = await work._run_publishers(tx, batch_of(1, 2, 3), tick())  # type: ignore[arg-type]
    assert failed == {2: "OSError: endpoint refused"} == tx.failed
    assert publisher.calls == [[1, 2, 3], [1], [2], [3]]


async def test_a_publisher_past_its_timeout_is_cancelled_and_fails_its_row() -> None:
    publisher = FakePublisher({2: lambda: OSError("unused")})
    hanging: list[int] = []

    async def hang(tx: Any, rows: Sequence[Published]) -> None:
        publisher.calls.append([row.id for row in rows])
        if any(row.id == 2 for row in rows):
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                hanging.append(len(rows))
                raise

    publisher.publish = hang  # type: ignore[method-assign]
    work, tx = work_with(publisher, publisher_timeout=0.05), FakeTx()
    failed = await work._run_publishers(tx, batch_of(1, 2, 3), tick())  # type: ignore[arg-type]
    error = "PublisherTimedOut: publisher 'fake' timed out after 0.05s (publish.publisher_timeout)"
    assert failed == {2: error} == tx.failed
    assert publisher.calls == [[1, 2, 3], [1], [2], [3]]
    assert hanging == [3, 1]  # both hung calls were cancelled, not left running


async def test_a_publisher_is_not_called_once_the_last_proof_is_stale() -> None:
    """A leader resumed after a freeze: its tick may run before the heartbeat that would
    notice. The age of the last proof stops the publisher call before it starts, and
    nothing is marked failed (the batch rolls back for the next leader)."""
    publisher = FakePublisher({})
    work, tx = work_with(publisher), FakeTx()
    with pytest.raises(LeadershipLost, match="stalled"):
        await work._run_publishers(tx, batch_of(1, 2), tick(FreshLease(proven_recently=False)))  # type: ignore[arg-type]
    assert publisher.calls == []
    assert tx.failed == {}


async def test_a_lost_connection_rolls_the_batch_back_whatever_the_publisher_raised() -> None:
    """A publisher's OSError while the connection dies under it: the savepoint's rollback
    fails with the driver's error, which is the database's "not now"."""
    publisher = FakePublisher({2: lambda: OSError("broken pipe")})
    work, tx = work_with(publisher), FakeTx()
    publisher.kill = tx
    with pytest.raises(asyncpg.InterfaceError):
        await work._run_publishers(tx, batch_of(1, 2, 3), tick())  # type: ignore[arg-type]
    assert tx.failed == {}


async def test_transient_database_error_is_retried_then_isolated_and_fails_its_row() -> None:
    publisher = FakePublisher({2: lambda: asyncpg.LockNotAvailableError("lock timeout")})
    work = work_with(publisher)
    for _attempt in range(TRANSIENT_BATCH_ATTEMPTS):
        tx = FakeTx()
        with pytest.raises(asyncpg.LockNotAvailableError):
            await work._run_publishers(tx, batch_of(1, 2, 3), tick())  # type: ignore[arg-type]
        assert tx.failed == {}
    # The next tick picks the same rows first (and one more that became due meanwhile).
    publisher.calls.clear()
    tx = FakeTx()
    failed = await work._run_publishers(tx, batch_of(1, 2, 3, 4), tick())  # type: ignore[arg-type]
    assert failed == {2: "LockNotAvailableError: lock timeout"} == tx.failed
    assert publisher.calls == [[1], [2], [3], [4]], "isolated: no batch attempt first"
    # Done with: the next batch runs as one again.
    publisher.calls.clear()
    assert await work._run_publishers(FakeTx(), batch_of(5, 6), tick()) == {}  # type: ignore[arg-type]
    assert publisher.calls == [[5, 6]]


async def test_a_transient_error_that_passes_resets_the_count() -> None:
    def deadlock() -> BaseException:
        error: BaseException = asyncpg.DeadlockDetectedError("deadlock detected")
        return error

    publisher = FakePublisher({1: deadlock})
    work = work_with(publisher)
    for _ in range(TRANSIENT_BATCH_ATTEMPTS - 1):
        with pytest.raises(asyncpg.DeadlockDetectedError):
            await work._run_publishers(FakeTx(), batch_of(1, 2), tick())  # type: ignore[arg-type]
    publisher.errors = {}
    assert await work._run_publishers(FakeTx(), batch_of(1, 2), tick()) == {}  # type: ignore[arg-type]
    # A new streak starts from zero: the next deadlock is retried again, not isolated.
    publisher.errors = {1: deadlock}
    with pytest.raises(asyncpg.DeadlockDetectedError):
        await work._run_publishers(FakeTx(), batch_of(1, 2), tick())  # type: ignore[arg-type]


# -- wake-ups that arrive while a tick runs ------------------------------------------------


class ScriptedTx:
    """Answers the tick's two queries; `during` runs inside the tick, as a notification
    arriving then would."""

    def __init__(self, seconds_to_next: float | None, during: Callable[[], None]) -> None:
        self.seconds_to_next = seconds_to_next
        self.during = during

    async def query(self, query: str, **params: Any) -> list[dict[str, Any]]:
        if query == "publish_due":
            self.during()
            return []
        assert query == "next_due_in"
        return [{"seconds": self.seconds_to_next, "skipped": False, "db_epoch": time.time()}]


class ScriptedLease:
    def __init__(self) -> None:
        self.tx: ScriptedTx | None = None

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[ScriptedTx]:
        assert self.tx is not None
        yield self.tx


async def test_a_notification_during_a_tick_is_never_judged_against_the_last_plan() -> None:
    """While draining, a tick plans the next one for "now" (rows still due); a row
    scheduled 0.5 s ahead and committed after the next tick's last look notifies during
    that tick. It must wake the loop right after the tick: compared with the stale plan
    (already past) it looked not sooner, and waited a whole sleep (60 s while listening)."""
    work = PublishWork(None, Settings(), [], Metrics(), get_logger())  # type: ignore[arg-type]
    woken: list[float] = []
    work.wake = lambda: woken.append(time.time())
    lease = ScriptedLease()
    tick = Tick("publish", 1, get_logger(), lease)  # type: ignore[arg-type]
    lease.tx = ScriptedTx(0.0, during=lambda: None)
    assert await work.tick(tick) == 0.0  # due now: the next tick is planned for now
    woken.clear()

    soon = (datetime.now(UTC) + timedelta(seconds=0.5)).isoformat()
    lease.tx = ScriptedTx(None, during=lambda: work._on_notification(soon))
    await work.tick(Tick("publish", 2, get_logger(), lease))  # type: ignore[arg-type]
    assert woken, "the notification that arrived during the tick was dropped"

    woken.clear()  # between ticks, a row due later than planned needs no wake-up
    work._on_notification((datetime.now(UTC) + timedelta(hours=1)).isoformat())
    assert woken == []


async def test_after_a_failed_tick_notifications_wait_for_the_retry() -> None:
    """A failed tick is retried after the interval. Its plan used to stay "a tick is
    running" (-inf), so every notification woke the loop at once, to fail again."""
    work = PublishWork(None, Settings(), [], Metrics(), get_logger())  # type: ignore[arg-type]
    woken: list[float] = []
    work.wake = lambda: woken.append(time.time())
    lease = ScriptedLease()
    lease.tx = ScriptedTx(0.0, during=lambda: None)
    await work.tick(Tick("publish", 1, get_logger(), lease))  # type: ignore[arg-type]

    def fail() -> None:
        raise asyncpg.UndefinedTableError("relation does not exist")

    lease.tx = ScriptedTx(0.0, during=fail)
    with pytest.raises(asyncpg.UndefinedTableError):
        await work.tick(Tick("publish", 2, get_logger(), lease))  # type: ignore[arg-type]
    woken.clear()
    for _ in range(3):
        work._on_notification(datetime.now(UTC).isoformat())
    assert woken == []
