"""What the dashboard shows, read from the database and the lock manager: never from this
replica's memory, so every replica shows the same cluster.

Each read is one short read-only transaction, bounded by the callers' timeout. Every list
is read a page at a time by keyset (the page after or before a row, never OFFSET) through
an index, and nothing counts every row: a page costs the same with a million rows as with
ten (measured: bench/dashboard.py, bench/results/dashboard_million.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from ..config.settings import Settings
from ..db.base import COUNT_LIMIT, Publication, PublicationStats, ScheduleRecord, Store
from ..db.schedules import ScheduleStore, schedule_record
from ..status import collect_status

MAX_PAGE = 200
# The timeline pictures at most this many of the latest runs.
TIMELINE_RUNS = 2000
RUN_FAILED = ("failed", "timed_out", "abandoned")

PublicationView = Literal["upcoming", "recent"]


@dataclass(frozen=True, slots=True)
class Run:
    id: int
    name: str
    slot: datetime
    instance: str
    started_at: datetime
    finished_at: datetime | None
    status: str
    error: str | None

    @property
    def duration(self) -> float | None:
        if self.finished_at is None:
            return None
        return (self.finished_at - self.started_at).total_seconds()

    @property
    def failed(self) -> bool:
        return self.status in RUN_FAILED


@dataclass(frozen=True, slots=True)
class ScheduleQuery:
    """Which page of the schedules page: names that start with ``prefix`` (case-sensitive;
    '': all), in byte order, from the first, after or before a name, or the last."""

    prefix: str = ""
    after: str | None = None
    before: str | None = None
    last: bool = False

    @property
    def backward(self) -> bool:
        """Read from the end of the range down (the page before a name, the last)."""
        return self.before is not None or self.last


@dataclass(frozen=True, slots=True)
class SchedulePage:
    rows: list[ScheduleRecord]
    query: ScheduleQuery
    has_previous: bool
    has_next: bool
    # How many schedules there are (None: unknown), and whether that is an estimate.
    total: int | None
    approximate: bool

    @property
    def search(self) -> str:
        return self.query.prefix

    @property
    def next_after(self) -> str | None:
        return self.rows[-1].name if self.has_next and self.rows else None

    @property
    def previous_before(self) -> str | None:
        return self.rows[0].name if self.has_previous and self.rows else None


@dataclass(frozen=True, slots=True)
class RunPage:
    runs: list[Run]
    failed_only: bool
    before: int | None
    limit: int

    @property
    def next_before(self) -> int | None:
        return self.runs[-1].id if len(self.runs) == self.limit else None


@dataclass(frozen=True, slots=True)
class Lane:
    """One instance's runs in the timeline, as fractions of its width."""

    instance: str
    bars: list[tuple[float, float, Run]]


@dataclass(frozen=True, slots=True)
class Timeline:
    start: datetime
    end: datetime
    lanes: list[Lane]
    shown: int


@dataclass(frozen=True, slots=True)
class Lateness:
    mean: float | None  # seconds, over the latest published rows
    worst: float | None
    oldest_due_wait: float | None  # how long the oldest due row has waited


@dataclass(frozen=True, slots=True)
class PublicationPage:
    view: PublicationView
    status: str | None
    rows: list[Publication]
    after: int | None  # the id of the row this page follows in the list (None: the first)
    has_next: bool
    stats: PublicationStats
    lateness: Lateness

    @property
    def next_after(self) -> int | None:
        return self.rows[-1].id if self.has_next and self.rows else None


def _run(row: dict[str, Any]) -> Run:
    return Run(**row)


def _publication(row: dict[str, Any]) -> Publication:
    return Publication(**row)


class Reads:
    """The dashboard's reads, on ``store``."""

    def __init__(self, store: Store, settings: Settings) -> None:
        self.store = store
        self.settings = settings

    async def cluster(self) -> dict[str, Any]:
        """`status`'s report: leaders from the lock manager, standbys, mode, schema."""
        return await collect_status(self.store, self.settings)

    async def schedules(self, query: ScheduleQuery, limit: int) -> SchedulePage:
        """A page of ``limit`` schedules: one more row is read, to tell whether there is
        another page that way."""
        block, params = schedule_read(query, limit + 1)
        async with self.store.transaction(readonly=True) as tx:
            rows = await tx.query(block, **params) if searchable(query) else []
            [estimate] = await tx.query("dashboard_schedules_estimate")
        more = len(rows) > limit
        records = [schedule_record(row) for row in rows[:limit]]
        if query.backward:
            records.reverse()
        total = None if estimate["schedules"] is None else int(estimate["schedules"])
        return SchedulePage(
            records, query,
            has_previous=more if query.backward else query.after is not None,
            has_next=query.before is not None if query.backward else more,
            total=total, approximate=bool(estimate["approximate"]),
        )  # fmt: skip

    async def schedule(self, name: str, history: int) -> tuple[ScheduleRecord | None, list[Run]]:
        async with self.store.transaction(readonly=True) as tx:
            record = await ScheduleStore(tx).get(name)
            runs = await tx.query("dashboard_schedule_runs", name=name, limit=history)
        return record, [_run(row) for row in runs]

    async def runs(self, failed_only: bool, before: int | None, limit: int) -> RunPage:
        block = "dashboard_runs_failed" if failed_only else "dashboard_runs"
        async with self.store.transaction(readonly=True) as tx:
            rows = await tx.query(block, before=before, limit=limit)
        return RunPage([_run(row) for row in rows], failed_only, before, limit)

    async def run(self, run_id: int) -> Run | None:
        async with self.store.transaction(readonly=True) as tx:
            rows = await tx.query("dashboard_run", id=run_id)
        return _run(rows[0]) if rows else None

    async def publications(
        self, view: PublicationView, status: str | None, after: int | None, limit: int
    ) -> PublicationPage:
        """A page of ``limit`` publications after the row ``after`` in the view's order
        (one more is read, to tell whether there is a next page)."""
        async with self.store.transaction(readonly=True) as tx:
            if view == "upcoming":
                rows = await tx.query(
                    "dashboard_publications_upcoming", after=after, limit=limit + 1
                )
            else:
                rows = await tx.query(
                    "dashboard_publications_recent", status=status, before=after, limit=limit + 1
                )
            [late] = await tx.query("dashboard_publication_lateness", sample=100)
        stats = await self.store.publication_stats(COUNT_LIMIT)
        lateness = Lateness(
            _seconds(late["mean_lateness"]), _seconds(late["max_lateness"]),
            _seconds(late["oldest_due_wait"]),
        )  # fmt: skip
        rows_read = [_publication(row) for row in rows[:limit]]
        return PublicationPage(view, status, rows_read, after, len(rows) > limit, stats, lateness)

    async def publication(self, publication_id: int) -> Publication | None:
        return await self.store.get(publication_id)


def successor(prefix: str) -> str | None:
    """The least string greater than every string that starts with ``prefix``, in code
    point order (byte order of their UTF-8: PostgreSQL's C collation, SQLite's BINARY):
    ``prefix`` with its last character incremented. None where there is none (an empty
    prefix, or one of U+10FFFF only): the range then has no end."""
    for end in range(len(prefix), 0, -1):
        following = ord(prefix[end - 1]) + 1
        if following <= 0x10FFFF:
            # Surrogates are no characters of UTF-8 text: U+D7FF is followed by U+E000.
            if 0xD800 <= following <= 0xDFFF:
                following = 0xE000
            return prefix[: end - 1] + chr(following)
    return None


def searchable(query: ScheduleQuery) -> bool:
    """Whether a name could be on the page at all: no name holds a NUL or a lone surrogate
    (client.pool refuses them; PostgreSQL's text cannot hold them, and a statement given
    one fails), and a URL can carry both."""
    texts = (query.prefix, query.after or "", query.before or "")
    return all("\x00" not in text and _encodes(text) for text in texts)


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate
        return False
    return True


def schedule_read(query: ScheduleQuery, rows: int) -> tuple[str, dict[str, Any]]:
    """The named block that reads ``query``'s page (``rows`` rows) and its parameters.

    A prefix's names are the range [prefix, successor(prefix)); the page after a name
    starts there (the name itself left out), the page before one ends below it, each
    within the prefix's range."""
    low, below = query.prefix, successor(query.prefix)
    params: dict[str, Any] = {"limit": rows}
    if query.backward:
        if query.before is not None:
            below = query.before if below is None else min(below, query.before)
        direction = "backward"
    else:
        if query.after is not None:
            low = max(low, query.after)
        params["after"] = query.after
        direction = "forward"
    params["low"] = low
    if below is None:
        return f"dashboard_schedules_{direction}", params
    return f"dashboard_schedules_{direction}_below", params | {"below": below}


def _seconds(value: Any) -> float | None:
    """Seconds as a float (PostgreSQL's ``extract`` gives a numeric)."""
    return None if value is None else float(value)


def timeline(runs: list[Run], longest: float, shortest: float = 60.0) -> Timeline:
    """``runs`` (newest first), one lane per instance: a failover shows as one lane ending
    and another taking over. It spans the runs given, ``shortest`` to ``longest`` seconds
    back from now."""
    now = time.time()
    oldest = min((run.started_at.timestamp() for run in runs), default=now)
    window = min(longest, max(shortest, (now - oldest) * 1.05))
    end = datetime.fromtimestamp(now, UTC)
    start = datetime.fromtimestamp(now - window, UTC)
    lanes: dict[str, list[tuple[float, float, Run]]] = {}
    for run in runs:
        finished = run.finished_at or end
        if finished < start:
            continue
        left = max(0.0, (run.started_at - start).total_seconds() / window)
        right = min(1.0, (finished - start).total_seconds() / window)
        lanes.setdefault(run.instance, []).append((left, max(right, left), run))
    ordered = [Lane(instance, bars[::-1]) for instance, bars in sorted(lanes.items())]
    return Timeline(start, end, ordered, sum(len(lane.bars) for lane in ordered))
