"""Manifests checked by the tools that consume them, offline.

- The Kubernetes Deployment, against the API schemas of a pinned Kubernetes release, in
  strict mode (an unknown field is an error): kubernetes-validate ships those schemas.
- The Prometheus alert rules: ``promtool check rules`` (syntax, templates, lint), ``promtool
  test rules`` (each alert fires on its fault, with its labels and annotations, and stays
  quiet in the healthy case), and every series they query is one the daemon exports.
- A live daemon's ``/metrics``, through ``promtool check metrics``.

Each check is also shown failing on a broken copy, so that it is known to read the file.
"""

from __future__ import annotations

import re
import signal
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from rig.metricnames import daemon_metrics, exposed_series
from rig.processes import Daemons
from rig.tools import find_tool

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "kubernetes" / "deployment.yaml"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
ALERTS_TEST = ROOT / "deploy" / "prometheus" / "alerts_test.yml"
DOCS = ROOT / "docs" / "operations.md"

# The Kubernetes release whose API schemas the manifest must satisfy. Raise it with the
# kubernetes-validate lower bound in pyproject.toml.
KUBERNETES_VERSION = "1.37"

PROMTOOL_FROM = "Debian's prometheus package; .ci/run extracts it when run as root"

# Series that Prometheus itself writes for every target, not the daemon.
PROMETHEUS_SERIES = {"up"}


# -- Kubernetes -----------------------------------------------------------------------------


def manifests(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def test_kubernetes_manifest_validates_against_the_pinned_schemas() -> None:
    resources = manifests(K8S.read_text())
    assert [(r["apiVersion"], r["kind"]) for r in resources] == [("apps/v1", "Deployment")]
    for resource in resources:
        # Returns the schema version it used: the pinned one, not an older fallback.
        used = kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)
        assert used == KUBERNETES_VERSION


@pytest.mark.parametrize(
    ("original", "broken", "path", "message"),
    [
        # A misspelled field: only strict mode refuses it (Kubernetes would drop it).
        (
            "terminationGracePeriodSeconds: 45",
            "terminationGracePeriodSecond: 45",
            "spec.template.spec",
            "'terminationGracePeriodSecond' was unexpected",
        ),
        # A string where an integer is required.
        ("replicas: 3", 'replicas: "3"', "spec.replicas", "'3' is not of type 'integer'"),
        # A required field gone: the container's name.
        (
            "- name: scheduler\n          image:",
            "- image:",
            "spec.template.spec.containers.0",
            "'name' is a required property",
        ),
    ],
    ids=["misspelled-field", "string-for-integer", "missing-required-field"],
)
def test_kubernetes_validation_refuses_a_broken_manifest(
    original: str, broken: str, path: str, message: str
) -> None:
    text = K8S.read_text()
    assert original in text
    [resource] = manifests(text.replace(original, broken, 1))
    with pytest.raises(kubernetes_validate.ValidationError) as caught:
        kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)
    assert ".".join(str(part) for part in caught.value.path) == path
    assert message in caught.value.message
    if "unexpected" in message:
        # What strict mode adds: the lenient schemas let the typo through.
        kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=False)


# -- alert rules: the file, the docs and the metrics they query --------------------------------


def alert_rules(text: str) -> list[dict[str, Any]]:
    groups = yaml.safe_load(text)["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def test_alert_rules_are_the_ones_in_the_docs() -> None:
    rules = ALERTS.read_text()
    assert f"```yaml\n{rules}```" in DOCS.read_text()


_PROMQL_WORDS = {"and", "or", "unless", "bool", "offset", "Inf", "NaN"}


def queried_series(expr: str) -> set[str]:
    """The series names a PromQL expression selects (not its functions or label names)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # strings
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", expr)  # label matchers, ranges
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set(re.findall(r"\b[a-zA-Z_:][a-zA-Z0-9_:]*\b(?!\s*\()", expr))
    return names - _PROMQL_WORDS


def test_queried_series_reads_expressions() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le) (rate(a_bucket{x="y z"}[10m]))) > 30\n'
        "  and on (loop, job) b_total offset 5m or absent(c) unless bool d:recorded"
    )
    assert queried_series(expr) == {"a_bucket", "b_total", "c", "d:recorded"}


def test_alerts_query_only_series_the_daemon_exports() -> None:
    exported = set().union(*(exposed_series(metric) for metric in daemon_metrics()))
    assert {"scheduler_leader", "scheduler_publication_lateness_seconds_bucket"} <= exported
    rules = alert_rules(ALERTS.read_text())
    assert len(rules) >= 10
    for rule in rules:
        queried = queried_series(rule["expr"])
        assert queried & exported, f"{rule['alert']} queries none of the daemon's metrics"
        unknown = queried - exported - PROMETHEUS_SERIES
        assert not unknown, f"{rule['alert']} queries series the daemon never exports: {unknown}"


def test_every_alert_has_a_firing_and_a_quiet_unit_test() -> None:
    alerts = {rule["alert"] for rule in alert_rules(ALERTS.read_text())}
    firing: set[str] = set()
    quiet: set[str] = set()
    for case in yaml.safe_load(ALERTS_TEST.read_text())["tests"]:
        for check in case["alert_rule_test"]:
            (firing if check["exp_alerts"] else quiet).add(check["alertname"])
    assert firing == alerts
    assert quiet == alerts
    for case in yaml.safe_load(ALERTS_TEST.read_text())["tests"]:
        for check in case["alert_rule_test"]:
            for alert in check["exp_alerts"]:
                # The labels and annotations are asserted, not just "some alert".
                assert alert["exp_labels"]["severity"] in ("critical", "warning")
                assert alert["exp_annotations"]["summary"]


# -- alert rules: promtool ----------------------------------------------------------------------


def promtool(*args: str, stdin: str | None = None, cwd: Path = ROOT) -> tuple[int, str]:
    result = subprocess.run(
        [find_tool("promtool", PROMTOOL_FROM), *args],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=60,
        check=False,
    )
    return result.returncode, result.stdout + result.stderr


def test_promtool_checks_the_rules() -> None:
    rc, output = promtool("check", "rules", "--lint=all", "--lint-fatal", str(ALERTS))
    assert rc == 0, output
    count = len(alert_rules(ALERTS.read_text()))
    assert f"SUCCESS: {count} rules found" in output, output


def test_promtool_check_rules_refuses_a_broken_rule(tmp_path: Path) -> None:
    broken = tmp_path / "alerts.yml"
    broken.write_text(ALERTS.read_text().replace("sum by (loop) (", "sum by (loop (", 1))
    rc, output = promtool("check", "rules", str(broken))
    assert rc != 0
    assert "parse error" in output, output


def test_promtool_unit_tests_of_the_alerts_pass() -> None:
    rc, output = promtool("test", "rules", str(ALERTS_TEST))
    assert rc == 0, output
    assert "SUCCESS" in output, output


def test_promtool_unit_tests_catch_a_changed_threshold(tmp_path: Path) -> None:
    (tmp_path / ALERTS_TEST.name).write_text(ALERTS_TEST.read_text())
    text = ALERTS.read_text()
    assert text.count("> 30\n") == 1
    (tmp_path / ALERTS.name).write_text(text.replace("> 30\n", "> 300\n"))
    rc, output = promtool("test", "rules", ALERTS_TEST.name, cwd=tmp_path)
    assert rc != 0
    assert "alertname: SchedulerPublicationsLate" in output, output


# -- a live daemon's /metrics -------------------------------------------------------------------


def test_promtool_accepts_a_live_daemons_metrics(daemons: Daemons, sqlite_url: str) -> None:
    promtool_path = find_tool("promtool", PROMTOOL_FROM)  # skip before starting anything
    daemon = daemons.start(
        {
            "SCHEDULER_DATABASE_URL": sqlite_url,
            "SCHEDULER_HTTP__ENABLED": "true",
            "SCHEDULER_HTTP__HOST": "127.0.0.1",
            "SCHEDULER_HTTP__PORT": "0",
        }
    )
    port = daemon.wait_for_log("http.started", timeout=60)["port"]
    daemon.wait_for_log("daemon.started", timeout=60)  # the loops' series are primed
    daemon.wait_for_log("leader.acquired", timeout=30, loop="publish")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        exposition = response.read().decode()
    assert 'scheduler_leader{loop="publish"} 1.0' in exposition
    assert "scheduler_database_up 1.0" in exposition

    result = subprocess.run(
        [promtool_path, "check", "metrics"],
        input=exposition,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (result.returncode, result.stdout + result.stderr) == (0, "")

    # The same check refuses a badly named counter: it really lints its input.
    result = subprocess.run(
        [promtool_path, "check", "metrics"],
        input=exposition.replace("scheduler_ticks_total", "scheduler_ticks"),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode != 0
    assert 'scheduler_ticks counter metrics should have "_total" suffix' in result.stderr

    daemon.signal(signal.SIGTERM)
    assert daemon.wait(45) == 0
