"""Plugin task targets for the tests, importable as ``plugin_targets:NAME``.

pytest puts ``tests/`` on ``sys.path`` (rootdir conftest, ``prepend`` import mode), so an
in-process daemon imports these directly; a daemon process needs ``PYTHONPATH=tests``
(see ``TARGETS_ENV``).

In-process targets append to :data:`CALLS`; targets that must leave evidence from
another process (or from a leader that may be killed) write through
``ctx.transaction()``, the fenced transaction of the plugin leader.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from scheduler_daemon.db.base import Tx
from scheduler_daemon.db.sqlite import SqliteTx
from scheduler_daemon.plugins.context import TaskContext

TESTS_DIR = Path(__file__).resolve().parent
TARGETS_ENV = {"PYTHONPATH": str(TESTS_DIR)}

PROBE_TABLE = "plugin_probe"
PROBE_DDL = (
    f"CREATE TABLE {PROBE_TABLE} (name text NOT NULL, slot_text text NOT NULL, "
    "instance text NOT NULL, at_text text NOT NULL)"
)


@dataclass(frozen=True)
class Call:
    kind: str  # which target
    name: str | None
    slot: datetime | None
    pid: int  # the daemon's own, or a worker process's (sync targets)
    thread: str
    in_task: bool  # ran as (part of) an asyncio task: on the event loop


CALLS: list[Call] = []
# Sync targets run in worker processes, where CALLS is another process's list: they also
# append their calls to this file, when the environment names one (see `calls()`).
CALLS_FILE_ENV = "PLUGIN_CALLS_FILE"


def _record(kind: str, ctx: TaskContext | None) -> None:
    try:
        in_task = asyncio.current_task() is not None
    except RuntimeError:  # no running loop in this thread
        in_task = False
    call = Call(
        kind,
        ctx.name if ctx else None,
        ctx.slot if ctx else None,
        os.getpid(),
        threading.current_thread().name,
        in_task,
    )
    CALLS.append(call)
    if path := os.environ.get(CALLS_FILE_ENV):
        entry = asdict(call) | {"slot": call.slot.isoformat() if call.slot else None}
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(entry) + "\n").encode())
        finally:
            os.close(fd)


def calls() -> list[Call]:
    """Every call so far, of this process and of its workers (by the file, if named)."""
    path = os.environ.get(CALLS_FILE_ENV)
    if not path or not os.path.exists(path):
        return list(CALLS)
    recorded = []
    with open(path) as lines:
        for line in lines:
            entry = json.loads(line)
            slot = datetime.fromisoformat(entry["slot"]) if entry["slot"] else None
            recorded.append(Call(**entry | {"slot": slot}))
    return recorded


async def tick(ctx: TaskContext) -> None:
    _record("async", ctx)


def tick_sync(ctx: TaskContext) -> None:
    _record("sync", ctx)


def no_context() -> None:
    """A target without parameters is called without the context."""
    _record("no_context", None)


async def fail(ctx: TaskContext) -> None:
    raise RuntimeError(f"boom for {ctx.name}")


def fail_sync(ctx: TaskContext) -> None:
    raise ValueError("sync boom")


async def raise_timeout_error(ctx: TaskContext) -> None:
    """Fails with TimeoutError of its own (an HTTP client's, say), well within its timeout."""
    raise TimeoutError("upstream did not answer")


async def hang(ctx: TaskContext) -> None:
    _record("hang", ctx)
    await asyncio.sleep(3600)


def hang_sync(ctx: TaskContext) -> None:
    """Blocks its thread until told to stop: a sync target cannot be cancelled."""
    _record("hang_sync", ctx)
    while not ctx.cancelled.wait(0.02):
        pass
    _record("hang_sync_saw_cancel", ctx)


async def slow(ctx: TaskContext) -> None:
    """Longer than the period the tests give it: the slots in between overlap."""
    _record("slow", ctx)
    await asyncio.sleep(1.5)


#: (name, args) of each run of `record_args` in this process (an in-process daemon's).
ARGS: list[tuple[str, dict[str, Any]]] = []
SLOT_ARGS: list[tuple[str, datetime, dict[str, Any]]] = []


async def record_args(ctx: TaskContext) -> None:
    """Records the arguments its schedule handed it: a runtime schedule's row's ``args``
    (and in ``SLOT_ARGS``, the slot they ran for)."""
    ARGS.append((ctx.name, dict(ctx.args)))
    SLOT_ARGS.append((ctx.name, ctx.slot, dict(ctx.args)))


def _placeholders(tx: Tx, count: int) -> str:
    mark = "?" if isinstance(tx, SqliteTx) else "$"
    return ", ".join(f"{mark}{n}" for n in range(1, count + 1))


async def probe(ctx: TaskContext) -> None:
    """Insert (name, slot, instance, the database's clock) into plugin_probe, in the fenced
    transaction. Times as ISO text (UTC, fixed width), so both backends store them alike."""
    async with ctx.transaction() as tx:
        clock = "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')" if isinstance(tx, SqliteTx) else None
        if clock is None:
            clock = (
                "to_char(clock_timestamp() AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')"
            )
        await tx.run(
            f"INSERT INTO {PROBE_TABLE} (name, slot_text, instance, at_text) "
            f"VALUES ({_placeholders(tx, 3)}, {clock})",
            ctx.name,
            ctx.slot.isoformat(),
            ctx.instance,
        )


async def probe_slowly(ctx: TaskContext) -> None:
    """A probe that takes most of a second: a leader killed now is killed mid-run."""
    await asyncio.sleep(0.4)
    await probe(ctx)
    await asyncio.sleep(0.3)


async def pause_in_transaction(ctx: TaskContext) -> None:
    """Probe, then await something else for 4 s inside the same fenced transaction (an API
    call, say), then probe again: longer than the tests' stall_timeout of 3 s."""
    async with ctx.transaction() as tx:
        await tx.run(f"INSERT INTO {PROBE_TABLE} (name, slot_text, instance, at_text) "
                     f"VALUES ({_placeholders(tx, 3)}, 'before')", ctx.name, "s", ctx.instance)  # fmt: skip
        await asyncio.sleep(4.0)
        await tx.run(f"INSERT INTO {PROBE_TABLE} (name, slot_text, instance, at_text) "
                     f"VALUES ({_placeholders(tx, 3)}, 'after')", ctx.name, "s", ctx.instance)  # fmt: skip


def declarations() -> list[dict[str, Any]]:
    """An entry point's provider (tests register it with a fake distribution)."""
    return [{"name": "ep.tick", "every": "1s", "target": tick}]


def bad_schedule() -> list[dict[str, Any]]:
    return [{"name": "ep.bad", "every": "soon", "target": tick}]


def both_actions() -> list[dict[str, Any]]:
    return [{"name": "ep.both", "every": "1s", "target": tick, "sql": "SELECT 1"}]


def unknown_key() -> list[dict[str, Any]]:
    return [{"name": "ep.typo", "every": "1s", "target": tick, "timout": "5s"}]


def broken_provider() -> list[dict[str, Any]]:
    raise RuntimeError("the plugin could not read its own settings")


def not_a_mapping() -> list[Any]:
    return ["ep.tick"]


def block_forever(ctx: TaskContext) -> None:
    """A sync target that ignores ``ctx.cancelled``: the worst a plugin can do. It runs in
    a worker process; ``$BLOCK_PID_FILE``, if set, receives that process's pid."""
    if path := os.environ.get("BLOCK_PID_FILE"):
        Path(path).write_text(str(os.getpid()))
    threading.Event().wait()


#: Runs of `gated` wait for this event: a test of an in-process daemon sets a new one
#: (monkeypatch), and says when its runs end by setting it.
GATE: asyncio.Event | None = None


async def gated(ctx: TaskContext) -> None:
    """A run that lasts until the test opens :data:`GATE`."""
    _record("gated", ctx)
    assert GATE is not None, "the test sets plugin_targets.GATE to an asyncio.Event"
    await GATE.wait()


async def brief(ctx: TaskContext) -> None:
    """A short run (``args.seconds``, default 0.1 s), recorded with its args."""
    _record(f"brief:{json.dumps(ctx.args, sort_keys=True)}", ctx)
    await asyncio.sleep(float(ctx.args.get("seconds", 0.1)))


def brief_sync(ctx: TaskContext) -> None:
    """:func:`brief`'s record, from a worker process: args cross the process boundary."""
    _record(f"brief_sync:{json.dumps(ctx.args, sort_keys=True)}", ctx)
