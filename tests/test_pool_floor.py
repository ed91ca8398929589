"""Lock mode ``transaction``: the pool fits everything that can hold a connection at once.

In this mode every lock lives in a pooled transaction, and a hold's heartbeat proves its
lock through the pool while a statement runs on the hold's own connection. A proof that
waits for a free connection counts as failed (leadership/heartbeat.py): the hold is lost and
its work cancelled on a healthy leader. The floor (``config.transaction_pool_users``)
counts the ticks, the holds, each hold's proof and the HTTP endpoints; the daemon's pool
is at least that large, so no acquire ever finds it full. The acceptance test runs a
daemon in this mode with every one of them busy at once and watches its pool.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import time
from typing import Any

import aiohttp
import asyncpg
import asyncpg.pool
import pytest
from aiohttp import web
from rig.ticks import FAST_TIMINGS

from scheduler_daemon.config import load_settings
from scheduler_daemon.config.settings import LogSettings, Settings, transaction_pool_users
from scheduler_daemon.errors import ConfigError
from scheduler_daemon.logs import configure_logging

WEBHOOK = {
    "publishers": ["webhook"],
    "webhook": {"url": "https://hooks.example.com/in", "secret": "hmac-secret"},
}


def floor(settings: Settings) -> int:
    return sum(transaction_pool_users(settings).values())


def test_the_floor_counts_what_the_daemon_runs() -> None:
    transaction = {"lock": {"mode": "transaction"}}
    everything = Settings(**transaction, publish=WEBHOOK)  # type: ignore[arg-type]
    assert transaction_pool_users(everything) == {
        "publish tick and its proof": 2,
        "webhook round's hold and its proof": 2,
        "plugin tick": 1,
        "plugin batch's hold and its proof": 2,
        "hold a plugin tick hands the next batch to": 1,
        "/readyz and /metrics check": 1,
        "/status report": 1,
        "dashboard read": 1,
    }
    assert floor(everything) == 11
    assert floor(Settings(**transaction)) == 9  # type: ignore[arg-type]
    publish_only = Settings(**transaction, plugin={"enabled": False}, http={"enabled": False})  # type: ignore[arg-type]
    assert floor(publish_only) == 2


def test_the_default_pool_grows_to_the_floor_and_a_smaller_one_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Session mode keeps the default; transaction mode's default is its floor.
    assert Settings().database.pool_max_size == 5
    grown = Settings(lock={"mode": "transaction"}, publish=WEBHOOK)  # type: ignore[arg-type]
    assert grown.database.pool_max_size == 11
    larger = Settings(lock={"mode": "transaction"}, database={"pool_max_size": 30})  # type: ignore[arg-type]
    assert larger.database.pool_max_size == 30
    # Set explicitly below the floor, the old floor of 4 included: exit 78 naming it.
    monkeypatch.setenv("SCHEDULER_LOCK__MODE", "transaction")
    monkeypatch.setenv("SCHEDULER_DATABASE__POOL_MAX_SIZE", "4")
    with pytest.raises(ConfigError) as refused:
        load_settings(None)
    message = str(refused.value)
    assert "database.pool_max_size" in message
    assert "needs at least 9 pooled connections" in message
    assert "got 4" in message


@pytest.fixture
def pool_watch(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Every pool's acquires: the most connections in use at once, and every acquire
    that found the pool full (and so waited for a release)."""
    watch: dict[str, Any] = {"peak": 0, "full": [], "acquires": 0}
    real_acquire = asyncpg.pool.Pool._acquire

    async def acquire(pool: asyncpg.pool.Pool, *args: Any) -> Any:
        if pool._queue.empty():  # type: ignore[attr-defined]
            watch["full"].append(time.monotonic())
        proxy = await real_acquire(pool, *args)
        in_use = pool._maxsize - pool._queue.qsize()  # type: ignore[attr-defined]
        watch["peak"] = max(watch["peak"], in_use)
        watch["acquires"] += 1
        return proxy

    monkeypatch.setattr(asyncpg.pool.Pool, "_acquire", acquire)
    return watch


@pytest.mark.postgres
@pytest.mark.usefixtures("restore_logging")
async def test_no_proof_waits_for_a_connection_with_everything_busy_at_once(
    pg_url: str, monkeypatch: pytest.MonkeyPatch, pool_watch: dict[str, Any]
) -> None:
    """Both loops, the webhook deliverer, a publisher and plugin tasks whose statements
    keep their holds' connections busy (so proofs go through the pool), and bursts of
    /readyz, /metrics and /status requests: the default pool (the floor) never makes an
    acquire wait, and no hold is lost."""
    from scheduler_daemon.daemon import Daemon
    from scheduler_daemon.logs import get_logger

    async def slow_receiver(request: web.Request) -> web.Response:
        await request.read()
        await asyncio.sleep(0.3)  # the webhook round holds the publish lock meanwhile
        return web.Response(status=204)

    app = web.Application()
    app.router.add_post("/in", slow_receiver)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]

    env = {
        **FAST_TIMINGS,
        "SCHEDULER_DATABASE_URL": pg_url,
        "SCHEDULER_LOCK__MODE": "transaction",
        "SCHEDULER_HTTP__PORT": "0",
        "SCHEDULER_PUBLISH__INTERVAL": "0.2s",
        "SCHEDULER_PUBLISH__PUBLISHERS": '["sql", "webhook"]',
        # Longer than a heartbeat interval (0.5 s): the tick's proof goes through the pool.
        "SCHEDULER_PUBLISH__SQL__STATEMENT": (
            "SELECT pg_sleep(0.6) WHERE cardinality($1::bigint[]) > 0"
        ),
        "SCHEDULER_PUBLISH__WEBHOOK__URL": f"http://127.0.0.1:{port}/in",
        "SCHEDULER_PUBLISH__WEBHOOK__SECRET": "hmac-secret",
        "SCHEDULER_PLUGIN__INTERVAL": "0.2s",
        "SCHEDULER_PLUGIN__TASKS": json.dumps(
            [{"name": f"busy{n}", "every": "1s", "sql": "SELECT pg_sleep(0.6)"} for n in range(2)]
        ),
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = load_settings(None)
    assert settings.database.pool_max_size == floor(settings) == 11  # the default, grown
    log = io.StringIO()
    configure_logging(LogSettings(format="json", level="info"), log)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)

    daemon = Daemon(settings, get_logger(instance="floor-1"))
    running = asyncio.create_task(daemon.run())
    try:
        await asyncio.wait_for(daemon.started.wait(), 30)
        assert daemon.http is not None
        base = f"http://127.0.0.1:{daemon.http.port}"
        conn = await asyncpg.connect(pg_url)
        try:
            async with aiohttp.ClientSession() as session:

                async def get(path: str) -> int:
                    async with session.get(base + path) as response:
                        await response.read()
                        return response.status

                deadline = time.monotonic() + 6
                while time.monotonic() < deadline:
                    await conn.execute(
                        "INSERT INTO scheduler_publications (payload, publish_at) "
                        "SELECT '{}'::jsonb, now() FROM generate_series(1, 3)"
                    )
                    statuses = await asyncio.gather(
                        *(get(path) for path in ("/readyz", "/metrics", "/status") * 5)
                    )
                    assert set(statuses) <= {200, 503}, statuses
                    await asyncio.sleep(0.1)
            counts = dict(
                await conn.fetch(
                    "SELECT 'published', count(*) FROM scheduler_publications "
                    "WHERE status = 'published' UNION ALL "
                    "SELECT 'runs', count(*) FROM scheduler_plugin_runs "
                    "WHERE status = 'succeeded'"
                )
            )
        finally:
            await conn.close()
    finally:
        daemon.request_stop("test over")
        assert await asyncio.wait_for(running, 30) == 0
        await runner.cleanup()

    events = [json.loads(line) for line in log.getvalue().splitlines()]
    lost = [e for e in events if e.get("event") in ("hold.lost", "leader.lost")]
    print(
        f"\ntransaction mode, pool of {settings.database.pool_max_size}: "
        f"{pool_watch['acquires']} acquires, at most {pool_watch['peak']} connections in "
        f"use at once, {len(pool_watch['full'])} found the pool full; {counts}"
    )
    assert counts["published"] > 0, "nothing was published: the workload did not run"
    assert counts["runs"] > 0, "no plugin run succeeded: the workload did not run"
    assert not pool_watch["full"], "an acquire waited for a connection"
    assert pool_watch["peak"] <= floor(settings)
    assert not lost, lost
