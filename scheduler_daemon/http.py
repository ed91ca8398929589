"""The operations endpoints: ``/healthz``, ``/readyz``, ``/metrics``, ``/status``.

An aiohttp server on ``http.host:http.port`` (127.0.0.1:9464 by default), owned by the
daemon's exit stack. Each connection is served by its own coroutine, so a slow or stuck
client costs one socket and one coroutine, never a tick: the handlers do small amounts of
work and every database call they make is bounded by a timeout.

The daemon starts the server before it connects to the database (a port clash is then
reported at once, and liveness probes are answered while the database is awaited) and
hands it the store with :meth:`HttpServer.attach` once the schema is migrated and the
loops run. Until then the server is *starting*: it reports the startup phase
(:meth:`HttpServer.starting`) instead of asking a database it does not have.

- ``/healthz``: 200 whenever the event loop answers. Answering at all is the check: a
  blocked loop answers nothing, and the orchestrator restarts the process.
- ``/readyz``: 200 when the database answers a trivial query within ``PROBE_TIMEOUT`` and
  the schema is at the newest migration this build knows; otherwise 503 with a JSON
  reason (``starting: connecting to the database`` while starting; ``outdated: …`` on a
  schema newer than this build, where it leads nothing). The same probe keeps
  ``scheduler_database_up`` current, and ``/metrics`` runs it too, so the gauge is fresh
  at every scrape even where nothing polls ``/readyz``.
- ``/metrics``: the daemon's own registry (never the process-global default one), in the
  format the scraper asks for. Its check also reads the scheduler's tables' sizes and
  dead rows and the database's oldest snapshot, at most every ``TABLES_REFRESH`` seconds:
  facts of the database that every replica reports, so that several replicas' scrapes
  do not load it. A read that fails leaves the gauges as they were.
- ``/`` and below: the browser dashboard (dashboard/), unless ``dashboard.enabled`` is
  false: its reads go one at a time (one pooled connection), its live streams end on stop.
- ``/status``: a summary of ``collect_status()`` that is safe to show the network (no
  database URL, host names, pids or client addresses; see :func:`status.summarize`), plus
  this replica's own instance id and roles. With ``http.status_detail`` the full report
  that ``scheduler-daemon status --json`` prints, plus the same.

Concurrent requests share one database check (``/readyz`` and ``/metrics``; a scrape's
table read runs in it, after the probe) and one status report (``/status``) in flight:
however many arrive, the endpoints hold at most two pooled connections (three with the
dashboard's one read at a time), which the pool's size counts on
(config.transaction_pool_users).
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

from .config.settings import Settings
from .dashboard import Dashboard
from .db.base import Store
from .db.sqlfiles import migrations
from .errors import ConfigError, describe
from .logs import Logger
from .metrics import Metrics
from .schema_gate import SchemaGate
from .status import collect_status, replica_status, summarize

# A database that needs longer than this for `SELECT version` is not serving us.
PROBE_TIMEOUT = 1.0
# The status report reads pg_locks and pg_stat_activity: cheap, but not free.
STATUS_TIMEOUT = 5.0
# Table sizes and the oldest snapshot are the same for every replica: a scrape reads them
# again only when the last read is this old, so scrapes of many replicas cost the
# database a read per replica every 30 s at most.
TABLES_REFRESH = 30.0
# The table read is statistics and file sizes: quick, unless the server struggles, which
# a scrape does not wait out.
TABLES_TIMEOUT = 2.0
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


@dataclass(frozen=True, slots=True)
class _Check:
    """The database check in flight: the probe, whose answer ``readiness`` has as soon as
    it is known, then, if ``tables``, the tables' read (``/metrics``), on the same one
    pooled connection at a time."""

    readiness: asyncio.Future[Readiness]
    task: asyncio.Task[None]
    tables: bool


class HttpServer:
    """Serve the operations endpoints until :meth:`stop` (or the ``async with`` ends).

    ``store`` may be None: the server is then *starting* until :meth:`attach` gives it
    one, and answers readiness and status from the phase :meth:`starting` last named.
    """

    def __init__(
        self,
        settings: Settings,
        store: Store | None,
        metrics: Metrics,
        log: Logger,
        stopping: asyncio.Event | None = None,
        schema: SchemaGate | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.log = log
        self.stopping = stopping
        self.schema = schema  # the daemon's: whether this replica found itself outdated
        self._store = store
        self._phase = "starting"
        self._runner: web.AppRunner | None = None
        self._check: _Check | None = None
        self._tables_read_at: float | None = None  # the event loop's clock
        self._status_task: asyncio.Task[dict[str, Any] | str] | None = None
        # Set on stop: the dashboard's live streams end at once instead of holding it up.
        self._closing = asyncio.Event()

    @property
    def store(self) -> Store:
        if self._store is None:
            raise RuntimeError("the HTTP server has no store yet (still starting)")
        return self._store

    def starting(self, phase: str) -> None:
        """Name what startup is doing (``connecting to the database``, ``migrating``)."""
        self._phase = phase

    def attach(self, store: Store) -> None:
        """Startup is done: answer ``/readyz`` and ``/status`` from ``store`` now."""
        self._store = store

    def detach(self) -> None:
        """The store is about to close: stop asking it (``/readyz`` answers ``stopping``)."""
        self._store = None
        self._phase = "stopping"

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
        if self.settings.dashboard.enabled:
            # Built here, not at import: reading dashboard.password_file may refuse (78).
            Dashboard(self.settings, lambda: self._store, self.log, self._closing).routes(app)
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
        self._closing.set()
        try:
            await runner.cleanup()
        finally:
            # After cleanup no handler awaits the shared probe or report any more.
            check = self._check.task if self._check is not None else None
            for task in (check, self._status_task):
                if task is not None and not task.done():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            self._check = None
            self._status_task = None
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
        store = self._store
        if store is None:
            return self._not_started()
        return await asyncio.shield(self._check_in_flight(store, tables=False).readiness)

    async def refresh_tables(self) -> None:
        """Probe the database and, if the gauges of its tables are ``TABLES_REFRESH`` old,
        read them again: what a scrape does before it answers. Shares the check in flight;
        never raises for the database (the gauges keep their values)."""
        store = self._store
        if store is None:
            return
        check = self._check_in_flight(store, tables=self._tables_due())
        await asyncio.shield(check.task)
        if not check.tables and self._tables_due():
            # It was a probe without the tables (a /readyz's): one more, after it.
            await asyncio.shield(self._check_in_flight(store, tables=True).task)

    def _tables_due(self) -> bool:
        read_at = self._tables_read_at
        return read_at is None or asyncio.get_running_loop().time() - read_at >= TABLES_REFRESH

    def _check_in_flight(self, store: Store, tables: bool) -> _Check:
        check = self._check
        if check is None or check.task.done():
            readiness = asyncio.get_running_loop().create_future()
            task = asyncio.create_task(
                self._check_database(store, readiness, tables), name="http:probe"
            )
            check = self._check = _Check(readiness, task, tables)
        return check

    def _not_started(self) -> Readiness:
        """Readiness before :meth:`attach` (or after :meth:`detach`): never ready."""
        expected = migrations(self.settings.database_url.backend)[-1].version
        return Readiness(False, self._phase_reason(), None, expected)

    def _phase_reason(self) -> str:
        if self._phase == "stopping" or (self.stopping is not None and self.stopping.is_set()):
            return "stopping"
        return f"starting: {self._phase}"

    async def _check_database(
        self, store: Store, readiness: asyncio.Future[Readiness], tables: bool
    ) -> None:
        try:
            answer = await self._probe_database(store)
            readiness.set_result(answer)
            if tables and answer.schema_version is not None:  # answered, and migrated
                await self._read_tables(store)
        except Exception as exc:
            if not readiness.done():
                readiness.set_exception(exc)  # a bug in the probe: its waiters see it too
            raise
        finally:
            if not readiness.done():  # cancelled (stop): its waiters are too
                readiness.cancel()

    async def _read_tables(self, store: Store) -> None:
        # Counted from the attempt: a failing database is not asked at every scrape.
        self._tables_read_at = asyncio.get_running_loop().time()
        try:
            async with asyncio.timeout(TABLES_TIMEOUT):
                health = await store.table_health()
        except Exception as exc:  # timed out, unreachable, ...: the old values stay
            self._database_failed(exc)
            return
        sizes = {t.table: (t.total_bytes, t.dead_ratio) for t in health.tables or ()}
        self.metrics.record_tables(sizes, health.snapshot_seconds)

    async def _probe_database(self, store: Store) -> Readiness:
        expected = migrations(store.backend)[-1].version
        try:
            async with asyncio.timeout(PROBE_TIMEOUT):
                version = await store.schema_version()
        except TimeoutError:
            self.metrics.database_up.set(0)
            return Readiness(
                False, f"database did not answer within {PROBE_TIMEOUT:g}s", None, expected
            )
        except Exception as exc:  # unreachable, restarting, auth revoked, ...
            self.metrics.database_up.set(0)
            return Readiness(False, self._database_failed(exc), None, expected)
        self.metrics.database_up.set(1)
        if version is not None and version > expected:
            # Never ready: a readiness gate waits for the new build's replicas, not these.
            reason = (
                f"outdated: schema at version {version}, newer than this build's newest "
                f"migration {expected}; this replica leads nothing until it is replaced"
            )
            return Readiness(False, reason, version, expected)
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
        await self.refresh_tables()
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        return web.Response(
            body=encoder(self.metrics.registry), headers={"Content-Type": content_type}
        )

    async def _status(self, request: web.Request) -> web.Response:
        store = self._store
        if store is None:
            return _error(503, self._phase_reason())
        # One report in flight, shared by the requests that arrive meanwhile, as the probe
        # is: a burst of requests takes one pooled connection, not one each.
        task = self._status_task
        if task is None or task.done():
            task = asyncio.create_task(self._collect_status(store), name="http:status")
            self._status_task = task
        report = await asyncio.shield(task)
        if isinstance(report, str):
            return _error(503, report)
        report = dict(report)  # shared with the other requests: add to a copy
        if not self.settings.http.status_detail:
            # Anyone who can reach the port reads this: no database URL, host names, pids
            # or client addresses unless the operator opted in (docs/operations.md).
            report = summarize(report)
        report["replica"] = replica_status(self.settings, self.metrics, self.schema)
        return web.json_response(report, dumps=json.dumps)

    async def _collect_status(self, store: Store) -> dict[str, Any] | str:
        """The status report, or why there is none."""
        try:
            async with asyncio.timeout(STATUS_TIMEOUT):
                return await collect_status(store, self.settings)
        except TimeoutError:
            return f"database did not answer within {STATUS_TIMEOUT:g}s"
        except Exception as exc:
            return self._database_failed(exc)

    def _database_failed(self, exc: Exception) -> str:
        """The reason a probe gives. A driver's message names users, hosts and addresses,
        which the network sees only with http.status_detail; the debug log has it (the
        loops report the outage itself)."""
        detail = describe(exc)
        self.log.debug("http.database_failed", error=detail)
        if self.settings.http.status_detail:
            return f"database: {detail}"
        return f"database: {type(exc).__name__} (details in this replica's log)"


def _error(status: int, reason: str) -> web.Response:
    return web.json_response({"error": reason}, status=status)
