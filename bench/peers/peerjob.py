"""The one job every contestant of bench/peers.py runs, identical for all of them.

One run: insert a row into ``peer_runs`` with the process id and the database's
``clock_timestamp()``, sleep 0.2 s, update the row with the end. Beside the database,
each process appends to a file of its own (``$PEER_RUNS_DIR/<pid>.runs``) one line when
the row is in (``S token pid wall_start``) and one when the run ended (``E token pid
wall_end``), wall clock from ``time.time()``: the intervals can be checked without the
database, and a run killed mid-sleep shows as an ``S`` line with no ``E``.

Imported by our daemon (``peerjob:ours``, an async plugin target), by the APScheduler and
procrastinate peer scripts (each in its own venv, with asyncpg installed) and by the
seed-design script. Needs only the standard library and asyncpg. The job connection is
opened on the first run and kept for the life of the process (one per process, the same
for every contestant); idle processes never open it.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from typing import Any

SLEEP = 0.2
TABLE = """
CREATE TABLE IF NOT EXISTS peer_runs (
    id bigserial PRIMARY KEY,
    contestant text NOT NULL,
    pid integer NOT NULL,
    token text NOT NULL,
    wall_start double precision NOT NULL,
    started_at timestamptz NOT NULL,
    finished_at timestamptz
)
"""

# The process's job connection, by pid (a forked child must not reuse its parent's).
_connections: dict[int, Any] = {}


async def _connection() -> Any:
    import asyncpg

    pid = os.getpid()
    conn = _connections.get(pid)
    if conn is None or conn.is_closed():
        conn = await asyncpg.connect(
            os.environ["PEER_DSN"],
            server_settings={
                "application_name": f"peer-{os.environ.get('PEER_CONTESTANT', '?')}/job"
            },
        )
        _connections[pid] = conn
    return conn


def _append(line: str) -> None:
    path = os.path.join(os.environ["PEER_RUNS_DIR"], f"{os.getpid()}.runs")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


async def run_job(conn: Any | None = None) -> None:
    """One run of the job; on `conn` if given (the seed design's single connection)."""
    conn = conn or await _connection()
    token = uuid.uuid4().hex
    pid = os.getpid()
    wall_start = time.time()
    await conn.execute(
        "INSERT INTO peer_runs (contestant, pid, token, wall_start, started_at) "
        "VALUES ($1, $2, $3, $4, clock_timestamp())",
        os.environ.get("PEER_CONTESTANT", "?"),
        pid,
        token,
        wall_start,
    )
    _append(f"S {token} {pid} {wall_start:.6f}\n")
    await asyncio.sleep(SLEEP)
    await conn.execute(
        "UPDATE peer_runs SET finished_at = clock_timestamp() WHERE token = $1", token
    )
    _append(f"E {token} {pid} {time.time():.6f}\n")


async def ours(ctx: Any) -> None:
    """The plugin target for scheduler-daemon (SCHEDULER_PLUGIN__TASKS)."""
    await run_job()
