"""SIGTERM/SIGINT handling: the first asks for a graceful stop, the second forces one.

Installed on the running event loop for the daemon's lifetime and removed afterwards,
so the previous behaviour (e.g. KeyboardInterrupt in a REPL) comes back.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager

HANDLED = (signal.SIGTERM, signal.SIGINT)


@contextmanager
def stop_on_signals(
    graceful: Callable[[signal.Signals], None], force: Callable[[signal.Signals], None]
) -> Iterator[None]:
    loop = asyncio.get_running_loop()
    received: list[signal.Signals] = []

    def handle(sig: signal.Signals) -> None:
        received.append(sig)
        (graceful if len(received) == 1 else force)(sig)

    for sig in HANDLED:
        loop.add_signal_handler(sig, handle, sig)
    try:
        yield
    finally:
        for sig in HANDLED:
            loop.remove_signal_handler(sig)
