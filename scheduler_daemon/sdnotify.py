"""systemd's notify protocol (sd_notify(3)), implemented directly.

The protocol is a datagram of newline-separated ``NAME=value`` lines sent to the
AF_UNIX socket named by ``$NOTIFY_SOCKET`` (a path, or ``@name`` for the abstract
namespace). Without ``$NOTIFY_SOCKET`` every method is a no-op, so the daemon calls them
unconditionally. What the daemon sends:

- ``READY=1`` once migrated and the loops run (``Type=notify`` waits for it);
- ``STATUS=...``, a line ``systemctl status`` shows ("leading publish, plugin", "standby");
- ``WATCHDOG=1`` every half ``$WATCHDOG_USEC``, from a task on the event loop. A blocked
  loop stops the pings, and systemd (``WatchdogSec=``) kills and restarts the process;
- ``STOPPING=1`` when the stop begins.

Sending never blocks the event loop and never raises: a lost notification is better than a
stalled scheduler, and systemd drains the socket promptly anyway.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable, Coroutine, Mapping
from types import TracebackType
from typing import Any, Self

from .errors import describe
from .logs import Logger


def notify_address(environ: Mapping[str, str]) -> str | None:
    """The socket address from ``$NOTIFY_SOCKET``; ``@name`` becomes ``\\0name`` (abstract)."""
    value = environ.get("NOTIFY_SOCKET", "")
    if value.startswith("@"):
        return "\0" + value[1:]
    return value or None


def watchdog_interval(environ: Mapping[str, str], pid: int) -> float | None:
    """Seconds between ``WATCHDOG=1`` pings: half of ``$WATCHDOG_USEC``, as sd_watchdog_enabled(3)
    advises, or None when no watchdog is asked of this process.

    ``$WATCHDOG_PID``, when set, names the process the watchdog is meant for; a process
    that merely inherited the variables (a child of the service) must not ping.
    """
    usec = environ.get("WATCHDOG_USEC", "").strip()
    owner = environ.get("WATCHDOG_PID", "").strip()
    if not usec or (owner and owner != str(pid)):
        return None
    try:
        value = int(usec)
    except ValueError:
        return None
    return value / 2_000_000 if value > 0 else None


class Notifier:
    """Sends notifications to systemd; owns the watchdog and status tasks while entered."""

    def __init__(self, address: str | None, watchdog_interval: float | None, log: Logger) -> None:
        self.address = address
        self.watchdog_interval = watchdog_interval
        self.log = log
        self._socket: socket.socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._last_status: str | None = None
        self._failing = False

    @classmethod
    def from_environ(
        cls, log: Logger, environ: Mapping[str, str] | None = None, pid: int | None = None
    ) -> Notifier:
        environ = os.environ if environ is None else environ
        pid = os.getpid() if pid is None else pid
        address = notify_address(environ)
        if address is not None and not address.startswith(("/", "\0")):
            # e.g. systemd's newer vsock:CID:PORT form, which needs AF_VSOCK.
            log.warning("sdnotify.unsupported_address", address=address)
            address = None
        interval = watchdog_interval(environ, pid) if address else None
        return cls(address, interval, log)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    async def __aenter__(self) -> Self:
        if self.address is None:
            return self
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        sock.setblocking(False)
        self._socket = sock
        if self.watchdog_interval is not None:
            self._spawn(self._watchdog(self.watchdog_interval), "sdnotify:watchdog")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    # -- messages ----------------------------------------------------------------------

    def send(self, *assignments: str) -> bool:
        """Send ``NAME=value`` lines as one datagram; False if nothing was delivered."""
        sock, address = self._socket, self.address
        if sock is None or address is None:
            return False
        try:
            sock.sendto("\n".join(assignments).encode(), address)
        except OSError as exc:  # no listener, queue full (EAGAIN), ...
            if not self._failing:  # once per outage, not once per watchdog ping
                self.log.warning("sdnotify.send_failed", error=describe(exc))
            self._failing = True
            return False
        self._failing = False
        return True

    def ready(self, status: str) -> None:
        self._last_status = status
        self.send("READY=1", f"STATUS={status}")

    def status(self, text: str) -> None:
        """Set the status line; repeating the current one sends nothing."""
        if text != self._last_status:
            self._last_status = text
            self.send(f"STATUS={text}")

    def stopping(self) -> None:
        self._last_status = "stopping"
        self.send("STOPPING=1", "STATUS=stopping")

    def watch_status(self, source: Callable[[], str], every: float) -> None:
        """Refresh the status line from ``source()`` every ``every`` seconds while entered."""
        if self._socket is not None:
            self._spawn(self._refresh_status(source, every), "sdnotify:status")

    # -- tasks ---------------------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        self._tasks.append(asyncio.create_task(coro, name=name))

    async def _watchdog(self, interval: float) -> None:
        while True:
            self.send("WATCHDOG=1")
            await asyncio.sleep(interval)

    async def _refresh_status(self, source: Callable[[], str], every: float) -> None:
        while True:
            await asyncio.sleep(every)
            self.status(source())
