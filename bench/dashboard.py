"""Operator views at a million (issue 30): each dashboard page's time over HTTP, and
`scheduler-daemon status`'s, with 1,000,000 runtime schedules, 3,000,000 runs and
1,000,000 publications.

One database of the durable throwaway cluster (bench/common.py), with the en-US ICU
collation where the server has ICU: production databases mostly sort by a language's
rules, in which a prefix of names is not one range of the primary key (migration 0013).
The schedules are bench/scale.py's (`add_runtime_schedules`: runtime rows naming
`growth_tasks:noop`, an hour away); the runs (one in 1,000 failed) and the publications
(half done, half scheduled an hour away or later) come from generate_series; then
VACUUM ANALYZE, as autovacuum leaves a table. One replica (`run`, both loops, HTTP on)
leads, idle, and serves the dashboard; each page is fetched `fetches` times in turn: the
first fetch (a statement's first run plans it; a page's first render loads its template)
and the median and max of them all. Then, the replica stopped, `status` and `status
--json`, as processes (Python's start and imports included: about 0.3 s here), first with
nothing due, then with every schedule due (a backlog of a million: what status counts).

Before and after a change, the same data: `--code DIR` runs the daemon, `migrate` and
`status` from another source tree (a checkout of an earlier commit), and `--legacy`
fetches the pages by the addresses the dashboard had before keyset paging (`offset=`, a
substring search); such a run is saved under OUT/before/, and shown beside the next one.

    python -m bench.dashboard [--quick] [--out DIR] [--code DIR --legacy]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import asyncpg

from bench.common import (
    RESULTS,
    ROOT,
    admin_dsn,
    drop_database,
    save_results,
    start_daemon,
    stop_daemon,
)
from bench.growth import code_version, fresh_log, wait_leading
from bench.scale import NOOP, RUNNABLE, add_runtime_schedules, free_port, names

NAME = "dashboard_million"
DB = "bench_dashboard"
STATUS_RUNS = 5
PAGE = 50  # the dashboard's page size (dashboard/views.py)


@dataclass(frozen=True)
class Sizes:
    schedules: int = 1_000_000
    runs: int = 3_000_000
    publications: int = 1_000_000  # half done, half scheduled
    fetches: int = 10


QUICK = Sizes(schedules=20_000, runs=60_000, publications=20_000, fetches=4)


@dataclass(frozen=True)
class Case:
    """One page: what it shows, its address now, and before keyset paging (None: the same)."""

    label: str
    path: str
    legacy: str | None = None


def cases(sizes: Sizes, sorted_names: list[str], run_ids: tuple[int, int]) -> list[Case]:
    """The pages measured, addressed by what the data holds: the middle name in byte
    order, a name of the longest kind (its prefix search finds it alone), a prefix of
    about a hundred names, a run and a publication halfway down their lists."""
    n = len(sorted_names)
    middle = sorted_names[n // 2]
    one = sorted_names[-1]  # the longest names sort last among names of equal start
    prefix = middle[:5]
    run_mid, failed_mid = run_ids
    done = sizes.publications // 2
    return [
        Case("cluster (`/`)", "/"),
        Case("schedules: first page", "/schedules"),
        Case("schedules: the middle (page after the middle name)",
             f"/schedules?after={middle}", f"/schedules?offset={n // 2}"),
        Case("schedules: the page before the middle",
             f"/schedules?before={middle}", f"/schedules?offset={n // 2 - PAGE}"),
        Case("schedules: last page", "/schedules?last=1", f"/schedules?offset={n - PAGE}"),
        Case(f"search, one name ({one!r})", f"/schedules?q={one}"),
        Case(f"search, a prefix of {sum(s.startswith(prefix) for s in sorted_names)} names "
             f"({prefix!r})", f"/schedules?q={prefix}"),
        Case("search, the next page of it", f"/schedules?q={prefix}&after={prefix}5",
             f"/schedules?q={prefix}&offset={PAGE}"),
        Case("search, no match", "/schedules?q=nothing-here"),
        Case("one schedule and its runs", f"/schedules/{middle}"),
        Case("runs: newest (timeline of 2,000)", "/runs"),
        Case("runs: halfway down", f"/runs?before={run_mid}"),
        Case("failed runs: newest", "/runs?failed=1"),
        Case("failed runs: halfway down", f"/runs?failed=1&before={failed_mid}"),
        Case("one run", f"/runs/{run_mid}"),
        Case("publications: soonest", "/publications"),
        Case("publications: halfway down", f"/publications?after={done + done // 2}",
             f"/publications?offset={done // 2}"),
        Case("publications done: latest", "/publications?view=recent"),
        Case("publications done: halfway down", f"/publications?view=recent&after={done // 2}",
             f"/publications?view=recent&offset={done // 2}"),
        Case("publications cancelled: latest", "/publications?view=recent&status=cancelled"),
    ]  # fmt: skip


# --- the data --------------------------------------------------------------------------


async def create_database(admin: str) -> tuple[str, str]:
    """A fresh database, en-US (ICU) where the server can; its DSN and its collation."""
    conn = await asyncpg.connect(admin)
    try:
        try:
            await conn.execute(
                f"CREATE DATABASE {DB} TEMPLATE template0 LOCALE_PROVIDER icu "
                "ICU_LOCALE 'en-US' LOCALE 'C.UTF-8'"
            )
            collation = "en-US (ICU)"
        except asyncpg.PostgresError:  # no ICU, or before PostgreSQL 15
            await conn.execute(f"CREATE DATABASE {DB}")
            collation = await conn.fetchval(
                "SELECT datcollate FROM pg_database WHERE datname = current_database()"
            )
    finally:
        await conn.close()
    return admin.rsplit("/", 1)[0] + f"/{DB}", collation


def cli(code: Path, dsn: str, *args: str) -> None:
    """`scheduler-daemon ARGS` of the tree at `code`, to completion."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SCHEDULER_")}
    env |= {"SCHEDULER_DATABASE_URL": dsn, "PYTHONPATH": str(code)}
    done = subprocess.run(
        [sys.executable, "-m", "scheduler_daemon", *args],
        env=env, cwd=code, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"scheduler-daemon {' '.join(args)}: {done.stderr}")


async def fill(conn: asyncpg.Connection, sizes: Sizes) -> dict[str, float]:
    """The schedules, runs and publications; seconds each took."""
    took: dict[str, float] = {}
    started = time.monotonic()
    await add_runtime_schedules(conn, sizes.schedules, NOOP, runnable=RUNNABLE)
    took["schedules"] = time.monotonic() - started
    started = time.monotonic()
    chunk = 500_000
    for first in range(1, sizes.runs + 1, chunk):
        # Run g of schedule g % N (named as names() names it: lpad alone would cut a
        # longer number), 10 ms apart up to now: ids grow with started_at.
        await conn.execute(
            "INSERT INTO scheduler_plugin_runs "
            "(name, slot, instance, started_at, finished_at, status, error) "
            "SELECT 's' || lpad(i.n, greatest(5, length(i.n)), '0'), s, 'bench', s, "
            "s + interval '1 millisecond', "
            "CASE WHEN g % 1000 = 0 THEN 'failed' ELSE 'succeeded' END, "
            "CASE WHEN g % 1000 = 0 THEN 'boom' END "
            "FROM generate_series($1::bigint, $2::bigint) g, "
            "LATERAL (SELECT (g % $3)::text AS n) i, "
            "LATERAL (SELECT date_trunc('second', now()) "
            "  - make_interval(secs => ($4 - g) * 0.01) AS s) slot",
            first, min(first + chunk - 1, sizes.runs), sizes.schedules, sizes.runs,
        )  # fmt: skip
    took["runs"] = time.monotonic() - started
    started = time.monotonic()
    done = sizes.publications // 2
    # Done, one a second back from now (ids 1..done: the latest first); 1 in 50
    # cancelled, 1 in 100 failed. Then scheduled, one a second from an hour ahead.
    await conn.execute(
        "INSERT INTO scheduler_publications "
        "(key, publish_at, status, published_at, published_by, attempts) "
        "SELECT 'done-' || g, now() - make_interval(secs => g), s, "
        "CASE WHEN s = 'cancelled' THEN NULL ELSE now() - make_interval(secs => g - 0.005) END, "
        "CASE WHEN s = 'cancelled' THEN NULL ELSE 'bench' END, 1 "
        "FROM generate_series(1, $1) g, LATERAL (SELECT CASE WHEN g % 100 = 0 THEN 'failed' "
        "  WHEN g % 50 = 0 THEN 'cancelled' ELSE 'published' END AS s) st",
        done,
    )
    await conn.execute(
        "INSERT INTO scheduler_publications (key, publish_at) "
        "SELECT 'due-' || g, now() + interval '1 hour' + make_interval(secs => g) "
        "FROM generate_series(1, $1) g",
        sizes.publications - done,
    )
    took["publications"] = time.monotonic() - started
    started = time.monotonic()
    await conn.execute("VACUUM ANALYZE")
    took["vacuum"] = time.monotonic() - started
    return took


async def name_index_build(conn: asyncpg.Connection, code: Path) -> float | None:
    """How long migration 0013's index takes to build on these schedules (dropped and
    built again by the migration's own statements, one at a time as `migrate` runs them:
    CONCURRENTLY, outside a transaction); None where the tree has no such index."""
    folder = code / "scheduler_daemon/migrations/postgres"
    migration = next(folder.glob("*_schedule_names.sql"), None)
    if migration is None:
        return None
    lines = [line for line in migration.read_text().splitlines() if not line.startswith("--")]
    statements = [s.strip() for s in "\n".join(lines).split(";") if s.strip()]
    await conn.execute("DROP INDEX scheduler_plugin_tasks_name_c_idx")
    started = time.monotonic()
    for statement in statements:
        await conn.execute(statement)
    return time.monotonic() - started


async def run_ids(conn: asyncpg.Connection) -> tuple[int, int]:
    """A run halfway down the history, and a failed one halfway down the failures."""
    row = await conn.fetchrow(
        "SELECT (SELECT id FROM scheduler_plugin_runs ORDER BY id "
        "        OFFSET (SELECT count(*) / 2 FROM scheduler_plugin_runs) LIMIT 1) AS mid, "
        "       (SELECT id FROM scheduler_plugin_runs WHERE status = 'failed' ORDER BY id "
        "        OFFSET (SELECT count(*) / 2 FROM scheduler_plugin_runs "
        "                WHERE status = 'failed') LIMIT 1) AS failed"
    )
    return int(row["mid"]), int(row["failed"])


# --- measuring -------------------------------------------------------------------------


def fetch(url: str) -> tuple[float, int, int]:
    """Seconds until the whole page arrived, its status, and its table rows."""
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            body, status = response.read(), int(response.status)
    except urllib.error.HTTPError as error:
        body, status = error.read(), int(error.code)
    took = time.perf_counter() - started
    rows = len(re.findall(rb"<tr[ >]", body)) - len(re.findall(rb"<thead>", body))
    return took, status, rows


def wait_http(base: str, daemon: subprocess.Popen[bytes], within: float = 120.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if daemon.poll() is not None:
            raise RuntimeError(f"the replica exited {daemon.returncode}")
        try:
            with urllib.request.urlopen(base + "/healthz", timeout=5):
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError("the replica's HTTP server did not answer")


def measure_pages(base: str, pages: list[Case], fetches: int, legacy: bool) -> list[dict[str, Any]]:
    measured = []
    for case in pages:
        path = case.legacy if legacy and case.legacy is not None else case.path
        got = [fetch(base + path) for _ in range(fetches)]
        times = [t for t, _, _ in got]
        measured.append(
            {
                "label": case.label,
                "path": path,
                "status": got[-1][1],
                "rows": got[-1][2],
                "first_s": times[0],
                "median_s": statistics.median(times),
                "max_s": max(times),
            }
        )
        print(f"  {case.label}: {statistics.median(times) * 1000:.0f} ms", flush=True)
    return measured


def time_status(code: Path, dsn: str) -> dict[str, Any]:
    """`status` and `status --json`, STATUS_RUNS times each, as processes; and `--help`,
    which starts Python and imports what `status` does but reads no database."""
    timed: dict[str, Any] = {}
    for args in (["--help"], ["status"], ["status", "--json"]):
        times = []
        for _ in range(STATUS_RUNS):
            started = time.perf_counter()
            cli(code, dsn, *args)
            times.append(time.perf_counter() - started)
        timed[" ".join(args)] = {"median_s": statistics.median(times), "max_s": max(times)}
    return timed


async def all_due(conn: asyncpg.Connection) -> None:
    await conn.execute(
        "UPDATE scheduler_plugin_tasks SET next_run_at = now() - interval '1 hour' "
        "WHERE target IS NOT NULL"
    )
    await conn.execute("VACUUM ANALYZE scheduler_plugin_tasks")


async def run(admin: str, workdir: Path, sizes: Sizes, code: Path, legacy: bool) -> dict[str, Any]:
    await drop_database(admin, DB, grace=0)
    dsn, collation = await create_database(admin)
    cli(code, dsn, "migrate")
    conn = await asyncpg.connect(dsn)
    try:
        took = await fill(conn, sizes)
        index_s = await name_index_build(conn, code)
        pages = cases(sizes, sorted(names(sizes.schedules)), await run_ids(conn))
        port = free_port()
        fresh_log(workdir)
        env = {
            "SCHEDULER_HTTP__ENABLED": "true",
            "SCHEDULER_HTTP__PORT": str(port),
            "SCHEDULER_PLUGIN__RUNNABLE": f'["{NOOP}"]',
            "PYTHONPATH": os.pathsep.join([str(code), str(ROOT / "bench")]),
        }
        daemon = start_daemon(dsn, workdir, only=None, env=env)
        try:
            await wait_leading(conn, daemon, "plugin", workdir)
            wait_http(f"http://127.0.0.1:{port}", daemon)
            measured = measure_pages(f"http://127.0.0.1:{port}", pages, sizes.fetches, legacy)
            load = os.getloadavg()[0]  # the machine is shared: what else ran meanwhile
        finally:
            stop_daemon(daemon)
        status = {"nothing due": time_status(code, dsn)}
        await all_due(conn)
        status["every schedule due"] = time_status(code, dsn)
    finally:
        await conn.close()
        await drop_database(admin, DB, grace=0)
    return {
        "sizes": asdict(sizes),
        "collation": collation,
        "code": str(code),
        "code_version": code_version() if code == ROOT else None,
        "legacy": legacy,
        "fill_s": took,
        "name_index_build_s": index_s,
        "pages": measured,
        "load": load,
        "status": status,
    }


# --- the report ------------------------------------------------------------------------


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:,.0f} ms"


def report(results: dict[str, Any], before: dict[str, Any] | None = None) -> str:
    s = results["sizes"]
    lines = [
        f"# Dashboard and status at {s['schedules']:,} schedules ({results['date']}, "
        f"{results['machine']})",
        "",
        f"{s['schedules']:,} runtime schedules, {s['runs']:,} runs (1 in 1,000 failed), "
        f"{s['publications']:,} publications (half done, half scheduled); database collation "
        f"{results['collation']}. One idle replica serves the pages over HTTP (loopback); "
        f"each page fetched {s['fetches']} times in turn: the first fetch, the median and the "
        f"max, whole page received (load average {results['load']:.1f} on 2 cores after "
        "them). `python -m bench.dashboard`.",
        "",
    ]
    old = {p["label"]: p for p in before["pages"]} if before else {}
    head = "| page | address | rows | first | median | max |"
    rule = "|---|---|---|---|---|---|"
    if old:
        head = "| page | address | rows | first | median | max | before: address | median | max |"
        rule += "---|---|---|"
    lines += [head, rule]
    for page in results["pages"]:
        row = (
            f"| {page['label']} | `{page['path']}` | {page['rows']} | {ms(page['first_s'])} "
            f"| {ms(page['median_s'])} | {ms(page['max_s'])} |"
        )
        if old:
            was = old.get(page["label"])
            row += (
                f" `{was['path']}` | {ms(was['median_s'])} | {ms(was['max_s'])} |"
                if was
                else " - | - | - |"
            )
        lines.append(row)
    lines += ["", "`scheduler-daemon status`, as a process: Python's start and imports "
              "included, which `--help` shows alone (it reads no database).", ""]  # fmt: skip
    lines += ["| when | command | median | max |" + (" before: median | max |" if old else ""),
              "|---|---|---|---|" + ("---|---|" if old else "")]  # fmt: skip
    for when, commands in results["status"].items():
        for command, timed in commands.items():
            row = f"| {when} | `{command}` | {ms(timed['median_s'])} | {ms(timed['max_s'])} |"
            if old:
                was = before["status"][when][command] if before else None
                row += f" {ms(was['median_s'])} | {ms(was['max_s'])} |" if was else " - | - |"
            lines.append(row)
    if results["name_index_build_s"] is not None:
        lines += [
            "",
            f'Migration 0013 (the index on `name COLLATE "C"`) built in '
            f"{results['name_index_build_s']:.2f} s at {s['schedules']:,} schedules, "
            "concurrently: writers of scheduler_plugin_tasks go on meanwhile.",
        ]
    if before:
        lines += [
            "",
            f"Before: {before['date']}, the daemon of `{before['code']}` (load average "
            f"{before['load']:.1f}), the addresses as the dashboard had them then (`offset=`; "
            "`q` a substring, any case): `python -m bench.dashboard --code DIR --legacy`, DIR "
            "a checkout of the earlier commit, then `python -m bench.dashboard`.",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.dashboard")
    parser.add_argument("--quick", action="store_true", help="20,000 schedules")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--code", type=Path, default=ROOT, help="the daemon's source tree")
    parser.add_argument("--legacy", action="store_true", help="the addresses before keyset")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else Sizes()
    code = args.code.resolve()
    with ExitStack() as stack:
        results = asyncio.run(
            run(admin_dsn(stack), RESULTS / ".work" / "dashboard", sizes, code, args.legacy)
        )
    if args.legacy:  # apart, where docs/performance.md shows no block of it
        save_results(NAME, results, report, args.out / "before")
        return
    before_file = args.out / "before" / f"{NAME}.json"
    before = json.loads(before_file.read_text()) if before_file.exists() else None
    if before is not None and before["sizes"] != results["sizes"]:
        before = None  # another size: nothing to compare with
    save_results(NAME, results, lambda r: report(r, before), args.out)


if __name__ == "__main__":
    main()
