"""systemd's notify protocol: parsing the environment, the datagrams, and a real daemon
process talking to a real AF_UNIX datagram socket the way it would talk to systemd."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import secrets
import signal
import socket
import struct
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from rig.processes import Daemons
from structlog.testing import capture_logs

from scheduler_daemon.logs import get_logger
from scheduler_daemon.sdnotify import Notifier, notify_address, watchdog_interval

# -- the environment ----------------------------------------------------------------------


def test_notify_address() -> None:
    assert notify_address({}) is None
    assert notify_address({"NOTIFY_SOCKET": ""}) is None
    assert notify_address({"NOTIFY_SOCKET": "/run/systemd/notify"}) == "/run/systemd/notify"
    assert notify_address({"NOTIFY_SOCKET": "@abstract/name"}) == "\0abstract/name"


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, None),
        ({"WATCHDOG_USEC": "400000"}, 0.2),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "4242"}, 15.0),
        # Inherited from a parent that is the watched process: not ours to feed.
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
    ],
)
def test_watchdog_interval(environ: dict[str, str], expected: float | None) -> None:
    assert watchdog_interval(environ, pid=4242) == expected


async def test_unset_notify_socket_is_a_no_op() -> None:
    notifier = Notifier.from_environ(get_logger(), environ={"WATCHDOG_USEC": "400000"}, pid=1)
    assert not notifier.enabled
    assert notifier.watchdog_interval is None
    async with notifier:
        assert notifier.send("READY=1") is False
        notifier.ready("standby")
        notifier.watch_status(lambda: "x", every=0.01)
        notifier.stopping()
        assert not notifier._tasks


def test_unsupported_address_disables_with_a_warning() -> None:
    with capture_logs() as events:
        notifier = Notifier.from_environ(get_logger(), environ={"NOTIFY_SOCKET": "vsock:2:9"})
    assert not notifier.enabled
    assert [e["event"] for e in events] == ["sdnotify.unsupported_address"]


# -- a receiving socket ---------------------------------------------------------------------


@dataclass(frozen=True)
class Message:
    at: float
    pid: int
    fields: tuple[str, ...]


class NotifySocket:
    """The systemd end: an AF_UNIX datagram socket that records who sent what, and when.

    SO_PASSCRED makes the kernel attach the sender's pid to each datagram: the same check
    systemd makes for ``NotifyAccess=main``.
    """

    def __init__(self, address: str) -> None:
        self.address = address
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind(address)
        self.messages: list[Message] = []

    @property
    def env_value(self) -> str:
        return "@" + self.address[1:] if self.address.startswith("\0") else self.address

    def receive(self, timeout: float) -> Message | None:
        self.sock.settimeout(timeout)
        try:
            data, ancillary, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(12))
        except TimeoutError:
            return None
        pid = -1
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                pid, _, _ = struct.unpack("3i", payload[:12])
        message = Message(time.monotonic(), pid, tuple(data.decode().split("\n")))
        self.messages.append(message)
        return message

    def wait_for(self, field: str, timeout: float) -> Message:
        deadline = time.monotonic() + timeout
        while (remaining := deadline - time.monotonic()) > 0:
            message = self.receive(remaining)
            if message is not None and field in message.fields:
                return message
        raise AssertionError(f"no {field!r} within {timeout}s; got {self.messages}")

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def abstract_socket() -> Iterator[NotifySocket]:
    sock = NotifySocket(f"\0scheduler-daemon-test-{secrets.token_hex(6)}")
    yield sock
    sock.close()


@pytest.fixture
def path_socket() -> Iterator[NotifySocket]:
    # sun_path holds 107 bytes: pytest's tmp_path can be longer than that.
    with tempfile.TemporaryDirectory(prefix="sdn-") as directory:
        sock = NotifySocket(str(Path(directory) / "notify"))
        yield sock
        sock.close()


async def receive(sock: NotifySocket, within: float = 2.0) -> Message:
    message = await asyncio.to_thread(sock.receive, within)
    assert message is not None, f"nothing received; so far {sock.messages}"
    return message


async def test_messages_on_an_abstract_socket(abstract_socket: NotifySocket) -> None:
    environ = {"NOTIFY_SOCKET": abstract_socket.env_value}
    notifier = Notifier.from_environ(get_logger(), environ=environ)
    async with notifier:
        notifier.ready("standby")
        assert (await receive(abstract_socket)).fields == ("READY=1", "STATUS=standby")
        notifier.status("standby")  # unchanged: nothing sent
        notifier.status("leading publish")
        assert (await receive(abstract_socket)).fields == ("STATUS=leading publish",)
        notifier.stopping()
        assert (await receive(abstract_socket)).fields == ("STOPPING=1", "STATUS=stopping")
    assert [m.pid for m in abstract_socket.messages] == [os.getpid()] * 3


async def test_watchdog_and_status_tasks_run_until_exit(abstract_socket: NotifySocket) -> None:
    environ = {"NOTIFY_SOCKET": abstract_socket.env_value, "WATCHDOG_USEC": "100000"}
    notifier = Notifier.from_environ(get_logger(), environ=environ)
    statuses = iter(["a", "a", "b"])
    async with notifier:
        notifier.watch_status(lambda: next(statuses, "b"), every=0.02)
        received = [await receive(abstract_socket) for _ in range(5)]
        tasks = list(notifier._tasks)
    assert all(task.done() for task in tasks)
    fields = [m.fields for m in received]
    assert fields.count(("WATCHDOG=1",)) >= 3
    assert [f for f in fields if f[0].startswith("STATUS=")] == [("STATUS=a",), ("STATUS=b",)]


async def test_send_failure_is_logged_once_and_never_raises(tmp_path: Path) -> None:
    environ = {"NOTIFY_SOCKET": str(tmp_path / "nobody-listens")}
    with capture_logs() as events:
        notifier = Notifier.from_environ(get_logger(), environ=environ)
        async with notifier:
            assert notifier.send("WATCHDOG=1") is False
            assert notifier.send("WATCHDOG=1") is False
    assert [e["event"] for e in events] == ["sdnotify.send_failed"]


# -- a real daemon process ------------------------------------------------------------------


def test_daemon_process_notifies_systemd(
    daemons: Daemons, sqlite_url: str, path_socket: NotifySocket
) -> None:
    daemon = daemons.start(
        {
            "SCHEDULER_DATABASE_URL": sqlite_url,
            "SCHEDULER_HTTP__ENABLED": "true",
            "SCHEDULER_HTTP__PORT": "0",
            "NOTIFY_SOCKET": path_socket.env_value,
            "WATCHDOG_USEC": "400000",
        }
    )
    ready = path_socket.wait_for("READY=1", timeout=30)
    leading = path_socket.wait_for("STATUS=leading publish, plugin", timeout=10)
    # A second of watchdog pings after READY=1, one every WATCHDOG_USEC/2 = 0.2s.
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        path_socket.receive(deadline - time.monotonic())
    pings = [m.at for m in path_socket.messages if m.fields == ("WATCHDOG=1",) and m.at > ready.at]
    assert len(pings) >= 4, path_socket.messages
    gaps = [b - a for a, b in itertools.pairwise(pings)]
    assert max(gaps) < 0.4, gaps  # well inside WATCHDOG_USEC

    # The HTTP endpoints are up in the same process.
    port = daemon.wait_for_log("http.started", timeout=5)["port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as response:
        assert response.status == 200
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5) as response:
        report = json.load(response)
    # The summary /status serves by default names instances, never pids.
    assert report["loops"]["publish"]["leader"]["instance"] == report["replica"]["instance"]
    assert report["replica"]["loops"] == {"publish": "leader", "plugin": "leader"}

    daemon.signal(signal.SIGTERM)
    stopping = path_socket.wait_for("STOPPING=1", timeout=10)
    assert daemon.wait(30) == 0

    messages = path_socket.messages
    at = messages.index
    assert at(ready) <= at(leading) < at(stopping)  # the leading status may come with READY
    assert [m for m in messages if "READY=1" in m.fields] == [ready]
    assert stopping.fields == ("STOPPING=1", "STATUS=stopping")
    # NotifyAccess=main: every datagram came from the daemon's own pid.
    assert {m.pid for m in path_socket.messages} == {daemon.pid}
