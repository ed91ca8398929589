"""TCP ports for the rig's servers, and ports where nothing listens."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that was free a moment ago: bound, then closed again. Nothing
    listens there now (connecting is refused), and a server of the rig may take it."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
        return port
