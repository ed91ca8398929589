"""Webhooks: signatures a receiver can trust, redirects that are never followed, and
delivery across replicas (each attempt once, one replica at a time, failover)."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from pydantic import SecretStr
from rig.overlap import find_overlaps
from rig.processes import DaemonProcess, Daemons, start_replicas
from rig.sql import afetch
from rig.ticks import FAST_TIMINGS, stop_all
from rig.waiting import until

from scheduler_daemon.config.settings import WebhookPublisherSettings
from scheduler_daemon.config.values import DEFAULT_PUBLISH_KEY
from scheduler_daemon.db.publications import OwedWebhook, Published
from scheduler_daemon.leadership import LeadershipLost
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
PUBLISH_ONLY = ("run", "--only", "publish")

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


def outbox_row(publication_id: int = 7) -> OwedWebhook:
    at = datetime(2030, 1, 1, tzinfo=UTC)
    return OwedWebhook(Published(publication_id, None, {"a": 1}, at, at), attempts=0)


@dataclass
class Held:
    """What a POST reads of its hold: the token it sends, and whether it may send."""

    fencing_token: int
    reason: str | None = None
    proven: bool = True

    def proven_recently(self) -> bool:
        return self.proven


async def test_no_post_leaves_once_the_last_proof_is_stale(endpoint: dict[str, Any]) -> None:
    """A leader resumed after a freeze: its POST tasks may run before the heartbeat that
    would notice. The age of the last proof stops the request before it is sent."""
    url = f"{endpoint['base']}/redirect/307?to=none"
    stale = Held(fencing_token=7, reason="heartbeat 9.0s late (process stalled)", proven=False)
    async with aiohttp.ClientSession() as session:
        with pytest.raises(LeadershipLost, match="stalled"):
            await deliverer(url)._post(session, outbox_row(), stale)  # type: ignore[arg-type]
    assert endpoint["redirects"] == [], "a request was sent"


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
        error = await deliverer(url)._post(session, outbox_row(), Held(fencing_token=7))  # type: ignore[arg-type]
    port = endpoint["base"].rsplit(":", 1)[1]
    assert error == f"HTTP {status}: " + expected.format(port=port)
    for secret in ("SECRETPATH", "SECRETQUERY", "OURTOKEN"):
        assert secret not in error
    assert endpoint["target"] == [], "the redirect was followed"
    [call] = endpoint["redirects"]
    assert call["method"] == "POST"
    assert json.loads(call["body"])["id"] == 7


async def wait_for_outbox(url: str, publication: int, within: float) -> dict[str, Any]:
    async def settled() -> dict[str, Any] | None:
        rows = await afetch(
            url,
            "SELECT status, attempts, last_error FROM scheduler_webhook_outbox "
            "WHERE publication_id = $1",
            publication,
        )
        return rows[0] if rows and rows[0]["status"] != "pending" else None

    row: dict[str, Any] = await until(settled, f"outbox row of {publication} settled", within)
    return row


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


# -- delivery across replicas (PostgreSQL) ------------------------------------------


@dataclass
class Call:
    """One request as the endpoint saw it, timed on its own clock (time.monotonic)."""

    replica: str  # from the per-replica URL's ?replica=
    publication: int  # Idempotency-Key
    attempt: int  # X-Scheduler-Attempt
    token: int | None  # X-Scheduler-Fencing-Token (None: the header was missing)
    signed: bool
    start: float  # the handler began (the request's headers had arrived)
    end: float | None = None  # the response was written (or could not be)


class Hook:
    """A webhook endpoint that holds each request `hold` seconds, answers
    ``status(call)``, and records every request with its start and the end of its
    response, server side."""

    def __init__(self, hold: float, status: Callable[[Call], int]) -> None:
        self.hold = hold
        self.status = status
        self.calls: list[Call] = []
        self.base = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        start = time.monotonic()
        body = await request.read()
        token = request.headers.get("X-Scheduler-Fencing-Token")
        call = Call(
            replica=request.query.get("replica", "?"),
            publication=int(request.headers["Idempotency-Key"]),
            attempt=int(request.headers["X-Scheduler-Attempt"]),
            token=None if token is None else int(token),
            signed=verify(SECRET, body, request.headers.get("X-Scheduler-Signature", "")),
            start=start,
        )
        self.calls.append(call)
        try:
            # Held, unless the sender goes away first (cancelled, killed): then the request
            # ends there, which is when its sender stopped working on it.
            deadline = start + self.hold
            while time.monotonic() < deadline:
                if request.transport is None or request.transport.is_closing():
                    return web.Response(status=499)
                await asyncio.sleep(min(0.005, max(0.0, deadline - time.monotonic())))
            response = web.StreamResponse(status=self.status(call))
            await response.prepare(request)
            await response.write_eof()  # sent: only now can the sender see the answer
            return response
        finally:  # a dead client (SIGKILLed sender) makes the writes fail: still an end
            call.end = time.monotonic()

    def of(self, publication: int) -> list[Call]:
        return sorted((c for c in self.calls if c.publication == publication), key=start_of)

    def by_replica(self) -> dict[str, int]:
        return dict(sorted(Counter(c.replica for c in self.calls).items()))


def start_of(call: Call) -> float:
    return call.start


def tokens(calls: list[Call]) -> list[int | None]:
    """The distinct fencing tokens, in order of first appearance."""
    return list(dict.fromkeys(call.token for call in sorted(calls, key=start_of)))


Serve = Callable[[float, Callable[[Call], int]], Awaitable[Hook]]


@pytest.fixture
async def hook_server() -> AsyncIterator[Serve]:
    """``hook_server(hold, status)`` starts a `Hook` on its own port (in this event loop:
    block it only through asyncio.to_thread)."""
    runners: list[web.AppRunner] = []

    async def serve(hold: float, status: Callable[[Call], int]) -> Hook:
        hook = Hook(hold, status)
        app = web.Application()
        app.router.add_post("/hook", hook.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        runners.append(runner)
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        hook.base = f"http://127.0.0.1:{runner.addresses[0][1]}"
        return hook

    try:
        yield serve
    finally:
        for runner in runners:
            await runner.cleanup()


def hook_env(url: str, hook: Hook, replica: str, **extra: str) -> dict[str, str]:
    return {
        "SCHEDULER_DATABASE_URL": url,
        "SCHEDULER_INSTANCE_ID": replica,
        **FAST_TIMINGS,
        "SCHEDULER_PUBLISH__INTERVAL": "0.2",
        "SCHEDULER_PUBLISH__PUBLISHERS": '["webhook"]',
        # The query string tells the endpoint which replica sent a request.
        "SCHEDULER_PUBLISH__WEBHOOK__URL": f"{hook.base}/hook?replica={replica}",
        "SCHEDULER_PUBLISH__WEBHOOK__SECRET": SECRET.decode(),
        "SCHEDULER_PUBLISH__WEBHOOK__BACKOFF": "0.2s",
        "SCHEDULER_PUBLISH__WEBHOOK__MAX_ATTEMPTS": "4",
        **extra,
    }


async def hook_replicas(
    daemons: Daemons, url: str, hook: Hook, count: int, **extra: str
) -> list[DaemonProcess]:
    """`count` publishing replicas r1.. sending to `hook`, all of them competing (their
    publish loop started) before anything is due."""
    envs = [(f"r{n}", hook_env(url, hook, f"r{n}", **extra)) for n in range(1, count + 1)]
    return await asyncio.to_thread(
        start_replicas, daemons, envs, PUBLISH_ONLY, loop="publish", ready="loop.started"
    )


async def stop_replicas(replicas: list[DaemonProcess]) -> None:
    await asyncio.to_thread(stop_all, replicas)


async def schedule_due(url: str, count: int, spread: float = 0.0) -> list[int]:
    """`count` publications, the first due now and the others every `spread` seconds."""
    rows = await afetch(
        url,
        "INSERT INTO scheduler_publications (key, payload, publish_at) "
        "SELECT 'w' || g, jsonb_build_object('n', g), "
        "now() + make_interval(secs => g * $2::float8) "
        "FROM generate_series(0, $1 - 1) g RETURNING id",
        count,
        spread,
    )
    return sorted(row["id"] for row in rows)


async def outbox_settled(url: str, ids: list[int], within: float) -> dict[int, dict[str, Any]]:
    """Every outbox row of `ids` once none is pending (fails the test after `within`)."""
    deadline = time.monotonic() + within
    while True:
        rows = await afetch(
            url,
            "SELECT o.publication_id, o.status, o.attempts, o.last_error, "
            "p.status AS publication_status "
            "FROM scheduler_webhook_outbox o JOIN scheduler_publications p "
            "ON p.id = o.publication_id WHERE o.publication_id = ANY($1::bigint[])",
            ids,
        )
        if len(rows) == len(ids) and all(row["status"] != "pending" for row in rows):
            return {row.pop("publication_id"): row for row in rows}
        if time.monotonic() > deadline:
            raise AssertionError(f"outbox not settled after {within}s: {rows}")
        await asyncio.sleep(0.1)


def overlapping(
    calls: list[Call], holder: Callable[[Call], str] | None = None
) -> list[tuple[Call, Call]]:
    """Pairs of requests that were at the endpoint at the same time (the rule of
    ``rig.overlap``, on the endpoint's clock): any two, or with `holder` two of different
    holders."""
    for call in calls:
        assert call.end is not None, f"a request without an end: {call}"
    return [(o.earlier, o.later) for o in find_overlaps(calls, holder=holder)]


def check_one_replica_at_a_time(calls: list[Call]) -> None:
    """Transaction mode: a round's POSTs run inside the hold that owns the lock, so two
    replicas' requests are never at the endpoint at once, and the fencing token never
    goes backwards; it grows whenever the replica changes."""
    assert "?" not in {c.replica for c in calls}, "the URL's ?replica= did not arrive"
    across = overlapping(calls, holder=lambda call: call.replica)
    assert across == [], f"{len(across)} overlaps across replicas, e.g. {across[:3]}"
    ordered = sorted(calls, key=start_of)
    assert all(call.token is not None for call in ordered), "no X-Scheduler-Fencing-Token"
    for before, after in itertools.pairwise(ordered):
        assert before.token is not None
        assert after.token is not None
        if after.replica == before.replica:
            assert after.token >= before.token, (before, after)
        else:
            assert after.token > before.token, (before, after)


async def left_pending(url: str, count: int, due_in: float) -> list[int]:
    """`count` publications that a previous leader published and died before delivering:
    outbox rows pending, their first attempt due in `due_in` seconds. Every replica's
    deliverer sees them in its first round, so all of them wake for the same attempt
    (a deliverer that publishes nothing itself otherwise sleeps until it is told)."""
    rows = await afetch(
        url,
        "WITH p AS (INSERT INTO scheduler_publications "
        "(key, payload, publish_at, status, published_at, published_by, attempts) "
        "SELECT 'left' || g, '{}', now(), 'published', now(), 'gone', 1 "
        "FROM generate_series(1, $1) g RETURNING id) "
        "INSERT INTO scheduler_webhook_outbox (publication_id, next_attempt_at) "
        "SELECT id, now() + make_interval(secs => $2::float8) FROM p "
        "RETURNING publication_id",
        count,
        due_in,
    )
    return sorted(row["publication_id"] for row in rows)


async def seconds_until_due(url: str) -> float:
    rows = await afetch(
        url,
        "SELECT extract(epoch FROM min(next_attempt_at) - now())::float8 AS s "
        "FROM scheduler_webhook_outbox WHERE status = 'pending'",
    )
    return float(rows[0]["s"] or 0.0)


@pytest.mark.postgres
@pytest.mark.parametrize("replicas", [2, pytest.param(3, marks=pytest.mark.chaos_long)])
async def test_transaction_mode_posts_each_attempt_once_cluster_wide(
    daemons: Daemons, pg_url: str, hook_server: Serve, replicas: int
) -> None:
    """The review's repro: in transaction mode every replica ran a deliverer and
    ``outbox_due`` claimed nothing, so with 2 replicas and a failing endpoint every round
    was POSTed twice and ``attempts`` rose by 2 per round. Now each attempt is POSTed
    once, numbered 1..max_attempts, never two at once for one publication, and the rows
    end failed after exactly max_attempts POSTs. Rows left pending (every replica
    races for each attempt) and rows published during the run."""
    hook = await hook_server(0.05, lambda call: 500)
    ids = await left_pending(pg_url, 3, due_in=4.0)
    processes = await hook_replicas(
        daemons, pg_url, hook, replicas, SCHEDULER_LOCK__MODE="transaction"
    )
    margin = await seconds_until_due(pg_url)
    ids += await schedule_due(pg_url, 3)
    outbox = await outbox_settled(pg_url, ids, within=60)
    await asyncio.sleep(1.0)  # a duplicate or a late round would arrive now
    await stop_replicas(processes)
    print(
        f"\n{replicas} replicas, failing endpoint: {len(hook.calls)} POSTs, by replica "
        f"{hook.by_replica()}, tokens {tokens(hook.calls)}; all up {margin:.1f}s early"
    )
    for publication in ids:
        calls = hook.of(publication)
        assert [c.attempt for c in calls] == [1, 2, 3, 4], (publication, calls)
        same_time = overlapping(calls)
        assert same_time == [], f"publication {publication} in flight twice: {same_time}"
        assert outbox[publication] == {
            "status": "failed",
            "attempts": 4,
            "last_error": "HTTP 500",
            "publication_status": "failed",
        }
    assert all(call.signed for call in hook.calls)
    check_one_replica_at_a_time(hook.calls)


@pytest.mark.postgres
@pytest.mark.parametrize("replicas", [3])
async def test_transaction_mode_delivers_each_publication_once(
    daemons: Daemons, pg_url: str, hook_server: Serve, replicas: int
) -> None:
    """A succeeding endpoint: one POST per publication, attempt 1, delivered."""
    hook = await hook_server(0.05, lambda call: 204)
    ids = await left_pending(pg_url, 3, due_in=4.0)
    processes = await hook_replicas(
        daemons, pg_url, hook, replicas, SCHEDULER_LOCK__MODE="transaction"
    )
    margin = await seconds_until_due(pg_url)
    ids += await schedule_due(pg_url, 9, spread=0.1)
    outbox = await outbox_settled(pg_url, ids, within=60)
    await asyncio.sleep(1.0)
    await stop_replicas(processes)
    print(
        f"\n{replicas} replicas, succeeding endpoint: POSTs by replica {hook.by_replica()}; "
        f"all up {margin:.1f}s early"
    )
    for publication in ids:
        assert [c.attempt for c in hook.of(publication)] == [1], hook.of(publication)
        assert outbox[publication] == {
            "status": "delivered",
            "attempts": 1,
            "last_error": None,
            "publication_status": "published",
        }
    check_one_replica_at_a_time(hook.calls)


@pytest.mark.chaos_long  # `make test-long`: kept out of `make test`'s 10 minutes
@pytest.mark.postgres
async def test_transaction_mode_webhook_work_never_overlaps_across_replicas(
    daemons: Daemons, pg_url: str, hook_server: Serve
) -> None:
    """Three replicas, publications due throughout ~4 s, an endpoint that holds every
    request 50 ms and fails each first attempt: rounds start from publishing (the
    winner's own wake-up) and from retry timers (every replica's), and still no request
    of one replica is at the endpoint while another's is."""
    hook = await hook_server(0.05, lambda call: 500 if call.attempt == 1 else 200)
    processes = await hook_replicas(daemons, pg_url, hook, 3, SCHEDULER_LOCK__MODE="transaction")
    ids = await schedule_due(pg_url, 20, spread=0.2)
    outbox = await outbox_settled(pg_url, ids, within=60)
    await asyncio.sleep(1.0)
    await stop_replicas(processes)
    print(f"\nno-overlap run: {len(hook.calls)} POSTs, by replica {hook.by_replica()}")
    for publication in ids:
        assert [c.attempt for c in hook.of(publication)] == [1, 2], hook.of(publication)
        assert outbox[publication]["status"] == "delivered"
        assert outbox[publication]["attempts"] == 2
    check_one_replica_at_a_time(hook.calls)


@pytest.mark.postgres
async def test_session_mode_leader_killed_while_the_endpoint_holds_its_requests(
    daemons: Daemons, pg_url: str, hook_server: Serve
) -> None:
    """Session mode, an endpoint that answers after 1 s, the leader SIGKILLed while all
    its POSTs are held. The standby takes over and delivers everything. What is promised
    and checked:

    - at least once: each POST whose result the dead leader never recorded is repeated
      (here: all of them, with the same attempt number), and each publication is POSTed
      exactly once by the new leader, whose result is recorded;
    - fencing: every request carries its sender's token, and the new leader's is larger
      than any the dead one used. A receiver that keeps the largest token never has to
      refuse a new leader's request; the only requests it may refuse are the dead
      leader's, sent before it died (here they all arrived before the kill, so it refuses
      none: a request still in the network could arrive later, with its old token).
    """
    hook = await hook_server(1.0, lambda call: 200)
    old = daemons.start(hook_env(pg_url, hook, "r1"), PUBLISH_ONLY, "r1")
    await asyncio.to_thread(old.wait_for_log, "leader.acquired", 30, loop="publish")
    new = daemons.start(hook_env(pg_url, hook, "r2"), PUBLISH_ONLY, "r2")
    await asyncio.to_thread(new.wait_for_log, "leader.waiting", 30, loop="publish")
    ids = await schedule_due(pg_url, 5)  # fewer than webhook.concurrency: all at once
    deadline = time.monotonic() + 30
    while len(hook.calls) < len(ids):
        assert time.monotonic() < deadline, f"the leader's POSTs did not arrive: {hook.calls}"
        await asyncio.sleep(0.01)
    before_kill = list(hook.calls)  # all the dead leader will ever send: 5 rows, 5 POSTs
    killed_at = time.monotonic()
    await asyncio.to_thread(old.kill)
    # The scenario: no answer had been written when it died, so it recorded none of them.
    assert all(c.end is None or c.end > killed_at for c in before_kill), before_kill
    outbox = await outbox_settled(pg_url, ids, within=30)
    await asyncio.sleep(1.5)  # the dead leader's held requests end; duplicates arrive
    await stop_replicas([new])
    takeover = next(e for e in new.log_events() if e.get("event") == "leader.acquired")

    assert {c.replica for c in before_kill} == {"r1"}
    assert sorted(c.publication for c in before_kill) == ids
    after_kill = hook.calls[len(before_kill) :]  # the list only grows
    assert {c.replica for c in after_kill} == {"r2"}, after_kill
    assert all(c.start > killed_at for c in after_kill)
    duplicated = sorted(p for p, n in Counter(c.publication for c in hook.calls).items() if n > 1)
    print(
        f"\nsession failover: {len(hook.calls)} POSTs for {len(ids)} publications, "
        f"{len(duplicated)} repeated; tokens r1 {tokens(before_kill)}, "
        f"r2 {tokens(after_kill)} (leader.acquired fencing_token "
        f"{takeover.get('fencing_token')}); first r2 POST "
        f"{min(c.start for c in after_kill) - killed_at:.3f}s after the kill"
    )
    for publication in ids:
        calls = hook.of(publication)
        assert [(c.replica, c.attempt) for c in calls] == [("r1", 1), ("r2", 1)], calls
        assert outbox[publication] == {
            "status": "delivered",
            "attempts": 1,
            "last_error": None,
            "publication_status": "published",
        }
    assert duplicated == ids  # none of the dead leader's results had been recorded

    [old_token] = {c.token for c in before_kill}
    [new_token] = {c.token for c in after_kill}
    assert old_token is not None
    assert new_token is not None
    assert new_token > old_token
    assert takeover["fencing_token"] == new_token
    largest = 0
    refused = []
    for call in sorted(hook.calls, key=start_of):  # a receiver that remembers the largest
        assert call.token is not None
        if call.token < largest:
            refused.append(call)
        largest = max(largest, call.token)
    assert all(c.replica == "r1" and c.start < killed_at for c in refused), refused


@pytest.mark.chaos_long  # `make test-long`: kept out of `make test`'s 10 minutes
@pytest.mark.postgres
async def test_transaction_mode_a_lost_round_stops_its_posts_before_anyone_else_posts(
    daemons: Daemons, pg_url: str, hook_server: Serve
) -> None:
    """Transaction mode, an endpoint that holds requests 4 s, the backend of the round's
    transaction terminated mid-POST: the round's POSTs are work of its hold, so they are
    cancelled with it; and the replica that wins the lock next finds the fencing sequence
    ahead of the last committed token (the lost round drew one) and waits settle_time
    before its own POSTs. No two replicas' requests are ever at the endpoint at once."""
    hook = await hook_server(4.0, lambda call: 200)
    extra = {"SCHEDULER_LOCK__MODE": "transaction", "SCHEDULER_PUBLISH__WEBHOOK__TIMEOUT": "20s"}
    processes = await hook_replicas(daemons, pg_url, hook, 2, **extra)
    ids = await schedule_due(pg_url, 3)
    deadline = time.monotonic() + 30
    while not hook.calls:
        assert time.monotonic() < deadline, "no POST arrived"
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.3)
    holder = await afetch(
        pg_url,
        "SELECT l.pid FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted "
        "AND l.objid = $1::bigint::oid",
        DEFAULT_PUBLISH_KEY,
    )
    assert len(holder) == 1, holder
    cut = time.monotonic()
    await afetch(pg_url, "SELECT pg_terminate_backend($1)", holder[0]["pid"])
    outbox = await outbox_settled(pg_url, ids, within=60)
    await stop_replicas(processes)
    first = min(hook.calls, key=start_of)
    assert first.end is not None
    later = [c for c in hook.calls if c.start > cut]
    print(
        f"\nlost round: its POST ended {first.end - cut:.3f}s after the cut; the next POST "
        f"started {min(c.start for c in later) - cut:.3f}s after it; by replica "
        f"{hook.by_replica()}"
    )
    assert first.end - cut < 1.0  # cancelled with its hold, not after the 4 s hold
    assert all(row["status"] == "delivered" for row in outbox.values()), outbox
    check_one_replica_at_a_time(hook.calls)


@pytest.mark.chaos_long  # `make test-long`: a measurement over several freezes
@pytest.mark.postgres
async def test_a_leader_resumed_after_eviction_sends_no_webhook(
    daemons: Daemons, pg_url: str, hook_server: Serve
) -> None:
    """Session mode, publications due all along, the delivering leader SIGSTOPped at
    random moments of its rounds (between selecting rows and POSTing them too), evicted,
    replaced, then SIGCONTed. Its timers fire in deadline order on resume, possibly before
    its heartbeat; every POST first asks the age of the last proof, so none of its
    requests reaches the endpoint after it resumed. Every publication is delivered."""
    hook = await hook_server(0.05, lambda call: 200)
    replicas = [
        daemons.start(hook_env(pg_url, hook, f"r{n}", SCHEDULER_PUBLISH__WEBHOOK__CONCURRENCY="4"),
                      PUBLISH_ONLY, f"r{n}")
        for n in (1, 2)
    ]  # fmt: skip
    ids = await schedule_due(pg_url, 400, spread=0.08)
    resumed: list[tuple[str, float]] = []

    async def delivered_since(since: float, by_other_than: str = "") -> bool:
        return any(c.replica != by_other_than and c.start > since for c in hook.calls)

    for _freeze in range(4):
        await until(partial(delivered_since, 0.0), "a delivery", 30, every=0.01)
        sender = hook.calls[-1].replica
        victim = next(p for p in replicas if p.name == sender)
        await asyncio.sleep(random.uniform(0.0, 0.2))
        victim.signal(signal.SIGSTOP)
        stopped = time.monotonic()
        # Until the other replica delivers: it was granted the lock after the eviction.
        await until(partial(delivered_since, stopped, sender), "a take-over", 30, every=0.02)
        resumed.append((sender, time.monotonic()))
        victim.signal(signal.SIGCONT)
        await asyncio.sleep(1.0)
    await outbox_settled(pg_url, ids, within=60)
    await stop_replicas(replicas)
    stale = [
        (c.replica, round(c.start - at, 4))
        for sender, at in resumed
        for c in hook.calls
        if c.replica == sender and at < c.start < at + 1.0
    ]
    print(f"\n{len(resumed)} freezes: POSTs by the resumed leader within 1 s of SIGCONT: {stale}")
    assert stale == []
