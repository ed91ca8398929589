"""What the dashboard shows, read from the database and the lock manager: never from this
replica's memory, so every replica shows the same cluster.

Each read is one short read-only transaction, bounded by the callers' timeout. The pages
read pages of at most ``MAX_PAGE`` rows: runs and publications through an index, so a
page of them costs the same with a million rows; the schedules page counts its matches
(measured: 10,000 schedules in 233 ms, tests/test_dashboard.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from ..config.settings import Settings
from ..db.base import Publication, PublicationStats, ScheduleRecord, Store
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
class SchedulePage:
    rows: list[ScheduleRecord]
    matches: int
    search: str | None
    offset: int
    limit: int

    @property
    def next_offset(self) -> int | None:
        following = self.offset + self.limit
        return following if following < self.matches else None

    @property
    def previous_offset(self) -> int | None:
        return max(0, self.offset - self.limit) if self.offset else None


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
    offset: int
    limit: int
    stats: PublicationStats
    lateness: Lateness

    @property
    def next_offset(self) -> int | None:
        return self.offset + self.limit if len(self.rows) == self.limit else None

    @property
    def previous_offset(self) -> int | None:
        return max(0, self.offset - self.limit) if self.offset else None


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

    async def schedules(self, search: str | None, offset: int, limit: int) -> SchedulePage:
        async with self.store.transaction(readonly=True) as tx:
            rows = await tx.query(
                "dashboard_schedules", search=search or None, limit=limit, offset=offset
            )
        matches = rows[0]["matches"] if rows else 0
        if not rows and offset:  # past the end: the count is still wanted
            async with self.store.transaction(readonly=True) as tx:
                first = await tx.query("dashboard_schedules", search=search or None, limit=1,
                                       offset=0)  # fmt: skip
            matches = first[0]["matches"] if first else 0
        records = [
            schedule_record({k: v for k, v in row.items() if k != "matches"}) for row in rows
        ]
        return SchedulePage(records, int(matches), search, offset, limit)

    async def schedule(self, name: str, history: int) -> tuple[ScheduleRecord | None, list[Run]]:
        async with self.store.transaction(readonly=True) as tx:
            record = await ScheduleStore(tx).get(name)
            runs = await tx.query("dashboard_schedule_runs", name=name, limit=history)
        return record, [_run(row) for row in runs]

    async def runs(self, failed_only: bool, before: int | None, limit: int) -> RunPage:
        async with self.store.transaction(readonly=True) as tx:
            rows = await tx.query("dashboard_runs", before=before, failed=failed_only, limit=limit)
        return RunPage([_run(row) for row in rows], failed_only, before, limit)

    async def run(self, run_id: int) -> Run | None:
        async with self.store.transaction(readonly=True) as tx:
            rows = await tx.query("dashboard_run", id=run_id)
        return _run(rows[0]) if rows else None

    async def publications(
        self, view: PublicationView, status: str | None, offset: int, limit: int
    ) -> PublicationPage:
        async with self.store.transaction(readonly=True) as tx:
            if view == "upcoming":
                rows = await tx.query("dashboard_publications_upcoming", limit=limit, offset=offset)
            else:
                rows = await tx.query(
                    "dashboard_publications_recent", status=status, limit=limit, offset=offset
                )
            [late] = await tx.query("dashboard_publication_lateness", sample=100)
        stats = await self.store.publication_stats()
        lateness = Lateness(
            _seconds(late["mean_lateness"]), _seconds(late["max_lateness"]),
            _seconds(late["oldest_due_wait"]),
        )  # fmt: skip
        rows_read = [_publication(row) for row in rows]
        return PublicationPage(view, status, rows_read, offset, limit, stats, lateness)

    async def publication(self, publication_id: int) -> Publication | None:
        return await self.store.get(publication_id)


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
