"""Webhooks: signatures a receiver can trust, and redirects that are never followed."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from pydantic import SecretStr
from rig.processes import DaemonProcess, Daemons
from rig.sql import afetch

from scheduler_daemon.config import WebhookPublisherSettings
from scheduler_daemon.logs import get_logger
from scheduler_daemon.metrics import Metrics
from scheduler_daemon.publishers.webhook import (
    SIGNATURE_TOLERANCE,
    WebhookDeliverer,
    sign,
    verify,
)

SECRET = b"hmac-secret"
BODY = b'{"id": 1}'

# -- verify -------------------------------------------------------------------------


def test_verify_accepts_a_fresh_signature() -> None:
    assert verify(SECRET, BODY, sign(SECRET, BODY, int(time.time())))
    assert SIGNATURE_TOLERANCE == 300  # the documented default: 5 minutes


def test_verify_refuses_the_wrong_body_or_secret() -> None:
    header = sign(SECRET, BODY, int(time.time()))
    assert not verify(SECRET, b'{"id": 2}', header)
    assert not verify(b"another secret", BODY, header)
    # A signature for another timestamp, with this one's t: the MAC covers t.
    forged = sign(SECRET, BODY, int(time.time()) - 1).split(",")[1]
    assert not verify(SECRET, BODY, f"t={int(time.time())},{forged}")


@pytest.mark.parametrize(
    ("age", "tolerance", "valid"),
    [
        (-250, None, True),  # 250 s old: within the default 5 minutes
        (-400, None, False),  # a replay
        (-(10**6), None, False),  # a replay from long ago
        (250, None, True),  # a sender's clock a little ahead
        (400, None, False),  # too far in the future
        (-400, 600, True),  # the window is a keyword argument
        (-30, 10, False),
        (30, 10, False),
    ],
)
def test_verify_tolerance_window(age: int, tolerance: int | None, valid: bool) -> None:
    header = sign(SECRET, BODY, int(time.time()) + age)
    kwargs = {} if tolerance is None else {"tolerance": tolerance}
    assert verify(SECRET, BODY, header, **kwargs) is valid


def test_verify_returns_false_for_malformed_headers() -> None:
    now = int(time.time())
    mac = sign(SECRET, BODY, now).split("v1=")[1]
    malformed: list[Any] = [
        "",
        "garbage",
        ",",
        "=",
        f"v1={mac}",  # no t
        f"t={now}",  # no v1
        f"t={now},v1=",
        f"t=,v1={mac}",
        f"t=abc,v1={mac}",
        f"t={now}.0,v1={mac}",
        f"t=+{now},v1={mac}",
        f"t=-{now},v1={mac}",
        f"t={now // 1000}_{now % 1000:03},v1={mac}",  # int() would accept it
        f"t={'١٢٣'},v1={mac}",  # non-ASCII digits: int() would accept them too
        f"t={'9' * 5000},v1={mac}",  # int() would raise on so many digits
        f"t={now},t={now},v1={mac}",  # two timestamps
        f"t={now},v1={mac},garbage",
        f"t={now},v1=é{mac[1:]}",  # compare_digest raises on non-ASCII str
        f"t={now},v1={mac[:-1]}",
        None,
        sign(SECRET, BODY, now).encode(),  # bytes, not str
    ]
    for header in malformed:
        assert verify(SECRET, BODY, header) is False, header


def test_verify_accepts_any_matching_v1_and_spaces() -> None:
    """Several v1 values (a sender rotating its secret) and spaces after commas, as
    receivers of this header format commonly allow."""
    now = int(time.time())
    mac = sign(SECRET, BODY, now).split("v1=")[1]
    other = sign(b"old secret", BODY, now).split("v1=")[1]
    assert verify(SECRET, BODY, f"t={now},v1={other},v1={mac}")
    assert verify(SECRET, BODY, f"t={now}, v1={mac}")
    assert verify(SECRET, BODY, f"t={now},v1={mac},v2=whatever")


# -- redirects ----------------------------------------------------------------------


@pytest.fixture
async def endpoint() -> AsyncIterator[dict[str, Any]]:
    """An HTTP server: /redirect/<status> answers <status> with a Location that carries a
    token (absolute, to https, with ?to=https; else relative); /target records requests."""
    state: dict[str, Any] = {"redirects": [], "target": []}

    async def redirect(request: web.Request) -> web.Response:
        state["redirects"].append(
            {"method": request.method, "body": await request.read(), "query": request.query}
        )
        status = int(request.match_info["status"])
        to = request.query.get("to")
        if to == "none":
            return web.Response(status=status)
        location = (
            f"{to}://hooks.example.test/target/tok-SECRETPATH?key=SECRETQUERY"
            if to
            else "/target/tok-SECRETPATH?key=SECRETQUERY"
        )
        return web.Response(status=status, headers={"Location": location})

    async def target(request: web.Request) -> web.Response:
        state["target"].append({"method": request.method, "body": await request.read()})
        return web.Response(status=200)

    app = web.Application()
    app.router.add_route("*", "/redirect/{status}", redirect)
    app.router.add_route("*", "/target/{rest:.*}", target)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    state["base"] = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        yield state
    finally:
        await runner.cleanup()


def deliverer(url: str) -> WebhookDeliverer:
    settings = WebhookPublisherSettings(url=SecretStr(url), secret=SecretStr(SECRET.decode()))
    return WebhookDeliverer(settings, Metrics(), get_logger())


def outbox_row(publication_id: int = 7) -> dict[str, Any]:
    at = datetime(2030, 1, 1, tzinfo=UTC)
    return {
        "id": publication_id,
        "key": None,
        "payload": {"a": 1},
        "publish_at": at,
        "published_at": at,
        "attempts": 0,
    }


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
@pytest.mark.parametrize(
    ("to", "expected"),
    [
        ("https", "redirect to https://hooks.example.test/*** not followed"),
        ("", "redirect to http://127.0.0.1:{port}/*** not followed"),  # relative Location
        ("none", "redirect without a Location, not followed"),
    ],
)
async def test_post_never_follows_a_redirect(
    endpoint: dict[str, Any], status: int, to: str, expected: str
) -> None:
    url = f"{endpoint['base']}/redirect/{status}?to={to}&token=OURTOKEN"
    async with aiohttp.ClientSession() as session:
        error = await deliverer(url)._post(session, outbox_row(), 7)
    port = endpoint["base"].rsplit(":", 1)[1]
    assert error == f"HTTP {status}: " + expected.format(port=port)
    for secret in ("SECRETPATH", "SECRETQUERY", "OURTOKEN"):
        assert secret not in error
    assert endpoint["target"] == [], "the redirect was followed"
    [call] = endpoint["redirects"]
    assert call["method"] == "POST"
    assert json.loads(call["body"])["id"] == 7


async def wait_for_outbox(url: str, publication: int, within: float) -> dict[str, Any]:
    deadline = time.monotonic() + within
    while True:
        rows = await afetch(
            url,
            "SELECT status, attempts, last_error FROM scheduler_webhook_outbox "
            "WHERE publication_id = $1",
            publication,
        )
        if rows and rows[0]["status"] != "pending":
            return rows[0]
        if time.monotonic() > deadline:
            raise AssertionError(f"outbox row still pending after {within}s: {rows}")
        await asyncio.sleep(0.1)


@pytest.mark.parametrize("status", [301, 302, 307])
async def test_a_redirecting_endpoint_is_never_delivered(
    daemons: Daemons, database_url: str, endpoint: dict[str, Any], status: int
) -> None:
    """An endpoint that moved (the http->https kind): aiohttp used to follow the redirect
    (a 301/302 as a GET without the body) and record the 2xx of the new place as
    delivered. Now every attempt fails with the status and the redacted Location, is
    retried with backoff, and the publication ends failed."""
    url = database_url
    now = "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')" if url.startswith("sqlite") else "now()"
    [row] = await afetch(
        url,
        "INSERT INTO scheduler_publications (key, payload, publish_at) "
        f"VALUES ('hook', '{{\"a\": 1}}', {now}) RETURNING id",
    )
    publication = row["id"]
    env = {
        "SCHEDULER_DATABASE_URL": url,
        "SCHEDULER_PUBLISH__INTERVAL": "0.2",
        "SCHEDULER_LOCK__HEARTBEAT_INTERVAL": "0.5",
        "SCHEDULER_PUBLISH__PUBLISHERS": '["webhook"]',
        # Relative Location: the target on this server, which would answer 200.
        "SCHEDULER_PUBLISH__WEBHOOK__URL": f"{endpoint['base']}/redirect/{status}?to=",
        "SCHEDULER_PUBLISH__WEBHOOK__SECRET": SECRET.decode(),
        "SCHEDULER_PUBLISH__WEBHOOK__BACKOFF": "0.2s",
        "SCHEDULER_PUBLISH__WEBHOOK__MAX_ATTEMPTS": "3",
    }
    process: DaemonProcess = daemons.start(env, args=["run", "--only", "publish"])
    try:
        outbox = await wait_for_outbox(url, publication, within=30)
    finally:
        process.signal(15)
        await asyncio.to_thread(process.wait, 15)
    expected = f"HTTP {status}: redirect to {endpoint['base']}/*** not followed"
    assert outbox == {"status": "failed", "attempts": 3, "last_error": expected}
    [state] = await afetch(
        url, "SELECT status, last_error FROM scheduler_publications WHERE id = $1", publication
    )
    assert state == {"status": "failed", "last_error": f"webhook: {expected}"}
    assert endpoint["target"] == [], "the redirect was followed"
    assert [call["method"] for call in endpoint["redirects"]] == ["POST"] * 3
    retries = [e for e in process.log_events() if e.get("event") == "webhook.retry"]
    assert [e["attempt"] for e in retries] == [1, 2]
    assert all(e["error"] == expected for e in retries)
    assert "SECRETPATH" not in process.output()
    assert "SECRETQUERY" not in process.output()
