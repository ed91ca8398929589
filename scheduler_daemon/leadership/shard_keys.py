"""Sharded leadership in PostgreSQL's lock manager: the advisory lock keys of a sharded
loop, all derived from the loop's own key, and a member's instance id read back from its
lock session's name.

Arithmetic only, no I/O: the guard (leadership/shards.py), the session guard (a
predecessor may have led shards), and ``status`` (who holds which shard) share it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from ..db.lock_store import MemberLocks

_PID_BITS = 22  # Linux pids stay below 2^22 (pid_max's ceiling)


@dataclass(frozen=True, slots=True)
class ShardKeys:
    """The advisory lock keys of one sharded loop, derived from its own key."""

    loop_key: int  # the loop's key (bigint space): members hold it shared
    count: int

    @property
    def shard_class(self) -> int:
        """30 bits of a hash of the whole key: two keys that differ anywhere get classes
        of their own (but for a 1 in 2^30 chance), unlike the key's low bits."""
        digest = hashlib.blake2b(self.loop_key.to_bytes(8, "big", signed=True), digest_size=4)
        return int.from_bytes(digest.digest(), "big") & (2**30 - 1)

    @property
    def member_class(self) -> int:
        return self.shard_class | 2**30

    def member_objid(self, backend_pid: int) -> int:
        return (self.count - 1) << _PID_BITS | backend_pid

    def member_locks(self, backend_pid: int) -> MemberLocks:
        """The member locks of the member whose lock session is ``backend_pid``."""
        return MemberLocks(self.member_class, self.member_objid(backend_pid), self.shard_class)

    def lock_key(self, shard: int) -> int:
        """The shard's lock as one bigint (scheduler_leaders.lock_key): class, then shard."""
        return self.shard_class << 32 | shard


def member_name(application_name: str) -> str:
    """The instance id in a lock session's application_name (``scheduler-daemon/<id>/
    lock:plugin``, cut at 63 bytes by the server: then as much of it as there is)."""
    name = application_name.removeprefix("scheduler-daemon/")
    head, sep, _ = name.rpartition("/lock:")
    return head if sep else name
