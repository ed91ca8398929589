"""What the daemon needs of a database, whatever the backend.

Each backend (``postgres``, ``sqlite``) implements :class:`Store` in its own module and
keeps its SQL in a ``<backend>.sql`` file beside it. The loops reach that SQL through
typed stores over a :class:`Tx` (db/publications.py, db/plugin_store.py,
db/schedules.py): methods with named parameters that return dataclasses; reports (the
status, the dashboard) read rows as dicts with :meth:`Tx.query`.

Callers never branch on the backend for business logic; they ask the store's
:class:`Capabilities`. Only the factories that build a backend's own part (the leadership
guard, the LISTEN connection, the lock-manager report) look at the concrete store.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal, Protocol

from ..config.url import Backend, DatabaseUrl

if TYPE_CHECKING:
    from .privileges import Grants

PublicationStatus = Literal["scheduled", "published", "cancelled", "failed"]


@dataclass(frozen=True, slots=True)
class Publication:
    id: int
    key: str | None
    payload: Any
    publish_at: datetime
    status: PublicationStatus
    published_at: datetime | None
    published_by: str | None
    attempts: int
    last_error: str | None
    created_at: datetime


@dataclass(frozen=True, slots=True)
class ScheduleResult:
    publication: Publication
    created: bool  # False: the idempotency key already named this publication


@dataclass(frozen=True, slots=True)
class PublicationFilter:
    """What ``find_publications`` returns: every given condition holds (None: any)."""

    statuses: tuple[PublicationStatus, ...] | None = None
    due_after: datetime | None = None  # publish_at >= due_after
    due_before: datetime | None = None  # publish_at < due_before
    key: str | None = None  # this key exactly
    key_prefix: str | None = None  # keys that start with this (case-sensitive)
    limit: int = 100


# `status`, /status and the dashboard count waiting publications and due schedules up to
# this many: a count of COUNT_LIMIT means at least that many. Counting a million reads a
# whole index (0.1 to 1 s), at every refresh of every open dashboard page.
COUNT_LIMIT = 10_000


@dataclass(frozen=True, slots=True)
class PublicationStats:
    scheduled: int  # rows waiting, due or not (up to the limit asked for)
    due: int  # rows whose publish_at has passed by the database's clock (the backlog), ditto
    next_due: datetime | None


# The scheduler's tables whose health `status` and /metrics report (TableHealth).
SCHEDULER_TABLES = (
    "scheduler_plugin_tasks",
    "scheduler_plugin_runs",
    "scheduler_publications",
    "scheduler_webhook_outbox",
)


@dataclass(frozen=True, slots=True)
class TableStats:
    """One of :data:`SCHEDULER_TABLES`, from the server's statistics (PostgreSQL). A
    partitioned table is the sum of its partitions; its vacuum time is its least recently
    vacuumed partition's. Row counts are the statistics' estimates, not ``count(*)``."""

    table: str
    total_bytes: int  # table, indexes and TOAST
    live_rows: int
    dead_rows: int
    dead_ratio: float  # dead / (live + dead); 0 when both are 0
    last_vacuum: datetime | None  # the later of the last manual and automatic VACUUM
    vacuum_age: float | None  # seconds since last_vacuum, by the database's clock
    vacuum_count: int
    autovacuum_count: int


@dataclass(frozen=True, slots=True)
class SnapshotHolder:
    """What holds the database's oldest xmin: no VACUUM can remove a row version that
    died after it (PostgreSQL)."""

    kind: Literal["session", "prepared transaction", "replication slot"]
    name: str | None  # the session's application_name, the gid, the slot's name
    state: str | None  # pg_stat_activity.state; a slot: active or inactive
    backend_pid: int | None
    xmin_age: int  # transactions since its xmin
    # Seconds since its transaction (or statement) began; None where unknown: a slot, or
    # a session of another role that this one may not see the times of.
    held_for: float | None


@dataclass(frozen=True, slots=True)
class DatabaseFile:
    """SQLite: the database file, whose deleted rows leave free pages (no dead rows)."""

    bytes: int  # page_count * page_size
    page_size: int
    free_pages: int  # freelist_count: reused by later writes, returned only by VACUUM
    wal_bytes: int | None  # the write-ahead log beside it (None: there is none)


@dataclass(frozen=True, slots=True)
class TableHealth:
    """Whether the scheduler's tables stay small and vacuumed. What a backend cannot
    tell is None: ``tables`` and ``oldest_snapshot`` on SQLite, ``file`` on PostgreSQL."""

    tables: tuple[TableStats, ...] | None
    oldest_snapshot: SnapshotHolder | None
    file: DatabaseFile | None
    # Seconds the oldest xmin has been held (0: none is): ``oldest_snapshot.held_for``, or
    # where that is unknown (a slot, another role's session), the oldest holder's whose
    # start is known.
    snapshot_seconds: float | None = None


@dataclass(frozen=True, slots=True)
class ScheduleRecord:
    """A row of ``scheduler_plugin_tasks``: a runtime schedule (``target`` set: the row
    says what to run) or a task the deployment declares (``target`` None: config, a
    plugin or a built-in, whose definition lives in the deployment; for those the
    definition columns keep their defaults and mean nothing). Fields are the columns."""

    name: str
    source: str  # "runtime", or where a declared task comes from: "config", "plugin:…", …
    target: str | None
    args: dict[str, Any]
    schedule: str  # its description ("every 30s", "cron 0 3 * * * UTC jitter 5s")
    every_seconds: float | None
    cron: str | None
    timezone: str
    timeout_seconds: float
    misfire: str
    jitter_seconds: float
    next_run_at: datetime
    active: bool
    paused: bool
    trigger_requested_at: datetime | None
    consecutive_failures: int
    last_slot: datetime | None
    last_started_at: datetime | None
    last_finished_at: datetime | None
    last_status: str | None
    last_error: str | None
    run_count: int
    created_at: datetime
    updated_at: datetime

    @property
    def runtime(self) -> bool:
        """Added at runtime (by the application, the CLI or SQL), not declared."""
        return self.target is not None


@dataclass(frozen=True, slots=True)
class ScheduleDefinition:
    """A runtime schedule as ``ScheduleStore.add`` (db/schedules.py) writes it, already validated
    (``client.validate_runtime_schedule``)."""

    name: str
    target: str
    args_json: str  # a JSON object
    schedule: str  # the description, for ``tasks list``
    every_seconds: float | None
    cron: str | None
    timezone: str
    timeout_seconds: float
    misfire: str
    jitter_seconds: float
    # The first slot: given by the caller, else computed from the database's clock by
    # ``first_slot`` (the schedule's own first slot after that instant).
    start: datetime | None
    first_slot: Callable[[datetime], datetime]


@dataclass(frozen=True, slots=True)
class AddedSchedule:
    schedule: ScheduleRecord
    created: bool  # False: an existing runtime schedule was replaced (``replace=True``)


@dataclass(frozen=True, slots=True)
class AppliedMigration:
    version: int
    name: str


@dataclass(frozen=True, slots=True)
class ShardScope:
    """The shards a sharded leader's transaction is fenced for: each with the fencing
    token its owner drew when it took the shard (``tokens``), out of ``count`` shards. The
    plugin loop's statements touch those shards' schedules only, and only while each
    token is still its shard's current one (db/postgres.sql)."""

    count: int
    tokens: dict[int, int]


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a backend can do (whether it has NOTIFY: :attr:`Store.commit_watch` is None)."""

    #: Leadership by the server's lock manager (advisory locks, ``pg_locks``), in session
    #: or transaction mode; without it, an OS file lock held for the whole leadership.
    advisory_locks: bool


class CommitWatch(Protocol):
    """How a backend without LISTEN/NOTIFY notices other processes' commits, cheaply."""

    def files_changed_marker(self) -> tuple[int, ...]:
        """Something that changes with every commit, ours included, for the price of a
        ``stat``: confirm with :meth:`data_version` only when it moved."""
        ...

    async def data_version(self) -> int:
        """Changes when another connection committed, never for our own commits."""
        ...

    async def next_due_in(self) -> float | None:
        """Seconds until the earliest scheduled publication (negative: due); None if
        nothing is scheduled."""
        ...


class Tx(Protocol):
    """One open transaction (or, from ``lease.statements()``, statements that each fence
    themselves), on the connection the leadership guard chose.

    In PostgreSQL session mode that is a pooled connection whose first statement checks
    the loop's fencing token, holding its row until the end (leadership/session_lease.py): a
    replaced leader's transaction cannot commit after its successor drew a token (a
    sharded member's, each shard's token: leadership/shard_lease.py). In
    transaction mode the same transaction holds the tick's ``pg_try_advisory_xact_lock``.
    """

    #: The fencing token of the leadership this transaction is fenced by (None for an
    #: administrative transaction, outside any loop). Python publishers hand it to the
    #: systems they call, so that those can refuse a replaced leader.
    fencing_token: int | None
    #: Sharded leadership: the shards this transaction is fenced for (None: not sharded,
    #: every schedule is the leader's).
    shards: ShardScope | None

    async def execute(self, sql: str, statement_timeout: float | None = None) -> None:
        """Run SQL (one or several statements, no parameters). ``statement_timeout`` replaces the
        session's statement timeout for this transaction (PostgreSQL); callers also bound
        the await, which interrupts the statement on SQLite."""
        ...

    async def fetch(self, query: str, *args: Any) -> list[dict[str, Any]]:
        """Run the named query from the backend's queries file; rows as dicts, times as
        aware datetimes."""
        ...

    async def query(self, query: str, **params: Any) -> list[dict[str, Any]]:
        """Run the named query, written with named parameters (``:name``), from the
        backend's queries file; rows as :meth:`fetch` returns them. A list is a PostgreSQL
        array (SQLite: JSON text, read with ``json_each``). On SQLite a query may be a
        script of several statements (no data-modifying CTEs there): each runs in order
        with the same parameters, and the rows of all of them are returned. Typed callers
        live in db/plugin_store.py."""
        ...

    async def run(self, sql: str, *args: Any) -> None:
        """Run one caller-supplied statement with parameters ($1… / ?1…)."""
        ...

    async def run_many(self, sql: str, args: Sequence[Sequence[Any]]) -> None:
        """Run one caller-supplied statement for each parameter tuple (pipelined)."""
        ...

    def savepoint(self) -> AbstractAsyncContextManager[None]:
        """A nested transaction: an error inside rolls back only what it did."""
        ...


class Store(Protocol):
    """A connected database. Methods are safe to call concurrently from one event loop.

    Rules every backend keeps:
    - "now" is the database's clock, never this process's;
    - every method either commits all of its effect or none of it;
    - errors that mean "the database is unreachable" surface as ``OSError`` or the
      driver's connection errors, never as a silent success.
    """

    @property
    def backend(self) -> Backend: ...

    @property
    def capabilities(self) -> Capabilities: ...

    @property
    def commit_watch(self) -> CommitWatch | None:
        """None where LISTEN/NOTIFY wakes the leader instead (PostgreSQL)."""
        ...

    @property
    def url(self) -> DatabaseUrl: ...

    async def refuse_missing_grants(self, need: Grants) -> None:
        """Raise :class:`~scheduler_daemon.errors.PrivilegeRefused` naming, as GRANT
        statements, what the role lacks of ``need`` (db/privileges.py)."""
        ...

    async def migrate(self) -> list[AppliedMigration]:
        """Bring the schema up to date, serialised against concurrent migrators.

        Returns what this call applied (empty when another replica already did).
        """
        ...

    async def schema_version(self) -> int | None:
        """The newest applied migration, or None on an empty database."""
        ...

    async def schedule(
        self, publish_at: datetime, payload_json: str, key: str | None
    ) -> ScheduleResult: ...

    async def cancel(self, publication_id: int) -> Publication: ...

    async def get(self, publication_id: int) -> Publication | None: ...

    async def get_by_key(self, key: str) -> Publication | None: ...

    async def find_publications(self, where: PublicationFilter) -> list[Publication]:
        """Matching rows in ``publish_at``, then ``id``, order, at most ``where.limit``.
        A read: it never waits for (or blocks) a writer longer than a read must."""
        ...

    async def publication_stats(self, limit: int = COUNT_LIMIT) -> PublicationStats:
        """Publications waiting and due, each counted up to ``limit``, and the next due."""
        ...

    async def table_health(self) -> TableHealth:
        """The scheduler's tables' sizes and dead rows, and what holds VACUUM back: one
        cheap read of the server's statistics (`status`, ``/metrics``)."""
        ...

    def transaction(self, *, readonly: bool = False) -> AbstractAsyncContextManager[Tx]:
        """An unfenced transaction, for administration (the CLI), never for loop work.

        ``readonly``: for reads (``status``, ``tasks list``), which then never wait for a
        writer nor hold one up: SQLite starts a deferred transaction instead of taking the
        write lock (``BEGIN IMMEDIATE``); PostgreSQL's is ``READ ONLY``."""
        ...

    async def close(self) -> None: ...
