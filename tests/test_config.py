"""Configuration: precedence, value parsing, and one-line errors naming the key."""

from __future__ import annotations

import io
import os
import tomllib
from pathlib import Path
from typing import Any, Literal

import pytest
import structlog
from hypothesis import given
from hypothesis import strategies as st
from pydantic import SecretStr

from scheduler_daemon.config import (
    LogSettings,
    Settings,
    _describe,
    load_settings,
    lock_key_from_name,
    parse_duration,
    parse_lock_key,
    redact_webhook_url,
)
from scheduler_daemon.db.url import DatabaseUrl, redact
from scheduler_daemon.errors import ConfigError
from scheduler_daemon.logs import configure_logging, get_logger

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("SCHEDULER_"):
            monkeypatch.delenv(name)


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


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("postgresql://u:secret@h/db", "postgresql://u:***@h/db"),
        ("postgres://u:s%40cret@h1:5432,h2:5433/db?x=1", "postgres://u:***@h1:5432,h2:5433/db?x=1"),
        ("connect to host=h password=secret user=u", "connect to host=h password=*** user=u"),
        ("password='se cret' x", "password=*** x"),
        ("postgresql://u@h/db", "postgresql://u@h/db"),
        ("nothing here", "nothing here"),
    ],
)
def test_redact(text: str, expected: str) -> None:
    assert redact(text) == expected


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


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("https://hooks.slack.com/services/T0/B0/tok", "https://hooks.slack.com/***"),
        ("http://u:p@[::1]:8080/x", "http://[::1]:8080/***"),
        ("not a url at all", "***"),
        ("https:///path-only", "***"),
    ],
)
def test_redact_webhook_url(url: str, shown: str) -> None:
    assert redact_webhook_url(url) == shown


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


@pytest.mark.parametrize("fmt", ["console", "json"])
def test_logged_tracebacks_are_scrubbed(fmt: Literal["console", "json"]) -> None:
    stream = io.StringIO()
    try:
        configure_logging(LogSettings(format=fmt), stream=stream)
        try:
            raise RuntimeError("cannot reach postgresql://u:pw@h/db")
        except RuntimeError:
            dsn = "postgresql://u:pw@h/db"
            get_logger(instance="t").exception("boom", nested={"to": [dsn]}, error=OSError(dsn))
    finally:
        structlog.reset_defaults()
    output = stream.getvalue()
    assert "boom" in output
    assert "RuntimeError" in output, "the traceback is still logged"
    assert "pw@" not in output
    assert "u:***@h/db" in output
