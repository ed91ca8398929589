"""What `scheduler-daemon status` and `/status` report.

PostgreSQL: the lock holder and the waiting standbys come from ``pg_locks`` joined with
``pg_stat_activity`` (the lock manager's own truth), enriched with the holder's row in
``scheduler_leaders`` (host, pid, since, heartbeat). SQLite: the leaders row, and whether
the loop's lock file is held right now. Both: the ``tables`` section, from
:meth:`Store.table_health` (sizes, dead rows, vacuums and the oldest snapshot; SQLite's
file), so that an operator sees when the hot tables stop being vacuumed.

:func:`collect_status` is the full report, for whoever holds the database's credentials
(the CLI). :func:`summarize` keeps the part that is safe to show anyone who can reach the
HTTP port: no database URL, host names, pids or client addresses. The summary is a strict
subset: every key it has means the same as in the full report, so tools read both.
"""

from __future__ import annotations

import fcntl
import os
from typing import TYPE_CHECKING, Any

from .config.settings import Settings
from .db.base import COUNT_LIMIT, Store, TableHealth
from .db.sqlfiles import migrations, queries
from .leadership.sqlite_flock import lock_path
from .output import counted, human_duration, human_size, json_value

if TYPE_CHECKING:  # the CLI imports this module; it has no use for prometheus_client
    from .db.postgres import PostgresStore
    from .metrics import Metrics
    from .schema_gate import SchemaGate

APP_PREFIX = "scheduler-daemon/"


def instance_from_application_name(name: str | None) -> str | None:
    """``scheduler-daemon/<instance>/lock:<loop>`` -> ``<instance>``."""
    if not name or not name.startswith(APP_PREFIX):
        return None
    return name[len(APP_PREFIX) :].rsplit("/", 1)[0]


def _loop_keys(settings: Settings) -> dict[str, int]:
    return {"publish": settings.lock.keys.publish, "plugin": settings.lock.keys.plugin}


async def collect_status(store: Store, settings: Settings) -> dict[str, Any]:
    """The status report, as plain JSON-able data with no secrets."""
    stats = await store.publication_stats()
    if store.capabilities.advisory_locks:
        loops = await _postgres_loops(store, settings)
    else:
        loops = await _sqlite_loops(store, settings)
    loops["publish"]["backlog"] = stats.due
    loops["publish"]["next_due"] = json_value(stats.next_due)
    async with store.transaction(readonly=True) as tx:
        [plugin] = await tx.query("plugin_stats", limit=COUNT_LIMIT)
    # Schedules due, and how long the oldest has waited: how far behind the loop is.
    loops["plugin"]["backlog"] = plugin["due"]
    loops["plugin"]["lag"] = round(plugin["lag"] or 0.0, 3)
    loops["plugin"]["next_due"] = json_value(plugin["next_run_at"])
    return {
        "database": str(settings.database_url),
        "backend": store.backend,
        "lock_mode": settings.lock.mode if store.capabilities.advisory_locks else "flock",
        "schema_version": await store.schema_version(),
        # Backlogs and publications waiting are counted up to this many (db.base).
        "count_limit": COUNT_LIMIT,
        "publications": {
            "scheduled": stats.scheduled,
            "due": stats.due,
            "next_due": json_value(stats.next_due),
        },
        "loops": loops,
        "tables": tables_report(await store.table_health()),
    }


def tables_report(health: TableHealth) -> dict[str, Any]:
    """The ``tables`` section: per table its size, rows, dead ratio and vacuums, and what
    holds the database's oldest snapshot (PostgreSQL); the database file (SQLite). What
    the backend cannot tell is null."""
    tables = None
    if health.tables is not None:
        tables = [
            {
                "table": t.table,
                "bytes": t.total_bytes,
                "live_rows": t.live_rows,
                "dead_rows": t.dead_rows,
                "dead_ratio": round(t.dead_ratio, 4),
                "last_vacuum": json_value(t.last_vacuum),
                "vacuum_age": None if t.vacuum_age is None else round(t.vacuum_age, 1),
                "vacuum_count": t.vacuum_count,
                "autovacuum_count": t.autovacuum_count,
            }
            for t in health.tables
        ]
    holder = health.oldest_snapshot
    oldest = None
    if holder is not None:
        oldest = {
            "kind": holder.kind,
            "name": holder.name,
            # Ours: the summary may show it, as it shows every replica's instance id.
            "instance": instance_from_application_name(holder.name)
            if holder.kind == "session"
            else None,
            "state": holder.state,
            "backend_pid": holder.backend_pid,
            "xmin_age": holder.xmin_age,
            "held_for": None if holder.held_for is None else round(holder.held_for, 3),
        }
    file = health.file
    return {
        "tables": tables,
        "oldest_snapshot": oldest,
        "snapshot_seconds": None
        if health.snapshot_seconds is None
        else round(health.snapshot_seconds, 3),
        "database_file": None
        if file is None
        else {
            "bytes": file.bytes,
            "page_size": file.page_size,
            "free_pages": file.free_pages,
            "wal_bytes": file.wal_bytes,
        },
    }


async def _postgres_loops(store: Store, settings: Settings) -> dict[str, dict[str, Any]]:
    from .db.postgres import PostgresStore

    assert isinstance(store, PostgresStore)
    q = queries("postgres")
    loops: dict[str, dict[str, Any]] = {}
    for loop, key in _loop_keys(settings).items():
        if loop == "plugin":
            # Whatever this config says: the replicas running are what is reported.
            count = await _running_shards(store, key) or settings.plugin.shards
            if count > 1:
                loops[loop] = await _shards(store, key, count)
                continue
        rows = await store.pool.fetch(q["lock_sessions"], loop, key)
        leader = None
        standbys = []
        for row in rows:
            who = {
                "instance": row["instance"]
                or instance_from_application_name(row["application_name"]),
                "backend_pid": row["pid"],
                "client_addr": row["client_addr"],
            }
            if row["granted"]:
                leader = who | {
                    "host": row["hostname"],
                    "pid": row["os_pid"],
                    "since": json_value(row["acquired_at"]),
                    "last_heartbeat": json_value(row["heartbeat_at"]),
                    "heartbeat_age": row["heartbeat_age"],
                    "fencing_token": row["fencing_token"],
                }
            else:
                standbys.append(who | {"connected_since": json_value(row["backend_start"])})
        loops[loop] = {
            "lock_key": key,
            "leader": leader,
            "standbys": standbys,
            "standby_count": len(standbys),
        }
    return loops


async def _running_shards(store: PostgresStore, key: int) -> int | None:
    """The shard count the plugin loop's members run with (None: no member)."""
    from .leadership.shard_keys import ShardKeys

    layouts = await store.pool.fetchrow(
        queries("postgres")["shard_layouts"], ShardKeys(key, 1).member_class, -1
    )
    count: int | None = layouts["other_count"]
    return count


async def _shards(store: PostgresStore, key: int, count: int) -> dict[str, Any]:
    """A sharded loop: its members and who leads each shard, from the lock manager."""
    from .leadership.shard_keys import ShardKeys, member_name

    keys = ShardKeys(key, count)
    q = queries("postgres")
    members: dict[int, dict[str, Any]] = {}
    for row in await store.pool.fetch(
        q["shard_members"], keys.member_class, keys.shard_class, count - 1, count
    ):
        if row["kind"] == "member":
            name = member_name(row["application_name"] or "")
            members[row["pid"]] = {"instance": name, "backend_pid": row["pid"], "shards": []}
    owners = []
    for row in await store.pool.fetch(q["shard_owners"], keys.shard_class, count):
        member = members.get(row["backend_pid"])
        if member is not None:
            member["shards"].append(row["shard"])
        holder = row["instance"] or instance_from_application_name(row["application_name"])
        owners.append(
            {
                "shard": row["shard"],
                "instance": holder if row["backend_pid"] is not None else None,
                "host": row["hostname"],
                "pid": row["os_pid"],
                "backend_pid": row["backend_pid"],
                "since": json_value(row["acquired_at"]),
                "fencing_token": row["fencing_token"],
                "changes": row["changes"],
            }
        )
    listed = sorted(members.values(), key=lambda m: (m["instance"], m["backend_pid"]))
    shares = [len(m["shards"]) for m in listed]
    mean = count / len(listed) if listed else None
    led = sum(1 for owner in owners if owner["instance"] is not None)
    return {
        "lock_key": key,
        "shards": count,
        "leader": None,  # each shard has its own: see shard_owners
        "members": listed,
        "member_count": len(listed),
        "shard_owners": owners,
        "balance": {
            "led": led,
            "unled": count - led,
            "largest": max(shares, default=0),
            "mean": round(mean, 3) if mean is not None else None,
            "largest_over_mean": round(max(shares) / mean, 3) if mean else None,
        },
        "owner_changes": sum(owner["changes"] for owner in owners),
        # Members that lead no shard yet (more members than shards, or just joined).
        "standbys": [
            {"instance": m["instance"], "backend_pid": m["backend_pid"]}
            for m in listed
            if not m["shards"]
        ],
        "standby_count": sum(1 for m in listed if not m["shards"]),
    }


async def _sqlite_loops(store: Store, settings: Settings) -> dict[str, dict[str, Any]]:
    from .db.sqlite import SqliteStore

    assert isinstance(store, SqliteStore)
    async with store.transaction(readonly=True) as tx:  # never waits for the writer
        rows = {(row["loop"], row["lock_key"]): row for row in await tx.query("leaders")}
    loops: dict[str, dict[str, Any]] = {}
    for loop, key in _loop_keys(settings).items():
        row = rows.get((loop, key))
        held = _flock_held(lock_path(store.path, loop))
        leader = None
        if held and row is not None:
            leader = {
                "instance": row["instance"],
                "host": row["hostname"],
                "pid": row["pid"],
                "since": json_value(row["acquired_at"]),
                "last_heartbeat": json_value(row["heartbeat_at"]),
                "heartbeat_age": row["heartbeat_age"],
                "fencing_token": row["fencing_token"],
            }
        # Waiting processes poll the lock file; they are not visible from outside.
        loops[loop] = {
            "lock_key": key,
            "leader": leader,
            "lock_held": held,
            "standbys": None,
            "standby_count": None,
        }
    return loops


def _flock_held(path: os.PathLike[str]) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also drops the lock if we just took it
    return False


# What the summary keeps, level by level; everything else is left out. An allow-list, so a
# field added to the full report later stays out of the network's view until added here.
_SUMMARY_TOP = (
    "backend", "lock_mode", "schema_version", "count_limit", "publications", "loops",
)  # fmt: skip
_SUMMARY_TABLES = ("snapshot_seconds", "database_file")
_SUMMARY_TABLE = (
    "table", "bytes", "live_rows", "dead_rows", "dead_ratio", "last_vacuum", "vacuum_age",
    "vacuum_count", "autovacuum_count",
)  # fmt: skip
_SUMMARY_DATABASE_FILE = ("bytes", "page_size", "free_pages", "wal_bytes")
# Not its application_name: another client's may name a host or the database.
_SUMMARY_SNAPSHOT = ("kind", "instance", "state", "xmin_age", "held_for")
_SUMMARY_LOOP = (
    "lock_key", "lock_held", "standby_count", "backlog", "lag", "next_due",
    "shards", "member_count", "balance", "owner_changes",
)  # fmt: skip
_SUMMARY_MEMBER = ("instance", "shards")
_SUMMARY_OWNER = ("shard", "instance", "since", "fencing_token", "changes")
_SUMMARY_LEADER = ("instance", "since", "last_heartbeat", "heartbeat_age", "fencing_token")
_SUMMARY_STANDBY = ("instance", "connected_since")


def _keep(source: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    return {key: source[key] for key in keys if key in source}


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """The part of :func:`collect_status`'s report that is safe for the network.

    Kept: per loop whether there is a leader, its instance id, since when, its heartbeat
    and fencing token; the standbys' instance ids and count; the backlog; the schema
    version; the scheduler's tables' sizes, rows, dead ratios and vacuums, and what holds
    the oldest snapshot: its kind, state, age and, if it is a replica's session, that
    replica's instance id. Left out: the database URL (user, host, database name), host
    names, pids, backend pids and client addresses, and the holder's own name (an
    application_name, a prepared transaction's gid, a slot's name): the session may be
    another client's, whose name may carry a host or database name. Instance ids stay:
    they are configured names, but the default one is ``<hostname>-<pid>`` (see
    docs/operations.md).
    """
    summary = _keep(report, _SUMMARY_TOP)
    loops: dict[str, dict[str, Any]] = {}
    for name, info in report.get("loops", {}).items():
        loop = _keep(info, _SUMMARY_LOOP)
        leader = info.get("leader")
        loop["leader"] = None if leader is None else _keep(leader, _SUMMARY_LEADER)
        standbys = info.get("standbys")
        loop["standbys"] = (
            None if standbys is None else [_keep(each, _SUMMARY_STANDBY) for each in standbys]
        )
        if "members" in info:  # sharded
            loop["members"] = [_keep(each, _SUMMARY_MEMBER) for each in info["members"]]
            loop["shard_owners"] = [_keep(each, _SUMMARY_OWNER) for each in info["shard_owners"]]
        loops[name] = loop
    if "loops" in report:
        summary["loops"] = loops
    if "tables" in report:
        summary["tables"] = _summarize_tables(report["tables"])
    return summary


def _summarize_tables(section: dict[str, Any]) -> dict[str, Any]:
    kept = _keep(section, _SUMMARY_TABLES)
    if kept.get("database_file") is not None:
        kept["database_file"] = _keep(kept["database_file"], _SUMMARY_DATABASE_FILE)
    tables = section.get("tables")
    kept["tables"] = None if tables is None else [_keep(t, _SUMMARY_TABLE) for t in tables]
    oldest = section.get("oldest_snapshot")
    kept["oldest_snapshot"] = None if oldest is None else _keep(oldest, _SUMMARY_SNAPSHOT)
    return kept


def replica_status(
    settings: Settings, metrics: Metrics, schema: SchemaGate | None = None
) -> dict[str, Any]:
    """This replica, as the process serving ``/status`` knows itself: its instance id and,
    per loop, ``leader``, ``standby`` or ``off`` (not run here: disabled, ``--only``).

    A replica that found the schema newer than its build knows says ``outdated`` for each
    loop it would run (it contends for none), and an ``outdated`` entry with both versions
    (schema_gate.py); a replica that is not outdated has no such entry."""
    outdated = schema is not None and schema.outdated
    loops: dict[str, str] = {}
    for loop in _loop_keys(settings):
        value = metrics.registry.get_sample_value("scheduler_leader", {"loop": loop})
        role = "outdated" if outdated else "standby"
        loops[loop] = "off" if value is None else "leader" if value == 1 else role
    report: dict[str, Any] = {"instance": settings.instance_id, "loops": loops}
    if schema is not None and schema.outdated:
        report["outdated"] = {
            "schema_version": schema.found,
            "newest_migration": schema.newest,
        }
    return report


def render_status(report: dict[str, Any]) -> str:
    lines = [
        f"database   {report['database']} ({report['backend']}, schema "
        f"v{report['schema_version']}, lock mode {report['lock_mode']})",
    ]
    newest = migrations(report["backend"])[-1].version
    if (report["schema_version"] or 0) > newest:
        lines.append(
            f"{'':<10} schema v{report['schema_version']} is newer than this build's newest "
            f"migration (v{newest}): replicas of this build stand by and lead nothing"
        )
    for loop, info in report["loops"].items():
        leader = info["leader"]
        if "members" in info:
            lines.extend(_render_shards(loop, info))
        elif leader:
            age = leader.get("heartbeat_age")  # written after this read began: a hair < 0
            age = None if age is None else max(0.0, age)
            lines.append(
                f"{loop:<10} leader {leader['instance']} (host {leader.get('host') or '?'}, "
                f"pid {leader.get('pid') or '?'}, since {leader.get('since') or '?'}, "
                f"heartbeat {f'{age:.1f}s ago' if age is not None else '?'}, "
                f"fencing token {leader.get('fencing_token') or '?'})"
            )
        else:
            lines.append(f"{loop:<10} leader -")
        standbys = info.get("standbys")
        if "members" in info:
            pass  # a member without shards is listed with its (empty) share
        elif standbys is not None:
            names = ", ".join(s["instance"] or f"pid {s['backend_pid']}" for s in standbys)
            lines.append(f"{'':<10} standbys {len(standbys)}{': ' + names if names else ''}")
        else:
            # SQLite: a waiting replica polls the lock file and leaves no trace to count.
            lines.append(f"{'':<10} standbys unknown (not visible on SQLite)")
        limit = report.get("count_limit")
        if loop == "publish":
            lines.append(
                f"{'':<10} backlog {counted(info['backlog'], limit)} due, "
                f"{counted(report['publications']['scheduled'], limit)} scheduled, "
                f"next due {info['next_due'] or '-'}"
            )
        elif "backlog" in info:
            lines.append(
                f"{'':<10} backlog {counted(info['backlog'], limit)} schedules due, "
                f"lag {info['lag']:g}s, next slot {info['next_due'] or '-'}"
            )
    if "tables" in report:
        lines.extend(_render_tables(report["tables"]))
    return "\n".join(lines)


# A snapshot held longer than this is worth a line: VACUUM has been held back since.
SNAPSHOT_SHOWN_AFTER = 60.0
# Where its start is hidden (a slot; another role's session), its age in transactions.
SNAPSHOT_SHOWN_AFTER_XIDS = 1000


def _render_tables(section: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    label = "tables"
    for table in section.get("tables") or []:
        age = table["vacuum_age"]
        ratio = table["dead_ratio"]
        dead = "<1%" if 0 < ratio < 0.01 else f"{ratio:.0%}"
        lines.append(
            f"{label:<10} {table['table']} {human_size(table['bytes'])}, "
            f"{table['live_rows']:,} live, {dead} dead, "
            f"{'never vacuumed' if age is None else f'vacuumed {human_duration(age)} ago'}"
        )
        label = ""
    file = section.get("database_file")
    if file is not None:
        free = human_size(file["free_pages"] * file["page_size"])
        wal = file["wal_bytes"]
        lines.append(
            f"{label:<10} database file {human_size(file['bytes'])}, "
            f"{file['free_pages']:,} free pages ({free})"
            + ("" if wal is None else f", write-ahead log {human_size(wal)}")
        )
    holder = section.get("oldest_snapshot")
    if holder is not None and _snapshot_shown(holder):
        held = holder["held_for"]
        who = holder["name"] or holder["instance"] or "?"
        state = f", {holder['state']}" if holder["state"] else ""
        since = (
            f"held for {human_duration(held)}"
            if held is not None
            else f"{holder['xmin_age']:,} transactions old"
        )
        lines.append(
            f"{'':<10} oldest snapshot {since}, by {holder['kind']} {who}{state}: "
            "VACUUM cannot remove rows that died since"
        )
    return lines


def _snapshot_shown(holder: dict[str, Any]) -> bool:
    held = holder["held_for"]
    if held is not None:
        return bool(held > SNAPSHOT_SHOWN_AFTER)
    return bool(holder["xmin_age"] > SNAPSHOT_SHOWN_AFTER_XIDS)


def _render_shards(loop: str, info: dict[str, Any]) -> list[str]:
    balance = info["balance"]
    lines = [
        f"{loop:<10} {info['shards']} shards over {info['member_count']} members: "
        f"largest share {balance['largest']} (mean {balance['mean'] or 0:g}), "
        f"{balance['unled']} unled, {info['owner_changes']} changes of owner"
    ]
    for member in info["members"]:
        shards = member["shards"]
        lines.append(
            f"{'':<10} member {member['instance']} leads {len(shards)}: {_ranges(shards) or '-'}"
        )
    unled = [o["shard"] for o in info["shard_owners"] if o["instance"] is None]
    if unled:
        lines.append(f"{'':<10} unled {_ranges(unled)}")
    return lines


def _ranges(numbers: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"."""
    spans: list[list[int]] = []
    for n in sorted(numbers):
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans)
