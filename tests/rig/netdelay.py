"""Delay (and jitter) for the packets arriving on a link, in a process of its own.

``tc netem`` is the usual tool, but it is a kernel option that not every kernel has (this
machine's has ``CONFIG_NET_SCH_NETEM`` unset). Netfilter's queue is nearly always there:
an iptables rule hands each arriving packet to this process (``NFQUEUE``), which gives it
back to the kernel (``NF_ACCEPT``) once its delay is over. The packet is only held, never
copied or forwarded, so TCP on both sides sees what it sees on a slow link: late ACKs,
retransmissions, reordering with jitter. Loss needs no help (iptables' ``statistic``).

One process serves one link: queue ``--queue`` in the host's namespace (packets the host
receives from the link) and the same queue number inside the replica's namespace
(packets the replica receives), so each direction is delayed once, as netem on both veth
ends would. It prints ``ready`` once both queues are bound, releases every held packet at
once on SIGTERM, and exits by itself when its parent dies (a killed test run leaves no
process behind).

Standard library only (netlink through a raw socket), run as a script:
``python netdelay.py --netns /run/netns/NAME --queue N --delay-ms D [--jitter-ms J]``.
The rig imports :func:`entered` from it too.
"""

from __future__ import annotations

import argparse
import ctypes
import heapq
import os
import random
import select
import signal
import socket
import struct
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CLONE_NEWNET = 0x40000000
NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET = 0
NFQNL_MSG_VERDICT = 1
NFQNL_MSG_CONFIG = 2
NFQA_PACKET_HDR = 1
NFQA_VERDICT_HDR = 2
NFQA_CFG_CMD = 1
NFQA_CFG_PARAMS = 2
NFQA_CFG_QUEUE_MAXLEN = 3
NFQA_CFG_MASK = 4
NFQA_CFG_FLAGS = 5
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
# Fail open: past maxlen the kernel passes packets rather than dropping them (loss is
# asked for separately); GSO: whole segments come to us, nothing is split for our sake.
NFQA_CFG_F_FAIL_OPEN = 1
NFQA_CFG_F_GSO = 4
NF_ACCEPT = 1
NLMSG_ERROR = 2
NLM_F_REQUEST = 1
NLM_F_ACK = 4
_NLMSG = struct.Struct("=IHHII")
_NFGEN = struct.Struct("=BBH")
_NLA = struct.Struct("=HH")
_ALIGN = 4


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"setns: {os.strerror(errno)}")


@contextmanager
def entered(netns: Path) -> Iterator[None]:
    """Run this thread inside the network namespace at `netns` (``/run/netns/NAME``).

    Sockets created meanwhile belong to that namespace for good, so a test can hold one
    end of a TCP stream inside a replica's namespace. Only the calling thread moves, and
    it moves back on leaving, whatever happened inside.
    """
    with Path("/proc/thread-self/ns/net").open() as home, netns.open() as target:
        _setns(target.fileno())
        try:
            yield
        finally:
            _setns(home.fileno())


def _attr(kind: int, payload: bytes) -> bytes:
    raw = _NLA.pack(_NLA.size + len(payload), kind) + payload
    return raw + b"\0" * (-len(raw) % _ALIGN)


def _message(kind: int, flags: int, queue: int, attrs: bytes, seq: int = 0) -> bytes:
    body = _NFGEN.pack(socket.AF_UNSPEC, 0, socket.htons(queue)) + attrs
    return (
        _NLMSG.pack(_NLMSG.size + len(body), (NFNL_SUBSYS_QUEUE << 8) | kind, flags, seq, 0) + body
    )


def _messages(data: bytes) -> Iterator[tuple[int, bytes]]:
    offset = 0
    while offset + _NLMSG.size <= len(data):
        length, kind, _flags, _seq, _pid = _NLMSG.unpack_from(data, offset)
        if length < _NLMSG.size:
            return
        yield kind, data[offset + _NLMSG.size : offset + length]
        offset += length + (-length % _ALIGN)


def _attrs(payload: bytes) -> dict[int, bytes]:
    found: dict[int, bytes] = {}
    offset = _NFGEN.size
    while offset + _NLA.size <= len(payload):
        length, kind = _NLA.unpack_from(payload, offset)
        if length < _NLA.size:
            break
        found[kind & 0x3FFF] = payload[offset + _NLA.size : offset + length]
        offset += length + (-length % _ALIGN)
    return found


def bind_queue(queue: int) -> socket.socket:
    """A netlink socket bound to netfilter queue `queue` of the current namespace."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.setsockopt(socket.SOL_SOCKET, 33, 8 << 20)  # SO_RCVBUFFORCE: a burst never overflows
    sock.bind((0, 0))
    flags = NFQA_CFG_F_FAIL_OPEN | NFQA_CFG_F_GSO
    attrs = (
        _attr(NFQA_CFG_CMD, struct.pack("!BxH", NFQNL_CFG_CMD_BIND, socket.AF_INET))
        + _attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META))
        + _attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", 10_000))
        + _attr(NFQA_CFG_MASK, struct.pack("!I", flags))
        + _attr(NFQA_CFG_FLAGS, struct.pack("!I", flags))
    )
    sock.send(_message(NFQNL_MSG_CONFIG, NLM_F_REQUEST | NLM_F_ACK, queue, attrs, seq=1))
    for kind, payload in _messages(sock.recv(65536)):
        if kind == NLMSG_ERROR:
            (error,) = struct.unpack_from("=i", payload)
            if error:
                sock.close()
                raise OSError(-error, f"binding netfilter queue {queue}: {os.strerror(-error)}")
    return sock


class Delayer:
    """Holds each queued packet for delay ± jitter (uniform, as netem without a
    distribution table), then accepts it."""

    def __init__(self, queue: int, delay: float, jitter: float, rng: random.Random) -> None:
        self.queue = queue
        self.delay = delay
        self.jitter = jitter
        self.rng = rng
        self.held: list[tuple[float, int, socket.socket, int]] = []
        self.count = 0

    def receive(self, sock: socket.socket) -> None:
        now = time.monotonic()
        for kind, payload in _messages(sock.recv(1 << 16)):
            if kind != (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
                continue
            header = _attrs(payload).get(NFQA_PACKET_HDR)
            if header is None:
                continue
            (packet_id,) = struct.unpack_from("!I", header)
            wait = max(0.0, self.delay + self.rng.uniform(-self.jitter, self.jitter))
            self.count += 1
            heapq.heappush(self.held, (now + wait, self.count, sock, packet_id))

    def release(self, everything: bool = False) -> float | None:
        """Accept what is due (or everything); the seconds until the next one is."""
        now = time.monotonic()
        while self.held and (everything or self.held[0][0] <= now):
            _, _, sock, packet_id = heapq.heappop(self.held)
            verdict = _attr(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, packet_id))
            sock.send(_message(NFQNL_MSG_VERDICT, NLM_F_REQUEST, self.queue, verdict))
        return self.held[0][0] - now if self.held else None


def serve(netns: Path, queue: int, delay: float, jitter: float, seed: int | None) -> None:
    parent = os.getppid()
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stopping.append(signum))
    sockets = [bind_queue(queue)]
    with entered(netns):
        sockets.append(bind_queue(queue))
    delayer = Delayer(queue, delay, jitter, random.Random(seed))
    print("ready", flush=True)
    while not stopping and os.getppid() == parent:
        due = delayer.release()
        timeout = 0.1 if due is None else min(0.1, due)
        try:
            readable, _, _ = select.select(sockets, [], [], timeout)
        except InterruptedError:
            continue
        for sock in readable:
            delayer.receive(sock)
    # Whatever is still held goes on now: a cleared link must not swallow packets.
    delayer.release(everything=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--netns", type=Path, required=True)
    parser.add_argument("--queue", type=int, required=True)
    parser.add_argument("--delay-ms", type=float, required=True)
    parser.add_argument("--jitter-ms", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    serve(args.netns, args.queue, args.delay_ms / 1000, args.jitter_ms / 1000, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
