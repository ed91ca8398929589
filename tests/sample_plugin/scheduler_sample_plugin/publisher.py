"""A sample publisher, declared in the entry-point group ``scheduler_daemon.publishers``.

The daemon calls the entry point (this class) with its ``Settings`` and runs
``publish(tx, rows)`` for each batch, inside the publishing transaction: what it writes
commits together with the state flip. It appends to a table the application created.

For the tests, a payload can make it fail: ``{"poison": true}`` raises ``ValueError``;
``{"raise": "OSError"}`` or ``{"raise": "TimeoutError"}`` raise those, the way a client
library's network call does (a publisher's own error, not the database's);
``{"hang": true}`` waits for ever, as a call to an endpoint that never answers does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from scheduler_daemon.db.base import Tx
from scheduler_daemon.publishers import Published

AUDIT_TABLE = "sample_publisher_audit"
RAISABLE: dict[str, type[Exception]] = {"OSError": OSError, "TimeoutError": TimeoutError}


class SamplePublisher:
    name = "sample"

    def __init__(self, settings: Any) -> None:
        self.instance = settings.instance_id

    async def publish(self, tx: Tx, rows: Sequence[Published]) -> None:
        if any(row.payload.get("poison") for row in rows if isinstance(row.payload, dict)):
            raise ValueError("the sample publisher refuses poisoned payloads")
        for row in rows:
            wanted = row.payload.get("raise") if isinstance(row.payload, dict) else None
            if wanted in RAISABLE:
                raise RAISABLE[wanted](f"the sample publisher's endpoint failed for {row.id}")
            if isinstance(row.payload, dict) and row.payload.get("hang"):
                await asyncio.Event().wait()
        await tx.run_many(
            f"INSERT INTO {AUDIT_TABLE} (publication_id, instance) VALUES ($1, $2)",
            [(row.id, self.instance) for row in rows],
        )
