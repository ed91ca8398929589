"""What every benchmark shares: the cluster, a fresh database, a daemon process, and the
results files (JSON, markdown table, plots) under bench/results/ or --out."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT / "tests"))

from rig import netns  # noqa: E402,F401 (bench/latency.py: replicas behind real links)
from rig.databases import (  # noqa: E402
    create_database,
    drop_database,
    migrate,
    migrate_up_to,  # noqa: F401 (for benchmarks of an upgrade)
)
from rig.pgcluster import PgCluster, find_pg_bindir  # noqa: E402


def bench_arguments(prog: str, argv: list[str] | None) -> argparse.Namespace:
    """The flags every benchmark takes: --quick (a smoke run of about a minute in all)
    and --out (where the results go; bench/results/ by default)."""
    parser = argparse.ArgumentParser(prog=f"python -m {prog}")
    parser.add_argument("--quick", action="store_true", help="few trials, short runs")
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser.parse_args(argv)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def fresh_database(admin_dsn: str, name: str) -> str:
    await drop_database(admin_dsn, name, grace=0)
    await create_database(admin_dsn, name)
    dsn = admin_dsn.rsplit("/", 1)[0] + f"/{name}"
    await asyncio.to_thread(migrate, dsn)
    return dsn


def start_daemon(
    dsn: str,
    workdir: Path,
    interval: str = "1s",
    only: str | None = "publish",
    env: dict[str, str] | None = None,
    prefix: Sequence[str] = (),
) -> subprocess.Popen[bytes]:
    """A real `scheduler-daemon run` process, logging (JSON) to workdir/daemon.log.
    ``only``: the one loop it runs, its interval set to `interval`; None: both loops,
    at their configured intervals. ``prefix``: a command it runs under (`taskset -c 0`)."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("SCHEDULER_")}
    environment |= {
        "SCHEDULER_DATABASE_URL": dsn,
        "SCHEDULER_HTTP__ENABLED": "false",
        "SCHEDULER_LOG__LEVEL": "warning",
        "SCHEDULER_LOG__FORMAT": "json",
    }
    if only is not None:
        environment[f"SCHEDULER_{only.upper()}__INTERVAL"] = interval
    environment |= env or {}
    workdir.mkdir(parents=True, exist_ok=True)
    loops = [] if only is None else ["--only", only]
    with (workdir / "daemon.log").open("ab") as log:  # the child has its own copy
        return subprocess.Popen(
            [*prefix, sys.executable, "-m", "scheduler_daemon", "run", *loops],
            env=environment,
            cwd=workdir,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )


def stop_daemon(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=60)


# Durable, as in production: the test rig turns fsync off for speed, which would hide
# what a commit per row really costs.
DURABLE = {"fsync": "on", "full_page_writes": "on", "synchronous_commit": "on"}


def admin_dsn(stack: ExitStack, settings: dict[str, str] | None = None) -> str:
    """SCHEDULER_BENCH_DATABASE_URL, or a throwaway cluster that `stack` stops (with
    `settings` beside the durable ones: bench/sustained.py loads pg_stat_statements)."""
    dsn = os.environ.get("SCHEDULER_BENCH_DATABASE_URL")
    if dsn:
        return dsn
    bindir = find_pg_bindir()
    if bindir is None:
        sys.exit("bench: no PostgreSQL binaries and SCHEDULER_BENCH_DATABASE_URL unset")
    return stack.enter_context(PgCluster(bindir, settings=DURABLE | (settings or {}))).dsn()


def save_results(
    name: str,
    results: dict[str, Any],
    report: Callable[[dict[str, Any]], str],
    out: Path = RESULTS,
) -> None:
    """Stamp date and machine, write <out>/<name>.json and .md, print the table."""
    results["date"] = datetime.now(UTC).isoformat(timespec="seconds")
    results["machine"] = (
        f"{platform.machine()}, {os.cpu_count()} cpus, Python {platform.python_version()}"
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(results, indent=2) + "\n")
    text = report(results)
    (out / f"{name}.md").write_text(text)
    print(text)
