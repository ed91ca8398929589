"""When slots fall (intervals, cron in a timezone across DST) and what ``plan`` does with a
slot that is due, late or very late. Pure: fixed dates, no clock, no database."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from itertools import pairwise
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scheduler_daemon.plugins.tasks import Cron, Every, Schedule, plan

BERLIN = ZoneInfo("Europe/Berlin")
NEW_YORK = ZoneInfo("America/New_York")


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)  # type: ignore[misc]


def slots(schedule: Schedule, after: datetime, until: datetime) -> Iterator[datetime]:
    """Every slot strictly after `after` and up to `until`, following next_after."""
    slot = schedule.next_after(after)
    while slot <= until:
        yield slot
        following = schedule.next_after(slot)
        assert following > slot, f"{schedule.describe()}: {following} does not follow {slot}"
        slot = following


def local_times(instants: Iterator[datetime], tz: ZoneInfo) -> list[str]:
    return [instant.astimezone(tz).isoformat() for instant in instants]


# -- intervals --------------------------------------------------------------------------


def test_interval_slots_are_evenly_spaced_from_the_first() -> None:
    every = Every(30)
    start = utc(2026, 1, 1, 12, 0, 7)
    assert every.first(start) == start  # a new interval task runs at once
    assert list(slots(every, start, start + timedelta(minutes=2))) == [
        start + timedelta(seconds=30 * n) for n in range(1, 5)
    ]
    assert every.describe() == "every 30s"


def test_interval_slots_ignore_local_time_and_dst() -> None:
    every = Every(3600)
    start = utc(2026, 3, 29, 0, 0)  # 01:00 CET, an hour before clocks jump in Berlin
    hours = list(slots(every, start, start + timedelta(hours=3)))
    assert [b - a for a, b in pairwise(hours)] == [timedelta(hours=1)] * 2


def test_fractional_intervals() -> None:
    every = Every(0.25)
    start = utc(2026, 1, 1)
    assert every.next_after(start) == start + timedelta(milliseconds=250)
    assert every.first_after(start, start + timedelta(seconds=1)) == start + timedelta(seconds=1.25)


# -- cron, fixed dates across DST -------------------------------------------------------


def test_cron_in_utc() -> None:
    cron = Cron("*/5 * * * *", "UTC")
    assert cron.first(utc(2026, 1, 1, 12, 3)) == utc(2026, 1, 1, 12, 5)
    assert cron.next_after(utc(2026, 1, 1, 12, 5)) == utc(2026, 1, 1, 12, 10)
    assert cron.describe() == "cron */5 * * * * UTC"


def test_cron_slots_are_utc_instants() -> None:
    slot = Cron("0 9 * * *", "Europe/Berlin").next_after(utc(2026, 1, 1))
    assert slot.tzinfo is UTC
    assert slot == utc(2026, 1, 1, 8, 0)  # 09:00 CET


def test_daily_0230_berlin_spring_forward_runs_once_each_day() -> None:
    # 2026-03-29 02:00 CET -> 03:00 CEST: 02:30 does not exist that day. Like cron, the
    # job runs once, as soon as the wall clock has passed 02:30 (at 03:00 CEST).
    cron = Cron("30 2 * * *", "Europe/Berlin")
    runs = local_times(slots(cron, utc(2026, 3, 27, 12), utc(2026, 3, 31, 12)), BERLIN)
    assert runs == [
        "2026-03-28T02:30:00+01:00",
        "2026-03-29T03:00:00+02:00",
        "2026-03-30T02:30:00+02:00",
        "2026-03-31T02:30:00+02:00",
    ]


def test_daily_0230_berlin_fall_back_runs_once_each_day() -> None:
    # 2026-10-25 03:00 CEST -> 02:00 CET: 02:30 happens twice. It runs the first time only.
    cron = Cron("30 2 * * *", "Europe/Berlin")
    runs = local_times(slots(cron, utc(2026, 10, 23, 12), utc(2026, 10, 27, 12)), BERLIN)
    assert runs == [
        "2026-10-24T02:30:00+02:00",
        "2026-10-25T02:30:00+02:00",
        "2026-10-26T02:30:00+01:00",
        "2026-10-27T02:30:00+01:00",
    ]


@pytest.mark.parametrize(
    ("expression", "tz", "after", "expected"),
    [
        # Several slots inside the repeated hour: each wall time once, the first time.
        (
            "0,30 2 * * *",
            "Europe/Berlin",
            utc(2026, 10, 24, 12),
            [
                "2026-10-25T02:00:00+02:00",
                "2026-10-25T02:30:00+02:00",
                "2026-10-26T02:00:00+01:00",
                "2026-10-26T02:30:00+01:00",
            ],
        ),
        (
            "*/20 1 * * *",
            "America/New_York",
            utc(2026, 10, 31, 12),
            [
                "2026-11-01T01:00:00-04:00",
                "2026-11-01T01:20:00-04:00",
                "2026-11-01T01:40:00-04:00",
                "2026-11-02T01:00:00-05:00",
                "2026-11-02T01:20:00-05:00",
                "2026-11-02T01:40:00-05:00",
            ],
        ),
    ],
)
def test_fixed_hour_jobs_run_each_wall_time_once_when_clocks_go_back(
    expression: str, tz: str, after: datetime, expected: list[str]
) -> None:
    cron = Cron(expression, tz)
    runs = local_times(slots(cron, after, after + timedelta(days=2)), ZoneInfo(tz))
    assert runs == expected


@pytest.mark.parametrize(
    ("tz", "day"),
    [
        ("Europe/Berlin", utc(2026, 3, 29)),  # spring forward
        ("Europe/Berlin", utc(2026, 10, 25)),  # fall back
        ("America/New_York", utc(2026, 3, 8, 4)),  # spring forward
        ("America/New_York", utc(2026, 11, 1, 4)),  # fall back
    ],
)
def test_every_half_hour_runs_at_every_real_half_hour(tz: str, day: datetime) -> None:
    # A job with no fixed hour follows real time: the repeated hour runs twice (it is two
    # real hours), the skipped hour not at all (it never happened).
    cron = Cron("*/30 * * * *", tz)
    runs = list(slots(cron, day - timedelta(minutes=1), day + timedelta(hours=24)))
    assert runs == [day + timedelta(minutes=30 * n) for n in range(49)]


def test_hourly_new_york_fall_back_runs_the_repeated_hour_twice() -> None:
    cron = Cron("0 * * * *", "America/New_York")
    runs = local_times(slots(cron, utc(2026, 11, 1, 3, 30), utc(2026, 11, 1, 8)), NEW_YORK)
    assert runs == [
        "2026-11-01T00:00:00-04:00",
        "2026-11-01T01:00:00-04:00",
        "2026-11-01T01:00:00-05:00",
        "2026-11-01T02:00:00-05:00",
        "2026-11-01T03:00:00-05:00",
    ]


def test_daily_new_york_across_both_changes() -> None:
    spring = Cron("30 2 * * *", "America/New_York")  # 02:00 EST -> 03:00 EDT on 03-08
    runs = local_times(slots(spring, utc(2026, 3, 6, 12), utc(2026, 3, 9, 12)), NEW_YORK)
    assert runs == [
        "2026-03-07T02:30:00-05:00",
        "2026-03-08T03:00:00-04:00",
        "2026-03-09T02:30:00-04:00",
    ]
    fall = Cron("30 1 * * *", "America/New_York")  # 01:30 happens twice on 11-01
    runs = local_times(slots(fall, utc(2026, 10, 31, 12), utc(2026, 11, 2, 12)), NEW_YORK)
    assert runs == ["2026-11-01T01:30:00-04:00", "2026-11-02T01:30:00-05:00"]


# -- plan: on time, late, very late -----------------------------------------------------


def test_plan_on_time_runs_and_moves_to_the_next_slot() -> None:
    slot = utc(2026, 1, 1, 12)
    step = plan(Every(60), slot, slot + timedelta(seconds=1), "run_once")
    assert step.run
    assert not step.missed
    assert step.next_run_at == slot + timedelta(seconds=60)


def test_plan_on_time_is_the_same_for_skip() -> None:
    slot = utc(2026, 1, 1, 12)
    step = plan(Every(60), slot, slot + timedelta(seconds=59), "skip")
    assert (step.run, step.missed, step.next_run_at) == (True, False, slot + timedelta(seconds=60))


def test_plan_one_period_late_run_once_catches_up_once_and_keeps_the_phase() -> None:
    slot = utc(2026, 1, 1, 12)
    now = slot + timedelta(seconds=90)  # the slot at +60 passed too
    step = plan(Every(60), slot, now, "run_once")
    assert step.run  # one catch-up run, for `slot`
    assert step.missed
    assert step.next_run_at == slot + timedelta(seconds=120)  # after now, on the old phase
    assert step.next_run_at > now


def test_plan_one_period_late_skip_does_not_run() -> None:
    slot = utc(2026, 1, 1, 12)
    step = plan(Every(60), slot, slot + timedelta(seconds=90), "skip")
    assert not step.run
    assert step.missed
    assert step.next_run_at == slot + timedelta(seconds=120)


def test_plan_exactly_on_the_following_slot_counts_as_missed() -> None:
    slot = utc(2026, 1, 1, 12)
    step = plan(Every(60), slot, slot + timedelta(seconds=60), "run_once")
    assert step.run
    assert step.missed
    assert step.next_run_at == slot + timedelta(seconds=120)


def test_plan_after_days_of_downtime_runs_once_not_a_burst() -> None:
    slot = utc(2026, 1, 1, 12)
    now = slot + timedelta(days=3, seconds=17)
    step = plan(Every(60), slot, now, "run_once")
    assert step.run  # once: one Plan is one run, whatever the backlog
    assert step.next_run_at == now - timedelta(seconds=17) + timedelta(seconds=60)


def test_plan_cron_after_downtime() -> None:
    cron = Cron("0 3 * * *", "Europe/Berlin")
    slot = utc(2026, 3, 20, 2)  # 03:00 CET
    now = utc(2026, 3, 30, 9)
    step = plan(cron, slot, now, "run_once")
    assert step.run
    assert step.missed
    assert step.next_run_at == utc(2026, 3, 31, 1)  # 03:00 CEST, the first slot after now
    assert not plan(cron, slot, now, "skip").run


durations = st.floats(min_value=0.001, max_value=7 * 86400, allow_nan=False)
instants = st.datetimes(
    min_value=datetime(2000, 1, 1), max_value=datetime(2100, 1, 1), timezones=st.just(UTC)
)


@given(
    period=durations,
    slot=instants,
    late=st.floats(min_value=0, max_value=10 * 365 * 86400, allow_nan=False),
    misfire=st.sampled_from(["run_once", "skip"]),
)
def test_plan_interval_property(period: float, slot: datetime, late: float, misfire: str) -> None:
    """Whatever the slot, lateness and period: at most one run, next_run_at after now,
    and on the slot's phase."""
    now = slot + timedelta(seconds=late)
    step = plan(Every(period), slot, now, misfire)  # type: ignore[arg-type]
    assert step.next_run_at > now
    assert step.run == (misfire == "run_once" or not step.missed)
    # One Plan is one run at most; the one after it is not due yet, so no burst follows.
    assert plan(Every(period), step.next_run_at, now, misfire).next_run_at > now
    elapsed = (step.next_run_at - slot).total_seconds()
    periods = round(elapsed / period)
    assert periods >= 1
    # Phase kept (timedelta has microsecond resolution, hence the tolerance).
    assert abs(elapsed - periods * period) <= 1e-6 * periods + 1e-6
    if not step.missed:
        assert periods == 1


@given(
    expression=st.sampled_from(
        ["*/5 * * * *", "30 2 * * *", "0 */6 * * 1-5", "15,45 1 * * *", "0 0 1 * *"]
    ),
    tz=st.sampled_from(["UTC", "Europe/Berlin", "America/New_York", "Australia/Lord_Howe"]),
    slot=instants,
    late=st.floats(min_value=0, max_value=400 * 86400, allow_nan=False),
    misfire=st.sampled_from(["run_once", "skip"]),
)
def test_plan_cron_property(
    expression: str, tz: str, slot: datetime, late: float, misfire: str
) -> None:
    cron = Cron(expression, tz)
    now = slot + timedelta(seconds=late)
    step = plan(cron, slot, now, misfire)  # type: ignore[arg-type]
    assert step.next_run_at > now
    assert step.run == (misfire == "run_once" or not step.missed)
    assert step.missed == (cron.next_after(slot) <= now)


# -- invalid input ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "expression", ["", "* * * *", "61 * * * *", "* 25 * * *", "every day", "*/0 * * * *"]
)
def test_invalid_cron_expression_raises(expression: str) -> None:
    with pytest.raises(ValueError, match="invalid cron expression"):
        Cron(expression, "UTC")


@pytest.mark.parametrize("tz", ["Mars/Olympus_Mons", "Europe/Berln", "", "../etc/passwd"])
def test_unknown_timezone_raises(tz: str) -> None:
    with pytest.raises(ValueError, match="unknown timezone"):
        Cron("* * * * *", tz)
