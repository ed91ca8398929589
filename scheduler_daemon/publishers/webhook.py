"""``webhook``: HTTP POST of each publication, after commit, from an outbox.

In the publishing transaction the publisher only adds the row to
``scheduler_webhook_outbox``, so a publication cannot be committed without its delivery
being owed. The leader's :class:`WebhookDeliverer` then POSTs outbox rows concurrently,
outside any transaction (a slow endpoint never holds database locks or blocks other rows),
and records each result in a short fenced transaction: delivered, retry later with
exponential backoff, or — after ``max_attempts`` — failed, which also marks the
publication ``failed`` with the last error.

Delivery is at-least-once (a leader can die after the POST and before recording it). The
receiver deduplicates on the publication id (``webhook-id``, also ``Idempotency-Key``) and
verifies the request the Standard Webhooks way (https://www.standardwebhooks.com/), with
any of its libraries: ``webhook-signature: v1,<base64 HMAC-SHA256(key,
"<webhook-id>.<webhook-timestamp>.<body>")>``. The key is the configured secret: in the
spec's ``whsec_<base64>`` form its decoded bytes, in any other form (a plain string, as
before) its UTF-8 bytes. The older ``X-Scheduler-Signature: t=<unix time>,v1=<hex
HMAC-SHA256(key, "<t>.<body>")>`` is still sent, with the same key, for receivers that
check it with :func:`verify`; it is deprecated.

Redirects are never followed: aiohttp would turn a 301/302 into a body-less GET whose 2xx
looks like a delivery. A 3xx is a failed attempt, retried like any other, whose error
names the status and the ``Location`` (scheme and host only: it may carry a token).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import json
import random
import time
from collections.abc import Sequence
from urllib.parse import urljoin

import aiohttp
import yarl

from .. import __version__
from ..aio import unless_set, wait_any
from ..config.settings import WebhookPublisherSettings
from ..db.base import Tx
from ..db.connect import Backoff
from ..db.publications import OwedWebhook, Published, PublishStore
from ..errors import ConfigError, describe
from ..leadership import LeadershipLost, Lease, NotLeader
from ..logs import Logger
from ..metrics import Metrics
from ..redact import REDACTED, redact_webhook_url

IDLE_RECHECK = 30.0  # also picks up rows a previous leader left pending
BUSY_RETRY = 0.5  # transaction mode: another replica holds the lock; try again soon
# How far a signature's timestamp may be from the receiver's clock, either way (seconds).
SIGNATURE_TOLERANCE = 300.0
# More digits than any Unix time for 30,000 years: refused before int() converts them.
_MAX_TIMESTAMP_DIGITS = 12


# The Standard Webhooks secret form: "whsec_" then the key, base64-encoded.
WHSEC_PREFIX = "whsec_"


def webhook_key(secret: str) -> bytes:
    """The HMAC key a configured ``publish.webhook.secret`` stands for: the decoded bytes
    of a ``whsec_<base64>`` secret (what Standard Webhooks libraries take), else the
    secret's own UTF-8 bytes (a plain string, the form before ``whsec_`` was accepted).

    So a plain secret ``S`` and ``whsec_`` + base64(``S``) are the same key, and a receiver
    given either form verifies the same signatures. Raises ValueError (without quoting
    the secret) for a ``whsec_`` secret that is not base64, or an empty key.
    """
    if secret.startswith(WHSEC_PREFIX):
        encoded = secret[len(WHSEC_PREFIX) :].strip()
        try:  # padding is optional, as the spec's own libraries allow
            key = base64.b64decode(encoded + "=" * (-len(encoded) % 4), validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("a whsec_ secret must be base64 after the prefix") from None
    else:
        key = secret.encode()
    if not key:
        raise ValueError("the secret is empty")
    return key


def standard_signature(key: bytes, message_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` value (Standard Webhooks, scheme v1): ``v1,<base64
    HMAC-SHA256(key, "<id>.<timestamp>.<body>")>``."""
    signed = f"{message_id}.{timestamp}.".encode() + body
    mac = hmac.new(key, signed, hashlib.sha256).digest()
    return f"v1,{base64.b64encode(mac).decode()}"


def signature_headers(key: bytes, message_id: str, body: bytes, timestamp: int) -> dict[str, str]:
    """Every signature header of one request: Standard Webhooks' three, and the
    deprecated ``X-Scheduler-Signature`` (same key, same timestamp)."""
    return {
        "webhook-id": message_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": standard_signature(key, message_id, timestamp, body),
        "X-Scheduler-Signature": sign(key, body, timestamp),
    }


def sign(secret: bytes, body: bytes, timestamp: int) -> str:
    """The deprecated ``X-Scheduler-Signature`` value: ``t=<timestamp>,v1=<hex
    HMAC-SHA256(secret, "<timestamp>.<body>")>`` (``secret``: the key bytes)."""
    mac = hmac.new(secret, f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={mac}"


def verify(
    secret: bytes, body: bytes, header: str, *, tolerance: float = SIGNATURE_TOLERANCE
) -> bool:
    """How a receiver checks the deprecated ``X-Scheduler-Signature`` (new receivers use a
    Standard Webhooks library on ``webhook-signature`` instead). `secret` is the key bytes
    (:func:`webhook_key`). True only if `header` is a well-formed
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

    def __init__(self, settings: WebhookPublisherSettings | None = None) -> None:
        """Checks the secret's form when the publishers are built (the daemon's start,
        ``check-config``): a bad one is a configuration error, exit 78."""
        secret = None if settings is None else settings.secret
        if secret is not None:
            try:
                webhook_key(secret.get_secret_value())
            except ValueError as exc:
                raise ConfigError(f"publish.webhook.secret: {exc}") from None

    async def publish(self, tx: Tx, rows: Sequence[Published]) -> None:
        await PublishStore(tx).owe_webhooks([row.id for row in rows])


class WebhookDeliverer:
    def __init__(self, settings: WebhookPublisherSettings, metrics: Metrics, log: Logger) -> None:
        assert settings.url is not None
        assert settings.secret is not None
        self.settings = settings
        self.url = settings.url.get_secret_value()
        self.key = webhook_key(settings.secret.get_secret_value())
        self.metrics = metrics
        self.log = log
        self.poke = asyncio.Event()
        self.finishing = False
        self.between_rounds = asyncio.Event()
        self.between_rounds.set()

    async def finish(self) -> None:
        """Let the round in flight end and record its results, and start no other: a
        graceful stop's POSTs are not resent by the next leader. The leadership's end then
        cancels :meth:`run` (past shutdown_timeout the daemon cancels this wait too)."""
        self.finishing = True
        await self.between_rounds.wait()

    def backoff(self, attempts_made: int) -> float:
        # The exponent is capped: past 2**1023 an int no longer converts to a float, and
        # max_attempts may allow that many (OverflowError on the 1,025th retry).
        delay = self.settings.backoff * 2 ** min(max(attempts_made - 1, 0), 64)
        return float(min(delay, self.settings.max_backoff))

    async def run(self, lease: Lease) -> None:
        """Deliver until cancelled (the publish loop cancels it when leadership ends, after
        :meth:`finish` on a graceful stop).

        Each round runs inside ``lease.hold()``: its POSTs are work of the publish loop,
        so they happen only while this replica holds the loop's lock. In session mode the
        leader holds it anyway; in transaction mode the round is one transaction that
        takes the lock (or waits for another turn), selects due rows ``FOR UPDATE SKIP
        LOCKED``, POSTs, records, and commits — so each attempt happens once, cluster-wide.
        """
        timeout = aiohttp.ClientTimeout(total=self.settings.timeout)
        backoff = Backoff(initial=0.5, maximum=IDLE_RECHECK)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while not self.finishing:
                self.between_rounds.clear()
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
                finally:
                    self.between_rounds.set()
                if wait > 0 and not self.finishing:
                    self.poke.clear()
                    await wait_any([self.poke], wait)
            # A service that returns while its leadership goes on is taken for a crash:
            # this one waits for the leadership's end to cancel it.
            await asyncio.Event().wait()

    async def _deliver_due(self, session: aiohttp.ClientSession, held: Lease) -> float:
        """Deliver one round of due rows; return how long to wait before the next."""
        # One wave of POSTs per round: in transaction mode the round holds the publish
        # lock, so it must not outlast one webhook.timeout.
        async with held.transaction() as tx:
            store = PublishStore(tx)
            due = await store.webhooks_due(limit=self.settings.concurrency)
            if not due:
                seconds = await store.next_webhook_in()
        if due:
            await self._deliver_batch(session, held, due)
            return 0.0
        return IDLE_RECHECK if seconds is None else min(max(seconds, 0.0), IDLE_RECHECK)

    async def _deliver_batch(
        self, session: aiohttp.ClientSession, held: Lease, rows: list[OwedWebhook]
    ) -> None:
        # Each POST is work of the hold: losing it cancels them, and the hold is let go
        # only once they have stopped.
        posts = [held.spawn(self._post(session, row, held), name="webhook:post") for row in rows]
        await unless_set(asyncio.wait(posts), held.lost)
        if held.lost.is_set():
            for post in posts:  # retrieved: the loss is the news (a stale _post raises it)
                if post.done() and not post.cancelled():
                    post.exception()
            raise LeadershipLost(held.reason or "lost")
        async with held.transaction() as tx:
            store = PublishStore(tx)
            for row, post in zip(rows, posts, strict=True):
                await self._record(store, row, post.result())

    async def _post(
        self, session: aiohttp.ClientSession, owed: OwedWebhook, held: Lease
    ) -> str | None:
        published = owed.publication
        body = json.dumps(published.summary() | {"payload": published.payload}).encode()
        headers = {
            "Content-Type": "application/json",
            "User-Agent": f"scheduler-daemon/{__version__}",
            "Idempotency-Key": str(published.id),
            "X-Scheduler-Publication-Id": str(published.id),
            "X-Scheduler-Attempt": str(owed.attempts + 1),
            # Grows with every change of publish leader: a receiver that remembers the
            # largest it has seen can refuse a replaced leader's late request.
            "X-Scheduler-Fencing-Token": str(held.fencing_token),
            # webhook-id is the publication id: the same message on every attempt, as the
            # spec asks, so a receiver's deduplication on it works across retries.
            **signature_headers(self.key, str(published.id), body, int(time.time())),
        }
        # Last thing before the request leaves: after a freeze, the tasks whose timers
        # fell due run in deadline order, and this one may run before the heartbeat that
        # would notice; the age of the last proof tells at once (and ends the lease).
        if not held.proven_recently():
            raise LeadershipLost(held.reason or "lost")
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
            # Some aiohttp errors quote the URL, whose path may carry a token: as given,
            # or as yarl normalised it (percent-encoding, default port dropped, ...).
            error = describe(exc)
            for spelling in {self.url, str(yarl.URL(self.url))}:
                error = error.replace(spelling, redact_webhook_url(self.url))
            return error

    async def _record(self, store: PublishStore, owed: OwedWebhook, error: str | None) -> None:
        publication_id, attempts = owed.publication.id, owed.attempts + 1
        log = self.log.bind(publication_id=publication_id, attempt=attempts)
        if error is None:
            await store.webhook_delivered(id=publication_id)
            log.info("webhook.delivered")
        elif attempts >= self.settings.max_attempts:
            await store.webhook_gave_up(id=publication_id, error=error)
            self.metrics.publications_failed.inc()
            log.error("webhook.failed", error=error)
        else:
            delay = self.backoff(attempts)
            await store.webhook_retry(id=publication_id, delay=delay, error=error)
            log.warning("webhook.retry", error=error, retry_in=delay)
