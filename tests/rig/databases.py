"""Databases for tests: one per test, cloned from a migrated template, dropped with a leak check.

The admin helpers are coroutines (asyncpg); fixtures call them through ``run_sync``,
which runs each on a private event loop in a worker thread, so they work the same
from sync fixtures, sync tests and async tests, whatever loop pytest-asyncio runs.
"""

from __future__ import annotations

import asyncio
import secrets
import sqlite3
import time
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from rig.pgcluster import PgCluster
from rig.processes import run_cli

T = TypeVar("T")

# Names the rig's own sessions in pg_stat_activity, so a leak report never blames it.
RIG_APPLICATION_NAME = "scheduler-test-rig"
RIG_APP = {"application_name": RIG_APPLICATION_NAME}  # asyncpg's server_settings for it


@dataclass(frozen=True)
class PgServer:
    """The PostgreSQL server the tests use: a throwaway cluster or an external one.

    ``admin_dsn`` may CREATE/DROP DATABASE. ``cluster`` is None for an external server
    (``SCHEDULER_TEST_DATABASE_URL``), which the rig must not restart or kill.
    """

    admin_dsn: str
    cluster: PgCluster | None

    @property
    def host(self) -> str:
        return urlsplit(self.admin_dsn).hostname or "localhost"

    @property
    def port(self) -> int:
        return urlsplit(self.admin_dsn).port or 5432

    def dsn_for(self, dbname: str) -> str:
        return replace_dbname(self.admin_dsn, dbname)

    def ensure_running(self) -> None:
        """Start the cluster again if a test left it stopped or killed."""
        if self.cluster is not None and not self.cluster.is_running():
            self.cluster.start()


def replace_dbname(dsn: str, dbname: str) -> str:
    return urlunsplit(urlsplit(dsn)._replace(path=f"/{dbname}"))


def replace_host_port(dsn: str, host: str, port: int) -> str:
    """`dsn` pointed at another address (a TcpProxy, say), same user and database."""
    parts = urlsplit(dsn)
    userinfo = parts.netloc.rpartition("@")[0]
    netloc = f"{userinfo}@{host}:{port}" if userinfo else f"{host}:{port}"
    return urlunsplit(parts._replace(netloc=netloc))


def replace_user(dsn: str, user: str) -> str:
    """`dsn` logging in as another role (no password: the rig's cluster trusts local TCP)."""
    parts = urlsplit(dsn)
    hostport = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}@{hostport}"))


def new_database_name(prefix: str = "t_") -> str:
    return f"{prefix}{secrets.token_hex(6)}"


def with_user(dsn: str, user: str, password: str | None = None) -> str:
    """`dsn` logging in as `user` (with `password`, if given) instead."""
    parts = urlsplit(dsn)
    userinfo = user if password is None else f"{user}:{password}"
    return urlunsplit(parts._replace(netloc=f"{userinfo}@{parts.hostname}:{parts.port}"))


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` to completion on a fresh event loop in a worker thread."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="rig-admin") as pool:
        return pool.submit(asyncio.run, coro).result()


def _quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


async def _connect_admin(admin_dsn: str) -> asyncpg.Connection:
    return await asyncpg.connect(
        admin_dsn, server_settings={"application_name": RIG_APPLICATION_NAME}
    )


async def create_database(admin_dsn: str, dbname: str, *, template: str | None = None) -> None:
    statement = f"CREATE DATABASE {_quote_ident(dbname)}"
    if template is not None:
        statement += f" TEMPLATE {_quote_ident(template)}"
    conn = await _connect_admin(admin_dsn)
    try:
        await conn.execute(statement)
    finally:
        await conn.close()


async def drop_database(admin_dsn: str, dbname: str, *, grace: float = 10.0) -> list[str]:
    """Drop `dbname` (if it exists) once its clients have gone; return the leaks.

    Waits up to `grace` seconds for the sessions on `dbname` to end, since a client
    that just closed its connection can linger a moment server-side. Sessions still
    there after that are leaked connections: their ``application_name``s are returned
    ("" for one that set none), and ``DROP ... WITH (FORCE)`` terminates them.
    """
    conn = await _connect_admin(admin_dsn)
    try:
        deadline = time.monotonic() + grace
        while True:
            leaked = await _sessions_on(conn, dbname)
            if not leaked or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.05)
        await conn.execute(f"DROP DATABASE IF EXISTS {_quote_ident(dbname)} WITH (FORCE)")
    finally:
        await conn.close()
    return leaked


async def _sessions_on(conn: asyncpg.Connection, dbname: str) -> list[str]:
    rows = await conn.fetch(
        "SELECT application_name FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
        dbname,
    )
    return sorted(row["application_name"] for row in rows)


def migrate(database_url: str) -> None:
    """Build the schema with the product's public CLI: `scheduler-daemon migrate`.

    The rig's only dependency on the product, so the schema under test is exactly what
    users get.
    """
    result = run_cli(["migrate"], {"SCHEDULER_DATABASE_URL": database_url}, timeout=120)
    if result.returncode != 0:
        raise RuntimeError(
            f"`scheduler-daemon migrate` exited {result.returncode} for {database_url}\n"
            f"--- stdout ---\n{result.stdout}--- stderr ---\n{result.stderr}"
        )


def sqlite_url_for(path: Path) -> str:
    """``sqlite:////abs/path``: three slashes of the scheme, then an absolute path."""
    return f"sqlite:///{path.resolve()}"


def copy_sqlite(source: Path, target: Path) -> None:
    """Copy a SQLite database consistently, including anything still in its WAL."""
    if not source.exists():
        raise FileNotFoundError(source)
    with closing(sqlite3.connect(source)) as src, closing(sqlite3.connect(target)) as dst:
        src.backup(dst)


async def migrate_up_to(conn: asyncpg.Connection, version: int) -> None:
    """The PostgreSQL migrations up to ``version``, recorded, as an older release's
    `migrate` left its database: for tests and benchmarks of an upgrade from it."""
    from scheduler_daemon.db.sqlfiles import migrations

    await conn.execute(
        "CREATE TABLE scheduler_schema_version (version integer PRIMARY KEY, "
        "name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
    )
    for migration in migrations("postgres"):
        if migration.version <= version:
            await conn.execute(migration.sql)
            await conn.execute(
                "INSERT INTO scheduler_schema_version VALUES ($1, $2)",
                migration.version,
                migration.name,
            )
