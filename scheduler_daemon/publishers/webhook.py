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
verifies ``X-Scheduler-Signature: t=<unix time>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>``
with :func:`verify`, which also refuses a timestamp outside its tolerance window (a
replayed request).

Redirects are never followed: aiohttp would turn a 301/302 into a body-less GET whose 2xx
looks like a delivery. A 3xx is a failed attempt, retried like any other, whose error
names the status and the ``Location`` (scheme and host only: it may carry a token).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import random
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import urljoin

import aiohttp

from .. import __version__
from ..aio import unless_set, wait_any
from ..config import WebhookPublisherSettings, redact_webhook_url
from ..db.base import Tx
from ..db.connect import Backoff
from ..db.url import REDACTED
from ..errors import describe
from ..leadership import LeadershipLost, Lease, NotLeader
from ..logs import Logger
from ..metrics import Metrics
from .base import Published

IDLE_RECHECK = 30.0  # also picks up rows a previous leader left pending
BUSY_RETRY = 0.5  # transaction mode: another replica holds the lock; try again soon
# How far a signature's timestamp may be from the receiver's clock, either way (seconds).
SIGNATURE_TOLERANCE = 300.0
# More digits than any Unix time for 30,000 years: refused before int() converts them.
_MAX_TIMESTAMP_DIGITS = 12


def sign(secret: bytes, body: bytes, timestamp: int) -> str:
    """The ``X-Scheduler-Signature`` value: ``t=<timestamp>,v1=<hex HMAC-SHA256>``."""
    mac = hmac.new(secret, f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={mac}"


def verify(
    secret: bytes, body: bytes, header: str, *, tolerance: float = SIGNATURE_TOLERANCE
) -> bool:
    """What a receiver does (and what the tests do): True only if `header` is a well-formed
    ``t=<unix time>,v1=<hex>`` whose timestamp is within `tolerance` seconds of this
    machine's clock (past or future: an old request is a replay) and one of whose ``v1``
    MACs matches `body` under `secret` (compared in constant time). Anything malformed is
    False, never an exception."""
    if not isinstance(header, str) or not isinstance(body, bytes | bytearray):
        return False
    timestamps: list[str] = []
    candidates: list[str] = []
    for part in header.split(","):
        name, equals, value = part.strip().partition("=")
        if not equals:
            return False
        if name == "t":
            timestamps.append(value)
        elif name == "v1":
            candidates.append(value)
        # Other schemes (a future v2) are ignored, as receivers of such headers do.
    if len(timestamps) != 1 or not candidates:
        return False
    [t] = timestamps
    if not (t.isascii() and t.isdigit() and len(t) <= _MAX_TIMESTAMP_DIGITS):
        return False
    timestamp = int(t)
    if abs(time.time() - timestamp) > tolerance:
        return False
    message = f"{timestamp}.".encode() + bytes(body)
    expected = hmac.new(secret, message, hashlib.sha256).hexdigest().encode()
    matched = False
    for candidate in candidates:
        # Bytes, not str: compare_digest refuses non-ASCII text with a TypeError.
        matched |= hmac.compare_digest(expected, candidate.encode("utf-8", "replace"))
    return matched


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
        """Deliver until cancelled (the publish loop cancels it when leadership ends).

        Each round runs inside ``lease.hold()``: its POSTs are work of the publish loop,
        so they happen only while this replica holds the loop's lock. In session mode the
        leader holds it anyway; in transaction mode the round is one transaction that
        takes the lock (or waits for another turn), selects due rows ``FOR UPDATE SKIP
        LOCKED``, POSTs, records, and commits — so each attempt happens once, cluster-wide.
        """
        timeout = aiohttp.ClientTimeout(total=self.settings.timeout)
        backoff = Backoff(initial=0.5, maximum=IDLE_RECHECK)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                try:
                    async with lease.hold() as held:
                        wait = await self._deliver_due(session, held)
                    backoff.reset()
                except NotLeader:
                    wait = random.uniform(BUSY_RETRY / 2, BUSY_RETRY)  # another's turn
                except Exception as exc:
                    # The database restarting, the hold lost: the owed rows stay in the
                    # outbox; try again, never give up silently.
                    wait = backoff.next_delay()
                    self.log.warning(
                        "webhook.deliverer_error", error=describe(exc),
                        retry_in=round(wait, 3),
                    )  # fmt: skip
                if wait > 0:
                    self.poke.clear()
                    await wait_any([self.poke], wait)

    async def _deliver_due(self, session: aiohttp.ClientSession, held: Lease) -> float:
        """Deliver one round of due rows; return how long to wait before the next."""
        # One wave of POSTs per round: in transaction mode the round holds the publish
        # lock, so it must not outlast one webhook.timeout.
        async with held.transaction() as tx:
            due = await tx.fetch("outbox_due", self.settings.concurrency)
            if not due:
                seconds = (await tx.fetch("outbox_next_in"))[0]["seconds"]
        if due:
            await self._deliver_batch(session, held, due)
            return 0.0
        return IDLE_RECHECK if seconds is None else min(max(seconds, 0.0), IDLE_RECHECK)

    async def _deliver_batch(
        self, session: aiohttp.ClientSession, held: Lease, rows: list[dict[str, Any]]
    ) -> None:
        # Each POST is work of the hold: losing it cancels them, and the hold is let go
        # only once they have stopped.
        posts = [
            held.spawn(self._post(session, row, held.fencing_token), name="webhook:post")
            for row in rows
        ]
        await unless_set(asyncio.wait(posts), held.lost)
        if held.lost.is_set():
            raise LeadershipLost(held.reason or "lost")
        async with held.transaction() as tx:
            for row, post in zip(rows, posts, strict=True):
                await self._record(tx, row, post.result())

    async def _post(
        self, session: aiohttp.ClientSession, row: dict[str, Any], fencing_token: int
    ) -> str | None:
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
            # Grows with every change of publish leader: a receiver that remembers the
            # largest it has seen can refuse a replaced leader's late request.
            "X-Scheduler-Fencing-Token": str(fencing_token),
            "X-Scheduler-Signature": sign(self.secret, body, int(time.time())),
        }
        try:
            # Never follow a redirect: a 301/302 would become a GET without the body, and
            # its 2xx would be recorded as delivered.
            async with session.post(
                self.url, data=body, headers=headers, allow_redirects=False
            ) as response:
                status = response.status
                if 200 <= status < 300:
                    return None
                if 300 <= status < 400:
                    location = response.headers.get("Location")
                    if not location:
                        return f"HTTP {status}: redirect without a Location, not followed"
                    try:  # scheme and host only: the new URL may carry a token, like ours
                        target = redact_webhook_url(urljoin(self.url, location))
                    except ValueError:
                        target = REDACTED
                    return f"HTTP {status}: redirect to {target} not followed"
                return f"HTTP {status}"
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
