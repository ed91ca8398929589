"""The operations endpoints: ``/healthz``, ``/readyz``, ``/metrics``, ``/status``.

An aiohttp server on ``http.host:http.port`` (127.0.0.1:9464 by default), owned by the
daemon's exit stack. Each connection is served by its own coroutine, so a slow or stuck
client costs one socket and one coroutine, never a tick: the handlers do small amounts of
work and every database call they make is bounded by a timeout.

- ``/healthz``: 200 whenever the event loop answers. Answering at all is the check: a
  blocked loop answers nothing, and the orchestrator restarts the process.
- ``/readyz``: 200 when the database answers a trivial query within ``PROBE_TIMEOUT`` and
  the schema is at the newest migration this build knows; otherwise 503 with a JSON
  reason. The same probe keeps ``scheduler_database_up`` current, and ``/metrics`` runs it
  too, so the gauge is fresh at every scrape even where nothing polls ``/readyz``.
- ``/metrics``: the daemon's own registry (never the process-global default one), in the
  format the scraper asks for.
- ``/status``: ``collect_status()`` as JSON, the report ``scheduler-daemon status --json``
  prints.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

from aiohttp import web
from prometheus_client.exposition import choose_encoder

from .config import Settings
from .db.base import Store
from .db.sqlfiles import migrations
from .errors import ConfigError, describe
from .logs import Logger
from .metrics import Metrics
from .status import collect_status

# A database that needs longer than this for `SELECT version` is not serving us.
PROBE_TIMEOUT = 1.0
# The status report reads pg_locks and pg_stat_activity: cheap, but not free.
STATUS_TIMEOUT = 5.0
# Handlers finish in milliseconds; waiting longer on stop would only delay the exit.
SHUTDOWN_TIMEOUT = 2.0
# Idle keep-alive connections are closed after this; scrapers simply reconnect.
KEEPALIVE_TIMEOUT = 15.0


@dataclass(frozen=True, slots=True)
class Readiness:
    ready: bool
    reason: str | None
    schema_version: int | None
    expected_version: int

    def as_json(self) -> dict[str, Any]:
        return {
            "status": "ready" if self.ready else "not ready",
            "reason": self.reason,
            "schema_version": self.schema_version,
            "expected_schema_version": self.expected_version,
        }


class HttpServer:
    """Serve the operations endpoints until :meth:`stop` (or the ``async with`` ends)."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        metrics: Metrics,
        log: Logger,
        stopping: asyncio.Event | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.metrics = metrics
        self.log = log
        self.stopping = stopping
        self._runner: web.AppRunner | None = None
        self._probe_task: asyncio.Task[Readiness] | None = None

    @property
    def host(self) -> str:
        return self.settings.http.host

    @property
    def port(self) -> int:
        """The bound port: the configured one, or the one the OS picked for port 0.

        Where the host name resolves to several addresses, each socket may have its own
        ephemeral port; this is the first one's.
        """
        if self._runner is None or not self._runner.addresses:
            raise RuntimeError("the HTTP server is not running")
        return int(self._runner.addresses[0][1])

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/status", self._status)
        runner = web.AppRunner(
            app,
            handle_signals=False,  # the daemon owns SIGTERM/SIGINT
            access_log=None,  # probes every few seconds would drown the useful lines
            shutdown_timeout=SHUTDOWN_TIMEOUT,
            keepalive_timeout=KEEPALIVE_TIMEOUT,
        )
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.settings.http.port)
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            raise ConfigError(
                f"http: cannot listen on {self.host}:{self.settings.http.port}: {exc.strerror} "
                "(set SCHEDULER_HTTP__PORT, or SCHEDULER_HTTP__ENABLED=false)"
            ) from None
        self._runner = runner
        self.log.info("http.started", host=self.host, port=self.port)

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is None:
            return
        try:
            await runner.cleanup()
        finally:
            # After cleanup no handler awaits the shared probe any more.
            probe = self._probe_task
            if probe is not None and not probe.done():
                probe.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await probe
            self._probe_task = None
            self.log.info("http.stopped")

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    # -- the database probe -----------------------------------------------------------

    async def probe(self) -> Readiness:
        """Check the database, sharing one in-flight check between concurrent callers.

        Probes arrive from several sides at once (kubelet, the load balancer, Prometheus);
        sharing keeps them from taking every pooled connection while the database is slow.
        The shield keeps one caller's disconnect from cancelling the others' answer.
        """
        task = self._probe_task
        if task is None or task.done():
            task = asyncio.create_task(self._check_database(), name="http:probe")
            self._probe_task = task
        return await asyncio.shield(task)

    async def _check_database(self) -> Readiness:
        expected = migrations(self.store.backend)[-1].version
        try:
            async with asyncio.timeout(PROBE_TIMEOUT):
                version = await self.store.schema_version()
        except TimeoutError:
            self.metrics.database_up.set(0)
            return Readiness(
                False, f"database did not answer within {PROBE_TIMEOUT:g}s", None, expected
            )
        except Exception as exc:  # unreachable, restarting, auth revoked, ...
            self.metrics.database_up.set(0)
            return Readiness(False, f"database: {describe(exc)}", None, expected)
        self.metrics.database_up.set(1)
        if version != expected:
            reason = f"schema at version {version}, this build expects {expected}"
            return Readiness(False, reason, version, expected)
        return Readiness(True, None, version, expected)

    # -- handlers ----------------------------------------------------------------------

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def _readyz(self, request: web.Request) -> web.Response:
        readiness = await self.probe()
        if readiness.ready and self.stopping is not None and self.stopping.is_set():
            readiness = Readiness(
                False, "stopping", readiness.schema_version, readiness.expected_version
            )
        return web.json_response(readiness.as_json(), status=200 if readiness.ready else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        await self.probe()
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        return web.Response(
            body=encoder(self.metrics.registry), headers={"Content-Type": content_type}
        )

    async def _status(self, request: web.Request) -> web.Response:
        try:
            async with asyncio.timeout(STATUS_TIMEOUT):
                report = await collect_status(self.store, self.settings)
        except TimeoutError:
            return _error(503, f"database did not answer within {STATUS_TIMEOUT:g}s")
        except Exception as exc:
            return _error(503, f"database: {describe(exc)}")
        return web.json_response(report, dumps=json.dumps)


def _error(status: int, reason: str) -> web.Response:
    return web.json_response({"error": reason}, status=status)
