"""Whatever the configuration says, ``check-config`` answers 0 or 78 with one readable
line, never a traceback, and ``run`` refuses what it refuses, with 78, before it opens
any connection.

Every ``SCHEDULER_*`` variable the settings models know (enumerated from them, the nested
``__`` names and the sections given whole as JSON included), the other names the daemon
reads (``SCHEDULER_CONFIG``, …) and unknown ones get any text an environment can hold:
everything but NUL (the OS passes C strings, and ``os.environ`` refuses ``"\\0"``; a test
below says so), bytes that are not UTF-8 included, which Python decodes to the surrogates
U+DC80..U+DCFF. Every key of the TOML file, at every depth, the plugin task tables'
fields included, gets any TOML value, NUL included (TOML's ``\\u0000``), and the file
itself any bytes.

Most examples run in-process (the CLI's entry point under click's runner, as
tests/test_cli.py does), hundreds a second; a few run as real processes
(``rig.processes.run_cli``), to show that the in-process answer is the real one, and that
``run`` gives the same answer without connecting (its database is a listening socket
that must see no connection).
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import string
from collections.abc import Iterator
from datetime import UTC, date, datetime, time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import SecretStr
from rig.commands import Outcome, invoke, real

from scheduler_daemon.config.explain import OTHER_ENV, setting_variables
from scheduler_daemon.config.settings import PluginTaskSettings, WebhookPublisherSettings
from scheduler_daemon.logs import get_logger
from scheduler_daemon.metrics import Metrics
from scheduler_daemon.publishers.webhook import WebhookDeliverer

# The fixtures (a clean environment, a working directory, logging put back) are set up
# once around all of a test's examples, on purpose: each example rewrites the config file
# and passes its variables to click's runner, which restores os.environ after each.
FAST = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
LONG = settings(FAST, max_examples=5000)
REAL = settings(FAST, max_examples=3)

SETTING_VARIABLES = sorted(setting_variables())
DOTTED_KEYS = sorted({key for key, _ in setting_variables().values()})
# Keys of one value, not of a section: what most examples change.
LEAF_KEYS = sorted(
    key
    for key, _ in setting_variables().values()
    if not any(f"{key}." in other for other in DOTTED_KEYS)
)
TASK_FIELDS = sorted(PluginTaskSettings.model_fields)

# Values that mean something to some setting, so that examples get past the first check.
MEANINGFUL = [
    "", " ", "0", "-1", "1", "5", "1.5", "1e400", "inf", "-inf", "nan", "NaN", "30s",
    "250ms", "2m", "1h", "1d", "9999999999999d", "true", "false", "null", "[]", "{}",
    "0x9a37b7a1", "0xffffffffffffffffff", str(2**64), "postgresql://app:hunter2@db:5432/app",
    "postgresql://[::1", "postgresql://h:99999/x", "sqlite:///./scheduler.db",
    "sqlite:///:memory:", "http://hooks.example.com/x", "whsec_!!", "* * * * *",
    "0 0 30 2 *", "*/0 * * * *", "UTC", "Mars/Olympus", "debug", "INFO", "json", "console",
    "session", "transaction", "wait", "poll", "batch", "row", "notify", "sql", "webhook",
    '["notify"]', '["sql"]', '["webhook"]', '["notify", "notify"]', "run_once", "skip",
    "no.such.module:f", "os:sep", "..:x", "$.post_id", "SELECT 1",
]  # fmt: skip

# Any text an environment variable can hold: no NUL; undecodable bytes as surrogates.
ENV_TEXT = st.text(
    st.characters(exclude_categories=["Cs"], exclude_characters="\x00")
    | st.characters(min_codepoint=0xDC80, max_codepoint=0xDCFF),
    max_size=40,
)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(TASK_FIELDS) | st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)
DEEP_JSON = st.integers(1, 5000).map(lambda n: "[" * n + "]" * n)
ENV_VALUES = st.one_of(
    st.sampled_from(MEANINGFUL),
    st.integers(-5, 100_000).map(str),
    ENV_TEXT,
    JSON_VALUES.map(json.dumps),
    DEEP_JSON,
)
ENV_NAMES = st.one_of(
    st.sampled_from(SETTING_VARIABLES),
    st.sampled_from(SETTING_VARIABLES),  # twice as likely
    st.sampled_from(SETTING_VARIABLES).map(str.lower),  # read case-insensitively
    st.sampled_from(sorted(OTHER_ENV)),
    st.text(string.ascii_uppercase + string.digits + "_", max_size=24).map("SCHEDULER_".__add__),
)
ENVIRONMENTS = st.dictionaries(ENV_NAMES, ENV_VALUES, max_size=2)
# Beside a fuzzed file, mostly no variable: each one is another chance of a refusal that
# ends the example before the file's values are judged.
FEW_VARIABLES = st.one_of(st.just({}), st.just({}), st.just({}), ENVIRONMENTS)

# -- TOML --------------------------------------------------------------------------------

TOML_SCALARS = st.one_of(
    st.sampled_from(MEANINGFUL),
    st.text(max_size=30),  # NUL and every control character included: written as escapes
    st.integers(min_value=-(2**63), max_value=2**63 - 1),  # TOML's integers are 64-bit
    st.floats(),  # inf and nan included: TOML has both
    st.booleans(),
    st.datetimes(timezones=st.none() | st.just(UTC)),
    st.dates(),
    st.times(),
)
TOML_VALUES = st.recursive(
    TOML_SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(TASK_FIELDS) | st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)
# Plausible values too, so that most examples pass every other check and the fuzzed one
# is what is judged.
PLAUSIBLE = st.one_of(
    st.sampled_from(MEANINGFUL),
    st.integers(-5, 100_000),
    st.floats(0.001, 1000),
    st.booleans(),
)
ANY_VALUE = PLAUSIBLE | TOML_VALUES
# A task table that would be valid, with a field or two replaced by anything, or removed.
VALID_TASK = {"name": "t", "every": "1s", "sql": "SELECT 1"}
TASK = st.tuples(
    st.dictionaries(st.sampled_from([*TASK_FIELDS, "nmae"]), ANY_VALUE, max_size=2),
    st.sets(st.sampled_from(sorted(VALID_TASK)), max_size=1),
).map(lambda change: {
    key: value for key, value in {**VALID_TASK, **change[0]}.items() if key not in change[1]
})  # fmt: skip
KEY_PATHS = st.one_of(
    *[st.sampled_from(LEAF_KEYS).map(lambda key: key.split("."))] * 4,  # the likeliest
    st.sampled_from(DOTTED_KEYS).map(lambda key: key.split(".")),
    st.lists(st.text(max_size=8), min_size=1, max_size=3),
)


def _unambiguous(entries: list[tuple[list[str], Any]]) -> list[tuple[list[str], Any]]:
    """Drop an entry whose key is another's, or a table of another's (``a = 1`` and
    ``a.b = 2``): TOML refuses those, and it would be most of what the examples test."""
    kept: list[tuple[list[str], Any]] = []
    for path, value in entries:
        if all(path[: len(other)] != other and other[: len(path)] != path for other, _ in kept):
            kept.append((path, value))
    return kept


DOCUMENTS = st.lists(
    st.tuples(KEY_PATHS, ANY_VALUE)
    | st.tuples(st.just(["plugin", "tasks"]), st.lists(TASK, max_size=2)),
    max_size=2,
).map(_unambiguous)


def toml_string(text: str) -> str:
    """A TOML basic string: every character as itself but quotes, backslashes and control
    characters, which are escaped (so NUL is ``\\u0000``)."""
    escaped = "".join(
        f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else "\\" + c if c in '"\\' else c
        for c in text
    )
    return f'"{escaped}"'


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, datetime | date | time):
        return value.isoformat()
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    assert isinstance(value, dict)
    pairs = (f"{toml_string(key)} = {toml_value(item)}" for key, item in value.items())
    return "{" + ", ".join(pairs) + "}"


def toml_document(entries: list[tuple[list[str], Any]]) -> str:
    """Dotted keys at the top level (``"publish"."interval" = …``). (Invalid TOML, keys
    given twice included, is fuzzed as bytes.)"""
    return "".join(
        ".".join(toml_string(part) for part in path) + f" = {toml_value(value)}\n"
        for path, value in entries
    )


# -- running the CLI -----------------------------------------------------------------------


# rig.commands: invoke (in this process) and real (a process of its own), one Outcome.


def assert_config_answer(outcome: Outcome, what: object) -> None:
    """0 and the effective config as JSON, or 78 and one printable line."""
    assert outcome.code in (0, 78), (what, outcome)
    assert "Traceback" not in outcome.stderr, (what, outcome.stderr)
    if outcome.code == 78:
        lines = outcome.stderr.splitlines()
        assert len(lines) == 1, (what, outcome.stderr)
        assert lines[0].startswith("scheduler-daemon: "), (what, lines)
        assert lines[0].isprintable(), (what, lines)  # values are quoted with their escapes
    else:
        assert isinstance(json.loads(outcome.stdout), dict), (what, outcome.stdout)


def comparable(outcome: Outcome) -> tuple[int, Any]:
    """What must be equal in and out of process: the code and the line, or the config
    (less the default instance id, which names the process)."""
    if outcome.code != 0:
        return outcome.code, outcome.stderr.strip().splitlines()[-1:]
    shown = json.loads(outcome.stdout)
    if re.fullmatch(rf"{re.escape(socket.gethostname())}-\d+", shown["instance_id"]):
        shown.pop("instance_id")
    return 0, shown


@pytest.fixture
def clean(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, restore_logging: None) -> Path:
    """No SCHEDULER_* variable of ours, and a directory of the test's own to work in (the
    in-process CLI resolves relative paths against it, as the real one does)."""
    for name in list(os.environ):
        if name.upper().startswith("SCHEDULER_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


# -- the tests -----------------------------------------------------------------------------


def test_an_environment_cannot_hold_nul() -> None:
    """Why the variables are fuzzed without NUL: it cannot reach the daemon that way."""
    with pytest.raises(ValueError, match="embedded null byte"):
        os.environ["SCHEDULER_INSTANCE_ID"] = "a\x00b"


def _check_environment(clean: Path, env: dict[str, str]) -> None:
    assert_config_answer(invoke(["check-config"], env), env)


@FAST
@given(env=ENVIRONMENTS)
def test_any_environment_gets_0_or_78_in_one_line(clean: Path, env: dict[str, str]) -> None:
    _check_environment(clean, env)


@pytest.mark.chaos_long
@LONG
@given(env=ENVIRONMENTS)
def test_any_environment_gets_0_or_78_in_one_line_long(clean: Path, env: dict[str, str]) -> None:
    _check_environment(clean, env)


def _check_file(clean: Path, content: bytes, env: dict[str, str]) -> None:
    config = clean / "config.toml"
    config.write_bytes(content)
    assert_config_answer(invoke(["check-config", "--config", str(config)], env), content)


@FAST
@given(document=DOCUMENTS, env=FEW_VARIABLES)
def test_any_toml_value_for_any_key_gets_0_or_78_in_one_line(
    clean: Path, document: list[tuple[list[str], Any]], env: dict[str, str]
) -> None:
    _check_file(clean, toml_document(document).encode(), env)


@pytest.mark.chaos_long
@LONG
@given(document=DOCUMENTS, env=FEW_VARIABLES)
def test_any_toml_value_for_any_key_gets_0_or_78_in_one_line_long(
    clean: Path, document: list[tuple[list[str], Any]], env: dict[str, str]
) -> None:
    _check_file(clean, toml_document(document).encode(), env)


@settings(FAST, max_examples=100)
@given(content=st.binary(max_size=200))
def test_any_bytes_as_the_config_file_get_0_or_78_in_one_line(clean: Path, content: bytes) -> None:
    _check_file(clean, content, {})


# The bad configurations found by fuzzing, each once before it was fixed: exit 70 and an
# "internal error" line (a traceback under debug), or accepted by check-config and then
# fatal to `run` or to every plugin tick.
FOUND: list[tuple[str, dict[str, str], bytes, str]] = [
    # Each a RecursionError: exit 70.
    ("deep JSON", {"SCHEDULER_PUBLISH__PUBLISHERS": "[" * 3000 + "]" * 3000}, b"",
     "SCHEDULER_PUBLISH__PUBLISHERS: JSON nested too deeply"),
    ("deep TOML", {}, b"a = " + b"[" * 3000 + b"]" * 3000, "nested too deeply"),
    # An AttributeError while naming the failing task: exit 70.
    ("plugin not a table", {}, b'plugin = "-1"', "plugin: Input should be a valid dictionary"),
    # A UnicodeDecodeError: exit 70.
    ("Latin-1 TOML", {}, 'instance_id = "café"'.encode("latin-1"), "not UTF-8 text (byte 0xe9"),
    # Accepted; then `run` exited 70 (HTTP host) or 69 (SQLite path), or (instance id)
    # PostgreSQL's application_name would have been refused at every connection.
    ("NUL host", {}, b'[http]\nhost = "a\\u0000b"', "http.host: contains a NUL character"),
    ("NUL path", {}, b'database_url = "sqlite:///a\\u0000.db"',
     "database_url: contains a NUL character"),
    ("NUL instance", {}, b'instance_id = "a\\u0000b"', "instance_id: contains a NUL character"),
    # Accepted; then OverflowError: `run` exited 69 on SQLite (int(inf) ms of busy_timeout).
    ("infinite timeout", {}, b"[database]\nstatement_timeout = inf",
     "database.statement_timeout: Input should be less than or equal to"),
    # Accepted; then every plugin tick failed (OverflowError computing the next slot, or
    # croniter finding no date), and no task ran at all.
    ("task every 1e300 s", {},
     b'[[plugin.tasks]]\nname = "t"\nevery = 1e300\nsql = "SELECT 1"',
     "plugin.tasks[t].every: Input should be less than or equal to"),
    ("cron on 30 February", {},
     b'[[plugin.tasks]]\nname = "t"\ncron = "0 0 30 2 *"\nsql = "SELECT 1"',
     "cron expression '0 0 30 2 *' never matches a date"),
    # Accepted; then PostgreSQL refused a task name over its index limit on every tick.
    ("task name of 3000 characters", {},
     f'[[plugin.tasks]]\nname = "{"n" * 3000}"\nevery = "1s"\nsql = "SELECT 1"'.encode(),
     "should have at most 500 characters"),
    # Accepted; asyncpg would have set up 10**9 pool places before connecting.
    ("pool of 10**9", {"SCHEDULER_DATABASE__POOL_MAX_SIZE": str(10**9)}, b"",
     "database.pool_max_size: Input should be less than or equal to 10000"),
]  # fmt: skip


@pytest.mark.parametrize(("env", "toml", "message"), [case[1:] for case in FOUND],
                         ids=[case[0] for case in FOUND])  # fmt: skip
def test_configurations_found_by_fuzzing_exit_78(
    clean: Path, env: dict[str, str], toml: bytes, message: str
) -> None:
    config = clean / "config.toml"
    config.write_bytes(toml)
    outcome = invoke(["check-config", "--config", str(config)], env)
    assert_config_answer(outcome, (env, toml))
    assert outcome.code == 78
    assert message in outcome.stderr, outcome.stderr


def test_invalid_utf8_in_a_variable_is_named(clean: Path) -> None:
    """A byte that is not UTF-8 (0xff) in an environment variable."""
    outcome = invoke(["check-config"], {"SCHEDULER_INSTANCE_ID": "host-\udcff"})
    assert_config_answer(outcome, "0xff")
    assert outcome.code == 78
    assert "instance_id: Input should be a valid string" in outcome.stderr


@pytest.fixture
def trap() -> Iterator[socket.socket]:
    """A PostgreSQL "server" that answers nothing: whoever connects is counted."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        listener.setblocking(False)
        yield listener


def connections(listener: socket.socket) -> int:
    count = 0
    while True:
        try:
            conn, _ = listener.accept()
        except BlockingIOError:
            return count
        conn.close()
        count += 1


def trap_url(listener: socket.socket) -> str:
    return f"postgresql://app:hunter2@127.0.0.1:{listener.getsockname()[1]}/app"


# `run` is a real process (about a second each): the kinds of refusal, once each, in
# `make test`; every case in `make chaos`. ("NUL path" names the database the test sets.)
RUN_CASES = [
    pytest.param(*case[1:], id=case[0], marks=[] if case[0] in (
        "deep JSON", "Latin-1 TOML", "NUL instance", "infinite timeout", "cron on 30 February"
    ) else [pytest.mark.chaos_long])
    for case in FOUND
    if case[0] != "NUL path"
]  # fmt: skip


@pytest.mark.parametrize(("env", "toml", "message"), RUN_CASES)
def test_run_refuses_the_same_with_78_before_connecting(
    clean: Path, trap: socket.socket, env: dict[str, str], toml: bytes, message: str
) -> None:
    config = clean / "config.toml"
    config.write_bytes(toml)
    env = {**env, "SCHEDULER_DATABASE_URL": trap_url(trap)}
    checked = invoke(["check-config", "--config", str(config)], env)
    ran = real(["run", "--config", str(config)], env, clean)
    assert ran.code == checked.code == 78, (checked, ran)
    assert ran.stderr == checked.stderr, (checked.stderr, ran.stderr)
    assert message in ran.stderr
    assert connections(trap) == 0, "run connected to the database before refusing"


def _compare_with_real_processes(
    tmp_path: Path, trap: socket.socket, document: list[tuple[list[str], Any]], env: dict[str, str]
) -> None:
    config = tmp_path / "config.toml"
    config.write_text(toml_document(document))
    args = ["check-config", "--config", str(config)]
    inside = invoke(args, env)
    outside = real(args, env, tmp_path)
    assert_config_answer(outside, (document, env))
    assert comparable(inside) == comparable(outside), (document, env)
    if outside.code == 78 and not any(name.upper() == "SCHEDULER_DATABASE_URL" for name in env):
        ran = real(
            ["run", "--config", str(config)],
            {**env, "SCHEDULER_DATABASE_URL": trap_url(trap)},
            tmp_path,
        )
        assert ran.code == 78, (document, env, ran)
        assert connections(trap) == 0, "run connected to the database before refusing"


@REAL
@given(document=DOCUMENTS, env=FEW_VARIABLES)
def test_in_process_answers_are_the_real_ones(
    clean: Path, trap: socket.socket, document: list[tuple[list[str], Any]], env: dict[str, str]
) -> None:
    _compare_with_real_processes(clean, trap, document, env)


@pytest.mark.chaos_long
@settings(REAL, max_examples=100)
@given(document=DOCUMENTS, env=FEW_VARIABLES)
def test_in_process_answers_are_the_real_ones_long(
    clean: Path, trap: socket.socket, document: list[tuple[list[str], Any]], env: dict[str, str]
) -> None:
    _compare_with_real_processes(clean, trap, document, env)


def test_the_fuzzed_names_are_every_setting() -> None:
    """The strategies reach every variable and key the models define, at every depth."""
    assert "SCHEDULER_PUBLISH__WEBHOOK__MAX_BACKOFF" in SETTING_VARIABLES
    assert "SCHEDULER_LOCK__KEYS__PUBLISH" in SETTING_VARIABLES
    assert "SCHEDULER_PLUGIN__TASKS" in SETTING_VARIABLES
    assert "lock.keys.plugin" in DOTTED_KEYS
    assert {"name", "every", "cron", "target", "sql", "timezone"} <= set(TASK_FIELDS)


def test_any_webhook_max_attempts_can_back_off() -> None:
    """`publish.webhook.max_attempts` has no upper bound; the 1,025th retry's backoff was
    an OverflowError (2**1024 as a float), which ended the deliverer."""
    settings = WebhookPublisherSettings(
        url=SecretStr("https://hooks.example.com/x"), secret=SecretStr("s3cr3t"), max_attempts=10**6
    )
    deliverer = WebhookDeliverer(settings, Metrics(), get_logger())
    assert [deliverer.backoff(n) for n in (1, 2, 1025, 10**6)] == [1.0, 2.0, 300.0, 300.0]
