"""The grants a PostgreSQL role needs to run the loops, checked before they start.

Unchecked, a missing grant shows only once a loop first needs it: a ``loop.db_error``
warning ("permission denied for table scheduler_leaders") repeated every few seconds by a
replica that looks started and never leads. Checked by ``run`` and ``preflight`` after
migrating, it is one line and exit 78 that names every missing grant as the GRANT
statement that fixes it.

What is needed follows from the SQL the loops run (db/postgres.sql), per enabled feature;
docs/security.md lists the same grants (its tests run them verbatim). Advisory locks,
LISTEN/NOTIFY, ``pg_locks``, ``application_name`` in ``pg_stat_activity`` and the settings
the lock sessions make for themselves (``idle_session_timeout``, keepalives, …) need none.
A session-mode standby waits through the procedure ``scheduler_wait_for_lock`` (migration
0010): PUBLIC may EXECUTE it unless an operator revoked that, so it is checked too. The
run history's upkeep (``scheduler_runs_maintain``, 0012) is not PUBLIC's: it is granted.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection

import asyncpg

from ..errors import PrivilegeRefused
from .sqlfiles import queries

QUERIES = queries("postgres")

# (kind, object) -> privileges; kind is "table", "sequence", "procedure" (its signature) or
# "function" (its name, which is unique).
Grants = dict[tuple[str, str], set[str]]

_ORDER = ("SELECT", "INSERT", "UPDATE", "DELETE", "USAGE", "EXECUTE")

# The standby's wait and a sharded member's watch (db/postgres.sql lock_wait, shard_watch).
WAIT_PROCEDURES = (
    "scheduler_wait_for_lock(bigint, integer)",
    "scheduler_wait_for_lock(integer, integer, integer)",
)


# Session mode's fences on pooled connections: a loop's (migration 0015,
# leadership/session_lease.py) and a sharded member's (migration 0016, shard_lease.py).
FENCE_FUNCTIONS = ("scheduler_fence", "scheduler_fence_shards")

# The run history's upkeep (migration 0012), run by the built-in purge_runs: it makes and
# drops partitions as the tables' owner (SECURITY DEFINER), and only granted roles may call it.
RUNS_UPKEEP_FUNCTION = "scheduler_runs_maintain"


def required_grants(
    loops: Collection[str], *, session: bool, webhook: bool, purge: bool, purge_runs: bool
) -> Grants:
    """What the enabled ``loops`` need: ``session`` lock mode (else transaction), the
    ``webhook`` publisher, the built-in tasks ``purge_publications`` (``purge``) and
    ``purge_runs``."""
    need: Grants = defaultdict(set)

    def grant(name: str, *privileges: str, kind: str = "table") -> None:
        need[(kind, name)].update(privileges)

    # Every command reads the schema version; `status` and /status the backlog.
    grant("scheduler_schema_version", "SELECT")
    grant("scheduler_publications", "SELECT")
    if loops and session:
        for procedure in WAIT_PROCEDURES:
            grant(procedure, "EXECUTE", kind="procedure")
        for function in FENCE_FUNCTIONS:
            grant(function, "EXECUTE", kind="function")
    for loop in loops:
        # Taking leadership: the leaders row is upserted (and deleted by a graceful
        # release of a session lock), and the loop's fencing token drawn and recorded.
        grant("scheduler_leaders", "SELECT", "INSERT", "UPDATE", *(["DELETE"] if session else []))
        grant("scheduler_fencing", "SELECT", "INSERT", "UPDATE")
        grant(f"scheduler_fencing_{loop}_seq", "USAGE", kind="sequence")
    if "publish" in loops:
        grant("scheduler_publications", "UPDATE")
        if webhook:
            grant("scheduler_webhook_outbox", "SELECT", "INSERT", "UPDATE")
    if "plugin" in loops:
        grant("scheduler_plugin_tasks", "SELECT", "INSERT", "UPDATE")
        grant("scheduler_plugin_runs", "SELECT", "INSERT", "UPDATE", "DELETE")  # trimmed
        # The leader publishes what runtime schedules may name (an upsert, and a delete).
        grant("scheduler_runnable_targets", "SELECT", "INSERT", "UPDATE", "DELETE")
        if purge:
            grant("scheduler_publications", "DELETE")
        if purge_runs:
            grant(RUNS_UPKEEP_FUNCTION, "EXECUTE", kind="function")
    return dict(need)


def grant_statement(kind: str, name: str, privileges: Collection[str], role: str) -> str:
    """The GRANT that gives ``role`` what it lacks: text for the operator to run as the
    tables' owner, shown in an error, never run by the daemon (so built here, not a named
    block). Object names are the daemon's own; the role comes quoted by the server
    (``quote_ident`` in missing_grants)."""
    ordered = ", ".join(sorted(privileges, key=_ORDER.index))
    on = {
        "sequence": f"SEQUENCE {name}",
        "procedure": f"PROCEDURE {name}",
        "function": f"FUNCTION {name}",
    }.get(kind, name)
    return f"GRANT {ordered} ON {on} TO {role}"


async def refuse_missing_grants(conn: asyncpg.Connection, need: Grants, where: str) -> None:
    """Raise :class:`PrivilegeRefused` naming, as GRANT statements, what the role lacks."""
    asked = [(kind, name, p) for (kind, name), privileges in need.items() for p in privileges]
    rows = await conn.fetch(
        QUERIES["missing_grants"],
        [a[0] for a in asked],
        [a[1] for a in asked],
        [a[2] for a in asked],
    )
    if not rows:
        return
    missing: Grants = defaultdict(set)
    for row in rows:
        missing[(row["kind"], row["name"])].add(row["privilege"])
    role = rows[0]["role"]
    objects = ", ".join(f"{kind} {name}" for kind, name in missing)
    statements = "; ".join(grant_statement(k, n, p, role) for (k, n), p in missing.items())
    # In the words the server would use at the first statement that needs them.
    raise PrivilegeRefused(
        f"{where}: permission denied for {objects} (SQLSTATE 42501): the role {role} lacks "
        f"privileges the daemon needs (checked at start); as the owner of the scheduler's "
        f"tables, run: {statements} (see docs/security.md)"
    )


async def refuse_unusable_schema(conn: asyncpg.Connection, where: str) -> None:
    """Before concluding that the schema was never created: it may only be out of sight."""
    rows = await conn.fetch(QUERIES["unusable_schemas"])
    if rows:
        schema, role = rows[0]["schema"], rows[0]["role"]
        raise PrivilegeRefused(
            f"{where}: the scheduler's tables are in schema {schema}, which the role {role} "
            f"may not use (no USAGE), so they look missing: GRANT USAGE ON SCHEMA {schema} "
            f"TO {role} (see docs/security.md)"
        )
