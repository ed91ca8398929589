"""SQLite: per loop, two OS locks, one on a sidecar file and one on the database file.

SQLite is "single host", not "single process": two daemons can open one file. OS locks
give them the same property a PostgreSQL session lock has: one holder at a time, and the
kernel frees the lock when the holder dies, however it dies. A leader holds both:

- an exclusive ``flock`` on the sidecar ``<real db file>.<loop>.lock``: found by *path*,
  so it still excludes a process that opens a new file put at the database's path;
- a write lock on one byte of the database file itself, per loop: found by *inode*, so it
  still excludes a process that reaches the file by another name (renamed, bind-mounted)
  or after the sidecar was removed.

Everyone takes them in that order, and a standby lets the sidecar go again when the byte
is taken. Standbys poll with non-blocking tries (a blocking lock in a thread could not be
cancelled on shutdown), reopening the sidecar whenever its path names another file.

The byte is an open-file-description lock (``F_OFD_SETLK``, Linux): it belongs to our
descriptor, so SQLite closing its own descriptors cannot drop it; one ``flock`` on the
database file could not serve two loops, since two descriptors of one file exclude each
other even within a process. The byte lies far past SQLite's own lock bytes (1 GiB to
1 GiB + 512), and SQLite, another process writing, and its ``busy_timeout`` behave just the
same while it is held (docs/leadership.md). Elsewhere than on Linux the sidecar is the
only lock.

A leader checks on each heartbeat that its configured path still names the file it has
open: one renamed, removed or replaced under it is :class:`ConfigError` (it steps down and
leads no more). A sidecar removed under it is made again and locked.

Not covered: a holder that is alive but frozen keeps its locks; on SQLite, systemd's
watchdog (``WatchdogSec``) is what restarts such a process.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import os
import socket
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from ..aio import wait_any
from ..config.settings import Settings
from ..db.lock_store import SqliteLockStore
from ..db.sqlite import SqliteStore, SqliteTx
from ..db.sqlite_file import descriptor_identity, path_identity, real_path
from ..errors import ConfigError, describe
from ..logs import Logger
from ..schema_gate import SchemaGate
from .base import GuardBase, Stopping
from .lease_state import LeaseState

POLL_INTERVAL = 0.05  # local file lock: cheap to try, and takeover should feel instant

# Open-file-description locks: Linux 3.15 and later. None elsewhere.
_OFD_SETLK: int | None = getattr(fcntl, "F_OFD_SETLK", None)
# Each loop's byte in the database file: 2**62 on, far from SQLite's lock bytes at 1 GiB
# and from any page it writes. A lock may lie past the end of a file.
DATABASE_LOCK_BYTES = {"publish": 1 << 62, "plugin": (1 << 62) + 1}


def lock_path(database: Path, loop: str) -> Path:
    """``<real db file>.<loop>.lock``, next to the real file: the lock belongs to the
    database file, not to the spelling of its path, so processes reaching it through a
    symlink (to the file or to a directory on the way) contend for one lock. Hard links
    cannot be resolved to one name; ``SqliteStore.open`` refuses them."""
    real = real_path(database)
    return real.with_name(f"{real.name}.{loop}.lock")


def lock_byte(fd: int, offset: int, *, take: bool) -> bool:
    """Take (or give back) the write lock on byte `offset` of the file open on `fd`, not
    waiting: False if another descriptor holds it. Always True where there are no
    open-file-description locks."""
    if _OFD_SETLK is None:
        return True
    kind = fcntl.F_WRLCK if take else fcntl.F_UNLCK
    # struct flock: l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks).
    request = struct.pack("hhqqi", kind, os.SEEK_SET, offset, 1, 0)
    try:
        fcntl.fcntl(fd, _OFD_SETLK, request)
    except (BlockingIOError, PermissionError):  # EAGAIN, or EACCES where POSIX allows it
        return False
    return True


# Why an open is refused for good (exit 78, naming the path); any other error may pass.
_REFUSED = {
    errno.EACCES, errno.EPERM, errno.EISDIR, errno.ENOTDIR, errno.ELOOP, errno.ENAMETOOLONG,
    errno.ENOENT, errno.EROFS,
}  # fmt: skip


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

    def proven_recently(self) -> bool:
        # Nobody evicts a flock holder: however long we were frozen, the lock stayed ours.
        return not self.lost.is_set()

    @asynccontextmanager
    async def transaction(self, *, only_ours: bool = False) -> AsyncIterator[SqliteTx]:
        async with self.store.write_transaction() as conn:
            # Under the file's write lock, as a migration runs: one that committed first
            # is seen, and none can start until this transaction ends (schema_gate.py).
            version = await SqliteLockStore(conn).schema_version()
            self.schema.check(version, self.log, "fence")
            yield SqliteTx(conn, self.fencing_token)


class FlockGuard(GuardBase[SqliteStore]):
    # The database file, opened once and never closed while the process runs: closing any
    # descriptor of a file drops every fcntl lock the process holds on it, SQLite's own
    # among them (POSIX), and without its shared lock another process's last close would
    # checkpoint and delete the WAL this one still uses.
    _database: int | None = None
    # The lock file's descriptor while it is ours: between two tries, or while leading.
    _lock_file: int | None = None

    @property
    def path(self) -> Path:
        return lock_path(self.store.path, self.loop)

    @property
    def _identity(self) -> tuple[str, int]:
        return (self.settings.instance_id, os.getpid())

    def open_files(self) -> None:
        """Open the lock file (and close it again) and the database file (kept) now: the
        daemon calls this at startup, so that a file this process cannot open is
        :class:`ConfigError` (exit 78) naming it, not a loop retrying for ever."""
        os.close(self.open_lock_file())
        self._database_file()

    def open_lock_file(self) -> int:
        """The lock file's descriptor, created if missing. One this process cannot open
        (permissions, a directory in its place) is :class:`ConfigError`, naming the path:
        no retry fixes it."""
        return self._open(self.path, "lock file", os.O_CREAT)

    def _database_file(self) -> int:
        if self._database is None:
            self._database = self._open(self.store.path, "database file", 0)
        return self._database

    def _open(self, path: Path, what: str, flags: int) -> int:
        try:
            # O_CLOEXEC: a child process (a plugin's subprocess) must not inherit the lock.
            return os.open(path, os.O_RDWR | os.O_CLOEXEC | flags, 0o644)
        except OSError as exc:
            if exc.errno not in _REFUSED:
                raise  # out of descriptors, disk full, I/O: retried like database trouble
            raise ConfigError(
                f"{what} {path} (for the {self.loop} loop): cannot open it for writing: "
                f"{exc.strerror}; it must be a file this user (uid {os.geteuid()}) may read "
                "and write"
            ) from None

    @asynccontextmanager
    async def leadership(self) -> AsyncIterator[FlockLease]:
        try:
            await self._acquire()
            async with self.store.write_transaction() as conn:
                locks = SqliteLockStore(conn)
                # Granted on a schema newer than we know: claim nothing, let the locks go.
                found = await locks.predecessor(self.loop, self.key)
                self.schema.check(found.schema_version, self.log, "lock granted")
                instance = self.settings.instance_id
                token = (await locks.draw_token(self.loop, instance)).token
                await locks.claim_leadership(
                    self.loop, self.key, instance=instance, hostname=socket.gethostname(),
                    pid=os.getpid(), token=token,
                )  # fmt: skip
            lease = FlockLease(self.store, token, self.settings, self.log, self.schema)
            self.metrics.leader.labels(self.loop).set(1)
            self.metrics.leadership_changes.labels(self.loop, "acquired").inc()
            self.log.info("leader.acquired", lock_file=str(self.path), fencing_token=token)
            heartbeat = asyncio.create_task(self._heartbeat(lease), name=f"heartbeat:{self.loop}")
            try:
                yield lease
            finally:
                # Work first, locks last: they are released only once nothing of this
                # leadership runs any more.
                await lease.stop_work()
                heartbeat.cancel()
                await asyncio.wait({heartbeat})
                self.metrics.leader.labels(self.loop).set(0)
                try:
                    instance, pid = self._identity
                    async with self.store.write_transaction() as conn:
                        await SqliteLockStore(conn).release_leadership(
                            self.loop, self.key, instance=instance, pid=pid
                        )
                except Exception as exc:
                    # The row is only what `status` shows; the locks go below all the same.
                    # Said, not swallowed: a write failing here is the database in trouble
                    # (or a transaction of ours left open), and the next leader meets it.
                    self.log.warning("leader.release_failed", error=describe(exc))
                self.metrics.leadership_changes.labels(self.loop, "released").inc()
                self.log.info("leader.released")
        finally:
            self._release()

    async def _acquire(self) -> None:
        """Both locks: the lock file's, then the database file's byte. A try that gets the
        first but not the second lets the first go, so that a leader that must lock a new
        lock file (the old one was removed) can."""
        self._refuse_if_moved()
        self.metrics.lock_waits.labels(self.loop).inc()
        self.log.info("leader.waiting", lock_file=str(self.path))
        while True:
            fd = self._current_lock_file()
            if _try_flock(fd):
                if lock_byte(self._database_file(), self._byte, take=True):
                    return
                fcntl.flock(fd, fcntl.LOCK_UN)
            if await wait_any([self.stop, self.schema.newer], POLL_INTERVAL):
                raise Stopping() if self.stop.is_set() else self.schema.error()
            self._refuse_if_moved()

    @property
    def _byte(self) -> int:
        return DATABASE_LOCK_BYTES[self.loop]

    def _current_lock_file(self) -> int:
        """The lock file now at :attr:`path`, opened (and created) again if the one we have
        open was removed or replaced."""
        fd = self._lock_file
        if fd is not None and self._still_at_path(fd):
            return fd
        opened = self.open_lock_file()
        self._close_lock_file()
        self._lock_file = opened
        return opened

    def _still_at_path(self, fd: int) -> bool:
        """Whether the lock file open on ``fd`` is the one :attr:`path` names now."""
        return path_identity(self.path) == descriptor_identity(fd)

    def _close_lock_file(self) -> None:
        if self._lock_file is not None:
            os.close(self._lock_file)  # releases its flock, if we held it
            self._lock_file = None

    def _release(self) -> None:
        # Never os.close() the database file: see _database.
        if self._database is not None:
            lock_byte(self._database, self._byte, take=False)
        self._close_lock_file()

    def _moved(self) -> str | None:
        """Why the configured path no longer names the database file this process opened
        (renamed, removed or replaced under it), or None."""
        configured = self.settings.database_url.sqlite_path
        assert configured is not None  # DatabaseUrl refuses in-memory databases
        opened = self.store.path
        now = real_path(configured)
        identity = path_identity(opened)
        if now != opened:
            why = f"it leads to {now} now, not to {opened}"
        elif identity is None:
            why = "nothing is there now"
        elif identity != descriptor_identity(self._database_file()):
            why = "another file is there now"
        else:
            return None
        return (
            f"database_url: {configured} is no longer the database file this process opened "
            f"({why}: it was renamed, removed or replaced while the daemon ran). SQLite finds "
            "a database's -wal and -shm files by its path, so this process leads no more "
            "beside processes that open the path now: start it again once database_url names "
            "the file to use"
        )

    def _refuse_if_moved(self) -> None:
        moved = self._moved()
        if moved is not None:
            raise ConfigError(moved)

    def _keep_lock_file(self) -> None:
        """A leader whose lock file was removed or replaced locks the one now at its path
        (the database file's byte excludes the others meanwhile). Until it can, processes
        opening the database's path anew are not kept out by the lock file: the next
        heartbeat tries again."""
        assert self._lock_file is not None
        if self._still_at_path(self._lock_file):
            return
        try:
            opened = self.open_lock_file()
        except (ConfigError, OSError) as exc:  # OSError: one that may pass (EMFILE, ENOSPC)
            self.log.warning("leader.lock_file_lost", lock_file=str(self.path), error=str(exc))
            return
        if not _try_flock(opened):
            os.close(opened)
            # A standby holds it for a moment, between its two tries.
            self.log.warning("leader.lock_file_lost", lock_file=str(self.path), error="busy")
            return
        self._close_lock_file()
        self._lock_file = opened
        self.log.info("leader.lock_file_restored", lock_file=str(self.path))

    async def _heartbeat(self, lease: FlockLease) -> None:
        """Checks that the files are still where they were, and keeps
        ``scheduler_leaders.heartbeat_at`` opened for ``status``; the locks themselves need
        no renewal."""
        while True:
            await asyncio.sleep(self.settings.lock.heartbeat_interval)
            moved = self._moved()
            if moved is not None:
                # Another process may lead on the file now at the path (the lock file gone
                # too, or a directory put in place of ours): stop at once.
                lease.lose(moved, lock_may_be_free=True)
                return
            self._keep_lock_file()
            try:
                instance, pid = self._identity
                async with self.store.write_transaction() as conn:
                    await SqliteLockStore(conn).heartbeat(
                        self.loop, self.key, instance=instance, pid=pid
                    )
            except Exception as exc:
                self.metrics.heartbeat_failures.labels(self.loop).inc()
                self.log.warning("leader.heartbeat_failed", error=describe(exc))


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True
