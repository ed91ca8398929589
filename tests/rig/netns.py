"""Real network partitions and bad links: each replica in a network namespace of its own.

Replica ``n`` runs inside namespace ``sdnet-<run>-<n>``, joined to the host by a veth
pair: the host end ``10.231.X.1/24``, the namespace end ``10.231.X.2/24`` (``X`` picked
free on this host, so that several runs can exist at once), ``lo`` up, no default route.
PostgreSQL listens on the host side (``listen_addresses = '*'``, and
:func:`trust_namespaces` for ``10.231.0.0/16``), so all of a replica's traffic to the
database crosses exactly one link, which the rig can cut or spoil:

- :meth:`Namespaces.partition` / :meth:`Namespaces.heal`: every packet is dropped *on
  arrival*, at both ends (INPUT inside the namespace; INPUT on the host for packets that
  come in from that veth). That is what makes the cut silent, like a dead switch: no RST,
  no ICMP, and no error for either sender. (A DROP in OUTPUT would fail the local
  sender's ``send()`` with EPERM at once, which is anything but silent.)
- :meth:`Namespaces.impair` / :meth:`Namespaces.clear`: delay and jitter (each direction
  delayed once, as netem on both veth ends would be; the round trip grows by twice the
  delay) and random loss of that share of the packets arriving at each end. Loss is
  iptables' ``statistic`` match; delay is ``rig.netdelay``, a process holding the packets
  in a netfilter queue, because ``tc netem`` is a kernel option this machine's kernel
  lacks.

Each end's rules live in one chain of the run's own (``SDN-<run>-<n>``), replaced as a
whole by one ``iptables-restore`` per end, so a change is atomic at each end. Every
change is logged (logger ``rig.netns``) and recorded in :attr:`Namespaces.events` with
its wall-clock times: ``started`` before the first command, ``ended`` once both ends are
in place. The fault is complete at ``ended``; measure reactions from ``started`` when
bounding them from above.

:class:`Namespaces` is a context manager: leaving it removes everything it made
(processes inside its namespaces are killed, the links, chains and queue processes go),
even after a failed test. Entering it first removes the leftovers of runs whose process
is gone (a killed test run), by their name prefix; runs still alive are left alone.
Needs root and the ``ip``, ``iptables`` and ``iptables-restore`` commands; see
:func:`unavailable`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self
from urllib.parse import urlsplit

from rig.databases import replace_host_port
from rig.netdelay import entered
from rig.pgcluster import PgCluster
from rig.sql import fetch

NETNS_PREFIX = "sdnet-"
LINK_PREFIX = "sdn"
CHAIN_PREFIX = "SDN-"
NETNS_DIR = Path("/run/netns")
TRUSTED_NETWORK = "10.231.0.0/16"
HBA_LINE = f"host all all {TRUSTED_NETWORK} trust"
# Netfilter queue numbers are per namespace; on the host each link takes its own.
_QUEUE_BASE = 23100
_DELAYER = Path(__file__).with_name("netdelay.py")
# Held while choosing a free subnet and while removing stale leftovers: another run on
# this host may be doing either at the same moment.
_HOST_LOCK = Path(tempfile.gettempdir()) / "scheduler-rig-netns.lock"
_RUN_ID = re.compile(r"[0-9a-f]{8}")
_COMMAND_TIMEOUT = 30.0

log = logging.getLogger("rig.netns")


class NetnsError(RuntimeError):
    """A command of the rig failed; the message has its output."""


@dataclass(frozen=True, slots=True)
class Impairment:
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss_pct: float = 0.0


@dataclass(frozen=True, slots=True)
class NetEvent:
    """One thing the rig did to a link, by wall clock (seconds since the epoch)."""

    kind: str  # create, partition, heal, impair, clear, remove
    index: int
    started: float
    ended: float
    detail: Mapping[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class NetHost:
    """Replica `index`'s namespace and its link to the host, and what is done to it now."""

    index: int
    run_id: str
    octet: int
    partitioned: bool = False
    impairment: Impairment = Impairment()
    delayer: subprocess.Popen[bytes] | None = None

    @property
    def name(self) -> str:
        return f"{NETNS_PREFIX}{self.run_id}-{self.index}"

    @property
    def path(self) -> Path:
        return NETNS_DIR / self.name

    @property
    def host_if(self) -> str:
        return f"{LINK_PREFIX}{self.run_id}{self.index:02x}h"  # 14 characters of 15

    @property
    def ns_if(self) -> str:
        return f"{LINK_PREFIX}{self.run_id}{self.index:02x}n"

    @property
    def chain(self) -> str:
        return f"{CHAIN_PREFIX}{self.run_id}-{self.index:02x}"

    @property
    def host_ip(self) -> str:
        """The host's end: what a replica in this namespace connects to."""
        return f"10.231.{self.octet}.1"

    @property
    def ns_ip(self) -> str:
        return f"10.231.{self.octet}.2"

    @property
    def queue(self) -> int:
        return _QUEUE_BASE + self.octet


class Namespaces:
    """The namespaces of one run: ``count`` of them on entering, more with :meth:`add`.

    Replicas are numbered from 0, in the order they were added.
    """

    def __init__(self, count: int = 0) -> None:
        self.run_id = f"{os.getpid():06x}{secrets.token_hex(1)}"
        self.hosts: list[NetHost] = []
        self.events: list[NetEvent] = []
        self._count = count

    def __enter__(self) -> Self:
        try:
            remove_stale()
            for _ in range(self._count):
                self.add()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- what a test uses -------------------------------------------------------------

    def add(self) -> int:
        """A new namespace and link; returns its index."""
        started = time.time()
        with _host_lock():
            host = NetHost(len(self.hosts), self.run_id, _free_octet())
            self.hosts.append(host)  # before creating: close() removes a half-made one
            _create(host)
        self._record("create", host, started, host_ip=host.host_ip, ns_ip=host.ns_ip)
        return host.index

    def argv(self, n: int, command: Sequence[str]) -> list[str]:
        """`command` run inside namespace `n`. ``ip netns exec`` execs it, so the pid a
        Popen gets is the command's own: signals sent to it reach the command."""
        return ["ip", "netns", "exec", self.hosts[n].name, *command]

    def dsn(self, n: int, dsn: str) -> str:
        """`dsn` as a replica in namespace `n` reaches the same server: the host's end of
        its link, same port, user and database."""
        return replace_host_port(dsn, self.hosts[n].host_ip, urlsplit(dsn).port or 5432)

    def socket(
        self, n: int, family: int = socket.AF_INET, kind: int = socket.SOCK_STREAM
    ) -> socket.socket:
        """A socket inside namespace `n`, for the rig's own probes of the link."""
        with entered(self.hosts[n].path):
            return socket.socket(family, kind)

    def partition(self, n: int) -> NetEvent:
        """Cut replica `n` off, silently, in both directions."""
        host = self.hosts[n]
        started = time.time()
        host.partitioned = True
        self._apply(host)
        return self._record("partition", host, started)

    def heal(self, n: int) -> NetEvent:
        host = self.hosts[n]
        started = time.time()
        host.partitioned = False
        self._apply(host)
        return self._record("heal", host, started)

    def impair(
        self, n: int, *, delay_ms: float = 0.0, jitter_ms: float = 0.0, loss_pct: float = 0.0
    ) -> NetEvent:
        """Delay each direction by `delay_ms` ± `jitter_ms` (uniform) and drop `loss_pct`
        percent of the packets arriving at each end; replaces an earlier impairment."""
        if delay_ms < 0 or jitter_ms < 0 or not 0 <= loss_pct <= 100:
            raise ValueError(f"impossible impairment: {delay_ms=} {jitter_ms=} {loss_pct=}")
        host = self.hosts[n]
        started = time.time()
        wanted = Impairment(delay_ms, jitter_ms, loss_pct)
        self._stop_delayer(host)
        host.delayer = _start_delayer(host, wanted) if delay_ms or jitter_ms else None
        host.impairment = wanted  # once it is real: a failed start changes nothing
        self._apply(host)
        return self._record(
            "impair", host, started, delay_ms=delay_ms, jitter_ms=jitter_ms, loss_pct=loss_pct
        )

    def clear(self, n: int) -> NetEvent:
        """The link back to full health (a partition stays until healed)."""
        host = self.hosts[n]
        started = time.time()
        host.impairment = Impairment()
        self._apply(host)
        self._stop_delayer(host)  # after the rules: it lets go of what it still holds
        return self._record("clear", host, started)

    def close(self) -> None:
        """Remove everything this run made; safe to call more than once."""
        while self.hosts:
            host = self.hosts.pop()
            started = time.time()
            self._stop_delayer(host)
            _remove(host.name, host.host_if, host.chain)
            self._record("remove", host, started)

    # -- internals --------------------------------------------------------------------

    def _apply(self, host: NetHost) -> None:
        """Both ends' chains replaced as a whole, host end first (the server stops
        hearing the replica first)."""
        rules = _rules(host)
        _restore(host.chain, rules)
        _restore(host.chain, rules, netns=host.name)

    def _stop_delayer(self, host: NetHost) -> None:
        delayer, host.delayer = host.delayer, None
        if delayer is None:
            return
        if delayer.poll() is None:
            delayer.terminate()
        try:
            delayer.communicate(timeout=5)  # reaps it and closes its pipes
        except subprocess.TimeoutExpired:
            delayer.kill()
            delayer.communicate()

    def _record(self, kind: str, host: NetHost, started: float, **detail: Any) -> NetEvent:
        event = NetEvent(kind, host.index, started, time.time(), detail)
        self.events.append(event)
        log.info(
            "%s replica %d (%s) %s..%s +%.0f ms %s",
            kind, host.index, host.name, _stamp(event.started), _stamp(event.ended),
            (event.ended - event.started) * 1000, detail or "",
        )  # fmt: skip
        return event


# -- PostgreSQL on the host side ----------------------------------------------------------


def trust_namespaces(cluster: PgCluster, timeout: float = 10.0) -> None:
    """Let replicas in any namespace log in to `cluster` (started with
    ``settings={"listen_addresses": "*"}``): ``host all all 10.231.0.0/16 trust`` in its
    pg_hba.conf, then a reload, waited for.

    The reload is asynchronous (a SIGHUP to the postmaster), and a replica that connected
    before it landed would be refused (exit 78). The postmaster reloads pg_hba.conf in
    the same step as it notes the new ``pg_conf_load_time()``, which every session forked
    after that step inherits: a new session that sees it changed proves it.
    """
    hba = cluster.data_dir / "pg_hba.conf"
    text = hba.read_text()
    if HBA_LINE not in text.splitlines():
        hba.write_text(text.rstrip("\n") + f"\n{HBA_LINE}\n")  # rewritten in place: same owner
    dsn = cluster.dsn()
    before = fetch(dsn, "SELECT pg_conf_load_time() AS t, pg_reload_conf()")[0]["t"]
    deadline = time.monotonic() + timeout
    while not fetch(dsn, "SELECT pg_conf_load_time() > $1 AS reloaded", before)[0]["reloaded"]:
        if time.monotonic() > deadline:
            raise NetnsError(f"PostgreSQL did not reload its configuration within {timeout}s")
        time.sleep(0.02)


# -- whether this machine can -------------------------------------------------------------


def unavailable() -> str | None:
    """Why namespaces cannot be used here, or None if they can (one is made to find out)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "network namespaces and iptables need root"
    missing = [tool for tool in ("ip", "iptables", "iptables-restore") if not shutil.which(tool)]
    if missing:
        return f"missing commands: {', '.join(missing)}"
    try:
        with Namespaces(1) as probe:
            probe.partition(0)
    except (NetnsError, OSError) as exc:
        return f"cannot make a network namespace with a cut link here: {exc}"
    return None


# -- commands ---------------------------------------------------------------------------


def _run(*command: str, stdin: str | None = None, check: bool = True) -> str:
    result = subprocess.run(
        command,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=_COMMAND_TIMEOUT,
        check=False,
    )
    if check and result.returncode != 0:
        raise NetnsError(
            f"`{' '.join(command)}` exited {result.returncode}: "
            f"{(result.stderr or result.stdout).strip()}"
        )
    return result.stdout


def _in_netns(netns: str | None, *command: str) -> tuple[str, ...]:
    return ("ip", "netns", "exec", netns, *command) if netns else command


def _create(host: NetHost) -> None:
    _run("ip", "netns", "add", host.name)
    # The peer goes straight into the namespace. No IPv6 link-local addresses: the link
    # carries IPv4 only, so nothing the rules do not see can cross it.
    _run("ip", "link", "add", host.host_if, "type", "veth",
         "peer", "name", host.ns_if, "netns", host.name)  # fmt: skip
    _run("ip", "link", "set", host.host_if, "addrgenmode", "none")
    _run("ip", "addr", "add", f"{host.host_ip}/24", "dev", host.host_if)
    _run("ip", "link", "set", host.host_if, "up")
    inside = ("ip", "-n", host.name)
    _run(*inside, "link", "set", host.ns_if, "addrgenmode", "none")
    _run(*inside, "addr", "add", f"{host.ns_ip}/24", "dev", host.ns_if)
    _run(*inside, "link", "set", host.ns_if, "up")
    _run(*inside, "link", "set", "lo", "up")
    for netns, interface in ((None, host.host_if), (host.name, host.ns_if)):
        _run(*_in_netns(netns, "iptables", "-w", "-N", host.chain))
        _run(*_in_netns(netns, "iptables", "-w", "-I", "INPUT", "-i", interface,
                        "-j", host.chain))  # fmt: skip


def _rules(host: NetHost) -> list[str]:
    """The chain's rules for the link's present state (iptables-restore syntax)."""
    if host.partitioned:
        return [f"-A {host.chain} -j DROP"]
    rules = []
    impairment = host.impairment
    if impairment.loss_pct:
        probability = impairment.loss_pct / 100
        rules.append(
            f"-A {host.chain} -m statistic --mode random --probability {probability:.6f} -j DROP"
        )
    if host.delayer is not None:
        # Bypass: were the delayer gone, packets would pass rather than vanish.
        rules.append(f"-A {host.chain} -j NFQUEUE --queue-num {host.queue} --queue-bypass")
    return rules


def _restore(chain: str, rules: list[str], netns: str | None = None) -> None:
    """Replace `chain`'s rules in one transaction."""
    text = "\n".join(["*filter", f"-F {chain}", *rules, "COMMIT", ""])
    _run(*_in_netns(netns, "iptables-restore", "-w", "--noflush"), stdin=text)


def _start_delayer(host: NetHost, impairment: Impairment) -> subprocess.Popen[bytes]:
    command = [sys.executable, str(_DELAYER), "--netns", str(host.path),
               "--queue", str(host.queue), "--delay-ms", f"{impairment.delay_ms:g}",
               "--jitter-ms", f"{impairment.jitter_ms:g}"]  # fmt: skip
    delayer = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # Ctrl-C for pytest must not drop the packets it holds
    )
    assert delayer.stdout is not None
    ready = delayer.stdout.readline()  # bounded: it binds two sockets or dies
    if ready.strip() != b"ready":
        delayer.kill()
        _, errors = delayer.communicate(timeout=5)
        raise NetnsError(f"the delay process for {host.name} failed: {errors.decode().strip()}")
    return delayer


def _remove(name: str, host_if: str, chain: str) -> None:
    """Kill what runs in the namespace, then remove the link (both ends go together), the
    namespace and the host's chain. Tolerates parts already gone."""
    pids = _run("ip", "netns", "pids", name, check=False).split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    _run("ip", "link", "delete", host_if, check=False)
    _run("ip", "netns", "delete", name, check=False)
    _run("iptables", "-w", "-D", "INPUT", "-i", host_if, "-j", chain, check=False)
    _run("iptables", "-w", "-F", chain, check=False)
    _run("iptables", "-w", "-X", chain, check=False)


# -- the host's shared state: subnets in use, leftovers of dead runs ------------------------


@contextlib.contextmanager
def _host_lock() -> Iterator[None]:
    with _HOST_LOCK.open("a") as file:
        fcntl.flock(file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(file, fcntl.LOCK_UN)


def _free_octet() -> int:
    used = set()
    for link in json.loads(_run("ip", "-j", "-4", "addr", "show") or "[]"):
        for address in link.get("addr_info", []):
            parts = str(address.get("local", "")).split(".")
            if parts[:2] == ["10", "231"]:
                used.add(int(parts[2]))
    for octet in range(1, 255):
        if octet not in used:
            return octet
    raise NetnsError("no free subnet left in 10.231.0.0/16")


def _run_is_alive(run_id: str) -> bool:
    pid = int(run_id[:6], 16)
    return pid == os.getpid() or Path(f"/proc/{pid}").exists()


def remove_stale() -> list[str]:
    """Remove namespaces, links and chains of runs whose process is gone; returns their
    names. Matches names of this rig only (``sdnet-<run>-<n>``, ``sdn<run><nn>h``,
    ``SDN-<run>-<nn>``)."""
    removed: list[str] = []
    with _host_lock():
        for entry in json.loads(_run("ip", "-j", "netns", "list") or "[]"):
            name = str(entry.get("name", ""))
            found = re.fullmatch(rf"{NETNS_PREFIX}({_RUN_ID.pattern})-(\d+)", name)
            if found and not _run_is_alive(found[1]):
                run_id, index = found[1], int(found[2])
                _remove(name, f"{LINK_PREFIX}{run_id}{index:02x}h",
                        f"{CHAIN_PREFIX}{run_id}-{index:02x}")  # fmt: skip
                removed.append(name)
        for link in json.loads(_run("ip", "-j", "link", "show") or "[]"):
            name = str(link.get("ifname", ""))
            found = re.fullmatch(rf"{LINK_PREFIX}({_RUN_ID.pattern})[0-9a-f]{{2}}h", name)
            if found and not _run_is_alive(found[1]):
                _run("ip", "link", "delete", name, check=False)
                removed.append(name)
        rules = _run("iptables", "-w", "-S").splitlines()
        for line in rules:  # jumps first: a chain still jumped to cannot be deleted
            jump = re.fullmatch(
                rf"-A INPUT -i (\S+) -j ({CHAIN_PREFIX}({_RUN_ID.pattern})-\w+)", line
            )
            if jump and not _run_is_alive(jump[3]):
                _run("iptables", "-w", "-D", "INPUT", "-i", jump[1], "-j", jump[2], check=False)
        for line in rules:
            chain = re.fullmatch(rf"-N ({CHAIN_PREFIX}({_RUN_ID.pattern})-\w+)", line)
            if chain and not _run_is_alive(chain[2]):
                _run("iptables", "-w", "-F", chain[1], check=False)
                _run("iptables", "-w", "-X", chain[1], check=False)
                removed.append(chain[1])
    if removed:
        log.info("removed leftovers of dead runs: %s", ", ".join(removed))
    return removed


def _stamp(epoch: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(epoch)) + f".{int(epoch % 1 * 1000):03d}"
