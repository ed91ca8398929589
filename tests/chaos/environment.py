"""What a chaos run stands on: the network (a namespace per replica, or plain loopback where
this machine cannot make namespaces) and the database (one throwaway PostgreSQL, or a
primary with a streaming standby when primary failover is among the faults).

Both adapt a rig module to the few verbs the harness needs, so that the harness reads as
the experiment and not as plumbing: ``rig.netns`` for links, ``rig.pgcluster`` and
``rig.standby`` for servers.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, Self

from rig import netns
from rig.databases import migrate
from rig.pgcluster import PgCluster
from rig.sql import execute, fetch
from rig.standby import ReplicatedCluster

DBNAME = "chaos"
LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")


def faketime_env(skew_seconds: float) -> dict[str, str]:
    """A process whose wall clock runs `skew_seconds` off, its monotonic clock untouched
    (asyncio's timers and the daemon's deadlines use it: only due-ness could be fooled)."""
    if not LIBFAKETIME.exists():
        raise FileNotFoundError(f"{LIBFAKETIME} (Debian: apt-get install libfaketime)")
    return {
        "LD_PRELOAD": str(LIBFAKETIME),
        "FAKETIME": f"{skew_seconds:+.0f}",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        "FAKETIME_NO_CACHE": "1",
    }


def standing_delay(rtt_ms: float) -> netns.Impairment:
    """The impairment that adds `rtt_ms` to a link's round trip: half of it each way (the
    rig delays each direction once, so the round trip grows by twice the delay)."""
    if rtt_ms < 0:
        raise ValueError(f"a round trip cannot shrink: {rtt_ms=}")
    return netns.Impairment(delay_ms=rtt_ms / 2)


def on_top(standing: netns.Impairment, fault: netns.Impairment) -> netns.Impairment:
    """A bad link's impairment over the standing one: a link that goes bad keeps the
    distance it had, so the delays add (and so do the jitters' ranges), and a packet
    survives only if it survives both losses."""
    survives = (1 - standing.loss_pct / 100) * (1 - fault.loss_pct / 100)
    return netns.Impairment(
        delay_ms=standing.delay_ms + fault.delay_ms,
        jitter_ms=standing.jitter_ms + fault.jitter_ms,
        loss_pct=round(100 * (1 - survives), 6),
    )


class ChaosNetwork:
    """A network namespace per replica (0-based index) when possible; else loopback, where
    partitions and bad links cannot be made (``enabled`` is False and the run says so).

    With a *standing* delay (``rtt_ms`` > 0: replicas a distance from their database, as
    across zones), every link carries it from the moment the namespaces are made, spares
    too (a scale_up's replica joins over a link as long as the others'), and every fault of
    a link returns to it, not to a clean link: :meth:`impair` puts the bad link *on top of*
    it (:func:`on_top`), :meth:`clear` goes back to it, and :meth:`heal` ends a cut with the
    link's impairment as it was (the rig keeps it, and its delay process, under a cut).
    Without namespaces there is no standing delay either (``rtt_ms`` is then 0).
    """

    def __init__(
        self, namespaces: netns.Namespaces | None, why_not: str | None, rtt_ms: float = 0.0
    ) -> None:
        self._namespaces = namespaces
        self.why_not = why_not
        self.rtt_ms = rtt_ms if namespaces is not None else 0.0
        self.standing = standing_delay(self.rtt_ms)

    @classmethod
    def create(cls, directory: Path, replicas: int, rtt_ms: float = 0.0) -> ChaosNetwork:
        why_not = netns.unavailable()
        return cls(None if why_not else netns.Namespaces(replicas), why_not, rtt_ms)

    @property
    def enabled(self) -> bool:
        return self._namespaces is not None

    def __enter__(self) -> Self:
        if self._namespaces is not None:
            self._namespaces.__enter__()
            try:
                for index in range(len(self._namespaces.hosts)):
                    self.clear(index)  # the standing delay, on every link
            except BaseException:
                self._namespaces.close()
                raise
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._namespaces is not None:
            self._namespaces.close()

    def argv(self, index: int, command: Sequence[str]) -> list[str]:
        if self._namespaces is None:
            return list(command)
        return self._namespaces.argv(index, command)

    def host_ip(self, index: int) -> str:
        """The address replica `index` reaches the host's servers at."""
        if self._namespaces is None:
            return "127.0.0.1"
        return self._namespaces.hosts[index].host_ip

    def partition(self, index: int) -> None:
        if self._namespaces is not None:
            self._namespaces.partition(index)

    def heal(self, index: int) -> None:
        if self._namespaces is not None and self._namespaces.hosts[index].partitioned:
            self._namespaces.heal(index)

    def impair(self, index: int, *, delay_ms: float, jitter_ms: float, loss_pct: float) -> None:
        """A bad link, on top of the standing delay."""
        if self._namespaces is not None:
            link = on_top(self.standing, netns.Impairment(delay_ms, jitter_ms, loss_pct))
            self._namespaces.impair(index, delay_ms=link.delay_ms, jitter_ms=link.jitter_ms,
                                    loss_pct=link.loss_pct)  # fmt: skip

    def clear(self, index: int) -> None:
        """The link back to the standing delay (a clean link without one)."""
        if self._namespaces is None:
            return
        if self._namespaces.hosts[index].impairment == self.standing:
            return  # as it stands already: no new delay process for nothing
        if self.standing == netns.Impairment():
            self._namespaces.clear(index)
        else:
            self._namespaces.impair(index, delay_ms=self.standing.delay_ms,
                                    jitter_ms=self.standing.jitter_ms,
                                    loss_pct=self.standing.loss_pct)  # fmt: skip

    def round_trip_ms(self, index: int, samples: int = 5, timeout: float = 5.0) -> float | None:
        """Link `index`'s round trip as a TCP handshake from inside its namespace sees it
        (the least of `samples` connects to a listener of the host's end: a SYN out, a
        SYN-ACK back), in milliseconds; None without namespaces or under a cut."""
        if self._namespaces is None or self._namespaces.hosts[index].partitioned:
            return None
        host = self._namespaces.hosts[index]
        best: float | None = None
        with socket.socket() as listener:
            listener.bind((host.host_ip, 0))
            listener.listen(samples)
            for _ in range(samples):
                with self._namespaces.socket(index) as client:
                    client.settimeout(timeout)
                    began = time.perf_counter()
                    client.connect(listener.getsockname())
                    took = (time.perf_counter() - began) * 1000
                accepted, _ = listener.accept()
                accepted.close()
                best = took if best is None else min(best, took)
        return best


class ChaosDatabase:
    """The run's PostgreSQL, listening where the namespaces reach it, with database
    ``chaos`` migrated by ``scheduler-daemon migrate`` before any replica starts.

    With a standby, replication starts synchronous and streams through the rig's proxy, so
    that an *asynchronous* failover can be given a real window: the standby is held back
    for a moment while commits go on, then the primary dies (what a lagging standby on a
    busy network does). Every replica and client uses the multi-host DSN with
    ``target_session_attrs=read-write``.
    """

    def __init__(self, *, with_standby: bool, network: ChaosNetwork) -> None:
        self.network = network
        settings = {"listen_addresses": "*"} if network.enabled else {}
        self.pair: ReplicatedCluster | None = None
        self.single: PgCluster | None = None
        if with_standby:
            self.pair = ReplicatedCluster(
                synchronous=True, settings=settings, replication_proxy=True
            )
        else:
            self.single = PgCluster(settings=settings)
        self.async_window = 0.0  # the longest measured window of lost commits

    def __enter__(self) -> Self:
        try:
            if self.pair is not None:
                self.pair.start()
            else:
                assert self.single is not None
                self.single.start()
            for node in self._nodes():
                if self.network.enabled:
                    netns.trust_namespaces(node)
            execute(self.admin_dsn_for("postgres"), f"CREATE DATABASE {DBNAME}")
            migrate(self.client_dsn)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.pair is not None:
            self.pair.cleanup()
        if self.single is not None:
            self.single.cleanup()

    def _nodes(self) -> list[PgCluster]:
        if self.pair is not None:
            return list(self.pair.nodes.values())
        assert self.single is not None
        return [self.single]

    # -- addresses -------------------------------------------------------------------

    @property
    def primary(self) -> PgCluster:
        if self.pair is not None:
            return self.pair.primary
        assert self.single is not None
        return self.single

    def admin_dsn_for(self, dbname: str) -> str:
        return self.primary.dsn(dbname)

    @property
    def admin_dsn(self) -> str:
        """The current primary, directly (for the harness's own reads and writes)."""
        return self.admin_dsn_for(DBNAME)

    @property
    def client_dsn(self) -> str:
        """What an application on the host uses: every node, the writable one wins."""
        return self._dsn("127.0.0.1")

    def replica_dsn(self, index: int) -> str:
        """What replica `index` uses, through its own link."""
        return self._dsn(self.network.host_ip(index))

    def _dsn(self, host: str) -> str:
        nodes = self._nodes()
        hosts = ",".join(f"{host}:{node.port}" for node in nodes)
        query = "?target_session_attrs=read-write" if len(nodes) > 1 else ""
        return f"postgresql://postgres@{hosts}/{DBNAME}{query}"

    # -- faults ----------------------------------------------------------------------

    def stop_primary(self, mode: Literal["fast", "immediate"]) -> None:
        """The first half of a restart: ``-m fast`` ends the sessions, ``-m immediate``
        crashes the server (recovery on the next start)."""
        self.primary.stop(mode)

    def start_primary(self) -> None:
        """The second half: start it again, on the same port, and wait until it answers."""
        self.primary.start()

    def failover(
        self,
        *,
        synchronous: bool,
        lag_seconds: float = 1.0,
        before_promote: Callable[[], None] | None = None,
    ) -> dict[str, Any]:
        """Stop the primary -m immediate and promote the standby; a new standby is built
        from the new primary afterwards. Asynchronous: the standby is held back for
        `lag_seconds` first, so commits are acknowledged that it never receives.
        `before_promote` runs once the old primary is dead and the standby has all it
        will ever get from it, before the promotion: no primary at all meanwhile."""
        assert self.pair is not None, "failover needs the standby (with_standby=True)"
        pair = self.pair
        if not synchronous:
            pair.set_synchronous(False)
            pair.pause_replication()
            time.sleep(lag_seconds)
        hook = None if before_promote is None else lambda _standby: before_promote()
        try:
            result = pair.failover(before_promote=hook)
        finally:
            with contextlib.suppress(Exception):
                pair.resume_replication()
        if not synchronous:
            pair.set_synchronous(True)
        window = result.lost.window(result.stop_started)
        self.async_window = max(self.async_window, window)
        return {
            "old_primary": result.old_primary,
            "new_primary": result.new_primary,
            "writable_after": round(result.downtime, 3),
            "lost_commits": len(result.lost.commits),
            "lost_window": round(window, 3),
            "lost_first": min(result.lost.commits) if result.lost.commits else None,
            "rebuilt_after": round(result.rebuilt - result.writable, 2) if result.rebuilt else None,
        }

    # -- observation -----------------------------------------------------------------

    def lock_holder(self, loop: str) -> tuple[bool, str | None]:
        """(whether the server answered, the instance holding `loop`'s lock now as it sees
        it: None for nobody)."""
        try:
            rows = fetch(
                self.admin_dsn,
                "SELECT s.instance FROM scheduler_leaders s JOIN pg_locks l "
                "ON l.pid = s.backend_pid AND l.locktype = 'advisory' AND l.granted "
                "WHERE s.loop = $1",
                loop,
                timeout=2,
            )
        except Exception:
            return False, None
        return True, str(rows[0]["instance"]) if rows else None

    def shard_owners(self) -> tuple[bool, dict[int, str]]:
        """(whether the server answered, the instance owning each shard of the plugin loop
        now, as it sees it: sharded leadership's ``plugin/<shard>`` rows whose session
        holds an advisory lock)."""
        try:
            rows = fetch(
                self.admin_dsn,
                "SELECT DISTINCT s.loop, s.instance FROM scheduler_leaders s JOIN pg_locks l "
                "ON l.pid = s.backend_pid AND l.locktype = 'advisory' AND l.granted "
                "WHERE s.loop LIKE 'plugin/%'",
                timeout=2,
            )
        except Exception:
            return False, {}
        return True, {int(row["loop"].split("/", 1)[1]): str(row["instance"]) for row in rows}

    def advisory_locks(self) -> list[dict[str, Any]]:
        """Advisory locks held on the run's database by anyone at all."""
        rows = fetch(
            self.admin_dsn,
            "SELECT l.pid, l.classid, l.objid, l.granted, a.application_name "
            "FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE l.locktype = 'advisory' "
            "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        )
        return [dict(row) for row in rows]
