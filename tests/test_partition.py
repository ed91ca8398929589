"""Real network partitions and a bad link (rig.netns): the rig's own proofs, then the product.

Each replica runs in a network namespace of its own, linked to the host by a veth pair;
PostgreSQL listens on the host side. A partition drops every packet on arrival at both
ends: the kernel of neither side hears anything, so unlike the userspace proxy of
tests/rig/tcpproxy.py, the server's own TCP keepalive / ``tcp_user_timeout`` is what has
to notice the dead peer.

Everything here needs root and network namespaces; it skips with the reason where they
cannot be made, except under CI (``CI=true``), where that is a failure.
"""

from __future__ import annotations

import asyncio
import errno
import json
import select
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from rig import netns
from rig.databases import create_database, drop_database, migrate, new_database_name, run_sync
from rig.effects import (
    EFFECTS_TARGETS,
    check_effects,
    effects_replica_env,
    read_effects,
    runs_of,
    wait_mid_run,
)
from rig.netns import Namespaces, NetEvent
from rig.pgcluster import PgCluster, find_pg_bindir
from rig.plugin import ci_is_set
from rig.ports import free_port
from rig.processes import DaemonProcess, Daemons, daemon_env, start_replicas
from rig.sql import LOCK_HOLDERS, fetch, lock_backend
from rig.ticks import (
    FAST_TIMINGS,
    PLUGIN_ONLY,
    RIG_APP,
    event_time,
    first_leader,
    stop_all,
    wait_for_event,
)
from rig.waiting import wait_until

from scheduler_daemon.config.values import DEFAULT_PLUGIN_KEY

pytestmark = pytest.mark.processes

TEMPLATE = "partition_template"


def _unusable(reason: str) -> None:
    if ci_is_set():
        pytest.fail(f"network namespaces are required under CI: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def netns_here() -> None:
    reason = netns.unavailable()
    if reason is not None:
        _unusable(reason)


@pytest.fixture
def net(netns_here: None) -> Iterator[Namespaces]:
    with Namespaces() as namespaces:
        yield namespaces


@pytest.fixture(scope="module")
def host_pg(netns_here: None) -> Iterator[PgCluster]:
    """A cluster of its own listening on every address (the session's listens on
    127.0.0.1 only), trusting the namespaces, with a migrated template database.
    Disconnections are logged: the server log says when and why it ended a session."""
    bindir = find_pg_bindir()
    if bindir is None:
        _unusable("no PostgreSQL server binaries")
    settings = {"listen_addresses": "*", "log_disconnections": "on"}
    with PgCluster(bindir, settings=settings) as cluster:
        netns.trust_namespaces(cluster)
        run_sync(create_database(cluster.dsn(), TEMPLATE))
        migrate(cluster.dsn(TEMPLATE))
        yield cluster


@pytest.fixture
def host_url(host_pg: PgCluster) -> Iterator[str]:
    name = new_database_name()
    run_sync(create_database(host_pg.dsn(), name, template=TEMPLATE))
    yield host_pg.dsn(name)
    run_sync(drop_database(host_pg.dsn(), name, grace=0))


# -- the rig ------------------------------------------------------------------------------


def test_argv_runs_the_command_itself_inside_the_namespace(
    net: Namespaces, daemons: Daemons
) -> None:
    """``ip netns exec`` execs: the pid Popen returns is the command's, in the namespace,
    so SIGSTOP and SIGKILL sent to it reach the command."""
    n = net.add()
    script = "import os, time; print(os.getpid(), flush=True); time.sleep(60)"
    process = daemons.spawn(net.argv(n, [sys.executable, "-c", script]), daemon_env({}))
    deadline = time.monotonic() + 10
    while not process.output().strip() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert process.output().split()[0] == str(process.pid)
    assert _netns_inode(process.pid) == net.hosts[n].path.stat().st_ino
    assert _netns_inode(process.pid) != Path("/proc/self/ns/net").stat().st_ino
    process.signal(signal.SIGSTOP)
    wait_until(lambda: _proc_state(process.pid) == "T", 5, "the command stopped")
    process.signal(signal.SIGKILL)
    assert process.wait(5) == -signal.SIGKILL


def _netns_inode(pid: int) -> int:
    return Path(f"/proc/{pid}/ns/net").stat().st_ino


def _proc_state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_partition_is_silent_both_ways_and_heal_restores_it(net: Namespaces) -> None:
    """Across the cut nothing is refused and no sender sees an error: connect() hangs
    (even to a port nobody listens on, which is refused on a healthy link), and on
    established streams send() succeeds while nothing arrives, either way.
    After heal, what was sent during the cut arrives and new connections work."""
    n = net.add()
    link = net.hosts[n]
    with (
        _listener(socket.socket(), link.host_ip) as on_host,
        _listener(net.socket(n), link.ns_ip) as in_ns,
    ):
        outward = _connected(net.socket(n), on_host)  # replica -> host
        inward = _connected(socket.socket(), in_ns)  # host -> replica
        closed_host_port = free_port(link.host_ip)
        with pytest.raises(ConnectionRefusedError):  # so the silence below means something
            _connect(net.socket(n), (link.host_ip, closed_host_port), 2.0)

        cut = net.partition(n)
        for client, server in (outward, inward):
            assert client.send(b"c") == 1  # no EPERM, no error of any kind
            assert server.send(b"s") == 1
        connecting = [
            _start_connect(net.socket(n), on_host.getsockname()),
            _start_connect(net.socket(n), (link.host_ip, closed_host_port)),
            _start_connect(socket.socket(), in_ns.getsockname()),
        ]
        # A refused or failed connect() would turn writable; data would turn readable.
        readable, writable, _ = select.select([*outward, *inward], connecting, [], 1.0)
        assert (readable, writable) == ([], [])
        assert [sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) for sock in connecting] == [
            0, 0, 0,
        ]  # fmt: skip
        for sock in connecting:
            sock.close()

        heal = net.heal(n)
        for client, server in (outward, inward):
            for receiver, expected in ((server, b"c"), (client, b"s")):
                receiver.settimeout(10)  # TCP retransmits on its own backoff
                assert receiver.recv(1) == expected
        _connect(net.socket(n), on_host.getsockname(), 2.0).close()
        with pytest.raises(ConnectionRefusedError):
            _connect(net.socket(n), (link.host_ip, closed_host_port), 2.0)
        for sock in (*outward, *inward):
            sock.close()
    assert [e.kind for e in net.events] == ["create", "partition", "heal"]
    assert cut.started <= cut.ended <= heal.started <= heal.ended


def test_impair_delays_each_direction_and_drops_its_share(net: Namespaces) -> None:
    """delay_ms holds each direction's packets that long (a round trip grows by twice it),
    jitter spreads it, loss_pct drops that share of the packets arriving at each end;
    clear() puts the link back."""
    n = net.add()
    link = net.hosts[n]
    with _listener(socket.socket(), link.host_ip) as on_host, _echo(on_host):
        stream = _connect(net.socket(n), on_host.getsockname(), 5.0)
        stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        before = _round_trips(stream, 10)
        net.impair(n, delay_ms=40)
        delayed = _round_trips(stream, 6)
        net.impair(n, delay_ms=40, jitter_ms=30)
        jittered = _round_trips(stream, 12)
        net.clear(n)
        after = _round_trips(stream, 10)
        stream.close()
    print(f"\nround trips (ms): healthy {statistics.median(before):.1f} (median), delay 40 "
          f"{min(delayed):.0f}..{max(delayed):.0f}, delay 40 ± 30 {min(jittered):.0f}.."
          f"{max(jittered):.0f}, cleared {statistics.median(after):.1f} (median)")  # fmt: skip
    # Lower bounds are exact (a held packet cannot come back early); upper ones have slack
    # for a loaded machine.
    assert statistics.median(before) < 20
    assert min(delayed) >= 80
    assert statistics.median(delayed) < 140
    assert min(jittered) >= 20
    assert max(jittered) - min(jittered) > 20
    assert statistics.median(after) < 20

    net.impair(n, loss_pct=20)
    outward, inward = _datagrams_through(net, n, 1000)
    net.clear(n)
    print(f"20% loss: {outward / 10:.1f}% and {inward / 10:.1f}% of 1000 datagrams arrived")
    for arrived in (outward, inward):
        assert 700 <= arrived <= 880, (outward, inward)
    assert _datagrams_through(net, n, 200) == (200, 200)


def test_a_cut_keeps_the_links_delay_and_the_heal_brings_it_back(net: Namespaces) -> None:
    """A partition of a delayed link replaces its rules with the cut but keeps the delay
    (and its process): the heal ends the cut with the link as delayed as before it, not
    clean. The chaos suite's standing delay relies on it."""
    n = net.add()
    with _listener(socket.socket(), net.hosts[n].host_ip) as on_host, _echo(on_host):
        stream = _connect(net.socket(n), on_host.getsockname(), 5.0)
        stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        net.impair(n, delay_ms=20)
        delayer = net.hosts[n].delayer
        net.partition(n)
        net.heal(n)
        assert net.hosts[n].impairment == netns.Impairment(delay_ms=20)
        assert delayer is not None
        assert net.hosts[n].delayer is delayer
        assert delayer.poll() is None
        healed = _round_trips(stream, 6)
        stream.close()
    print(f"\nround trips after the heal of a link delayed 20 ms (ms): {min(healed):.0f}.."
          f"{max(healed):.0f}")  # fmt: skip
    assert min(healed) >= 40


def test_leftovers_of_a_killed_run_are_removed(netns_here: None, tmp_path: Path) -> None:
    """A run SIGKILLed with a link cut and delayed leaves its namespace, link, chains and
    delay process behind; the delay process exits by itself, the next run's entry removes
    the rest, and leaves a live run's namespaces alone."""
    script = (
        "import sys, time\n"
        "from rig.netns import Namespaces\n"
        "net = Namespaces(1).__enter__()\n"
        "net.impair(0, delay_ms=50)\n"
        "print(net.hosts[0].name, net.hosts[0].host_if, net.hosts[0].chain,"
        " net.hosts[0].delayer.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    tests_dir = str(Path(__file__).parent)
    with subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        text=True,
        env={"PYTHONPATH": tests_dir, "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
    ) as orphan:
        assert orphan.stdout is not None
        name, host_if, chain, delayer = orphan.stdout.readline().split()
        orphan.kill()
    assert name in _netns_names()
    with Namespaces(1) as alive:  # entering removes what dead runs left
        assert name not in _netns_names()
        assert netns.remove_stale() == []  # and a live run's are not stale
        assert alive.hosts[0].name in _netns_names()
    assert host_if not in subprocess.run(["ip", "-o", "link"], capture_output=True,
                                         text=True, check=True).stdout  # fmt: skip
    assert chain not in subprocess.run(["iptables", "-w", "-S"], capture_output=True,
                                       text=True, check=True).stdout  # fmt: skip
    wait_until(
        lambda: not Path(f"/proc/{delayer}").exists(), 5, "the orphaned delay process to exit"
    )


def _netns_names() -> set[str]:
    out = subprocess.run(["ip", "-j", "netns", "list"], capture_output=True, text=True, check=True)
    return {entry["name"] for entry in json.loads(out.stdout or "[]")}


class _listener:
    """A listening TCP socket on `host`, closed on leaving."""

    def __init__(self, sock: socket.socket, host: str) -> None:
        self.sock = sock
        sock.bind((host, 0))
        sock.listen(8)

    def __enter__(self) -> socket.socket:
        return self.sock

    def __exit__(self, *exc: object) -> None:
        self.sock.close()


def _connect(sock: socket.socket, address: tuple[str, int], timeout: float) -> socket.socket:
    sock.settimeout(timeout)
    try:
        sock.connect(address)
    except BaseException:
        sock.close()
        raise
    return sock


def _start_connect(sock: socket.socket, address: tuple[str, int]) -> socket.socket:
    sock.setblocking(False)
    assert sock.connect_ex(address) == errno.EINPROGRESS
    return sock


def _connected(client: socket.socket, server: socket.socket) -> tuple[socket.socket, socket.socket]:
    _connect(client, server.getsockname(), 5.0)
    server.settimeout(5.0)
    accepted, _ = server.accept()
    for sock in (client, accepted):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return client, accepted


class _echo:
    """Echo every byte on the connections `server` accepts, in a thread."""

    def __init__(self, server: socket.socket) -> None:
        self.server = server
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        self.server.settimeout(10)
        try:
            conn, _ = self.server.accept()
        except OSError:
            return
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while data := conn.recv(64):
                conn.sendall(data)

    def __enter__(self) -> None:
        self.thread.start()

    def __exit__(self, *exc: object) -> None:
        self.thread.join(10)


def _round_trips(stream: socket.socket, count: int) -> list[float]:
    stream.settimeout(10)
    times = []
    for _ in range(count):
        started = time.monotonic()
        stream.sendall(b"x")
        assert stream.recv(1) == b"x"
        times.append((time.monotonic() - started) * 1000)
    return times


SO_RCVBUFFORCE = 33  # root may exceed net.core.rmem_max


def _datagrams_through(net: Namespaces, n: int, count: int) -> tuple[int, int]:
    """UDP datagrams sent replica -> host and host -> replica that arrived, each way."""
    link = net.hosts[n]
    arrived = []
    for sender, receiver, address in (
        (net.socket(n, kind=socket.SOCK_DGRAM), socket.socket(type=socket.SOCK_DGRAM),
         link.host_ip),
        (socket.socket(type=socket.SOCK_DGRAM), net.socket(n, kind=socket.SOCK_DGRAM),
         link.ns_ip),
    ):  # fmt: skip
        with sender, receiver:
            receiver.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 4 << 20)  # holds them all
            receiver.bind((address, 0))
            receiver.settimeout(0.15)
            for index in range(count):
                sender.sendto(b"%d" % index, receiver.getsockname())
            got = 0
            try:
                while True:
                    receiver.recv(16)
                    got += 1
            except TimeoutError:
                arrived.append(got)
    return arrived[0], arrived[1]


# -- the product --------------------------------------------------------------------------

# The test timings with stall_timeout raised, so that the server's idle timeout cannot be
# what frees a cut-off leader's lock: keepalive / tcp_user_timeout must (>= 3 s after the
# cut by config/timing.py's formula: min(4, max(1, 4 - 1), 1 x 3)).
KEEPALIVE_TIMINGS = {**FAST_TIMINGS, "SCHEDULER_LOCK__STALL_TIMEOUT": "20"}
# The product's own lock timings (heartbeat 2 s, keepalive 2/2/4, tcp_user_timeout 10 s,
# stall_timeout 15 s): docs/leadership.md says the server frees the lock 8-10 s after the cut.
DEFAULT_TIMINGS = {
    key: value for key, value in FAST_TIMINGS.items() if not key.startswith("SCHEDULER_LOCK__")
}
KEEPALIVE = "TCP keepalive / tcp_user_timeout"
CONNECTION_CHECK = "tcp_user_timeout, seen by client_connection_check_interval"
IDLE_TIMEOUT = "idle timeout (stall_timeout)"


def effects_tasks() -> list[dict[str, str]]:
    """An async and a sync effects probe, each working 0.5 s per 0.5 s slot: always busy."""
    return [
        {"name": kind, "every": "0.5s", "timeout": "20s", "target": EFFECTS_TARGETS[kind]}
        for kind in ("async", "sync")
    ]


@dataclass(frozen=True)
class Replicas:
    leader: DaemonProcess
    standbys: list[DaemonProcess]
    at: int  # the leader's namespace


def start_in_namespaces(
    daemons: Daemons,
    net: Namespaces,
    url: str,
    names: list[str],
    log: Path,
    timings: Mapping[str, str] = FAST_TIMINGS,
    tasks: list[dict[str, str]] | None = None,
) -> Replicas:
    """One replica per name, each in a namespace of its own, all started at once; returns
    once one leads the plugin loop and the others wait."""
    spaces = [net.add() for _ in names]
    envs = [
        (
            name,
            effects_replica_env(net.dsn(n, url), name, log, tasks or effects_tasks(), 0.5, timings),
        )
        for name, n in zip(names, spaces, strict=True)
    ]
    processes = start_replicas(
        daemons, envs, PLUGIN_ONLY, wrap=lambda index, argv: net.argv(spaces[index], argv)
    )
    leader = first_leader(processes)
    standbys = [process for process in processes if process is not leader]
    # The pid a test signals is the daemon's own: the daemon wrote it into scheduler_leaders.
    assert _leader_row(url) == (leader.name, leader.pid)
    return Replicas(leader, standbys, spaces[processes.index(leader)])


def _leader_row(url: str) -> tuple[str, int]:
    rows = fetch(url, "SELECT instance, pid FROM scheduler_leaders WHERE loop = 'plugin'")
    assert len(rows) == 1, rows
    return rows[0]["instance"], rows[0]["pid"]


def lock_app(instance: str) -> str:
    return f"scheduler-daemon/{instance}/lock:plugin"


@dataclass(frozen=True)
class Freed:
    cut: NetEvent
    at: float  # wall clock: the old backend no longer holds the lock
    holder: str | None  # application_name of the session holding it next


def cut_and_watch(url: str, backend: int, cut: Callable[[], NetEvent]) -> Freed:
    """Cut (call `cut`), then poll pg_locks on a connection opened beforehand until
    `backend` no longer holds the plugin lock: the lock manager's own word on when the
    server let go of it."""

    async def go() -> Freed:
        conn = await asyncpg.connect(url, server_settings=RIG_APP)
        try:
            event = cut()
            while time.time() - event.started < 60:
                rows = await conn.fetch(LOCK_HOLDERS, DEFAULT_PLUGIN_KEY)
                if not any(r["pid"] == backend and r["granted"] for r in rows):
                    holders = [r["application_name"] for r in rows if r["granted"]]
                    return Freed(event, time.time(), holders[0] if holders else None)
                await asyncio.sleep(0.01)
        finally:
            await conn.close()
        raise AssertionError(f"backend {backend} still holds the lock 60 s after the cut")

    return run_sync(go())


def server_lines(cluster: PgCluster, backend: int) -> list[str]:
    """The server log's lines about one backend (log_line_prefix has ``[%p]``)."""
    return [line for line in cluster.log_path.read_text(errors="replace").splitlines()
            if f"[{backend}]" in line]  # fmt: skip


def why_freed(lines: list[str]) -> str:
    """What ended the session, as the server logged it."""
    text = "\n".join(lines)
    if "idle-session timeout" in text or "idle-in-transaction timeout" in text:
        return IDLE_TIMEOUT
    if "Connection timed out" in text:  # ETIMEDOUT: keepalive or tcp_user_timeout
        return KEEPALIVE
    if "connection to client lost" in text:  # a busy backend polled its socket: dead
        return CONNECTION_CHECK
    return "unknown: " + " | ".join(lines[-3:])


def _next_leader(processes: list[DaemonProcess], since: float) -> DaemonProcess:
    """The one process that logged leader.acquired (plugin) since `since`; fails if two did."""

    def find() -> DaemonProcess | None:
        found = [process for process in processes for entry in process.log_events()
                 if entry.get("event") == "leader.acquired" and entry.get("loop") == "plugin"
                 and event_time(entry) >= since]  # fmt: skip
        assert len(found) <= 1, f"more than one new leader: {[p.name for p in found]}"
        return found[0] if found else None

    leader: DaemonProcess = wait_until(find, 60, "a standby to take over")
    return leader


def _events_since(process: DaemonProcess, event: str, since: float) -> list[dict[str, Any]]:
    return [e for e in process.log_events() if e.get("event") == event
            and e.get("loop") == "plugin" and event_time(e) >= since]  # fmt: skip


@pytest.mark.parametrize(
    ("timings", "cause", "frees_within"),
    [
        pytest.param(KEEPALIVE_TIMINGS, KEEPALIVE, 10.0, id="keepalive"),
        pytest.param(FAST_TIMINGS, None, 10.0, id="fast", marks=pytest.mark.chaos_long),
        pytest.param(DEFAULT_TIMINGS, KEEPALIVE, 20.0, id="defaults", marks=pytest.mark.chaos_long),
    ],
)
def test_a_partitioned_leader_stops_before_the_server_frees_its_lock(
    host_url: str,
    host_pg: PgCluster,
    net: Namespaces,
    daemons: Daemons,
    tmp_path: Path,
    timings: Mapping[str, str],
    cause: str | None,
    frees_within: float,
) -> None:
    """Three replicas, each in its own namespace; the plugin leader's link is cut silently
    mid-run. The leader steps down and its work stops; then the server gives up on the
    silent session and frees the lock, and one standby takes over. No two instances work
    at once. `cause`: what must end the session, from the server's log (the keepalive
    case raises stall_timeout so that only keepalive / tcp_user_timeout can; ``fast`` is
    the suite's timings, where the idle timeout comes first). On heal the old leader comes
    back as a standby and stays one (docs/leadership.md: step down, back off, compete
    again as a standby)."""
    log = tmp_path / "effects.jsonl"
    replicas = start_in_namespaces(daemons, net, host_url, ["p0", "p1", "p2"], log, timings)
    leader, standbys, old = replicas.leader, replicas.standbys, replicas.leader.name
    backend = lock_backend(host_url, old)
    wait_mid_run(log, old, {"async", "sync"})

    freed = cut_and_watch(host_url, backend, lambda: net.partition(replicas.at))
    cut_at = freed.cut.started
    lost = wait_for_event(leader, "leader.lost", after=cut_at, loop="plugin", timeout=15)
    successor = _next_leader(standbys, cut_at)
    wait_until(lambda: runs_of(log, successor.name), 20, "a run by the new leader")
    assert leader.poll() is None, "the cut-off leader exited: " + leader.output()[-2000:]
    freed_by = why_freed(server_lines(host_pg, backend))

    heal = net.heal(replicas.at)
    waiting = wait_for_event(leader, "leader.waiting", after=heal.ended, loop="plugin", timeout=30)
    wait_until(lambda: any(r["application_name"] == lock_app(old) and not r["granted"]
                      for r in fetch(host_url, LOCK_HOLDERS, DEFAULT_PLUGIN_KEY)),
          10, f"{old} waiting on the lock")  # fmt: skip
    time.sleep(0.5)  # and staying a standby
    acquired_again = _events_since(leader, "leader.acquired", cut_at)
    stop_all([leader, *standbys])

    stopped = max(run.end for run in runs_of(log, old))
    first_new = min(run.start for run in runs_of(log, successor.name))
    print(f"\nreal partition of the plugin leader; the server freed its lock by {freed_by}:"
          f"\n  cut in place at both ends {(freed.cut.ended - cut_at) * 1000:.0f} ms after it began"
          f"\n  leader stepped down {event_time(lost) - cut_at:.2f}s after the cut ({lost['reason']})"
          f"\n  its last external record {stopped - cut_at:.2f}s after the cut"
          f"\n  lock free on the server {freed.at - cut_at:.2f}s after the cut (to {freed.holder})"
          f"\n  {successor.name}'s first work {first_new - cut_at:.2f}s after the cut"
          f"\n  back as a standby {event_time(waiting) - heal.ended:.2f}s after the heal")  # fmt: skip
    assert acquired_again == [], acquired_again
    if cause is not None:
        assert freed_by == cause, server_lines(host_pg, backend)
    assert stopped < freed.at, "the cut-off leader still worked when its lock was freed"
    assert freed.at - cut_at < frees_within
    assert freed.holder in {lock_app(s.name) for s in standbys}
    check_effects(read_effects(log), min_runs=4, min_instances=2)


@pytest.mark.chaos_long
def test_a_leader_cut_off_mid_statement_loses_its_lock_by_the_connection_check(
    host_url: str, host_pg: PgCluster, net: Namespaces, daemons: Daemons, tmp_path: Path
) -> None:
    """The one case the idle timeout cannot back up: the lock session is busy (a 60 s SQL
    task on the leader's lock connection) when the link is cut. The server's kernel
    times the silent socket out (tcp_user_timeout), and the backend, busy in the
    statement, finds out through client_connection_check_interval, cancels it and ends
    the session; the statement's transaction never commits."""
    log = tmp_path / "effects.jsonl"
    tasks = [{"name": "long", "every": "1s", "timeout": "120s", "sql": "SELECT pg_sleep(60)"}]
    replicas = start_in_namespaces(
        daemons, net, host_url, ["m0", "m1"], log, KEEPALIVE_TIMINGS, tasks
    )
    old = replicas.leader.name
    backend = lock_backend(host_url, old)
    wait_until(lambda: fetch(host_url, "SELECT 1 FROM pg_stat_activity WHERE pid = $1 AND "
                         "query LIKE '%pg_sleep(60)%' AND state = 'active'", backend),
          20, f"{old}'s lock session running the long statement")  # fmt: skip

    freed = cut_and_watch(host_url, backend, lambda: net.partition(replicas.at))
    cut_at = freed.cut.started
    successor = _next_leader(replicas.standbys, cut_at)
    freed_by = why_freed(server_lines(host_pg, backend))
    net.heal(replicas.at)
    stop_all([replicas.leader, *replicas.standbys])
    print(f"\ncut mid-statement: lock free on the server {freed.at - cut_at:.2f}s after the cut "
          f"({freed_by}); {successor.name} leads")  # fmt: skip
    assert freed_by == CONNECTION_CHECK, server_lines(host_pg, backend)
    assert freed.at - cut_at < 10  # not the 60 s the statement would have taken
    runs = fetch(host_url, "SELECT instance, status FROM scheduler_plugin_runs WHERE name = 'long'")
    assert (old, "succeeded") not in {(r["instance"], r["status"]) for r in runs}, runs


@pytest.mark.parametrize(
    ("timings", "impaired_for"),
    [
        # No overlap on a bad link: the chaos slice's netem shows it in `make test`.
        pytest.param(FAST_TIMINGS, 3.0, id="fast", marks=pytest.mark.chaos_long),
        pytest.param(DEFAULT_TIMINGS, 10.0, id="defaults", marks=pytest.mark.chaos_long),
    ],
)
def test_a_slow_lossy_link_leads_or_hands_over_without_overlap(
    host_url: str,
    net: Namespaces,
    daemons: Daemons,
    tmp_path: Path,
    timings: Mapping[str, str],
    impaired_for: float,
) -> None:
    """The plugin leader's link gets 200 ms each way (±20 ms) and 5% loss at each end
    for `impaired_for` seconds. With the suite's 0.5 s heartbeat a proof comes too late
    and the leader steps down, and the standby on its healthy link takes over; with the
    product's 2 s it keeps leading, slowly. Either way no two instances work at once,
    nobody exits, and the work goes on once the link is healthy again."""
    log = tmp_path / "effects.jsonl"
    replicas = start_in_namespaces(daemons, net, host_url, ["b0", "b1"], log, timings)
    leader, (standby,) = replicas.leader, replicas.standbys
    wait_mid_run(log, leader.name, {"async", "sync"})
    bad = net.impair(replicas.at, delay_ms=200, jitter_ms=20, loss_pct=5)
    time.sleep(impaired_for)
    good = net.clear(replicas.at)
    wait_until(lambda: len([r for r in read_effects(log) if r.start > good.ended]) >= 2, 20,
          "work going on once the link is healthy")  # fmt: skip
    assert leader.poll() is None
    assert standby.poll() is None
    lost = _events_since(leader, "leader.lost", bad.started)
    took_over = _events_since(standby, "leader.acquired", bad.started)
    stop_all([leader, standby])
    runs = read_effects(log)
    during = [run for run in runs if bad.ended < run.start < good.started]
    print(f"\n200 ms ± 20 ms each way + 5% loss for {good.started - bad.ended:.1f}s: "
          f"{len(during)} runs started meanwhile, by {sorted({r.instance for r in during})}; "
          f"the leader stepped down at {[round(event_time(e) - bad.ended, 2) for e in lost]} s "
          f"({', '.join(e['reason'] for e in lost) or 'never'}), the standby took over at "
          f"{[round(event_time(e) - bad.ended, 2) for e in took_over]} s")  # fmt: skip
    check_effects(runs, min_runs=4)
