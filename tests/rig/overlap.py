"""The one overlap rule every exclusion proof of the suite uses.

A proof of "one at a time" is a list of *intervals of work*, each recorded by the one who
did it: the probe's rows (``rig.ticks``: the database server's ``clock_timestamp()`` at the
start and end of a guarded transaction), the effects records written outside any
transaction (``rig.effects``: this host's wall clock, first and last record of a run), the
chaos history's runs and publications (``chaos.checker``), the webhook endpoint's requests
(its own monotonic clock). :func:`find_overlaps` applies one rule to all of them:

    Within one *scope* (a loop, a shard, a schedule, a publication: whatever the caller
    says may have one holder at a time), no two intervals of different *holders* (the
    instances, replicas) intersect. Two intervals ``[s1, e1]`` and ``[s2, e2]`` intersect
    when ``max(s1, s2) < min(e1, e2)``, or when one of them is a moment (``s == e``: work
    seen at one instant, an audit row, a run whose end is unknown) strictly inside the
    other (``s2 < s1 < e2``).

Touching endpoints are *not* an intersection: one interval ending at the very stamp the
next begins at is a hand-over, not two holders at once. Neither clock resolves finer than a
microsecond (PostgreSQL's ``clock_timestamp()``) or than what ``time.time()`` /
``time.monotonic()`` return on this host, so a hand-over within one tick of the clock
stamps both ends the same, and the rule cannot tell it from the real order. It adds no
tolerance either way: an overlap shorter than the clock's resolution is invisible to it,
any longer one is reported. An interval ending before it starts is an error of the
recorder, never data. All intervals given to one call must be stamped by one clock (the
database server's, or the wall clock of the one host that runs every replica): stamps of
replicas with skewed clocks cannot be compared.

``holder=None`` makes every interval its own holder: then no two intervals of a scope may
intersect at all, the same holder's included (a re-entrant tick, one publication in flight
twice).

What a caller does with an intersection (fail, or allow it as the documented
frozen-leader window and bound it) is the caller's; the rule is this module's alone.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar


class Span(Protocol):
    """Anything with a start and an end, in seconds of one clock."""

    @property
    def start(self) -> float: ...

    @property
    def end(self) -> float: ...


S = TypeVar("S", bound=Span)


@dataclass(frozen=True, slots=True)
class Overlap(Generic[S]):
    """Two intervals of one scope that intersect: `earlier` started first (or at the same
    stamp and ended no later)."""

    scope: str
    earlier: S
    later: S

    @property
    def seconds(self) -> float:
        """How long both were going (0 for a moment inside the other's interval)."""
        return max(0.0, min(self.earlier.end, self.later.end) - self.later.start)


def intersect(a: Span, b: Span) -> bool:
    """The rule for two intervals (see the module's docstring)."""
    low, high = max(a.start, b.start), min(a.end, b.end)
    if low < high:
        return True
    return low == high and any(
        x.start == x.end == low and y.start < low < y.end for x, y in ((a, b), (b, a))
    )


def find_overlaps(
    intervals: Iterable[S],
    *,
    scope: Callable[[S], str] = lambda interval: "",
    holder: Callable[[S], Hashable] | None = None,
) -> list[Overlap[S]]:
    """Every pair of intervals of one scope, of different holders, that intersect, in
    order of the later one's start. `holder` None: each interval is its own holder.

    A sweep in start order that keeps, per holder, the intervals still going: cheap for
    thousands of intervals as long as few of them go on at once.
    """
    who: Callable[[S], Hashable] = holder if holder is not None else id
    groups: dict[str, list[S]] = defaultdict(list)
    for interval in intervals:
        if interval.end < interval.start:
            raise AssertionError(f"an interval that ends before it starts: {interval}")
        groups[scope(interval)].append(interval)
    found: list[Overlap[S]] = []
    for name, items in groups.items():
        items.sort(key=lambda i: (i.start, i.end))
        going: dict[Hashable, list[tuple[float, int, S]]] = {}
        for index, current in enumerate(items):
            mine = who(current)
            for key in list(going):
                heap = going[key]
                # Ended by the time this one starts: it cannot meet this one or any later.
                while heap and heap[0][0] <= current.start:
                    heapq.heappop(heap)
                if not heap:
                    del going[key]
                elif key != mine:
                    for _, _, earlier in sorted(heap, key=lambda entry: entry[1]):
                        if intersect(earlier, current):
                            found.append(Overlap(name, earlier, current))
            heapq.heappush(going.setdefault(mine, []), (current.end, index, current))
    found.sort(key=lambda o: (o.later.start, o.earlier.start))
    return found
