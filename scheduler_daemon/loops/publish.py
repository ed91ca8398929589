"""The publish loop: every due publication becomes ``published`` once, on time.

A tick, on the leader only, loops over batches until nothing is due. Each batch is one
fenced transaction (``lease.transaction()``: in session mode a pooled one whose first
statement checks the loop's fencing token, in transaction mode a pooled one whose first
statement takes the lock, on SQLite under the file lock): one statement picks up to ``batch_size`` due rows
(``publish_at <= now()`` by the database's clock; PostgreSQL skips rows others hold
locked) and flips them (db/publications.py), and the publishers run on the returned rows
in the same transaction. If the leader lost its lock, nothing of the batch commits, and
the next leader publishes it.

Timing: the tick returns how long until the earliest scheduled row, so the leader sleeps
exactly until then. On PostgreSQL the replica's LISTEN connection (db/listen.py), fed by a
statement trigger on the table, wakes it when a row is scheduled sooner than that —
whoever wrote it (the CLI, the API, plain SQL); while it listens, the leader looks
unprompted only every ``LISTENING_MAX_SLEEP``, else every ``interval``. SQLite has no NOTIFY: the leader watches
its files (a ``stat``) every ``SQLITE_WATCH_INTERVAL``; when they moved it asks
``PRAGMA data_version``, which moves only when another process committed, and only then
looks at the earliest row.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING

import asyncpg

from ..config.settings import Settings
from ..db.base import CommitWatch, Store, Tx
from ..db.connect import is_transient_database_error
from ..db.publications import Published, PublishStore
from ..errors import describe
from ..leadership import LeadershipLost, Lease
from ..logs import Logger
from ..metrics import Metrics
from ..publishers import Publisher
from .base import LISTENING_MAX_SLEEP, Tick

if TYPE_CHECKING:
    from ..db.listen import Listener
    from ..publishers.webhook import WebhookDeliverer

WAKE_CHANNEL = "scheduler_publications_due"
# How often the SQLite leader looks for other processes' commits: the bound on its
# short-notice lateness, for one cheap pragma (no page read) per look.
SQLITE_WATCH_INTERVAL = 0.1
LOCKED_ROWS_RETRY = 0.5
# A batch that a transient database error (deadlock, lock or statement timeout, …) rolled
# back this many times in a row is run row by row, where such an error fails its row.
TRANSIENT_BATCH_ATTEMPTS = 3


def unreadable(exc: BaseException) -> bool:
    """Whether reading rows failed on a value the database holds but Python cannot decode:
    a payload nested deeper than ``json`` reads or with an integer of over 4,300 digits
    (what plain SQL may store; the API refuses both), a time outside Python's years, text
    that is not UTF-8 (SQLite). Never a database outage or a refused statement."""
    if isinstance(exc, RecursionError | ValueError | OverflowError):
        return not isinstance(exc, asyncpg.InterfaceError)  # DataError: a parameter
    return isinstance(exc, sqlite3.OperationalError) and "decode" in str(exc)


class PublisherTimedOut(Exception):
    """A publisher call outlasted ``publish.publisher_timeout`` and was cancelled."""


class PublishWork:
    name = "publish"

    def __init__(
        self,
        store: Store,
        settings: Settings,
        publishers: Sequence[Publisher],
        metrics: Metrics,
        log: Logger,
        listener: Listener | None = None,
    ) -> None:
        self.store = store
        self.listener = listener  # PostgreSQL, session mode
        self.settings = settings
        self.publishers = publishers
        self.metrics = metrics
        self.log = log.bind(loop=self.name)
        self.wake: Callable[[], None] = lambda: None  # the runner sets its own
        self._deliverer: WebhookDeliverer | None = None
        self._delivering: asyncio.Task[None] | None = None
        self._watching: asyncio.Task[None] | None = None  # SQLite: the commit watcher
        # time.time() of the next planned tick; -inf while a tick runs, nan after one
        # failed (the runner retries after its interval, whatever is notified).
        self._planned_wake = float("inf")
        self._db_clock_offset = 0.0  # database clock minus ours, measured each tick
        # Publication id -> transient rollbacks in a row of the batch that held it (only
        # the last such batch; empty on the happy path). See _run_publishers.
        self._transient_strikes: dict[int, int] = {}

    async def tick(self, tick: Tick) -> float | None:
        # While the tick runs, every notification wakes the next one: a row committed
        # after this tick's last look would otherwise be judged against the previous
        # tick's plan (in the past while draining a backlog) and wait a whole sleep.
        self._planned_wake = float("-inf")
        try:
            return await self._tick(tick)
        except BaseException:
            # The runner retries a failed tick after a whole interval: what failed would
            # fail again at once, and a notification is no reason to try sooner.
            self._planned_wake = float("nan")
            raise

    async def _tick(self, tick: Tick) -> float | None:
        if self.listener is not None:
            await self.listener.ensure()
        published = 0
        one_by_one = False
        while True:
            try:
                async with tick.lease.transaction() as tx:
                    lost = 0  # rows failed because they could not be read
                    store = PublishStore(tx)
                    if one_by_one:
                        batch, lost = await self._take_one_by_one(store, tick.log)
                        taken = len(batch) + lost
                    else:
                        batch = await store.take_due(
                            limit=self.settings.publish.batch_size,
                            instance=self.settings.instance_id,
                        )
                        taken = len(batch)
                    failed = await self._run_publishers(tx, batch, tick) if batch else {}
                    if taken < self.settings.publish.batch_size:
                        upcoming = await store.next_due()
            except Exception as exc:
                if one_by_one or not unreadable(exc):
                    raise
                # Rolled back: the batch again, each row on its own, so that the one
                # Python cannot read fails alone instead of stopping every tick.
                tick.log.warning("publish.batch_unreadable", error=describe(exc))
                one_by_one = True
                continue
            one_by_one = False
            published += len(batch) - len(failed)
            self._count(batch, failed)
            self.metrics.publications_failed.inc(lost)
            if taken < self.settings.publish.batch_size:
                break
        if published:
            tick.log.info("publish.published", count=published)
            if self._deliverer is not None:
                self._deliverer.poke.set()
        self._db_clock_offset = upcoming.db_epoch - time.time()
        delay = None if upcoming.seconds is None else max(upcoming.seconds, 0.0)
        if upcoming.skipped:
            # Due rows another transaction holds locked: retry soon, not in a tight loop.
            delay = max(delay or 0.0, LOCKED_ROWS_RETRY)
        horizon = self.max_sleep() if delay is None else min(delay, self.max_sleep())
        self._planned_wake = time.time() + horizon
        return delay

    def max_sleep(self) -> float:
        if self.listener is not None and self.listener.listening:
            return LISTENING_MAX_SLEEP
        return self.settings.publish.interval

    async def _run_publishers(self, tx: Tx, batch: list[Published], tick: Tick) -> dict[int, str]:
        """Run every publisher on the batch. Returns {publication id: error} for the rows
        marked failed.

        Whatever a publisher raises (``OSError`` and ``TimeoutError`` included) is a
        publisher failure, and so is a call that outlasts ``publish.publisher_timeout``
        (cancelled then): the batch is run again row by row, each row in a savepoint, and
        only the rows that fail again are marked failed. Only an error from the database
        that says "not now" (see :func:`is_transient_database_error`) rolls the whole batch
        back, to be retried by the next tick; once the same rows were rolled back
        ``TRANSIENT_BATCH_ATTEMPTS`` times in a row, they are isolated: row by row, where
        such an error fails its row too, so no row can hold the loop up for ever.
        """
        if not self.publishers:
            return {}
        log = tick.log
        attempts = self._transient_attempts(batch) if self._transient_strikes else 0
        isolated = attempts >= TRANSIENT_BATCH_ATTEMPTS
        if isolated:
            log.warning("publish.batch_isolated", size=len(batch), attempts=attempts)
        else:
            try:
                async with tx.savepoint():
                    await self._publish(tx, batch, tick.lease)
            except LeadershipLost:
                raise
            except Exception as exc:
                if is_transient_database_error(exc):
                    self._strike(batch, exc, log)
                    raise  # roll the whole batch back; the next tick publishes it again
                log.warning("publish.batch_failed", size=len(batch), error=describe(exc))
            else:
                if self._transient_strikes:
                    self._transient_strikes.clear()
                return {}
        failed: dict[int, str] = {}
        for row in batch:
            try:
                async with tx.savepoint():
                    await self._publish(tx, [row], tick.lease)
            except LeadershipLost:
                raise
            except Exception as exc:
                if not isolated and is_transient_database_error(exc):
                    self._strike(batch, exc, log)
                    raise  # a deadlock or lock timeout says nothing about this row's data
                # If the connection died, this fails too and nothing of the batch commits.
                error = describe(exc)
                await PublishStore(tx).fail(id=row.id, error=error)
                failed[row.id] = error
                log.error("publish.row_failed", publication_id=row.id, key=row.key, error=error)
        self._transient_strikes.clear()
        return failed

    async def _publish(self, tx: Tx, rows: list[Published], lease: Lease) -> None:
        """Every publisher, once, on ``rows``: each only while the lease is fresh, and
        for at most ``publisher_timeout``."""
        timeout = self.settings.publish.publisher_timeout
        for publisher in self.publishers:
            # Right before work that may leave the database: a leader resumed after a
            # freeze learns here, not after the call, that it may have been replaced.
            if not lease.proven_recently():
                raise LeadershipLost(lease.reason or "lost")
            try:
                async with asyncio.timeout(timeout) as deadline:
                    await publisher.publish(tx, rows)
            except TimeoutError:
                if not deadline.expired():
                    raise  # the publisher's own: a failure like any other
                raise PublisherTimedOut(
                    f"publisher {publisher.name!r} timed out after {timeout:g}s "
                    "(publish.publisher_timeout)"
                ) from None

    async def _take_one_by_one(
        self, store: PublishStore, log: Logger
    ) -> tuple[list[Published], int]:
        """:meth:`PublishStore.take_due`, one row at a time, each in a savepoint: a row
        that cannot be read is marked failed, naming why. Returns the rows read and how
        many failed."""
        rows: list[Published] = []
        lost = 0
        for publication_id in await store.due_ids(limit=self.settings.publish.batch_size):
            try:
                async with store.tx.savepoint():
                    row = await store.take_one(
                        id=publication_id, instance=self.settings.instance_id
                    )
                if row is not None:
                    rows.append(row)
            except Exception as exc:
                if not unreadable(exc):
                    raise
                error = f"unreadable row: {describe(exc)}"
                await store.fail(id=publication_id, error=error)
                lost += 1
                log.error("publish.row_unreadable", publication_id=publication_id, error=error)
        return rows, lost

    def _transient_attempts(self, batch: list[Published]) -> int:
        """How many times in a row a batch holding these rows was rolled back by a
        transient database error."""
        return max(self._transient_strikes.get(row.id, 0) for row in batch)

    def _strike(self, batch: list[Published], exc: BaseException, log: Logger) -> None:
        """Count a transient rollback against the batch's rows. Only the last failed batch
        is remembered (the next tick picks the same rows first), so this stays small."""
        strikes = self._transient_strikes
        self._transient_strikes = {row.id: strikes.get(row.id, 0) + 1 for row in batch}
        log.warning(
            "publish.batch_retry", size=len(batch), error=describe(exc),
            attempt=self._transient_attempts(batch), limit=TRANSIENT_BATCH_ATTEMPTS,
        )  # fmt: skip

    def _count(self, batch: list[Published], failed: dict[int, str]) -> None:
        for row in batch:
            if row.id in failed:
                self.metrics.publications_failed.inc()
                continue
            self.metrics.publications_published.inc()
            lateness = (row.published_at - row.publish_at).total_seconds()
            self.metrics.publication_lateness.observe(max(lateness, 0.0))

    async def leadership_started(self, lease: Lease) -> None:
        settings = self.settings.publish
        if "webhook" in settings.publishers:
            # Work of the leadership: cancelled the moment it is lost, and stopped before
            # the lock is released, so that no POST of ours overlaps the next leader's.
            # Imported only here: aiohttp is needed by a deployment that sends webhooks.
            from ..publishers.webhook import WebhookDeliverer

            self._deliverer = WebhookDeliverer(settings.webhook, self.metrics, self.log)
            self._delivering = lease.spawn(
                self._deliverer.run(lease), name="publish:webhooks", service=True
            )
        if self.listener is not None:
            await self.listener.subscribe(WAKE_CHANNEL, self._on_notification)
        if self.store.commit_watch is not None:
            self._watching = lease.spawn(
                self._watch_commits(self.store.commit_watch), name="publish:watch", service=True
            )

    async def _watch_commits(self, store: CommitWatch) -> None:
        """Wake the leader when another process scheduled a row due before the planned
        tick: SQLite's stand-in for the LISTEN below."""
        seen: int | None = None
        files: tuple[int, ...] | None = None
        while True:
            try:
                # A stat on the event loop is nearly free; the pragma goes through the
                # connection's thread, so it is asked only when the files moved.
                now_files = store.files_changed_marker()
                if now_files != files:
                    files = now_files
                    version = await store.data_version()
                    if seen is not None and version != seen:
                        seconds = await store.next_due_in()
                        if seconds is not None:
                            self._due_at(time.time() + max(seconds, 0.0))
                    seen = version
            except Exception as exc:  # the tick reports database trouble; this only waits
                self.log.debug("publish.watch_failed", error=describe(exc))
            await asyncio.sleep(SQLITE_WATCH_INTERVAL)

    def _on_notification(self, payload: str) -> None:
        """A row was scheduled (payload: the earliest new publish_at, database clock), or
        notifications may have been missed (empty payload): tick now if that is sooner
        than planned."""
        try:
            due = datetime.fromisoformat(payload).timestamp() - self._db_clock_offset
        except ValueError:
            due = 0.0
        self._due_at(due)

    def _due_at(self, due: float) -> None:
        """Something is due at ``due`` (time.time()): tick then if that is sooner than
        planned, or right after the tick that is running now (never sooner than planned
        after a failed tick: ``nan``, which nothing is less than)."""
        if self._planned_wake == float("-inf"):
            self.wake()
        elif due < self._planned_wake:
            self._planned_wake = due
            self.wake()

    async def leadership_ended(self, graceful: bool) -> None:
        if self._delivering is not None:
            if graceful and self._deliverer is not None:
                await self._deliverer.finish()  # the POSTs in flight end and are recorded
            self._delivering.cancel()  # a stop: the guard waits for it to end
            self._delivering = None
            self._deliverer = None
        if self.listener is not None:
            self.listener.unsubscribe(WAKE_CHANNEL)
        if self._watching is not None:
            self._watching.cancel()  # work of the lease: the guard waits for it to end
            self._watching = None
