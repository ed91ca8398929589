"""Configuration: precedence, value parsing, and one-line errors naming the key."""

from __future__ import annotations

import io
import os
import re
import tomllib
from pathlib import Path
from typing import Any, Literal

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import SecretStr, ValidationError
from rig.processes import run_cli
from rig.ticks import FAST_TIMINGS

from scheduler_daemon.config import load_settings
from scheduler_daemon.config.explain import (
    OTHER_ENV,
    OTHER_ENV_PREFIXES,
    _describe,
    setting_variables,
)
from scheduler_daemon.config.settings import LogSettings, Settings
from scheduler_daemon.config.timing import TIMING_MARGIN, earliest_lock_release
from scheduler_daemon.config.url import DatabaseUrl, postgres_ports
from scheduler_daemon.config.values import lock_key_from_name, parse_duration, parse_lock_key
from scheduler_daemon.errors import ConfigError
from scheduler_daemon.leadership.postgres_session import session_keepalive_settings
from scheduler_daemon.logs import configure_logging, get_logger

ROOT = Path(__file__).resolve().parent.parent


pytestmark = pytest.mark.usefixtures("clean_env")  # conftest.py


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


def test_defaults_need_nothing() -> None:
    settings = load_settings()
    assert settings.database_url.backend == "sqlite"
    assert str(settings.database_url) == "sqlite:///./scheduler.db"
    assert settings.lock.keys.publish == 0x9A37B7A1
    assert settings.lock.keys.plugin == 0x7B9C5F3E
    assert settings.http.host == "127.0.0.1"
    assert settings.http.port == 9464
    assert settings.instance_id.endswith(f"-{os.getpid()}")


def test_file_beats_defaults_and_env_beats_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(
        tmp_path,
        'instance_id = "from-file"\n[publish]\ninterval = "7s"\nbatch_size = 10\n'
        '[lock]\nmode = "transaction"\n',
    )
    from_file = load_settings(path)
    assert from_file.instance_id == "from-file"
    assert from_file.publish.interval == 7.0
    assert from_file.lock.mode == "transaction"

    monkeypatch.setenv("SCHEDULER_PUBLISH__INTERVAL", "2")
    monkeypatch.setenv("SCHEDULER_INSTANCE_ID", "from-env")
    merged = load_settings(path)
    assert merged.publish.interval == 2.0  # env wins
    assert merged.instance_id == "from-env"
    assert merged.publish.batch_size == 10  # the file still fills what env leaves alone
    assert merged.lock.mode == "transaction"


def test_config_file_from_env_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SCHEDULER_CONFIG", str(write(tmp_path, "shutdown_timeout = 3\n")))
    assert load_settings().shutdown_timeout == 3.0


def test_env_forms_from_the_brief(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SCHEDULER_LOCK__MODE", "transaction")
    monkeypatch.setenv("SCHEDULER_HTTP__ENABLED", "false")
    monkeypatch.setenv("SCHEDULER_PUBLISH__PUBLISHERS", '["notify"]')
    monkeypatch.setenv("SCHEDULER_LOCK__KEYS__PUBLISH", "0x10")
    monkeypatch.setenv("SCHEDULER_DATABASE_URL", "postgresql://u:pw@db:5432/app")
    settings = load_settings()
    assert settings.lock.mode == "transaction"
    assert settings.http.enabled is False
    assert settings.publish.publishers == ["notify"]
    assert settings.lock.keys.publish == 16
    assert settings.database_url.backend == "postgres"


@pytest.mark.parametrize(
    ("text", "seconds"),
    [(5, 5.0), (2.5, 2.5), ("5", 5.0), ("5s", 5.0), ("250ms", 0.25), ("2m", 120.0),
     ("1h", 3600.0), ("1.5s", 1.5), (" 3 s ", 3.0), ("1d", 86400.0)],
)  # fmt: skip
def test_durations(text: Any, seconds: float) -> None:
    assert parse_duration(text) == seconds


@given(st.floats(min_value=0.001, max_value=1e6, allow_nan=False))
def test_duration_numbers_round_trip(value: float) -> None:
    assert parse_duration(f"{value}s") == pytest.approx(value)
    assert parse_duration(f"{value * 1000}ms") == pytest.approx(value)


def test_lock_keys() -> None:
    assert parse_lock_key(42) == 42
    assert parse_lock_key("42") == 42
    assert parse_lock_key("0x9a37b7a1") == 0x9A37B7A1
    assert parse_lock_key("0xffffffffffffffff") == -1  # unsigned folded into bigint
    assert parse_lock_key(-(2**63)) == -(2**63)
    with pytest.raises(ValueError, match="64 bits"):
        parse_lock_key(2**64)
    # Fixed vectors: the hash must never change, or upgraded replicas would stop contending
    # with old ones for the same lock.
    assert lock_key_from_name("publish") == -6497433933908059685
    assert lock_key_from_name("my-app/publish") == -1585078199593501522
    assert parse_lock_key("my-app/publish") == lock_key_from_name("my-app/publish")


@pytest.mark.parametrize(
    ("toml", "env", "names"),
    [
        ("[publish]\ninterval = -1\n", {}, "publish.interval"),
        ("[publish]\ninterval = 0\n", {}, "publish.interval"),
        ("", {"SCHEDULER_PUBLISH__INTERVAL": "-1"}, "publish.interval"),
        ('[publish]\nbatch_size = "many"\n', {}, "publish.batch_size"),
        ("", {"SCHEDULER_HTTP__PORT": "http"}, "http.port"),
        ('database_url = "mysql://x@y/z"\n', {}, "database_url"),
        ("", {"SCHEDULER_DATABASE_URL": "redis://localhost"}, "database_url"),
        ('database_url = "sqlite:///:memory:"\n', {}, "database_url"),
        ('[lock]\nmode = "sometimes"\n', {}, "lock.mode"),
        ("", {"SCHEDULER_LOCK__MODE": "sometimes"}, "lock.mode"),
        ("[publish]\nintreval = 5\n", {}, "publish.intreval"),
        ("nonsense = 1\n", {}, "nonsense"),
        ("[plugin]\n[[plugin.tasks]]\nname = 'a'\nevery = '1s'\n", {}, "plugin.tasks[a]"),
        ("[database]\npool_min_size = 9\npool_max_size = 2\n", {}, "database"),
        ("[plugin]\nshards = 0\n", {}, "plugin.shards"),
        ("", {"SCHEDULER_PLUGIN__SHARDS": "1025"}, "plugin.shards"),
        # A rule across sections names its keys itself, once.
        (
            "[plugin]\nshards = 4\n[lock]\nmode = 'transaction'\n",
            {"SCHEDULER_DATABASE_URL": "postgresql://u@h/d"},
            "plugin.shards",
        ),
        ("[plugin]\nshards = 4\n", {"SCHEDULER_DATABASE_URL": "sqlite:///x.db"}, "plugin.shards"),
        (
            "[database]\npool_min_size = 1\npool_max_size = 3\n[lock]\nmode = 'transaction'\n",
            {},
            "database.pool_max_size",
        ),
    ],
)
def test_invalid_values_name_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, toml: str, env: dict[str, str], names: str
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, toml))
    message = str(info.value)
    assert message.startswith(f"invalid config: {names}"), message
    assert "\n" not in message


def test_malformed_toml_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"config\.toml: invalid TOML") as info:
        load_settings(write(tmp_path, "[publish\ninterval = 5\n"))
    assert "\n" not in str(info.value)


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_settings(tmp_path / "absent.toml")


def test_bad_url_error_does_not_echo_the_password(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SCHEDULER_DATABASE_URL", "mysql://admin:hunter2@db/app")
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert "hunter2" not in str(info.value)


def test_redacted_config_hides_the_password(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SCHEDULER_DATABASE_URL", "postgresql://admin:hunter2@db/app")
    settings = load_settings()
    assert "hunter2" not in repr(settings)
    assert "hunter2" not in str(settings.redacted())
    assert "hunter2" not in settings.model_dump_json()
    assert settings.redacted()["database_url"] == "postgresql://admin:***@db/app"
    assert settings.database_url.secret() == "postgresql://admin:hunter2@db/app"


def test_sqlite_paths() -> None:
    assert str(DatabaseUrl.parse("sqlite:///./x.db").sqlite_path) == "x.db"
    assert str(DatabaseUrl.parse("sqlite:////tmp/x.db").sqlite_path) == "/tmp/x.db"
    assert str(DatabaseUrl.parse("sqlite:///data/x.db").sqlite_path) == "data/x.db"


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def test_example_config_matches_the_model_defaults() -> None:
    """config.example.toml lists every key with its default; the two cannot drift."""
    example_path = ROOT / "config.example.toml"
    example = tomllib.loads(example_path.read_text())
    from_example = load_settings(example_path).model_dump(mode="json")
    defaults = Settings().model_dump(mode="json")
    # instance_id's default is computed per process; the example shows it commented out.
    for data in (from_example, defaults):
        data.pop("instance_id")
    assert from_example == defaults
    text = example_path.read_text()
    flat_defaults = _flatten(defaults)
    # Keys without a default (None) are shown commented out, with an example value.
    unset = {key for key, value in flat_defaults.items() if value is None} | {"instance_id"}
    assert set(_flatten(example)) | unset == set(flat_defaults) | {"instance_id"}
    for key in unset:
        assert f"# {key.rsplit('.', 1)[-1]} = " in text, f"{key} is not shown"


def test_task_errors_name_the_task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    toml = "[[plugin.tasks]]\nname = 'a'\nevery = '1s'\nsql = 'x'\n"
    toml += "[[plugin.tasks]]\nname = 'refresh'\nevery = 'often'\nsql = 'x'\n"
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, toml))
    assert str(info.value).startswith("invalid config: plugin.tasks[refresh].every:")
    monkeypatch.setenv("SCHEDULER_PLUGIN__TASKS", '[{"name": "envtask", "every": -1, "sql": "x"}]')
    with pytest.raises(ConfigError, match=r"plugin\.tasks\[envtask\]\.every"):
        load_settings()


def test_duplicate_task_names_do_not_dump_the_list(tmp_path: Path) -> None:
    toml = "[[plugin.tasks]]\nname = 'a'\nevery = '1s'\nsql = 'x'\n" * 2
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, toml))
    assert str(info.value) == "invalid config: plugin.tasks: duplicate task name 'a'"


@pytest.mark.parametrize(
    "toml",
    [
        "[publish.webhook]\nsecret = 123456789\n",
        "[publish.webhook]\nurl = 123456789\n",
        "[publish.webhook]\nurl = ['https://u:123456789@hooks.example.com/x']\n",
        "database_url = 123456789\n",
    ],
)
def test_invalid_secret_values_are_never_echoed(tmp_path: Path, toml: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, toml))
    message = str(info.value)
    assert "123456789" not in message
    assert message.startswith("invalid config: ")
    assert "\n" not in message


@pytest.mark.parametrize(
    ("loc", "value"),
    [
        (("publish", "webhook", "secret"), 123456789),
        (("plugin", "api_token"), 123456789),
        (("extra", "db_password"), 123456789),
        (("x", "callback_url"), 123456789),
        (("x", "database_url"), 123456789),
        (("x", "plain"), SecretStr("123456789")),
    ],
)
def test_describe_hides_secret_bearing_fields(loc: tuple[str, ...], value: Any) -> None:
    error = {"loc": loc, "msg": "Input should be a valid string", "type": "string_type"}
    described = _describe({**error, "input": value}, [])
    assert "123456789" not in described
    assert described.startswith(".".join(loc))
    # A field that carries no secret still shows what was wrong.
    assert "(got 5)" in _describe({**error, "loc": ("publish", "url_style"), "input": 5}, [])


def test_webhook_url_is_secret_and_redacted(monkeypatch: pytest.MonkeyPatch) -> None:
    url = "https://user:pw123@hooks.example.com:8443/services/T000/B000/XXtokenXX?sig=abc"
    monkeypatch.setenv("SCHEDULER_PUBLISH__PUBLISHERS", '["webhook"]')
    monkeypatch.setenv("SCHEDULER_PUBLISH__WEBHOOK__URL", url)
    monkeypatch.setenv("SCHEDULER_PUBLISH__WEBHOOK__SECRET", "hmac-key")
    settings = load_settings()
    assert settings.publish.webhook.url is not None
    assert settings.publish.webhook.url.get_secret_value() == url
    shown = settings.redacted()
    assert shown["publish"]["webhook"]["url"] == "https://hooks.example.com:8443/***"
    for text in (str(shown), repr(settings), settings.model_dump_json()):
        for secret in ("pw123", "XXtokenXX", "sig=abc", "hmac-key", "user:"):
            assert secret not in text


def test_webhook_publisher_still_needs_url_and_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SCHEDULER_PUBLISH__PUBLISHERS", '["webhook"]')
    monkeypatch.setenv("SCHEDULER_PUBLISH__WEBHOOK__SECRET", "hmac-key")
    with pytest.raises(ConfigError, match=r"needs publish\.webhook\.url and \.secret"):
        load_settings()
    monkeypatch.setenv("SCHEDULER_PUBLISH__WEBHOOK__URL", "")
    with pytest.raises(ConfigError, match=r"needs publish\.webhook\.url and \.secret"):
        load_settings()
    monkeypatch.setenv("SCHEDULER_PUBLISH__WEBHOOK__URL", "https://hooks.example.com/x")
    assert load_settings().publish.webhook.url is not None


@pytest.mark.usefixtures("restore_logging")
@pytest.mark.parametrize("fmt", ["console", "json"])
def test_logged_tracebacks_are_scrubbed(fmt: Literal["console", "json"]) -> None:
    stream = io.StringIO()
    configure_logging(LogSettings(format=fmt), stream=stream)
    try:
        raise RuntimeError("cannot reach postgresql://u:pw@h/db")
    except RuntimeError:
        dsn = "postgresql://u:pw@h/db"
        get_logger(instance="t").exception("boom", nested={"to": [dsn]}, error=OSError(dsn))
    output = stream.getvalue()
    assert "boom" in output
    assert "RuntimeError" in output, "the traceback is still logged"
    assert "pw@" not in output
    assert "u:***@h/db" in output


# -- lock timings: the leader stops before the server can free its lock (promise 5) -------


def test_the_reviews_example_is_refused(tmp_path: Path) -> None:
    """Heartbeat 3.2 s with idle = interval = 2.5 s, count 2 used to pass (2.5 + 2.5 x 2 =
    7.5 >= 6.4 + 1) although the server got 2/2/2 after rounding. Now the fractional
    values are refused, and what the server would have got is refused on the arithmetic."""
    toml = "[lock]\nheartbeat_interval = 3.2\nkeepalive_idle = 2.5\nkeepalive_interval = 2.5\n"
    toml += "keepalive_count = 2\n"
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, toml))
    assert str(info.value).startswith(
        "invalid config: lock.keepalive_idle: PostgreSQL takes whole seconds (got 2.5)"
    )
    rounded = toml.replace("2.5", "2")
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, rounded))
    message = str(info.value)
    assert message.startswith("invalid config: lock: timings: "), message
    assert "= 8.4s must not exceed" in message  # 2 x 3.2 + stop_grace 1 + margin 1
    assert message.endswith("= min(10, max(2, 10 - max(2, 2)), 2 x 2) = 4s"), message
    assert "\n" not in message


def test_the_old_defaults_had_no_slack_and_are_refused(tmp_path: Path) -> None:
    """Keepalive 5/2/3 s with heartbeat 2 s: counted from the cut (the server's last packet
    from us may be keepalive_idle old) the server may free the lock after 5 s, when the
    leader may only just have decided to step down (4 s) and its work is still stopping."""
    toml = "[lock]\nkeepalive_idle = 5\nkeepalive_interval = 2\nkeepalive_count = 3\n"
    with pytest.raises(ConfigError, match=r"^invalid config: lock: timings: .* = 5s$"):
        load_settings(write(tmp_path, toml))
    with pytest.raises(ConfigError, match=r"= 5\.001s must not exceed .* = 5s$"):
        load_settings(write(tmp_path, toml + 'stop_grace = "1ms"\n'))


def test_stall_timeout_leaves_room_for_the_work_to_stop(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, '[lock]\nstall_timeout = "5.5s"\n'))
    assert str(info.value) == (
        "invalid config: lock: timings: stall_timeout (5.5s) must be at least "
        "2 x heartbeat_interval + stop_grace + 1s (6s), or the server could end the session "
        "of a leader whose work has not stopped yet"
    )
    assert load_settings(write(tmp_path, "[lock]\nstall_timeout = 6\n")).lock.stall_timeout == 6


def test_the_server_must_not_end_a_polling_standby_between_its_polls(tmp_path: Path) -> None:
    polling = '[lock]\nstandby = "poll"\n'
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, polling + 'poll_interval = "14.5s"\n'))
    assert "lock.poll_interval (14.5s) + 1s must not exceed lock.stall_timeout (15s)" in str(
        info.value
    )
    assert load_settings(write(tmp_path, polling + 'poll_interval = "14s"\n')).lock.standby


def test_stall_timeout_is_whole_milliseconds_as_postgresql_takes_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="stall_timeout"):
        load_settings(write(tmp_path, '[lock]\nstall_timeout = "15.0005s"\n'))


def test_the_old_standby_recheck_setting_is_refused_by_name(tmp_path: Path) -> None:
    """Standbys no longer re-issue their wait (it wrote an ERROR to the server log each
    time): the setting is gone, and a leftover one is a configuration error."""
    with pytest.raises(ConfigError, match=r"lock\.standby_recheck: unknown key"):
        load_settings(write(tmp_path, '[lock]\nstandby_recheck = "10s"\n'))


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("keepalive_idle = 2.5", "lock.keepalive_idle: PostgreSQL takes whole seconds (got 2.5)"),
        (
            'keepalive_interval = "1500ms"',
            "lock.keepalive_interval: PostgreSQL takes whole seconds (got '1500ms')",
        ),
        (
            'tcp_user_timeout = "10.0005s"',
            "lock.tcp_user_timeout: PostgreSQL takes whole milliseconds (got '10.0005s')",
        ),
    ],
)
def test_fractional_tcp_settings_are_refused(tmp_path: Path, line: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, f"[lock]\n{line}\n"))
    assert str(info.value) == f"invalid config: {expected}"


def test_a_fractional_keepalive_from_the_environment_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SCHEDULER_LOCK__KEEPALIVE_IDLE", "2.5")
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert str(info.value) == (
        "invalid config: lock.keepalive_idle: PostgreSQL takes whole seconds (got '2.5')"
    )


@pytest.mark.parametrize(
    ("lock", "sent"),
    [
        ({}, ("2", "2", "4", "10000")),
        # 8001 ms is 8.001 s, and int(8.001 * 1000) == 8000: no float arithmetic on the way.
        (
            {"keepalive_idle": "1s", "keepalive_interval": 2, "keepalive_count": 5,
             "tcp_user_timeout": "8001ms"},
            ("1", "2", "5", "8001"),
        ),
        (
            {"keepalive_idle": "3000ms", "keepalive_interval": "1s", "keepalive_count": 6,
             "tcp_user_timeout": 9.5},
            ("3", "1", "6", "9500"),
        ),
    ],
)  # fmt: skip
def test_session_keepalive_settings_send_exactly_the_configured_values(
    lock: dict[str, Any], sent: tuple[str, str, str, str]
) -> None:
    settings = Settings(lock=lock)
    assert session_keepalive_settings(settings) == dict(
        zip(
            ("tcp_keepalives_idle", "tcp_keepalives_interval", "tcp_keepalives_count",
             "tcp_user_timeout"),
            sent,
            strict=True,
        )
    )  # fmt: skip


def _sent_values(settings: Settings) -> tuple[int, int, int, int]:
    sent = session_keepalive_settings(settings)
    return (
        int(sent["tcp_keepalives_idle"]),
        int(sent["tcp_keepalives_interval"]),
        int(sent["tcp_keepalives_count"]),
        int(sent["tcp_user_timeout"]),
    )


def test_the_defaults_hold_with_two_seconds_to_spare() -> None:
    lock = Settings().lock
    assert lock.stopped_after == 5.0  # 2 x 2 s + stop_grace 1 s
    assert earliest_lock_release(*_sent_values(Settings())) == 8.0
    assert lock.server_frees_lock_after - (lock.stopped_after + TIMING_MARGIN) == 2.0
    assert lock.stall_timeout - (lock.stopped_after + TIMING_MARGIN) == 9.0


def test_the_fast_test_timings_are_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in FAST_TIMINGS.items():
        monkeypatch.setenv(key, value)
    settings = load_settings()
    lock = settings.lock
    assert lock.heartbeat_interval == 0.5
    need = lock.stopped_after + TIMING_MARGIN
    assert need <= earliest_lock_release(*_sent_values(settings)) == lock.server_frees_lock_after
    assert need <= lock.stall_timeout


_DURATION_INPUTS = st.one_of(
    st.integers(min_value=1, max_value=20),
    st.integers(min_value=1, max_value=20_000).map(lambda ms: f"{ms}ms"),
    st.floats(min_value=0.01, max_value=20, allow_nan=False),
)


@given(
    heartbeat=st.integers(min_value=20, max_value=5000).map(lambda ms: f"{ms}ms"),
    stop_grace=st.integers(min_value=1, max_value=3000).map(lambda ms: f"{ms}ms"),
    stall=st.integers(min_value=1, max_value=30),
    idle=_DURATION_INPUTS,
    interval=_DURATION_INPUTS,
    count=st.integers(min_value=1, max_value=10),
    user_timeout=st.one_of(
        st.integers(min_value=1, max_value=40_000).map(lambda ms: f"{ms}ms"),
        st.floats(min_value=0.001, max_value=40, allow_nan=False),
    ),
)
def test_any_accepted_config_stops_the_leader_before_the_server_can_free_its_lock(
    heartbeat: str,
    stop_grace: str,
    stall: int,
    idle: Any,
    interval: Any,
    count: int,
    user_timeout: Any,
) -> None:
    lock = {
        "heartbeat_interval": heartbeat,
        "stop_grace": stop_grace,
        "stall_timeout": stall,
        "keepalive_idle": idle,
        "keepalive_interval": interval,
        "keepalive_count": count,
        "tcp_user_timeout": user_timeout,
    }
    try:
        settings = Settings(lock=lock)
    except ValidationError:
        return  # refused: it never runs
    sent = _sent_values(settings)
    # What the server gets is what was configured, nothing rounded away (a float within
    # 1e-6 of whole seconds, 1.9999999999999964, is taken as those seconds)...
    assert sent[0] == settings.lock.keepalive_idle == pytest.approx(parse_duration(idle), abs=1e-6)
    assert (
        sent[1]
        == settings.lock.keepalive_interval
        == pytest.approx(parse_duration(interval), abs=1e-6)
    )
    assert sent[3] == pytest.approx(parse_duration(user_timeout) * 1000, abs=1e-6)
    # ...and on those values the leader's work has stopped before the server can free the
    # lock (by keepalive) and before a standby can evict it.
    need = 2 * parse_duration(heartbeat) + parse_duration(stop_grace) + 1.0
    assert need <= earliest_lock_release(*sent) + 1e-9
    assert need <= stall + 1e-9


def _keepalive_drop(
    idle: int, interval: int, count: int, user_timeout: int, cut: int, packets: list[int],
    *, linux: bool,
) -> int:  # fmt: skip
    """When the server's kernel drops an idle connection whose peer goes silent at `cut`
    (all times in ms), following Linux's ``tcp_keepalive_timer``: it runs when due, finds
    the time since the last packet received (``elapsed``); below ``idle`` it sleeps until
    then; otherwise it drops the socket if ``user_timeout`` has passed with a probe
    unanswered (``linux``: TCP_USER_TIMEOUT set) or ``count`` probes went unanswered (a
    server without it), else sends a probe and runs again ``interval`` later. Before the
    cut every probe is answered at once, and `packets` arrive from the client (any packet
    resets the unanswered probes, as ``tcp_ack`` does). The socket was set up at 0."""
    received, unanswered, now = 0, 0, idle
    arrivals = sorted(packet for packet in packets if packet < cut)
    while True:
        while arrivals and arrivals[0] <= now:
            received, unanswered = arrivals.pop(0), 0
        elapsed = now - received
        if elapsed < idle:
            now += idle - elapsed
            continue
        if (linux and elapsed >= user_timeout and unanswered > 0) or (
            not linux and unanswered >= count
        ):
            return now
        if now < cut:
            received, unanswered = now, 0
        else:
            unanswered += 1
        now += interval


@given(
    idle=st.integers(min_value=1, max_value=10),
    interval=st.integers(min_value=1, max_value=10),
    count=st.integers(min_value=1, max_value=10),
    user_timeout=st.integers(min_value=1, max_value=40_000),
    cut=st.integers(min_value=0, max_value=60_000),
    packets=st.lists(st.integers(min_value=0, max_value=60_000), max_size=6),
)
def test_earliest_lock_release_is_a_lower_bound_of_the_kernels_timer(
    idle: int, interval: int, count: int, user_timeout: int, cut: int, packets: list[int]
) -> None:
    bound = earliest_lock_release(idle, interval, count, user_timeout) * 1000
    # Data the server sends after the cut dies user_timeout after it was sent.
    assert bound <= user_timeout + 1e-6  # float seconds, integer milliseconds
    for linux in (True, False):
        dropped = _keepalive_drop(
            idle * 1000, interval * 1000, count, user_timeout, cut, packets, linux=linux
        )
        assert dropped - cut >= bound - 1e-6, (linux, dropped - cut, bound)


@pytest.mark.parametrize(
    ("tcp", "cut", "dropped_after"),
    [
        # Defaults: the cut comes just as a probe goes out, the server's last packet from us
        # keepalive_idle old; dropped keepalive_interval x 4 later, when 10 s have passed.
        ((2, 2, 4, 10_000), 2_000, 8_000),
        # A probe interval longer than idle: the last packet can be interval old, so
        # tcp_user_timeout - keepalive_idle (9 s) would promise too much.
        ((1, 5, 3, 10_000), 6_000, 5_000),
    ],
)
def test_earliest_lock_release_is_reached(
    tcp: tuple[int, int, int, int], cut: int, dropped_after: int
) -> None:
    idle, interval, count, user_timeout = tcp
    dropped = _keepalive_drop(
        idle * 1000, interval * 1000, count, user_timeout, cut, [], linux=True
    )
    assert dropped - cut == dropped_after == earliest_lock_release(*tcp) * 1000


# -- lock keys ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "env",
    [
        {"SCHEDULER_LOCK__KEYS__PUBLISH": "0x10", "SCHEDULER_LOCK__KEYS__PLUGIN": "16"},
        {"SCHEDULER_LOCK__KEYS__PUBLISH": "myapp", "SCHEDULER_LOCK__KEYS__PLUGIN": "myapp"},
        {"SCHEDULER_LOCK__KEYS__PLUGIN": "0x9A37B7A1"},  # the default publish key
    ],
)
def test_equal_lock_keys_exit_78(tmp_path: Path, env: dict[str, str]) -> None:
    result = run_cli(["check-config"], env, cwd=tmp_path)
    assert result.returncode == 78, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "lock.keys: publish and plugin are the same key" in lines[0]


def test_equal_lock_keys_written_differently_in_the_file_exit_78(tmp_path: Path) -> None:
    config = write(tmp_path, '[lock.keys]\npublish = 16\nplugin = "0x10"\n')
    result = run_cli(["check-config", "--config", str(config)], cwd=tmp_path)
    assert result.returncode == 78, result.stdout + result.stderr
    assert result.stderr.strip() == (
        "scheduler-daemon: invalid config: lock.keys: publish and plugin are the same key (16): the loops "
        "would share one lock and only one of them could ever lead; give each its own"
    )
    config.write_text('[lock.keys]\npublish = 16\nplugin = "0x11"\n')
    assert run_cli(["check-config", "--config", str(config)], cwd=tmp_path).returncode == 0


# -- issue 11.3: configuration typos never pass silently ------------------------------------


@pytest.mark.parametrize(
    ("variable", "suggested"),
    [
        ("SCHEDULER_DATABASE_ULR", "SCHEDULER_DATABASE_URL"),
        ("SCHEDULER_PUBLISH_INTERVAL", "SCHEDULER_PUBLISH__INTERVAL"),  # one underscore
        ("SCHEDULER_PUBLISH__INTREVAL", "SCHEDULER_PUBLISH__INTERVAL"),
        ("SCHEDULER_PUBLISH__WEBHOOK__URLL", "SCHEDULER_PUBLISH__WEBHOOK__URL"),
        ("scheduler_lock__moed", "SCHEDULER_LOCK__MODE"),  # read case-insensitively
        ("SCHEDULER_CONFIG_FILE", "SCHEDULER_CONFIG"),
    ],
)
def test_an_unknown_variable_is_refused_with_the_closest_name(
    monkeypatch: pytest.MonkeyPatch, variable: str, suggested: str
) -> None:
    """`SCHEDULER_DATABASE_ULR=postgresql://…` used to pass, leaving the replica alone on
    SQLite."""
    monkeypatch.setenv(variable, "postgresql://app@db/app")
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert str(info.value) == (
        f"invalid config: {variable}: unknown variable, not a setting; did you mean "
        f"{suggested}? (every setting is listed in config.example.toml)"
    )


def test_an_unknown_variable_far_from_any_setting_gets_no_suggestion(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SCHEDULER_XYZZY", "1")
    with pytest.raises(ConfigError, match=r"^invalid config: SCHEDULER_XYZZY: unknown variable"):
        load_settings()


@pytest.mark.parametrize(
    "variable",
    [
        "SCHEDULER_CONFIG",
        "SCHEDULER_TEST_DATABASE_URL",  # the test rig's server
        "SCHEDULER_TEST_SYSTEMD_DOCKER_FLAGS",
        "SCHEDULER_BENCH_DATABASE_URL",  # bench/publish.py
        "SCHEDULER_SAMPLE_PLUGIN",  # the test suite's sample plugin
    ],
)
def test_variables_that_are_not_settings_but_are_used_are_allowed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    value = str(write(tmp_path, "")) if variable == "SCHEDULER_CONFIG" else "x"
    monkeypatch.setenv(variable, value)
    load_settings()


def test_every_variable_the_docs_and_deploy_files_name_is_accepted() -> None:
    """What users are told to set must not be refused as a typo."""
    files = [ROOT / name for name in ("README.md", "config.example.toml", "docker-compose.yml")]
    files += [ROOT / "Dockerfile", ROOT / "Makefile"]
    files += [
        *(ROOT / "docs").rglob("*.md"),
        *(p for p in (ROOT / "deploy").rglob("*") if p.is_file()),
    ]
    names = set()
    for path in files:
        for line in path.read_text(errors="replace").splitlines():
            if "did you mean" not in line:  # the docs' own example of a refused typo
                names |= set(re.findall(r"\bSCHEDULER_[A-Z0-9_]*[A-Z0-9]\b", line))
    assert "SCHEDULER_DATABASE_URL" in names
    known = setting_variables()
    for name in sorted(names):
        assert name in known or name in OTHER_ENV or name.startswith(OTHER_ENV_PREFIXES), name


def test_every_setting_has_a_variable() -> None:
    known = setting_variables()
    assert known["SCHEDULER_DATABASE_URL"][0] == "database_url"
    assert known["SCHEDULER_PUBLISH__WEBHOOK__MAX_ATTEMPTS"][0] == "publish.webhook.max_attempts"
    assert known["SCHEDULER_LOCK__KEYS__PUBLISH"][0] == "lock.keys.publish"
    assert known["SCHEDULER_DATABASE__COMMAND_BUDGET"][0] == "database.command_budget"
    # Each section is a variable too (pydantic-settings takes it as a JSON object).
    assert "SCHEDULER_PUBLISH__WEBHOOK" in known


@pytest.mark.parametrize(
    ("variable", "value", "takes"),
    [
        ("SCHEDULER_PUBLISH__PUBLISHERS", "notify", "publish.publishers takes a JSON list"),
        ("SCHEDULER_PLUGIN__DISABLED", "purge_publications", "plugin.disabled takes a JSON list"),
        ("SCHEDULER_PLUGIN__TASKS", "[{", "plugin.tasks takes a JSON list"),
        ("SCHEDULER_PUBLISH__WEBHOOK", "url=x", "publish.webhook takes a JSON object"),
    ],
)
def test_malformed_json_in_a_variable_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, takes: str
) -> None:
    """Was `error parsing value for field "publish" from source "EnvSettingsSource"`."""
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError) as info:
        load_settings()
    message = str(info.value)
    assert message.startswith(f"invalid config: {variable}: not valid JSON ("), message
    assert takes in message
    assert "EnvSettingsSource" not in message


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("ftp://hooks.example.com/x", "needs an http:// or https:// URL"),
        ("hooks.example.com/x", "needs an http:// or https:// URL"),
        ("https:///only-a-path", "needs a host, as in https://hooks.example.com/path"),
        ("https://hooks.example.com:99999/x", "not a URL with a valid port (0-65535)"),
    ],
)
def test_the_webhook_url_is_validated_without_echoing_it(
    monkeypatch: pytest.MonkeyPatch, url: str, problem: str
) -> None:
    monkeypatch.setenv("SCHEDULER_PUBLISH__WEBHOOK__URL", url + "/t0ken")
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert str(info.value) == f"invalid config: publish.webhook.url: {problem}"
    assert "t0ken" not in str(info.value)


@pytest.mark.parametrize(
    "url",
    ["https://hooks.example.com/T0/B0/t0ken", "http://127.0.0.1:8080/hook", "HTTPS://[::1]/x"],
)
def test_http_and_https_webhook_urls_are_accepted(
    monkeypatch: pytest.MonkeyPatch, url: str
) -> None:
    monkeypatch.setenv("SCHEDULER_PUBLISH__WEBHOOK__URL", url)
    assert load_settings().publish.webhook.url is not None


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("postgresql://app:hunter2@db:99999/app", "port 99999 is out of range (1-65535)"),
        ("postgresql://app:hunter2@db1:5432,db2:70000/app", "port 70000 is out of range"),
        ("postgresql://app:hunter2@[::1]:0/app", "port 0 is out of range"),
        ("postgresql://app:hunter2@db/app?port=123456", "port 123456 is out of range"),
        ("postgresql://app:hunter2@db/app?port=54x32", "a port is not a number"),
    ],
)
def test_a_database_port_out_of_range_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch, url: str, problem: str
) -> None:
    """Port 99999 was exit 69 ("database unavailable") after the driver refused it."""
    monkeypatch.setenv("SCHEDULER_DATABASE_URL", url)
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert str(info.value).startswith(f"invalid config: database_url: {problem}"), info.value
    assert "hunter2" not in str(info.value)


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://app@db1:5432,db2:5433/app?target_session_attrs=read-write",
        "postgresql://app@[::1]:5432/app",
        "postgresql://app@db/app",
        "postgresql:///app?host=/var/run/postgresql&port=5433",
    ],
)
def test_valid_database_ports_are_accepted(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    monkeypatch.setenv("SCHEDULER_DATABASE_URL", url)
    assert load_settings().database_url.backend == "postgres"


def test_postgres_ports() -> None:
    assert postgres_ports("postgresql://u:p@h1:1,[::1]:2,h3/db?port=3,4&x=5") == [
        "1",
        "2",
        "3",
        "4",
    ]
    assert postgres_ports("postgres://h/db") == []


@pytest.mark.parametrize(
    ("env", "value"),
    [
        ({"SCHEDULER_PUBLISH__INTERVAL": "banana"}, "'banana'"),
        ({"SCHEDULER_PUBLISH__WEBHOOK__TIMEOUT": "forever"}, "'forever'"),
        ({"SCHEDULER_PLUGIN__TASKS": '[{"name": "t", "every": "often", "sql": "x"}]'}, "'often'"),
    ],
)
def test_a_bad_value_is_quoted_once(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], value: str
) -> None:
    """Was `not a duration: 'banana' (use e.g. …) (got 'banana')`."""
    for key, text in env.items():
        monkeypatch.setenv(key, text)
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert str(info.value).count(value) == 1, info.value


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (
            {"SCHEDULER_DATABASE_ULR": "postgresql://app:hunter2@db/app"},
            "SCHEDULER_DATABASE_ULR: unknown variable, not a setting; did you mean "
            "SCHEDULER_DATABASE_URL?",
        ),
        (
            {"SCHEDULER_PUBLISH__PUBLISHERS": "notify"},
            "SCHEDULER_PUBLISH__PUBLISHERS: not valid JSON",
        ),
        (
            {"SCHEDULER_DATABASE_URL": "postgresql://app:hunter2@127.0.0.1:99999/app"},
            "database_url: port 99999 is out of range (1-65535)",
        ),
    ],
)
@pytest.mark.parametrize("command", [["check-config"], ["status"], ["run"]])
def test_typos_exit_78_in_one_line_from_every_command(
    tmp_path: Path, command: list[str], env: dict[str, str], expected: str
) -> None:
    result = run_cli(command, env, cwd=tmp_path)
    assert result.returncode == 78, result.stdout + result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"scheduler-daemon: invalid config: {expected}"), lines[0]
    assert "hunter2" not in result.stdout + result.stderr
    assert not (tmp_path / "scheduler.db").exists()
