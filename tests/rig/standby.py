"""A PostgreSQL primary with a streaming standby, and primary failover, as often as asked.

:class:`ReplicatedCluster` owns two :class:`~rig.pgcluster.PgCluster` nodes, ``node1``
and ``node2``, whose roles swap at each failover. Clients use :meth:`ReplicatedCluster.dsn`,
a multi-host DSN naming both nodes with ``target_session_attrs=read-write``: whichever
node is primary is the one a connection lands on, the way an application reaches
Patroni- or RDS-managed PostgreSQL. Each node keeps its port for ever, so that DSN never
changes.

::

    with ReplicatedCluster(synchronous=True) as pg:
        url = pg.dsn("app")             # give this to the replicas
        times = pg.failover()           # primary stopped -m immediate, standby promoted,
        print(times.describe())         # the old primary rebuilt as the new standby

Replication modes (:meth:`ReplicatedCluster.set_synchronous` switches at run time):

- synchronous: the primary's ``synchronous_standby_names`` names the standby (its
  ``application_name``), and ``synchronous_commit=on``, so a commit is acknowledged only
  once the standby has the WAL: nothing a client saw committed is lost by a failover.
- asynchronous: commits do not wait; whatever the standby had not received when the
  primary died is lost. :attr:`Failover.lost` reads it back from the old primary's WAL
  (``pg_waldump`` from the new timeline's switch point): how many commits, and when.

After a promotion the new primary runs alone, and so asynchronously, until the rebuilt
standby streams (the way Patroni's non-strict synchronous mode degrades); then, in
synchronous mode, it waits for commits again. :meth:`ReplicatedCluster.failover` refuses
to run while there is no standby in sync, so a long run can fail over again and again
without ever failing over onto a standby that lacks acknowledged commits.

``replication_proxy=True`` streams through a :class:`~rig.tcpproxy.TcpProxy`, so that
:meth:`ReplicatedCluster.pause_replication` can hold the standby back (a stalled link) for
as long as a test wants a window of unreplicated commits.

All of it runs on 127.0.0.1 and never touches any other server (the session's throwaway
cluster included).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import asyncpg

from rig.databases import RIG_APP, run_sync
from rig.pgcluster import PgCluster, PgClusterError
from rig.tcpproxy import TcpProxy

# What a node needs to be a primary with a standby, or that standby (PostgreSQL 15's
# defaults for the first three, spelled out because they are the point). wal_keep_size:
# a standby held back (pause_replication) or rebuilt later still finds its WAL.
REPLICATION_SETTINGS: Mapping[str, str] = {
    "wal_level": "replica",
    "max_wal_senders": "10",
    "hot_standby": "on",
    "wal_keep_size": "256MB",
    # How long a standby whose stream broke waits before it looks again (5 s by default).
    # A promotion requested meanwhile waits for it too (measured: 5 s, not 0.1 s), and so
    # does a rebuilt standby's first connection.
    "wal_retrieve_retry_interval": "100ms",
}

NODE_NAMES = ("node1", "node2")
_REPLICATION_HBA = re.compile(r"^host\s+replication\s+all\s+127\.0\.0\.1/32\s+trust\s*$", re.M)
_POLL = 0.01

# pg_waldump's line for a commit record (TZ=UTC), e.g.
# "... lsn: 0/0301A0B8, prev 0/0301A080, desc: COMMIT 2024-12-01 18:40:01.123456 UTC"
_COMMIT_RECORD = re.compile(
    r"lsn: (?P<lsn>[0-9A-F]+/[0-9A-F]+), prev \S+ desc: COMMIT "
    r"(?P<at>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?) UTC"
)


@dataclass(frozen=True, slots=True)
class LostWal:
    """What the old primary had written that the new timeline does not contain.

    ``switch_lsn`` is where the new primary's timeline branched off the old one (the end
    of the WAL the standby had replayed); every record of the old primary at or after it
    is gone. ``commits`` are the commit times (epoch seconds) of the transactions among
    them: committed there (acknowledged, unless their client still waited for a
    synchronous standby), and lost.
    """

    timeline: int
    switch_lsn: str
    commits: tuple[float, ...]

    def window(self, crash: float) -> float:
        """Seconds between the first commit the standby never got and the crash (0: none;
        negative: the primary committed it while dying, after it was told to stop)."""
        return crash - min(self.commits) if self.commits else 0.0


@dataclass(frozen=True, slots=True)
class Failover:
    """One failover, step by step; times are ``time.time()`` (comparable with logs)."""

    old_primary: str
    new_primary: str
    synchronous: bool
    stop_started: float  # the primary is sent SIGQUIT (pg_ctl stop -m immediate)
    stopped: float  # its postmaster has exited
    promote_started: float  # after before_promote, if any
    promoted: float  # the control file says "in production": out of recovery
    writable: float  # a transaction that needs a primary committed on it
    lost: LostWal
    rebuilt: float | None = None  # a new standby streams (in sync); None: not rebuilt

    @property
    def downtime(self) -> float:
        """Primary stopped -> the new one takes writes."""
        return self.writable - self.stop_started

    def describe(self) -> str:
        steps = (
            f"stop {self.stopped - self.stop_started:.3f}s, "
            f"promote {self.promoted - self.promote_started:.3f}s, "
            f"writable {self.writable - self.promoted:.3f}s later"
        )
        rebuilt = (
            f", standby rebuilt {self.rebuilt - self.writable:.2f}s later" if self.rebuilt else ""
        )
        mode = "sync" if self.synchronous else "async"
        lost = f"{len(self.lost.commits)} commits lost"
        if self.lost.commits:
            first, last = (
                1000 * (t - self.stop_started)
                for t in (min(self.lost.commits), max(self.lost.commits))
            )
            lost += f" (committed {first:+.1f} to {last:+.1f} ms from the stop)"
        return (
            f"{mode} failover {self.old_primary} -> {self.new_primary}: writable "
            f"{self.downtime:.3f}s after the stop ({steps}){rebuilt}; {lost}"
        )


class ReplicatedCluster:
    """Two nodes, one primary and one streaming standby; see the module docstring.

    ``start()`` (or the ``with`` block) builds both; ``cleanup()`` removes everything.
    ``synchronous`` picks the replication mode to start in.
    """

    def __init__(
        self,
        *,
        synchronous: bool = True,
        bindir: Path | None = None,
        settings: Mapping[str, str] | None = None,
        replication_proxy: bool = False,
        timeout: float = 60.0,
    ) -> None:
        self.synchronous = synchronous
        self.timeout = timeout
        self.replication_proxy = replication_proxy
        self.nodes = {
            name: PgCluster(
                bindir,
                settings={**REPLICATION_SETTINGS, "cluster_name": name, **(settings or {})},
                timeout=timeout,
            )
            for name in NODE_NAMES
        }
        self._primary = NODE_NAMES[0]
        self._standby: str | None = None  # None: no standby (before start, after failover)
        self._proxy: TcpProxy | None = None
        self._paused = False
        self.failovers: list[Failover] = []

    # -- who is who ----------------------------------------------------------------

    @property
    def primary(self) -> PgCluster:
        return self.nodes[self._primary]

    @property
    def primary_name(self) -> str:
        return self._primary

    @property
    def standby(self) -> PgCluster | None:
        """The streaming standby, or None while there is none (right after a failover
        that did not rebuild one)."""
        return None if self._standby is None else self.nodes[self._standby]

    @property
    def standby_name(self) -> str | None:
        return self._standby

    def dsn(self, dbname: str = "postgres", *, password: str | None = None) -> str:
        """Both nodes, in a fixed order, ``target_session_attrs=read-write``: connections
        land on whichever is primary. ``password`` goes in the user info (the nodes trust
        every local login, so any value works: for checking it is never shown)."""
        user = "postgres" if password is None else f"postgres:{password}"
        hosts = ",".join(f"{node.host}:{node.port}" for node in self.nodes.values())
        return f"postgresql://{user}@{hosts}/{dbname}?target_session_attrs=read-write"

    def primary_dsn(self, dbname: str = "postgres") -> str:
        """The current primary alone (for admin work: CREATE DATABASE, inspection)."""
        return self.primary.dsn(dbname)

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> Self:
        """initdb and start the primary, clone the standby from it, wait until it streams
        (in sync, in synchronous mode)."""
        self.primary.start()
        self._allow_replication(self.primary)
        self._build_standby(next(n for n in NODE_NAMES if n != self._primary))
        return self

    def cleanup(self) -> None:
        """Stop both nodes and delete their directories; safe to call more than once."""
        self._close_proxy()
        for node in self.nodes.values():
            node.cleanup()

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.cleanup()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cleanup()

    # -- replication -----------------------------------------------------------------

    def set_synchronous(self, synchronous: bool) -> None:
        """Switch the replication mode on the running primary (ALTER SYSTEM + reload) and
        wait until the standby, if there is one, is in that mode."""
        self.synchronous = synchronous
        self._apply_mode()

    def wait_streaming(self, timeout: float | None = None) -> None:
        """Until the standby streams from the primary (and is its synchronous standby, in
        synchronous mode)."""
        if self._standby is None:
            raise PgClusterError("there is no standby")
        wanted = "sync" if self.synchronous else "async"
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            rows = self._query(
                self.primary,
                "SELECT state, sync_state FROM pg_stat_replication WHERE application_name = $1",
                self._standby,
            )
            if any(r["state"] == "streaming" and r["sync_state"] == wanted for r in rows):
                return
            if time.monotonic() > deadline:
                raise PgClusterError(
                    f"standby {self._standby} not streaming ({wanted}) after "
                    f"{timeout or self.timeout}s: {rows}\n{self.nodes[self._standby].log_tail()}"
                )
            time.sleep(_POLL)

    def pause_replication(self) -> None:
        """Hold the standby back: nothing more reaches it until :meth:`resume_replication`
        (or a failover, which drops what was held). Asynchronous mode: commits go on and
        are at risk. Synchronous mode: commits wait. Needs ``replication_proxy=True``."""
        if self._proxy is None:
            raise PgClusterError("pause_replication needs replication_proxy=True and a standby")
        self._proxy.freeze()
        self._paused = True

    def resume_replication(self) -> None:
        if self._proxy is not None:
            self._proxy.thaw()
        self._paused = False

    # -- failover ----------------------------------------------------------------------

    def failover(
        self,
        *,
        rebuild: bool = True,
        before_promote: Callable[[PgCluster], None] | None = None,
    ) -> Failover:
        """Stop the primary ``-m immediate``, promote the standby, wait until it takes
        writes; then (``rebuild``) rebuild the old primary as the new standby with a
        fresh ``pg_basebackup``. Returns the time of each step (also kept in
        :attr:`failovers`).

        ``before_promote(standby)`` runs between the stop and the promotion, once the
        standby has received and replayed all it ever will: its data is then exactly
        what the new timeline starts from (it is read-only; waiting for the end of the
        stream and the hook's own time count in the downtime).
        With ``rebuild=False`` the old primary's data stays as it was left until
        :meth:`rebuild_standby`: :meth:`old_primary_view` can read it meanwhile.
        """
        if self._standby is None:
            raise PgClusterError("no standby to fail over to: rebuild_standby() first")
        self.wait_streaming()  # never onto a standby that lacks acknowledged commits
        old, new = self._primary, self._standby
        stop_started = time.time()
        self.nodes[old].stop("immediate")
        stopped = time.time()
        if self._paused:
            # What the stalled link still holds never arrives: dropped with the link.
            self._close_proxy()
        if before_promote is not None:
            self._wait_stream_ended(self.nodes[new])
            before_promote(self.nodes[new])
        promote_started = time.time()
        self.nodes[new].promote(wait=False)
        promoted = self._wait_promoted(self.nodes[new])
        self._wait_writable(self.nodes[new])
        writable = time.time()
        # Only now: until the promotion its walreceiver reconnects every
        # wal_retrieve_retry_interval, and the proxy may be accepting one of those.
        self._close_proxy()
        self._primary, self._standby = new, None
        result = Failover(
            old_primary=old,
            new_primary=new,
            synchronous=self.synchronous,
            stop_started=stop_started,
            stopped=stopped,
            promote_started=promote_started,
            promoted=promoted,
            writable=writable,
            lost=self._lost_wal(old, new),
        )
        if rebuild:
            self.rebuild_standby()
            result = _with_rebuilt(result, time.time())
        self.failovers.append(result)
        return result

    def rebuild_standby(self) -> float:
        """Rebuild the node that is not primary as its standby (fresh pg_basebackup, same
        port); returns the seconds it took, until streaming (in sync)."""
        if self._standby is not None:
            raise PgClusterError("there is a standby already")
        started = time.monotonic()
        other = next(n for n in NODE_NAMES if n != self._primary)
        self.nodes[other].stop("fast")
        self._build_standby(other)
        if self.failovers and self.failovers[-1].rebuilt is None:
            self.failovers[-1] = _with_rebuilt(self.failovers[-1], time.time())
        return time.monotonic() - started

    @contextlib.contextmanager
    def old_primary_view(self) -> Iterator[PgCluster]:
        """Start the demoted primary on its Unix socket only (no TCP client can reach
        it, so no replica can land on it) to read what it had committed: use its
        ``socket_dsn()``. Stopped again on leaving; between a failover with
        ``rebuild=False`` and :meth:`rebuild_standby` only."""
        if self._standby is not None:
            raise PgClusterError("the old primary has been rebuilt already")
        old = self.nodes[next(n for n in NODE_NAMES if n != self._primary)]
        old.start(tcp=False)
        try:
            yield old
        finally:
            old.stop("fast")

    # -- internals -------------------------------------------------------------------

    def _build_standby(self, name: str) -> None:
        node, primary = self.nodes[name], self.primary
        conninfo = None
        if self.replication_proxy:
            self._proxy = TcpProxy(primary.host, primary.port).start()
            conninfo = f"host={primary.host} port={self._proxy.port} user=postgres"
        node.clone_from(
            primary.host, primary.port, application_name=name, primary_conninfo=conninfo
        )
        node.start()
        self._standby = name
        self._apply_mode()

    def _allow_replication(self, node: PgCluster) -> None:
        """Replication connections from 127.0.0.1, trusted (initdb's pg_hba.conf has the
        line; made sure of, not assumed). Standbys are cloned with the file."""
        hba = node.data_dir / "pg_hba.conf"
        if not _REPLICATION_HBA.search(hba.read_text()):
            with hba.open("a") as file:
                file.write(
                    "host    replication     all             127.0.0.1/32            trust\n"
                )
            self._query(node, "SELECT pg_reload_conf()")

    def _apply_mode(self) -> None:
        names = self._standby if self.synchronous and self._standby else ""
        self._query(self.primary, f"ALTER SYSTEM SET synchronous_standby_names = '{names}'")
        self._query(self.primary, "SELECT pg_reload_conf()")
        if self._standby is not None:
            self.wait_streaming()

    def _close_proxy(self) -> None:
        proxy, self._proxy = self._proxy, None
        self._paused = False
        if proxy is not None:
            proxy.close()

    def _wait_stream_ended(self, node: PgCluster) -> None:
        """Until the standby has everything it will ever get from the dead primary: its
        walreceiver stopped streaming (it read the end of the stream), and it replayed
        all it received. A partial last record never replays: after a second, go on (the
        promotion drops it)."""
        deadline = time.monotonic() + self.timeout
        while self._query(node, "SELECT 1 FROM pg_stat_wal_receiver WHERE status = 'streaming'"):
            if time.monotonic() > deadline:
                raise PgClusterError(f"the standby still streams {self.timeout}s after the crash")
            time.sleep(_POLL)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            row = self._query(
                node,
                "SELECT pg_last_wal_replay_lsn() >= pg_last_wal_receive_lsn() AS done",
            )[0]
            if row["done"]:
                return
            time.sleep(_POLL)

    def _wait_promoted(self, node: PgCluster) -> float:
        """When the control file first said "in production" (polled every 10 ms)."""
        deadline = time.monotonic() + self.timeout
        while True:
            if _control_field(node, "Database cluster state") == "in production":
                return time.time()
            if time.monotonic() > deadline:
                raise PgClusterError(f"not promoted after {self.timeout}s\n{node.log_tail()}")
            time.sleep(_POLL)

    def _wait_writable(self, node: PgCluster) -> None:
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                # txid_current() assigns a transaction id: refused during recovery.
                self._query(node, "SELECT txid_current()")
                return
            except (OSError, asyncpg.PostgresError) as exc:
                if time.monotonic() > deadline:
                    raise PgClusterError(
                        f"{node.dsn()} not writable {self.timeout}s after promotion: {exc}"
                    ) from exc
            time.sleep(_POLL)

    def _lost_wal(self, old: str, new: str) -> LostWal:
        """The old primary's commit records past the new timeline's switch point."""
        histories = sorted((self.nodes[new].data_dir / "pg_wal").glob("*.history"))
        if not histories:
            raise PgClusterError(f"{new} was promoted but has no timeline history file")
        # The last line: "<parent timeline>\t<switch point>\t<reason>".
        parent, switch_lsn = histories[-1].read_text().strip().splitlines()[-1].split()[:2]
        node = self.nodes[old]
        segment_bytes = int(_control_field(node, "Bytes per WAL segment"))
        last = _last_segment(node.data_dir / "pg_wal", int(parent), segment_bytes)
        if last is None or _lsn(switch_lsn) >= (last + 1) * segment_bytes:
            return LostWal(int(parent), switch_lsn, ())  # it wrote nothing past the switch
        # Up to the end of its last segment: past it pg_waldump would wait 5 s for the next
        # file. It exits 1 at the end of the WAL ("invalid record length"): what it printed
        # up to there counts.
        end = _lsn_text((last + 1) * segment_bytes)
        dump = node.run_tool(
            "pg_waldump", "-p", str(node.data_dir / "pg_wal"), "-t", parent, "-s", switch_lsn,
            "-e", end, "-r", "Transaction", check=False, env={"TZ": "UTC"},
        )  # fmt: skip
        commits = tuple(
            datetime.fromisoformat(match["at"] + "+00:00").timestamp()
            for match in _COMMIT_RECORD.finditer(dump.stdout)
        )
        return LostWal(int(parent), switch_lsn, commits)

    def _query(self, node: PgCluster, sql: str, *args: Any) -> list[dict[str, Any]]:
        return run_sync(_fetch(node.socket_dsn(), sql, *args))


def _control_field(node: PgCluster, name: str) -> str:
    control = node.run_tool("pg_controldata", "-D", str(node.data_dir)).stdout
    found = re.search(rf"^{re.escape(name)}:\s+(.*)$", control, re.M)
    if found is None:
        raise PgClusterError(f"pg_controldata shows no {name!r}:\n{control}")
    return found[1].strip()


def _last_segment(wal_dir: Path, timeline: int, segment_bytes: int) -> int | None:
    """The highest WAL segment number of `timeline` in `wal_dir` (None: none)."""
    per_log = 0x1_0000_0000 // segment_bytes
    numbers = [
        int(f.name[8:16], 16) * per_log + int(f.name[16:24], 16)
        for f in wal_dir.iterdir()
        if re.fullmatch(r"[0-9A-F]{24}", f.name) and int(f.name[:8], 16) == timeline
    ]
    return max(numbers, default=None)


def _lsn(text: str) -> int:
    high, low = text.split("/")
    return (int(high, 16) << 32) | int(low, 16)


def _lsn_text(lsn: int) -> str:
    return f"{lsn >> 32:X}/{lsn & 0xFFFF_FFFF:X}"


def _with_rebuilt(failover: Failover, rebuilt: float) -> Failover:
    return replace(failover, rebuilt=rebuilt)


async def _fetch(dsn: str, sql: str, *args: Any) -> list[dict[str, Any]]:
    conn = await asyncio.wait_for(asyncpg.connect(dsn, server_settings=RIG_APP), timeout=10)
    try:
        return [dict(row) for row in await conn.fetch(sql, *args)]
    finally:
        await conn.close()
