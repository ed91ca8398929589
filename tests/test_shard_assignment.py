"""Sharded leadership's assignment (leadership/assignment.py): every member computes the
same one, no member's share passes ceil(K / n), every shard is assigned, and membership
changes move few shards."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_daemon.leadership.assignment import Member, assign
from scheduler_daemon.leadership.shard_keys import ShardKeys, member_name

names = st.lists(
    st.text(alphabet="abcdefghij0123456789-", min_size=1, max_size=12), min_size=1, max_size=8
)


def members(ids: list[str]) -> list[Member]:
    return [Member(name, 1000 + index) for index, name in enumerate(ids)]


@settings(max_examples=200, deadline=None)
@given(ids=names, shards=st.integers(min_value=1, max_value=256))
def test_every_shard_once_and_no_share_past_the_cap(ids: list[str], shards: int) -> None:
    group = members(ids)
    result = assign(group, shards)
    assigned = sorted(s for share in result.values() for s in share)
    assert assigned == list(range(shards))
    cap = math.ceil(shards / len(group))
    assert max(len(share) for share in result.values()) <= cap
    # The same answer whatever order the members were listed in.
    assert assign(list(reversed(group)), shards) == result


def test_balance_of_64_shards_over_3_members() -> None:
    result = assign(members(["r1", "r2", "r3"]), 64)
    shares = sorted(len(share) for share in result.values())
    assert shares[-1] / (64 / 3) <= 1.1, shares


def test_a_joining_member_takes_about_its_share_and_others_keep_the_rest() -> None:
    before = assign(members([f"replica-{i}" for i in range(3)]), 64)
    grown = members([f"replica-{i}" for i in range(4)])
    after = assign(grown, 64)
    owner_before = {s: m.name for m, share in before.items() for s in share}
    owner_after = {s: m.name for m, share in after.items() for s in share}
    moved = sum(owner_before[s] != owner_after[s] for s in range(64))
    # The newcomer's share (16) is the least that must move; a little cascade is allowed.
    assert 16 <= moved <= 24, moved


def test_a_member_restarted_under_its_id_gets_its_shards_back() -> None:
    first = assign([Member("a", 10), Member("b", 11), Member("c", 12)], 16)
    again = assign([Member("a", 10), Member("b", 99), Member("c", 12)], 16)
    by_name = {m.name: share for m, share in first.items()}
    assert {m.name: share for m, share in again.items()} == by_name


def test_keys_and_names() -> None:
    keys = ShardKeys(0x7B9C5F3E, 64)
    assert 0 <= keys.shard_class < 2**30 <= keys.member_class < 2**31  # int4, both
    assert keys.member_objid(4194303) == (63 << 22) | 4194303
    assert keys.member_objid(4194303) < 2**32
    assert keys.lock_key(5) == keys.shard_class << 32 | 5
    # Keys that differ only in their high bits (or their sign) lock apart.
    classes = {ShardKeys(k, 2).shard_class for k in (7, 2**32 + 7, 2**62 + 7, -7, 2**31 + 7)}
    assert len(classes) == 5
    assert member_name("scheduler-daemon/web-1/lock:plugin") == "web-1"
    assert member_name("scheduler-daemon/a/b/lock:plugin") == "a/b"
    assert member_name("scheduler-daemon/" + "x" * 46) == "x" * 46  # cut by the server
