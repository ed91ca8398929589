"""SQLite: an exclusive OS file lock per loop, on a sidecar file next to the database.

SQLite is "single host", not "single process": two daemons can open one file. ``flock``
gives them the same property a PostgreSQL session lock has: one holder at a time, and
the kernel frees the lock when the holder dies, however it dies. Standbys poll with
``LOCK_NB`` (a blocking ``flock`` in a thread could not be cancelled on shutdown).

Not covered: a holder that is alive but frozen keeps its lock; on SQLite, systemd's
watchdog (``WatchdogSec``) is what restarts such a process.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from pathlib import Path

import aiosqlite

from ..aio import wait_any
from ..config import Settings
from ..db.sqlfiles import queries
from ..db.sqlite import SqliteStore, SqliteTx
from ..db.sqlite_file import real_path
from ..errors import ConfigError, describe
from ..logs import Logger
from ..schema_gate import SchemaGate
from .base import GuardBase, LeaseState, Stopping

Q = queries("sqlite")
POLL_INTERVAL = 0.05  # local file lock: cheap to try, and takeover should feel instant


def lock_path(database: Path, loop: str) -> Path:
    """``<real db file>.<loop>.lock``, next to the real file: the lock belongs to the
    database file, not to the spelling of its path, so processes reaching it through a
    symlink (to the file or to a directory on the way) contend for one lock. Hard links
    cannot be resolved to one name; ``SqliteStore.open`` refuses them."""
    real = real_path(database)
    return real.with_name(f"{real.name}.{loop}.lock")


class FlockLease(LeaseState):
    def __init__(
        self,
        store: SqliteStore,
        fencing_token: int,
        settings: Settings,
        log: Logger,
        schema: SchemaGate,
    ) -> None:
        super().__init__(fencing_token, settings, log)
        self.store = store
        self.schema = schema

    def fresh(self) -> bool:
        # Nobody evicts a flock holder: however long we were frozen, the lock stayed ours.
        return not self.lost.is_set()

    @asynccontextmanager
    async def transaction(self, *, only_ours: bool = False) -> AsyncIterator[SqliteTx]:
        async with self.store.write_transaction() as conn:
            # Under the file's write lock, as a migration runs: one that committed first
            # is seen, and none can start until this transaction ends (schema_gate.py).
            self.schema.check(await _schema_version(conn), self.log, "fence")
            yield SqliteTx(conn, self.fencing_token)


async def _schema_version(conn: aiosqlite.Connection) -> int | None:
    async with conn.execute(Q["schema_version"]) as cursor:
        row = await cursor.fetchone()
    version: int | None = None if row is None else row[0]
    return version


class FlockGuard(GuardBase[SqliteStore]):
    @property
    def path(self) -> Path:
        return lock_path(self.store.path, self.loop)

    @property
    def _identity(self) -> tuple[str, int]:
        return (self.settings.instance_id, os.getpid())

    def open_lock_file(self) -> int:
        """The lock file's descriptor, created if missing. One this process cannot open
        (permissions, a directory in its place) is :class:`ConfigError`, naming the path:
        no retry fixes it. The daemon opens it once at startup, so that exits 78."""
        try:
            # O_CLOEXEC: a child process (a plugin's subprocess) must not inherit the lock.
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise ConfigError(
                f"lock file {self.path} (for the {self.loop} loop): cannot open it for "
                f"writing: {exc.strerror}; it must be a file this user (uid {os.geteuid()}) "
                "may read and write, next to the database"
            ) from None

    @asynccontextmanager
    async def leadership(self) -> AsyncIterator[FlockLease]:
        fd = self.open_lock_file()
        try:
            await self._acquire(fd)
            async with self.store.write_transaction() as conn:
                # Granted on a schema newer than we know: claim nothing, let the flock go.
                self.schema.check(await _schema_version(conn), self.log, "lock granted")
                instance = self.settings.instance_id
                async with conn.execute(Q["fencing_next"], (self.loop, instance)) as cursor:
                    row = await cursor.fetchone()
                assert row is not None  # an upsert with RETURNING returns its row
                token = row[0]
                await conn.execute(
                    Q["leader_claim"],
                    (self.loop, self.key, instance, socket.gethostname(), os.getpid(), token),
                )
            lease = FlockLease(self.store, token, self.settings, self.log, self.schema)
            self.metrics.leader.labels(self.loop).set(1)
            self.metrics.leadership_changes.labels(self.loop, "acquired").inc()
            self.log.info("leader.acquired", lock_file=str(self.path), fencing_token=token)
            heartbeat = asyncio.create_task(self._heartbeat(), name=f"heartbeat:{self.loop}")
            try:
                yield lease
            finally:
                # Work first, lock last: the flock is released only once nothing of this
                # leadership runs any more.
                await lease.stop_work()
                heartbeat.cancel()
                await asyncio.wait({heartbeat})
                self.metrics.leader.labels(self.loop).set(0)
                with suppress(Exception):
                    async with self.store.write_transaction() as conn:
                        await conn.execute(
                            Q["leader_release"], (self.loop, self.key, *self._identity)
                        )
                self.metrics.leadership_changes.labels(self.loop, "released").inc()
                self.log.info("leader.released")
        finally:
            os.close(fd)  # closing the descriptor releases the flock

    async def _acquire(self, fd: int) -> None:
        self.metrics.lock_waits.labels(self.loop).inc()
        self.log.info("leader.waiting", lock_file=str(self.path))
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if await wait_any([self.stop, self.schema.newer], POLL_INTERVAL):
                    raise (Stopping() if self.stop.is_set() else self.schema.error()) from None

    async def _heartbeat(self) -> None:
        """Keeps ``scheduler_leaders.heartbeat_at`` fresh for ``status``; the flock itself
        needs no renewal."""
        while True:
            await asyncio.sleep(self.settings.lock.heartbeat_interval)
            try:
                async with self.store.write_transaction() as conn:
                    await conn.execute(
                        Q["leader_heartbeat"], (self.loop, self.key, *self._identity)
                    )
            except Exception as exc:
                self.metrics.heartbeat_failures.labels(self.loop).inc()
                self.log.warning("leader.heartbeat_failed", error=describe(exc))
