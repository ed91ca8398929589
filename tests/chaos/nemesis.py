"""The nemesis: faults at random times, from a seed, each logged with its wall-clock span.

The plan is a pure function of the seed, the duration and the fault kinds on offer
(:func:`plan`), so a failing seed replays the same sequence of intents. Who a fault hits
is decided when it fires ("the publish leader", "a random replica"), because which
process leads then depends on what the earlier faults did; the history records the name
(and, for a fault on a process, the incarnation).

The plan is a sequence of *episodes*, each followed by a quiet gap (the system's recovery
is part of what is measured: failover time per kind is fault start → next work by another
instance). An episode is one fault, or two that overlap, as real incidents do: an *outer*
fault, and an *inner* one that starts while the outer is in effect (``during``), at
``offset`` seconds into the outer's hold. Any two kinds may overlap except two faults of
PostgreSQL itself (:func:`may_overlap`), in either order: a SIGKILL of the leader during a
partition, a clock step during a PostgreSQL restart, a SIGSTOP during a primary failover,
a partition of a replica whose process is down.

A fault is *inflicted* (the signal sent, the link cut, the server stopped), *held* for its
duration, then *healed* (the restart, SIGCONT, the link back, the server started, the
standby promoted). The outer of a pair is healed only once the inner is inflicted, so the
two always overlap, also when the outer's hold is nothing but the time its own healing
takes (a restart of PostgreSQL, a clock step, a failover: the inner lands while the server
is down, the replica is stopped, the old primary is dead and the standby not yet promoted).

Two faults on one replica at once (:func:`share_replica`) compose when they are different
things: a fault of its link and a fault of its process (a process killed or restarted
inside a cut namespace comes up cut); a partition and a bad link (the cut wins while it
lasts, the bad link is back after it if it still holds); a kill, a stop or a clock step of
a frozen process (the freeze ends there, and its fault is recorded as ending there). They
conflict when one would undo the other or there is nothing left to hit: two partitions or
two bad links of one link (the first heal would end the second early), two SIGSTOPs (the
first SIGCONT would end the second), anything aimed at a process that a kill or a restart
is already taking down. A conflicting inner fault goes to another replica
(:func:`choose_replica`), and the history says where it was aimed.

A run may give every link a *standing* delay (``ChaosConfig.rtt_ms``: replicas a distance
from their database). A bad link then adds its delay on top of it, and a fault of a link
ends back at it, never at a clean link: a heal, a bad link's end.

Two faults change the cluster's membership, as an autoscaler or a rolling deploy does: a
*scale_up* starts a process on one of two spare replicas (a fresh instance id; it joins,
and with sharded leadership takes shards over) and stops it gracefully after its hold; a
*scale_down* SIGTERMs a replica (a graceful leave: its shards or its lock are handed
over) and starts it again only after its hold. At least ``MIN_RUNNING`` replicas stay
running, and at most the configured count + ``SPARES`` run. A joined replica is a replica
like the others while it runs: an inner fault may kill, freeze or cut it.
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
    "scale_up",
    "scale_down",
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
    "scale_up": 2,
    "scale_down": 2,
}

# Faults of one replica's process, of its link, and of PostgreSQL itself. A scale_down is
# a SIGTERM whose replica stays away for the hold (a graceful leave, and a rejoin after);
# a scale_up starts a process on a spare replica (a join) and stops it after the hold.
PROCESS_FAULTS: frozenset[FaultKind] = frozenset(
    {"sigkill", "sigterm", "sigstop", "clock_skew", "scale_down"}
)
LINK_FAULTS: frozenset[FaultKind] = frozenset({"partition", "netem"})
DATABASE_FAULTS: frozenset[FaultKind] = frozenset(
    {"pg_restart_fast", "pg_restart_immediate", "failover_sync", "failover_async"}
)
# Faults that change how many replicas run: the cluster's membership.
MEMBERSHIP_FAULTS: frozenset[FaultKind] = frozenset({"scale_up", "scale_down"})
# Faults aimed at one replica: at the leader of a loop most of the time (that is where a
# fault can break a promise), at any replica otherwise; a scale_up at a spare one.
REPLICA_FAULTS: frozenset[FaultKind] = PROCESS_FAULTS | LINK_FAULTS | {"scale_up"}
# Process faults that end the process they hit (and start another, at once or after the
# hold).
ENDS_PROCESS: frozenset[FaultKind] = frozenset({"sigkill", "sigterm", "clock_skew", "scale_down"})
# Membership bounds: a scale_down never leaves fewer than MIN_RUNNING replicas running;
# a scale_up adds one of SPARES replicas kept for it (at most the configured count + 2).
MIN_RUNNING = 2
SPARES = 2

# How likely an episode is a pair of overlapping faults rather than one fault.
OVERLAP = 0.4

Target = Literal["leader:publish", "leader:plugin", "random", "postgres", "outer", "spare"]


@dataclass(frozen=True, slots=True)
class Intent:
    """One planned fault: when (seconds after the run's start), what, at whom, how long.

    ``during``: the ``id`` of the fault this one starts inside of (None: it starts alone),
    ``offset`` seconds after that fault is in effect; ``at`` is then when it is planned to
    start if the outer takes no time to inflict."""

    at: float
    kind: FaultKind
    target: Target  # "outer": the replica the outer fault hit; "spare": one not running
    pick: float  # in [0, 1): which replica when target is "random", or when retargeted
    duration: float  # how long the fault is held before it is healed (kind-specific)
    skew_minutes: float  # clock_skew only: the offset, signed
    id: int = 0  # its place in the plan
    during: int | None = None
    offset: float = 0.0


def may_overlap(a: FaultKind, b: FaultKind) -> bool:
    """Whether faults of kinds `a` and `b` may be drawn as a pair.

    Not two faults of PostgreSQL: the run's PostgreSQL has one control plane, as a real one
    does (one orchestrator, one pair of nodes), and its operations cannot interleave: a
    restart during a failover would stop the new primary under the standby's
    ``pg_basebackup``, a second restart would race the first's start-up, a failover needs
    a primary up and a standby streaming before it begins. A second operation on the
    server waits for the first (and then it is the next episode, not an overlap).
    """
    return not (a in DATABASE_FAULTS and b in DATABASE_FAULTS)


def share_replica(active: FaultKind, new: FaultKind) -> bool:
    """Whether a fault of kind `new` may hit a replica that a fault of kind `active` is
    hitting now (see the module docstring)."""
    if active in LINK_FAULTS and new in LINK_FAULTS:
        return active != new
    if active in PROCESS_FAULTS and new in PROCESS_FAULTS:
        return active == "sigstop" and new in ENDS_PROCESS
    return True


@dataclass(frozen=True, slots=True)
class ReplicaState:
    """What target choice needs to know of a replica when a fault fires."""

    name: str
    alive: bool  # a process of it runs (and no fault is taking it down)
    active: tuple[FaultKind, ...] = ()  # the faults hitting it now
    spare: bool = False  # kept for a scale_up, and no process of it runs now


def choose_replica(
    kind: FaultKind, preferred: str | None, pick: float, replicas: Sequence[ReplicaState]
) -> str | None:
    """The replica a fault of `kind` hits: `preferred` (the leader it was aimed at, the
    outer fault's replica, or a random one) if the fault can hit it now, else another one
    chosen by `pick` among those it can; None if there is none.

    A process fault needs a process to hit (a replica whose process is down or being taken
    down has none); a link fault can cut the link of such a replica too, but only when
    aimed at it (its next process then comes up behind the cut). Either composes with
    what already hits the replica only as :func:`share_replica` says.

    A scale_up starts a spare replica (one that is not running and nothing hits), chosen
    by `pick`; a scale_down needs MIN_RUNNING replicas running besides the one it stops
    (None otherwise: the fault is skipped, and the history says why)."""

    if kind == "scale_up":
        spares = [state.name for state in replicas if state.spare and not state.active]
        return spares[min(int(pick * len(spares)), len(spares) - 1)] if spares else None
    if kind == "scale_down" and sum(state.alive for state in replicas) - 1 < MIN_RUNNING:
        return None

    def can(state: ReplicaState, aimed: bool) -> bool:
        if state.spare or not all(share_replica(active, kind) for active in state.active):
            return False
        return state.alive or (aimed and kind in LINK_FAULTS)

    by_name = {state.name: state for state in replicas}
    if preferred is not None and preferred in by_name and can(by_name[preferred], True):
        return preferred
    candidates = [state.name for state in replicas if can(state, False)]
    if not candidates:
        return None
    return candidates[min(int(pick * len(candidates)), len(candidates) - 1)]


def plan(
    seed: int,
    duration: float,
    kinds: Sequence[FaultKind],
    *,
    warmup: float = 4.0,
    cooldown: float = 8.0,
    mean_gap: float = 3.0,
    overlap: float = OVERLAP,
    guaranteed: Sequence[FaultKind] = (),
    guaranteed_pairs: Sequence[tuple[FaultKind, FaultKind]] = (),
) -> list[Intent]:
    """Episodes between `warmup` and `duration - cooldown`, with gaps of mean `mean_gap` s;
    each a pair of overlapping faults with probability `overlap`, else one fault.

    Each (outer, inner) pair in `guaranteed_pairs` is drawn at least once, and each kind
    in `guaranteed` (alone, unless a guaranteed pair has it already), when the run is long
    enough (the short slice in `make test` must cover partitions, failover and overlapping
    faults, whatever the seed); they are placed first, in an order drawn from the seed.
    """
    if not kinds:
        return []
    rng = random.Random(seed)
    on_offer = list(kinds)
    to_place: list[tuple[FaultKind, ...]] = [
        (outer, inner)
        for outer, inner in guaranteed_pairs
        if outer in kinds and inner in kinds and may_overlap(outer, inner)
    ]
    paired = {kind for pair in to_place for kind in pair}
    to_place += [(kind,) for kind in guaranteed if kind in kinds and kind not in paired]
    rng.shuffle(to_place)
    intents: list[Intent] = []
    now = warmup
    end = duration - cooldown
    while True:
        episode = to_place.pop() if to_place else (_draw(rng, on_offer),)
        if len(episode) == 1 and rng.random() < overlap:
            partners = [kind for kind in on_offer if may_overlap(episode[0], kind)]
            if partners:
                partner = _draw(rng, partners)
                episode = (episode[0], partner) if rng.random() < 0.5 else (partner, episode[0])
        outer = _intent(rng, episode[0], len(intents), now)
        span = outer.duration
        placed = [outer]
        if len(episode) == 2:
            # Into the outer's hold: early, late, or (a hold of nothing but the healing)
            # at once, while it is healed.
            offset = round(rng.uniform(0.1, 0.9) * outer.duration, 2) if outer.duration else 0.0
            inner = _intent(rng, episode[1], outer.id + 1, now + offset, outer, offset)
            span = max(span, offset + inner.duration)
            placed.append(inner)
        if now + span > end:
            break
        intents += placed
        recovery = max(_recovery(intent.kind) for intent in placed)
        now += span + recovery + rng.expovariate(1 / mean_gap)
    return intents


def episodes(intents: Sequence[Intent]) -> list[list[Intent]]:
    """The plan's episodes in order: each intent with the one it starts during."""
    grouped: list[list[Intent]] = []
    for intent in intents:
        if intent.during is not None and grouped and grouped[-1][0].id == intent.during:
            grouped[-1].append(intent)
        else:
            grouped.append([intent])
    return grouped


def _draw(rng: random.Random, kinds: Sequence[FaultKind]) -> FaultKind:
    return rng.choices(list(kinds), [WEIGHTS[kind] for kind in kinds])[0]


def _intent(
    rng: random.Random,
    kind: FaultKind,
    ident: int,
    at: float,
    outer: Intent | None = None,
    offset: float = 0.0,
) -> Intent:
    length = _duration(kind, rng)
    target: Target
    if kind not in REPLICA_FAULTS:
        target = "postgres"
    elif kind == "scale_up":
        target = "spare"
    elif outer is not None and outer.kind in REPLICA_FAULTS and share_replica(outer.kind, kind):
        # Aimed at the outer's replica about a quarter of the time: a fault of the link of a
        # replica whose process is down, a kill of a partitioned or frozen leader, of a
        # replica that has just joined (a scale_up's), a leave of a frozen one. Aimed
        # at a leader, it often lands there too (the lock has not moved yet) or on the
        # new leader (a second failure during the takeover).
        options: list[Target] = ["leader:publish", "leader:plugin", "random", "outer"]
        target = rng.choices(options, [3, 3, 2, 3])[0]
    else:
        aims: list[Target] = ["leader:publish", "leader:plugin", "random"]
        target = rng.choices(aims, [3, 3, 2])[0]
    skew = rng.choice([-1, 1]) * rng.uniform(1, 10) if kind == "clock_skew" else 0.0
    during = outer.id if outer is not None else None
    return Intent(round(at, 3), kind, target, rng.random(), length, skew, ident, during, offset)


def _duration(kind: FaultKind, rng: random.Random) -> float:
    """How long the fault is held, drawn for its kind (seconds; rounded for readable logs)."""
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
        "scale_up": (4.0, 15.0),  # one more replica, then it leaves (SIGTERM)
        "scale_down": (4.0, 15.0),  # one fewer (SIGTERM), then it joins again
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
        # The last membership change (the leave after a scale_up, the rejoin after a
        # scale_down) is at the end of the hold: its rebalance has to finish.
        "scale_up": 3.0,
        "scale_down": 3.0,
    }.get(kind, 2.0)


def planned_pairs(intents: Sequence[Intent]) -> list[tuple[FaultKind, FaultKind]]:
    """(outer, inner) kinds of each planned pair, in plan order."""
    return [(group[0].kind, group[1].kind) for group in episodes(intents) if len(group) == 2]
