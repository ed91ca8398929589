"""Which member leads which shard: a pure function of the members, the same on every one.

Bounded-load rendezvous hashing. Each shard ranks the members by a hash of (member,
shard) and goes to the highest-ranked member that has fewer than ``ceil(shards / n)``
shards so far, shards taken in order. So:

- every member computes the same assignment from the same member list, with no
  coordinator and nothing written anywhere (the locks decide who actually holds what:
  two members that briefly disagree only delay a shard, never share one);
- the largest share is at most ``ceil(shards / n)`` (64 shards, 3 members: 22 against a
  mean of 21.3);
- a member joining or leaving moves about the shards its share is made of, not a
  reshuffle of all of them (plain rendezvous hashing's property, kept by the bound
  except where a full member passes a shard on; tests/test_shard_assignment.py).

A member is named by its instance id, so that a replica restarted under the same id
ranks the same and gets its old shards back; the backend pid breaks ties between two
members given the same id by mistake.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, order=True)
class Member:
    name: str  # the instance id
    pid: int  # its lock session's backend pid


def _rank(member: Member, shard: int) -> tuple[bytes, int]:
    seed = f"{member.name}\x00{shard}".encode()
    return hashlib.blake2b(seed, digest_size=8).digest(), member.pid


def assign(members: Sequence[Member], shards: int) -> dict[Member, list[int]]:
    """Every member's shards (a member may get none when there are more members than
    shards)."""
    ordered = sorted(set(members))
    result: dict[Member, list[int]] = {member: [] for member in ordered}
    if not ordered:
        return result
    cap = math.ceil(shards / len(ordered))
    for shard in range(shards):
        for member in sorted(ordered, key=lambda m: _rank(m, shard), reverse=True):
            if len(result[member]) < cap:
                result[member].append(shard)
                break
    return result
