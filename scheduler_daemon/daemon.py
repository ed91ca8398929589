"""The daemon process: connect, migrate, run the loops, stop cleanly.

Lifecycle (one AsyncExitStack owns every resource; each step registers its own cleanup):

1. serve HTTP (a port clash exits 78 at once; ``/healthz`` answers while the rest starts,
   ``/readyz`` says what startup is waiting for);
2. connect to the database, retrying within ``database.startup_budget`` (exit 69 after;
   exit 78 at once if it refuses the login);
3. migrate (serialised across replicas); on a schema newer than this build knows, the
   loops start idle and never contend (schema_gate.py); check the grants. A stop requested
   while connecting, migrating or checking ends startup at once (exit 0);
4. start one owned task per enabled loop and wait until each has really started; then
   ``/readyz`` and ``/status`` answer from the database;
5. run until a stop is requested, or until a loop task ends by itself — a bug, so the
   daemon exits non-zero and lets its supervisor restart it rather than limp on;
6. stop: ask the loops to finish their tick, wait up to ``shutdown_timeout``, then cancel
   what is left and wait for the cancellation to land; close the database.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Coroutine, Mapping
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from . import db
from .aio import unless_set
from .config.settings import Settings
from .db.connect import connect, within_startup_budget
from .db.listen import Listener, listener_for
from .db.pooler import refuse_unsafe_locking
from .db.privileges import required_grants
from .errors import EXIT_OK, EXIT_SOFTWARE, SchedulerError, describe
from .leadership import Guard, make_guard
from .logs import Logger
from .loops.base import LoopRunner, LoopWork
from .loops.plugin import PluginWork
from .loops.publish import PublishWork
from .metrics import Metrics
from .plugins.builtin import builtin_tasks
from .plugins.tasks import Target, TaskSpec, load_tasks, runnable_targets
from .plugins.workers import Workers
from .publishers import Publisher, build_publishers
from .schema_gate import SchemaGate
from .sdnotify import Notifier

if TYPE_CHECKING:
    from .http import HttpServer

LoopName = Literal["publish", "plugin"]
EXIT_FORCED = 130  # a second signal cut the graceful stop short

T = TypeVar("T")


class Daemon:
    def __init__(self, settings: Settings, log: Logger, only: LoopName | None = None) -> None:
        self.settings = settings
        self.log = log
        self.only = only
        self.stopping = asyncio.Event()
        self.started = asyncio.Event()
        self.forced = False
        self.metrics = Metrics()
        self.schema = SchemaGate(settings.database_url.backend)
        self._tasks: list[TaskSpec] = []
        self._runnable: dict[str, Target] = {}  # what runtime schedules may name
        self._publishers: list[Publisher] = []
        self._workers: Workers | None = None
        self.notifier = Notifier.from_environ(log)
        self.http: HttpServer | None = None  # set once serving; tests read its port
        self._main: asyncio.Task[Any] | None = None

    def request_stop(self, reason: str) -> None:
        if not self.stopping.is_set():
            self.log.info("daemon.stopping", reason=reason)
            self.stopping.set()

    def force_stop(self, reason: str) -> None:
        self.log.warning("daemon.forced_stop", reason=reason)
        self.forced = True
        self.stopping.set()
        if self._main is not None:
            self._main.cancel()

    def enabled_loops(self) -> list[LoopName]:
        wanted: list[LoopName] = []
        if self.settings.publish.enabled and self.only in (None, "publish"):
            wanted.append("publish")
        if self.settings.plugin.enabled and self.only in (None, "plugin"):
            wanted.append("plugin")
        return wanted

    def _build(
        self, name: LoopName, store: db.Store, listener: Listener | None
    ) -> tuple[LoopWork, float]:
        if name == "publish":
            publish = PublishWork(
                store, self.settings, self._publishers, self.metrics, self.log, listener
            )
            return publish, self.settings.publish.interval
        # A leader that holds its lock between ticks (file lock, session lock) knows no
        # one else ran anything meanwhile; transaction mode wins it afresh each tick.
        sticky = not store.capabilities.advisory_locks or self.settings.lock.mode == "session"
        work = PluginWork(
            self._tasks,
            self._runnable,
            self.settings,
            self.metrics,
            self._workers,
            sticky,
            listener,
        )
        return work, self.settings.plugin.interval

    def _listener(self, store: db.Store, stack: AsyncExitStack) -> Listener | None:
        """The replica's LISTEN connection, shared by the loops it leads (held open from
        the start, a standby's too): PostgreSQL in session mode only (see db/listen.py)."""
        if self.settings.lock.mode != "session":
            return None
        listener = listener_for(store, self.log)
        if listener is not None:
            stack.callback(listener.close)
        return listener

    async def _start_workers(self, stack: AsyncExitStack) -> None:
        """Sync targets run in worker processes: start their forkserver now, with the
        targets' modules imported, so that the first run does not pay for it."""
        if "plugin" not in self.enabled_loops():
            return
        targets = [spec.target for spec in self._tasks if spec.target is not None]
        targets += self._runnable.values()
        modules = sorted({t.__module__ for t in targets if not inspect.iscoroutinefunction(t)})
        if not modules:
            return
        workers = Workers(preload=modules)
        await workers.start()
        stack.push_async_callback(workers.close)
        self._workers = workers

    async def run(self) -> int:
        """Run until stopped; return the process exit code."""
        self._main = asyncio.current_task()
        try:
            return await self._run()
        except asyncio.CancelledError:
            if not self.forced:
                raise
            return EXIT_FORCED

    async def preflight(self) -> int | None:
        """Everything `run` checks before its loops start, and nothing more: the task
        declarations and publishers, the database login, the lock mode, the migrations
        and the lock files. Raises what `run` would exit with; returns the schema version.

        For a supervisor that cannot be told "do not restart on 78" (Docker Compose):
        run this once, and start the replicas only if it passed.
        """
        self._validate_config()
        store = await connect(self.settings, self.log)
        try:
            await self._prepare(store)
            for name in self.enabled_loops():
                self._guard(name, store)  # a SQLite lock file we cannot open is 78
            return await store.schema_version()
        finally:
            await store.close()

    def _validate_config(self) -> None:
        # Task declarations are config: validate them (exit 78) before touching the database.
        self._tasks = load_tasks(self.settings, builtin_tasks(self.settings))
        self._runnable = runnable_targets(self.settings, self._tasks)
        self._publishers = build_publishers(self.settings, self.settings.database_url.backend)

    async def _prepare(self, store: db.Store) -> None:
        """The schema up to date on a connection that can hold our locks. The database may
        still be settling (a container's init restarts it once, a failover, a restart):
        every step of it is retried within ``database.startup_budget``, the whole run
        again (each step can be: migrate applies only what is pending)."""
        await within_startup_budget(
            lambda: self._prepare_once(store), self.settings, self.log,
            failed_event="db.migrate_failed",
        )  # fmt: skip

    async def _prepare_once(self, store: db.Store) -> None:
        # Before anything else talks to it: behind a transaction pooler even the
        # migration could fail in confusing ways.
        await refuse_unsafe_locking(store)
        self._starting("migrating")
        applied = await store.migrate()
        version = await store.schema_version()
        self.log.info(
            "db.migrated",
            backend=store.backend,
            applied=[m.version for m in applied],
            version=version,
        )
        self.schema.note(version, self.log, "startup")
        await self._refuse_missing_grants(store)

    async def _run(self) -> int:
        self._validate_config()
        async with AsyncExitStack() as stack:
            # First in, last out: the watchdog pings from startup (connecting may take
            # longer than WatchdogSec) until the very end of the shutdown.
            await stack.enter_async_context(self.notifier)
            # Before the database: a port clash is a config error to report now, not after
            # the startup budget, and liveness probes need answers while we wait.
            await self._serve_http(stack)
            self._starting("connecting to the database")
            store = await self._until_stopped(connect(self.settings, self.log))
            if store is None:
                return EXIT_OK
            stack.push_async_callback(store.close)
            if self.http is not None:
                # Unwound just before store.close: no probe asks a closing store.
                stack.callback(self.http.detach)
            # Migrating may wait on another replica's migration, and any step on a slow
            # database: a stop requested meanwhile ends startup now (exit 0), not after
            # database.startup_budget.
            prepared = await unless_set(self._prepare(store), self.stopping)
            if prepared.cancelled():
                return EXIT_OK
            prepared.result()
            self.metrics.database_up.set(1)
            self._starting("starting the loops")
            await self._start_workers(stack)

            listener = self._listener(store, stack)
            # A standby's too: taking over then costs a LISTEN, not a connection's setup.
            if (
                listener is not None
                and (await unless_set(listener.open(), self.stopping)).cancelled()
            ):
                return EXIT_OK
            runners = self._runners(store, listener)
            tasks: dict[str, asyncio.Task[None]] = {
                name: asyncio.create_task(runner.run(), name=f"loop:{name}")
                for name, runner in runners.items()
            }
            stack.push_async_callback(self._stop_tasks, tasks)
            # Unwound before _stop_tasks: systemd hears STOPPING=1 as the stop begins.
            stack.callback(self.notifier.stopping)
            await asyncio.gather(*(runner.started.wait() for runner in runners.values()))
            if self.http is not None:
                self.http.attach(store)
            self.started.set()
            # Logged before READY=1, so by the time `systemctl start` returns it is written.
            self.log.info(
                "daemon.started", loops=list(runners), database=str(self.settings.database_url)
            )
            self.notifier.ready(self._status_line(list(runners)))
            self.notifier.watch_status(lambda: self._status_line(list(runners)), every=1.0)
            return await self._monitor(tasks)

    def _runners(self, store: db.Store, listener: Listener | None) -> dict[LoopName, LoopRunner]:
        runners = {}
        for name in self.enabled_loops():
            self.metrics.prime_loop(name)
            if name == "plugin":
                self.metrics.shards.labels(name).set(self.settings.plugin.shards)
            work, interval = self._build(name, store, listener)
            guard = self._guard(name, store, listener)
            runners[name] = LoopRunner(
                work, guard, interval, self.stopping, self.log, self.metrics, self.schema
            )
        return runners

    async def _serve_http(self, stack: AsyncExitStack) -> None:
        """Listen now; the store comes with :meth:`HttpServer.attach` once we are up."""
        if not self.settings.http.enabled:
            return
        # Imported only when serving: aiohttp and the dashboard are a third of what a
        # replica imports, and one with http.enabled = false never needs them.
        from .http import HttpServer

        http = HttpServer(
            self.settings, None, self.metrics, self.log, self.stopping, schema=self.schema
        )
        await http.start()
        self.http = http
        stack.push_async_callback(http.stop)

    def _starting(self, phase: str) -> None:
        """What startup is doing, for systemd's STATUS= line and for ``/readyz``."""
        self.notifier.status(phase)
        if self.http is not None:
            self.http.starting(phase)

    def _status_line(self, loops: list[LoopName]) -> str:
        """systemd's STATUS= line: which loops this replica leads, read off the gauge."""
        if self.stopping.is_set():
            return "stopping"
        if not loops:
            return "running, no loops enabled"
        if self.schema.outdated:
            return self.schema.describe()
        leading = [
            name
            for name in loops
            if self.metrics.registry.get_sample_value("scheduler_leader", {"loop": name}) == 1
        ]
        if not leading:
            return "standby"
        waiting = [name for name in loops if name not in leading]
        line = f"leading {', '.join(leading)}"
        return f"{line}; standby for {', '.join(waiting)}" if waiting else line

    def _guard(self, name: LoopName, store: db.Store, listener: Listener | None = None) -> Guard:
        return make_guard(
            name,
            self._lock_key(name),
            store,
            self.settings,
            self.log,
            self.metrics,
            self.stopping,
            self.schema,
            listener,
        )

    def _lock_key(self, name: LoopName) -> int:
        return (
            self.settings.lock.keys.publish if name == "publish" else self.settings.lock.keys.plugin
        )

    async def _refuse_missing_grants(self, store: db.Store) -> None:
        """Exit 78 now, naming every missing grant, rather than lead never (db/privileges.py)."""
        need = required_grants(
            self.enabled_loops(),
            session=self.settings.lock.mode == "session",
            webhook="webhook" in self.settings.publish.publishers,
            purge=any(task.name == "purge_publications" for task in self._tasks),
            purge_runs=any(task.name == "purge_runs" for task in self._tasks),
        )
        await store.refuse_missing_grants(need)

    async def _until_stopped(self, startup: Coroutine[Any, Any, T]) -> T | None:
        """Await a startup step unless a stop is requested first (then return None)."""
        step = await unless_set(startup, self.stopping)
        return None if step.cancelled() else step.result()

    async def _monitor(self, tasks: Mapping[str, asyncio.Task[None]]) -> int:
        if not tasks:
            self.log.warning("daemon.no_loops", hint="both loops are disabled")
            await self.stopping.wait()
            return EXIT_OK
        stop = asyncio.ensure_future(self.stopping.wait())
        try:
            await asyncio.wait([stop, *tasks.values()], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stop
        if self.stopping.is_set():
            return EXIT_OK
        code = EXIT_SOFTWARE
        for name, task in tasks.items():
            if task.done():
                error = task.exception() if not task.cancelled() else None
                why = describe(error) if error else "ended without an exception"
                self.log.error("loop.died", loop=name, error=why)
                if isinstance(error, SchedulerError):  # explained: its own exit code
                    code = error.exit_code
        self.stopping.set()
        return code

    async def _stop_tasks(self, tasks: Mapping[str, asyncio.Task[None]]) -> None:
        self.stopping.set()
        pending = [task for task in tasks.values() if not task.done()]
        try:
            if pending and not self.forced:
                await asyncio.wait(pending, timeout=self.settings.shutdown_timeout)
        finally:
            # Also reached when a second signal cancels the graceful wait above.
            for task in pending:
                if not task.done():
                    reason = "forced" if self.forced else "shutdown_timeout"
                    self.log.warning("loop.cancelled", loop=task.get_name()[5:], reason=reason)
                    task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            self.log.info("daemon.stopped")
