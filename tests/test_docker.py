"""The image and the compose stack, run for real on a Docker engine.

`docker compose up --scale scheduler=3` with the repository's compose file unchanged (its
plugin loop sharded, `SCHEDULER_PLUGIN__SHARDS=12` in the environment compose reads), and
the image on its own with the SQLite default on a volume, checked only through what a
user has: `docker compose exec … scheduler-daemon status --json`, `docker kill`,
`docker compose stop`, container health and exit codes. Where no engine runs (or the base
images are missing), these tests skip with the reason; `.ci/run` starts an engine where it
can and says loudly when it cannot.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from rig.docker import Cleanup, DockerError, docker, docker_available, unique_name
from rig.scene import TAIL_LINES, Scene, psql_scene
from rig.waiting import wait_until

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
CONSTRAINTS = ROOT / "constraints.txt"
IMAGE = "scheduler-daemon:local"
BASE_IMAGES = ("python:3.11-slim", "postgres:16")
# Generous: the machine has 2 cores and the build may be cold.
BUILD_TIMEOUT = 600.0
HEALTHY_TIMEOUT = 120.0

pytestmark = [pytest.mark.docker, pytest.mark.processes]


def _require_engine() -> None:
    reason = docker_available(BASE_IMAGES)
    if reason is not None:
        pytest.skip(f"no Docker engine for the image tests: {reason}")


@dataclass
class Stack:
    """One `docker compose -p <project>` stack of the repository's compose file."""

    project: str
    timings: dict[str, float]
    env_file: Path | None = None  # what `docker compose` interpolates into the file

    def compose(
        self, *args: str, timeout: float = 120.0, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        return docker(
            "compose",
            "--project-directory",
            str(ROOT),
            "-f",
            str(COMPOSE),
            *(["--env-file", str(self.env_file)] if self.env_file is not None else []),
            "-p",
            self.project,
            *args,
            timeout=timeout,
            check=check,
        )

    def containers(self, service: str = "scheduler") -> list[str]:
        out = self.compose("ps", "--all", "--quiet", service).stdout.split()
        return sorted(out)

    def inspect(self, container: str) -> dict[str, Any]:
        data: list[dict[str, Any]] = json.loads(docker("inspect", container).stdout)
        return data[0]

    def status(self) -> dict[str, Any]:
        """`scheduler-daemon status --json`, asked inside a running replica."""
        out = self.compose("exec", "-T", "scheduler", "scheduler-daemon", "status", "--json")
        report: dict[str, Any] = json.loads(out.stdout)
        return report

    def describe(self) -> str:
        """For a failed test's scene: the containers, their last log lines, and the
        database's locks, sessions and leader rows."""
        ps = self.compose("ps", "--all", check=False).stdout
        logs = self.compose("logs", "--no-color", "--tail", str(TAIL_LINES), check=False)
        database = self.compose(
            "exec", "-T", "postgres", "psql", "-U", "scheduler", "-d", "scheduler",
            *psql_scene(), check=False,
        )  # fmt: skip
        return "\n".join(
            (ps, f"--- logs, last {TAIL_LINES} lines of each ---", logs.stdout, database.stdout)
        )

    def psql(self, sql: str) -> str:
        out = self.compose(
            "exec", "-T", "postgres", "psql", "-U", "scheduler", "-d", "scheduler",
            "-At", "-c", sql,
        )  # fmt: skip
        return out.stdout.strip()


SHARDS = 12


@pytest.fixture(scope="module")
def compose_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    _require_engine()
    env_file = tmp_path_factory.mktemp("compose") / "env"
    env_file.write_text(f"SCHEDULER_PLUGIN__SHARDS={SHARDS}\n")
    stack = Stack(project=unique_name("sdtest"), timings={}, env_file=env_file)
    started = time.monotonic()
    stack.compose("build", timeout=BUILD_TIMEOUT)
    stack.timings["build"] = time.monotonic() - started
    try:
        started = time.monotonic()
        stack.compose("up", "--detach", "--scale", "scheduler=3", timeout=HEALTHY_TIMEOUT)
        stack.timings["up"] = time.monotonic() - started
        yield stack
    finally:
        stack.compose("down", "--volumes", "--timeout", "5", check=False, timeout=120)
        print(f"compose timings: {stack.timings}")


@pytest.fixture
def stack(compose_stack: Stack, scene: Scene) -> Stack:
    scene.watch("compose stack", compose_stack.describe)
    return compose_stack


def leaders(report: dict[str, Any]) -> dict[str, str | None]:
    """The leader of each unsharded loop."""
    return {
        loop: (info["leader"] or {}).get("instance")
        for loop, info in report["loops"].items()
        if "members" not in info
    }


def spread(report: dict[str, Any], members: int) -> bool:
    """The sharded plugin loop's shards all led, shared out fairly by `members` replicas."""
    info = report["loops"]["plugin"]
    balance = info["balance"]
    return (
        info["member_count"] == members
        and balance["unled"] == 0
        and balance["largest"] <= -(-SHARDS // members)
    )


def test_compose_scale_3_gives_healthy_replicas_one_leader_per_loop(stack: Stack) -> None:
    replicas = stack.containers()
    assert len(replicas) == 3

    def all_healthy() -> bool:
        return all(
            stack.inspect(c)["State"].get("Health", {}).get("Status") == "healthy" for c in replicas
        )

    started = time.monotonic()
    wait_until(all_healthy, HEALTHY_TIMEOUT, "all replicas healthy", 1.0, (DockerError,))
    stack.timings["healthy"] = time.monotonic() - started

    def settled() -> dict[str, Any] | None:
        report = stack.status()
        publish = report["loops"]["publish"]
        done = publish["leader"] and len(publish["standbys"]) == 2 and spread(report, 3)
        return report if done else None

    report = wait_until(
        settled, 60, "one publish leader, two standbys, the shards spread", 0.25, (DockerError,)
    )
    hostnames = {stack.inspect(c)["Config"]["Hostname"] for c in replicas}
    publish = report["loops"]["publish"]
    plugin = report["loops"]["plugin"]
    for loop, members in (
        ("publish", {publish["leader"]["instance"], *(s["instance"] for s in publish["standbys"])}),
        ("plugin", {m["instance"] for m in plugin["members"] if m["shards"]}),
    ):
        # The default instance id is "<hostname>-<pid>": one per container.
        assert {m.rsplit("-", 1)[0] for m in members} == hostnames, (loop, members)
    shown = stack.compose("exec", "-T", "scheduler", "scheduler-daemon", "status").stdout
    print(f"\n{shown}")  # README.md shows this (Deploy)
    assert f"plugin     {SHARDS} shards over 3 members" in shown, shown

    # The preflight ran once, passed, and is not restarted.
    (preflight,) = stack.containers("preflight")
    state = stack.inspect(preflight)["State"]
    assert (state["Status"], state["ExitCode"]) == ("exited", 0)


def test_the_replicas_run_as_the_unprivileged_image_user(stack: Stack) -> None:
    out = stack.compose("exec", "-T", "scheduler", "id", "-u").stdout.strip()
    assert out == "10001"


def test_a_scheduled_publication_is_published(stack: Stack) -> None:
    out = stack.compose(
        "exec", "-T", "scheduler", "scheduler-daemon", "schedule", "--at", "+1s",
        "--payload", '{"from": "compose"}',
    )  # fmt: skip
    publication = int(out.stdout.strip())

    def published() -> str | None:
        status = stack.psql(f"SELECT status FROM scheduler_publications WHERE id = {publication}")
        return status if status == "published" else None

    started = time.monotonic()
    wait_until(published, 60, "the publication is published", 0.25, (DockerError,))
    stack.timings["publish"] = time.monotonic() - started


def test_docker_kill_of_the_leader_is_taken_over_and_stop_exits_0(stack: Stack) -> None:
    before = wait_until(
        lambda: all(leaders(stack.status()).values()) and stack.status(),
        60,
        "leaders",
        0.25,
        (DockerError,),
    )
    leader = leaders(before)["publish"]
    assert leader is not None
    victim = leader.rsplit("-", 1)[0]  # the container's hostname: its id prefix
    killed_at = time.monotonic()
    docker("kill", victim)

    def taken_over() -> dict[str, str | None] | None:
        now = leaders(stack.status())
        return now if now["publish"] not in (None, leader) else None

    after = wait_until(taken_over, 30, "another replica leads publish", 0.1, (DockerError,))
    stack.timings["kill_to_new_leader_observed"] = time.monotonic() - killed_at
    assert after["publish"] != leader
    wait_until(
        lambda: spread(stack.status(), 2),
        30,
        "the survivors lead every shard",
        0.25,
        (DockerError,),
    )

    survivors = [c for c in stack.containers() if not c.startswith(victim)]
    assert len(survivors) == 2
    stack.compose("stop", timeout=120)
    for container in survivors:
        state = stack.inspect(container)["State"]
        assert (state["Status"], state["ExitCode"]) == ("exited", 0), container


# -- the image on its own -------------------------------------------------------------------


@pytest.fixture(scope="module")
def image(compose_stack: Stack) -> str:
    """The image the compose stack built (built once per module)."""
    return IMAGE


def run_in_image(
    image: str, *args: str, entrypoint: str = "python"
) -> subprocess.CompletedProcess[str]:
    return docker("run", "--rm", "--entrypoint", entrypoint, image, *args, check=False)


def test_the_image_ships_no_pip_or_setuptools(image: str) -> None:
    for module in ("pip", "setuptools", "wheel"):
        for python in ("python", "python3"):
            result = run_in_image(image, "-c", f"import {module}", entrypoint=python)
            assert result.returncode != 0, f"{python} can import {module}"
            assert "ModuleNotFoundError" in result.stderr
    assert run_in_image(image, "-c", "command -v pip pip3", entrypoint="sh").returncode != 0
    # Nothing half-removed: the system Python starts without complaint (no stale .pth).
    clean = run_in_image(image, "-c", "pass", entrypoint="python3")
    assert (clean.returncode, clean.stderr) == (0, "")


def test_the_image_holds_exactly_the_pinned_dependencies(image: str) -> None:
    result = run_in_image(
        image,
        "-c",
        "import importlib.metadata as m, json;"
        "print(json.dumps({d.name.lower().replace('_', '-'): d.version"
        " for d in m.distributions()}))",
    )
    assert result.returncode == 0, result.stderr
    installed: dict[str, str] = json.loads(result.stdout)
    assert installed.pop("scheduler-daemon")
    pinned = {}
    for line in CONSTRAINTS.read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pinned[name.lower().replace("_", "-")] = version
    assert installed == pinned


def healthcheck(image: str) -> list[str]:
    info: list[dict[str, Any]] = json.loads(docker("image", "inspect", image).stdout)
    test: list[str] = info[0]["Config"]["Healthcheck"]["Test"]
    assert test[0] == "CMD", test
    return test[1:]


HEALTH_SETTINGS = {
    "defaults": {},
    "other-port": {"SCHEDULER_HTTP__PORT": "9500"},
    "other-host": {"SCHEDULER_HTTP__HOST": "127.0.0.2"},
    "http-disabled": {"SCHEDULER_HTTP__ENABLED": "false"},
}


def test_the_healthcheck_follows_the_http_settings(image: str) -> None:
    """The image's own HEALTHCHECK command, in a container per setting (all at once)."""
    command = healthcheck(image)
    with Cleanup() as cleanup:
        names = {}
        for case, env in HEALTH_SETTINGS.items():
            names[case] = cleanup.container(unique_name(f"sdtest-health-{case}"))
            flags = [f"--env={k}={v}" for k, v in env.items()]
            docker("run", "--detach", "--name", names[case], *flags, image)
        for case, name in names.items():

            def healthy(name: str = name) -> bool:
                return docker("exec", name, *command, check=False).returncode == 0

            wait_until(healthy, 60, f"{case}: healthcheck {command} passes", 0.5, (DockerError,))
            if case == "http-disabled":
                continue
            # A real check: with the daemon stopped it fails (a short timeout keeps it quick).
            docker("kill", "--signal", "STOP", name)
            stopped = docker("exec", name, *command, "--timeout", "1", check=False, timeout=30)
            assert stopped.returncode != 0, (case, stopped.stdout)
            docker("kill", "--signal", "CONT", name)


def test_a_single_container_on_sqlite_keeps_its_state_on_a_volume(image: str) -> None:
    with Cleanup() as cleanup:
        volume = unique_name("sdtest-data")
        first = cleanup.container(unique_name("sdtest-sqlite"))
        try:
            docker(
                "run",
                "--detach",
                "--name",
                first,
                "-v",
                f"{volume}:/var/lib/scheduler-daemon",
                image,
            )
            out = wait_until(
                lambda: docker(
                    "exec", first, "scheduler-daemon", "schedule", "--at", "+1s", check=False
                ).stdout.strip(),
                60,
                "schedule on the SQLite default",
                0.5,
                (DockerError,),
            )
            publication = int(out)
            query = (
                "import sqlite3; print(sqlite3.connect('scheduler.db').execute("
                f"'SELECT status FROM scheduler_publications WHERE id = {publication}'"
                ").fetchone()[0])"
            )

            def status(container: str) -> str:
                return docker("exec", container, "python", "-c", query).stdout.strip()

            wait_until(
                lambda: status(first) == "published",
                60,
                "published on SQLite",
                0.25,
                (DockerError,),
            )
            docker("stop", "-t", "45", first, timeout=60)
            assert json.loads(docker("inspect", first).stdout)[0]["State"]["ExitCode"] == 0
            # A new container on the same volume sees the same database.
            second = cleanup.container(unique_name("sdtest-sqlite"))
            docker(
                "run",
                "--detach",
                "--name",
                second,
                "-v",
                f"{volume}:/var/lib/scheduler-daemon",
                image,
            )
            wait_until(
                lambda: status(second) == "published",
                60,
                "the state survived",
                0.25,
                (DockerError,),
            )
        finally:
            cleanup.close()
            docker("volume", "rm", volume, check=False)


def test_a_bad_setting_stops_compose_up_at_the_preflight(tmp_path: Path) -> None:
    """Compose cannot skip restarts on exit 78; the preflight keeps replicas from looping."""
    _require_engine()
    override = tmp_path / "bad.yml"
    override.write_text(
        "services:\n"
        + "".join(
            f"  {service}:\n    environment:\n      SCHEDULER_PUBLISH__BATCH_SIZE: banana\n"
            for service in ("preflight", "scheduler")
        )
    )
    project = unique_name("sdtest-bad")
    base = [
        "compose",
        "--project-directory",
        str(ROOT),
        "-f",
        str(COMPOSE),
        "-f",
        str(override),
        "-p",
        project,
    ]
    try:
        result = docker(
            *base, "up", "--detach", "--scale", "scheduler=2", timeout=HEALTHY_TIMEOUT, check=False
        )
        assert result.returncode != 0
        preflight = docker(*base, "ps", "--all", "--quiet", "preflight").stdout.split()
        assert len(preflight) == 1
        state = json.loads(docker("inspect", preflight[0]).stdout)[0]["State"]
        assert state["ExitCode"] == 78
        logs = docker("logs", preflight[0]).stderr
        assert "batch_size" in logs
        # The replicas were created but never started, so none restart-loops.
        for replica in docker(*base, "ps", "--all", "--quiet", "scheduler").stdout.split():
            state = json.loads(docker("inspect", replica).stdout)[0]["State"]
            assert (state["Status"], state["StartedAt"][:4]) == ("created", "0001"), state
    finally:
        docker(*base, "down", "--volumes", "--timeout", "5", check=False, timeout=120)
