"""A leader across a real network: what round-trip time to PostgreSQL costs the work.

Per RTT case (0, 2, 10, 40 ms by default): a fresh database on a throwaway, durable
cluster listening on the host's end of the rig's links (tests/rig/netns.py), and three
replicas, real `scheduler-daemon run` processes (both loops, `database.pool_max_size`
10), each in a network namespace of its own: every connection crosses its link, which
delays each direction by RTT/2 (`Namespaces.impair`: a process holding the packets in a
netfilter queue, this kernel has no netem; at RTT 0 there is no such process).

The workload, all at once from T0; a WARMUP is left out, then the window is measured:

- **async**: 1,000 runtime schedules every 10 s (`add_schedule_in`), slots spread over
  the period, of `growth_tasks:probe` (bench/ on PYTHONPATH): it notes the wall clock as
  it is called, awaits 1 ms and appends one line to a file, outside the database.
  Lateness = that start - slot (one clock: the namespaces share the host's, and the
  database runs on it). Not run: the window's slots without a line GRACE after it;
  duplicates: a (schedule, slot) with two lines.
- **sql**: 20 declared `sql` tasks every 1 s (`SCHEDULER_PLUGIN__TASKS`), spread over the
  second by `jitter = 1s` (declared together they would share one phase). Each inserts
  its slot, read from its own `running` row of scheduler_plugin_runs (committed by the
  claim before the run starts; one per schedule at a time), with `now()` of its
  transaction into a table of the bench's: lateness = now() - slot.
- **publications**: one every 50 ms, `schedule_in` with `publish_at` = now + 1 s, each in
  its own transaction as an application would; `notify` publishes them: lateness =
  published_at - publish_at.

RTT measured: the median of 20 `SELECT 1` (asyncpg) from inside namespace 0, before the
workload and after the window (under load). The machine has 2 cores: the probe appends
one line per run, results are read after the window, and the CPU of the replicas and of
the delay processes is recorded (100% = one core).

    python -m bench.latency [--quick] [--out DIR] [--rtts 0,2,10,40] [--seconds N]

--seconds: the measured window of each case, after the warm-up (default 30; --quick:
RTTs 0 and 10, 10 s).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack, suppress
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg

from bench.common import (
    DURABLE,
    RESULTS,
    ROOT,
    PgCluster,
    drop_database,
    find_pg_bindir,
    fresh_database,
    netns,
    save_results,
    start_daemon,
)
from bench.growth import code_version, fmt_s, log_tail, summary
from bench.scale import stop_all
from scheduler_daemon.client import add_schedule_in, schedule_in

REPLICAS = 3
SCHEDULES = 1_000
PERIOD = 10.0  # s, each runtime schedule
SQL_TASKS = 20  # every 1 s
PUBLICATIONS = 20  # a second
WARMUP = 10.0  # s from T0 not measured: start-up, NOTIFY pickup, first slots
LEAD = 2.0  # s at least from the first add to T0: adding 1,000 takes about 0.5 s here
GRACE = 5.0  # s after the window before reading: late runs still count
PROBE = "growth_tasks:probe"
DB = "bench_latency"
SQL = (
    "INSERT INTO bench_latency_sql SELECT name, slot, now() FROM scheduler_plugin_runs "
    "WHERE name = '{name}' AND status = 'running'"
)
# Run inside a namespace. Its first SELECT prepares the statement, so that each one timed
# after it is a single round trip.
RTT_SCRIPT = """
import asyncio, statistics, sys, time, asyncpg
async def main():
    conn = await asyncpg.connect(sys.argv[1])
    await conn.fetchval("SELECT 1")
    times = []
    for _ in range(20):
        start = time.perf_counter()
        await conn.fetchval("SELECT 1")
        times.append(time.perf_counter() - start)
    print(statistics.median(times))
asyncio.run(main())
"""


def utc(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


def cpu_seconds(pids: Sequence[int]) -> float:
    total = 0.0
    for pid in pids:
        with suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def replica_env(probes: Path) -> dict[str, str]:
    tasks = [
        {"name": f"q{i:02d}", "every": "1s", "jitter": "1s", "sql": SQL.format(name=f"q{i:02d}")}
        for i in range(SQL_TASKS)
    ]
    return {
        "SCHEDULER_DATABASE__POOL_MAX_SIZE": "10",
        "SCHEDULER_PUBLISH__PUBLISHERS": '["notify"]',
        "SCHEDULER_PLUGIN__RUNNABLE": json.dumps([PROBE]),
        "SCHEDULER_PLUGIN__TASKS": json.dumps(tasks),
        "SCHEDULER_PLUGIN__ENTRY_POINTS": "false",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "bench"), str(ROOT)]),
        "BENCH_PROBES": str(probes),
    }


async def wait_ready(
    conn: asyncpg.Connection, replicas: Sequence[subprocess.Popen[bytes]], workdir: Path
) -> None:
    """Until both loops have a leader, the runnable target is published (the plugin
    leader's take-over) and every replica has a session open across its link."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for n, replica in enumerate(replicas):
            if replica.poll() is not None:
                tail = log_tail(workdir / f"r{n}")
                raise RuntimeError(f"replica r{n} exited {replica.returncode}:\n{tail}")
        ready = await conn.fetchval(
            "SELECT (SELECT count(*) FROM scheduler_leaders) = 2 "
            "AND EXISTS (SELECT 1 FROM scheduler_runnable_targets WHERE target = $1) "
            "AND (SELECT count(DISTINCT client_addr) FROM pg_stat_activity "
            "     WHERE datname = current_database() AND client_addr << $2::cidr) = $3",
            PROBE,
            netns.TRUSTED_NETWORK,
            len(replicas),
        )
        if ready:
            await asyncio.sleep(1.0)  # the take-over ticks' own work
            return
        await asyncio.sleep(0.2)
    raise TimeoutError(f"replicas not ready after 120 s: see {workdir}")


async def measure_rtt(net: netns.Namespaces, dsn: str) -> float:
    command = net.argv(0, [sys.executable, "-c", RTT_SCRIPT, net.dsn(0, dsn)])
    done = await asyncio.to_thread(
        subprocess.run, command, capture_output=True, text=True, timeout=120
    )
    if done.returncode != 0:
        raise RuntimeError(f"RTT probe failed: {done.stderr.strip()}")
    return float(done.stdout) * 1000


async def add_schedules(conn: asyncpg.Connection) -> tuple[float, float]:
    """The 1,000 schedules in one transaction, schedule i's first slot T0 + i * 10 ms
    (its phase from then on); returns (T0, seconds the adding took). T0 is a whole
    second, so that a window of whole seconds from it holds exactly seconds * 100 slots
    (and the sql tasks' seconds * 20), none on a float's edge."""
    started = time.time()
    t0 = float(math.ceil(started + LEAD))
    async with conn.transaction():
        for i in range(SCHEDULES):
            first = utc(t0 + i * PERIOD / SCHEDULES)
            await add_schedule_in(conn, f"p{i:04d}", target=PROBE, every=PERIOD, start=first)
    return t0, time.time() - started


async def feed(conn: asyncpg.Connection, until: float) -> None:
    """One publication every 1/PUBLICATIONS s, due 1 s after it is scheduled, as an
    application scheduling them one at a time would (each in its own transaction)."""
    step = 1.0 / PUBLICATIONS
    at = time.time()
    while at + 1.0 < until:
        await asyncio.sleep(max(0.0, at - time.time()))
        async with conn.transaction():
            await schedule_in(conn, utc(time.time() + 1.0))
        at += step


def read_probes(directory: Path) -> list[tuple[str, str, float, float]]:
    lines = []
    for path in directory.glob("*.probes"):
        for line in path.read_text().splitlines():
            instance, name, slot, started = line.split()
            lines.append((instance, name, float(slot), float(started)))
    return lines


def runs(
    records: Sequence[tuple[str, float, float]], start: float, end: float, expected: int
) -> dict[str, Any]:
    """(key, slot, ran at) records: rate in the window, lateness of the window's slots."""
    seen: set[tuple[str, float]] = set()
    late: list[float] = []
    for key, slot, at in records:
        if (key, round(slot, 3)) in seen:
            continue
        seen.add((key, round(slot, 3)))
        if start <= slot < end:
            late.append(at - slot)
    return {
        "runs_per_second": sum(start <= at < end for _, _, at in records) / (end - start),
        "lateness_s": summary(late),
        "slots_expected": expected,
        "slots_not_run": expected - len(late),
        "duplicates": len(records) - len(seen),
    }


async def case(
    admin: str, net: netns.Namespaces, rtt_ms: float, seconds: float, workdir: Path
) -> dict[str, Any]:
    for n in range(REPLICAS):
        if rtt_ms:
            net.impair(n, delay_ms=rtt_ms / 2)
        else:
            net.clear(n)
    shutil.rmtree(workdir, ignore_errors=True)
    probes = workdir / "probes"
    probes.mkdir(parents=True)
    dsn = await fresh_database(admin, DB)
    conn = await asyncpg.connect(dsn)
    await conn.execute(
        "CREATE TABLE bench_latency_sql (task text, slot timestamptz, at timestamptz)"
    )
    env = replica_env(probes)
    replicas = [
        start_daemon(net.dsn(n, dsn), workdir / f"r{n}", only=None,
                     env=env | {"SCHEDULER_INSTANCE_ID": f"r{n}"}, prefix=net.argv(n, []))
        for n in range(REPLICAS)
    ]  # fmt: skip
    delayers = [h.delayer.pid for h in net.hosts if h.delayer is not None]
    try:
        await wait_ready(conn, replicas, workdir)
        rtt_idle = await measure_rtt(net, dsn)
        t0, adding_s = await add_schedules(conn)
        start, end = t0 + WARMUP, t0 + WARMUP + seconds
        feeder = asyncio.create_task(feed(conn, end))
        await asyncio.sleep(max(0.0, start - time.time()))
        cpu_before = cpu_seconds([r.pid for r in replicas]), cpu_seconds(delayers)
        await asyncio.sleep(max(0.0, end - time.time()))
        cpu_after = cpu_seconds([r.pid for r in replicas]), cpu_seconds(delayers)
        load = os.getloadavg()[0]
        await feeder
        await asyncio.sleep(GRACE)
        rtt_loaded = await measure_rtt(net, dsn)
        exited = {f"r{n}": r.returncode for n, r in enumerate(replicas) if r.poll() is not None}
        probe_lines = read_probes(probes)
        sql_rows = await conn.fetch(
            "SELECT task, extract(epoch FROM slot)::float8 AS slot, "
            "extract(epoch FROM at)::float8 AS at FROM bench_latency_sql"
        )
        publications = await conn.fetch(
            "SELECT extract(epoch FROM published_at - publish_at)::float8 AS late "
            "FROM scheduler_publications "
            "WHERE publish_at >= to_timestamp($1::float8) AND publish_at < to_timestamp($2::float8)",
            start,
            end,
        )
        leaders = dict(await conn.fetch("SELECT loop, instance FROM scheduler_leaders"))
    finally:
        await asyncio.to_thread(stop_all, [r for r in replicas if r.poll() is None])
        await conn.close()
        await drop_database(admin, DB, grace=0)
    published = [r["late"] for r in publications if r["late"] is not None]
    return {
        "rtt_set_ms": rtt_ms,
        "rtt_idle_ms": rtt_idle,
        "rtt_loaded_ms": rtt_loaded,
        "adding_s": adding_s,
        "async": runs([(n, s, a) for _, n, s, a in probe_lines], start, end,
                      round(seconds * SCHEDULES / PERIOD)),
        "sql": runs([(r["task"], r["slot"], r["at"]) for r in sql_rows], start, end,
                    round(SQL_TASKS * seconds)),
        "publications": {
            "scheduled": len(publications),
            "not_published": len(publications) - len(published),
            "lateness_s": summary(published),
        },
        "plugin_runners": sorted({i for i, _, _, a in probe_lines if start <= a < end}),
        "leaders": leaders,
        "exited_early": exited,
        "replicas_cpu_percent": (cpu_after[0] - cpu_before[0]) / seconds * 100,
        "delay_cpu_percent": (cpu_after[1] - cpu_before[1]) / seconds * 100,
        "load_average": load,
    }  # fmt: skip


async def run(
    admin: str, net: netns.Namespaces, rtts: list[float], seconds: float
) -> dict[str, Any]:
    results: dict[str, Any] = {
        "code": code_version(),
        "replicas": REPLICAS,
        "seconds": seconds,
        "warmup_s": WARMUP,
        "cases": [],
    }
    for rtt in rtts:
        print(f"bench.latency: RTT {rtt:g} ms, {WARMUP:g} + {seconds:g} s", flush=True)
        r = await case(admin, net, rtt, seconds, RESULTS / ".work" / "latency" / f"rtt{rtt:g}")
        results["cases"].append(r)
        print(f"bench.latency:   {row(r)}", flush=True)
    return results


def row(r: dict[str, Any]) -> str:
    a, q, p = r["async"], r["sql"], r["publications"]
    dup = a["duplicates"] + q["duplicates"]
    return (
        f"| {r['rtt_set_ms']:g} ms | {r['rtt_idle_ms']:.1f} / {r['rtt_loaded_ms']:.1f} ms "
        f"| {a['runs_per_second']:.1f} | {fmt_s(a['lateness_s']['p50'])} "
        f"| {fmt_s(a['lateness_s']['p99'])} | {fmt_s(a['lateness_s']['max'])} "
        f"| {a['slots_not_run']} of {a['slots_expected']} | {q['runs_per_second']:.1f} "
        f"| {fmt_s(q['lateness_s']['p99'])} | {q['slots_not_run']} of {q['slots_expected']} "
        f"| {fmt_s(p['lateness_s']['p99'])} | {p['not_published']} of {p['scheduled']} "
        f"| {'**' + str(dup) + '**' if dup else 0} | {', '.join(r['plugin_runners']) or '-'} "
        f"/ {r['leaders'].get('publish', '-')} | {r['replicas_cpu_percent']:.0f}% "
        f"| {r['delay_cpu_percent']:.0f}% | {r['load_average']:.1f} |"
    )


def report(results: dict[str, Any]) -> str:
    code = results["code"]
    lines = [
        f"# A leader across a real network ({results['date']}, {results['machine']})",
        "",
        f"Commit {code['commit'][:12]}"
        + (f", with uncommitted changes to {', '.join(code['changed'])}" if code["changed"] else "")
        + f". {results['replicas']} replicas (`scheduler-daemon run`, both loops, pool 10), "
        "each in a network namespace whose link to PostgreSQL (durable, this host) delays "
        "each direction by RTT/2. All at once: 1,000 runtime schedules every 10 s of an "
        "async target awaiting 1 ms, 20 `sql` tasks every 1 s, 20 publications a second "
        f"(`notify`) due 1 s after scheduling; {results['seconds']:g} s measured after a "
        f"{results['warmup_s']:g} s warm-up. Lateness: async, the target's own start - slot; "
        "sql, `now()` of its transaction - slot; publications, published_at - publish_at. "
        "*Measured*: median `SELECT 1` from a namespace, idle / under load. *Runners*: the "
        "replicas whose async runs fell in the window / the publish leader. CPU: 100% = "
        "one core; *delay*: the rig's userspace delay processes. Method: bench/latency.py.",
        "",
        "| RTT | measured | async runs/s (of 100) | lateness p50 | p99 | max | not run "
        "| sql runs/s (of 20) | sql p99 | sql not run | publications p99 | not published "
        "| duplicates | runners | replicas CPU | delay CPU | load |",
        "|" + "---|" * 17,
        *[row(r) for r in results["cases"]],
        "",
    ]
    for r in results["cases"]:
        if len(r["plugin_runners"]) > 1:
            lines.append(f"- RTT {r['rtt_set_ms']:g} ms: the plugin loop changed hands in the "
                         "window: not a clean measurement.")  # fmt: skip
        if r["exited_early"]:
            lines.append(
                f"- RTT {r['rtt_set_ms']:g} ms: replicas exited early: {r['exited_early']}."
            )
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.latency")
    parser.add_argument("--quick", action="store_true", help="RTTs 0 and 10 ms, 10 s each")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--rtts", type=lambda s: [float(v) for v in s.split(",")])
    parser.add_argument("--seconds", type=float, help="measured window per case")
    args = parser.parse_args(argv)
    rtts = args.rtts or ([0.0, 10.0] if args.quick else [0.0, 2.0, 10.0, 40.0])
    seconds = args.seconds or (10.0 if args.quick else 30.0)
    why_not = netns.unavailable()
    bindir = find_pg_bindir()
    if why_not or bindir is None:
        sys.exit(f"bench.latency: {why_not or 'no PostgreSQL server binaries'}")
    with ExitStack() as stack:
        settings = DURABLE | {"listen_addresses": "*"}  # the namespaces reach the host's end
        cluster = stack.enter_context(PgCluster(bindir, settings=settings))
        netns.trust_namespaces(cluster)
        net = stack.enter_context(netns.Namespaces(REPLICAS))
        results = asyncio.run(run(cluster.dsn(), net, rtts, seconds))
    save_results("latency", results, report, args.out)


if __name__ == "__main__":
    main()
