"""What a running task receives."""

from __future__ import annotations

import threading
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from datetime import datetime

from ..db.base import Tx
from ..leadership import Lease
from ..logs import Logger


@dataclass(frozen=True, slots=True)
class TaskContext:
    """Passed to a task's target when it takes one argument.

    - ``slot``: the scheduled instant this run is for (UTC), unique per task;
    - ``log``: a structlog logger bound with ``task`` and ``slot``;
    - ``transaction()``: a fenced database transaction (it can only commit while this
      replica still leads the plugin loop);
    - ``cancelled``: set when the run passed its timeout or the daemon is stopping. Async
      targets are cancelled outright; a sync target (run in a thread) cannot be, and
      should check this event in its long loops.
    """

    name: str
    slot: datetime
    instance: str
    log: Logger
    lease: Lease
    cancelled: threading.Event = field(default_factory=threading.Event)

    def transaction(self) -> AbstractAsyncContextManager[Tx]:
        return self.lease.transaction()
