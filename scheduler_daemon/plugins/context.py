"""What a running task receives."""

from __future__ import annotations

import threading
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from ..db.base import Tx
from ..logs import Logger

if TYPE_CHECKING:
    from ..leadership import Lease


@dataclass(frozen=True, slots=True)
class TaskContext:
    """Passed to a task's target when it takes one argument.

    - ``slot``: the scheduled instant this run is for (UTC), unique per task;
    - ``args``: the task's JSON arguments (``args`` in its declaration, or its runtime
      schedule's row), a dict;
    - ``fencing_token``: the plugin loop's fencing token for the leadership running this
      slot. It grows with every change of leader, so a system this task calls can refuse
      a request carrying a smaller token than one it has already seen (a replaced leader
      that has not noticed yet); see docs/leadership.md. Sharded, it is the shard's token:
      compare it only with tokens of the same ``shard``;
    - ``shard``: the shard this schedule belongs to (``plugin.shards`` > 1), else None;
    - ``log``: a structlog logger bound with ``task`` and ``slot``;
    - ``transaction()``: a fenced database transaction (it can only commit while this
      replica still leads the plugin loop); async targets only;
    - ``cancelled``: set when the run must stop: its timeout passed, the replica lost
      leadership, or the daemon is stopping. Async targets are cancelled outright; a sync
      target runs in a worker process, whose ``cancelled`` is set on SIGTERM, and is
      killed if it has not returned within ``lock.stop_grace`` of that;
    - ``leading``: this replica still leads, as far as it can know: the lock was proven
      held recently enough that nobody can have taken it over meanwhile (after a freeze
      it is False at once, before the heartbeat runs). Check it right before each
      external write; the fencing token is the proof that does not depend on timing.
    """

    name: str
    slot: datetime
    instance: str
    log: Logger
    fencing_token: int
    args: dict[str, Any] = field(default_factory=dict)
    shard: int | None = None
    lease: Lease | None = None  # None in a worker process
    cancelled: threading.Event = field(default_factory=threading.Event)

    @property
    def leading(self) -> bool:
        if self.cancelled.is_set():
            return False
        return self.lease is None or self.lease.proven_recently()

    def transaction(self) -> AbstractAsyncContextManager[Tx]:
        if self.lease is None:
            raise RuntimeError(
                "ctx.transaction() is for async targets: a sync target runs in a worker "
                "process, outside the daemon's fenced connection"
            )
        return self.lease.transaction()
