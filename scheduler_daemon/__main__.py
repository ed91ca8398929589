"""The entry point of ``scheduler-daemon`` and ``python -m scheduler_daemon``.

``run`` answers SIGTERM/SIGINT with a graceful stop, exit 0 (during startup at once):
its handlers are installed on the event loop (``signals.py``). Before that, while Python
imports the daemon and reads its configuration (over half a second on a small machine),
the default action would end it with the signal instead (-15, 143 in a shell): a
container stopped, or a replica scaled down, right after it started, would look crashed.
So this module, which imports nothing of the daemon's, first makes such a stop end
``run`` at once with 0; the daemon's own handlers replace that one when they start.
"""

from __future__ import annotations

import signal
import sys
from types import FrameType


def _stop_before_start(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def main() -> None:
    # The group takes no option with a value: the first word is the command.
    command = next((arg for arg in sys.argv[1:] if not arg.startswith("-")), None)
    if command == "run":
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _stop_before_start)
    from .cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
