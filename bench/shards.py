"""Sharded leadership of the plugin loop (issue 21): what K shards shared by n replicas buy
and cost, against the issue's targets.

Every replica is a real `scheduler-daemon run --only plugin` process on a fresh database
of the bench's durable throwaway cluster; schedules are runtime rows (bench/scale.py's
`Leader`, which starts the replicas, and its `periodic` case for the throughput steps).
`plugin.shards` = 64 (K) unless said; K = 1 is today's one leader. Targets (bench/, on
PYTHONPATH): `growth_tasks:five_ms_cpu` (spins 5 ms of CPU, holding the event loop) and
`growth_tasks:tenth_second` (awaits 0.1 s; writes each run's start and end, wall clock,
to a file of its process when BENCH_RUN_RECORDS is set).

Cases (`Sizes` gives the counts and windows; --quick shrinks them):

1. **CPU-bound**: N schedules of `five_ms_cpu` every `cpu_period` s, spread; each replica
   pinned to its own core (`taskset -c 0`, `-c 1`; PostgreSQL runs unpinned beside them,
   on the same two cores). The highest offered rate whose lateness p99 (finished_at -
   slot, bench/scale.py) stays under 100 ms: a first step offered well beyond what the
   replicas can run gives the saturated throughput T (runs started per second), then the
   offered rate is bisected from 0.6 T (T itself taken as too much). 1 replica at K = 1
   and at K = 64; 2 replicas at K = 64.
2. **I/O-bound**: `tenth_second` at `plugin.concurrency` = 20 (200 runs/s per replica at
   most), offered 1.5 times what the replicas can run: the saturated throughput of 1, 2
   and 3 replicas.
3. **Balance**, 4. **member joins**, 5. **member SIGKILLed**, 6. **graceful leave**: one
   cluster of 3 replicas (r0, r1 and a third that comes and goes) under a steady load of
   `tenth_second` schedules every 10 s. Each trial stops the third (SIGKILL, then SIGTERM
   for the last ones) and times, from the signal (`time.time()` just before `kill`), the
   survivors' `shard.acquired` log lines for each of its shards (all of them led
   elsewhere: the last one); then starts a new third under a new name and times its join,
   from its `leader.acquired` (member=true) line to its last `shard.acquired` for the
   shards the assignment gives it (computed here with the daemon's own `assign`), while
   the old owners hand them over (their `shard.released` `handover` field). Once the three
   share the shards again: each one's `scheduler_shards_owned` from /metrics (balance:
   largest / mean), and the schedules that share covers. At the end: every run the target
   recorded, per schedule, checked for overlap (a SIGKILLed process's runs in flight end
   at its kill); the same from scheduler_plugin_runs.
   Beside it, K = 1: 3 replicas, the leader SIGKILLed, from the signal to the next
   leader's `leader.acquired` line, a replacement started after each trial.
7. **Idle cost**: 3 replicas, N schedules an hour away, K = 64 and K = 1, one after the
   other: statements and transactions per second from the server's statement log
   (`log_statement = 'all'`, bench/scale.py's `tally_log`).

    python -m bench.shards [--quick] [--out DIR]
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import signal
import subprocess
import time
import urllib.request
from collections import Counter, defaultdict
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.common import RESULTS, admin_dsn, bench_arguments, save_results
from bench.growth import code_version, fmt_s, summary
from bench.growth_tasks import RECORDS
from bench.peers import cpu_seconds, find_log, tree
from bench.scale import Leader, Periodic, periodic, tally_log
from bench.scale import Sizes as ScaleSizes
from scheduler_daemon.leadership.assignment import Member, assign

CPU = "growth_tasks:five_ms_cpu"
IO = "growth_tasks:tenth_second"
RUNNABLE = (CPU, IO)
K = 64
DB = "bench_shards"
P99_TARGET = 0.1  # s, lateness p99 of a sustainable rate
CPU_SCALING_TARGET = 1.8  # 2 replicas against one
IO_SCALING_TARGET = 2.7  # 3 replicas against one
BALANCE_TARGET = 1.1  # largest share / mean
JOIN_TARGET = 2.0  # s
KILL_TARGET = 1.0  # s, p99
INFO = {"SCHEDULER_LOG__LEVEL": "info"}


@dataclass(frozen=True)
class Sizes:
    cpu_period: float = 5.0
    cpu_window: float = 15.0
    cpu_probes: int = 4  # bisection steps after the saturation step
    io_concurrency: int = 20
    io_window: float = 20.0
    io_overload: float = 1.5  # offered / what the replicas can run at most
    churn_load: int = 500  # tenth_second schedules every 10 s during the membership trials
    kills: int = 20
    leaves: int = 10
    unsharded_kills: int = 20
    idle_tasks: int = 1_000
    idle_settle: float = 5.0
    idle_window: float = 60.0


QUICK = Sizes(
    cpu_window=6.0,
    cpu_probes=2,
    io_window=6.0,
    churn_load=200,
    kills=3,
    leaves=2,
    unsharded_kills=3,
    idle_tasks=200,
    idle_settle=3.0,
    idle_window=10.0,
)


def load() -> float:
    return os.getloadavg()[0]


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


# --- 1 and 2: throughput -------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    label: str
    replicas: int
    shards: int
    pinned: bool = False

    def options(self, concurrency: int | None = None) -> dict[str, Any]:
        names = tuple(f"r{i}" for i in range(self.replicas))
        return {
            "instances": names,
            "shards": self.shards,
            "pins": tuple(str(i % 2) for i in range(self.replicas)) if self.pinned else (),
            "runnable": RUNNABLE,
            "database": DB,
        }


CPU_SETUPS = (
    Setup("1 replica, unsharded (K=1), core 0", 1, 1, pinned=True),
    Setup(f"1 replica, K={K}, core 0", 1, K, pinned=True),
    Setup(f"2 replicas, K={K}, cores 0 and 1", 2, K, pinned=True),
)
IO_SETUPS = (
    Setup("1 replica, unsharded (K=1)", 1, 1),
    *(Setup(f"{n} replica{'s' * (n > 1)}, K={K}", n, K) for n in (1, 2, 3)),
)


async def step(
    admin: str, work: Path, setup: Setup, target: str, rate: float, period: float,
    window: float, concurrency: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One offered rate: N = rate * period schedules every `period` s, spread, on fresh
    replicas; bench/scale.py's periodic case measures it."""
    tasks = max(1, round(rate * period))
    case = Periodic(
        f"{setup.label}, {tasks / period:,.0f} runs/s offered", "runtime", tasks, 1.0, 0.0,
        concurrency, window, period=period, target=target,
    )  # fmt: skip
    before = load()
    result = await periodic(admin, work, case, ScaleSizes(), **setup.options())
    p99 = result["lateness_s"]["p99"]
    row = {
        "offered": tasks / period,
        "tasks": tasks,
        "runs_per_second": result["runs_per_second"],
        "lateness_s": result["lateness_s"],
        "claim_lateness_s": result["claim_lateness_ran_s"],
        "commits_per_second": result["commits_per_second"],
        "slots_expected": result["slots_expected"],
        "slots_not_run": result["slots_not_run"],
        "replica_cpu_percent": result["replica_cpu_percent"],
        "db_cpu_percent": result["db_cpu_percent"],
        "failed": result["failed"],
        "leadership_lost": result["leadership_lost"],
        "load_before": before,
        "load_average": result["load_average"],
        "sustained": p99 is not None and p99 < P99_TARGET and result["slots_not_run"] == 0,
    }
    print(
        f"shards:   {setup.label}: offered {row['offered']:,.0f} runs/s -> "
        f"{row['runs_per_second']:,.0f} runs/s, p99 {fmt_s(p99)}, CPU "
        + ", ".join(f"{c or 0:.0f}%" for c in row["replica_cpu_percent"])
        + f" (db {row['db_cpu_percent'] or 0:.0f}%), load {row['load_average']:.1f}",
        flush=True,
    )
    return row


async def cpu_bound(admin: str, work: Path, sizes: Sizes, setup: Setup) -> dict[str, Any]:
    """Saturate, then bisect the offered rate for the highest with lateness p99 < 100 ms."""
    period, window = sizes.cpu_period, sizes.cpu_window
    saturation = await step(
        admin, work, setup, CPU, 300.0 * setup.replicas, period, window
    )  # 5 ms a run: at most 200 runs/s per core
    ceiling = saturation["runs_per_second"]
    steps = [saturation]
    low: float | None = None
    high = ceiling  # at the rate it can just run, the backlog of a hiccup never clears
    rate = 0.6 * ceiling
    for _ in range(sizes.cpu_probes):
        row = await step(admin, work, setup, CPU, rate, period, window)
        steps.append(row)
        if row["sustained"]:
            low = row["offered"]
        else:
            high = min(high, row["offered"])
        rate = (low + high) / 2 if low is not None else rate * 0.7
    best = max((s["offered"] for s in steps if s["sustained"]), default=None)
    failed_above = min((s["offered"] for s in steps if not s["sustained"]), default=None)
    return {
        **asdict(setup),
        "period_s": period,
        "window_s": window,
        "saturated_runs_per_second": ceiling,
        "max_sustained_runs_per_second": best,
        "lowest_failed_runs_per_second": failed_above,
        "steps": steps,
    }


async def io_bound(admin: str, work: Path, sizes: Sizes, setup: Setup) -> dict[str, Any]:
    most = setup.replicas * sizes.io_concurrency / 0.1
    row = await step(
        admin, work, setup, IO, sizes.io_overload * most, 10.0, sizes.io_window,
        concurrency=sizes.io_concurrency,
    )  # fmt: skip
    return {**asdict(setup), "concurrency": sizes.io_concurrency, "at_most": most, **row}


# --- 3 to 6: members coming and going ------------------------------------------------------


class Follow:
    """A replica's JSON log, read as it grows: its leadership events (and its warnings)."""

    KEEP = (b'"shard.', b'"leader.', b'"level": "warning"', b'"level": "error"')

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.rest = b""
        self.events: list[dict[str, Any]] = []

    def poll(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as log:
                log.seek(self.offset)
                data = log.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        lines = (self.rest + data).split(b"\n")
        self.rest = lines.pop()
        new = []
        for line in lines:
            if not any(marker in line for marker in self.KEEP):
                continue
            try:
                event = json.loads(line)
            except ValueError:
                continue
            event["t"] = datetime.fromisoformat(event["timestamp"]).timestamp()
            new.append(event)
        self.events += new
        return new

    def named(self, name: str, since: float = 0.0) -> list[dict[str, Any]]:
        self.poll()
        return [e for e in self.events if e.get("event") == name and e["t"] >= since]


@dataclass
class Replica:
    name: str
    process: subprocess.Popen[bytes]
    log: Follow
    port: int
    started: float  # time.time() just before it was started


def scrape(port: int) -> dict[str, float]:
    """The shard gauges of one replica's /metrics (an empty dict if it does not answer)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as page:
            text = page.read().decode()
    except OSError:
        return {}
    found = {}
    for line in text.splitlines():
        for metric in ("scheduler_shards_owned", "scheduler_shard_members"):
            if line.startswith(metric + "{") and 'loop="plugin"' in line:
                found[metric] = float(line.rsplit(" ", 1)[1])
    return found


def add(leader: Leader, name: str, env: dict[str, str]) -> Replica:
    started = time.time()
    process = leader.start_replica(name, env=env)
    port = leader.ports[-1] if leader.http else 0
    return Replica(name, process, Follow(leader.replica_dir(name) / "daemon.log"), port, started)


async def held_by(leader: Leader, instance: str) -> list[int]:
    rows = await leader.db.fetch(
        "SELECT split_part(loop, '/', 2)::int AS shard FROM scheduler_leaders "
        "WHERE loop LIKE 'plugin/%' AND instance = $1 ORDER BY 1",
        instance,
    )
    return [row["shard"] for row in rows]


async def wait_for(check: Any, within: float, what: str) -> Any:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        value = check()
        if value is not None:
            return value
        await asyncio.sleep(0.02)
    raise TimeoutError(what)


def first_acquired(logs: list[Follow], shards: set[int], since: float) -> dict[int, float]:
    """When each of `shards` was first taken, in `logs`, at or after `since`."""
    found: dict[int, float] = {}
    for log in logs:
        for event in log.named("shard.acquired", since):
            shard = event["shard"]
            if shard in shards and (shard not in found or event["t"] < found[shard]):
                found[shard] = event["t"]
    return found


async def balance(leader: Leader, replicas: list[Replica]) -> dict[str, Any]:
    """Once the three share the shards out: each one's scheduler_shards_owned, the
    shards the leader rows give each, and the schedules those shards hold."""
    await leader.wait_shared()
    await asyncio.sleep(0.3)  # the gauges are set right after the rows; let them settle
    gauges = [await asyncio.to_thread(scrape, r.port) for r in replicas]
    owned = [g.get("scheduler_shards_owned") for g in gauges]
    rows = await leader.db.fetch(
        "SELECT l.instance, count(DISTINCT l.loop) AS shards, count(t.name) AS schedules "
        "FROM scheduler_leaders l LEFT JOIN scheduler_plugin_tasks t "
        "  ON l.loop = 'plugin/' || (t.shard_hash % $1) "
        "WHERE l.loop LIKE 'plugin/%' GROUP BY l.instance",
        K,
    )
    by = {row["instance"]: row for row in rows}
    rows_owned = [by[r.name]["shards"] if r.name in by else 0 for r in replicas]
    schedules = [by[r.name]["schedules"] if r.name in by else 0 for r in replicas]
    known = [o for o in owned if o is not None]
    return {
        "members": [r.name for r in replicas],
        "metric_owned": owned,
        "metric_members": [g.get("scheduler_shard_members") for g in gauges],
        "rows_owned": rows_owned,
        "schedules": schedules,
        "ratio": max(known) / (sum(known) / len(known)) if len(known) == len(owned) else None,
        "schedule_ratio": max(schedules) / (sum(schedules) / len(schedules))
        if sum(schedules)
        else None,
    }


async def churn(admin: str, work: Path, sizes: Sizes) -> dict[str, Any]:
    records = work / "records"
    records.mkdir(parents=True, exist_ok=True)
    for old in records.glob("*.runs"):
        old.unlink()
    env = INFO | {RECORDS: str(records)}
    trials: list[dict[str, Any]] = []
    balances: list[dict[str, Any]] = []
    deaths: dict[int, float] = {}  # pid -> when its runs in flight ended at the latest
    async with Leader(
        admin, work, sizes.churn_load, target=IO, runnable=RUNNABLE, instances=("r0", "r1", "j00"),
        shards=K, env=env, http=True, database=DB,
    ) as leader:  # fmt: skip
        replicas = [
            Replica(n, d, Follow(leader.replica_dir(n) / "daemon.log"), p, time.time())
            for n, d, p in zip(leader.instances, leader.daemons, leader.ports, strict=True)
        ]
        seen = list(replicas)
        t0 = await leader.set_slots(1.0)
        await leader.sleep_until(t0)
        await asyncio.sleep(2.0)  # runs in flight everywhere
        balances.append(await balance(leader, replicas))
        total = sizes.kills + sizes.leaves
        for trial in range(total):
            kill = trial < sizes.kills
            victim = replicas[2]
            survivors = replicas[:2]
            share = set(await held_by(leader, victim.name))
            await asyncio.sleep(random.uniform(0.2, 1.0))  # a varied phase of the runs
            in_flight = await leader.db.fetchval(
                "SELECT count(*) FROM scheduler_plugin_runs WHERE status = 'running' "
                "AND instance = $1",
                victim.name,
            )
            signalled = time.time()
            victim.process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            taken = await wait_for(
                lambda share=share, signalled=signalled, logs=[s.log for s in survivors]: (
                    found
                    if len(found := first_acquired(logs, share, signalled)) == len(share)
                    else None
                ),
                30.0,
                f"trial {trial}: {victim.name}'s shards not taken over",
            )
            await asyncio.to_thread(victim.process.wait, 60)
            exited = time.time()
            deaths[victim.process.pid] = signalled if kill else exited
            leader.daemons.remove(victim.process)
            released = victim.log.named("leader.released", signalled)
            entry: dict[str, Any] = {
                "trial": trial,
                "signal": "SIGKILL" if kill else "SIGTERM",
                "victim": victim.name,
                "shards": len(share),
                "runs_in_flight": in_flight,
                "all_led_elsewhere_s": max(taken.values()) - signalled,
                "first_led_elsewhere_s": min(taken.values()) - signalled,
                "exit_code": victim.process.returncode,
                "exited_s": exited - signalled,
                "released_s": released[0]["t"] - signalled if released else None,
                "member_gone_lines": sum(
                    len(s.log.named("shard.member_gone", signalled)) for s in survivors
                ),
            }
            # A new member joins under a new name.
            name = f"j{trial + 1:02d}"
            joining = add(leader, name, env)
            seen.append(joining)
            everyone = [Member(r.name, 0) for r in survivors] + [Member(name, 0)]
            mine = set(assign(everyone, K)[Member(name, 0)])
            joined = await wait_for(
                lambda j=joining: e[0] if (e := j.log.named("leader.acquired")) else None,
                60.0,
                f"{name} never joined",
            )
            got = await wait_for(
                lambda j=joining, mine=mine: (
                    found if len(found := first_acquired([j.log], mine, 0.0)) == len(mine) else None
                ),
                60.0,
                f"{name} never led its share",
            )
            handed = [
                e
                for s in survivors
                for e in s.log.named("shard.released", joining.started)
                if e.get("reason") == "rebalance"
            ]
            entry |= {
                "joiner": name,
                "share": len(mine),
                "joined_member": bool(joined.get("member")),
                "join_s": max(got.values()) - joined["t"],
                "join_from_start_s": max(got.values()) - joining.started,
                "start_to_member_s": joined["t"] - joining.started,
                "handover_s": [e.get("handover") for e in handed],
            }
            replicas = [*survivors, joining]
            balances.append(await balance(leader, replicas))
            trials.append(entry)
            print(
                f"shards:   trial {trial + 1}/{total} {entry['signal']} {victim.name} "
                f"({entry['shards']} shards, {in_flight} runs in flight): led elsewhere after "
                f"{fmt_s(entry['all_led_elsewhere_s'])}; {name} joined, led its {len(mine)} "
                f"after {fmt_s(entry['join_s'])} (hand-overs up to "
                f"{fmt_s(max((h for h in entry['handover_s'] if h is not None), default=None))})",
                flush=True,
            )
        await asyncio.sleep(1.0)
        leader.stop()
        stopped = time.time()
        for replica in replicas:
            deaths.setdefault(replica.process.pid, stopped)  # it had exited by then
        db_overlaps = await leader.db.fetchval(
            "SELECT count(*) FROM (SELECT started_at, lag(finished_at) OVER w AS previous_end, "
            "lag(started_at) OVER w AS previous_start FROM scheduler_plugin_runs "
            "WHERE status <> 'skipped_overlap' WINDOW w AS (PARTITION BY name ORDER BY started_at)) r "
            "WHERE started_at < coalesce(previous_end, 'infinity') AND previous_start IS NOT NULL"
        )
        db_runs = await leader.db.fetch(
            "SELECT status, count(*) AS n FROM scheduler_plugin_runs GROUP BY status"
        )
        for replica in seen:
            replica.log.poll()
        warnings = Counter(
            f"{e.get('level')} {e.get('event')}"
            for r in seen
            for e in r.log.events
            if e.get("level") in ("warning", "error", "critical")
        )
    overlap = check_records(records, deaths)
    return {
        "load": sizes.churn_load,
        "trials": trials,
        "balances": balances,
        "overlap": overlap,
        "db_overlapping_runs": db_overlaps,
        "db_runs": {row["status"]: row["n"] for row in db_runs},
        "warnings": dict(warnings.most_common()),
    }


def check_records(records: Path, deaths: dict[int, float]) -> dict[str, Any]:
    """Every run the target recorded, per schedule: does one start before another of the
    same schedule ended? A run with no end record ended when its process was killed (or,
    one that stopped, at the latest when the harness saw it exit)."""
    runs: dict[tuple[int, str, str], dict[str, float]] = {}
    for path in records.glob("*.runs"):
        pid = int(path.stem)
        for line in path.read_text().splitlines():
            kind, name, slot, _instance, _shard, stamp = line.split()
            runs.setdefault((pid, name, slot), {})[kind] = float(stamp)
    by_schedule: dict[str, list[tuple[float, float, int, str]]] = defaultdict(list)
    unended = 0
    slots: dict[tuple[str, str], int] = defaultdict(int)
    for (pid, name, slot), run in runs.items():
        if "start" not in run:
            continue
        end = run.get("end")
        if end is None:
            unended += 1
            end = deaths.get(pid, math.inf)
        by_schedule[name].append((run["start"], end, pid, slot))
        slots[(name, slot)] += 1
    overlaps = []
    for name, intervals in by_schedule.items():
        intervals.sort()
        latest_end, latest = -math.inf, None
        for start, end, pid, slot in intervals:
            if start < latest_end and latest is not None:
                overlaps.append(
                    {"schedule": name, "slot": slot, "pid": pid, "other": latest,
                     "by_s": latest_end - start}
                )  # fmt: skip
            if end > latest_end:
                latest_end, latest = end, {"pid": pid, "slot": slot}
    return {
        "runs": sum(len(v) for v in by_schedule.values()),
        "schedules": len(by_schedule),
        "unended": unended,
        "overlaps": len(overlaps),
        "overlap_examples": overlaps[:5],
        "slots_run_twice": sum(1 for n in slots.values() if n > 1),
    }


async def unsharded_kills(admin: str, work: Path, sizes: Sizes) -> dict[str, Any]:
    """K = 1: the leader SIGKILLed, from the signal to the next leader's leader.acquired."""
    trials: list[dict[str, Any]] = []
    async with Leader(
        admin, work, sizes.churn_load, target=IO, runnable=RUNNABLE, instances=("u0", "u1", "u2"),
        env=INFO, database=DB,
    ) as leader:  # fmt: skip
        replicas = {
            n: Replica(n, d, Follow(leader.replica_dir(n) / "daemon.log"), 0, time.time())
            for n, d in zip(leader.instances, leader.daemons, strict=True)
        }
        t0 = await leader.set_slots(1.0)
        await leader.sleep_until(t0)
        for trial in range(sizes.unsharded_kills):
            await wait_for(
                lambda: (
                    True if all(r.log.named("leader.waiting") for r in replicas.values()) else None
                ),
                60.0,
                "standbys not waiting",
            )
            await asyncio.sleep(random.uniform(0.5, 1.3))
            name = await leader.db.fetchval(
                "SELECT instance FROM scheduler_leaders WHERE loop = 'plugin'"
            )
            victim = replicas.pop(name)
            signalled = time.time()
            victim.process.send_signal(signal.SIGKILL)

            def acquired(signalled: float = signalled) -> dict[str, Any] | None:
                found = [
                    e for r in replicas.values() for e in r.log.named("leader.acquired", signalled)
                ]
                return min(found, key=lambda e: e["t"]) if found else None

            event = await wait_for(acquired, 30.0, f"trial {trial}: no new leader")
            await asyncio.to_thread(victim.process.wait, 60)
            leader.daemons.remove(victim.process)
            trials.append(
                {"trial": trial, "victim": name, "new_leader": event.get("instance"),
                 "led_elsewhere_s": event["t"] - signalled}
            )  # fmt: skip
            new = f"u{trial + 3}"
            replicas[new] = add(leader, new, INFO)
        leader.stop()
    times = [t["led_elsewhere_s"] for t in trials]
    print(f"shards:   K=1 SIGKILL: new leader after p50 {fmt_s(summary(times)['p50'])}", flush=True)
    return {"trials": trials, "led_elsewhere_s": summary(times)}


# --- 7: idle -------------------------------------------------------------------------------


async def idle(admin: str, work: Path, sizes: Sizes, shards: int) -> dict[str, Any]:
    log = await find_log(admin)
    if log.path is None:
        return {"shards": shards, "error": "no server log (SCHEDULER_BENCH_DATABASE_URL set)"}
    async with Leader(
        admin, work, sizes.idle_tasks, target=IO, runnable=RUNNABLE,
        instances=("i0", "i1", "i2"), shards=shards, log_statements=True, database=DB,
    ) as leader:  # fmt: skip
        await asyncio.sleep(sizes.idle_settle)
        processes = {d.pid: tree(d.pid) for d in leader.daemons}
        cpu_before = {pid: cpu_seconds(members) for pid, members in processes.items()}
        offset = log.offset()
        began = time.monotonic()
        await asyncio.sleep(sizes.idle_window)
        elapsed = time.monotonic() - began
        lines = log.lines_since(offset)
        cpu = [
            100 * (cpu_seconds(members) - cpu_before[pid]) / elapsed
            for pid, members in processes.items()
        ]
        sessions = await leader.db.fetch(
            "SELECT application_name, count(*) AS n FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid() "
            "GROUP BY 1 ORDER BY 1"
        )
        load_now = load()
        leader.stop()
    tally = tally_log(lines, elapsed)
    return {
        "shards": shards,
        "replicas": 3,
        "tasks": sizes.idle_tasks,
        "window_s": elapsed,
        "statements_per_s": tally["statements_per_s"],
        "transactions_per_s": tally["transactions_per_s"],
        "ticks": tally["ticks"],
        "top": tally["top"],
        "cpu_percent_per_replica": cpu,
        "connections": sum(row["n"] for row in sessions),
        "sessions": {row["application_name"]: row["n"] for row in sessions},
        "load_average": load_now,
    }


# --- the run -------------------------------------------------------------------------------


async def run(admin: str, work: Path, sizes: Sizes) -> dict[str, Any]:
    results: dict[str, Any] = {
        "code": code_version(),
        "sizes": asdict(sizes),
        "shards": K,
        "load_at_start": load(),
        "uptime_at_start": uptime(),
    }
    started = time.monotonic()
    print("shards: 1. CPU-bound target, replicas pinned to a core each", flush=True)
    results["cpu"] = [await cpu_bound(admin, work / "cpu", sizes, s) for s in CPU_SETUPS]
    print("shards: 2. I/O-bound target at a fixed concurrency", flush=True)
    results["io"] = [await io_bound(admin, work / "io", sizes, s) for s in IO_SETUPS]
    print("shards: 3-6. members joining, killed, leaving", flush=True)
    results["churn"] = await churn(admin, work / "churn", sizes)
    print("shards: 5. beside it, K=1: the leader SIGKILLed", flush=True)
    results["unsharded_kill"] = await unsharded_kills(admin, work / "unsharded", sizes)
    print("shards: 7. idle cost, K=64 and K=1", flush=True)
    results["idle"] = [await idle(admin, work / f"idle{k}", sizes, k) for k in (K, 1)]
    for r in results["idle"]:
        print(
            f"shards:   K={r['shards']}: {r.get('statements_per_s', 0):.2f} statements/s, "
            f"{r.get('transactions_per_s', 0):.2f} transactions/s",
            flush=True,
        )
    results["load_at_end"] = load()
    results["uptime_at_end"] = uptime()
    results["took_s"] = time.monotonic() - started
    results["targets"] = assess(results)
    return results


# --- against the targets -------------------------------------------------------------------


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def assess(results: dict[str, Any]) -> dict[str, Any]:
    cpu = {r["label"]: r for r in results["cpu"]}
    one, one_sharded, two = (cpu[s.label] for s in CPU_SETUPS)
    io = {r["replicas"]: r for r in results["io"] if r["shards"] > 1}
    churn_ = results["churn"]
    kills = [t for t in churn_["trials"] if t["signal"] == "SIGKILL"]
    leaves = [t for t in churn_["trials"] if t["signal"] == "SIGTERM"]
    handovers = [h for t in churn_["trials"] for h in t["handover_s"] if h is not None]
    balances = [b["ratio"] for b in churn_["balances"] if b["ratio"] is not None]
    idle_ = {r["shards"]: r for r in results["idle"]}
    out: dict[str, Any] = {
        "cpu_ratio": ratio(
            two["max_sustained_runs_per_second"], one["max_sustained_runs_per_second"]
        ),
        "cpu_ratio_vs_sharded_one": ratio(
            two["max_sustained_runs_per_second"], one_sharded["max_sustained_runs_per_second"]
        ),
        "cpu_saturated_ratio": ratio(
            two["saturated_runs_per_second"], one["saturated_runs_per_second"]
        ),
        "io_ratio": ratio(io[3]["runs_per_second"], io[1]["runs_per_second"]),
        "io_ratio_2": ratio(io[2]["runs_per_second"], io[1]["runs_per_second"]),
        "io_ratio_vs_unsharded": ratio(
            io[3]["runs_per_second"],
            next(r["runs_per_second"] for r in results["io"] if r["shards"] == 1),
        ),
        "io_one_sharded_vs_unsharded": ratio(
            io[1]["runs_per_second"],
            next(r["runs_per_second"] for r in results["io"] if r["shards"] == 1),
        ),
        "balance_worst": max(balances) if balances else None,
        "balance_samples": len(balances),
        "schedule_balance_worst": max(
            (b["schedule_ratio"] for b in churn_["balances"] if b["schedule_ratio"]), default=None
        ),
        "join_s": summary([t["join_s"] for t in churn_["trials"]]),
        "join_from_start_s": summary([t["join_from_start_s"] for t in churn_["trials"]]),
        "kill_s": summary([t["all_led_elsewhere_s"] for t in kills]),
        "kill_first_s": summary([t["first_led_elsewhere_s"] for t in kills]),
        "unsharded_kill_s": results["unsharded_kill"]["led_elsewhere_s"],
        "leave_s": summary([t["all_led_elsewhere_s"] for t in leaves]),
        "handover_s": summary(handovers),
        "handovers": len(handovers),
        "overlaps": churn_["overlap"]["overlaps"] + (churn_["db_overlapping_runs"] or 0),
        "idle_statement_ratio": ratio(
            idle_[K].get("statements_per_s"), idle_[1].get("statements_per_s")
        ),
        "idle_transaction_ratio": ratio(
            idle_[K].get("transactions_per_s"), idle_[1].get("transactions_per_s")
        ),
    }
    p99 = lambda s: s["p99"]  # noqa: E731
    out["met"] = {
        "cpu": out["cpu_ratio"] is not None and out["cpu_ratio"] >= CPU_SCALING_TARGET,
        "io": out["io_ratio"] is not None and out["io_ratio"] >= IO_SCALING_TARGET,
        "balance": out["balance_worst"] is not None and out["balance_worst"] <= BALANCE_TARGET,
        "join": p99(out["join_s"]) is not None and p99(out["join_s"]) <= JOIN_TARGET,
        "kill": p99(out["kill_s"]) is not None and p99(out["kill_s"]) <= KILL_TARGET,
        "overlap": out["overlaps"] == 0,
        "idle": out["idle_transaction_ratio"] is not None and out["idle_transaction_ratio"] <= 1.0,
    }
    return out


def yes_no(value: bool) -> str:
    return "met" if value else "**not met**"


def fmt_rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def fmt_x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def spread(s: dict[str, float | None]) -> str:
    return f"p50 {fmt_s(s['p50'])}, p99 {fmt_s(s['p99'])}, max {fmt_s(s['max'])}"


def sustained(r: dict[str, Any]) -> str:
    """The highest rate that held lateness p99 < 100 ms, or how low the steps went."""
    best = r["max_sustained_runs_per_second"]
    if best is not None:
        return f"{best:,.0f} runs/s"
    lowest = min(r["steps"], key=lambda s: s["offered"])
    return (
        f"none of {len(r['steps'])} steps (the lowest, {lowest['offered']:,.0f} runs/s: "
        f"p99 {fmt_s(lowest['lateness_s']['p99'])})"
    )


def per_run(r: dict[str, Any]) -> str:
    return f"{r['commits_per_second'] / r['runs_per_second']:.2f}" if r["runs_per_second"] else "-"


def report(results: dict[str, Any]) -> str:
    t = results["targets"]
    met = t["met"]
    code = results["code"]
    cpu = {r["label"]: r for r in results["cpu"]}
    one, one_sharded, two = (cpu[s.label] for s in CPU_SETUPS)
    io = {r["replicas"]: r for r in results["io"] if r["shards"] > 1}
    churn_ = results["churn"]
    kills = [x for x in churn_["trials"] if x["signal"] == "SIGKILL"]
    leaves = [x for x in churn_["trials"] if x["signal"] == "SIGTERM"]
    idle_ = {r["shards"]: r for r in results["idle"]}
    sizes = results["sizes"]
    lines = [
        f"# Sharded leadership: issue 21's targets ({results['date']}, {results['machine']})",
        "",
        f"Commit {code['commit'][:12]}"
        + (f", with uncommitted changes to {', '.join(code['changed'])}" if code["changed"] else "")
        + f". Real `scheduler-daemon run --only plugin` replicas on the durable throwaway "
        f"cluster, `plugin.shards` = {results['shards']} unless said (K = 1: one leader, "
        "today's default), runtime schedules. The machine has 2 cores, shared: "
        f"`uptime` at the start: {results['uptime_at_start']}; at the end: "
        f"{results['uptime_at_end']}. The whole run took {results['took_s'] / 60:.0f} min.",
        "",
        "## Against the targets",
        "",
        "| target | measured | |",
        "|---|---|---|",
        f"| CPU-bound target (5 ms of CPU a run), 2 replicas ≥ 1.8x one (a core each) "
        f"| highest rate with lateness p99 < 100 ms: 2 replicas (K = {K}) "
        f"{sustained(two)}, 1 replica unsharded {sustained(one)}, 1 replica K = {K} "
        f"{sustained(one_sharded)}: **{fmt_x(t['cpu_ratio'])}** "
        f"({fmt_x(t['cpu_ratio_vs_sharded_one'])} against one sharded replica). Saturated "
        f"throughput: {fmt_rate(two['saturated_runs_per_second'])} runs/s against "
        f"{fmt_rate(one['saturated_runs_per_second'])} unsharded (**{fmt_x(t['cpu_saturated_ratio'])}**) "
        f"and {fmt_rate(one_sharded['saturated_runs_per_second'])} for one sharded replica "
        f"({fmt_x(ratio(two['saturated_runs_per_second'], one_sharded['saturated_runs_per_second']))}) "
        f"| {yes_no(met['cpu'])} |",
        f"| I/O-bound target (awaits 0.1 s), concurrency {sizes['io_concurrency']}, 3 replicas "
        f"≥ 2.7x one | saturated throughput 1 / 2 / 3 replicas: {fmt_rate(io[1]['runs_per_second'])} / "
        f"{fmt_rate(io[2]['runs_per_second'])} / {fmt_rate(io[3]['runs_per_second'])} runs/s: "
        f"**{fmt_x(t['io_ratio'])}** (2 replicas {fmt_x(t['io_ratio_2'])}; 3 replicas against "
        f"one unsharded: {fmt_x(t['io_ratio_vs_unsharded'])}; one sharded against one unsharded: "
        f"{fmt_x(t['io_one_sharded_vs_unsharded'])}) | {yes_no(met['io'])} |",
        f"| balance, {K} shards on 3 replicas: largest share / mean ≤ 1.1 "
        f"| **{t['balance_worst']:.3f}** at worst over {t['balance_samples']} member sets "
        f"(`scheduler_shards_owned`); the schedules those shards hold: "
        f"{t['schedule_balance_worst']:.2f} at worst | {yes_no(met['balance'])} |",
        f"| a member joins: leads its share within 2 s | from its `leader.acquired` (member) "
        f"to its last `shard.acquired`, {len(churn_['trials'])} joins: **{spread(t['join_s'])}**; "
        f"from the process's start: {spread(t['join_from_start_s'])} | {yes_no(met['join'])} |",
        f"| a member SIGKILLed: all its shards led elsewhere p99 ≤ 1 s | {len(kills)} kills: "
        f"**{spread(t['kill_s'])}** (the first shard: p50 {fmt_s(t['kill_first_s']['p50'])}); "
        f"K = 1, the leader SIGKILLed, {len(results['unsharded_kill']['trials'])} kills: "
        f"{spread(t['unsharded_kill_s'])} | {yes_no(met['kill'])} |",
        f"| graceful leave with runs in flight; no schedule's runs overlap "
        f"| {len(leaves)} SIGTERMs: all led elsewhere {spread(t['leave_s'])}; hand-overs to a "
        f"joining member ({t['handovers']}): {spread(t['handover_s'])}; "
        f"**{churn_['overlap']['overlaps']} overlaps** in {churn_['overlap']['runs']:,} recorded runs, "
        f"{churn_['db_overlapping_runs']} in scheduler_plugin_runs | {yes_no(met['overlap'])} |",
        f"| idle, 3 replicas: no more than one leader's | K = {K}: "
        f"{idle_[K].get('statements_per_s', 0):.2f} statements/s, "
        f"{idle_[K].get('transactions_per_s', 0):.2f} transactions/s; K = 1: "
        f"{idle_[1].get('statements_per_s', 0):.2f}, {idle_[1].get('transactions_per_s', 0):.2f}: "
        f"**{fmt_x(t['idle_transaction_ratio'])}** the transactions "
        f"({fmt_x(t['idle_statement_ratio'])} the statements) | {yes_no(met['idle'])} |",
        "",
        f"## 1. CPU-bound target: `five_ms_cpu`, every {sizes['cpu_period']:g} s, spread",
        "",
        "Each replica under `taskset -c` (its own core); PostgreSQL unpinned on the same two "
        "cores. Per step a fresh database and fresh replicas; the first step offers 300 runs/s "
        "per replica (a core runs at most 200), the next ones bisect. Sustained: lateness p99 "
        f"< 100 ms and every slot run, over a {sizes['cpu_window']:g} s window. CPU: 100% = one "
        "core; db: the database backends of the replicas.",
        "",
        "| setup | offered runs/s | ran runs/s | lateness p50 | p99 | max | claim p99 | not run | replica CPU | db CPU | commits/s | commits a run | load | sustained |",
        "|" + "---|" * 14,
    ]
    for r in results["cpu"]:
        for s in sorted(r["steps"], key=lambda s: s["offered"]):
            lines.append(
                f"| {r['label']} | {s['offered']:,.0f} | {s['runs_per_second']:,.0f} "
                f"| {fmt_s(s['lateness_s']['p50'])} | {fmt_s(s['lateness_s']['p99'])} "
                f"| {fmt_s(s['lateness_s']['max'])} | {fmt_s(s['claim_lateness_s']['p99'])} "
                f"| {s['slots_not_run']:,} of {s['slots_expected']:,} "
                f"| {' + '.join(f'{c or 0:.0f}%' for c in s['replica_cpu_percent'])} "
                f"| {s['db_cpu_percent'] or 0:.0f}% | {s['commits_per_second']:,.0f} "
                f"| {per_run(s)} | {s['load_average']:.1f} "
                f"| {'yes' if s['sustained'] else 'no'} |"
            )
    lines += [
        "",
        "| setup | highest sustained | lowest not sustained | saturated |",
        "|---|---|---|---|",
        *[
            f"| {r['label']} | {fmt_rate(r['max_sustained_runs_per_second'])} "
            f"| {fmt_rate(r['lowest_failed_runs_per_second'])} "
            f"| {fmt_rate(r['saturated_runs_per_second'])} |"
            for r in results["cpu"]
        ],
        "",
        f"## 2. I/O-bound target: `tenth_second`, concurrency {sizes['io_concurrency']}, "
        f"offered {sizes['io_overload']:g}x what fits",
        "",
        "| setup | at most (concurrency / 0.1 s) | offered | ran runs/s | of the most | replica CPU | db CPU | commits/s | commits a run | load |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *[
            f"| {r['label']} | {r['at_most']:,.0f} | {r['offered']:,.0f} "
            f"| {r['runs_per_second']:,.0f} | {r['runs_per_second'] / r['at_most']:.0%} "
            f"| {' + '.join(f'{c or 0:.0f}%' for c in r['replica_cpu_percent'])} "
            f"| {r['db_cpu_percent'] or 0:.0f}% | {r['commits_per_second']:,.0f} "
            f"| {per_run(r)} | {r['load_average']:.1f} |"
            for r in results["io"]
        ],
        "",
        f"## 3-6. Members joining, killed and leaving ({churn_['load']} `tenth_second` "
        f"schedules every 10 s throughout)",
        "",
        "Times from the signal (`time.time()` just before `kill`) to the survivors' "
        "`shard.acquired` lines (log timestamps, same clock) for the victim's shards; a join "
        "from the new member's `leader.acquired` line to its last `shard.acquired` of the "
        "shards the assignment gives it; hand-over: the old owner's `shard.released` "
        "`handover` field (its runs in flight end, results written, leader row deleted, unlock).",
        "",
        "| trial | signal | shards | runs in flight | first led elsewhere | all led elsewhere | victim exited | joiner's share | join | from its start | hand-overs (max) |",
        "|" + "---|" * 11,
    ]
    for x in churn_["trials"]:
        handed = [h for h in x["handover_s"] if h is not None]
        lines.append(
            f"| {x['trial'] + 1} | {x['signal']} | {x['shards']} | {x['runs_in_flight']} "
            f"| {fmt_s(x['first_led_elsewhere_s'])} | {fmt_s(x['all_led_elsewhere_s'])} "
            f"| {fmt_s(x['exited_s'])} | {x['share']} | {fmt_s(x['join_s'])} "
            f"| {fmt_s(x['join_from_start_s'])} | {len(handed)} ({fmt_s(max(handed, default=None))}) |"
        )
    o = churn_["overlap"]
    owned = [b["metric_owned"] for b in churn_["balances"]]
    lines += [
        "",
        f"Balance after each join ({len(owned)} member sets), shards owned per replica from "
        "/metrics: "
        + ", ".join(
            "/".join(f"{v:.0f}" if v is not None else "?" for v in sorted(b)) for b in owned[:12]
        )
        + (" …" if len(owned) > 12 else "")
        + "; schedules per replica: "
        + ", ".join(
            "/".join(str(v) for v in sorted(b["schedules"])) for b in churn_["balances"][:6]
        )
        + " ….",
        "",
        f"Overlap: {o['runs']:,} runs of {o['schedules']} schedules recorded by the target "
        f"itself, {o['unended']} without an end record (SIGKILLed: they end at the kill); "
        f"{o['overlaps']} overlapping, {o['slots_run_twice']} slots run twice. "
        f"scheduler_plugin_runs: {churn_['db_overlapping_runs']} runs starting before the "
        "previous run of their schedule finished; statuses "
        + ", ".join(f"{k} {v:,}" for k, v in sorted(churn_["db_runs"].items()))
        + ".",
    ]
    if churn_["warnings"]:
        lines += [
            "",
            "Warnings and errors the members logged: "
            + ", ".join(f"`{k}` {v}" for k, v in churn_["warnings"].items())
            + ".",
        ]
    u = results["unsharded_kill"]
    lines += [
        "",
        f"K = 1 beside it: 3 replicas, the leader SIGKILLed {len(u['trials'])} times, from the "
        f"signal to the next leader's `leader.acquired`: {spread(u['led_elsewhere_s'])}.",
        "",
        f"## 7. Idle: 3 replicas, {sizes['idle_tasks']:,} schedules an hour away, "
        f"{sizes['idle_window']:g} s window",
        "",
        "| K | statements/s | transactions/s | plugin ticks | connections | CPU per replica | most frequent statements |",
        "|---|---|---|---|---|---|---|",
    ]
    for k in (K, 1):
        r = idle_[k]
        if "error" in r:
            lines.append(f"| {k} | {r['error']} | | | | | |")
            continue
        top = "; ".join(f"{x['count']} x `{x['statement'][:60]}`" for x in r["top"][:3])
        lines.append(
            f"| {k} | {r['statements_per_s']:.2f} | {r['transactions_per_s']:.2f} | {r['ticks']} "
            f"| {r['connections']} | {' / '.join(f'{c:.1f}%' for c in r['cpu_percent_per_replica'])} "
            f"| {top} |"
        )
    return "\n".join([*lines, ""])


def plots(results: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    for r in results["cpu"]:
        steps = sorted(r["steps"], key=lambda s: s["offered"])
        left.plot(
            [s["offered"] for s in steps],
            [max(s["lateness_s"]["p99"] or 0.0, 1e-3) * 1000 for s in steps],
            "o-",
            label=r["label"],
        )
    left.axhline(P99_TARGET * 1000, color="grey", linestyle="--", linewidth=1)
    left.set_yscale("log")
    left.set_xlabel("offered runs/s (5 ms of CPU each)")
    left.set_ylabel("lateness p99 (ms)")
    left.set_title("CPU-bound target: a core per replica")
    left.grid(True, alpha=0.3)
    left.legend(fontsize=8)
    io = [r for r in results["io"] if r["shards"] > 1]
    xs = [r["replicas"] for r in io]
    right.bar(xs, [r["runs_per_second"] for r in io], label=f"ran, K={K}")
    right.plot(xs, [r["at_most"] for r in io], "k--", label="concurrency / 0.1 s")
    for r in results["io"]:
        if r["shards"] == 1:
            right.plot([1], [r["runs_per_second"]], "r^", markersize=9, label="ran, 1 replica, K=1")
    right.set_xticks(xs)
    right.set_xlabel("replicas")
    right.set_ylabel("runs/s")
    right.set_title(f"I/O-bound target, K={K}: saturated throughput")
    right.grid(True, alpha=0.3)
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "shards_scaling.png", dpi=110)
    plt.close(fig)

    churn_ = results["churn"]
    series = {
        f"K={K} SIGKILL\n(all shards)": [
            t["all_led_elsewhere_s"] for t in churn_["trials"] if t["signal"] == "SIGKILL"
        ],
        "K=1 SIGKILL\n(the lock)": [
            t["led_elsewhere_s"] for t in results["unsharded_kill"]["trials"]
        ],
        f"K={K} SIGTERM\n(all shards)": [
            t["all_led_elsewhere_s"] for t in churn_["trials"] if t["signal"] == "SIGTERM"
        ],
        "join\n(its share)": [t["join_s"] for t in churn_["trials"]],
        "hand-over\n(one shard)": [h for t in churn_["trials"] for h in t["handover_s"] if h],
    }
    fig, ax = plt.subplots(figsize=(10, 4.2))
    for i, values in enumerate(series.values()):
        jitter = [i + random.uniform(-0.15, 0.15) for _ in values]
        ax.scatter(jitter, [v * 1000 for v in values], s=12, alpha=0.7)
    ax.set_xticks(range(len(series)))
    ax.set_xticklabels(list(series), fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("ms")
    ax.axhline(
        KILL_TARGET * 1000, color="grey", linestyle="--", linewidth=1, label="kill target (p99)"
    )
    ax.axhline(JOIN_TARGET * 1000, color="grey", linestyle=":", linewidth=1, label="join target")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("members leaving and joining: until their shards are led again")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "shards_membership.png", dpi=110)
    plt.close(fig)
    return ["shards_scaling.png", "shards_membership.png"]


def main(argv: list[str] | None = None) -> None:
    args = bench_arguments("bench.shards", argv)
    sizes = QUICK if args.quick else Sizes()
    with ExitStack() as stack:
        results = asyncio.run(run(admin_dsn(stack), RESULTS / ".work" / "shards", sizes))
    results["plots"] = plots(results, args.out)
    save_results("shards", results, report, args.out)


if __name__ == "__main__":
    main()
