"""Least privilege: replicas run as a runtime role that is not a superuser and holds exactly
the grants docs/security.md lists, and each grant it lists is one the daemon refuses to
run without, saying which.

The SQL comes from docs/security.md itself (its ``security-sql`` blocks, run verbatim but
for the role and database names), so the page cannot drift from what was tested. Role
names are unique per test (per module for the grant-by-grant tests, which share one
database and each give back the grant they take); they are dropped afterwards.
"""

from __future__ import annotations

import json
import re
import secrets
import signal
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from click.testing import CliRunner
from rig.databases import (
    PgServer,
    create_database,
    drop_database,
    new_database_name,
    replace_user,
    run_sync,
)
from rig.processes import Daemons, run_cli
from rig.sql import execute, fetch, leader_of, scalar
from rig.ticks import (
    TICK_LOG_DDL,
    assert_no_overlap,
    event_time,
    first_leader,
    pg_env,
    pg_ticks,
    stop_all,
    wait_for_event,
)
from rig.waiting import wait_until

from scheduler_daemon.cli import cli
from scheduler_daemon.db.privileges import grant_statement, required_grants
from scheduler_daemon.db.sqlfiles import queries
from scheduler_daemon.errors import EXIT_CONFIG

pytestmark = pytest.mark.postgres

SECURITY_MD = Path(__file__).resolve().parent.parent / "docs" / "security.md"

# The names docs/security.md uses, replaced by each test's own.
DOC_ROLES = ("sched_owner", "sched_runtime", "sched_all")
# And one the doc does not name: an operator that runs `status`.
OTHER_ROLES = ("monitor",)
DOC_DATABASE = "sched"


def security_sql(block: str) -> list[str]:
    """The statements of the ```sql block under ``<!-- security-sql: BLOCK -->``."""
    text = SECURITY_MD.read_text()
    match = re.search(rf"<!-- security-sql: {block} -->\s*```sql\n(.*?)```", text, re.S)
    assert match, f"docs/security.md has no security-sql block {block!r}"
    return [s.strip() for s in match[1].split(";") if s.strip()]


def adapted(statements: list[str], names: Mapping[str, str]) -> list[str]:
    """The statements with the doc's role and database names replaced (whole words only:
    ``sched`` is not ``sched_owner``, nor part of ``scheduler_leaders``)."""
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b")
    return [pattern.sub(lambda m: names[m[1]], s) for s in statements]


@dataclass(frozen=True)
class Unit:
    """One privilege on one object, as a GRANT in docs/security.md gives it."""

    privilege: str
    kind: str  # DATABASE, SCHEMA, SEQUENCE, FUNCTION or TABLE
    name: str

    def __str__(self) -> str:
        return f"{self.privilege}-{self.name}"


_GRANT = re.compile(
    r"GRANT (?P<privileges>[A-Z, ]+) ON (?:(?P<kind>DATABASE|SCHEMA|SEQUENCE|FUNCTION|TABLE) )?"
    r"(?P<objects>[\w, ]+?) TO \w+"
)


def grant_units(statements: list[str]) -> list[Unit]:
    units = []
    for statement in statements:
        match = _GRANT.fullmatch(statement)
        if match is None:
            continue  # a REVOKE
        for obj in match["objects"].split(","):
            for privilege in match["privileges"].split(","):
                units.append(Unit(privilege.strip(), match["kind"] or "TABLE", obj.strip()))
    return units


# What the runtime role is given: to connect and use the schema, then the table grants.
DOC_UNITS = grant_units(security_sql("owner") + security_sql("runtime"))


# -- fixtures ---------------------------------------------------------------------------


@pytest.fixture
def roles(pg_server: PgServer) -> Iterator[dict[str, str]]:
    """This test's names for the doc's roles (created by the doc's own statements), dropped
    afterwards. Requested before the database fixtures, so it is torn down after them:
    a role cannot be dropped while a database it owns or holds privileges in is there."""
    suffix = secrets.token_hex(4)
    names = {role: f"{role}_{suffix}" for role in (*DOC_ROLES, *OTHER_ROLES)}
    yield names
    execute(pg_server.admin_dsn, *(f"DROP ROLE IF EXISTS {name}" for name in names.values()))


def _dbname(url: str) -> str:
    return urlsplit(url).path.lstrip("/")


@dataclass(frozen=True)
class Split:
    """A database owned by the owner role, migrated by it, with the runtime role's grants."""

    owner_url: str
    runtime_url: str
    names: dict[str, str]

    @property
    def runtime(self) -> str:
        return self.names["sched_runtime"]


def admin_block(names: Mapping[str, str], dbname: str, block: str = "admin") -> list[str]:
    """The doc's superuser block, on the test's own database: that one exists already (its
    fixture drops it, with a leak check), so CREATE DATABASE becomes giving it away."""
    statements = []
    for statement in adapted(security_sql(block), names):
        created = re.fullmatch(r"CREATE DATABASE \w+ OWNER (\w+)", statement)
        statements.append(
            f"ALTER DATABASE {dbname} OWNER TO {created[1]}" if created else statement
        )
    return statements


@pytest.fixture
def split(
    roles: dict[str, str], pg_empty_url: str, pg_server: PgServer, restore_logging: None
) -> Split:
    """The doc's two roles on this test's own database (migrate runs in this process: its
    logging is put back afterwards)."""
    dbname = _dbname(pg_empty_url)
    names = {**roles, DOC_DATABASE: dbname}
    execute(pg_server.admin_dsn, *admin_block(names, dbname))
    owner_url = replace_user(pg_empty_url, names["sched_owner"])
    execute(owner_url, *adapted(security_sql("owner"), names))
    # The owner creates the schema, with the product's own command.
    migrated = CliRunner().invoke(cli, ["migrate"], env={"SCHEDULER_DATABASE_URL": owner_url})
    assert migrated.exit_code == 0, migrated.output
    execute(owner_url, *adapted(security_sql("runtime"), names))
    return Split(owner_url, replace_user(pg_empty_url, names["sched_runtime"]), names)


# -- the doc, the code and the SQL agree ------------------------------------------------

# The fence functions (migrations 0015, 0016): PUBLIC's by default, as the procedures.
FENCES = {("function", "scheduler_fence"), ("function", "scheduler_fence_shards")}

ALL_FEATURES = required_grants(
    ["publish", "plugin"], session=True, webhook=True, purge=True, purge_runs=True
)


def test_the_documented_grants_are_what_the_daemon_checks_for() -> None:
    """docs/security.md's runtime block grants exactly what `run` requires with every loop,
    publisher and built-in task enabled: no more (least privilege), no less."""
    documented = {
        (u.kind.lower(), u.name, u.privilege)
        for u in DOC_UNITS
        if u.kind in ("TABLE", "SEQUENCE", "FUNCTION")
    }
    checked = {
        (kind, name, p) for (kind, name), ps in ALL_FEATURES.items() for p in ps
        # PUBLIC's by default: docs/security.md grants none
        if kind != "procedure" and (kind, name) not in FENCES
    }  # fmt: skip
    assert documented == checked


# Named queries run only by the command line or by `migrate`, never by the loops.
NOT_THE_LOOPS = {
    "create_version_table", "record_version", "schedule", "get", "get_by_key", "cancel",
    "publications_find", "tasks_list", "task_pause", "task_resume", "task_trigger",
    # Runtime schedules: the application's API and `tasks add|remove|show|list`.
    "schedule_lookup", "schedule_insert", "schedule_replace", "schedule_remove",
    "schedule_get", "schedules_list", "schedules_count",
}  # fmt: skip


def privileges_used(sql: str) -> set[tuple[str, str, str]]:
    """What a statement needs on the scheduler's tables and sequences, read off its text."""
    used: set[tuple[str, str, str]] = set()
    table = r"(scheduler_\w+)"
    for verb, pattern in (
        ("INSERT", rf"INSERT INTO {table}"),
        ("UPDATE", rf"UPDATE {table}"),
        ("DELETE", rf"DELETE FROM {table}"),
        ("SELECT", rf"(?:FROM|JOIN|UPDATE|INTO) {table}"),  # read: WHERE, RETURNING, ON CONFLICT
    ):
        used |= {("table", name, verb) for name in re.findall(pattern, sql)}
    if re.search(r"ON CONFLICT \([^)]*\) DO UPDATE", sql):
        used |= {("table", name, "UPDATE") for name in re.findall(rf"INSERT INTO {table}", sql)}
    if "FOR UPDATE OF o" in sql:  # the outbox's rows, locked while they are delivered
        used.add(("table", "scheduler_webhook_outbox", "UPDATE"))
    if "CALL scheduler_wait_for_lock(:key, :slice_ms)" in sql:  # a standby's wait
        used.add(("procedure", "scheduler_wait_for_lock(bigint, integer)", "EXECUTE"))
    if "CALL scheduler_wait_for_lock(:member_class, :objid, :slice_ms)" in sql:  # a watch
        used.add(("procedure", "scheduler_wait_for_lock(integer, integer, integer)", "EXECUTE"))
    if "FROM scheduler_runs_maintain(" in sql:  # the history's upkeep: a function, not a table
        used.discard(("table", "scheduler_runs_maintain", "SELECT"))
        used.add(("function", "scheduler_runs_maintain", "EXECUTE"))
    for fence in ("scheduler_fence", "scheduler_fence_shards"):  # session mode's fences
        if f"{fence}(" in sql:  # a function, FOR SHARE
            used.add(("function", fence, "EXECUTE"))
    if "scheduler_fencing_%s_seq" in sql:  # nextval() of the loop's own sequence
        used |= {
            ("sequence", f"scheduler_fencing_{loop}_seq", "USAGE") for loop in ("publish", "plugin")
        }
    return used


def test_the_grants_follow_from_the_sql_the_daemon_runs() -> None:
    """Every privilege the loops' named queries use (db/postgres.sql) is required, and
    nothing else is: a query that starts writing a table breaks this test until the list
    (and docs/security.md) follow."""
    used: set[tuple[str, str, str]] = set()
    for name, sql in queries("postgres").items():
        if name not in NOT_THE_LOOPS:
            used |= privileges_used(sql)
    checked = {(kind, name, p) for (kind, name), ps in ALL_FEATURES.items() for p in ps}
    assert used - checked == set(), "used by the loops, not required: docs/security.md misses it"
    assert checked - used == set(), "required, yet no query of the loops uses it"


def test_fewer_features_need_fewer_grants() -> None:
    """Transaction mode never deletes its leaders row; only the webhook publisher touches the
    outbox; only the purge task deletes publications; a loop not run here needs nothing."""
    assert (
        "DELETE"
        not in required_grants(
            ["publish"], session=False, webhook=False, purge=False, purge_runs=False
        )[("table", "scheduler_leaders")]
    )
    plugin_only = required_grants(
        ["plugin"], session=True, webhook=True, purge=False, purge_runs=False
    )
    assert ("table", "scheduler_webhook_outbox") not in plugin_only
    assert ("sequence", "scheduler_fencing_publish_seq") not in plugin_only
    assert "DELETE" not in plugin_only[("table", "scheduler_publications")]
    assert ("function", "scheduler_runs_maintain") not in plugin_only
    assert grant_statement("sequence", "s", {"USAGE"}, "r") == "GRANT USAGE ON SEQUENCE s TO r"


# -- each documented grant is needed, and its absence is named --------------------------

# Every feature on, so that each grant is needed: the webhook publisher (preflight only
# builds it; nothing is posted) and the built-in purge task (on by default).
ALL_FEATURES_ENV = {
    "SCHEDULER_PUBLISH__PUBLISHERS": '["webhook"]',
    "SCHEDULER_PUBLISH__WEBHOOK__URL": "http://127.0.0.1:9/hook",
    "SCHEDULER_PUBLISH__WEBHOOK__SECRET": "not-a-real-secret",
    "SCHEDULER_HTTP__ENABLED": "false",
    "SCHEDULER_DATABASE__STARTUP_BUDGET": "5",  # preflight's, should anything hang
}


def cli_in_process(args: list[str], env: Mapping[str, str]) -> tuple[int, str]:
    """``scheduler-daemon ARGS`` in this process (a subprocess costs most of a second):
    its exit code and the last line it wrote on stderr."""
    result = CliRunner().invoke(cli, args, env=dict(env), catch_exceptions=False)
    lines = result.stderr.strip().splitlines()
    return result.exit_code, lines[-1] if lines else ""


def expected_phrases(unit: Unit, role: str, dbname: str) -> list[str]:
    """What the one line must say for this grant to be found from it."""
    if unit.kind == "DATABASE":
        return [f'permission denied for database "{dbname}"', "CONNECT privilege", role]
    if unit.kind == "SCHEMA":
        return [f"GRANT USAGE ON SCHEMA {unit.name} TO {role}"]
    if unit.kind in ("SEQUENCE", "FUNCTION"):
        return [f"GRANT {unit.privilege} ON {unit.kind} {unit.name} TO {role}"]
    return [f"GRANT {unit.privilege} ON {unit.name} TO {role}"]


def change(verb: str, unit: Unit, names: Mapping[str, str]) -> str:
    """``GRANT``/``REVOKE`` of `unit` to/from this test's runtime role."""
    name = names.get(unit.name, unit.name)  # the test's own database
    on = name if unit.kind == "TABLE" else f"{unit.kind} {name}"
    to = "TO" if verb == "GRANT" else "FROM"
    return f"{verb} {unit.privilege} ON {on} {to} {names['sched_runtime']}"


@pytest.fixture(scope="module")
def granted(pg_server: PgServer, pg_template: str) -> Iterator[Split]:
    """The runtime role with the doc's grants on a migrated database, shared by the tests
    below, each of which takes one grant away and gives it back (a database and a role per
    test cost more than the tests). Made by the superuser: who owns the tables does not
    change what the grants allow."""
    dbname = new_database_name()
    run_sync(create_database(pg_server.admin_dsn, dbname, template=pg_template))
    names = {"sched_runtime": f"sched_runtime_{secrets.token_hex(4)}", DOC_DATABASE: dbname}
    url = pg_server.dsn_for(dbname)
    try:
        create = adapted([s for s in security_sql("admin") if "sched_runtime" in s], names)
        execute(pg_server.admin_dsn, *create)
        execute(url, *adapted(security_sql("owner") + security_sql("runtime"), names))
        yield Split(url, replace_user(url, names["sched_runtime"]), names)
    finally:
        leaked = run_sync(drop_database(pg_server.admin_dsn, dbname))
        execute(pg_server.admin_dsn, f"DROP ROLE IF EXISTS {names['sched_runtime']}")
    assert not leaked, f"connections to {dbname} still open after the tests: {leaked}"


@pytest.mark.usefixtures("restore_logging")
def test_the_documented_grants_pass_every_check(granted: Split) -> None:
    """The control for the tests below: all the documented grants, and preflight passes."""
    env = {"SCHEDULER_DATABASE_URL": granted.runtime_url, **ALL_FEATURES_ENV}
    code, line = cli_in_process(["preflight"], env)
    assert code == 0, line
    assert line == "", "preflight prints its verdict on stdout, nothing on stderr"


@pytest.mark.usefixtures("restore_logging")
@pytest.mark.parametrize("unit", DOC_UNITS, ids=str)
def test_each_documented_grant_is_needed_and_its_absence_is_named(
    granted: Split, unit: Unit
) -> None:
    """Preflight (what `run` checks before its loops start, in this process) without one
    grant: exit 78, one line that names it. Each test gives the grant back."""
    env = {"SCHEDULER_DATABASE_URL": granted.runtime_url, **ALL_FEATURES_ENV}
    execute(granted.owner_url, change("REVOKE", unit, granted.names))
    try:
        code, line = cli_in_process(["preflight"], env)
    finally:
        execute(granted.owner_url, change("GRANT", unit, granted.names))
    assert code == EXIT_CONFIG, (code, line)
    for phrase in expected_phrases(unit, granted.runtime, granted.names[DOC_DATABASE]):
        assert phrase in line, (phrase, line)
    assert "Traceback" not in line


@pytest.mark.usefixtures("restore_logging")
def test_a_runtime_role_on_a_schema_not_yet_upgraded_is_told_to_migrate_as_the_owner(
    granted: Split,
) -> None:
    """A release with a migration, rolled out before its owner ran `migrate`: the runtime
    role's replica may not apply it, and says which and what to do (docs/security.md,
    Upgrades). Stood in for by taking the newest migration's record away."""
    [newest] = fetch(
        granted.owner_url,
        "DELETE FROM scheduler_schema_version WHERE version = "
        "(SELECT max(version) FROM scheduler_schema_version) RETURNING version, name",
    )
    try:
        code, line = cli_in_process(["preflight"], {"SCHEDULER_DATABASE_URL": granted.runtime_url})
    finally:
        fetch(
            granted.owner_url,
            "INSERT INTO scheduler_schema_version (version, name) VALUES ($1, $2)",
            newest["version"],
            newest["name"],
        )
    assert code == EXIT_CONFIG, line
    migration = f"{newest['version']:04d}_{newest['name']}"
    for phrase in (
        f"cannot apply migrations {migration}: permission denied for schema public",
        "run `scheduler-daemon migrate` as the role that owns the scheduler's tables first",
    ):
        assert phrase in line, (phrase, line)


def test_run_refuses_to_start_without_a_grant_and_says_which(granted: Split) -> None:
    """What a replica does: exit 78 before any loop starts, not a warning every few
    seconds from loops that never lead."""
    unit = Unit("DELETE", "TABLE", "scheduler_leaders")
    execute(granted.owner_url, change("REVOKE", unit, granted.names))
    try:
        result = run_cli(["run"], {"SCHEDULER_DATABASE_URL": granted.runtime_url}, timeout=30)
    finally:
        execute(granted.owner_url, change("GRANT", unit, granted.names))
    assert result.returncode == EXIT_CONFIG, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert f"run: GRANT DELETE ON scheduler_leaders TO {granted.runtime} (see" in line, line
    assert "loop.started" not in result.stderr, "refused before any loop starts"


@pytest.mark.usefixtures("restore_logging")
def test_one_role_that_owns_the_database_needs_no_grant(
    roles: dict[str, str], pg_empty_url: str, pg_server: PgServer
) -> None:
    """docs/security.md, One role for both: a role that owns the database (not a superuser,
    no CREATEDB or CREATEROLE) creates the schema and passes every check `run` makes."""
    dbname = _dbname(pg_empty_url)
    names = {**roles, DOC_DATABASE: dbname}
    execute(pg_server.admin_dsn, *admin_block(names, dbname, block="single"))
    url = replace_user(pg_empty_url, names["sched_all"])
    code, line = cli_in_process(["preflight"], {"SCHEDULER_DATABASE_URL": url, **ALL_FEATURES_ENV})
    assert code == 0, line
    owners = fetch(
        url, "SELECT DISTINCT tableowner FROM pg_tables WHERE tablename LIKE 'scheduler_%'"
    )
    assert owners == [{"tableowner": names["sched_all"]}]
    role = fetch(
        url,
        "SELECT rolsuper, rolcreatedb, rolcreaterole FROM pg_roles WHERE rolname = current_user",
    )
    assert role == [{"rolsuper": False, "rolcreatedb": False, "rolcreaterole": False}]


# -- real replicas as the runtime role --------------------------------------------------

AUDIT_DDL = """
CREATE TABLE audit (
    publication_id bigint NOT NULL,
    at             timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""


def app_tables(split: Split) -> None:
    """The application's own tables, owned by the owner: the probe's tick_log and the `sql`
    publisher's audit table, with the runtime role's grants on them (docs/security.md, Your
    own SQL), and one table it is given nothing on."""
    rt = split.runtime
    execute(
        split.owner_url,
        TICK_LOG_DDL,
        AUDIT_DDL,
        "CREATE TABLE not_granted (id integer)",
        f"GRANT SELECT, INSERT, UPDATE ON tick_log TO {rt}",
        f"GRANT USAGE ON SEQUENCE tick_log_id_seq TO {rt}",  # a bigserial's
        f"GRANT INSERT ON audit TO {rt}",
    )


def replica_env(split: Split, instance: str) -> dict[str, str]:
    env = pg_env(
        split.runtime_url,
        instance,
        SCHEDULER_PUBLISH__PUBLISHERS='["sql", "notify"]',
        SCHEDULER_PUBLISH__SQL__STATEMENT=(
            "INSERT INTO audit (publication_id) SELECT unnest($1::bigint[])"
        ),
    )
    denied = {"name": "denied", "every": "1s", "sql": "INSERT INTO not_granted VALUES (1)"}
    env["SCHEDULER_PLUGIN__TASKS"] = json.dumps(
        [*json.loads(env["SCHEDULER_PLUGIN__TASKS"]), denied]
    )
    return env


def publish_some(split: Split, batch: str, count: int = 5) -> set[str]:
    """Schedule `count` publications due now, as the application (the owner) would, with a
    plain INSERT; wait until they are published; return who published them."""
    fetch(
        split.owner_url,
        "INSERT INTO scheduler_publications (key, publish_at) "
        "SELECT $1 || '-' || g, now() FROM generate_series(1, $2) g",
        batch,
        count,
    )
    done = "SELECT count(*) FROM scheduler_publications WHERE key LIKE $1 AND status = 'published'"
    wait_until(
        lambda: scalar(split.owner_url, done, f"{batch}-%") == count, 20, f"{batch} published"
    )
    rows = fetch(
        split.owner_url,
        "SELECT DISTINCT published_by FROM scheduler_publications WHERE key LIKE $1",
        f"{batch}-%",
    )
    return {row["published_by"] for row in rows}


def wait_probe_runs(split: Split, name: str, count: int = 3) -> None:
    """Until `name` has run the probe `count` times from now on (its work, not its lock)."""
    since = fetch(split.owner_url, "SELECT now() AS now")[0]["now"]
    runs = "SELECT count(*) FROM tick_log WHERE instance LIKE $1 AND started > $2"
    mine = f"scheduler-daemon/{name}/%"
    wait_until(lambda: scalar(split.owner_url, runs, mine, since) >= count, 20, f"{name} working")


def status_json(url: str) -> dict[str, Any]:
    """`scheduler-daemon status --json` as the role of `url` (in this process: it is the
    same command, for a tenth of the time)."""
    result = CliRunner().invoke(
        cli, ["status", "--json"], env={"SCHEDULER_DATABASE_URL": url}, catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    report: dict[str, Any] = json.loads(result.stdout)
    return report


@pytest.mark.usefixtures("restore_logging")
def test_replicas_run_as_a_runtime_role_with_only_the_documented_grants(
    split: Split, daemons: Daemons, pg_server: PgServer
) -> None:
    """Three replicas as the runtime role: both loops work, `status` works, a SIGKILLed
    leader is replaced, a SIGSTOPped one is evicted by the server, and no two replicas'
    work overlapped. Then the role's missing grants on the application's own tables show
    where docs/security.md says they do."""
    runtime = fetch(
        pg_server.admin_dsn,
        "SELECT rolsuper, rolcreaterole, rolcreatedb, rolbypassrls, rolcanlogin, "
        "(SELECT count(*) FROM pg_auth_members WHERE member = r.oid) AS memberships "
        "FROM pg_roles r WHERE rolname = $1",
        split.runtime,
    )
    assert runtime == [
        dict.fromkeys(["rolsuper", "rolcreaterole", "rolcreatedb", "rolbypassrls"], False)
        | {"rolcanlogin": True, "memberships": 0}
    ]
    app_tables(split)
    replicas = {name: daemons.start(replica_env(split, name), name=name) for name in "abc"}
    first = {loop: first_leader(replicas.values(), loop) for loop in ("publish", "plugin")}
    for process in replicas.values():
        process.wait_for_log("leader.waiting", loop="plugin")  # all three up
    assert publish_some(split, "first") == {first["publish"].name}
    wait_probe_runs(split, first["plugin"].name)

    # `status` as the runtime role sees every session's activity; as an operator role
    # with SELECT only, it sees the leader but its heartbeat only as of its election.
    report = status_json(split.runtime_url)
    for loop, leader in first.items():
        info = report["loops"][loop]
        assert info["leader"]["instance"] == leader.name, info
        assert info["standby_count"] == 2, info
        assert info["leader"]["heartbeat_age"] < 2.0, info
        assert info["standbys"][0]["connected_since"] is not None, info
    monitor = split.names["monitor"]
    execute(pg_server.admin_dsn, f"CREATE ROLE {monitor} LOGIN")
    execute(
        split.owner_url,
        f"GRANT CONNECT ON DATABASE {_dbname(split.owner_url)} TO {monitor}",
        f"GRANT USAGE ON SCHEMA public TO {monitor}",
        f"GRANT SELECT ON scheduler_schema_version, scheduler_publications, scheduler_leaders, "
        f"scheduler_plugin_tasks TO {monitor}",
    )
    monitor_url = replace_user(split.owner_url, monitor)
    blind = status_json(monitor_url)["loops"]["plugin"]
    assert blind["leader"]["instance"] == first["plugin"].name
    assert blind["leader"]["last_heartbeat"] == blind["leader"]["since"], blind
    assert blind["standbys"][0]["connected_since"] is None, blind
    assert blind["leader"]["client_addr"] is None, blind
    execute(pg_server.admin_dsn, f"GRANT pg_read_all_stats TO {monitor}")
    seeing = status_json(monitor_url)["loops"]["plugin"]
    assert seeing["leader"]["last_heartbeat"] > seeing["leader"]["since"], seeing
    assert seeing["leader"]["heartbeat_age"] < 2.0, seeing
    assert seeing["standbys"][0]["connected_since"] is not None, seeing

    # SIGKILL the plugin loop's leader: a standby takes over.
    killed = first["plugin"]
    killed_at = time.time()
    killed.signal(signal.SIGKILL)
    killed.wait()
    left = [p for p in replicas.values() if p is not killed]
    names = {p.name for p in left}
    successor = wait_until(
        lambda: (name := leader_of(split.owner_url, "plugin")) in names and name,
        20,
        "a plugin leader",
    )
    wait_until(lambda: leader_of(split.owner_url, "publish") in names, 20, "a publish leader")
    assert publish_some(split, "after-kill") <= names
    frozen = replicas[successor]
    wait_for_event(frozen, "leader.acquired", after=killed_at, loop="plugin")
    wait_probe_runs(split, successor)

    # SIGSTOP the new leader: the server ends its silent lock session (stall_timeout), and
    # the last replica, waiting for the lock, is granted it.
    [evictor] = [p for p in left if p is not frozen]
    stopped_at = time.time()
    frozen.signal(signal.SIGSTOP)
    try:
        evicted = wait_for_event(
            evictor, "leader.evicted", after=stopped_at, loop="plugin", timeout=20
        )
        assert evicted["evicted_instance"] == frozen.name, evicted
        print(f"\nSIGSTOP: evicted after {event_time(evicted) - stopped_at:.2f}s")
        wait_probe_runs(split, evictor.name)
        assert publish_some(split, "while-stopped") == {evictor.name}
    finally:
        resumed_at = time.time()
        frozen.signal(signal.SIGCONT)
    wait_for_event(frozen, "leader.lost", after=resumed_at, loop="plugin")

    # The application's own tables: the grants there are the user's to give.
    execute(split.owner_url, f"REVOKE INSERT ON audit FROM {split.runtime}")
    fetch(
        split.owner_url,
        "INSERT INTO scheduler_publications (key, publish_at) VALUES ('refused', now())",
    )
    refused = wait_until(
        lambda: fetch(
            split.owner_url,
            "SELECT status, last_error FROM scheduler_publications "
            "WHERE key = 'refused' AND status <> 'scheduled'",
        ),
        20,
        "the refused publication marked",
    )
    assert refused[0]["status"] == "failed"
    assert "permission denied for table audit" in refused[0]["last_error"]
    # Each run of the task without grants failed and says why (a killed leader's run is
    # abandoned; a slot that fell while the frozen leader's run was in flight is
    # skipped_overlap: seen once in a helper's run); the other tasks went on.
    denied = fetch(
        split.owner_url,
        "SELECT status, error FROM scheduler_plugin_runs WHERE name = 'denied' "
        "AND status NOT IN ('running', 'abandoned', 'skipped_overlap')",
    )
    assert denied, "the task without grants has run"
    for run in denied:
        assert run["status"] == "failed", run
        assert "permission denied for table not_granted" in run["error"], run

    stop_all(left)
    summary = assert_no_overlap(run_sync(pg_ticks(split.owner_url)), min_ticks=9, min_instances=3)
    print(f"probe ticks per instance: {summary}")
    duplicates = fetch(
        split.owner_url, "SELECT publication_id FROM audit GROUP BY 1 HAVING count(*) > 1"
    )
    assert duplicates == []
    assert scalar(split.owner_url, "SELECT count(*) FROM audit") == 15


@pytest.mark.chaos_long
@pytest.mark.usefixtures("restore_logging")
def test_transaction_mode_needs_no_delete_on_the_leaders_table(
    split: Split, daemons: Daemons
) -> None:
    """docs/security.md: only a session lock's graceful release deletes the leaders row.
    In transaction mode the runtime role works without DELETE on it, through a SIGKILL and
    a SIGTERM."""
    execute(split.owner_url, f"REVOKE DELETE ON scheduler_leaders FROM {split.runtime}")
    app_tables(split)
    mode = {"SCHEDULER_LOCK__MODE": "transaction"}
    a = daemons.start({**replica_env(split, "a"), **mode}, name="a")
    b = daemons.start({**replica_env(split, "b"), **mode}, name="b")
    publish_some(split, "first")
    ticks = "SELECT count(*) FROM tick_log WHERE instance LIKE $1"
    wait_until(lambda: scalar(split.owner_url, ticks, "%") >= 5, 20, "probe runs")
    a.signal(signal.SIGKILL)
    a.wait()
    assert publish_some(split, "after-kill") == {"b"}
    by_b = "scheduler-daemon/b/%"
    wait_until(lambda: scalar(split.owner_url, ticks, by_b) >= 5, 20, "b running the probe")
    stop_all([b])
    for process in (a, b):
        assert "permission denied for table scheduler_" not in process.output(), process.name
    assert_no_overlap(run_sync(pg_ticks(split.owner_url)), min_ticks=10)
