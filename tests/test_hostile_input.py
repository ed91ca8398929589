"""Bad and hostile input, from every side but the config file (tests/test_fuzz_config.py):
command lines, payloads, rows written with plain SQL, names with SQL and quotes in them, and
databases that answer slowly or not at all.

What each part shows:

- any argv of any command exits with a code the CLI documents (0, 2, 65; 1 and 78 where
  documented), one readable line for a refusal, never a traceback;
- a payload is stored and published verbatim, or refused (65, ``InvalidInput``) before
  anything reaches the database, on both backends alike: nested deeper than 100 levels,
  over ``publish.max_payload_bytes``, NUL (``\\u0000``), lone surrogates, bytes that are not
  UTF-8, integers Python cannot read (there is no HTTP API for scheduling; the API is
  ``Client`` and ``schedule_in``, which share ``validate_schedule``);
- a row written with plain SQL that breaks a rule the code relies on is refused by the
  database (migration 0005), naming the rule; one the database accepts but Python cannot
  read fails alone, and the rest publish;
- keys, task names and instance ids with quotes, backslashes, SQL and any Unicode are
  stored and shown verbatim (CLI, ``status --json``, logs), never executed;
- a database that never answers, answers slowly or refuses connections gets a readable
  line and the documented code within the documented timeouts.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rig.commands import Outcome, invoke, real
from rig.databases import replace_host_port, run_sync
from rig.ports import free_port
from rig.processes import DaemonProcess, Daemons, run_cli
from rig.sql import fetch, scalar
from rig.tcpproxy import TcpProxy
from rig.ticks import FAST_TIMINGS
from rig.waiting import wait_until

from scheduler_daemon.client import MAX_KEY_LENGTH, MAX_PAYLOAD_DEPTH, Client
from scheduler_daemon.config import load_settings
from scheduler_daemon.config.settings import Settings
from scheduler_daemon.db.sqlfiles import migrations
from scheduler_daemon.db.sqlite import from_db_time
from scheduler_daemon.errors import InvalidInput, describe

# Fixtures (a database, the environment, logging) are set up once around all examples on
# purpose: every example is one more command against the same database.
FUZZ = settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def assert_refused(outcome: Outcome, code: int, *phrases: str) -> None:
    """Exit `code`, and one plain readable line that says `phrases` (JSON log lines of
    retries may come before it)."""
    assert outcome.code == code, outcome
    assert "Traceback" not in outcome.stderr, outcome.stderr
    plain = [line for line in outcome.stderr.splitlines() if not line.startswith("{")]
    assert plain == [outcome.line], outcome.stderr
    assert outcome.line.startswith("scheduler-daemon: "), outcome.line
    assert outcome.line.isprintable(), outcome.line
    for phrase in phrases:
        assert phrase in outcome.line, (phrase, outcome.line)


@pytest.fixture
def quiet_env(monkeypatch: pytest.MonkeyPatch, restore_logging: None) -> None:
    """No SCHEDULER_* variable of the caller's reaches the in-process CLI."""
    import os

    for name in list(os.environ):
        if name.upper().startswith("SCHEDULER_"):
            monkeypatch.delenv(name)


def url_env(url: str, **extra: str) -> dict[str, str]:
    return {"SCHEDULER_DATABASE_URL": url, **extra}


# -- 1. command lines ----------------------------------------------------------------------

# Any text an argument can hold: no NUL (a C string), bytes that are not UTF-8 as the
# surrogates Python decodes them to.
ARG_TEXT = st.text(
    st.characters(exclude_categories=["Cs"], exclude_characters="\x00")
    | st.characters(min_codepoint=0xDC80, max_codepoint=0xDCFF),
    max_size=20,
)
MEANINGFUL_ARGS = [
    "+10m", "-1h", "+0s", "+1e400s", "+99999999999d", "2027-01-01T09:00:00Z",
    "2027-01-01T09:00:00", "9999-12-31T23:59:59-01:00", "0001-01-01T00:00:00+01:00", "now",
    "{}", '{"post": 1}', "[]", "null", "NaN", "1e400", "9" * 5000, "[" * 5000,
    '{"a": "\\u0000"}', '"\\ud800"', "0", "1", "2", "-1", "99999999999999999999", "10001",
    "scheduled", "published", "cancelled", "failed", "bogus", "*", "post-*", "\udcff",
    "'; DROP TABLE scheduler_publications; --", "--", "-", "--help", "-h",
]  # fmt: skip
ARG_VALUES = st.sampled_from(MEANINGFUL_ARGS) | ARG_TEXT | st.integers().map(str)
IDS = st.integers(-3, 30).map(str) | ARG_VALUES
NAMES = st.sampled_from(["purge_publications", "x"]) | ARG_VALUES
TIMES = st.one_of(*[st.sampled_from(["+10m", "+1h", "2027-01-01T09:00:00+02:00", "-1h"])] * 2,
                  ARG_VALUES)  # fmt: skip
PAYLOADS = st.one_of(
    st.sampled_from(["{}", '{"post": 1}']),
    st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                 lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner)).map(json.dumps),
    ARG_VALUES,
)  # fmt: skip


@dataclass(frozen=True)
class Spec:
    """A command's own parameters, so that most examples get past click to the command."""

    options: Mapping[str, st.SearchStrategy[str]]
    flags: tuple[str, ...] = ()
    argument: st.SearchStrategy[str] | None = None


COMMANDS: dict[tuple[str, ...], Spec] = {
    (): Spec({}, ("--help", "--version")),
    ("schedule",): Spec({"--at": TIMES, "--payload": PAYLOADS, "--key": ARG_VALUES},
                        ("--allow-past",)),
    ("cancel",): Spec({}, argument=IDS),
    ("status",): Spec({}, ("--json",)),
    ("migrate",): Spec({}),
    ("check-config",): Spec({}),
    ("preflight",): Spec({}),
    ("healthcheck",): Spec({"--timeout": ARG_VALUES}),
    ("publications", "list"): Spec(
        {"--status": st.sampled_from(["scheduled", "failed"]) | ARG_VALUES,
         "--due-after": TIMES, "--due-before": TIMES, "--key": ARG_VALUES,
         "--limit": IDS},
        ("--json",),
    ),
    ("publications", "show"): Spec({"--key": ARG_VALUES}, ("--json",), argument=IDS),
    ("tasks", "list"): Spec({}, ("--json",)),
    ("tasks", "pause"): Spec({}, argument=NAMES),
    ("tasks", "resume"): Spec({}, argument=NAMES),
    ("tasks", "trigger"): Spec({}, argument=NAMES),
}  # fmt: skip


@st.composite
def command_lines(draw: st.DrawFn) -> list[str]:
    """A command, some of its options with any values, its flags, its argument (mostly),
    and now and then a stray token."""
    command = draw(st.sampled_from(sorted(COMMANDS)))
    spec = COMMANDS[command]
    args = list(command)
    for option in draw(st.lists(st.sampled_from(sorted(spec.options)), unique=True)
                       if spec.options else st.just([])):  # fmt: skip
        args += [option, draw(spec.options[option])]
    args += draw(st.lists(st.sampled_from(spec.flags), unique=True) if spec.flags else st.just([]))
    if spec.argument is not None and draw(st.integers(0, 9)) > 0:
        args.append(draw(spec.argument))
    if draw(st.integers(0, 9)) == 0:
        stray = draw(ARG_VALUES | st.just("--bogus"))
        args.insert(draw(st.integers(len(command), len(args))), stray)
    return args


def assert_documented_answer(args: list[str], outcome: Outcome) -> None:
    allowed = {0, 2, 65}  # ok, usage, refused input
    if args[:1] == ["healthcheck"]:
        allowed.add(1)  # no /healthz answered
    assert outcome.code in allowed, (args, outcome)
    assert "Traceback" not in outcome.stderr, (args, outcome.stderr)
    if outcome.code == 65:
        assert_refused(outcome, 65)


def _fuzz_command_line(url: str, args: list[str]) -> None:
    assert_documented_answer(args, invoke(args, url_env(url)))


@FUZZ
@given(args=command_lines())
def test_any_command_line_gets_a_documented_code_sqlite(
    quiet_env: None, sqlite_url: str, args: list[str]
) -> None:
    _fuzz_command_line(sqlite_url, args)


@pytest.mark.postgres
@settings(FUZZ, max_examples=40)
@given(args=command_lines())
def test_any_command_line_gets_a_documented_code_postgres(
    quiet_env: None, pg_url: str, args: list[str]
) -> None:
    _fuzz_command_line(pg_url, args)


@pytest.mark.chaos_long
@settings(FUZZ, max_examples=3000)
@given(args=command_lines())
def test_any_command_line_gets_a_documented_code_long(
    quiet_env: None, database_url: str, args: list[str]
) -> None:
    _fuzz_command_line(database_url, args)


# Found by the fuzzing above, each an internal error (70) before: the argument reached the
# database driver, or datetime arithmetic, unchecked.
FOUND_ARGS = [
    (["schedule", "--at", "+1h", "--key", "\udcff"], 2, "'--key': is not UTF-8 text (the byte 0xff"),
    (["publications", "show", "--key", "k\udcfe"], 2, "is not UTF-8 text (the byte 0xfe"),
    (["publications", "list", "--key", "\udcff*"], 2, "is not UTF-8 text"),
    (["tasks", "pause", "\udcff"], 2, "'NAME': is not UTF-8 text"),
    (["cancel", "99999999999999999999"], 2, "is not in the range"),
    (["publications", "show", "99999999999999999999"], 2, "is not in the range"),
    (["schedule", "--at", "+99999999999d"], 65, "out of range (years 1 to 9999, in UTC)"),
    (["schedule", "--at", "9999-12-31T23:59:59-01:00"], 65, "out of range"),
    (["schedule", "--at", "-99999999999d", "--allow-past"], 65, "out of range"),
    (["publications", "list", "--due-after", "-99999999999d"], 65, "out of range"),
    (["schedule", "--at", "+1h", "--payload", "9" * 5000], 65, "Exceeds the limit (4300 digits)"),
    (["schedule", "--at", "+1h", "--payload", "[" * 10_000 + "]" * 10_000], 65,
     f"nested deeper than {MAX_PAYLOAD_DEPTH} levels"),
]  # fmt: skip


def _found_command_lines(database_url: str) -> None:
    for args, code, message in FOUND_ARGS:
        outcome = invoke(args, url_env(database_url))
        assert outcome.code == code, (args[:5], outcome)
        assert message in outcome.stderr, (args[:5], outcome.stderr)
        if code == 65:
            assert_refused(outcome, 65)
    assert count(database_url) == 0


def test_an_argument_cannot_hold_nul_but_the_cli_refuses_one_anyway(quiet_env: None) -> None:
    """Why argv is fuzzed without NUL: the OS passes C strings. From Python (click's
    runner, an embedding application) one can arrive: a usage error, like bad UTF-8."""
    with pytest.raises(ValueError, match="embedded null byte"):
        run_cli(["schedule", "--at", "+1h", "--key", "a\x00b"])
    outcome = invoke(["tasks", "pause", "a\x00b"], {})
    assert outcome.code == 2, outcome
    assert "Invalid value for 'NAME': contains a NUL character" in outcome.stderr


def test_invalid_utf8_arguments_from_a_real_process(sqlite_url: str) -> None:
    """The byte 0xff itself in argv, as a shell passes it (not a Python surrogate)."""
    outcome = real(["schedule", "--at", "+1h", "--key", "caf\udcff"], url_env(sqlite_url))
    assert outcome.code == 2, outcome
    assert "Invalid value for '--key': is not UTF-8 text (the byte 0xff at position 3)" in (
        outcome.stderr
    )
    assert scalar(sqlite_url, "SELECT count(*) FROM scheduler_publications") == 0


# -- 2. payloads -------------------------------------------------------------------------

TEN_MB = "x" * (10 * 1024 * 1024)


def nested(depth: int) -> Any:
    """`depth` arrays inside one another around a number: ``[[1]]`` is 2."""
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


REFUSED_PAYLOADS: list[tuple[str, str | None, Any, str]] = [
    # (name, as --payload, as a Python value, the refusal says)
    ("nested 10,000 deep", "[" * 10_000 + "1" + "]" * 10_000, nested(10_000),
     f"nested deeper than {MAX_PAYLOAD_DEPTH} levels"),
    ("nested 101 deep", json.dumps(nested(101)), nested(101),
     f"nested deeper than {MAX_PAYLOAD_DEPTH} levels"),
    ("10 MB", json.dumps(TEN_MB), TEN_MB, "over the limit of 1048576 (publish.max_payload_bytes)"),
    ("NUL in a value", '{"text": "a\\u0000b"}', {"text": "a\x00b"},
     "NUL character (\\u0000), which PostgreSQL text and jsonb cannot hold"),
    ("NUL in a key", '{"a\\u0000": 1}', {"a\x00": 1}, "NUL character"),
    ("lone surrogate", '{"text": "\\ud800"}', {"text": "\ud800"}, "lone surrogate (\\ud800)"),
    ("undecodable byte", None, {"text": "caf\udce9"}, "lone surrogate (\\udce9)"),
    ("integer of 5000 digits", "9" * 5000, 10**5000, "4300 digits"),
    ("NaN", "NaN", float("nan"), "Out of range float values are not JSON compliant"),
    ("a set", None, {1, 2}, "not JSON-serialisable"),
]  # fmt: skip


def _refused_payloads(database_url: str) -> None:
    """Refused alike by `schedule --payload` and by Client.schedule; nothing stored."""
    for name, text, _, message in REFUSED_PAYLOADS:
        if text is not None:
            outcome = invoke(["schedule", "--at", "+1h", "--payload", text], url_env(database_url))
            assert outcome.code == 65, (name, outcome)
            assert_refused(outcome, 65, message)

    async def schedule_each() -> list[str]:
        refusals = []
        async with Client.connect(load_settings_for(database_url)) as client:
            for name, _, value, _ in REFUSED_PAYLOADS:
                with pytest.raises(InvalidInput) as refused:
                    await client.schedule(datetime.now(UTC) + timedelta(hours=1), value, key=name)
                refusals.append(str(refused.value))
        return refusals

    for (name, *_, message), refusal in zip(
        REFUSED_PAYLOADS, run_sync(schedule_each()), strict=True
    ):
        assert message in refusal, (name, refusal)
    assert count(database_url) == 0


def load_settings_for(url: str, **extra: str) -> Settings:
    """Settings for `url`, as the daemon loads them (from the environment)."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in {"SCHEDULER_DATABASE_URL": url, **extra}.items():
            patch.setenv(name, value)
        return load_settings()


def count(url: str) -> int:
    return int(scalar(url, "SELECT count(*) FROM scheduler_publications"))


VERBATIM_PAYLOADS: list[tuple[str, Any]] = [
    ("nested 100 deep", nested(MAX_PAYLOAD_DEPTH)),
    ("101 brackets, the last empty", json.loads("[" * 101 + "]" * 101)),
    ("Unicode", {"text": "é 雪 😀 \u202e‮ rtl \u0301 \ufeff \u2028", "🔑": "ünïcödé"}),
    ("escapes that are not NUL", {"text": "\\u0000 is six characters", "ctl": "\x01\x1f\x7f"}),
    ("quotes and SQL", {"q": "'; DROP TABLE scheduler_publications; --", "d": '"\\'}),
    ("integer of 4300 digits", {"n": 10**4299}),
    ("every JSON type", {"a": [None, True, False, 0, -1, 1.5, "", {}, []]}),
]


def _verbatim_payloads(database_url: str) -> None:
    env = url_env(database_url)
    for name, value in VERBATIM_PAYLOADS:
        scheduled = invoke(["schedule", "--at", "+1h", "--payload", json.dumps(value)], env)
        assert scheduled.code == 0, (name, scheduled)
        shown = invoke(["publications", "show", scheduled.stdout.strip(), "--json"], env)
        assert shown.code == 0, (name, shown)
        assert json.loads(shown.stdout)["payload"] == value, name
    listed = invoke(["publications", "list", "--json"], env)
    assert [row["payload"] for row in json.loads(listed.stdout)] == [
        value for _, value in VERBATIM_PAYLOADS
    ]


def test_the_command_line_and_the_api_on_either_backend(quiet_env: None, database_url: str) -> None:
    """On one database per backend (a PostgreSQL database of a test's own costs about a
    second): the command lines found by fuzzing; refused payloads and keys, which change
    nothing; payloads and hostile keys stored and shown verbatim."""
    _found_command_lines(database_url)
    _refused_payloads(database_url)
    _refused_keys(database_url)
    _verbatim_payloads(database_url)
    _hostile_keys(database_url)


# -- 3. rows written with plain SQL ------------------------------------------------------

DUE = "2026-01-01T00:00:00Z"
# (name, PostgreSQL statement, SQLite statement, the rule named in the refusal); None: the
# backend has no such statement to refuse.
BROKEN_ROWS: list[tuple[str, str | None, str | None, str]] = [
    ("status not a status",
     f"INSERT INTO scheduler_publications (publish_at, status) VALUES ('{DUE}', 'done')",
     f"INSERT INTO scheduler_publications (publish_at, status) VALUES ('{DUE}', 'done')",
     "status"),
    ("negative attempts",
     f"INSERT INTO scheduler_publications (publish_at, attempts) VALUES ('{DUE}', -1)",
     f"INSERT INTO scheduler_publications (publish_at, attempts) VALUES ('{DUE}', -1)",
     "scheduler_publications_attempts_check"),
    ("attempts not a number", None,
     f"INSERT INTO scheduler_publications (publish_at, attempts) VALUES ('{DUE}', 'many')",
     "scheduler_publications_attempts_check"),
    ("attempts made negative", "UPDATE scheduler_publications SET attempts = -1",
     "UPDATE scheduler_publications SET attempts = -1", "scheduler_publications_attempts_check"),
    ("published_at on a scheduled row",
     f"INSERT INTO scheduler_publications (publish_at, published_at) VALUES ('{DUE}', now())",
     f"INSERT INTO scheduler_publications (publish_at, published_at) VALUES ('{DUE}', '{DUE}')",
     "scheduler_publications_published_at_check"),
    ("cancelled, keeping a published_at",
     f"UPDATE scheduler_publications SET status = 'cancelled', published_at = '{DUE}'",
     f"UPDATE scheduler_publications SET status = 'cancelled', published_at = '{DUE}'",
     "scheduler_publications_published_at_check"),
    ("publish_at infinity",
     "INSERT INTO scheduler_publications (publish_at) VALUES ('infinity')", None,
     "scheduler_publications_publish_at_check"),
    ("publish_at before the year 1",
     "INSERT INTO scheduler_publications (publish_at) VALUES ('0001-01-01 BC')",
     "INSERT INTO scheduler_publications (publish_at) VALUES ('0000-06-01')",
     "scheduler_publications_publish_at_check"),
    ("publish_at after the year 9999",
     "INSERT INTO scheduler_publications (publish_at) VALUES ('10000-01-01Z')",
     "INSERT INTO scheduler_publications (publish_at) VALUES (9999999)",
     "scheduler_publications_publish_at_check"),
    ("publish_at 'now' (SQLite's julianday takes it)", None,
     "INSERT INTO scheduler_publications (publish_at) VALUES ('now')",
     "scheduler_publications_publish_at_check"),
    ("publish_at a time without a date", None,
     "INSERT INTO scheduler_publications (publish_at) VALUES ('09:00')",
     "scheduler_publications_publish_at_check"),
    ("publish_at moved to 'now'", None, "UPDATE scheduler_publications SET publish_at = 'now'",
     "scheduler_publications_publish_at_check"),
    ("payload not JSON",
     f"INSERT INTO scheduler_publications (publish_at, payload) VALUES ('{DUE}', '{{x')",
     f"INSERT INTO scheduler_publications (publish_at, payload) VALUES ('{DUE}', '{{x')",
     "json"),
    ("payload nested 101 deep",
     f"INSERT INTO scheduler_publications (publish_at, payload) VALUES ('{DUE}', "
     f"'{'[' * 101}1{']' * 101}')", None, "scheduler_publications_payload_depth_check"),
    ("payload with NUL (jsonb cannot hold it)",
     f"INSERT INTO scheduler_publications (publish_at, payload) VALUES ('{DUE}', "
     "'{\"a\": \"\\u0000\"}')", None, "unsupported Unicode escape sequence"),
    ("task failures negative", "UPDATE scheduler_plugin_tasks SET consecutive_failures = -1",
     "UPDATE scheduler_plugin_tasks SET consecutive_failures = -1",
     "scheduler_plugin_tasks_counts_check"),
    ("task run count negative",
     "INSERT INTO scheduler_plugin_tasks (name, schedule, next_run_at, run_count) "
     f"VALUES ('x', 'every 1s', '{DUE}', -5)",
     "INSERT INTO scheduler_plugin_tasks (name, schedule, next_run_at, run_count) "
     f"VALUES ('x', 'every 1s', '{DUE}', -5)", "scheduler_plugin_tasks_counts_check"),
    ("task next_run_at infinity or 'now'",
     "UPDATE scheduler_plugin_tasks SET next_run_at = 'infinity'",
     "UPDATE scheduler_plugin_tasks SET next_run_at = 'now'",
     "scheduler_plugin_tasks_next_run_at_check"),
    ("outbox attempts negative", "UPDATE scheduler_webhook_outbox SET attempts = -1",
     "UPDATE scheduler_webhook_outbox SET attempts = -1",
     "scheduler_webhook_outbox_attempts_check"),
]  # fmt: skip


def _arrange(url: str) -> None:
    """One row in each table the broken statements touch."""
    fetch(url, f"INSERT INTO scheduler_publications (key, publish_at) VALUES ('p', '{DUE}')")
    fetch(url, "INSERT INTO scheduler_webhook_outbox (publication_id) "
               "SELECT id FROM scheduler_publications")  # fmt: skip
    fetch(url, "INSERT INTO scheduler_plugin_tasks (name, schedule, next_run_at) "
               f"VALUES ('t', 'every 1s', '{DUE}')")  # fmt: skip


def test_rows_that_break_the_rules_are_refused(database_url: str) -> None:
    backend = "sqlite" if database_url.startswith("sqlite") else "postgres"
    _arrange(database_url)
    before = fetch(database_url, "SELECT * FROM scheduler_publications")
    tried = 0
    for name, pg_sql, sqlite_sql, rule in BROKEN_ROWS:
        statement = pg_sql if backend == "postgres" else sqlite_sql
        if statement is None:
            continue
        tried += 1
        with pytest.raises((asyncpg.PostgresError, sqlite3.Error)) as refused:
            fetch(database_url, statement)
        assert rule in str(refused.value), (name, str(refused.value))
    assert tried >= 14
    assert fetch(database_url, "SELECT * FROM scheduler_publications") == before


# Times as people write them by hand on SQLite: julianday() reads them all, and so must
# the daemon (each was a ValueError for the publish loop, or a wrong instant, before).
HAND_WRITTEN_TIMES = [
    "2026-01-01 10:00:00 +02:00", "2026-01-01T10:00", "2026-01-01 10:00z",
    "2026-01-0110:00", "2026-01-01TT 10:00:00.5", "2026-01-01 24:00", "2026-02-31",
    "2026-01-01 10:00:00.1234567-03:30", "2461041.5", "2026-01-01 ",
]  # fmt: skip


def test_hand_written_sqlite_times_are_read_as_sqlite_reads_them(
    quiet_env: None, sqlite_url: str
) -> None:
    for n, text in enumerate(HAND_WRITTEN_TIMES):
        fetch(sqlite_url, "INSERT INTO scheduler_publications (key, publish_at) VALUES ($1, $2)",
              f"t{n}", text)  # fmt: skip
    expected = {
        row["key"]: row["jd"]
        for row in fetch(
            sqlite_url, "SELECT key, julianday(publish_at) AS jd FROM scheduler_publications"
        )
    }
    listed = invoke(["publications", "list", "--json"], url_env(sqlite_url))
    assert listed.code == 0, listed
    for row in json.loads(listed.stdout):
        shown = datetime.fromisoformat(row["publish_at"])
        assert abs(_julian(shown) - expected[row["key"]]) * 86400 < 0.002, (row, expected)
    assert len(json.loads(listed.stdout)) == len(HAND_WRITTEN_TIMES)


def _julian(moment: datetime) -> float:
    return (moment - datetime(1970, 1, 1, tzinfo=UTC)).total_seconds() / 86400 + 2440587.5


def _spelled(moment: datetime, separator: str, seconds: str, zone: str) -> str:
    """`moment` as one of the spellings SQLite reads (strftime's %Y is not zero-padded)."""
    day = f"{moment.year:04d}-{moment.month:02d}-{moment.day:02d}"
    clock = f"{moment.hour:02d}:{moment.minute:02d}"
    if seconds:
        clock += f":{moment.second:02d}" + (f".{moment.microsecond:06d}" if seconds == "." else "")
    return f"{day}{separator}{clock}{zone}"


SQLITE_TIMES = st.one_of(
    st.builds(
        _spelled,
        st.datetimes(min_value=datetime(1, 1, 2), max_value=datetime(9999, 12, 30)),
        st.sampled_from(["T", " ", "", "TT ", "\t"]),
        st.sampled_from(["", ":", "."]),
        st.sampled_from(["", "Z", "z", " +02:00", "-14:00", "+05:30 "]),
    ),
    st.floats(1721425.5, 5373484.0).map(str),
    st.text("0123456789-:. TZz+", max_size=30),
)


@pytest.fixture
def sqlite_schema(sqlite_url: str) -> Iterator[sqlite3.Connection]:
    conn = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"), isolation_level=None)
    yield conn
    conn.close()


@settings(FUZZ, max_examples=200)
@given(text=SQLITE_TIMES)
def test_every_time_the_sqlite_triggers_accept_reads_as_sqlite_reads_it(
    sqlite_schema: sqlite3.Connection, text: str
) -> None:
    """Whatever text migration 0005's trigger lets into publish_at, the daemon reads as
    the instant julianday() reads (to the millisecond: SQLite's own precision)."""
    conn = sqlite_schema
    conn.execute("SAVEPOINT t")
    try:
        conn.execute("INSERT INTO scheduler_publications (publish_at) VALUES (?)", (text,))
    except sqlite3.IntegrityError:
        return  # refused: nothing for the daemon to read
    finally:
        conn.execute("ROLLBACK TO t")
        conn.execute("RELEASE t")
    expected = conn.execute("SELECT julianday(?)", (text,)).fetchone()[0]
    moment = from_db_time(text)
    assert moment is not None
    assert abs(_julian(moment) - expected) * 86400 < 0.002, (text, moment, expected)


@pytest.mark.postgres
def test_postgres_migrates_over_an_old_row_that_breaks_a_rule_and_refuses_new_ones(
    pg_empty_url: str,
) -> None:
    """An older schema holding such a row: migration 0005 adds its rules NOT VALID, so it
    applies without scanning (and locking) the table for the old rows, and every write
    after it is judged. VALIDATE CONSTRAINT finds the old row until it is fixed."""

    async def arrange() -> None:
        conn = await asyncpg.connect(pg_empty_url)
        try:
            await conn.execute(
                "CREATE TABLE scheduler_schema_version (version integer PRIMARY KEY, "
                "name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
            )
            for migration in migrations("postgres")[:4]:
                await conn.execute(migration.sql)
                await conn.execute(
                    "INSERT INTO scheduler_schema_version (version, name) VALUES ($1, $2)",
                    migration.version, migration.name,
                )  # fmt: skip
            await conn.execute(
                "INSERT INTO scheduler_publications (publish_at, attempts) VALUES (now(), -3)"
            )
        finally:
            await conn.close()

    async def judged() -> None:
        conn = await asyncpg.connect(pg_empty_url)
        try:
            with pytest.raises(asyncpg.CheckViolationError, match="attempts_check"):
                await conn.execute(
                    "INSERT INTO scheduler_publications (publish_at, attempts) VALUES (now(), -1)"
                )
            with pytest.raises(asyncpg.CheckViolationError, match="attempts_check"):
                await conn.execute("UPDATE scheduler_publications SET attempts = attempts - 1")
            with pytest.raises(asyncpg.CheckViolationError, match="is violated by some row"):
                await conn.execute(
                    "ALTER TABLE scheduler_publications "
                    "VALIDATE CONSTRAINT scheduler_publications_attempts_check"
                )
            await conn.execute("UPDATE scheduler_publications SET attempts = 0")
            await conn.execute(
                "ALTER TABLE scheduler_publications "
                "VALIDATE CONSTRAINT scheduler_publications_attempts_check"
            )
        finally:
            await conn.close()

    run_sync(arrange())
    migrated = real(["migrate"], url_env(pg_empty_url))
    assert migrated.code == 0, migrated
    newest = migrations("postgres")[-1].version
    assert scalar(pg_empty_url, "SELECT max(version) FROM scheduler_schema_version") == newest
    assert scalar(pg_empty_url, "SELECT attempts FROM scheduler_publications") == -3
    run_sync(judged())


# -- 4 and 5. a daemon among hostile names and unreadable rows ---------------------------

HOSTILE = "it's \"quoted\" \\ '; DROP TABLE scheduler_publications; -- 雪 😀 %s $1 ?"
KEYS = [
    HOSTILE,
    "'; DROP TABLE scheduler_publications; --",
    '" OR 1=1 --',
    "back\\slash\\",
    "%s%s%n",
    "Robert'); DROP TABLE Students;--",
    "\u202eevil\u202c",
    "🔑" * MAX_KEY_LENGTH,
    "k" * MAX_KEY_LENGTH,
    " leading and trailing ",
    "line\nbreak",
    "*",
]
KEY_TEXT = st.text(
    st.characters(exclude_categories=["Cs"], exclude_characters="\x00"),
    min_size=1,
    max_size=MAX_KEY_LENGTH,
).filter(str.strip)


def _key_round_trip(url: str, key: str) -> None:
    env = url_env(url)
    scheduled = invoke(["schedule", "--at", "+1h", "--key", key], env)
    assert scheduled.code == 0, (key, scheduled)
    shown = invoke(["publications", "show", "--key", key, "--json"], env)
    assert shown.code == 0, (key, shown)
    assert json.loads(shown.stdout)["key"] == key
    listed = invoke(["publications", "list", "--key", key, "--limit", "10000", "--json"], env)
    assert key in [row["key"] for row in json.loads(listed.stdout)], (key, listed)
    again = invoke(["schedule", "--at", "+1h", "--key", key], env)
    assert again.code == 0, (key, again)
    assert again.stdout == scheduled.stdout, (key, again)
    assert repr(key) in again.stderr  # "key '…' already scheduled as id …", quoted


def _hostile_keys(database_url: str) -> None:
    before = count(database_url)
    for key in KEYS:
        _key_round_trip(database_url, key)
    assert count(database_url) == before + len(KEYS)  # and the table is still there


@settings(FUZZ, max_examples=30)
@given(key=KEY_TEXT)
def test_any_key_is_stored_and_shown_verbatim(quiet_env: None, sqlite_url: str, key: str) -> None:
    _key_round_trip(sqlite_url, key)


@pytest.mark.chaos_long
@settings(FUZZ, max_examples=1000)
@given(key=KEY_TEXT)
def test_any_key_is_stored_and_shown_verbatim_long(
    quiet_env: None, database_url: str, key: str
) -> None:
    _key_round_trip(database_url, key)


def _refused_keys(database_url: str) -> None:
    env = url_env(database_url)
    long = invoke(["schedule", "--at", "+1h", "--key", "k" * (MAX_KEY_LENGTH + 1)], env)
    assert_refused(long, 65, f"key is {MAX_KEY_LENGTH + 1} characters, over the limit")
    blank = invoke(["schedule", "--at", "+1h", "--key", " \t"], env)
    assert_refused(blank, 65, "key must not be empty")
    assert count(database_url) == 0


def test_hostile_publisher_and_task_names_are_named_never_run(quiet_env: None) -> None:
    """Configured names reach no SQL: an unknown publisher is refused, quoted with its
    escapes, and so is a task's broken target."""
    publisher = invoke(
        ["check-config"], {"SCHEDULER_PUBLISH__PUBLISHERS": json.dumps([HOSTILE + "\n"])}
    )
    assert_refused(publisher, 78, f"unknown publisher {HOSTILE + chr(10)!r}")
    task = [{"name": HOSTILE, "every": "1s", "target": f"{HOSTILE}:f"}]
    target = invoke(["check-config"], {"SCHEDULER_PLUGIN__TASKS": json.dumps(task)})
    assert_refused(target, 78, f"invalid task {HOSTILE!r}")


def _unreadable_rows(url: str) -> dict[str, str]:
    """Rows the database accepts that Python cannot read (by key: what is wrong)."""
    rows = {"huge-integer": f'{{"n": {"9" * 5000}}}'}
    if url.startswith("sqlite"):
        rows["deep"] = "[" * 1500 + "]" * 1500  # PostgreSQL refuses it (0005)
    for key, payload in rows.items():
        fetch(url, "INSERT INTO scheduler_publications (key, payload, publish_at) "
                   "VALUES ($1, $2, $3)", key, payload, datetime.now(UTC))  # fmt: skip
    return rows


# What the `sql` publisher was handed, row by row: the key and two payload fields.
AUDIT_DDL = "CREATE TABLE audit (id bigint, key text, payload_key text, blob text)"
AUDIT_INSERT = {
    "postgres": "INSERT INTO audit VALUES ($1, $2, $3, $4)",
    "sqlite": "INSERT INTO audit VALUES (?1, ?2, ?3, ?4)",
}


@pytest.fixture
def hostile_daemon(daemons: Daemons, database_url: str) -> DaemonProcess:
    """A daemon with a hostile instance id and task name, and rows it has to publish:
    hostile keys, a 10 MB payload (the limit raised), and rows it cannot read."""
    big = {"blob": TEN_MB}
    backend = "sqlite" if database_url.startswith("sqlite") else "postgres"
    fetch(database_url, AUDIT_DDL)
    settings = load_settings_for(database_url, SCHEDULER_PUBLISH__MAX_PAYLOAD_BYTES=str(16 * 2**20))

    async def schedule() -> None:
        async with Client.connect(settings) as client:
            now = datetime.now(UTC)
            for key in KEYS[:6]:
                await client.schedule(now, {"key": key}, key=key)
            await client.schedule(now, big, key="big")

    run_sync(schedule())
    _unreadable_rows(database_url)
    task = json.dumps([{"name": HOSTILE, "every": "0.2s", "sql": "SELECT 1"}])
    process = daemons.start(
        {
            **FAST_TIMINGS,
            "SCHEDULER_DATABASE_URL": database_url,
            "SCHEDULER_INSTANCE_ID": HOSTILE,
            "SCHEDULER_PUBLISH__INTERVAL": "0.2",
            "SCHEDULER_PLUGIN__INTERVAL": "0.2",
            "SCHEDULER_PLUGIN__TASKS": task,
            "SCHEDULER_PUBLISH__PUBLISHERS": '["sql"]',
            "SCHEDULER_PUBLISH__SQL__MODE": "row",
            "SCHEDULER_PUBLISH__SQL__STATEMENT": AUDIT_INSERT[backend],
            "SCHEDULER_PUBLISH__SQL__PARAMS": '["id", "key", "$.key", "$.blob"]',
        }
    )
    return process


def wait_for(url: str, sql: str, expected: Any, *params: Any, timeout: float = 30.0) -> None:
    wait_until(lambda: scalar(url, sql, *params) == expected, timeout, f"{sql} = {expected!r}", 0.1)


def test_a_daemon_among_hostile_names_and_unreadable_rows(
    quiet_env: None, database_url: str, hostile_daemon: DaemonProcess
) -> None:
    process = hostile_daemon
    unreadable = 1 if database_url.startswith("postgres") else 2
    wait_for(
        database_url, "SELECT count(*) FROM scheduler_publications WHERE status = 'published'", 7
    )
    wait_for(database_url, "SELECT count(*) FROM scheduler_publications WHERE status = 'failed'",
             unreadable)  # fmt: skip
    wait_for(database_url, "SELECT run_count > 0 FROM scheduler_plugin_tasks WHERE name = $1",
             True, HOSTILE)  # fmt: skip
    env = url_env(database_url)

    # Stored and shown verbatim: keys, payloads, the instance that published them.
    for key in KEYS[:6]:
        shown = json.loads(invoke(["publications", "show", "--key", key, "--json"], env).stdout)
        assert (shown["key"], shown["payload"], shown["status"]) == (key, {"key": key}, "published")
        assert shown["published_by"] == HOSTILE
    big = json.loads(invoke(["publications", "show", "--key", "big", "--json"], env).stdout)
    assert big["status"] == "published"
    assert big["payload"] == {"blob": TEN_MB}
    # Published verbatim: what the publisher was handed, in its own transaction.
    audit = {row["key"]: row for row in fetch(database_url, "SELECT * FROM audit")}
    assert sorted(audit) == sorted([*KEYS[:6], "big"])
    assert all(audit[key]["payload_key"] == key for key in KEYS[:6])
    assert audit["big"]["blob"] == TEN_MB

    # The rows Python cannot read failed alone, saying why; the rest published.
    for row in fetch(database_url, "SELECT key, last_error FROM scheduler_publications "
                                   "WHERE status = 'failed'"):  # fmt: skip
        assert row["last_error"].startswith("unreadable row: "), row
    events = process.log_events()
    assert {e["publication_id"] for e in events if e.get("event") == "publish.row_unreadable"}

    # The hostile instance id and task name, as the operator sees them.
    status = json.loads(invoke(["status", "--json"], env).stdout)
    assert {status["loops"][loop]["leader"]["instance"] for loop in ("publish", "plugin")} == {
        HOSTILE
    }
    tasks = json.loads(invoke(["tasks", "list", "--json"], env).stdout)
    assert HOSTILE in [task["name"] for task in tasks]
    paused = invoke(["tasks", "pause", HOSTILE], env)
    assert paused.code == 0, paused
    assert paused.stdout == f"{HOSTILE}: paused\n"
    assert {e["instance"] for e in events} == {HOSTILE}  # every log line, verbatim
    assert process.poll() is None, "the daemon stopped"


# -- 6. databases that answer slowly, or not at all ---------------------------------------

SHORT_BUDGETS = {
    "SCHEDULER_DATABASE__CONNECT_TIMEOUT": "0.5s",
    "SCHEDULER_DATABASE__COMMAND_BUDGET": "1s",
    "SCHEDULER_DATABASE__STARTUP_BUDGET": "1s",
}


@pytest.mark.postgres
def test_a_database_that_never_answers(
    pg_url: str, tcp_proxy_factory: Any, daemons: Daemons
) -> None:
    """Connections are accepted and hear nothing (a frozen proxy): each command gives up
    after its budget, and `run` after the startup budget, with 69 and one line. Bounds:
    the budget, plus a last attempt of up to twice connect_timeout, plus slack."""
    host, port = pg_url.split("@")[1].split("/")[0].rsplit(":", 1)
    proxy: TcpProxy = tcp_proxy_factory(host, int(port))
    proxy.freeze()
    url = replace_host_port(pg_url, "127.0.0.1", proxy.port)
    env = url_env(url, **SHORT_BUDGETS)
    commands = [["status"], ["schedule", "--at", "+1h"], ["publications", "list"]]
    started = time.monotonic()
    server = daemons.start(env)
    with ThreadPoolExecutor(len(commands)) as pool:
        results = list(pool.map(lambda args: (real(args, env), time.monotonic()), commands))
    for (outcome, ended), args in zip(results, commands, strict=True):
        assert_refused(outcome, 69, "unreachable for 1s (database.command_budget)",
                       "no answer in time (database.connect_timeout 0.5s)")  # fmt: skip
        assert ended - started < 1 + 2 * 0.5 + 8, (args, ended - started)
    assert server.wait(timeout=30) == 69
    assert time.monotonic() - started < 1 + 2 * 0.5 + 10
    assert "unreachable for 1s (database.startup_budget)" in server.output().splitlines()[-1]


@pytest.mark.postgres
def test_a_database_that_answers_too_slowly(pg_url: str) -> None:
    """A statement that waits longer than database.statement_timeout (another session
    holds a lock the command needs) is cancelled by the server: 75, nothing changed, and
    the same command succeeds once the lock is gone."""
    env = url_env(pg_url, SCHEDULER_DATABASE__STATEMENT_TIMEOUT="0.5s")

    async def while_locked() -> list[tuple[Outcome, float]]:
        conn = await asyncpg.connect(pg_url)
        try:
            async with conn.transaction():
                await conn.execute("LOCK TABLE scheduler_publications IN ACCESS EXCLUSIVE MODE")
                started = time.monotonic()
                outcomes = await asyncio.gather(
                    asyncio.to_thread(real, ["schedule", "--at", "+1h"], env),
                    asyncio.to_thread(real, ["publications", "list"], env),
                )
                return [(outcome, time.monotonic() - started) for outcome in outcomes]
        finally:
            await conn.close()

    for outcome, elapsed in run_sync(while_locked()):
        assert_refused(outcome, 75, "canceling statement due to statement timeout",
                       "nothing was changed, try again")  # fmt: skip
        assert elapsed < 0.5 + 8, elapsed
    assert count(pg_url) == 0
    assert real(["schedule", "--at", "+1h"], env).code == 0


@pytest.mark.postgres
def test_a_database_error_is_one_line(pg_url: str) -> None:
    """asyncpg puts PostgreSQL's DETAIL and HINT on lines of their own; every error the
    CLI prints, and every last_error stored, goes through describe(): it was several
    lines (a 3,000-character key: 5 lines and exit 70, before keys were limited)."""
    with pytest.raises(asyncpg.UntranslatableCharacterError) as refused:
        fetch(pg_url, 'SELECT \'{"a": "\\u0000"}\'::jsonb')
    assert "\n" in str(refused.value)
    assert describe(refused.value) == (
        "UntranslatableCharacterError: unsupported Unicode escape sequence "
        "DETAIL:  \\u0000 cannot be converted to text."
    )


@pytest.mark.parametrize(
    "args",
    [
        ["publications", "list"],
        ["publications", "show", "1"],
        ["migrate"],
        ["tasks", "resume", "x"],
    ],
    ids=" ".join,
)
def test_a_database_that_refuses_connections(quiet_env: None, args: list[str]) -> None:
    """Nothing listens (tests/test_bad_input.py covers `run`, tests/test_cli.py `schedule`,
    `cancel`, `tasks list` and `pause`): retried within the command budget, then 69 and
    one line."""
    url = f"postgresql://app:hunter2@127.0.0.1:{free_port()}/app"
    started = time.monotonic()
    outcome = invoke(args, url_env(url, SCHEDULER_DATABASE__COMMAND_BUDGET="0.3s"))
    assert_refused(outcome, 69, "unreachable for 0.3s (database.command_budget)", "app:***@")
    assert "hunter2" not in outcome.stderr
    assert time.monotonic() - started < 0.3 + 5
