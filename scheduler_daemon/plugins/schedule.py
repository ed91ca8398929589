"""When a task's slots fall: fixed intervals, or cron expressions in an IANA timezone.

Slots are instants (aware UTC datetimes). ``plan`` turns "the slot the database says is
next" and "the database's now" into what to run and what comes after, applying the
misfire policy: after downtime, at most one catch-up run, never a burst.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterBadDateError, croniter

Misfire = Literal["run_once", "skip"]


def check_timezone(name: str) -> None:
    """Raise ValueError unless ``name`` is an IANA timezone this system knows."""
    try:
        ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"unknown timezone {name!r}") from None


@dataclass(frozen=True, slots=True)
class Every:
    seconds: float

    def first(self, now: datetime) -> datetime:
        return now  # a new interval task runs at once, then every `seconds`

    @property
    def step(self) -> timedelta:
        # Slots are whole steps of microseconds (timedelta's resolution) from the first:
        # exact integer arithmetic, so "strictly after now" never rounds onto now.
        return max(timedelta(seconds=self.seconds), timedelta(microseconds=1))

    def next_after(self, slot: datetime) -> datetime:
        return slot + self.step

    def first_after(self, slot: datetime, now: datetime) -> datetime:
        """The first slot strictly after ``now``, keeping the phase of ``slot``."""
        periods = (now - slot) // self.step + 1
        return slot + self.step * max(periods, 1)

    def describe(self) -> str:
        return f"every {self.seconds:g}s"


@dataclass(frozen=True, slots=True)
class Cron:
    expression: str
    timezone: str
    # Parsed once: every run computes its next slot from it (croniter parses anew per
    # instance, about 4 times the cost of the step itself).
    _iter: Any = field(init=False, repr=False, compare=False, hash=False)
    _tz: ZoneInfo = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        check_timezone(self.timezone)
        if not croniter.is_valid(self.expression):
            raise ValueError(f"invalid cron expression {self.expression!r}")
        object.__setattr__(self, "_tz", ZoneInfo(self.timezone))
        object.__setattr__(self, "_iter", croniter(self.expression, datetime.now(self._tz)))
        # A valid expression may name no date at all (30 February): every plugin tick would
        # fail computing its next slot, the other tasks' runs with it.
        try:
            self.next_after(datetime.now(UTC))
        except (CroniterBadDateError, OverflowError):
            raise ValueError(f"cron expression {self.expression!r} never matches a date") from None

    @property
    def _fixed_hours(self) -> bool:
        fields = self.expression.split()
        return len(fields) >= 2 and fields[1] != "*"

    def first(self, now: datetime) -> datetime:
        return self.next_after(now)

    def next_after(self, slot: datetime) -> datetime:
        tz = self._tz
        self._iter.set_current(slot.astimezone(tz), force=True)
        candidate: datetime = self._iter.get_next(datetime)
        # When clocks go back, an hour repeats. Like cron, a job pinned to an hour runs
        # once in it (the first time); a job on every hour runs at each real instant.
        while self._fixed_hours and _repeated_wall_time(candidate, tz):
            candidate = self._iter.get_next(datetime)
        return candidate.astimezone(UTC)

    def first_after(self, slot: datetime, now: datetime) -> datetime:
        return self.next_after(now)

    def describe(self) -> str:
        return f"cron {self.expression} {self.timezone}"


def _repeated_wall_time(local: datetime, tz: ZoneInfo) -> bool:
    """Whether ``local`` is the second occurrence of its wall time in ``tz`` (the hour
    that repeats when clocks go back)."""
    first = local.replace(tzinfo=None).replace(tzinfo=tz, fold=0)
    return first.astimezone(UTC) < local.astimezone(UTC)


def name_hash(name: str) -> int:
    """A schedule's name as a 64-bit number, the same in every process and release: what
    spreads schedules that are alike (their jitter, their history trims) over a range."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big")


def jitter_offset(name: str, jitter: float) -> timedelta:
    """A schedule's own offset in ``[0, jitter)``: from a hash of its name, so it is the
    same on every replica and across restarts, and thousands of schedules on one period
    spread over the jitter instead of all firing at one instant."""
    if jitter <= 0:
        return timedelta(0)
    fraction = name_hash(name) / 2**64
    return timedelta(microseconds=int(fraction * jitter * 1_000_000))


@dataclass(frozen=True, slots=True)
class Jittered:
    """``base``'s slots, each ``offset`` later (see :func:`jitter_offset`).

    A cron schedule's slots are its expression's instants plus the offset. An interval
    schedule's are put on a grid of their own: whole periods from the Unix epoch plus the
    offset. So schedules created at one instant (a bulk INSERT, whose rows all default to
    ``now()``) run together at most once, their first slot, and then each on its own phase,
    however their first slot was set."""

    base: Every | Cron
    offset: timedelta
    jitter: float  # the bound the offset was drawn within (part of the description)

    def first(self, now: datetime) -> datetime:
        if isinstance(self.base, Every):
            return self._on_grid(now, strictly_after=False)
        return self.next_after(now)

    def next_after(self, slot: datetime) -> datetime:
        if isinstance(self.base, Every):
            return self._on_grid(slot, strictly_after=True)
        return self.base.next_after(slot - self.offset) + self.offset

    def first_after(self, slot: datetime, now: datetime) -> datetime:
        if isinstance(self.base, Every):
            return self._on_grid(now, strictly_after=True)
        return self.base.first_after(slot - self.offset, now - self.offset) + self.offset

    def _on_grid(self, instant: datetime, strictly_after: bool) -> datetime:
        assert isinstance(self.base, Every)
        step = self.base.step
        origin = _EPOCH + self.offset % step
        periods, rest = divmod(instant - origin, step)
        if rest or strictly_after:
            periods += 1
        return origin + step * periods

    def describe(self) -> str:
        return f"{self.base.describe()} jitter {self.jitter:g}s"


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def with_jitter(base: Every | Cron, name: str, jitter: float) -> Schedule:
    if jitter <= 0:
        return base
    return Jittered(base, jitter_offset(name, jitter), jitter)


Schedule = Every | Cron | Jittered


@dataclass(frozen=True, slots=True)
class Plan:
    run: bool  # claim and run ``slot`` now
    next_run_at: datetime
    missed: bool  # at least one whole period passed without a run


def plan(schedule: Schedule, slot: datetime, now: datetime, misfire: Misfire) -> Plan:
    following = schedule.next_after(slot)
    if following > now:
        return Plan(run=True, next_run_at=following, missed=False)
    return Plan(
        run=misfire == "run_once",
        next_run_at=schedule.first_after(slot, now),
        missed=True,
    )
