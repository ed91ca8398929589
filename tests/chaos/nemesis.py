"""The nemesis: faults at random times, from a seed, each logged with its wall-clock span.

The plan is a pure function of the seed, the duration and the fault kinds on offer
(:func:`plan`), so a failing seed replays the same sequence of intents. Who a fault hits
is decided when it fires ("the publish leader", "a random replica"), because which
process leads then depends on what the earlier faults did; the history records the name.

Faults run one at a time, with a quiet gap after each (the system's recovery is part of
what is measured: failover time per kind is fault start → next work by another instance).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

FaultKind = Literal[
    "sigkill",
    "sigterm",
    "sigstop",
    "pg_restart_fast",
    "pg_restart_immediate",
    "partition",
    "netem",
    "failover_sync",
    "failover_async",
    "clock_skew",
]
ALL_KINDS: tuple[FaultKind, ...] = get_args(FaultKind)

# How often each kind is drawn, relative to the others. Process faults are the common
# case in production; primary failover is rare and slow (a new standby is built after).
WEIGHTS: dict[FaultKind, float] = {
    "sigkill": 4,
    "sigterm": 2,
    "sigstop": 3,
    "pg_restart_fast": 1,
    "pg_restart_immediate": 1,
    "partition": 3,
    "netem": 2,
    "failover_sync": 1,
    "failover_async": 1,
    "clock_skew": 1,
}

# Faults aimed at one replica: at the leader of a loop most of the time (that is where a
# fault can break a promise), at any replica otherwise.
REPLICA_FAULTS: frozenset[FaultKind] = frozenset(
    {"sigkill", "sigterm", "sigstop", "partition", "netem", "clock_skew"}
)


@dataclass(frozen=True, slots=True)
class Intent:
    """One planned fault: when (seconds after the run's start), what, at whom, how long."""

    at: float
    kind: FaultKind
    target: str  # "leader:publish", "leader:plugin", "random", or "postgres"
    pick: float  # in [0, 1): which replica when target is "random"
    duration: float  # how long the fault lasts before it is healed (kind-specific)
    skew_minutes: float  # clock_skew only: the offset, signed


def plan(
    seed: int,
    duration: float,
    kinds: Sequence[FaultKind],
    *,
    warmup: float = 4.0,
    cooldown: float = 8.0,
    mean_gap: float = 3.0,
    guaranteed: Sequence[FaultKind] = (),
) -> list[Intent]:
    """Faults between `warmup` and `duration - cooldown`, with gaps of mean `mean_gap` s.

    Each kind in `guaranteed` is drawn at least once when the run is long enough (the
    short slice in `make test` must cover partitions and failover, whatever the seed).
    """
    if not kinds:
        return []
    rng = random.Random(seed)
    weights = [WEIGHTS[kind] for kind in kinds]
    to_place = [kind for kind in guaranteed if kind in kinds]
    rng.shuffle(to_place)
    intents: list[Intent] = []
    now = warmup
    end = duration - cooldown
    while True:
        kind = to_place.pop() if to_place else rng.choices(list(kinds), weights)[0]
        length = _duration(kind, rng)
        if now + length > end:
            break
        if kind in REPLICA_FAULTS:
            target = rng.choices(["leader:publish", "leader:plugin", "random"], [3, 3, 2])[0]
        else:
            target = "postgres"
        skew = rng.choice([-1, 1]) * rng.uniform(1, 10) if kind == "clock_skew" else 0.0
        intents.append(Intent(round(now, 3), kind, target, rng.random(), length, skew))
        now += length + _recovery(kind) + rng.expovariate(1 / mean_gap)
    return intents


def _duration(kind: FaultKind, rng: random.Random) -> float:
    """How long the fault lasts, drawn for its kind (seconds; rounded for readable logs)."""
    low, high = {
        "sigkill": (0.3, 2.0),  # down, then restarted
        "sigterm": (0.3, 2.0),
        "sigstop": (0.5, 6.0),  # past stall_timeout (3 s) about half the time
        "pg_restart_fast": (0.0, 0.0),
        "pg_restart_immediate": (0.0, 0.0),
        "partition": (3.0, 10.0),  # long enough, mostly, for the server to notice
        "netem": (2.0, 6.0),
        "failover_sync": (0.0, 0.0),
        "failover_async": (0.0, 0.0),
        "clock_skew": (0.0, 0.0),  # the replica lives skewed until its next restart
    }[kind]
    return round(rng.uniform(low, high), 2)


def _recovery(kind: FaultKind) -> float:
    """Quiet time after a fault before the next may start: the takeover has to be able to
    finish (a partitioned leader's lock is freed after ~3-4 s), or the faults blur."""
    return {
        "partition": 5.0,
        "failover_sync": 6.0,
        "failover_async": 6.0,
        "pg_restart_fast": 3.0,
        "pg_restart_immediate": 4.0,
        "sigstop": 4.0,
    }.get(kind, 2.0)
