"""Webhooks signed per the Standard Webhooks specification, checked by its own library
(the `standardwebhooks` package from PyPI) the way a receiver would: a real daemon POSTs
to a real HTTP endpoint, and the endpoint's requests verify, while a tampered body,
timestamp or id does not."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import secrets
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from aiohttp import web
from rig.processes import Daemons, run_cli
from rig.sql import afetch
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from scheduler_daemon.client import Client
from scheduler_daemon.config.settings import Settings
from scheduler_daemon.publishers.webhook import (
    signature_headers,
    standard_signature,
    verify,
    webhook_key,
)

KEY = secrets.token_bytes(32)
WHSEC = "whsec_" + base64.b64encode(KEY).decode()
PLAIN = "a plain hmac secret"  # the form every deployment used before whsec_


# -- the key and the signature ----------------------------------------------------------


def test_a_whsec_secret_is_its_decoded_bytes_and_a_plain_one_its_utf8() -> None:
    assert webhook_key(WHSEC) == KEY
    assert webhook_key(WHSEC.rstrip("=")) == KEY  # padding is optional
    assert webhook_key(PLAIN) == PLAIN.encode()
    # The same key in both forms: a receiver may be given either.
    assert webhook_key("whsec_" + base64.b64encode(PLAIN.encode()).decode()) == PLAIN.encode()


@pytest.mark.parametrize(
    ("secret", "message"),
    [
        ("whsec_not base64!", "a whsec_ secret must be base64 after the prefix"),
        ("whsec_====", "a whsec_ secret must be base64 after the prefix"),
        ("whsec_", "the secret is empty"),
        ("", "the secret is empty"),
    ],
)
def test_a_malformed_secret_is_refused_without_quoting_it(secret: str, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        webhook_key(secret)


def test_our_signature_is_the_libraries() -> None:
    body = b'{"id": 7, "payload": {"post": 42}}'
    timestamp = int(time.time())
    expected = Webhook(WHSEC).sign("7", datetime.fromtimestamp(timestamp, UTC), body.decode())
    assert standard_signature(KEY, "7", timestamp, body) == expected
    headers = signature_headers(KEY, "7", body, timestamp)
    assert Webhook(WHSEC).verify(body, headers) == json.loads(body)
    assert verify(KEY, body, headers["X-Scheduler-Signature"]), "the deprecated header too"


def test_check_config_refuses_a_malformed_whsec_secret(tmp_path: Path) -> None:
    env = {
        "SCHEDULER_PUBLISH__PUBLISHERS": '["webhook"]',
        "SCHEDULER_PUBLISH__WEBHOOK__URL": "https://hooks.example.com/in",
        "SCHEDULER_PUBLISH__WEBHOOK__SECRET": "whsec_s3cr3t!!",
    }
    result = run_cli(["check-config"], env, cwd=tmp_path)
    assert result.returncode == 78, result.stderr
    assert result.stderr.strip().splitlines() == [
        "scheduler-daemon: publish.webhook.secret: a whsec_ secret must be base64 after the prefix"
    ]
    assert "s3cr3t" not in result.stdout + result.stderr


# -- a real daemon, a real receiver -----------------------------------------------------


@dataclass
class Receiver:
    """An HTTP endpoint that keeps each request's headers and raw body, and answers 500
    to the first one (so the daemon retries) and 200 to the rest, a moment later: a
    SIGTERM sent on the second request's arrival lands while that POST is in flight."""

    requests: list[tuple[dict[str, str], bytes]] = field(default_factory=list)
    url: str = ""

    async def handle(self, request: web.Request) -> web.Response:
        self.requests.append((dict(request.headers), await request.read()))
        if len(self.requests) == 1:
            return web.Response(status=500)
        await asyncio.sleep(0.5)
        return web.Response(status=200)


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    hook = Receiver()
    app = web.Application()
    app.router.add_post("/hook", hook.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    hook.url = f"http://127.0.0.1:{runner.addresses[0][1]}/hook"
    try:
        yield hook
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(
    ("daemon_secret", "receiver_secret"),
    [
        (WHSEC, WHSEC),
        # A plain secret S is the key S: the receiver gives its library whsec_ + base64(S).
        (PLAIN, "whsec_" + base64.b64encode(PLAIN.encode()).decode()),
    ],
    ids=["whsec", "plain"],
)
async def test_a_standard_webhooks_library_verifies_what_the_daemon_sends(
    daemons: Daemons,
    sqlite_url: str,
    receiver: Receiver,
    daemon_secret: str,
    receiver_secret: str,
) -> None:
    async with Client.connect(Settings(database_url=sqlite_url)) as client:
        scheduled = await client.schedule(
            datetime.now(UTC) - timedelta(seconds=1), {"post": 42}, key="post-42"
        )
    publication = scheduled.publication.id
    process = daemons.start(
        {
            "SCHEDULER_DATABASE_URL": sqlite_url,
            "SCHEDULER_PUBLISH__INTERVAL": "0.2",
            "SCHEDULER_PUBLISH__PUBLISHERS": '["webhook"]',
            "SCHEDULER_PUBLISH__WEBHOOK__URL": receiver.url,
            "SCHEDULER_PUBLISH__WEBHOOK__SECRET": daemon_secret,
            "SCHEDULER_PUBLISH__WEBHOOK__BACKOFF": "0.2s",
        },
        args=["run", "--only", "publish"],
    )
    deadline = time.monotonic() + 30
    while len(receiver.requests) < 2:
        assert time.monotonic() < deadline, process.output()[-3000:]
        await asyncio.sleep(0.05)
    process.signal(signal.SIGTERM)
    assert await asyncio.to_thread(process.wait, 30) == 0
    [(first, first_body), (second, second_body)] = receiver.requests[:2]

    webhook = Webhook(receiver_secret)
    for headers, body in receiver.requests[:2]:
        # What a receiver does: the library checks the signature and the timestamp.
        message = webhook.verify(body, headers)
        assert message["id"] == publication
        assert message["key"] == "post-42"
        assert message["payload"] == {"post": 42}
        assert headers["webhook-id"] == str(publication) == headers["Idempotency-Key"]
        # The deprecated header goes on for now, under the same key.
        assert verify(webhook_key(daemon_secret), body, headers["X-Scheduler-Signature"])

    # One message, two attempts: the id stays, each attempt is signed afresh.
    assert [first["X-Scheduler-Attempt"], second["X-Scheduler-Attempt"]] == ["1", "2"]
    assert first["webhook-id"] == second["webhook-id"]
    assert first_body == second_body

    tampered_body = first_body.replace(b"42", b"43")
    assert tampered_body != first_body
    later = str(int(first["webhook-timestamp"]) + 1)
    for bad_headers, bad_body in [
        (first, tampered_body),
        ({**first, "webhook-timestamp": later}, first_body),
        ({**first, "webhook-id": str(publication + 1)}, first_body),
        ({**first, "webhook-signature": standard_signature(b"k", "1", 1, b"")}, first_body),
        ({k: v for k, v in first.items() if k != "webhook-signature"}, first_body),
    ]:
        with pytest.raises(WebhookVerificationError):
            webhook.verify(bad_body, bad_headers)
    with pytest.raises(WebhookVerificationError):
        Webhook("whsec_" + base64.b64encode(b"another key").decode()).verify(first_body, first)

    [outbox] = await afetch(
        sqlite_url,
        "SELECT status, attempts FROM scheduler_webhook_outbox WHERE publication_id = $1",
        publication,
    )
    # The stop let the POST in flight end and recorded it: the next leader will not resend.
    assert outbox == {"status": "delivered", "attempts": 2}
