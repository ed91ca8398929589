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
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection

import asyncpg

from ..errors import PrivilegeRefused

# (kind, object) -> privileges; kind is "table" or "sequence".
Grants = dict[tuple[str, str], set[str]]

# Of the grants asked for, those the current role lacks; an object that does not exist
# counts as lacking (to_regclass gives NULL), which cannot happen after migrating.
_MISSING = """
SELECT r.kind, r.name, r.privilege, quote_ident(current_user) AS role
FROM unnest($1::text[], $2::text[], $3::text[]) AS r(kind, name, privilege)
WHERE NOT coalesce(CASE r.kind
    WHEN 'table' THEN has_table_privilege(to_regclass(r.name), r.privilege)
    WHEN 'sequence' THEN has_sequence_privilege(to_regclass(r.name), r.privilege)
END, false)
ORDER BY r.kind DESC, r.name, r.privilege
"""

# Where the scheduler's tables are when name lookup cannot see them: PostgreSQL leaves a
# schema the role has no USAGE on out of its search_path, without a word.
_UNUSABLE_SCHEMAS = """
SELECT quote_ident(n.nspname) AS schema, quote_ident(current_user) AS role
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.relname = 'scheduler_schema_version' AND c.relkind = 'r'
  AND NOT has_schema_privilege(n.oid, 'USAGE')
ORDER BY n.nspname
"""

_ORDER = ("SELECT", "INSERT", "UPDATE", "DELETE", "USAGE")


def required_grants(loops: Collection[str], *, session: bool, webhook: bool, purge: bool) -> Grants:
    """What the enabled ``loops`` need: ``session`` lock mode (else transaction), the
    ``webhook`` publisher, the built-in ``purge_publications`` task."""
    need: Grants = defaultdict(set)

    def grant(name: str, *privileges: str, kind: str = "table") -> None:
        need[(kind, name)].update(privileges)

    # Every command reads the schema version; `status` and /status the backlog.
    grant("scheduler_schema_version", "SELECT")
    grant("scheduler_publications", "SELECT")
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
    return dict(need)


def grant_statement(kind: str, name: str, privileges: Collection[str], role: str) -> str:
    ordered = ", ".join(sorted(privileges, key=_ORDER.index))
    on = f"SEQUENCE {name}" if kind == "sequence" else name
    return f"GRANT {ordered} ON {on} TO {role}"


async def refuse_missing_grants(conn: asyncpg.Connection, need: Grants, where: str) -> None:
    """Raise :class:`PrivilegeRefused` naming, as GRANT statements, what the role lacks."""
    asked = [(kind, name, p) for (kind, name), privileges in need.items() for p in privileges]
    rows = await conn.fetch(
        _MISSING, [a[0] for a in asked], [a[1] for a in asked], [a[2] for a in asked]
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
    rows = await conn.fetch(_UNUSABLE_SCHEMAS)
    if rows:
        schema, role = rows[0]["schema"], rows[0]["role"]
        raise PrivilegeRefused(
            f"{where}: the scheduler's tables are in schema {schema}, which the role {role} "
            f"may not use (no USAGE), so they look missing: GRANT USAGE ON SCHEMA {schema} "
            f"TO {role} (see docs/security.md)"
        )
