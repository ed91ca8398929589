"""Exactly-once publication under fire: real replicas, SIGKILL and SIGSTOP of the leader.

The proof is not the final status alone: an append-only audit table is filled by the
`sql` publisher inside each publishing transaction, so a row published twice (or by a
deposed leader whose transaction still committed) would appear twice.
"""

from __future__ import annotations

import signal
import time

import pytest
from rig.processes import DaemonProcess, Daemons
from rig.sql import fetch, leader_of, scalar
from rig.ticks import FAST_TIMINGS
from rig.waiting import wait_until


def publish_leader(url: str, replicas: dict[str, DaemonProcess]) -> DaemonProcess | None:
    """The running process of `replicas` that leads the publish loop, if any."""
    process = replicas.get(leader_of(url, "publish") or "")
    return process if process is not None and process.poll() is None else None


def wait_for_new_leader(
    url: str, replicas: dict[str, DaemonProcess], old: DaemonProcess, timeout: float = 30
) -> DaemonProcess:
    def new_leader() -> DaemonProcess | None:
        leader = publish_leader(url, replicas)
        return leader if leader is not None and leader is not old else None

    found: DaemonProcess = wait_until(
        new_leader, timeout, f"a publish leader other than {old.name}", 0.05
    )
    return found


SCENARIOS = [
    # Both in `make test-long`: the chaos slice kills and freezes publishing leaders under
    # load with three witnesses in `make test`, and keeps the suite in its 10 minutes.
    pytest.param(2000, (("kill", 0.12), ("stop", 0.4), ("kill", 0.7)), id="2000-rows",
                 marks=pytest.mark.chaos_long),
    pytest.param(
        20000,
        (("kill", 0.1), ("stop", 0.25), ("kill", 0.4), ("stop", 0.55), ("kill", 0.7),
         ("kill", 0.85)),
        id="20000-rows-long",
        marks=pytest.mark.chaos_long,
    ),
]  # fmt: skip


@pytest.mark.postgres
@pytest.mark.parametrize(("rows", "actions"), SCENARIOS)
def test_publications_exactly_once_through_kills_and_stalls(
    daemons: Daemons, pg_url: str, rows: int, actions: tuple[tuple[str, float], ...]
) -> None:
    fetch(pg_url, "CREATE TABLE audit (publication_id bigint NOT NULL, at timestamptz "
                  "NOT NULL DEFAULT clock_timestamp(), by text)")  # fmt: skip
    # Due over the next rows x 4 ms (~8 s for 2,000).
    fetch(
        pg_url,
        "INSERT INTO scheduler_publications (key, payload, publish_at) "
        "SELECT 'c' || g, jsonb_build_object('n', g), now() + interval '3 s' + g * interval '4 ms' "
        "FROM generate_series(1, $1) g",
        rows,
    )
    env = dict(FAST_TIMINGS) | {
        "SCHEDULER_DATABASE_URL": pg_url,
        "SCHEDULER_PUBLISH__INTERVAL": "0.5",
        "SCHEDULER_PUBLISH__BATCH_SIZE": "200",
        "SCHEDULER_PUBLISH__PUBLISHERS": '["sql"]',
        "SCHEDULER_PUBLISH__SQL__STATEMENT": (
            "INSERT INTO audit (publication_id, by) "
            "SELECT unnest($1::bigint[]), current_setting('application_name')"
        ),
    }
    replicas: dict[str, DaemonProcess] = {}

    def launch(name: str) -> None:
        replicas[name] = daemons.start(
            env | {"SCHEDULER_INSTANCE_ID": name}, args=["run", "--only", "publish"], name=name
        )

    for name in ("r1", "r2", "r3"):
        launch(name)
    for process in replicas.values():
        process.wait_for_log("loop.started", loop="publish")

    deadline = time.monotonic() + 30
    while publish_leader(pg_url, replicas) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    spare = (f"r{n}" for n in range(4, 100))
    events: list[str] = []

    def published() -> int:
        return int(scalar(pg_url, "SELECT count(*) FROM audit"))

    for action, fraction in actions:
        while published() < rows * fraction:
            time.sleep(0.05)
        leader = publish_leader(pg_url, replicas)
        assert leader is not None
        if action == "kill":
            leader.signal(signal.SIGKILL)
            wait_for_new_leader(pg_url, replicas, leader)
            launch(next(spare))  # keep two standbys
        else:
            leader.signal(signal.SIGSTOP)
            wait_for_new_leader(pg_url, replicas, leader)
            time.sleep(1.0)  # the new leader publishes while the old one is frozen
            leader.signal(signal.SIGCONT)
            leader.wait_for_log("leader.lost", timeout=15)
        events.append(f"{action} {leader.name} at {published()}")

    deadline = time.monotonic() + 60
    while scalar(pg_url, "SELECT count(*) FROM scheduler_publications WHERE status = 'scheduled'"):
        assert time.monotonic() < deadline, f"rows stuck in scheduled after {events}"
        time.sleep(0.1)

    duplicates = fetch(
        pg_url,
        "SELECT publication_id, count(*) FROM audit GROUP BY 1 HAVING count(*) > 1 LIMIT 5",
    )
    assert duplicates == [], f"published twice: {duplicates} ({events})"
    assert scalar(pg_url, "SELECT count(*) FROM audit") == rows
    assert (
        scalar(pg_url, "SELECT count(*) FROM scheduler_publications WHERE status = 'published'")
        == rows
    )
    assert (
        scalar(
            pg_url,
            "SELECT count(*) FROM scheduler_publications p JOIN audit a ON a.publication_id = p.id",
        )
        == rows
    )
    publishers = {row["by"] for row in fetch(pg_url, "SELECT DISTINCT by FROM audit")}
    assert len(publishers) >= 3, f"leadership must have moved: {publishers}"
    print(f"exactly once through: {events}; published by {sorted(publishers)}")
