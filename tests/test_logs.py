"""Logs: one JSON object per line, whichever library wrote it, and never a password.

The daemon's structlog events and every stdlib ``logging`` record (asyncpg's pool, aiohttp,
asyncio, warnings) go through the same processors: format, redaction, the traceback as
the ``exception`` field, the configured level. The acceptance test runs a real daemon on
the throwaway PostgreSQL through an outage, with a password in its URL.
"""

from __future__ import annotations

import io
import json
import logging
import signal
import time
import warnings
from collections.abc import Callable
from typing import Any, Literal

import pytest
from rig.databases import PgServer, replace_host_port, run_sync
from rig.pgcluster import PgCluster
from rig.processes import Daemons
from rig.tcpproxy import TcpProxy
from rig.ticks import create_tick_log, event_time, pg_env
from rig.waiting import wait_until

from scheduler_daemon.config.settings import LogSettings
from scheduler_daemon.logs import configure_logging, get_logger

PASSWORD = "Hunter2-outage"
SSL_PASSWORD = "Xyzzy-keyphrase"
DSN = f"postgresql://app:{PASSWORD}@db.example:5432/app?sslpassword={SSL_PASSWORD}"


def captured(fmt: Literal["json", "console"], level: str = "info") -> io.StringIO:
    stream = io.StringIO()
    settings = LogSettings.model_validate({"format": fmt, "level": level})
    configure_logging(settings, stream, instance="i1")
    return stream


def json_lines(text: str) -> list[dict[str, Any]]:
    lines = text.splitlines()
    assert lines, "nothing was logged"
    return [json.loads(line) for line in lines]


@pytest.mark.usefixtures("restore_logging")
def test_a_stdlib_record_is_json_redacted_with_its_traceback_as_a_field() -> None:
    stream = captured("json")
    try:
        raise ConnectionRefusedError(f"cannot connect to {DSN}")
    except ConnectionRefusedError:
        logging.getLogger("asyncpg.pool").exception("Failed to connect; retrying: %s", DSN)
        get_logger(instance="i1").exception("own.event")
    output = stream.getvalue()
    library, own = json_lines(output)
    assert PASSWORD not in output
    assert SSL_PASSWORD not in output
    assert library["logger"] == "asyncpg.pool"
    assert library["instance"] == "i1"  # as on the daemon's own lines
    assert library["level"] == "error"
    assert library["event"] == (
        "Failed to connect; retrying: postgresql://app:***@db.example:5432/app?sslpassword=***"
    )
    assert library["timestamp"].endswith("Z")
    # The same field as the daemon's own events carry their traceback in.
    for line in (library, own):
        assert line["exception"].startswith("Traceback (most recent call last):")
        assert line["exception"].endswith(
            "ConnectionRefusedError: cannot connect to "
            "postgresql://app:***@db.example:5432/app?sslpassword=***"
        )
    assert own["event"] == "own.event"
    assert own["instance"] == "i1"


@pytest.mark.usefixtures("restore_logging")
def test_stdlib_records_follow_the_configured_level() -> None:
    stream = captured("json", level="warning")
    logging.getLogger("asyncpg").info("chatty")
    get_logger().info("chatty.own")
    logging.getLogger("asyncpg").warning("kept")
    assert [line["event"] for line in json_lines(stream.getvalue())] == ["kept"]


@pytest.mark.usefixtures("restore_logging")
def test_console_format_redacts_stdlib_records_too() -> None:
    stream = captured("console")
    try:
        raise OSError(f"no route to {DSN}")
    except OSError:
        logging.getLogger("aiohttp.client").exception("request to %s failed", DSN)
    output = stream.getvalue()
    assert "request to postgresql://app:***@db.example" in output
    assert "[aiohttp.client]" in output
    assert "OSError: no route to postgresql://app:***@" in output  # the traceback
    assert PASSWORD not in output
    assert SSL_PASSWORD not in output


@pytest.mark.usefixtures("restore_logging")
def test_warnings_and_unformattable_records_are_json_lines_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(logging, "raiseExceptions", False)  # pytest's own handler would raise
    stream = captured("json")
    logging.getLogger("somelib").warning("%d connections to %s", "many", DSN)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn(f"deprecated: {DSN}", UserWarning, stacklevel=1)
    output = stream.getvalue()
    broken, warned = json_lines(output)
    assert broken["logger"] == "somelib"
    assert broken["event"].startswith("unformattable log record: TypeError: ")
    assert warned["logger"] == "py.warnings"
    assert "UserWarning: deprecated: postgresql://app:***@" in warned["event"]
    assert PASSWORD not in output


@pytest.mark.usefixtures("restore_logging")
def test_configuring_again_replaces_the_handler() -> None:
    first = captured("json")
    second = captured("json")
    logging.getLogger("asyncpg").warning("once")
    assert first.getvalue() == ""
    assert [line["event"] for line in json_lines(second.getvalue())] == ["once"]


@pytest.mark.usefixtures("restore_logging")
def test_other_libraries_stay_at_info_at_debug_level_unless_asked_for() -> None:
    stream = captured("json", level="debug")
    logging.getLogger("aiosqlite").debug("executing functools.partial(...)")
    logging.getLogger("aiosqlite").info("kept")
    get_logger().debug("own.debug")
    logging.getLogger("scheduler_daemon.child").debug("own.child")
    assert [line["event"] for line in json_lines(stream.getvalue())] == [
        "kept",
        "own.debug",
        "own.child",
    ]
    stream = io.StringIO()
    settings = LogSettings(format="json", level="debug", debug_libraries=True)
    configure_logging(settings, stream, instance="i1")
    logging.getLogger("aiosqlite").debug("executing functools.partial(...)")
    get_logger().debug("own.debug")
    assert [line["event"] for line in json_lines(stream.getvalue())] == [
        "executing functools.partial(...)",
        "own.debug",
    ]


@pytest.mark.processes
def test_a_debug_daemon_on_sqlite_shows_its_own_events_not_the_libraries(
    daemons: Daemons,
) -> None:
    """`make run` (SQLite, level debug): the ticks are what shows, not aiosqlite's line per
    statement of the 100 ms watch; `log.debug_libraries` brings those back."""
    env = {"SCHEDULER_LOG__LEVEL": "debug"}
    quiet = daemons.start(env, name="quiet")
    loud = daemons.start({**env, "SCHEDULER_LOG__DEBUG_LIBRARIES": "true"}, name="loud")
    for daemon in (quiet, loud):
        daemon.wait_for_log("daemon.started")
    # As long as the loud one takes to write a few libraries' debug lines, which the quiet
    # one, doing the same, would have written too.
    wait_until(
        lambda: sum("logger" in e and e.get("level") == "debug" for e in loud.log_events()) >= 5,
        30,
        "five debug lines of the libraries from the loud daemon",
    )
    counts: dict[str, tuple[int, int, int]] = {}
    for daemon in (quiet, loud):
        daemon.wait_for_log("tick.done", loop="publish")
        daemon.signal(signal.SIGTERM)
        assert daemon.wait(30) == 0, daemon.output()[-3000:]
        lines = (daemon.stdout_path.read_text() + daemon.stderr_path.read_text()).splitlines()
        events = [json.loads(line) for line in lines]
        own = [e for e in events if "logger" not in e]
        debug = [e for e in events if "logger" in e and e["level"] == "debug"]
        counts[daemon.name] = (len(lines), len(own), len(debug))
        assert any(e["event"] == "tick.done" for e in own), "the daemon's debug events show"
    assert counts["quiet"][2] == 0, "no library's debug line without the opt-in"
    assert counts["loud"][2] > 0, "log.debug_libraries brings the libraries' debug lines back"
    print(
        "\n(lines, the daemon's own, libraries' debug) over a few seconds at level debug: "
        f"default {counts['quiet']}, log.debug_libraries {counts['loud']}"
    )


# -- a real daemon through a database outage --------------------------------------------


@pytest.mark.postgres
@pytest.mark.processes
def test_every_line_through_a_database_outage_is_json_without_the_password(
    pg_cluster: PgCluster,
    pg_server: PgServer,
    pg_url: str,
    daemons: Daemons,
    tcp_proxy_factory: Callable[[str, int], TcpProxy],
) -> None:
    """A network partition (a proxy that stops forwarding: timeouts), then PostgreSQL
    stopped (refused connections), the daemon leading again after each."""
    run_sync(create_tick_log(pg_url))
    proxy = tcp_proxy_factory(pg_server.host, pg_server.port)
    # The throwaway cluster trusts local connections: any password gets in, and both must
    # be scrubbed from whatever asyncpg and the daemon say about the URL.
    assert pg_url.startswith("postgresql://postgres@")
    assert "?" not in pg_url
    url = replace_host_port(pg_url, "127.0.0.1", proxy.port)
    url = url.replace("postgres@", f"postgres:{PASSWORD}@", 1)
    url += f"?sslmode=disable&sslpassword={SSL_PASSWORD}"
    env = {**pg_env(url, "logs1"), "SCHEDULER_LOG__LEVEL": "debug"}
    daemon = daemons.start({**env, "SCHEDULER_DATABASE__POOL_MIN_SIZE": "2"})
    for loop in ("publish", "plugin"):
        daemon.wait_for_log("leader.acquired", loop=loop)

    def leads_again_after(since: float) -> None:
        def led(loop: str) -> bool:
            return any(
                e.get("event") == "leader.acquired"
                and e.get("loop") == loop
                and event_time(e) > since
                for e in daemon.log_events()
            )

        deadline = time.monotonic() + 30
        while not (led("publish") and led("plugin")):
            assert daemon.poll() is None, daemon.output()[-3000:]
            assert time.monotonic() < deadline, daemon.output()[-3000:]
            time.sleep(0.1)

    def timed_out() -> bool:
        return any(
            str(e.get("error", "")).startswith("TimeoutError: ") for e in daemon.log_events()
        )

    started_at = time.time()
    proxy.freeze()
    # Frozen until the daemon has said so: it loses its locks, then a connect attempt
    # times out (connect_timeout, 2 s) rather than being refused. A fixed 5 s freeze was
    # too short on a loaded machine, where noticing the loss took longer than 3 s.
    wait_until(timed_out, 60, "a connect attempt that timed out through the partition", 0.1)
    proxy.thaw()
    leads_again_after(time.time())
    pg_cluster.stop()
    time.sleep(3)
    pg_cluster.start()
    leads_again_after(time.time())
    ended_at = time.time()
    daemon.signal(signal.SIGTERM)
    assert daemon.wait(30) == 0, daemon.output()[-3000:]

    output = daemon.stdout_path.read_text() + daemon.stderr_path.read_text()
    lines = output.splitlines()
    not_json = [line for line in lines if not _is_json_object(line)]
    assert not not_json, f"{len(not_json)} of {len(lines)} lines are not JSON: {not_json[:5]}"
    for secret in (PASSWORD, SSL_PASSWORD):
        assert secret not in output
    events = [json.loads(line) for line in lines]
    assert all(e["instance"] == "logs1" for e in events), "every line names the instance"
    library = [e for e in events if str(e.get("logger", "")).startswith("asyncpg")]
    assert library, "asyncpg logged nothing through the outage"
    for line in library:
        assert line["level"] in ("debug", "info", "warning", "error", "critical")
    assert any("exception" in line for line in library), "asyncpg's traceback is a field"
    errors = [str(e["error"]) for e in events if "error" in e]
    assert any(error.startswith("TimeoutError: ") for error in errors), "no partition seen"
    for error in errors:
        assert not error.rstrip().endswith(":"), f"an error that says nothing: {error!r}"
    during = [e for e in events if started_at <= event_time(e) <= ended_at]
    print(
        f"\npartition 5s + PostgreSQL stopped 6s: {len(lines)} lines ({len(during)} in the "
        f"outages), all JSON, no password; {len(library)} from asyncpg; "
        f"{len(errors)} with an error field, e.g. {sorted(set(errors))[:3]}"
    )


def _is_json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False
