"""PostgreSQL primary failover under real replicas (BRIEF.md §2: "advisory locks are not
replicated").

A primary and a streaming standby (``rig.standby``); two ``scheduler-daemon run``
processes on the multi-host DSN ``…@node1,node2/app?target_session_attrs=read-write``
(with a password in it, which no line of output may show), publishing through the
``sql`` publisher (an audit row in the publishing transaction) and the ``effects``
publisher (wall-clock records outside the database), and running a plugin task that
records its runs outside the database with its fencing token. Publications are
scheduled throughout, through plain SQL (a feeder that reconnects through the failover)
and through ``scheduler-daemon schedule``. Then the primary is stopped ``-m immediate``
and the standby promoted.

The evidence is three views of the database and one of the world outside it:

- ``standby``: the standby's data just before its promotion, which is what the new
  timeline starts from (read through ``before_promote``);
- ``old``: what the old primary had committed when it died (read afterwards on its
  Unix socket only, where no replica can reach it);
- ``new``: the new primary at the end;
- the effects log: every publisher call and plugin run, by wall clock.

``old - standby`` is the *lost window*: every commit the standby never received. With
synchronous replication nothing acknowledged can be in it; with asynchronous replication
it holds acknowledged commits, and every publication published twice, every schedule
request lost and every plugin slot run twice must be explained by it, exactly.
``check_failover`` does that accounting; the test of each mode asserts what the mode
promises. Fencing tokens are promised in both modes: never handed out twice, and every
token a new primary hands out is larger than every token of the old one, the tokens
granted in the lost window included (the token's epoch grows with the timeline:
docs/leadership.md, Fencing tokens). Every token drawn is in a ``leader.acquired`` line.

``make test`` runs one synchronous failover and one asynchronous one with the standby's
link stalled before the crash and a change of leader in the lost window whose token a
sequence alone would hand out again (about 18 s with the two small tests at the end);
``make chaos`` adds five failovers in a row per mode (the natural asynchronous window,
under a burst of writes) and 50 asynchronous failovers with such a change of leader each.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import datetime
from itertools import pairwise
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from rig.databases import create_database, migrate, run_sync
from rig.effects import EFFECTS_TARGETS, EffectRun, check_effects, effects_env, read_effects
from rig.pgcluster import PgCluster, find_pg_bindir
from rig.processes import DaemonProcess, Daemons, run_cli
from rig.sql import execute
from rig.standby import Failover, ReplicatedCluster
from rig.ticks import FAST_TIMINGS, RIG_APP, event_time
from rig.waiting import wait_until

from scheduler_daemon.config.settings import Settings
from scheduler_daemon.db.lock_store import Predecessor
from scheduler_daemon.leadership.base import settle_time
from scheduler_daemon.leadership.postgres_session import wait_for_predecessor

pytestmark = [pytest.mark.postgres, pytest.mark.processes]

DBNAME = "app"
# Trust authentication accepts any password: it is there to be redacted.
PASSWORD = "failover-s3cret"
PLUGIN_TASK = "probe"
PLUGIN_EVERY = 0.25
FEED_EVERY = 0.05  # one publication scheduled through SQL every 50 ms…
DUE_IN = 0.3  # …due 0.3 s later
# The old primary's link to the standby stalls this long before the crash (asynchronous
# case): a window of commits the standby never receives, so that the accounting has
# something to explain. The natural window is measured without it (chaos_long).
STALL_BEFORE_CRASH = 0.4

WORKLOAD_DDL = """
CREATE TABLE audit (
    publication_id bigint NOT NULL,
    instance       text NOT NULL,
    token          bigint,
    at             timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE burst (key text PRIMARY KEY, at timestamptz NOT NULL DEFAULT clock_timestamp())
"""

AUDIT_STATEMENT = (
    "INSERT INTO audit (publication_id, instance, token) "
    "SELECT unnest($1::bigint[]), current_setting('application_name'), "
    "(SELECT token FROM scheduler_fencing WHERE loop = 'publish')"
)


@pytest.fixture(scope="module")
def bindir() -> Path:
    found = find_pg_bindir()
    if found is None:
        pytest.skip("no PostgreSQL server binaries (initdb, postgres, pg_basebackup)")
    return found


@pytest.fixture
def replicated(request: pytest.FixtureRequest, bindir: Path) -> Iterator[ReplicatedCluster]:
    """A primary and a standby of this test's own (never the session's cluster). The param:
    ``(synchronous, replication_proxy)``, the proxy being what can stall the link."""
    synchronous, proxy = request.param
    with ReplicatedCluster(
        synchronous=synchronous, bindir=bindir, replication_proxy=proxy
    ) as cluster:
        yield cluster


SYNC = pytest.param((True, False), id="sync")
ASYNC = pytest.param((False, False), id="async")
ASYNC_STALLED = pytest.param((False, True), id="async-stalled")


# -- the database's views ---------------------------------------------------------------


@dataclass(frozen=True)
class DbView:
    """What one server holds of the workload."""

    audit: frozenset[tuple[int, str, datetime]]  # (publication id, instance, at)
    ids: dict[int, str]  # publication id -> key
    statuses: dict[str, str]  # key -> status
    claims: frozenset[tuple[str, datetime]]  # plugin (task, slot)
    tokens: dict[str, int]  # loop -> the last fencing token granted
    burst: frozenset[str]  # keys of the burst writer's rows

    def audit_keys(self) -> Counter[str]:
        return Counter(self.ids[row[0]] for row in self.audit)


async def read_view(dsn: str) -> DbView:
    conn = await asyncpg.connect(dsn, server_settings=RIG_APP)
    try:
        audit = await conn.fetch("SELECT publication_id, instance, at FROM audit")
        pubs = await conn.fetch("SELECT id, key, status FROM scheduler_publications")
        runs = await conn.fetch("SELECT name, slot FROM scheduler_plugin_runs")
        tokens = await conn.fetch("SELECT loop, token FROM scheduler_fencing")
        burst = await conn.fetch("SELECT key FROM burst")
    finally:
        await conn.close()
    return DbView(
        audit=frozenset((r["publication_id"], r["instance"], r["at"]) for r in audit),
        ids={r["id"]: r["key"] for r in pubs},
        statuses={r["key"]: r["status"] for r in pubs},
        claims=frozenset((r["name"], r["slot"]) for r in runs),
        tokens={r["loop"]: r["token"] for r in tokens},
        burst=frozenset(r["key"] for r in burst),
    )


# -- the workload -----------------------------------------------------------------------


class Writer:
    """Runs one insert after another (``statement``, its key as ``$1``), every ``every`` s,
    on its own connection to the multi-host DSN, reconnecting through any failure. A
    request whose outcome is unknown (the connection died during the commit) is retried
    with the same key, so it never writes twice; ``acked`` holds the keys the database
    confirmed, with when."""

    def __init__(self, dsn: str, statement: str, prefix: str, every: float) -> None:
        self.dsn = dsn
        self.statement = statement
        self.prefix = prefix
        self.every = every
        self.acked: dict[str, float] = {}
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name=prefix)

    def start(self) -> Writer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        assert not self._thread.is_alive(), f"the {self.prefix} writer did not stop"

    async def _run(self) -> None:
        conn: asyncpg.Connection | None = None
        number = 0
        key = ""
        while not self._stop.is_set():
            if not key:
                number += 1
                key = f"{self.prefix}-{number}"
            try:
                if conn is None:
                    conn = await asyncpg.connect(self.dsn, timeout=2, server_settings=RIG_APP)
                await conn.execute(self.statement, key)
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")
                if conn is not None:
                    conn.terminate()
                    conn = None
                await asyncio.sleep(0.02)
                continue  # the same key again: its outcome is unknown
            self.acked[key] = time.time()
            key = ""
            if self.every:
                await asyncio.sleep(self.every)
        if conn is not None:
            await conn.close()


# Publications through plain SQL, each due DUE_IN after it was scheduled.
FEED_STATEMENT = (
    "INSERT INTO scheduler_publications (key, payload, publish_at) "
    f"VALUES ($1, '{{}}', now() + interval '{DUE_IN} seconds') ON CONFLICT (key) DO NOTHING"
)
# A write load as fast as one connection goes, to see how much of it an asynchronous
# standby still lacks when the primary dies.
BURST_STATEMENT = "INSERT INTO burst (key) VALUES ($1) ON CONFLICT (key) DO NOTHING"


def schedule_with_cli(dsn: str, key: str) -> tuple[str, float]:
    """``scheduler-daemon schedule`` on the multi-host DSN; returns its output, ack time."""
    env = {"SCHEDULER_DATABASE_URL": dsn, "SCHEDULER_DATABASE__COMMAND_BUDGET": "30"}
    result = run_cli(["schedule", "--at", "+0.5s", "--key", key, "--payload", "{}"], env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert int(result.stdout), result.stdout
    return result.stdout + result.stderr, time.time()


def replica_env(dsn: str, instance: str, effects_log: Path) -> dict[str, str]:
    task = {"name": PLUGIN_TASK, "every": f"{PLUGIN_EVERY:g}s", "timeout": "10s",
            "target": EFFECTS_TARGETS["async"]}  # fmt: skip
    return {
        **FAST_TIMINGS,
        "SCHEDULER_DATABASE_URL": dsn,
        "SCHEDULER_INSTANCE_ID": instance,
        "SCHEDULER_PUBLISH__INTERVAL": "0.2",
        "SCHEDULER_PUBLISH__PUBLISHERS": '["sql", "effects"]',
        "SCHEDULER_PUBLISH__SQL__STATEMENT": AUDIT_STATEMENT,
        "SCHEDULER_PLUGIN__INTERVAL": "0.1",
        "SCHEDULER_PLUGIN__TASKS": json.dumps([task]),
        "SCHEDULER_PLUGIN__DISABLED": '["purge_publications", "purge_runs"]',
        **effects_env(effects_log, 0.1),
        "EFFECTS_PUBLISH_SECONDS": "0.02",
    }


# -- one run: replicas, feeder, failovers -------------------------------------------------


@dataclass
class Timeline:
    """One stretch of history on one primary: from its promotion (or the start) to the
    crash that ended it (or the end of the run)."""

    begins: float
    start_view: DbView | None = None  # the standby's data at promotion (None: first)
    end_view: DbView | None = None  # everything it had committed when it ended
    failover: Failover | None = None  # the failover that began it


@dataclass
class Run:
    cluster: ReplicatedCluster
    daemons: Daemons
    directory: Path
    replicas: dict[str, DaemonProcess] = field(default_factory=dict)
    timelines: list[Timeline] = field(default_factory=list)
    cli_acked: dict[str, float] = field(default_factory=dict)
    cli_output: list[str] = field(default_factory=list)
    feeder: Writer | None = None
    bursts: list[Writer] = field(default_factory=list)

    @property
    def effects_log(self) -> Path:
        return self.directory / "effects.jsonl"

    def dsn(self) -> str:
        return self.cluster.dsn(DBNAME, password=PASSWORD)

    def start(self, replicas: int = 2) -> None:
        primary = self.cluster.primary_dsn
        run_sync(create_database(primary(), DBNAME))
        migrate(self.dsn())  # the product's own migrate, on the multi-host DSN
        execute(primary(DBNAME), WORKLOAD_DDL)
        self.timelines.append(Timeline(begins=time.time()))
        self.feeder = Writer(self.dsn(), FEED_STATEMENT, "sql", FEED_EVERY).start()
        for number in range(1, replicas + 1):
            name = f"r{number}"
            env = replica_env(self.dsn(), name, self.effects_log)
            self.replicas[name] = self.daemons.start(env, name=name)
        self.schedule_with_cli("cli-0")
        wait_until(lambda: self.work_since(self.timelines[-1].begins), 60, "work on both loops")

    def schedule_with_cli(self, key: str) -> None:
        output, acked = schedule_with_cli(self.dsn(), key)
        self.cli_output.append(output)
        self.cli_acked[key] = acked

    def work_since(self, since: float) -> dict[str, float] | None:
        """The first external record of each loop that started after `since`, once both
        loops have one (a publisher call, a plugin run)."""
        firsts: dict[str, float] = {}
        for run in read_effects(self.effects_log):
            if run.start > since and run.loop not in firsts:
                firsts[run.loop] = run.start
        return firsts if len(firsts) == 2 else None

    def fail_over(
        self,
        *,
        stall: float = 0.0,
        burst: float = 0.0,
        during_stall: Callable[[Run], None] | None = None,
    ) -> dict[str, float]:
        """One failover; returns primary stop -> first work on the new primary, per loop.

        ``stall``: the replication link stalls that long before the crash (after
        ``during_stall(run)``, if given, has run). ``burst``: a writer inserts as fast as
        it can from that long before the crash until work resumes after it."""
        cluster = self.cluster
        views: list[DbView] = []

        def snapshot(standby: PgCluster) -> None:
            views.append(run_sync(read_view(standby.socket_dsn(DBNAME))))

        writer = None
        if burst:
            writer = Writer(self.dsn(), BURST_STATEMENT, f"burst{len(self.timelines)}", 0)
            self.bursts.append(writer.start())
            time.sleep(burst)
        if stall:
            cluster.pause_replication()
            if during_stall is not None:
                during_stall(self)
            time.sleep(stall)
        with ThreadPoolExecutor(1) as pool:
            # A schedule request under way through the failover: its budget covers it.
            during = pool.submit(self.schedule_with_cli, f"cli-{len(self.timelines)}")
            failover = cluster.failover(rebuild=False, before_promote=snapshot)
            with cluster.old_primary_view() as old:
                self.timelines[-1].end_view = run_sync(read_view(old.socket_dsn(DBNAME)))
            begins = failover.promote_started  # no work on the new primary is older
            self.timelines.append(Timeline(begins, start_view=views[0], failover=failover))
            firsts = wait_until(lambda: self.work_since(begins), 60, "work after the failover")
            during.result(60)
        if writer is not None:
            writer.stop()
        cluster.rebuild_standby()
        return {loop: at - failover.stop_started for loop, at in firsts.items()}

    def finish(self) -> None:
        """Stop scheduling, let everything due be published, stop the replicas (exit 0)."""
        assert self.feeder is not None
        self.feeder.stop()
        last_due = time.time() + DUE_IN + 0.5

        def drained() -> bool:
            view = run_sync(read_view(self.cluster.primary_dsn(DBNAME)))
            return time.time() > last_due and "scheduled" not in view.statuses.values()

        wait_until(drained, 60, "every publication published")
        for process in self.replicas.values():
            process.signal(signal.SIGTERM)
        for process in self.replicas.values():
            assert process.wait(30) == 0, process.output()[-3000:]
        self.timelines[-1].end_view = run_sync(read_view(self.cluster.primary_dsn(DBNAME)))

    def outputs(self) -> str:
        return "".join(p.output() for p in self.replicas.values()) + "".join(self.cli_output)


# -- the accounting ---------------------------------------------------------------------


@dataclass
class Accounting:
    """What the failovers lost, and what that explains (see the module docstring)."""

    lost_commits: int = 0  # commit records past the switch points (pg_waldump)
    windows_ms: list[float] = field(default_factory=list)  # first lost commit -> stop
    lost_flips: int = 0  # publications flipped (and audited) on an old primary only
    lost_inserts: int = 0  # publications inserted (by anyone) on an old primary only
    lost_claims: int = 0  # plugin slots claimed on an old primary only
    lost_grants: list[str] = field(default_factory=list)  # loops whose last grant was lost
    acked_lost: list[str] = field(default_factory=list)  # acknowledged schedules, gone
    republished_lost_flip: list[str] = field(default_factory=list)
    republished_rolled_back: list[str] = field(default_factory=list)
    repeated_on_one_primary: list[str] = field(default_factory=list)  # a batch retried
    slots_run_twice: list[tuple[str, str]] = field(default_factory=list)
    lost_claims_that_ran: list[tuple[str, str]] = field(default_factory=list)
    reused_token_runs: list[EffectRun] = field(default_factory=list)  # allowed regressions
    tokens_twice: list[tuple[str, int]] = field(default_factory=list)  # by two primaries
    grants: Counter[str] = field(default_factory=Counter)  # loop -> tokens drawn
    grants_twice: list[tuple[str, int]] = field(default_factory=list)  # (loop, token)
    grants_not_above: list[str] = field(default_factory=list)  # a primary's token <= an older's
    burst_acked: int = 0  # rows the burst writers had confirmed
    burst_lost: list[float] = field(default_factory=list)  # acknowledged, s after the stop
    published: int = 0
    plugin_runs: int = 0

    def describe(self) -> str:
        windows = ", ".join(f"{w:.1f}" for w in self.windows_ms)
        burst = f"{_lost_writes(self.burst_lost)} of {self.burst_acked} acknowledged lost"
        return (
            f"published {self.published}, plugin runs {self.plugin_runs}; lost windows: "
            f"{self.lost_commits} commits (the first {windows} ms before the stop): {self.lost_flips} "
            f"flips, {self.lost_inserts} inserts, {self.lost_claims} claims, grants of "
            f"{self.lost_grants or 'no loop'}; acknowledged schedules lost "
            f"{len(self.acked_lost)}; republished after failover: "
            f"{len(self.republished_lost_flip)} (flip lost), "
            f"{len(self.republished_rolled_back)} (batch rolled back); slots run twice "
            f"{len(self.slots_run_twice)}; tokens handed out twice {self.tokens_twice or 0}"
            + (f"; burst writes: {burst}" if self.burst_acked else "")
            + f"; fencing tokens drawn {sum(self.grants.values())} ("
            + ", ".join(f"{loop} {n}" for loop, n in sorted(self.grants.items()))
            + f"), drawn twice {self.grants_twice or 0}, not above an older primary's "
            f"{self.grants_not_above or 0}"
        )


def _lost_writes(offsets: list[float]) -> str:
    if not offsets:
        return "0"
    return (
        f"{len(offsets)} (acknowledged {min(offsets) * 1000:+.1f} to "
        f"{max(offsets) * 1000:+.1f} ms from the stop)"
    )


def check_failover(run: Run) -> Accounting:
    """Every loss and every repeat, explained by a lost window, exactly; fails naming
    whatever is not. What a mode promises on top is for its test to assert."""
    result = Accounting()
    timelines = run.timelines
    final = _view(timelines[-1].end_view)
    windows = [_lost_window(before, after, result) for before, after in pairwise(timelines)]

    # Each primary flipped each publication at most once; the final one flipped every
    # publication it knows (all are due by now), with its audit row (exactly once).
    for timeline in timelines:
        twice = [key for key, n in _view(timeline.end_view).audit_keys().items() if n > 1]
        assert twice == [], f"flipped twice on one primary: {twice}"
    unpublished = sorted(k for k, status in final.statuses.items() if status != "published")
    assert unpublished == [], f"not published: {unpublished}"
    assert set(final.audit_keys()) == set(final.statuses), "audit rows and flips disagree"
    result.published = len(final.statuses)

    # An acknowledged schedule that is gone was committed in a lost window.
    acked = {**(run.feeder.acked if run.feeder else {}), **run.cli_acked}
    in_windows = {key for window in windows for key in window.statuses}
    result.acked_lost = sorted(key for key in acked if key not in final.statuses)
    unexplained = [key for key in result.acked_lost if key not in in_windows]
    assert unexplained == [], f"acknowledged, lost, and in no lost window: {unexplained}"

    # Burst writes: an acknowledged row that is gone was in a lost window. When it was
    # acknowledged, relative to the stop of that failover, is the window as a client saw
    # it (after the stop, too: a primary takes a few ms to die, committing meanwhile).
    failovers = [after.failover for _, after in pairwise(timelines)]
    for writer in run.bursts:
        result.burst_acked += len(writer.acked)
        for key in (key for key in writer.acked if key not in final.burst):
            lost_in = [f for f, w in zip(failovers, windows, strict=True) if key in w.burst]
            assert lost_in, f"acknowledged write {key} lost, and in no lost window"
            assert lost_in[0] is not None
            result.burst_lost.append(writer.acked[key] - lost_in[0].stop_started)

    # The world outside, by timeline: a primary's work starts after the promotion was
    # asked for, and the old primary's ended before that.
    effects = read_effects(run.effects_log)
    by_timeline: dict[int, list[EffectRun]] = defaultdict(list)
    for record in effects:
        by_timeline[_timeline_of(timelines, record.start)].append(record)

    # A publication whose publisher was called again on a later primary: its earlier
    # flip was in the lost window (committed there only), or never committed (the batch
    # rolled back: external effects are at-least-once). A flip that had reached the
    # standby and was published again would be a double publication.
    calls: dict[str, Counter[int]] = defaultdict(Counter)  # key -> timeline -> calls
    for index, records in by_timeline.items():
        view = _view(timelines[index].end_view)
        for record in records:
            for pid in record.extra.get("ids", ()):
                calls[view.ids[pid]][index] += 1
    for key, per_timeline in sorted(calls.items()):
        if any(n > 1 for n in per_timeline.values()):
            result.repeated_on_one_primary.append(key)
        for index in sorted(per_timeline)[:-1]:
            flip = _flip_of(_view(timelines[index].end_view), key)
            if flip is None:
                result.republished_rolled_back.append(key)
            elif flip in _view(timelines[index + 1].start_view).audit:
                raise AssertionError(
                    f"{key} was published again after a failover, yet its flip {flip} had "
                    "reached the standby: published twice"
                )
            else:
                result.republished_lost_flip.append(key)
    # And every lost flip whose publication the final primary still knows was published
    # again (its row, still scheduled there, was published by the next primary).
    lost_flips = {_view(before.end_view).ids[row[0]] for (before, _), w in
                  zip(pairwise(timelines), windows, strict=True) for row in w.audit}  # fmt: skip
    not_again = sorted(lost_flips & set(final.statuses) - set(result.republished_lost_flip))
    assert not_again == [], f"flips lost, yet never published again: {not_again}"

    # Plugin slots: one run each, unless the claim was lost (the next primary runs the
    # slot again). A lost claim that had run was acknowledged: runs start after it commits.
    plugin = [r for r in effects if r.loop == "plugin"]
    result.plugin_runs = len(plugin)
    slots = Counter((r.extra["task"], r.extra["slot"]) for r in plugin)
    lost_claims = {(task, slot.isoformat()) for w in windows for task, slot in w.claims}
    result.slots_run_twice = sorted(slot for slot, n in slots.items() if n > 1)
    unexplained_slots = [slot for slot in result.slots_run_twice if slot not in lost_claims]
    assert unexplained_slots == [], f"slots run twice, claims not lost: {unexplained_slots}"
    result.lost_claims_that_ran = sorted(slot for slot in lost_claims if slots[slot])
    # Exactly: next_run_at went back with the lost claims, to the first of them, and the
    # next primary runs that slot once more; the later ones it skips (misfire run_once:
    # one catch-up run), so they ran once.
    first_lost: set[tuple[str, str]] = set()
    for window in windows:
        for task in {task for task, _ in window.claims}:
            first = (task, min(slot for t, slot in window.claims if t == task).isoformat())
            first_lost |= {first} if slots[first] else set()  # a claim that ran
    assert set(result.slots_run_twice) == first_lost, (
        f"lost claims that ran {result.lost_claims_that_ran}, the first of each "
        f"{sorted(first_lost)}, slots run twice {result.slots_run_twice}"
    )

    # Outside the database, no two instances at once, and tokens never go backwards,
    # except after a run under a token granted in a lost window: the next primary may
    # hand that number out again.
    reused = _runs_on_lost_tokens(timelines, by_timeline)
    allowed = check_effects(effects, min_runs=4, allow=lambda r: r.run in reused).allowed
    result.reused_token_runs = allowed
    # A token handed out again (equal, which check_effects lets pass, or smaller) by a
    # later primary: only one granted in a lost window.
    used: dict[tuple[str, int], set[int]] = defaultdict(set)  # (loop, token) -> timelines
    for index, records in by_timeline.items():
        for r in records:
            if r.token is not None:
                used[(r.loop, r.token)].add(index)
    result.tokens_twice = sorted(t for t, where in used.items() if len(where) > 1)
    lost_tokens = {(r.loop, r.token) for rs in by_timeline.values() for r in rs if r.run in reused}
    unexplained_tokens = [t for t in result.tokens_twice if t not in lost_tokens]
    assert unexplained_tokens == [], f"tokens handed out twice: {unexplained_tokens}"
    _count_grants(run, result)
    return result


@dataclass(frozen=True)
class Grant:
    """A fencing token drawn: a replica's ``leader.acquired`` line."""

    loop: str
    token: int
    at: float
    instance: str


def _count_grants(run: Run, result: Accounting) -> None:
    """Every token drawn, from every replica's log (the lost windows' grants included: a
    replica logs its grant once committed, on whichever primary): how many per loop, which
    ones twice, and any primary that drew a token not above every token of the primaries
    before it."""
    grants = [
        Grant(e["loop"], e["fencing_token"], event_time(e), name)
        for name, process in run.replicas.items()
        for e in process.log_events()
        if e.get("event") == "leader.acquired"
    ]
    result.grants = Counter(g.loop for g in grants)
    drawn = Counter((g.loop, g.token) for g in grants)
    result.grants_twice = sorted(key for key, n in drawn.items() if n > 1)
    for loop in sorted(result.grants):
        highest: Grant | None = None  # of the primaries before
        for index in range(len(run.timelines)):
            mine = [
                g for g in grants if g.loop == loop and _timeline_of(run.timelines, g.at) == index
            ]
            if not mine:
                continue
            lowest = min(mine, key=lambda g: g.token)
            if highest is not None and lowest.token <= highest.token:
                result.grants_not_above.append(
                    f"{loop}: {lowest.instance} drew {lowest.token} on primary {index}, "
                    f"{highest.instance} {highest.token} on an earlier one"
                )
            top = max(mine, key=lambda g: g.token)
            highest = top if highest is None or top.token > highest.token else highest


def _view(view: DbView | None) -> DbView:
    assert view is not None, "a timeline was not read back"
    return view


def _lost_window(before: Timeline, after: Timeline, result: Accounting) -> DbView:
    """``old - standby`` at one failover, as a view of the lost rows; counted in `result`.

    The standby must never have had what its primary had not."""
    old, start = _view(before.end_view), _view(after.start_view)
    failover = after.failover
    assert failover is not None
    assert start.audit <= old.audit, "the standby had audit rows its primary had not"
    assert start.claims <= old.claims, "the standby had claims its primary had not"
    assert set(start.statuses) <= set(old.statuses), "the standby had rows its primary had not"
    lost_keys = set(old.statuses) - set(start.statuses)
    window = DbView(
        audit=old.audit - start.audit,
        ids=old.ids,
        statuses={key: old.statuses[key] for key in lost_keys},
        claims=old.claims - start.claims,
        tokens={k: v for k, v in old.tokens.items() if v != start.tokens.get(k)},
        burst=old.burst - start.burst,
    )
    if window.audit or window.statuses or window.claims or window.tokens or window.burst:
        assert failover.lost.commits, "rows were lost, yet no commit past the switch point"
    result.lost_commits += len(failover.lost.commits)
    result.windows_ms.append(failover.lost.window(failover.stop_started) * 1000)
    result.lost_flips += len(window.audit)
    result.lost_inserts += len(window.statuses)
    result.lost_claims += len(window.claims)
    result.lost_grants += sorted(window.tokens)
    return window


def _timeline_of(timelines: list[Timeline], at: float) -> int:
    return max(index for index, t in enumerate(timelines) if t.begins <= at)


def _flip_of(view: DbView, key: str) -> tuple[int, str, datetime] | None:
    rows = [row for row in view.audit if view.ids[row[0]] == key]
    return rows[0] if rows else None


def _runs_on_lost_tokens(
    timelines: list[Timeline], by_timeline: dict[int, list[EffectRun]]
) -> set[str]:
    """The external runs (their ids) under a fencing token larger than the one the next
    primary started from: a token granted in the lost window."""
    reused: set[str] = set()
    for index, records in by_timeline.items():
        if index + 1 < len(timelines):
            start = _view(timelines[index + 1].start_view)
            reused |= {
                r.run
                for r in records
                if r.token is not None and r.token > start.tokens.get(r.loop, 0)
            }
    return reused


def report(run: Run, accounting: Accounting, downtimes: list[dict[str, float]]) -> str:
    lines = [accounting.describe()]
    for timeline, firsts in zip(run.timelines[1:], downtimes, strict=True):
        assert timeline.failover is not None
        work = ", ".join(f"{loop} {seconds:.3f}s" for loop, seconds in sorted(firsts.items()))
        lines.append(f"{timeline.failover.describe()}; first work after the stop: {work}")
    # How the new leaders settled with a predecessor that had not handed over (after a
    # failover it is alive, reconnecting: standing by again is no eviction).
    events = [e for p in run.replicas.values() for e in p.log_events()]
    settled = [
        f"{e['loop']} {e['settled_in']:.2f}s"
        + (" (standing by)" if e.get("predecessor_standing_by") else "")
        + ("" if e.get("predecessor_alive") else " (gone)")
        for e in events
        if e.get("event") == "leader.acquired" and "settled_in" in e
    ]
    evicted = sum(e.get("event") == "leader.evicted" for e in events)
    lines.append(
        f"settled: {', '.join(settled) or 'nothing to settle'}; evictions logged {evicted}"
    )
    return "\n".join(lines)


def assert_nothing_leaked(run: Run) -> None:
    assert PASSWORD not in run.outputs(), "the DSN's password appeared in the output"
    assert PASSWORD in run.dsn()  # (so that the check above means something)


# -- the tests --------------------------------------------------------------------------


def failover_run(
    cluster: ReplicatedCluster,
    daemons: Daemons,
    directory: Path,
    *,
    failovers: int,
    stall: float = 0.0,
    burst: float = 0.0,
    during_stall: Callable[[Run], None] | None = None,
    replicas: int = 2,
    steady: float = 1.0,
) -> tuple[Run, Accounting, list[dict[str, float]]]:
    """`replicas` at work, `failovers` failovers `steady` s apart (see Run.fail_over for
    the rest), then the accounting."""
    run = Run(cluster, daemons, directory)
    downtimes: list[dict[str, float]] = []
    run.start(replicas)
    for _ in range(failovers):
        time.sleep(steady)
        downtimes.append(run.fail_over(stall=stall, burst=burst, during_stall=during_stall))
    time.sleep(steady)
    run.schedule_with_cli("cli-last")
    run.finish()
    accounting = check_failover(run)
    assert_nothing_leaked(run)
    print(report(run, accounting, downtimes))
    return run, accounting, downtimes


def assert_fencing_promises(accounting: Accounting) -> None:
    """Both modes: no fencing token is handed out twice, and none goes backwards, however
    much a failover lost; each primary's tokens are above every token of the ones before."""
    assert accounting.grants_twice == [], "a fencing token was drawn twice"
    assert accounting.grants_not_above == [], "a new primary's token was not above the old's"
    assert accounting.tokens_twice == [], "work of two primaries ran under one token"
    assert accounting.reused_token_runs == [], "a fencing token went backwards"


def assert_synchronous_promises(accounting: Accounting) -> None:
    """Synchronous replication: nothing acknowledged is lost. What the lost window holds
    (if anything) were commits still waiting for the standby when the primary died,
    which their clients never saw succeed."""
    assert accounting.acked_lost == [], "acknowledged schedules lost"
    assert accounting.burst_lost == [], "acknowledged writes lost"
    assert accounting.lost_claims_that_ran == [], "a lost claim had run: it was acknowledged"
    assert accounting.slots_run_twice == [], "a plugin slot ran twice"
    assert_fencing_promises(accounting)


@pytest.mark.parametrize("replicated", [SYNC], indirect=True)
def test_synchronous_failover_loses_nothing_acknowledged(
    replicated: ReplicatedCluster, daemons: Daemons, tmp_path: Path
) -> None:
    """~8 s: one failover under load (a burst of writes just before it); nothing
    acknowledged lost, no publication flipped twice, no slot run twice, no overlap
    outside the database, tokens never backwards nor handed out twice."""
    _, accounting, _ = failover_run(replicated, daemons, tmp_path, failovers=1, burst=0.3)
    assert_synchronous_promises(accounting)


@pytest.mark.parametrize("replicated", [ASYNC_STALLED], indirect=True)
def test_asynchronous_failover_loses_exactly_the_window(
    replicated: ReplicatedCluster, daemons: Daemons, tmp_path: Path
) -> None:
    """~8 s: the standby's link stalls STALL_BEFORE_CRASH s before the crash; what the
    standby missed is lost (schedules acknowledged then), published again (flips made
    then) or run again (the first slot claimed then), and nothing else is. The plugin loop
    changes leader in the window, its token past the sequence's WAL log-ahead: the new
    primary's sequence gives that value again, yet no token is handed out twice."""
    _, accounting, _ = failover_run(
        replicated, daemons, tmp_path, failovers=1, stall=STALL_BEFORE_CRASH,
        during_stall=hand_over_past_the_log_ahead,
    )  # fmt: skip
    # The stall put acknowledged work in the window: the accounting had it to explain.
    assert accounting.lost_commits > 0
    assert accounting.acked_lost, "no acknowledged schedule in the window"
    assert accounting.republished_lost_flip, "no flip in the window"
    assert "plugin" in accounting.lost_grants, "the change of leader was not in the window"
    assert_fencing_promises(accounting)


@pytest.mark.chaos_long
@pytest.mark.parametrize("replicated", [SYNC], indirect=True)
def test_synchronous_failover_again_and_again(
    replicated: ReplicatedCluster, daemons: Daemons, tmp_path: Path
) -> None:
    """~25 s: five failovers back and forth, each under a burst of writes, the old
    primary rebuilt as the standby each time."""
    _, accounting, _ = failover_run(replicated, daemons, tmp_path, failovers=5, burst=1.0)
    assert_synchronous_promises(accounting)


@pytest.mark.chaos_long
@pytest.mark.parametrize("replicated", [ASYNC], indirect=True)
def test_asynchronous_failover_natural_window(
    replicated: ReplicatedCluster, daemons: Daemons, tmp_path: Path
) -> None:
    """~25 s: five asynchronous failovers with nothing stalled, each under a burst of
    writes: the window is whatever the standby had not received when the primary died
    (measured and reported; the accounting still has to be exact)."""
    _, accounting, _ = failover_run(replicated, daemons, tmp_path, failovers=5, burst=1.0)
    assert_fencing_promises(accounting)


def hand_over_past_the_log_ahead(run: Run, *, terminate: bool = False) -> None:
    """While the standby is held back: leave the plugin loop's fencing sequence no cached
    value (as ``log_cnt`` more changes of leader would), then hand the plugin loop over
    and wait for its successor's first run. The successor's draw is the first value past
    the sequence's WAL log-ahead: its sequence record is in the lost window, so the
    standby's copy of the sequence has not reached it, and the next primary's sequence
    gives the same value again (a token that was the sequence alone was handed out twice).

    The hand-over: SIGTERM the leader, or (``terminate``) end its lock session, which
    leaves the replica running, to stand by again (its successor waits its settle time)."""
    primary = run.cluster.primary_dsn(DBNAME)
    leader, backend = run_sync(
        _fetch_row(
            primary, "SELECT instance, backend_pid FROM scheduler_leaders WHERE loop = 'plugin'"
        )
    )
    cached = run_sync(_fetch_value(primary, "SELECT log_cnt FROM scheduler_fencing_plugin_seq"))
    burn = "SELECT count(nextval('scheduler_fencing_plugin_seq')) FROM generate_series(1, $1)"
    run_sync(_fetch_value(primary, burn, cached))
    handed_at = time.time()
    if terminate:
        assert run_sync(_fetch_value(primary, "SELECT pg_terminate_backend($1)", backend))
    else:
        run.replicas[leader].signal(signal.SIGTERM)
        assert run.replicas[leader].wait(30) == 0

    def successor_ran() -> bool:
        return any(
            r.loop == "plugin" and r.instance != leader and r.start > handed_at
            for r in read_effects(run.effects_log)
        )

    wait_until(successor_ran, 20, "a run of the new plugin leader")


async def _fetch_value(dsn: str, sql: str, *args: Any) -> Any:
    conn = await asyncpg.connect(dsn, server_settings=RIG_APP)
    try:
        return await conn.fetchval(sql, *args)
    finally:
        await conn.close()


async def _fetch_row(dsn: str, sql: str, *args: Any) -> tuple[Any, ...]:
    conn = await asyncpg.connect(dsn, server_settings=RIG_APP)
    try:
        row = await conn.fetchrow(sql, *args)
    finally:
        await conn.close()
    assert row is not None, sql
    return tuple(row)


FENCING_FAILOVERS = 50


@pytest.mark.chaos_long
@pytest.mark.parametrize("replicated", [ASYNC_STALLED], indirect=True)
def test_fencing_tokens_never_repeat_across_asynchronous_failovers(
    replicated: ReplicatedCluster, daemons: Daemons, tmp_path: Path
) -> None:
    """~4-7 min: FENCING_FAILOVERS asynchronous failovers in a row, each with a change of
    leader in its lost window whose token a sequence alone would hand out again (one
    change of leader in 32 is such a one, without the burn). Never a token drawn twice,
    and every primary's tokens above all the earlier ones'."""
    _, accounting, _ = failover_run(
        replicated, daemons, tmp_path, failovers=FENCING_FAILOVERS, stall=0.2, replicas=3,
        during_stall=lambda run: hand_over_past_the_log_ahead(run, terminate=True),
        steady=0.5,
    )  # fmt: skip
    assert accounting.lost_grants.count("plugin") == FENCING_FAILOVERS
    assert_fencing_promises(accounting)


def test_check_config_takes_a_multi_host_dsn_and_hides_its_password() -> None:
    """The DSN the replicas use, as check-config shows it: every host, the parameter,
    the password hidden (its ':' and '@' percent-encoded, as url.py requires)."""
    url = (
        "postgresql://app:p%40ss%3Aword@127.0.0.1:5433,db2.example:5434/app"
        "?target_session_attrs=read-write"
    )
    result = run_cli(["check-config"], {"SCHEDULER_DATABASE_URL": url})
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)["database_url"]
    assert shown == (
        "postgresql://app:***@127.0.0.1:5433,db2.example:5434/app?target_session_attrs=read-write"
    )
    assert "p%40ss" not in result.stdout + result.stderr


# -- the product fix: a predecessor standing by again is no eviction -------------------


async def test_a_predecessor_waiting_for_the_lock_again_is_no_eviction(pg_url: str) -> None:
    """After a PostgreSQL failover the old leader is alive and reconnected: the new leader
    used to report an eviction (and fire SchedulerLeaderEvicted). One of its sessions
    waiting for the lock says its leadership (and its work) ended: not an eviction. It
    still waits the whole settle_time: a name is no proof of who waits (see the long id
    below). Its old lock session, still listed a moment after the server freed the lock,
    does not wait for it, and counts for nothing."""
    key = 0x5E771E
    lock = {k.removeprefix("SCHEDULER_LOCK__").lower(): v for k, v in FAST_TIMINGS.items()
            if k.startswith("SCHEDULER_LOCK__")}  # fmt: skip
    settings = Settings(database_url=pg_url, instance_id="new", lock=lock)
    predecessor = Predecessor(schema_version=None, instance="old", hostname="elsewhere", pid=1)
    names = ["scheduler-test-rig", "scheduler-daemon/old/pool", "scheduler-daemon/old/lock:plugin"]
    ours, pool, its_lock = [
        await asyncpg.connect(pg_url, server_settings={"application_name": name}) for name in names
    ]
    try:
        await ours.execute("SELECT pg_advisory_lock($1)", key)
        stopping = await wait_for_predecessor(ours, predecessor, key, settings)
        assert stopping["predecessor_alive"]
        assert not stopping["predecessor_standing_by"]  # so it waited the whole bound

        waiting = asyncio.ensure_future(its_lock.execute("SELECT pg_advisory_lock($1)", key))
        await _until_waiting(ours, key)
        standing_by = await wait_for_predecessor(ours, predecessor, key, settings)
        assert standing_by["predecessor_alive"]
        assert standing_by["predecessor_standing_by"]  # not an eviction
        assert standing_by["settled_in"] >= settle_time(settings) - 0.05  # yet waited

        # An id cut at 63 bytes names its siblings too: their waiting proves nothing.
        long_id = "content-platform-scheduler-daemon-prod-7d9f8c6b5d-x7k2p"
        sibling = await asyncpg.connect(
            pg_url,
            server_settings={"application_name": f"scheduler-daemon/{long_id[:-1]}q/lock:plugin"},
        )
        try:
            queued = asyncio.ensure_future(sibling.execute("SELECT pg_advisory_lock($1)", key))
            await _until_waiting(ours, key, count=2)
            cut = await wait_for_predecessor(
                ours, replace(predecessor, instance=long_id), key, settings
            )
            assert cut["predecessor_alive"]
            assert not cut["predecessor_standing_by"]
        finally:
            sibling.terminate()
            await asyncio.wait({queued})

        await pool.close()
        # The predecessor dies: the server ends its sessions (as it would a dead peer's).
        await ours.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE application_name LIKE 'scheduler-daemon/old/%'"
        )
        await asyncio.wait({waiting})
        assert waiting.exception() is not None  # the wait died with its session
        gone = await wait_for_predecessor(ours, predecessor, key, settings)
        assert not gone["predecessor_alive"]
        assert not gone["predecessor_standing_by"]
    finally:
        for conn in (ours, pool, its_lock):
            conn.terminate()


async def _until_waiting(conn: asyncpg.Connection, key: int, count: int = 1) -> None:
    deadline = time.monotonic() + 10
    query = (
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
        "AND objid = ($1::bigint & 4294967295)::oid"
    )
    while await conn.fetchval(query, key) < count:
        assert time.monotonic() < deadline, f"{count} sessions never waited for the lock"
        await asyncio.sleep(0.01)  # the server's state, not ours: poll it
