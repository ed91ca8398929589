"""``webhook``: HTTP POST of each publication, after commit, from an outbox.

In the publishing transaction the publisher only adds the row to
``scheduler_webhook_outbox``, so a publication cannot be committed without its delivery
being owed. The leader's :class:`WebhookDeliverer` then POSTs outbox rows concurrently,
outside any transaction (a slow endpoint never holds database locks or blocks other rows),
and records each result in a short fenced transaction: delivered, retry later with
exponential backoff, or — after ``max_attempts`` — failed, which also marks the
publication ``failed`` with the last error.

Delivery is at-least-once (a leader can die after the POST and before recording it). The
receiver deduplicates on the ``Idempotency-Key`` header, which is the publication id, and
verifies ``X-Scheduler-Signature: t=<unix time>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>``.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
from collections.abc import Sequence
from typing import Any

import aiohttp

from .. import __version__
from ..aio import wait_any
from ..config import WebhookPublisherSettings, redact_webhook_url
from ..db.base import Tx
from ..db.connect import Backoff
from ..errors import describe
from ..leadership import Lease
from ..logs import Logger
from ..metrics import Metrics
from .base import Published

IDLE_RECHECK = 30.0  # also picks up rows a previous leader left pending


def sign(secret: bytes, body: bytes, timestamp: int) -> str:
    mac = hmac.new(secret, f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={mac}"


def verify(secret: bytes, body: bytes, header: str) -> bool:
    """What a receiver does (and what the tests do)."""
    fields = dict(part.split("=", 1) for part in header.split(","))
    expected = sign(secret, body, int(fields["t"]))
    return hmac.compare_digest(expected, header)


class WebhookPublisher:
    name = "webhook"

    async def publish(self, tx: Tx, rows: Sequence[Published]) -> None:
        await tx.fetch("outbox_add", [row.id for row in rows])


class WebhookDeliverer:
    def __init__(self, settings: WebhookPublisherSettings, metrics: Metrics, log: Logger) -> None:
        assert settings.url is not None
        assert settings.secret is not None
        self.settings = settings
        self.url = settings.url.get_secret_value()
        self.secret = settings.secret.get_secret_value().encode()
        self.metrics = metrics
        self.log = log
        self.poke = asyncio.Event()

    def backoff(self, attempts_made: int) -> float:
        delay = self.settings.backoff * 2 ** max(attempts_made - 1, 0)
        return float(min(delay, self.settings.max_backoff))

    async def run(self, lease: Lease) -> None:
        """Deliver until cancelled (the publish loop cancels it when leadership ends)."""
        timeout = aiohttp.ClientTimeout(total=self.settings.timeout)
        backoff = Backoff(initial=0.5, maximum=IDLE_RECHECK)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                try:
                    wait = await self._deliver_due(session, lease)
                    backoff.reset()
                except Exception as exc:
                    # The database restarting, the lock busy (transaction mode): the owed
                    # rows stay in the outbox; try again, never give up silently.
                    wait = backoff.next_delay()
                    self.log.warning(
                        "webhook.deliverer_error", error=describe(exc),
                        retry_in=round(wait, 3),
                    )  # fmt: skip
                if wait > 0:
                    self.poke.clear()
                    await wait_any([self.poke], wait)

    async def _deliver_due(self, session: aiohttp.ClientSession, lease: Lease) -> float:
        """Deliver one round of due rows; return how long to wait before the next."""
        async with lease.transaction() as tx:
            due = await tx.fetch("outbox_due", self.settings.concurrency * 4)
            if not due:
                seconds = (await tx.fetch("outbox_next_in"))[0]["seconds"]
        if due:
            await self._deliver_batch(session, lease, due)
            return 0.0
        return IDLE_RECHECK if seconds is None else min(max(seconds, 0.0), IDLE_RECHECK)

    async def _deliver_batch(
        self, session: aiohttp.ClientSession, lease: Lease, rows: list[dict[str, Any]]
    ) -> None:
        limit = asyncio.Semaphore(self.settings.concurrency)

        async def one(row: dict[str, Any]) -> str | None:
            async with limit:
                return await self._post(session, row)

        errors = await asyncio.gather(*(one(row) for row in rows))
        async with lease.transaction() as tx:
            for row, error in zip(rows, errors, strict=True):
                await self._record(tx, row, error)

    async def _post(self, session: aiohttp.ClientSession, row: dict[str, Any]) -> str | None:
        published = Published(
            row["id"], row["key"], row["payload"], row["publish_at"], row["published_at"]
        )
        body = json.dumps(published.summary() | {"payload": published.payload}).encode()
        headers = {
            "Content-Type": "application/json",
            "User-Agent": f"scheduler-daemon/{__version__}",
            "Idempotency-Key": str(published.id),
            "X-Scheduler-Publication-Id": str(published.id),
            "X-Scheduler-Attempt": str(row["attempts"] + 1),
            "X-Scheduler-Signature": sign(self.secret, body, int(time.time())),
        }
        try:
            async with session.post(self.url, data=body, headers=headers) as response:
                if 200 <= response.status < 300:
                    return None
                return f"HTTP {response.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            # Some aiohttp errors quote the URL, whose path may carry a token.
            error = describe(exc)
            return error.replace(self.url, redact_webhook_url(self.url))

    async def _record(self, tx: Tx, row: dict[str, Any], error: str | None) -> None:
        publication_id, attempts = row["id"], row["attempts"] + 1
        log = self.log.bind(publication_id=publication_id, attempt=attempts)
        if error is None:
            await tx.fetch("outbox_delivered", publication_id)
            log.info("webhook.delivered")
        elif attempts >= self.settings.max_attempts:
            await tx.fetch("outbox_failed", publication_id, error)
            await tx.fetch("publication_undelivered", publication_id, f"webhook: {error}")
            self.metrics.publications_failed.inc()
            log.error("webhook.failed", error=error)
        else:
            delay = self.backoff(attempts)
            await tx.fetch("outbox_retry", publication_id, delay, error)
            log.warning("webhook.retry", error=error, retry_in=delay)
