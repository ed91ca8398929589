"""What an idle cluster of ours costs the database, by configuration, and what it cost
before the idle-cost work (issue 12 item 6), measured in the same run.

Each configuration: three real replicas (`scheduler-daemon run`) on a fresh database of
the durable throwaway cluster, nothing due (the plugin loop has one task whose cron is
midnight on 1 January, and the built-in purge is disabled), left to settle, then a window
over which every statement their sessions send is read from the server's log
(``log_statement = 'all'`` on that database) and counted as transactions the way
bench/peers.py does (``account_log``: pg_stat_database's counters are flushed too late to
measure a window, see there). Also: the server's ERROR lines, connections, CPU and RSS
per replica.

"before" is the daemon as of commit ``BEFORE`` (the last before the idle-cost work),
taken with ``git archive`` and run from its own copy (PYTHONPATH), on a database it
migrates itself; "before quiet proofs" the same for ``BEFORE_QUIET`` (the last before a
leader with no work running proved only every ``lock.quiet_proof_interval``). The heartbeat rows are the trade-off the issue asks for: each
``lock.heartbeat_interval`` with what it means for detection, from the timing arithmetic
config/timing.py checks (step-down, work stopped, the earliest the server frees a cut-off
leader's lock, stall eviction).

    python -m bench.idle [--quick] [--out DIR]
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg

from bench.common import (
    ROOT,
    admin_dsn,
    bench_arguments,
    create_database,
    drop_database,
    fresh_database,
    save_results,
    start_daemon,
)
from bench.peers import ServerLog, account_log, cpu_seconds, find_log, memory_mb, tree
from scheduler_daemon.config.timing import LockSettings

BEFORE = "3d01da6"  # the last commit before the idle-cost work
BEFORE_QUIET = "7f451d9"  # the last commit before quiet leaders' proofs (issue 20 item 10)
REPLICAS = 3
IDLE_TASK = [{"name": "yearly", "cron": "0 0 1 1 *", "sql": "SELECT 1"}]


@dataclass(frozen=True)
class Config:
    name: str
    label: str
    loops: str  # "both" or one loop
    env: dict[str, str] = field(default_factory=dict)
    before: str | None = None  # run the daemon of this commit


CONFIGS = (
    Config("before-plugin", f"before ({BEFORE}), plugin loop", "plugin", before=BEFORE),
    Config("before-both", f"before ({BEFORE}), both loops", "both", before=BEFORE),
    Config("quiet-before-both", f"before quiet proofs ({BEFORE_QUIET}), both loops", "both", before=BEFORE_QUIET),
    Config("plugin", "plugin loop (defaults)", "plugin"),
    Config("both", "both loops (defaults)", "both"),
    Config("both-hb1", "both loops, heartbeat 1 s", "both", {"SCHEDULER_LOCK__HEARTBEAT_INTERVAL": "1"}),
    Config("both-hb3", "both loops, heartbeat 3 s", "both", {"SCHEDULER_LOCK__HEARTBEAT_INTERVAL": "3"}),
    Config("both-poll", "both loops, polling standbys", "both", {"SCHEDULER_LOCK__STANDBY": "poll"}),
    Config(
        "both-transaction", "both loops, transaction mode", "both", {"SCHEDULER_LOCK__MODE": "transaction"}
    ),
)  # fmt: skip
QUICK_CONFIGS = ("quiet-before-both", "plugin", "both")


@dataclass(frozen=True)
class Sizes:
    settle: float = 8.0  # s from the last start to the window
    window: float = 30.0  # six quiet proofs per leading loop


QUICK = Sizes(settle=5.0, window=8.0)


def extract_before(into: Path, commit: str) -> Path:
    """scheduler_daemon/ as of `commit`, under `into` (to go first on PYTHONPATH)."""
    into = into / commit
    into.mkdir(parents=True, exist_ok=True)
    archive = into / "before.tar"
    subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--output", str(archive), commit, "scheduler_daemon"],
        check=True,
    )
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into


def start(
    dsn: str, config: Config, workdir: Path, before: Path | None
) -> list[subprocess.Popen[bytes]]:
    env = {
        "SCHEDULER_PLUGIN__TASKS": json.dumps(IDLE_TASK),
        "SCHEDULER_PLUGIN__DISABLED": json.dumps(["purge_publications"]),
        **config.env,
    }
    if before is not None:
        env["PYTHONPATH"] = str(before)
    only = None if config.loops == "both" else config.loops
    return [
        start_daemon(
            dsn,
            workdir / f"r{n}",
            only=only,
            env=env | {"SCHEDULER_INSTANCE_ID": f"{config.name}-{n}"},
        )
        for n in range(REPLICAS)
    ]


async def measure(
    admin: str, config: Config, sizes: Sizes, log: ServerLog, work: Path
) -> dict[str, Any]:
    name = f"bench_idle_{config.name.replace('-', '_')}"
    if config.before:  # its own migrations, run by itself
        await drop_database(admin, name, grace=0)
        await create_database(admin, name)
        dsn = admin.rsplit("/", 1)[0] + f"/{name}"
    else:
        dsn = await fresh_database(admin, name)
    observer = await asyncpg.connect(admin)
    try:
        await observer.execute(f"ALTER DATABASE \"{name}\" SET log_statement = 'all'")
        processes = start(
            dsn,
            config,
            work / config.name,
            extract_before(work, config.before) if config.before else None,
        )
        try:
            await asyncio.sleep(sizes.settle)
            pids = {p.pid: tree(p.pid) for p in processes}
            cpu_before = {pid: cpu_seconds(members) for pid, members in pids.items()}
            offset = log.offset()
            began = time.monotonic()
            await asyncio.sleep(sizes.window)
            elapsed = time.monotonic() - began
            lines = log.lines_since(offset)
            connections = await observer.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = $1", name
            )
            cpu = [
                100 * (cpu_seconds(members) - cpu_before[pid]) / elapsed
                for pid, members in pids.items()
            ]
            rss = [memory_mb(pid)[0] for pid in pids]
            dead = [p.pid for p in processes if p.poll() is not None]
        finally:
            for process in processes:
                if process.poll() is None:
                    process.send_signal(signal.SIGTERM)
            for process in processes:
                process.wait(timeout=60)
        if dead:
            raise RuntimeError(f"{config.name}: a replica exited early; see {work / config.name}")
    finally:
        await observer.close()
    await drop_database(admin, name, grace=0)
    tally = account_log(lines, {}, {"ours": name}).get("ours", {})
    result: dict[str, Any] = {
        "label": config.label,
        "window_s": elapsed,
        "transactions_per_s": tally.get("transactions", 0) / elapsed,
        "statements_per_s": tally.get("statements", 0) / elapsed,
        "server_error_lines": tally.get("errors", 0),
        "server_error_examples": tally.get("error_examples", []),
        "top_statements": tally.get("top", []),
        "connections": connections,
        "cpu_percent_per_replica": sum(cpu) / len(cpu),
        "rss_mb_per_replica": sum(rss) / len(rss),
    }
    if not config.before:
        lock = LockSettings(**{k.removeprefix("SCHEDULER_LOCK__").lower(): v for k, v in config.env.items() if k.startswith("SCHEDULER_LOCK__")})  # type: ignore[arg-type]  # fmt: skip
        result["timings"] = {
            "heartbeat_interval": lock.heartbeat_interval,
            "step_down_after": lock.step_down_after,
            "quiet_proof_interval": lock.quiet_proof_interval,
            "work_stopped_after": lock.stopped_after,
            "server_frees_cut_leader_after": lock.server_frees_lock_after,
            "stall_eviction_after": lock.stall_timeout,
        }
    return result


async def run(admin: str, sizes: Sizes, configs: list[Config], work: Path) -> dict[str, Any]:
    log = await find_log(admin)
    if log.path is None:
        sys.exit(
            "bench.idle: needs the throwaway cluster's server log (not SCHEDULER_BENCH_DATABASE_URL)"
        )
    results: dict[str, Any] = {
        "replicas": REPLICAS, "window_s": sizes.window, "before": BEFORE,
        "before_quiet": BEFORE_QUIET,
    }  # fmt: skip
    for config in configs:
        print(f"bench.idle: {config.label}", flush=True)
        results[config.name] = await measure(admin, config, sizes, log, work)
    return results


def report(results: dict[str, Any]) -> str:
    rows = [name for name in (c.name for c in CONFIGS) if name in results]
    lines = [
        f"# Idle cost of ours, by configuration ({results['date']}, {results['machine']})",
        "",
        f"{results['replicas']} idle replicas (nothing due), {results['window_s']:g} s window; "
        "transactions counted from the server's statement log. `before`: the daemon of "
        f"commit {results['before']}, the last before the idle-cost work, and `before quiet "
        f"proofs`: of {results.get('before_quiet', BEFORE_QUIET)}, the last before a leader "
        "with no work running proved at its own pace, in the same run.",
        "",
        "| configuration | transactions/s, all replicas | server ERROR lines | connections | CPU per replica | RSS per replica | what the idle work is |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in rows:
        r = results[name]
        top = "; ".join(f"{t['count']} x `{t['statement'][:48]}`" for t in r["top_statements"][:2])
        lines.append(
            f"| {r['label']} | {r['transactions_per_s']:.2f} | {r['server_error_lines']} "
            f"| {r['connections']} | {r['cpu_percent_per_replica']:.2f}% "
            f"| {r['rss_mb_per_replica']:.0f} MB | {top or '—'} |"
        )
    lines += [
        "",
        "Heartbeat interval against detection (session mode; the other lock settings at "
        "their defaults, as config/timing.py checks them) and idle cost:",
        "",
        "| heartbeat | transactions/s, both loops | a working leader steps down within | its work stopped within | a leader with no work running proves every | and learns of a cut within | server frees a cut-off leader's lock after | a frozen leader is evicted after |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in ("both-hb1", "both", "both-hb3"):
        if name in results:
            t = results[name]["timings"]
            lines.append(
                f"| {t['heartbeat_interval']:g} s | {results[name]['transactions_per_s']:.2f} "
                f"| {t['step_down_after']:g} s | {t['work_stopped_after']:g} s "
                f"| {t['quiet_proof_interval']:g} s "
                f"| {t['quiet_proof_interval'] + t['heartbeat_interval']:g} s "
                f"| ≥ {t['server_frees_cut_leader_after']:g} s | {t['stall_eviction_after']:g} s |"
            )
    return "\n".join([*lines, ""])


def main(argv: list[str] | None = None) -> None:
    args = bench_arguments("bench.idle", argv)
    sizes = QUICK if args.quick else Sizes()
    configs = [c for c in CONFIGS if not args.quick or c.name in QUICK_CONFIGS]
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="bench-idle-") as tmp:
        results = asyncio.run(run(admin_dsn(stack), sizes, configs, Path(tmp)))
    save_results("idle", results, report, args.out)


if __name__ == "__main__":
    main()
