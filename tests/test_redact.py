"""Redaction (scheduler_daemon/redact.py): every secret-bearing URL and DSN form libpq
accepts, webhook URLs, and everything that prints a URL or an error going through it."""

from __future__ import annotations

import asyncio
import json
from urllib.parse import quote

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from rig.processes import run_cli

from scheduler_daemon.config import load_settings
from scheduler_daemon.config.url import DatabaseUrl
from scheduler_daemon.errors import ConfigError, describe, explain_timeouts
from scheduler_daemon.redact import REDACTED, redact, redact_webhook_url

pytestmark = pytest.mark.usefixtures("clean_env")  # conftest.py


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # user:password@ -- raw "@", ":", "/", "#", "?" in the password hide nothing less
        ("postgresql://app:secret@db:5432/app", "postgresql://app:***@db:5432/app"),
        ("postgresql://app:p@ss@db/app", "postgresql://app:***@db/app"),
        ("postgresql://app:p@s@s@db/app", "postgresql://app:***@db/app"),
        ("postgresql://app:pa:ss@db/app", "postgresql://app:***@db/app"),
        ("postgresql://app:pa/ss@db/app", "postgresql://app:***@db/app"),
        ("postgresql://app:pa#ss@db/app", "postgresql://app:***@db/app"),
        ("postgresql://app:pa?ss@db/app", "postgresql://app:***@db/app"),
        ("postgresql://app:p%40s%3As%2Fs%23x%3F@db/app", "postgresql://app:***@db/app"),
        ("postgresql://:secret@db/app", "postgresql://:***@db/app"),
        ("postgresql://app@db/app", "postgresql://app@db/app"),
        ("postgresql://db:5432/app", "postgresql://db:5432/app"),
        # schemes
        ("postgres://app:secret@db/app", "postgres://app:***@db/app"),
        ("postgresql+asyncpg://app:secret@db/app", "postgresql+asyncpg://app:***@db/app"),
        # multi-host
        (
            "postgresql://u:p@h1:5432,h2:5433/db?target_session_attrs=read-write",
            "postgresql://u:***@h1:5432,h2:5433/db?target_session_attrs=read-write",
        ),
        ("postgres://u:s%40cret@h1,h2/db?x=1", "postgres://u:***@h1,h2/db?x=1"),
        # Unix-socket hosts: in the query, percent-encoded, or an empty host
        (
            "postgresql://u:pw@/db?host=/var/run/postgresql",
            "postgresql://u:***@/db?host=/var/run/postgresql",
        ),
        (
            "postgresql://u:pw@%2Fvar%2Frun%2Fpostgresql/db",
            "postgresql://u:***@%2Fvar%2Frun%2Fpostgresql/db",
        ),
        (
            "postgresql:///db?host=/var/run/postgresql&user=u&password=pw",
            "postgresql:///db?host=/var/run/postgresql&user=u&password=***",
        ),
        # password= and sslpassword= (and OAuth's client secret) in the query
        (
            "postgresql://u@db/app?password=pw&sslmode=require",
            "postgresql://u@db/app?password=***&sslmode=require",
        ),
        (
            "postgresql://u@db/app?sslmode=verify-full&sslpassword=keyphrase&sslkey=/k.pem",
            "postgresql://u@db/app?sslmode=verify-full&sslpassword=***&sslkey=/k.pem",
        ),
        (
            "postgresql://u:a@db/app?sslpassword=b#frag",
            "postgresql://u:***@db/app?sslpassword=***#frag",
        ),
        (
            "postgresql://u@db/app?oauth_client_id=c&oauth_client_secret=s",
            "postgresql://u@db/app?oauth_client_id=c&oauth_client_secret=***",
        ),
        # key=value DSNs
        (
            "host=db port=5432 password=secret user=app",
            "host=db port=5432 password=*** user=app",
        ),
        ("host=db password='a b' user=app", "host=db password=*** user=app"),
        (r"password='it\'s a \\ secret' dbname=app", "password=*** dbname=app"),
        ("password = secret dbname=app", "password = *** dbname=app"),
        ("host=db PASSWORD=secret", "host=db PASSWORD=***"),
        ("sslpassword=keyphrase sslkey=/k.pem", "sslpassword=*** sslkey=/k.pem"),
        ("password='unterminated and long", "password=***"),
        # SQLite: nothing to hide, whatever the path holds
        ("sqlite:///./scheduler.db", "sqlite:///./scheduler.db"),
        ("sqlite:////var/lib/x:y@z.db", "sqlite:////var/lib/x:y@z.db"),
        # URLs and parameters inside longer messages (asyncpg's, ours, a repr)
        (
            "ConnectionRefusedError: [Errno 111] Connect call failed ('127.0.0.1', 5432) "
            "connecting to postgresql://app:secret@db:5432/app",
            "ConnectionRefusedError: [Errno 111] Connect call failed ('127.0.0.1', 5432) "
            "connecting to postgresql://app:***@db:5432/app",
        ),
        (
            "invalid DSN 'postgresql://app:p@ss@db/app': bad port",
            "invalid DSN 'postgresql://app:***@db/app': bad port",
        ),
        (
            "_ConnectionParameters(user='app', password='secret', sslpassword='kp', ssl=None)",
            "_ConnectionParameters(user='app', password=***, sslpassword=***, ssl=None)",
        ),
        ("{'user': 'app', 'password': 'secret'}", "{'user': 'app', 'password': ***}"),
        ('{"password": "secret", "x": 1}', '{"password": ***, "x": 1}'),
        (
            "a postgresql://u:one@h1/db and postgres://u:two@h2/db",
            "a postgresql://u:***@h1/db and postgres://u:***@h2/db",
        ),
        # What must stay as it is
        (
            'password authentication failed for user "app"',
            'password authentication failed for user "app"',
        ),
        ("fencing_token=5 tokens=3", "fencing_token=5 tokens=3"),
        # Punctuation around an unquoted value stays (at most two marks it ends with)
        (
            "(could not open postgresql://u@h/db?sslpassword=kp)",
            "(could not open postgresql://u@h/db?sslpassword=***)",
        ),
        ("dsn 'host=h password=pw': invalid", "dsn 'host=h password=***': invalid"),
        ("password=secret, user=app", "password=***, user=app"),
        ("nothing here", "nothing here"),
        # Webhook URLs quoted in an error: user info and a ?token=
        (
            "POST https://user:pw@hooks.example.com/x?token=abc&v=1 failed",
            "POST https://user:***@hooks.example.com/x?token=***&v=1 failed",
        ),
    ],
)
def test_redact(text: str, expected: str) -> None:
    assert redact(text) == expected
    assert redact(expected) == expected  # a log line's values are often redacted twice


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("https://hooks.slack.com/services/T0/B0/tok", "https://hooks.slack.com/***"),
        ("https://user:pw@hooks.example.com:8443/x", "https://hooks.example.com:8443/***"),
        ("https://hooks.example.com/in?token=abc", "https://hooks.example.com/***"),
        ("https://user:p@ss@hooks.example.com/x", "https://hooks.example.com/***"),
        ("http://u:p@[::1]:8080/x", "http://[::1]:8080/***"),
        ("not a url at all", "***"),
        ("https:///path-only", "***"),
    ],
)
def test_redact_webhook_url(url: str, shown: str) -> None:
    assert redact_webhook_url(url) == shown


# -- properties: for any password, the redacted text never holds it -------------------

# Long enough to mean something: a 1-3 character password may occur anywhere by chance.
passwords = st.text(min_size=4, max_size=40)
# What can stand raw in a URL's user info: anything but whitespace (which would end it).
raw_passwords = st.text(
    st.characters(exclude_categories=("Z", "C")),  # separators (whitespace), control chars
    min_size=4,
    max_size=40,
)


def libpq_quoted(value: str) -> str:
    """``value`` as a key=value DSN writes it: quoted when it must be, escapes inside."""
    if value and not any(c.isspace() or c in "'\"\\" for c in value):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


@given(password=raw_passwords)
def test_a_raw_password_in_the_user_info_is_hidden(password: str) -> None:
    for template in (
        "postgresql://app:{}@db.example:5432/app?sslmode=require",
        "postgres://app:{}@h1:5432,h2:5433/app",
        "postgresql://app:{}@/app?host=/var/run/postgresql",
        "connect failed: postgresql://app:{}@db/app (attempt 3)",
    ):
        expected = template.format(REDACTED)
        assume(password not in expected)
        assert redact(template.format(password)) == expected


@given(password=passwords)
def test_an_encoded_password_is_hidden_wherever_the_url_puts_it(password: str) -> None:
    encoded = quote(password, safe="")
    for template in (
        "postgresql://app:{}@db.example:5432/app",
        "postgresql://app@db.example/app?sslmode=require&password={}&application_name=x",
        "postgresql://app@db.example/app?sslpassword={}&sslkey=/k.pem",
        "postgresql:///app?host=/var/run/postgresql&password={}",
    ):
        expected = template.format(REDACTED)
        assume(password not in expected and encoded not in expected)
        shown = redact(template.format(encoded))
        assert password not in shown
        assert encoded not in shown
        assert_shape(shown, expected)


@given(password=passwords, key=st.sampled_from(["password", "sslpassword"]))
def test_a_password_in_a_keyword_dsn_is_hidden(password: str, key: str) -> None:
    expected = f"host=db {key}={REDACTED} dbname=app"
    assume(password not in expected)
    shown = redact(f"host=db {key}={libpq_quoted(password)} dbname=app")
    assert password not in shown
    assert_shape(shown, expected)


def assert_shape(shown: str, expected: str) -> None:
    """``shown`` is ``expected`` but for up to two punctuation marks after the ``***``,
    which an unquoted value gives back (see redact.py)."""
    head, tail = expected.split(REDACTED)
    assert shown.startswith(head + REDACTED), shown
    assert shown.endswith(tail), shown
    given_back = shown[len(head) + len(REDACTED) : len(shown) - len(tail)]
    assert len(given_back) <= 2, shown
    assert all(mark in ")]}>'\",;.:" for mark in given_back), shown


@given(password=passwords, token=passwords)
def test_a_webhook_url_shows_its_host_only(password: str, token: str) -> None:
    url = (
        f"https://hook:{quote(password, safe='')}@hooks.example.com/services/"
        f"{quote(token, safe='')}?token={quote(token, safe='')}"
    )
    assert redact_webhook_url(url) == "https://hooks.example.com/***"


# -- everything that prints a URL or an error uses it -----------------------------------

URL = "postgresql://app:p%40ss@db:5432/app?sslmode=require&sslpassword=keyphrase"
SHOWN = "postgresql://app:***@db:5432/app?sslmode=require&sslpassword=***"
SECRETS = ("p%40ss", "p@ss", "keyphrase")


def test_database_url_prints_redacted() -> None:
    url = DatabaseUrl.parse(URL)
    assert str(url) == SHOWN
    assert repr(url) == f"DatabaseUrl({SHOWN!r})"
    assert url.secret() == URL


def test_settings_and_their_dump_are_redacted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SCHEDULER_DATABASE_URL", URL)
    settings = load_settings()
    assert settings.redacted()["database_url"] == SHOWN
    for text in (repr(settings), str(settings.redacted()), settings.model_dump_json()):
        for secret in SECRETS:
            assert secret not in text


def test_check_config_prints_the_url_redacted() -> None:
    result = run_cli(["check-config"], env={"SCHEDULER_DATABASE_URL": URL})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["database_url"] == SHOWN
    for secret in SECRETS:
        assert secret not in result.stdout + result.stderr


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("postgresql://app:p@ss@db/app", "a raw '@' in the user name or password"),
        ("postgresql://app:pa/ss@db/app", "a raw '/' or '#' in the password"),
        ("postgresql://app:12/ss@db/app", "a raw '/' or '#' in the password"),
        ("postgresql://app:pa#ss@db/app", "a raw '/' or '#' in the password"),
        ("postgresql://app:pa?ss@db/app", "a raw '/', '?' or '#' in the password"),
        ("postgresql://app:12?ss@db/app", "a raw '?' in the password"),
    ],
)
def test_a_password_the_driver_would_misread_is_refused_without_showing_it(
    monkeypatch: pytest.MonkeyPatch, url: str, why: str
) -> None:
    """asyncpg, like libpq, ends the user info at the first '@' and the authority at the
    first '/', '?', '#': it would connect with part of the password as the host, port or a
    query parameter, and quote that part in errors no redaction can recognise."""
    monkeypatch.setenv("SCHEDULER_DATABASE_URL", url)
    with pytest.raises(ConfigError) as info:
        load_settings()
    message = str(info.value)
    assert message.startswith(f"invalid config: database_url: {why} ("), message
    assert "percent-encode it (@ as %40, / as %2F, ? as %3F, # as %23)" in message
    assert "ss" not in message.replace("password", "")


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://u:p%40%2F%3F%23%3Ass@h1:5432,h2:5433/db?target_session_attrs=read-write",
        "postgresql://u:pw@/db?host=/var/run/postgresql",
        "postgresql://u@[::1]:5432/db?application_name=me@host",
        "postgres:///db?host=/var/run/postgresql&password=pw",
    ],
)
def test_well_formed_urls_are_accepted(url: str) -> None:
    assert DatabaseUrl.parse(url).secret() == url


def test_describe_redacts_and_never_says_nothing() -> None:
    assert describe(OSError(f"cannot reach {URL}")) == f"OSError: cannot reach {SHOWN}"
    assert describe(TimeoutError()) == "TimeoutError: timed out"
    assert describe(ConnectionResetError()) == "ConnectionResetError: Connection reset."
    assert describe(Exception()) == "Exception: (no message)"
    timeout = TimeoutError()
    timeout.__cause__ = OSError(f"no route to {URL}")
    assert describe(timeout) == f"TimeoutError: timed out (OSError: no route to {SHOWN})"


async def test_explain_timeouts_says_what_timed_out() -> None:
    explained = explain_timeouts("connecting (lock:publish): no answer within 0.01s")
    with pytest.raises(TimeoutError) as info, explained:
        await asyncio.wait_for(asyncio.sleep(1), 0.01)
    assert describe(info.value) == (
        "TimeoutError: connecting (lock:publish): no answer within 0.01s"
    )
    with pytest.raises(TimeoutError, match=r"^already says$"), explain_timeouts("not used"):
        raise TimeoutError("already says")
