"""Work done *outside* the database, recorded by wall clock: the test suite's probe.

Each run of a probe appends JSON lines to the file named by ``$EFFECTS_LOG``: a
``start``, a ``beat`` every ~10 ms while it works, and an ``end`` (``cancelled`` when it
was stopped). A run killed outright (SIGKILL) leaves no end; its last beat says, within
10 ms, when it stopped. Every line carries the instance, the process id and the fencing
token (and a plugin run's shard), so a checker (tests/rig/effects.py) can prove that no
two replicas worked at once and that the tokens never went backwards — with records that
exist whether or not any database transaction committed.

Three shapes of work, as users write them: an async target, a sync target (which the
daemon runs in a worker process), a sync target that ignores cancellation, and a Python
publisher. ``$EFFECTS_SECONDS`` says how long a plugin run works (default 0.3 s),
``$EFFECTS_PUBLISH_SECONDS`` how long a publisher batch does (default 0.05 s).

Standard library only: it runs inside daemons and worker processes.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import Sequence
from typing import Any

BEAT = 0.01


def _seconds(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


class Recorder:
    """One run's records. One ``write()`` per line with O_APPEND: lines from many
    processes never interleave."""

    def __init__(self, loop: str, kind: str, instance: str, token: int | None, **extra: Any):
        self.base = {
            "run": uuid.uuid4().hex,
            "loop": loop,
            "kind": kind,
            "instance": instance,
            "token": token,
            "pid": os.getpid(),
            **extra,
        }

    def write(self, event: str) -> None:
        line = json.dumps(self.base | {"event": event, "t": time.time()}) + "\n"
        fd = os.open(os.environ["EFFECTS_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


def _recorder(ctx: Any, kind: str) -> Recorder:
    # ``ctx.shard``: the run's shard with sharded leadership (its token is that shard's),
    # None with one plugin leader (and on a daemon that predates shards).
    return Recorder("plugin", kind, ctx.instance, ctx.fencing_token, task=ctx.name,
                    slot=ctx.slot.isoformat(), shard=getattr(ctx, "shard", None))  # fmt: skip


async def _work(record: Recorder, seconds: float, ctx: Any = None) -> None:
    """Beat for `seconds` on the event loop; a cancellation ends the run, recorded. Given
    `ctx`, check ``ctx.leading`` right before each beat, as a careful target checks it
    before each external write, and stop (recorded) once it is false."""
    record.write("start")
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            await asyncio.sleep(BEAT)
            if ctx is not None and not ctx.leading:
                record.write("stood_down")
                return
            record.write("beat")
    except asyncio.CancelledError:
        record.write("cancelled")
        raise
    record.write("end")


async def probe_async(ctx: Any) -> None:
    """An async target that works for $EFFECTS_SECONDS."""
    await _work(_recorder(ctx, "async"), _seconds("EFFECTS_SECONDS", 0.3))


async def probe_async_checked(ctx: Any) -> None:
    """probe_async, checking ``ctx.leading`` before each beat."""
    await _work(_recorder(ctx, "async_checked"), _seconds("EFFECTS_SECONDS", 0.3), ctx)


async def probe_async_stubborn(ctx: Any) -> None:
    """An async target that swallows cancellation and works on: a bug, which the daemon
    answers by exiting rather than letting its lock go while this runs."""
    record = _recorder(ctx, "async_stubborn")
    record.write("start")
    deadline = time.monotonic() + _seconds("EFFECTS_SECONDS", 0.3)
    while time.monotonic() < deadline:
        try:
            await asyncio.sleep(BEAT)
        except asyncio.CancelledError:
            record.write("swallowed")
        record.write("beat")
    record.write("end")


def probe_sync(ctx: Any) -> None:
    """A sync target that works for $EFFECTS_SECONDS and honours ``ctx.cancelled``."""
    record = _recorder(ctx, "sync")
    record.write("start")
    deadline = time.monotonic() + _seconds("EFFECTS_SECONDS", 0.3)
    while time.monotonic() < deadline:
        if ctx.cancelled.wait(BEAT):
            record.write("cancelled")
            return
        record.write("beat")
    record.write("end")


def probe_sync_stubborn(ctx: Any) -> None:
    """The worst a plugin can do: a sync target that never looks at ``ctx.cancelled``."""
    record = _recorder(ctx, "sync_stubborn")
    record.write("start")
    deadline = time.monotonic() + _seconds("EFFECTS_SECONDS", 0.3)
    while time.monotonic() < deadline:
        time.sleep(BEAT)
        record.write("beat")
    record.write("end")


class EffectsPublisher:
    """A Python publisher (entry point ``effects``) whose batches take
    $EFFECTS_PUBLISH_SECONDS of outside work, with the transaction's fencing token."""

    name = "effects"

    def __init__(self, settings: Any) -> None:
        self.instance = settings.instance_id

    async def publish(self, tx: Any, rows: Sequence[Any]) -> None:
        record = Recorder("publish", "publisher", self.instance, tx.fencing_token,
                          ids=[row.id for row in rows], keys=[row.key for row in rows])  # fmt: skip
        await _work(record, _seconds("EFFECTS_PUBLISH_SECONDS", 0.05))
