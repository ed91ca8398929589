"""One chaos run: a throwaway PostgreSQL (a primary with a streaming standby when failover is
on offer), N replicas as real ``scheduler-daemon run`` processes, each in its own network
namespace when this machine allows it (each link with a standing delay if the run asks
for one: ``ChaosConfig.rtt_ms``), the workload, the nemesis, and at the end the history
(``history.jsonl``), the checker's verdict and the report, all in one directory.

The nemesis runs the plan's episodes one after another: a fault alone, or two that overlap,
the outer one in a thread of its own (see ``chaos.nemesis``). Who is hit by what, and each
process's state (frozen, and until when), is kept under one lock, so that two faults on one
replica compose or go elsewhere as the nemesis's rules say, and each is recorded with the
window it really had.

Every replica process is an *incarnation* with its own instance id (``r2.3``: replica 2,
third start), so a restarted replica is never mistaken for its previous self by the
checker. A replica started with its clock skewed (libfaketime) writes skewed wall-clock
times into its logs and external records; the history puts them back on the real clock
by the known offset of that incarnation.
"""

from __future__ import annotations

import contextlib
import json
import random
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rig.effects import read_effects
from rig.processes import CLI, DaemonProcess, Daemons, daemon_env
from rig.sql import execute, fetch
from rig.ticks import FAST_TIMINGS, instance_of

from chaos.environment import ChaosDatabase, ChaosNetwork, faketime_env
from chaos.history import History
from chaos.nemesis import (
    ALL_KINDS,
    ENDS_PROCESS,
    OVERLAP,
    PROCESS_FAULTS,
    REPLICA_FAULTS,
    SPARES,
    FaultKind,
    Intent,
    ReplicaState,
    choose_replica,
    episodes,
    plan,
    planned_pairs,
)
from chaos.workload import (
    KEY_PREFIX,
    SHARD_OF_TASKS,
    WORKLOAD_DDL,
    Feeder,
    FeedLog,
    replica_env,
    task_periods,
)

# Leadership log events, and what they mean for the timeline.
LEADER_EVENTS = {
    "leader.acquired": "acquired",
    "leader.released": "released",
    "leader.lost": "lost",
    "leader.stepped_down": "lost",
}
# Sharded leadership (SCHEDULER_PLUGIN__SHARDS > 1): each shard of the plugin loop has an
# owner of its own, and these lines tell when it changed.
SHARD_EVENTS = {"shard.acquired": "acquired", "shard.released": "released", "shard.lost": "lost"}

# The longest the nemesis waits for a fault to be inflicted (a failover's primary stopped
# comes after the standby is in sync and, asynchronous, after the held-back second).
INFLICT_TIMEOUT = 120.0

# After the last fault: long enough for a cut-off leader's lock to be freed and every
# publication due by the end to be published (the checker's grace is shorter than this).
DRAIN_SECONDS = 8.0


@dataclass(frozen=True, slots=True)
class ChaosConfig:
    seed: int
    duration: float
    replicas: int
    directory: Path
    kinds: tuple[FaultKind, ...] = ALL_KINDS
    guaranteed: tuple[FaultKind, ...] = ()
    guaranteed_pairs: tuple[tuple[FaultKind, FaultKind], ...] = ()
    overlap: float = OVERLAP  # how likely an episode is two overlapping faults
    mean_gap: float = 3.0
    lateness_bound: float = 2.0  # seconds, outside fault windows
    recovery_allowance: float = 6.0  # seconds after a fault that still count as its window
    # Sharded leadership of the plugin loop (SCHEDULER_PLUGIN__SHARDS; 1: one leader), and
    # how many plugin tasks the workload adds to spread over the shards (None: as many as
    # there are shards, at most 9; none when there is one).
    shards: int = 1
    shard_tasks: int | None = None
    # A standing delay on every replica's link to the database for the whole run: this
    # much added to each round trip (half of it each way), spares' links included; a bad
    # link (netem) adds its delay on top, and every fault of a link ends back at it. 0: a
    # clean link (tens of microseconds). Needs network namespaces, as partitions do.
    rtt_ms: float = 0.0

    @property
    def extra_tasks(self) -> int:
        if self.shards <= 1:
            return 0
        return min(self.shards, 9) if self.shard_tasks is None else self.shard_tasks


@dataclass
class Incarnation:
    instance: str
    process: DaemonProcess
    skew_seconds: float
    started: float
    ended: float | None = None
    # A SIGSTOP holding it (the fault's id); when and by what the freeze ended, if another
    # fault ended it first (a kill, a SIGTERM's SIGCONT): the SIGSTOP's fault ends there.
    frozen_by: int | None = None
    thawed: float | None = None
    thawed_by: str | None = None
    # The signal the harness ended it with, and whether a SIGTERM had to be followed by a
    # SIGKILL (the checker's unclean_stop).
    ended_by: str | None = None
    forced: bool = False
    unbidden: bool = False  # it had exited before the harness signalled it


@dataclass
class Replica:
    name: str
    index: int  # its network namespace's number
    incarnations: list[Incarnation] = field(default_factory=list)
    # A spare replica runs only while a scale_up has started it (`enabled`): beyond the
    # configured count, it is never restarted by another fault's healing once it left.
    spare: bool = False
    enabled: bool = True

    @property
    def current(self) -> Incarnation | None:
        if self.incarnations and self.incarnations[-1].ended is None:
            return self.incarnations[-1]
        return None


class ChaosRun:
    """Use as a context manager: everything it started is stopped and removed on exit."""

    def __init__(self, config: ChaosConfig) -> None:
        self.config = config
        self.directory = config.directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.effects_log = self.directory / "effects.jsonl"
        self.records: list[dict[str, Any]] = []
        self.skipped: list[dict[str, Any]] = []  # intents that found nothing they could hit
        self.stopping: float | None = None
        self._stack = contextlib.ExitStack()
        self._records_lock = threading.Lock()
        # Faults run two at a time: who is hit by what, and each incarnation's state, are
        # changed under `_lock`; the rig's links under `_net_lock`.
        self._lock = threading.Lock()
        self._net_lock = threading.Lock()
        self._active: dict[str, dict[int, FaultKind]] = {}
        self._leaders: dict[str, str | None] = {}  # each loop's leader when last seen
        self._shards_with_tasks: list[int] | None = None
        spares = SPARES if "scale_up" in config.kinds else 0
        self.replicas = [Replica(f"r{n + 1}", n) for n in range(config.replicas)]
        self.replicas += [
            Replica(f"r{n + 1}", n, spare=True, enabled=False)
            for n in range(config.replicas, config.replicas + spares)
        ]
        self.task_periods = task_periods(config.extra_tasks)
        failover = {"failover_sync", "failover_async"} & set(config.kinds)
        self.network = ChaosNetwork.create(self.directory, len(self.replicas), config.rtt_ms)
        self.db = ChaosDatabase(with_standby=bool(failover), network=self.network)
        self.daemons = Daemons(self.directory / "daemons")
        self.intents = plan(
            config.seed,
            config.duration,
            self._available(config.kinds),
            mean_gap=config.mean_gap,
            overlap=config.overlap,
            guaranteed=config.guaranteed,
            guaranteed_pairs=config.guaranteed_pairs,
        )

    def _available(self, kinds: Sequence[FaultKind]) -> list[FaultKind]:
        """Partitions and bad links need network namespaces; without them (not root) the
        run says so in its meta record instead of pretending."""
        if self.network.enabled:
            return list(kinds)
        return [kind for kind in kinds if kind not in ("partition", "netem")]

    def __enter__(self) -> ChaosRun:
        self._stack.enter_context(self.network)
        self._stack.enter_context(self.db)
        self._stack.callback(self.daemons.close)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    # -- the run ---------------------------------------------------------------------

    def run(self) -> Path:
        """Run the workload under the nemesis; write and return ``history.jsonl``."""
        execute(self.db.admin_dsn, WORKLOAD_DDL)
        # Each link's round trip as it stands, before any fault and after the last heal:
        # the standing delay was there from the start and every fault returned to it.
        round_trips = {"start": self._round_trips()}
        started = time.time()
        for replica in self.replicas:
            if not replica.spare:
                self._start(replica)
        feeder = Feeder(self.db.client_dsn, random.Random(self.config.seed + 1))
        feeder.start()
        try:
            self._nemesis(started)
            self._heal_all()
            round_trips["end"] = self._round_trips()
            feeder.stop()
            time.sleep(DRAIN_SECONDS)
        finally:
            feeder.stop()
            self.stopping = time.time()
            stopped = self._stop_all()
            feeder.close()
        if feeder.failure is not None:
            raise AssertionError(
                f"the feeder died, so the history is not whole: {feeder.failure!r}"
            )
        locks = self.db.advisory_locks()
        return self._write_history(started, stopped, feeder, locks, round_trips)

    def _start(self, replica: Replica, skew_seconds: float = 0.0) -> Incarnation | None:
        """Start a process of `replica`; None for a spare that is not wanted now (a fault
        healing after the scale_up that started it ended)."""
        with self._lock:
            if not replica.enabled:
                return None
            instance = f"{replica.name}.{len(replica.incarnations) + 1}"
        env = {
            **FAST_TIMINGS,
            **replica_env(
                self.db.replica_dsn(replica.index),
                instance,
                self.effects_log,
                shards=self.config.shards,
                extra_tasks=self.config.extra_tasks,
            ),
            **(faketime_env(skew_seconds) if skew_seconds else {}),
        }
        argv = self.network.argv(replica.index, [*CLI, "run"])
        process = self.daemons.spawn(argv, daemon_env(env), name=instance)
        incarnation = Incarnation(instance, process, skew_seconds, time.time())
        with self._lock:
            replica.incarnations.append(incarnation)
        return incarnation

    def _end(
        self,
        replica: Replica,
        sig: int | None,
        wait: float = 20.0,
        sent: Callable[[], None] | None = None,
        why: str | None = None,
    ) -> None:
        """Send `sig` (None: it was sent already), call `sent`, and wait for the exit;
        SIGKILL if it does not come within `wait`. A second SIGTERM would force the exit
        (130), so it is sent once. A frozen process is continued first for any signal
        but SIGKILL (which a stopped process dies of as it is); either way its freeze
        ends here, and the SIGSTOP fault holding it learns when, and by what (`why`)."""
        current = replica.current
        if current is None:
            if sent is not None:
                sent()
            return
        if sig is not None:
            with self._lock:
                _send(current, sig)
                if current.frozen_by is not None and current.thawed is None:
                    current.thawed, current.thawed_by = time.time(), why
        if sent is not None:
            sent()
        try:
            current.process.popen.wait(wait)
        except subprocess.TimeoutExpired:
            current.process.kill()
            current.forced = True
        current.ended = time.time()

    def _stop_all(self) -> float:
        """SIGTERM to every replica at once (as `docker compose stop` does), then wait."""
        for replica in self.replicas:
            if replica.current is not None:
                _send(replica.current, signal.SIGTERM)
        for replica in self.replicas:
            self._end(replica, None)
        return time.time()

    def _heal_all(self) -> None:
        """After the nemesis (every fault healed by its own thread already): whatever is
        left, in case a fault's healing failed. Links go back to the standing delay."""
        for replica in self.replicas:
            with self._net_lock:
                self.network.heal(replica.index)
                self.network.clear(replica.index)
            current = replica.current
            if current is not None:
                current.process.signal(signal.SIGCONT)
            elif not replica.spare:
                self._start(replica)

    def _round_trips(self) -> dict[str, float | None]:
        """Each replica's link's round trip now (ms, a TCP handshake from inside its
        namespace); None where it could not be measured. {} without namespaces."""
        if not self.network.enabled:
            return {}
        measured: dict[str, float | None] = {}
        for replica in self.replicas:
            with self._net_lock:
                try:
                    rtt = self.network.round_trip_ms(replica.index)
                except OSError:
                    rtt = None
            measured[replica.name] = None if rtt is None else round(rtt, 2)
        return measured

    # -- the nemesis -----------------------------------------------------------------

    def _nemesis(self, started: float) -> None:
        """Episode after episode, each at its planned time or, if the one before overran,
        as soon as it is over: never more than the two faults of one episode at once."""
        for group in episodes(self.intents):
            delay = started + group[0].at - time.time()
            if delay > 0:
                time.sleep(delay)
            self._episode(group)
        remaining = started + self.config.duration - time.time()
        if remaining > 0:
            time.sleep(remaining)

    def _episode(self, group: Sequence[Intent]) -> None:
        """One fault; or an outer fault in a thread of its own and, once it is in effect
        and `offset` seconds on, the inner one in this thread. The outer is healed only
        after the inner is inflicted (both always overlap); each heals itself."""
        for loop in ("publish", "plugin"):
            self._leader(loop)  # seen before the outer, should it take the server down
        if len(group) == 1:
            self._fault(group[0], threading.Event())
            return
        outer, inner = group
        outer_in, inner_in = threading.Event(), threading.Event()
        outcome: dict[str, Any] = {}

        def run_outer() -> None:
            try:
                self._fault(outer, outer_in, heal_after=inner_in)
            except BaseException as exc:  # raised again in the nemesis's own thread
                outcome["error"] = exc
            finally:
                outer_in.set()

        thread = threading.Thread(target=run_outer, name=f"chaos-fault-{outer.id}", daemon=True)
        thread.start()
        try:
            outer_in.wait(INFLICT_TIMEOUT)
            time.sleep(inner.offset)
            # The outer's replica while it is in effect (it is healed after the inner).
            self._fault(inner, inner_in, outer_replica=self._hitting(outer.id))
        finally:
            inner_in.set()
            thread.join()
        if "error" in outcome:
            raise outcome["error"]

    def _hitting(self, ident: int) -> Replica | None:
        """The replica fault `ident` hits, while it is in effect."""
        with self._lock:
            return next((r for r in self.replicas if ident in self._active.get(r.name, {})), None)

    def _claim(self, intent: Intent, outer_replica: Replica | None) -> tuple[Replica | None, str]:
        """The replica `intent` hits, registered as hit by it until `_release`; and, if it
        had to go elsewhere than where it was aimed, why (else "")."""
        preferred: str | None = None
        if intent.target.startswith("leader:"):
            instance = self._leader(intent.target.removeprefix("leader:"))
            preferred = next(
                (r.name for r in self.replicas if r.current and r.current.instance == instance),
                None,
            )
        elif intent.target == "outer" and outer_replica is not None:
            preferred = outer_replica.name
        with self._lock:
            states = [
                ReplicaState(
                    replica.name,
                    alive=replica.current is not None
                    and not any(
                        k in ENDS_PROCESS for k in self._active.get(replica.name, {}).values()
                    ),
                    active=tuple(self._active.get(replica.name, {}).values()),
                    spare=replica.spare and not replica.enabled,
                )
                for replica in self.replicas
            ]
            chosen = choose_replica(intent.kind, preferred, intent.pick, states)
            if chosen is None:
                if intent.kind == "scale_up":
                    return None, "no spare replica left"
                if intent.kind == "scale_down":
                    return None, "too few replicas running to stop one"
                return None, "no replica it could hit"
            if intent.kind == "scale_up":
                replica = next(r for r in self.replicas if r.name == chosen)
                replica.enabled = True
            busy = ", ".join(sorted(self._active.get(preferred or "", {}).values()))
            self._active.setdefault(chosen, {})[intent.id] = intent.kind
        replica = next(r for r in self.replicas if r.name == chosen)
        if preferred is None or preferred == chosen:
            return replica, ""
        return replica, f"{intent.target} was {preferred}, under {busy or 'nothing'}"

    def _leader(self, loop: str) -> str | None:
        """Who holds `loop`'s lock, as the server says; while it cannot say (it is down:
        a fault during a restart or a failover), who held it when it last could.

        Sharded, the plugin loop has a leader per shard: its "leader" is then the member
        owning the most shards that have tasks (the most plugin work)."""
        if loop == "plugin" and self.config.shards > 1:
            answered, owners = self.db.shard_owners()
            busy = set(self._busy_shards())
            counts = Counter(who for shard, who in owners.items() if shard in busy)
            top = max(counts, key=lambda who: (counts[who], who), default=None)
            instance = top
        else:
            answered, instance = self.db.lock_holder(loop)
        with self._lock:
            if answered:
                self._leaders[loop] = instance
            return self._leaders.get(loop)

    def _release(self, intent: Intent, replica: Replica) -> None:
        with self._lock:
            self._active.get(replica.name, {}).pop(intent.id, None)

    def _fault(
        self,
        intent: Intent,
        inflicted: threading.Event,
        heal_after: threading.Event | None = None,
        outer_replica: Replica | None = None,
    ) -> Replica | None:
        """Inflict `intent`, set `inflicted`, hold it, wait for `heal_after` (the inner
        fault of the pair, inflicted), heal it, and record it with its real window.
        Returns the replica it hit (None: PostgreSQL, or nothing it could hit)."""
        kind = intent.kind
        replica: Replica | None = None
        if kind in REPLICA_FAULTS:
            replica, moved = self._claim(intent, outer_replica)
            if replica is None:
                inflicted.set()
                self.skipped.append({"id": intent.id, "kind": kind, "reason": moved})
                return None
        start = time.time()
        detail: dict[str, Any] = {}
        instance: str | None = None
        end: float | None = None
        try:
            if replica is not None and kind in REPLICA_FAULTS:
                detail, instance, end = self._replica_fault(intent, replica, inflicted, heal_after)
                if moved:
                    detail["retargeted"] = moved
            else:
                detail = self._database_fault(intent, inflicted, heal_after)
        finally:
            inflicted.set()
            if replica is not None:
                self._release(intent, replica)
        self._record(
            "fault",
            kind=kind,
            target=replica.name if replica is not None else "postgres",
            instance=instance,
            start=start,
            end=end if end is not None else time.time(),
            id=intent.id,
            during=intent.during,
            **detail,
        )
        return replica

    def _wait_for(self, heal_after: threading.Event | None) -> None:
        if heal_after is not None and not heal_after.wait(INFLICT_TIMEOUT):
            raise AssertionError(f"the inner fault was not inflicted in {INFLICT_TIMEOUT:g} s")

    def _replica_fault(
        self,
        intent: Intent,
        replica: Replica,
        inflicted: threading.Event,
        heal_after: threading.Event | None,
    ) -> tuple[dict[str, Any], str | None, float | None]:
        """(detail, the incarnation hit for a process fault, the end if it came early)."""
        kind = intent.kind
        current = replica.current
        # A link fault hits whichever process runs behind the link: no one incarnation.
        instance = current.instance if current is not None and kind in PROCESS_FAULTS else None
        if kind in ("sigkill", "sigterm"):
            sig = signal.SIGKILL if kind == "sigkill" else signal.SIGTERM
            self._end(replica, sig, sent=inflicted.set, why=f"{kind} (fault {intent.id})")
            time.sleep(intent.duration)
            self._wait_for(heal_after)
            self._start(replica)
            return {}, instance, None
        if kind == "scale_down":
            self._end(
                replica, signal.SIGTERM, sent=inflicted.set, why=f"{kind} (fault {intent.id})"
            )
            time.sleep(intent.duration)
            self._wait_for(heal_after)
            self._start(replica)  # it joins again (a spare it was: only while still wanted)
            return {}, instance, None
        if kind == "scale_up":
            joined = self._start(replica)
            inflicted.set()
            time.sleep(intent.duration)
            self._wait_for(heal_after)
            with self._lock:
                replica.enabled = False  # no fault's healing starts it again now
            self._end(replica, signal.SIGTERM, why=f"{kind} (fault {intent.id}) ending")
            return {}, joined.instance if joined is not None else None, None
        if kind == "clock_skew":
            self._end(
                replica, signal.SIGTERM, sent=inflicted.set, why=f"{kind} (fault {intent.id})"
            )
            self._wait_for(heal_after)
            # Whole seconds: what libfaketime is given is what the history subtracts.
            detail = {"skew_seconds": round(intent.skew_minutes * 60)}
            self._start(replica, skew_seconds=detail["skew_seconds"])
            return detail, instance, None
        if kind == "sigstop":
            assert current is not None  # choose_replica hits a live process only
            with self._lock:
                current.frozen_by, current.thawed, current.thawed_by = intent.id, None, None
                current.process.signal(signal.SIGSTOP)
            inflicted.set()
            time.sleep(intent.duration)
            self._wait_for(heal_after)
            with self._lock:
                if current.thawed is None:
                    current.process.signal(signal.SIGCONT)
                    current.thawed = time.time()
                current.frozen_by = None
                ended_by = current.thawed_by
                end = current.thawed
            return ({"ended_by": ended_by} if ended_by else {}), instance, end
        if kind == "partition":
            with self._net_lock:
                self.network.partition(replica.index)
            inflicted.set()
            time.sleep(intent.duration)
            self._wait_for(heal_after)
            with self._net_lock:
                # The rig keeps the link's impairment under a cut (the standing delay, or
                # a bad link still held): the heal brings the link back with it.
                self.network.heal(replica.index)
            return {}, None, None
        assert kind == "netem", kind
        rng = random.Random(intent.pick)
        # The fault's own delay and loss (what the history records): on top of the standing
        # delay, and the link goes back to that after the hold.
        detail = {"delay_ms": rng.randint(50, 300), "loss_pct": rng.choice([0, 2, 5, 10])}
        with self._net_lock:
            self.network.impair(replica.index, jitter_ms=detail["delay_ms"] // 4, **detail)
        inflicted.set()
        time.sleep(intent.duration)
        self._wait_for(heal_after)
        with self._net_lock:
            self.network.clear(replica.index)
        return detail, None, None

    def _database_fault(
        self, intent: Intent, inflicted: threading.Event, heal_after: threading.Event | None
    ) -> dict[str, Any]:
        kind = intent.kind
        if kind in ("pg_restart_fast", "pg_restart_immediate"):
            self.db.stop_primary("fast" if kind == "pg_restart_fast" else "immediate")
            inflicted.set()
            self._wait_for(heal_after)
            self.db.start_primary()
            return {}
        assert kind in ("failover_sync", "failover_async"), kind
        paired = intent.during is not None or heal_after is not None

        def between() -> None:  # the old primary dead, the standby not yet promoted
            inflicted.set()
            self._wait_for(heal_after)

        return self.db.failover(
            synchronous=kind == "failover_sync", before_promote=between if paired else None
        )

    # -- the history -----------------------------------------------------------------

    def _record(self, type_: str, **fields: Any) -> None:
        with self._records_lock:
            self.records.append({"type": type_, **fields})

    def _skews(self) -> dict[str, float]:
        return {inc.instance: inc.skew_seconds for r in self.replicas for inc in r.incarnations}

    def _write_history(
        self,
        started: float,
        stopped: float,
        feeder: Feeder,
        locks: list[dict[str, Any]],
        round_trips: dict[str, dict[str, float | None]],
    ) -> Path:
        skews = self._skews()
        feed = feeder.snapshot()
        records: list[dict[str, Any]] = [
            {
                "type": "meta",
                "seed": self.config.seed,
                "duration": self.config.duration,
                "replicas": self.config.replicas,
                "start": started,
                "end": stopped,
                "stopping": self.stopping,
                "kinds": list(self._available(self.config.kinds)),
                "network_namespaces": self.network.enabled,
                "rtt_ms": self.network.rtt_ms,
                "link_rtt_ms": round_trips,
                "lateness_bound": self.config.lateness_bound,
                "recovery_allowance": self.config.recovery_allowance,
                "async_window": self.db.async_window,
                "expected_slots": dict(self.task_periods),
                "shards": self.config.shards,
                "task_shards": self._task_shards(),
                "spares": [replica.name for replica in self.replicas if replica.spare],
                "skews": {k: v for k, v in skews.items() if v},
                "feeder_errors": len(feed.errors),
                "uncertain_keys": feed.uncertain,
                "overlap": self.config.overlap,
                "planned_pairs": [list(pair) for pair in planned_pairs(self.intents)],
                "skipped_faults": self.skipped,
            }
        ]
        # Faults in the order they began (two of one episode end in either order).
        records += sorted(self.records, key=lambda record: record["start"])
        records += self._publications(feed)
        records += self._database_runs()
        records += self._leader_events(skews)
        records.append({"type": "final_locks", "locks": locks})
        path = self.directory / "history.jsonl"
        with path.open("w") as out:
            for record in records:
                out.write(json.dumps(record, default=str) + "\n")
        # The records the work wrote outside any database, on the real clock.
        history = History.load(path)
        history.add_effects(read_effects(self.effects_log), skews, publication_id=_key_order)
        history.dump(path)
        return path

    def _busy_shards(self) -> list[int]:
        """The shards that have tasks (asked once)."""
        if self._shards_with_tasks is None:
            try:
                self._shards_with_tasks = sorted(set(self._task_shards().values()))
            except Exception:  # the server is down: ask again next time
                return []
        return self._shards_with_tasks

    def _task_shards(self) -> dict[str, int]:
        """Each task's shard, by the daemon's own rule in the database ({} unsharded)."""
        if self.config.shards <= 1:
            return {}
        rows = fetch(self.db.admin_dsn, SHARD_OF_TASKS, list(self.task_periods), self.config.shards)
        return {row["name"]: row["shard"] for row in rows}

    def _publications(self, feed: FeedLog) -> Iterator[dict[str, Any]]:
        """Publications by the number in their key, not their database id: an asynchronous
        failover rewinds the id sequence, so a lost publication's id is given again to a
        new one. Keys are the feeder's and never repeat."""
        acknowledged = {s.key: s for s in feed.scheduled}
        rows = fetch(
            self.db.admin_dsn,
            "SELECT id, key, publish_at, created_at, status "
            "FROM scheduler_publications WHERE key LIKE $1 ORDER BY id",
            KEY_PREFIX + "%",
        )
        in_db = {row["key"]: row for row in rows}
        for key in sorted(set(acknowledged) | set(in_db), key=_key_order):
            row, ack = in_db.get(key), acknowledged.get(key)
            yield {
                "type": "publication",
                "id": _key_order(key),
                "key": key,
                "via": ack.via if ack else ("sql" if _key_order(key) % 2 else "api"),
                "publish_at": row["publish_at"].timestamp() if row else ack.publish_at,
                "created": row["created_at"].timestamp() if row else ack.created,
                "acknowledged": ack is not None,
                "in_database": row is not None,
                "status": row["status"] if row else None,
                "database_id": row["id"] if row else ack.id if ack else None,
            }
        for row in fetch(self.db.admin_dsn, "SELECT key, instance, token, at FROM chaos_audit"):
            yield {
                "type": "publish_effect",
                "id": _key_order(row["key"]),
                "source": "audit",
                "instance": instance_of(row["instance"]),
                "token": row["token"],
                "at": row["at"].timestamp(),
            }
        for key, at in feed.notified:
            yield {"type": "publish_effect", "id": _key_order(key), "source": "notify",
                   "instance": None, "token": None, "at": at}  # fmt: skip
        for start, end in feed.listen_gaps:
            yield {"type": "observer_gap", "source": "notify", "start": start, "end": end}

    def _database_runs(self) -> Iterator[dict[str, Any]]:
        """The runs as the database saw them (the external records are added from the
        effects log by `History.add_effects`)."""
        for row in fetch(
            self.db.admin_dsn,
            "SELECT instance, token, slot, started, ended FROM chaos_sql_runs "
            "WHERE ended IS NOT NULL",
        ):
            slot = row["slot"].isoformat() if row["slot"] else None
            yield {"type": "run", "loop": "plugin", "task": "sql_probe", "slot": slot,
                   "kind": "sql", "source": "db", "instance": instance_of(row["instance"]),
                   "token": row["token"], "start": row["started"].timestamp(),
                   "end": row["ended"].timestamp(), "outcome": "end"}  # fmt: skip
        for row in fetch(
            self.db.admin_dsn,
            "SELECT name, slot, instance, started_at, finished_at, status "
            "FROM scheduler_plugin_runs WHERE name = ANY($1::text[])",
            # The SQL task's own rows (above) are its database record, with the real span
            # of its work and its token: the daemon's bookkeeping row would be a second
            # record of the same run.
            [task for task in self.task_periods if task != "sql_probe"],
        ):
            yield {
                "type": "run",
                "loop": "plugin",
                "task": row["name"],
                "slot": row["slot"].isoformat(),
                "kind": "record",  # the daemon's own record of the run, not work
                "source": "db",
                "instance": row["instance"],
                "token": None,
                "start": row["started_at"].timestamp(),
                "end": (row["finished_at"] or row["started_at"]).timestamp(),
                "outcome": row["status"],
            }

    def _leader_events(self, skews: dict[str, float]) -> Iterator[dict[str, Any]]:
        for replica in self.replicas:
            for incarnation in replica.incarnations:
                skew = incarnation.skew_seconds
                for entry in incarnation.process.log_events():
                    name = str(entry.get("event"))
                    if "timestamp" not in entry:
                        continue
                    at = datetime.fromisoformat(entry["timestamp"]).replace(tzinfo=UTC)
                    if name in SHARD_EVENTS and entry.get("shard") is not None:
                        yield {"type": "leader", "loop": entry.get("loop", "plugin"),
                               "instance": incarnation.instance, "event": SHARD_EVENTS[name],
                               "token": entry.get("fencing_token"), "shard": entry["shard"],
                               "reason": entry.get("reason"),
                               "at": at.timestamp() - skew}  # fmt: skip
                        continue
                    event = LEADER_EVENTS.get(name)
                    if event is None or "loop" not in entry:
                        continue
                    yield {"type": "leader", "loop": entry["loop"],
                           "instance": incarnation.instance, "event": event,
                           "token": entry.get("fencing_token"),
                           "at": at.timestamp() - skew}  # fmt: skip
                code = incarnation.process.poll()
                if incarnation.ended is None and code is None:
                    continue  # still running (the history is written after the stop)
                # A process that exited unbidden was never waited for: its end is when
                # this noticed, at the latest.
                yield {"type": "exit", "instance": incarnation.instance, "code": code,
                       "at": incarnation.ended or time.time(),
                       "signal": incarnation.ended_by, "forced": incarnation.forced,
                       "unbidden": incarnation.unbidden or incarnation.ended is None}  # fmt: skip


def _send(incarnation: Incarnation, sig: int) -> None:
    """Signal a replica's process (continued first, but for SIGKILL, which a stopped
    process dies of as it is), noting what ended it, or that it had ended unbidden."""
    if incarnation.process.poll() is not None:
        incarnation.unbidden = True  # it had exited already: no signal ended it
    if sig != signal.SIGKILL:
        incarnation.process.signal(signal.SIGCONT)
    incarnation.process.signal(sig)
    incarnation.ended_by = signal.Signals(sig).name


def _key_order(key: str) -> int:
    return int(key.removeprefix(KEY_PREFIX))
