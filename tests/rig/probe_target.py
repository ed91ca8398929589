"""A Python plugin task for leadership tests (loaded by the daemon as ``rig.probe_target:probe``).

Records one wall-clock interval per run, as a JSON line appended to ``$PROBE_LOG``, so
that work done outside any database transaction can be checked for overlap too (on
SQLite the database serialises writers by itself and would hide a second leader).
Standard library only: it is imported inside the daemon process.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any


async def probe(ctx: Any) -> None:
    start = time.time()
    await asyncio.sleep(float(os.environ.get("PROBE_SLEEP", "0.05")))
    end = time.time()
    line = json.dumps({"instance": ctx.instance, "start": start, "end": end}) + "\n"
    # One write() with O_APPEND: lines from several processes never interleave.
    fd = os.open(os.environ["PROBE_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
