"""A TCP proxy that can cut its connections silently, for "the leader's network is gone".

``freeze()`` stops all forwarding but closes nothing: both peers keep open sockets and
simply hear nothing more, as behind a dead switch. While frozen, the proxy reads none
of its sockets (new bytes, EOFs and resets wait in the kernel; only what it had read
before still drains) and connects new clients to nothing. ``thaw()`` resumes exactly
where it stopped.

(Per BRIEF.md guarantee 6, the target's kernel still answers TCP keepalives on a
frozen proxy, so the server never sees the client as dead; only stall eviction frees
a lock held through one.)

It runs its own event loop in a background thread, so sync and async tests and other
processes can use it alike.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any, Self, TypeVar

T = TypeVar("T")

_CALL_TIMEOUT = 10.0


class TcpProxy:
    """Forwards 127.0.0.1:``port`` to ``target_host:target_port``; freeze/thaw on demand."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._links: set[_Link] = set()
        self._frozen = False  # touched only on the proxy's loop, like _links

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the proxy is not started")
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    def start(self) -> Self:
        if self._loop is not None:
            raise RuntimeError("the proxy is already started")
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="tcp-proxy", daemon=True)
        thread.start()
        self._loop, self._thread = loop, thread
        try:
            self._server = self._call(self._listen)
        except BaseException:
            self.close()
            raise
        return self

    def freeze(self) -> None:
        """Stop forwarding on every connection, current and future; returns once in effect."""
        self._call(self._set_frozen, True)

    def thaw(self) -> None:
        self._call(self._set_frozen, False)

    def close(self) -> None:
        """Close every socket, stop the loop and join the thread; safe to call twice."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        try:
            if loop.is_running():
                self._call(self._shutdown)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
            loop.close()
            self._loop = self._thread = self._server = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- on the proxy's loop ---------------------------------------------------------

    def _call(self, function: Callable[..., Coroutine[Any, Any, T]], *args: Any) -> T:
        """Run a coroutine function on the proxy's loop and wait for its result."""
        if self._loop is None:
            raise RuntimeError("the proxy is not started")
        future = asyncio.run_coroutine_threadsafe(function(*args), self._loop)
        return future.result(_CALL_TIMEOUT)

    async def _listen(self) -> asyncio.Server:
        loop = asyncio.get_running_loop()
        return await loop.create_server(lambda: _Link(self).client, "127.0.0.1", 0)

    async def _set_frozen(self, frozen: bool) -> None:
        self._frozen = frozen
        for link in list(self._links):
            link.update()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        links = list(self._links)
        for link in links:
            link.abort()
        await asyncio.gather(*(link.closed() for link in links))
        if self._server is not None:
            await self._server.wait_closed()
        # Resolving a host name ("localhost") starts the loop's default executor.
        await asyncio.get_running_loop().shutdown_default_executor()


class _Side(asyncio.Protocol):
    """One socket of a link; whatever it receives is written to the other side's socket."""

    def __init__(self, link: _Link) -> None:
        self.link = link
        self.transport: asyncio.Transport | None = None
        self.write_blocked = False  # our socket's send buffer is full: the other side waits
        self.lost = False

    @property
    def other(self) -> _Side:
        return self.link.upstream if self is self.link.client else self.link.client

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.link.side_connected(self)

    def data_received(self, data: bytes) -> None:
        # Reading is paused unless both sides are connected and the proxy is not frozen.
        assert self.other.transport is not None
        self.other.transport.write(data)

    def eof_received(self) -> bool:
        self.link.close()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.link.close()

    def pause_writing(self) -> None:
        self.write_blocked = True
        self.link.update()

    def resume_writing(self) -> None:
        self.write_blocked = False
        self.link.update()

    def set_reading(self, reading: bool) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        if reading:
            self.transport.resume_reading()
        else:
            self.transport.pause_reading()


class _Link:
    """One proxied connection: the client's socket and ours to the target.

    It stays in ``proxy._links`` from the client's arrival until both sockets are
    closed and no connection attempt is pending, which is what ``close()`` waits for.
    """

    def __init__(self, proxy: TcpProxy) -> None:
        self.proxy = proxy
        self.client = _Side(self)
        self.upstream = _Side(self)
        self._connecting: asyncio.Task[Any] | None = None
        self._closing = False
        self._gone = asyncio.get_running_loop().create_future()

    def side_connected(self, side: _Side) -> None:
        if side is self.client:
            self.proxy._links.add(self)
        if self._closing:
            self.close()  # the target answered after the client had left
        else:
            self.update()

    def update(self) -> None:
        """Apply the state: connect to the target once not frozen; read only while flowing."""
        if self._closing:
            return
        frozen = self.proxy._frozen
        if self._connecting is None and not frozen:
            # Deferred while frozen: the target sees nothing of a client arriving then.
            self._connecting = asyncio.create_task(self._connect_upstream())
            self._connecting.add_done_callback(lambda _: self._forget_if_gone())
        paired = self.upstream.transport is not None
        for side in (self.client, self.upstream):
            side.set_reading(paired and not frozen and not side.other.write_blocked)

    async def _connect_upstream(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            await loop.create_connection(
                lambda: self.upstream, self.proxy.target_host, self.proxy.target_port
            )
        except OSError:
            self.close()  # the client sees the target refuse, as it would without us

    def close(self) -> None:
        """Close both sockets once what is already buffered for them has been sent."""
        self._end(lambda transport: transport.close())

    def abort(self) -> None:
        """Close both sockets at once, dropping buffered data."""
        self._end(lambda transport: transport.abort())

    def _end(self, end: Callable[[asyncio.Transport], None]) -> None:
        self._closing = True
        if self._connecting is not None and not self._connecting.done():
            self._connecting.cancel()
        for side in (self.client, self.upstream):
            if side.transport is not None and not side.lost:
                end(side.transport)
        self._forget_if_gone()

    def _forget_if_gone(self) -> None:
        connecting = self._connecting is not None and not self._connecting.done()
        open_sides = any(
            s.transport is not None and not s.lost for s in (self.client, self.upstream)
        )
        if self._closing and not connecting and not open_sides and not self._gone.done():
            self.proxy._links.discard(self)
            self._gone.set_result(None)

    async def closed(self) -> None:
        """Wait until both sockets are closed and no connection attempt is pending."""
        await self._gone
