"""The dashboard's credentials and CSRF tokens (no database, no browser), its settings, and
its pages on the SQLite default (a real daemon, plain HTTP)."""

from __future__ import annotations

import base64
import json
import urllib.request
from pathlib import Path

import pytest
from aiohttp.test_utils import make_mocked_request
from pydantic import ValidationError
from rig.processes import Daemons

from scheduler_daemon.config.settings import DashboardSettings
from scheduler_daemon.dashboard.auth import Credentials, read_password, same_origin
from scheduler_daemon.dashboard.views import loopback_only
from scheduler_daemon.errors import ConfigError

CREDS = Credentials("ops", "correct horse battery staple")
HOUR = 3600.0


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def test_only_the_configured_user_and_password_identify() -> None:
    def who(headers: dict[str, str]) -> str | None:
        return CREDS.identify(make_mocked_request("POST", "/", headers=headers))

    assert who(basic("ops", "correct horse battery staple")) == "ops"
    assert who(basic("ops", "wrong")) is None
    assert who(basic("admin", "correct horse battery staple")) is None
    assert who({}) is None
    assert who({"Authorization": "Bearer correct horse battery staple"}) is None
    assert who({"Authorization": "Basic !!!not-base64"}) is None


def test_a_csrf_token_is_for_one_user_one_action_and_twelve_hours() -> None:
    now = 1_800_000_000.0
    token = CREDS.csrf_token("ops", "/actions/schedules/a/pause", now)
    assert CREDS.csrf_valid(token, "ops", "/actions/schedules/a/pause", now + 11 * HOUR)
    assert not CREDS.csrf_valid(token, "ops", "/actions/schedules/a/pause", now + 14 * HOUR)
    assert not CREDS.csrf_valid(token, "ops", "/actions/schedules/a/resume", now)
    assert not CREDS.csrf_valid(token, "other", "/actions/schedules/a/pause", now)
    assert not CREDS.csrf_valid(token, "ops", "/actions/schedules/a/pause", now - 2 * HOUR)
    # Another replica, configured alike, accepts it; a different password does not.
    assert Credentials("ops", CREDS.password).csrf_valid(
        token, "ops", "/actions/schedules/a/pause", now
    )
    other = Credentials("ops", "another long password")
    assert not other.csrf_valid(token, "ops", "/actions/schedules/a/pause", now)
    for forged in ("", "x", "123", "123.", f"{int(now // HOUR)}.00ff"):
        assert not CREDS.csrf_valid(forged, "ops", "/actions/schedules/a/pause", now)


def test_a_post_from_another_site_is_told_apart_by_its_origin() -> None:
    def request(origin: str | None) -> bool:
        headers = {"Host": "sched.internal:9464"} | ({"Origin": origin} if origin else {})
        return same_origin(make_mocked_request("POST", "/", headers=headers))

    assert request(None)  # not a browser
    assert request("http://sched.internal:9464")
    assert request("https://sched.internal:9464")  # TLS ended by a proxy
    assert not request("https://evil.example")
    assert not request("null")


def test_actions_are_refused_at_start_without_a_usable_password(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="needs credentials"):
        DashboardSettings(actions=True)
    with pytest.raises(ValidationError, match="at least 12"):
        DashboardSettings(actions=True, password="short")
    with pytest.raises(ValidationError, match="not both"):
        DashboardSettings(actions=True, password="x" * 12, password_file=tmp_path / "p")
    missing = DashboardSettings(actions=True, password_file=tmp_path / "missing")
    with pytest.raises(ConfigError, match="cannot read"):
        read_password(missing)
    (tmp_path / "p").write_text("a long enough secret\n")
    assert read_password(DashboardSettings(actions=True, password_file=tmp_path / "p")) == (
        "a long enough secret"
    )


def test_loopback_is_told_from_addresses_others_reach() -> None:
    assert loopback_only("127.0.0.1")
    assert loopback_only("::1")
    assert loopback_only("localhost")
    assert not loopback_only("0.0.0.0")
    assert not loopback_only("")


def test_every_page_renders_on_the_sqlite_default(daemons: Daemons, tmp_path: Path) -> None:
    tasks = [{"name": "broken", "every": "1s", "sql": "SELECT * FROM no_such_table"}]
    process = daemons.start(
        {
            "SCHEDULER_DATABASE_URL": f"sqlite:///{tmp_path / 'dash.db'}",
            "SCHEDULER_HTTP__ENABLED": "true",
            "SCHEDULER_HTTP__PORT": "0",
            "SCHEDULER_PLUGIN__TASKS": json.dumps(tasks),
        }
    )
    port = process.wait_for_log("http.started", timeout=20)["port"]
    process.wait_for_log("task.failed", timeout=20)
    url = f"http://127.0.0.1:{port}"
    for path in ("/", "/schedules", "/schedules?q=bro", "/schedules/broken", "/runs",
                 "/runs?failed=1", "/runs/1", "/publications", "/publications?view=recent"):  # fmt: skip
        with urllib.request.urlopen(url + path, timeout=10) as response:
            assert response.status == 200, path
            html = response.read().decode()
        assert "Cannot read the cluster" not in html, path
    # Loopback: detail is shown (the error text), no opt-in needed.
    with urllib.request.urlopen(url + "/runs?failed=1", timeout=10) as response:
        assert "no such table" in response.read().decode()
