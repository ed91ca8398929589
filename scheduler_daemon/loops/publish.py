"""The publish loop: every due publication becomes ``published`` once, on time.

A tick, on the leader only, loops over batches until nothing is due. Each batch is one
fenced transaction on the leader's connection: one statement picks up to ``batch_size``
due rows (``publish_at <= now()`` by the database's clock, ``FOR UPDATE SKIP LOCKED``),
flips them, and the publishers run on the returned rows in the same transaction. If the
leader lost its session, nothing of the batch commits, and the next leader publishes it.

Timing: the tick returns how long until the earliest scheduled row, so the leader sleeps
exactly until then (capped by ``interval``). On PostgreSQL a LISTEN connection, fed by a
statement trigger on the table, wakes it when a row is scheduled sooner than that —
whoever wrote it (the CLI, the API, plain SQL). On SQLite, external writers are picked up
by the interval.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from ..config import Settings
from ..db.base import Store, Tx
from ..db.connect import is_transient
from ..errors import describe
from ..leadership import Lease
from ..logs import Logger
from ..metrics import Metrics
from ..publishers import Published, Publisher
from ..publishers.webhook import WebhookDeliverer
from .base import Tick

WAKE_CHANNEL = "scheduler_publications_due"
LISTEN_RETRY = 30.0
LOCKED_ROWS_RETRY = 0.5


class PublishWork:
    name = "publish"

    def __init__(
        self,
        store: Store,
        settings: Settings,
        publishers: Sequence[Publisher],
        metrics: Metrics,
        log: Logger,
    ) -> None:
        self.store = store
        self.settings = settings
        self.publishers = publishers
        self.metrics = metrics
        self.log = log.bind(loop=self.name)
        self.wake: Callable[[], None] = lambda: None  # the runner sets its own
        self._lease: Lease | None = None
        self._listener: Any = None  # asyncpg connection with the LISTEN
        self._deliverer: WebhookDeliverer | None = None
        self._delivering: asyncio.Task[None] | None = None
        self._listen_retry_at = 0.0
        self._planned_wake = float("inf")  # time.time() of the next planned tick
        self._db_clock_offset = 0.0  # database clock minus ours, measured each tick

    async def tick(self, tick: Tick) -> float | None:
        if self._lease is not tick.lease:
            await self._start_leading(tick.lease)
        else:
            await self._ensure_listener()
        published = 0
        while True:
            async with tick.lease.transaction() as tx:
                rows = await tx.fetch("publish_due", self.settings.publish.batch_size,
                                      self.settings.instance_id)  # fmt: skip
                batch = [Published(**row) for row in rows]
                failed = await self._run_publishers(tx, batch, tick.log) if batch else {}
                if len(batch) < self.settings.publish.batch_size:
                    upcoming = (await tx.fetch("next_due_in"))[0]
            published += len(batch) - len(failed)
            self._count(batch, failed)
            if len(batch) < self.settings.publish.batch_size:
                break
        if published:
            tick.log.info("publish.published", count=published)
            if self._deliverer is not None:
                self._deliverer.poke.set()
        self._db_clock_offset = upcoming["db_epoch"] - time.time()
        delay: float | None = upcoming["seconds"]
        delay = None if delay is None else max(delay, 0.0)
        if upcoming["skipped"]:
            # Due rows another transaction holds locked: retry soon, not in a tight loop.
            delay = max(delay or 0.0, LOCKED_ROWS_RETRY)
        horizon = (
            self.settings.publish.interval
            if delay is None
            else min(delay, self.settings.publish.interval)
        )
        self._planned_wake = time.time() + horizon
        return delay

    async def _run_publishers(self, tx: Tx, batch: list[Published], log: Logger) -> dict[int, str]:
        """Run every publisher on the batch; on error, fall back to row by row so only the
        offending rows fail. Returns {publication id: error} for the rows marked failed."""
        if not self.publishers:
            return {}
        try:
            async with tx.savepoint():
                for publisher in self.publishers:
                    await publisher.publish(tx, batch)
            return {}
        except Exception as exc:
            if is_transient(exc):
                raise  # roll the whole batch back; the next tick publishes it again
            log.warning("publish.batch_failed", size=len(batch), error=describe(exc))
        failed: dict[int, str] = {}
        for row in batch:
            try:
                async with tx.savepoint():
                    for publisher in self.publishers:
                        await publisher.publish(tx, [row])
            except Exception as exc:
                if is_transient(exc):
                    raise  # a deadlock or timeout says nothing about this row's data
                error = describe(exc)
                failed[row.id] = error
                await tx.fetch("publication_fail", row.id, error)
                log.error("publish.row_failed", publication_id=row.id, key=row.key, error=error)
        return failed

    def _count(self, batch: list[Published], failed: dict[int, str]) -> None:
        for row in batch:
            if row.id in failed:
                self.metrics.publications_failed.inc()
                continue
            self.metrics.publications_published.inc()
            lateness = (row.published_at - row.publish_at).total_seconds()
            self.metrics.publication_lateness.observe(max(lateness, 0.0))

    async def _start_leading(self, lease: Lease) -> None:
        await self.leadership_ended(graceful=False)
        self._lease = lease
        settings = self.settings.publish
        if "webhook" in settings.publishers:
            self._deliverer = WebhookDeliverer(settings.webhook, self.metrics, self.log)
            self._delivering = asyncio.create_task(
                self._deliverer.run(lease), name="publish:webhooks"
            )
        self._listen_retry_at = 0.0
        await self._ensure_listener()

    async def _ensure_listener(self) -> None:
        """Keep a LISTEN connection while leading (PostgreSQL); reopen it if it died, at
        most every LISTEN_RETRY seconds. Precise wake-ups are an optimisation: without
        them the interval still bounds lateness."""
        from ..db.postgres import PostgresStore

        if not isinstance(self.store, PostgresStore) or self.settings.lock.mode != "session":
            # Transaction mode is for transaction poolers, through which LISTEN cannot
            # work (the notification arrives on whichever server session ran it).
            return
        if self._listener is not None and not self._listener.is_closed():
            return
        if time.monotonic() < self._listen_retry_at:
            return
        # LISTEN needs its own connection: the pool's reset runs UNLISTEN *.
        listener = None
        try:
            listener = await self.store.connect_dedicated("listen:publish")
            await listener.add_listener(WAKE_CHANNEL, self._on_notification)
            self._listener = listener
        except Exception as exc:
            if listener is not None:
                listener.terminate()
            self._listener = None
            self._listen_retry_at = time.monotonic() + LISTEN_RETRY
            self.log.warning("publish.listen_failed", error=describe(exc))

    def _on_notification(self, _conn: Any, _pid: int, _channel: str, payload: str) -> None:
        try:
            due = datetime.fromisoformat(payload).timestamp() - self._db_clock_offset
        except ValueError:
            due = 0.0
        if due < self._planned_wake:
            self._planned_wake = due
            self.wake()

    async def leadership_ended(self, graceful: bool) -> None:
        self._lease = None
        if self._delivering is not None:
            self._delivering.cancel()
            await asyncio.wait({self._delivering})
            if not self._delivering.cancelled() and self._delivering.exception():
                self.log.warning("webhook.deliverer_died", error=repr(self._delivering.exception()))
            self._delivering = None
            self._deliverer = None
        if self._listener is not None:
            self._listener.terminate()
            self._listener = None
