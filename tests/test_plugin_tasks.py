"""Task declarations (config file, entry points, built-ins) are validated before the daemon
touches the database: a bad one makes `check-config` and `run` exit 78 with one line
naming the task. Real processes; the entry points come from the installed sample plugin
(tests/sample_plugin) and from fake distributions put on PYTHONPATH."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from plugin_targets import TESTS_DIR
from rig.processes import run_cli

from scheduler_daemon.config.settings import Settings
from scheduler_daemon.errors import ConfigError
from scheduler_daemon.plugins.builtin import builtin_tasks
from scheduler_daemon.plugins.tasks import load_tasks

EXIT_CONFIG = 78

pytestmark = [pytest.mark.processes, pytest.mark.usefixtures("clean_env")]  # conftest.py


def toml_value(value: Any) -> str:
    return json.dumps(value)  # strings and numbers: JSON's forms are valid TOML


def write_config(tmp_path: Path, tasks: list[Mapping[str, Any]], extra: str = "") -> Path:
    lines = [extra]
    for task in tasks:
        lines.append("[[plugin.tasks]]")
        lines += [f"{key} = {toml_value(value)}" for key, value in task.items()]
    path = tmp_path / "scheduler.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def base_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {
        "SCHEDULER_DATABASE_URL": f"sqlite:///{tmp_path / 'never-created.db'}",
        "PYTHONPATH": str(TESTS_DIR),
        **extra,
    }


COMMANDS = {"check-config": ["check-config"], "run": ["run", "--only", "plugin"]}


@dataclass(frozen=True)
class Case:
    """One refused configuration, tried with both commands."""

    env: Mapping[str, str]
    config: Path | None
    cwd: Path


Results = dict[str, dict[str, subprocess.CompletedProcess[str]]]


def run_cases(cases: Mapping[str, Case]) -> Results:
    """Run `check-config` and `run --only plugin` for every case, several at a time:
    most of a CLI process's second is spent starting Python, not on a CPU."""
    with ThreadPoolExecutor(max_workers=6) as pool:
        futures = {
            (case_id, command): pool.submit(
                run_cli,
                [*args, *(["--config", str(case.config)] if case.config else [])],
                case.env,
                120,
                case.cwd,
            )
            for case_id, case in cases.items()
            for command, args in COMMANDS.items()
        }
        results: Results = {}
        for (case_id, command), future in futures.items():
            results.setdefault(case_id, {})[command] = future.result()
    return results


def assert_refused(results: Mapping[str, subprocess.CompletedProcess[str]], *fragments: str) -> str:
    line = ""
    for command, result in results.items():
        assert result.returncode == EXIT_CONFIG, (command, result.stdout, result.stderr)
        assert result.stdout == "", command
        lines = result.stderr.splitlines()
        assert len(lines) == 1, (command, result.stderr)
        line = lines[0]
        assert line.startswith("scheduler-daemon: "), line
        for fragment in fragments:
            assert fragment in line, (command, fragment, line)
    return line


GOOD = {"every": "1m", "sql": "SELECT 1"}

BAD_DECLARATIONS = {
    "duplicate name": (
        [{"name": "twice", **GOOD}, {"name": "twice", "every": "2m", "sql": "SELECT 2"}],
        ["'twice'", "duplicate task name"],
    ),
    "name of a built-in": (
        [{"name": "purge_publications", **GOOD}],
        ["'purge_publications'", "declared twice", "config", "builtin"],
    ),
    "bad cron": (
        [{"name": "nightly", "cron": "61 25 * * *", "sql": "SELECT 1"}],
        ["'nightly'", "invalid cron expression '61 25 * * *'"],
    ),
    "cron with too few fields": (
        [{"name": "short", "cron": "0 3 * *", "sql": "SELECT 1"}],
        ["'short'", "invalid cron expression"],
    ),
    "unknown timezone": (
        [{"name": "berlin", "cron": "0 3 * * *", "timezone": "Europe/Berlim", "sql": "SELECT 1"}],
        ["'berlin'", "unknown timezone 'Europe/Berlim'"],
    ),
    "unknown timezone on an interval": (
        [{"name": "ticker", "every": "1m", "timezone": "Mars/Base", "sql": "SELECT 1"}],
        ["'ticker'", "unknown timezone 'Mars/Base'"],
    ),
    "both target and sql": (
        [{"name": "both", "every": "1m", "sql": "SELECT 1", "target": "plugin_targets:tick"}],
        ["'both'", "exactly one of 'target' and 'sql'"],
    ),
    "neither target nor sql": (
        [{"name": "idle", "every": "1m"}],
        ["'idle'", "exactly one of 'target' and 'sql'"],
    ),
    "both every and cron": (
        [{"name": "twice-timed", "every": "1m", "cron": "* * * * *", "sql": "SELECT 1"}],
        ["'twice-timed'", "exactly one of 'every' and 'cron'"],
    ),
    "neither every nor cron": (
        [{"name": "untimed", "sql": "SELECT 1"}],
        ["'untimed'", "exactly one of 'every' and 'cron'"],
    ),
    "target module missing": (
        [{"name": "ghost", "every": "1m", "target": "no_such_module_xyz:run"}],
        ["'ghost'", "cannot import 'no_such_module_xyz'"],
    ),
    "target function missing": (
        [{"name": "typo", "every": "1m", "target": "plugin_targets:tikc"}],
        ["'typo'", "plugin_targets has no 'tikc'"],
    ),
    "target not callable": (
        [{"name": "noncallable", "every": "1m", "target": "plugin_targets:CALLS"}],
        ["'noncallable'", "is not callable"],
    ),
    "target without a colon": (
        [{"name": "dotted", "every": "1m", "target": "plugin_targets.tick"}],
        ["'dotted'", "'package.module:function'"],
    ),
    "target whose import fails": (
        [{"name": "raises", "every": "1m", "target": "plugin_targets_broken:run"}],
        ["'raises'", "cannot import 'plugin_targets_broken'", "settings are missing"],
    ),
}


def case_dir(factory: pytest.TempPathFactory, case_id: str) -> Path:
    return factory.mktemp("".join(c if c.isalnum() else "-" for c in case_id))


@pytest.fixture(scope="module")
def refused_declarations(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[dict[str, Case], Results]:
    cases = {}
    for case_id, (tasks, _) in BAD_DECLARATIONS.items():
        directory = case_dir(tmp_path_factory, case_id)
        cases[case_id] = Case(base_env(directory), write_config(directory, tasks), directory)
    directory = case_dir(tmp_path_factory, "env")
    from_env = [{"name": "from-env", "cron": "every day", "sql": "SELECT 1"}]
    cases["from env"] = Case(
        base_env(directory, SCHEDULER_PLUGIN__TASKS=json.dumps(from_env)), None, directory
    )
    return cases, run_cases(cases)


@pytest.mark.parametrize("case_id", list(BAD_DECLARATIONS))
def test_bad_declaration_exits_78_naming_the_task(
    refused_declarations: tuple[dict[str, Case], Results], case_id: str
) -> None:
    cases, results = refused_declarations
    assert_refused(results[case_id], *BAD_DECLARATIONS[case_id][1])
    # Refused before touching the database: `run` did not even create the SQLite file.
    assert not (cases[case_id].cwd / "never-created.db").exists()


def test_declarations_from_the_environment_are_validated_too(
    refused_declarations: tuple[dict[str, Case], Results],
) -> None:
    _, results = refused_declarations
    assert_refused(results["from env"], "'from-env'", "invalid cron expression")


def effective_tasks(result: subprocess.CompletedProcess[str]) -> dict[str, dict[str, Any]]:
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    return {task["name"]: task for task in report["plugin"]["effective_tasks"]}


def test_good_declarations_are_listed_with_their_schedule_and_source(tmp_path: Path) -> None:
    config = write_config(
        tmp_path,
        [
            {"name": "every-minute", "every": "1m", "sql": "SELECT 1"},
            {
                "name": "nightly",
                "cron": "30 2 * * *",
                "timezone": "Europe/Berlin",
                "target": "plugin_targets:tick_sync",
                "timeout": "10m",
                "misfire": "skip",
            },
        ],
    )
    result = run_cli(["check-config", "--config", str(config)], base_env(tmp_path), cwd=tmp_path)
    assert effective_tasks(result) == {
        "every-minute": {"name": "every-minute", "schedule": "every 60s", "source": "config"},
        "nightly": {
            "name": "nightly",
            "schedule": "cron 30 2 * * * Europe/Berlin",
            "source": "config",
        },
        "purge_publications": {
            "name": "purge_publications",
            "schedule": "every 600s",
            "source": "builtin",
        },
        "purge_runs": {"name": "purge_runs", "schedule": "every 60s", "source": "builtin"},
    }


def test_disabled_and_enabled_false_remove_tasks(tmp_path: Path) -> None:
    config = write_config(
        tmp_path,
        [
            {"name": "kept", "every": "1m", "sql": "SELECT 1"},
            {"name": "switched-off", "every": "1m", "sql": "SELECT 1", "enabled": False},
            {"name": "listed-off", "every": "1m", "sql": "SELECT 1"},
        ],
        extra='[plugin]\ndisabled = ["listed-off", "purge_publications", "purge_runs"]\n',
    )
    result = run_cli(["check-config", "--config", str(config)], base_env(tmp_path), cwd=tmp_path)
    assert set(effective_tasks(result)) == {"kept"}


def test_sample_plugin_tasks_load_from_its_entry_point(tmp_path: Path) -> None:
    args = ["check-config"]
    off = effective_tasks(run_cli(args, base_env(tmp_path), cwd=tmp_path))
    assert not any(name.startswith("sample.") for name in off)  # disabled unless asked

    on_env = base_env(tmp_path, SCHEDULER_SAMPLE_PLUGIN="1")
    on = effective_tasks(run_cli(args, on_env, cwd=tmp_path))
    assert on["sample.greet"] == {
        "name": "sample.greet",
        "schedule": "every 1s",
        "source": "plugin:sample",
    }
    assert on["sample.tidy"]["schedule"] == "cron 30 3 * * * Europe/Berlin"

    no_entry_points = {**on_env, "SCHEDULER_PLUGIN__ENTRY_POINTS": "false"}
    assert "sample.greet" not in effective_tasks(run_cli(args, no_entry_points, cwd=tmp_path))

    disabled = {**on_env, "SCHEDULER_PLUGIN__DISABLED": '["sample.tidy"]'}
    assert set(effective_tasks(run_cli(args, disabled, cwd=tmp_path))) == {
        "purge_publications",
        "purge_runs",
        "sample.greet",
    }


# -- entry points of fake distributions ------------------------------------------------


def fake_distribution(site: Path, provider: str, name: str = "fake") -> Path:
    """A distribution that exists only as ``*.dist-info`` on a path entry: enough for
    importlib.metadata to find its entry points."""
    info = site / f"fake_plugin_{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: fake-plugin-{name}\nVersion: 1.0\n"
    )
    (info / "entry_points.txt").write_text(f"[scheduler_daemon.plugins]\n{name} = {provider}\n")
    return site


def plugin_env(tmp_path: Path, provider: str) -> dict[str, str]:
    site = fake_distribution(tmp_path / "site", provider)
    env = base_env(tmp_path)
    env["PYTHONPATH"] = f"{site}{os.pathsep}{TESTS_DIR}"
    return env


def test_fake_distribution_tasks_are_loaded(tmp_path: Path) -> None:
    env = plugin_env(tmp_path, "plugin_targets:declarations")
    tasks = effective_tasks(run_cli(["check-config"], env, cwd=tmp_path))
    assert tasks["ep.tick"] == {"name": "ep.tick", "schedule": "every 1s", "source": "plugin:fake"}


BAD_PLUGINS = {
    "bad field": ("plugin_targets:bad_schedule", ["'ep.bad'", "plugin:fake", "every:", "'soon'"]),
    "both actions": (
        "plugin_targets:both_actions",
        ["'ep.both'", "plugin:fake", "exactly one of 'target' and 'sql'"],
    ),
    "unknown key": ("plugin_targets:unknown_key", ["'ep.typo'", "timout: unknown key"]),
    "provider raises": (
        "plugin_targets:broken_provider",
        ["plugin 'fake'", "could not read its own settings"],
    ),
    "provider missing": ("plugin_targets:no_such_provider", ["plugin 'fake'"]),
    "not a mapping": ("plugin_targets:not_a_mapping", ["plugin 'fake'", "must be a mapping"]),
}


@pytest.fixture(scope="module")
def refused_plugins(tmp_path_factory: pytest.TempPathFactory) -> Results:
    cases = {}
    for case_id, (provider, _) in BAD_PLUGINS.items():
        directory = case_dir(tmp_path_factory, case_id)
        cases[case_id] = Case(plugin_env(directory, provider), None, directory)
    directory = case_dir(tmp_path_factory, "same-name")
    config = write_config(directory, [{"name": "ep.tick", **GOOD}])
    cases["same name"] = Case(
        plugin_env(directory, "plugin_targets:declarations"), config, directory
    )
    return run_cases(cases)


@pytest.mark.parametrize("case_id", list(BAD_PLUGINS))
def test_bad_plugin_exits_78_naming_it(refused_plugins: Results, case_id: str) -> None:
    assert_refused(refused_plugins[case_id], *BAD_PLUGINS[case_id][1])


def test_config_task_and_plugin_task_with_one_name(refused_plugins: Results) -> None:
    assert_refused(refused_plugins["same name"], "'ep.tick'", "declared twice", "plugin:fake")


# -- the same rules, in process (fast, for the details) --------------------------------


def test_builtin_declarations_are_valid_and_can_be_disabled() -> None:
    settings = Settings(plugin={"entry_points": False})
    assert [spec.name for spec in load_tasks(settings, builtin_tasks(settings))] == [
        "purge_runs",
        "purge_publications",
    ]
    off = Settings(plugin={"entry_points": False, "disabled": ["purge_publications", "purge_runs"]})
    assert load_tasks(off, builtin_tasks(off)) == []


def test_callable_target_from_a_mapping_keeps_its_callable() -> None:
    import plugin_targets

    settings = Settings(plugin={"entry_points": False})
    [spec] = load_tasks(settings, [{"name": "c", "every": 5, "target": plugin_targets.tick}])
    assert spec.target is plugin_targets.tick
    assert spec.is_async
    assert spec.wants_context
    assert spec.source == "builtin"


def test_target_kinds() -> None:
    settings = Settings(
        plugin={
            "entry_points": False,
            "tasks": [
                {"name": "a", "every": 1, "target": "plugin_targets:tick"},
                {"name": "s", "every": 1, "target": "plugin_targets:tick_sync"},
                {"name": "n", "every": 1, "target": "plugin_targets:no_context"},
                {"name": "q", "every": 1, "sql": "SELECT 1"},
            ],
        }
    )
    specs = {spec.name: spec for spec in load_tasks(settings)}
    assert (specs["a"].is_async, specs["a"].wants_context) == (True, True)
    assert (specs["s"].is_async, specs["s"].wants_context) == (False, True)
    assert (specs["n"].is_async, specs["n"].wants_context) == (False, False)
    assert specs["q"].target is None
    assert specs["q"].sql == "SELECT 1"
    assert (specs["q"].timeout, specs["q"].misfire) == (300.0, "run_once")


def test_duplicate_between_builtins_is_refused() -> None:
    settings = Settings(plugin={"entry_points": False})
    twice = [{"name": "x", "every": 1, "sql": "SELECT 1"}] * 2
    with pytest.raises(
        ConfigError, match=r"invalid task 'x': declared twice \(builtin and builtin\)"
    ):
        load_tasks(settings, twice)


def test_jitter_is_a_fixed_offset_per_name_within_its_bound() -> None:
    from datetime import UTC, datetime, timedelta

    from scheduler_daemon.plugins.tasks import Cron, Every, jitter_offset, with_jitter

    offsets = [jitter_offset(f"tenant-{i}", 10.0) for i in range(1000)]
    assert all(timedelta(0) <= o < timedelta(seconds=10) for o in offsets)
    assert offsets == [jitter_offset(f"tenant-{i}", 10.0) for i in range(1000)]  # stable
    # Spread over the bound, not bunched: every tenth of it holds some.
    assert {int(o.total_seconds()) for o in offsets} == set(range(10))
    assert jitter_offset("x", 0) == timedelta(0)

    now = datetime(2027, 3, 1, 12, 0, 40, tzinfo=UTC)  # past the jitter of 12:00
    offset = jitter_offset("feed-7", 30.0)
    # Intervals: on a grid of whole periods from the epoch plus the offset, whatever the
    # first slot was (rows inserted at one instant spread out after their first run).
    every = with_jitter(Every(60), "feed-7", 30.0)
    first = every.first(now)
    assert first == datetime(2027, 3, 1, 12, 1, tzinfo=UTC) + offset
    assert every.next_after(first) == first + timedelta(seconds=60)
    assert every.first(first) == first
    assert every.next_after(now) == first  # from an unjittered slot, onto the grid
    assert every.first_after(first, first + timedelta(minutes=5, seconds=1)) == (
        first + timedelta(minutes=6)
    )
    phases = {with_jitter(Every(10), f"t{i}", 10).next_after(now) for i in range(100)}
    assert len(phases) > 90  # one instant in, a hundred phases out
    cron = with_jitter(Cron("*/5 * * * *", "UTC"), "feed-7", 30.0)
    slot = cron.first(now)
    assert slot == datetime(2027, 3, 1, 12, 5, tzinfo=UTC) + offset
    assert cron.next_after(slot) == datetime(2027, 3, 1, 12, 10, tzinfo=UTC) + offset
    assert cron.first_after(slot, slot + timedelta(minutes=12)) == (
        datetime(2027, 3, 1, 12, 20, tzinfo=UTC) + offset
    )
    assert "jitter 30s" in cron.describe()
