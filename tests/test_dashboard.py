"""The browser dashboard, in a real browser (Debian's Chromium, driven by Playwright)
against real daemons and a real PostgreSQL; its paging and search over plain HTTP on both
backends.

Sync tests only: while the module's browser runs, this thread's event loop is
Playwright's (tests/rig/browser.py); `rig.sql.fetch` reads the database from a thread.
The cluster and runs pages' screenshots in docs/images/ are taken here.
"""

from __future__ import annotations

import base64
import html as htmllib
import json
import re
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Page, expect
from rig.processes import DaemonProcess, Daemons
from rig.sql import fetch
from rig.ticks import FAST_TIMINGS, PLUGIN_ONLY, first_leader
from rig.waiting import wait_until

from scheduler_daemon.dashboard.reads import successor

# PostgreSQL's tests are marked `postgres` by the rig (they use its fixtures); the paging
# tests run on SQLite too.
pytestmark = [pytest.mark.processes]

ROOT = Path(__file__).resolve().parent.parent
IMAGES = ROOT / "docs" / "images"
PASSWORD = "correct horse battery staple"
CREDENTIALS = {"username": "ops", "password": PASSWORD}
TASKS = [
    {"name": "steady", "every": "1s", "sql": "SELECT 1"},
    {"name": "broken", "every": "1s", "sql": "SELECT * FROM no_such_table_here"},
]


def replica_env(url: str, instance: str, **extra: str) -> dict[str, str]:
    return {
        "SCHEDULER_DATABASE_URL": url,
        "SCHEDULER_INSTANCE_ID": instance,
        **FAST_TIMINGS,
        "SCHEDULER_PLUGIN__TASKS": json.dumps(TASKS),
        # `broken` fails every run; paused after 5 in a row (the default), it would stop
        # running before the pause test counts its runs on a slow machine.
        "SCHEDULER_PLUGIN__MAX_CONSECUTIVE_FAILURES": "1000",
        "SCHEDULER_HTTP__ENABLED": "true",
        "SCHEDULER_HTTP__PORT": "0",
        "SCHEDULER_DASHBOARD__REFRESH": "0.5",
        "SCHEDULER_DASHBOARD__ACTIONS": "true",
        "SCHEDULER_DASHBOARD__USER": CREDENTIALS["username"],
        "SCHEDULER_DASHBOARD__PASSWORD": PASSWORD,
        **extra,
    }


def base_url(process: DaemonProcess) -> str:
    port = process.wait_for_log("http.started", timeout=20)["port"]
    return f"http://127.0.0.1:{port}"


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def post(url: str, form: dict[str, str], auth: tuple[str, str] | None = None,
         origin: str | None = None) -> int:  # fmt: skip
    data = "&".join(f"{k}={urllib.request.quote(v)}" for k, v in form.items()).encode()
    request = urllib.request.Request(url, data=data, method="POST")
    request.add_header("Content-Type", "application/x-www-form-urlencoded")
    if auth is not None:
        request.add_header("Authorization", basic(*auth))
    if origin is not None:
        request.add_header("Origin", origin)

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args: Any) -> None:
            return None

    opener = urllib.request.build_opener(NoRedirect)
    try:
        with opener.open(request, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)


def get(url: str, auth: tuple[str, str] | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url)
    if auth is not None:
        request.add_header("Authorization", basic(*auth))
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as error:
        return int(error.code), error.read().decode()


def test_the_page_follows_a_failover_shows_failures_and_pauses_a_schedule(
    pg_url: str, daemons: Daemons, new_page: Callable[..., Page]
) -> None:
    replicas = [
        daemons.start(replica_env(pg_url, f"dash-{n}"), PLUGIN_ONLY, name=f"dash-{n}")
        for n in range(2)
    ]
    leader = first_leader(replicas)
    other = next(r for r in replicas if r is not leader)
    page = new_page(timezone_id="Europe/Berlin")
    page.goto(base_url(other) + "/")
    plugin_leader = page.locator('dd.leader[data-loop="plugin"]')
    expect(plugin_leader).to_have_text(leader.name)
    # Times in the viewer's zone once the script ran, UTC on hover.
    since = page.locator("#loop-plugin ~ dl time").first
    expect(since).to_have_attribute("title", re.compile(r"UTC$"))
    expect(since).not_to_have_text(re.compile(r"UTC$"))
    page.screenshot(path=str(IMAGES / "dashboard-cluster.png"), full_page=True)

    killed = time.monotonic()
    leader.signal(signal.SIGKILL)
    expect(plugin_leader).to_have_text(other.name, timeout=2000)  # no reload
    shown_after = time.monotonic() - killed
    print(f"new leader shown {shown_after:.2f}s after SIGKILL")

    # A run that fails shows its error on the runs page, and in the timeline.
    page.goto(base_url(other) + "/runs?failed=1")
    expect(page.locator("table.runs")).to_contain_text("no_such_table_here")
    page.goto(base_url(other) + "/runs")
    expect(page.locator("svg.timeline rect.bar-failed").first).to_be_attached()
    page.screenshot(path=str(IMAGES / "dashboard-runs.png"), full_page=True)

    # Pausing from the page pauses it in the database, and the leader skips it.
    operator = new_page(http_credentials=CREDENTIALS)
    operator.goto(base_url(other) + "/login?next=/schedules/steady")
    expect(operator.locator("button", has_text="Pause")).to_be_visible()
    operator.locator("button", has_text="Pause").click()
    expect(operator.locator("dd.state")).to_have_text("paused")
    [row] = fetch(pg_url, "SELECT paused FROM scheduler_plugin_tasks WHERE name = 'steady'")
    assert row["paused"] is True
    paused_at = fetch(pg_url, "SELECT now() AS now")[0]["now"]

    def runs_since(name: str) -> int:
        rows = fetch(pg_url, "SELECT count(*) AS n FROM scheduler_plugin_runs "
                     "WHERE name = $1 AND started_at > $2", name, paused_at)  # fmt: skip
        return int(rows[0]["n"])

    # The leader leads on: three slots of `broken`, every second like `steady`'s...
    wait_until(lambda: runs_since("broken") >= 3, 15, "three runs of the other task")
    assert runs_since("steady") == 0  # ...and skips only the paused one
    log = [e for e in other.log_events() if e.get("event") == "dashboard.action"]
    assert log[-1]["user"] == "ops"
    assert log[-1]["action"] == "schedule.pause"
    assert PASSWORD not in other.output()


def test_actions_need_credentials_and_the_pages_token(pg_url: str, daemons: Daemons) -> None:
    """Refused without credentials, with a wrong or missing CSRF token, or from another
    site's page; nothing changes. With both: pause, cancel and retry do what they say."""
    process = daemons.start(replica_env(pg_url, "dash-act"), PLUGIN_ONLY, name="dash-act")
    url = base_url(process)
    auth = (CREDENTIALS["username"], PASSWORD)
    wait_until(
        lambda: bool(fetch(pg_url, "SELECT 1 FROM scheduler_plugin_tasks WHERE name = 'steady'")),
        20, "the leader declared its tasks",
    )  # fmt: skip
    [row] = fetch(pg_url, "INSERT INTO scheduler_publications (publish_at, payload) "
                  "VALUES (now() + interval '1 hour', '{}') RETURNING id")  # fmt: skip
    pid = row["id"]
    action = f"{url}/actions/schedules/steady/pause"

    assert post(action, {"csrf": "x"}) == 401  # no credentials
    assert post(action, {"csrf": "x"}, auth=("ops", "wrong password here")) == 401
    assert post(action, {}, auth=auth) == 403  # no token
    assert post(action, {"csrf": "123.abc"}, auth=auth) == 403  # a forged one
    # A token for another action does not do this one.
    status, html = get(f"{url}/publications/{pid}", auth=auth)
    assert status == 200
    cancel_token = re.search(r'name="csrf" value="([^"]+)"', html)
    assert cancel_token is not None
    assert post(action, {"csrf": cancel_token[1]}, auth=auth) == 403
    [row] = fetch(pg_url, "SELECT paused FROM scheduler_plugin_tasks WHERE name = 'steady'")
    assert row["paused"] is False
    # Without credentials a page offers no form, hence no token.
    assert 'name="csrf"' not in get(f"{url}/schedules/steady")[1]

    status, html = get(f"{url}/schedules/steady", auth=auth)
    token = re.search(r'action="/actions/schedules/steady/pause"[^>]*>\s*<input type="hidden" '
                      r'name="csrf" value="([^"]+)"', html)  # fmt: skip
    assert token is not None
    assert post(action, {"csrf": token[1]}, auth=auth, origin="https://evil.example") == 403
    assert post(action, {"csrf": token[1], "next": "https://evil.example/"}, auth=auth) == 303
    [row] = fetch(pg_url, "SELECT paused FROM scheduler_plugin_tasks WHERE name = 'steady'")
    assert row["paused"] is True

    assert post(f"{url}/actions/publications/{pid}/cancel", {"csrf": cancel_token[1]},
                auth=auth) == 303  # fmt: skip
    fetch(pg_url, "UPDATE scheduler_publications SET status = 'failed', published_at = now(), "
          "last_error = 'boom' WHERE id = $1", pid)  # fmt: skip
    status, html = get(f"{url}/publications/{pid}", auth=auth)
    retry = re.search(r'name="csrf" value="([^"]+)"', html)
    assert retry is not None
    assert post(f"{url}/actions/publications/{pid}/retry", {"csrf": retry[1]}, auth=auth) == 303
    statuses = fetch(pg_url, "SELECT status FROM scheduler_publications WHERE id = $1", pid)
    assert statuses[0]["status"] in ("scheduled", "published")
    refused = [e for e in process.log_events() if e.get("event") == "dashboard.action_refused"]
    assert len(refused) == 6
    assert PASSWORD not in process.output()


def test_ten_thousand_schedules_page_fast_and_search_by_name(
    pg_url: str, daemons: Daemons, new_page: Callable[..., Page]
) -> None:
    fetch(
        pg_url,
        "INSERT INTO scheduler_runnable_targets (target) VALUES ('sample.noop') "
        "ON CONFLICT DO NOTHING",
    )
    fetch(
        pg_url,
        "INSERT INTO scheduler_plugin_tasks (name, schedule, next_run_at, source, target, "
        "every_seconds) SELECT format('sched-%s', lpad(n::text, 5, '0')), 'every 1h', "
        "now() + interval '1 hour', 'runtime', 'sample.noop', 3600 "
        "FROM generate_series(1, 10000) n",
    )
    process = daemons.start(
        replica_env(pg_url, "dash-10k", SCHEDULER_PLUGIN__ENABLED="false"), name="dash-10k"
    )
    url = base_url(process)
    page = new_page()
    page.goto(url + "/schedules")  # warm: the first request imports templates
    began = time.monotonic()
    page.goto(url + "/schedules")
    rows = page.locator("table.schedules tbody tr")
    expect(rows).to_have_count(50)
    first_page = time.monotonic() - began
    print(f"schedules page with 10,000 schedules: {first_page * 1000:.0f} ms")
    assert first_page < 1.0
    # Counted from the statistics (once the inserting session's have arrived): an estimate.
    wait_until(lambda: "About 10,000 schedules in all" in get(url + "/schedules")[1], 10,
               "the estimate")  # fmt: skip
    # Pages follow the links, by name: next, last, previous, first.
    pager = page.locator("nav.pager")
    pager.get_by_role("link", name="Next →").click()
    expect(rows.first).to_contain_text("sched-00051")
    pager.get_by_role("link", name="Last »").click()
    expect(rows.last).to_contain_text("sched-10000")
    expect(pager.get_by_role("link", name="Next →")).to_have_count(0)
    pager.get_by_role("link", name="← Previous").click()
    expect(rows.first).to_contain_text("sched-09901")
    expect(rows.last).to_contain_text("sched-09950")
    pager.get_by_role("link", name="« First").click()
    expect(rows.first).to_contain_text("sched-00001")
    expect(pager.get_by_role("link", name="← Previous")).to_have_count(0)
    # A search finds the names that start with the text typed, case and all.
    page.fill("#q", "sched-0734")
    page.keyboard.press("Enter")
    expect(rows).to_have_count(10)
    expect(page.locator("p.count")).to_contain_text("Names starting with “sched-0734”")
    page.fill("#q", "SCHED-0734")
    page.keyboard.press("Enter")
    expect(rows).to_have_count(1)
    expect(rows.first).to_contain_text("No schedule starts with")
    page.fill("#q", "sched-07342")
    page.keyboard.press("Enter")
    expect(rows).to_have_count(1)
    page.locator("a", has_text="sched-07342").click()
    expect(page).to_have_url(re.compile(r"/schedules/sched-07342$"))


# -- paging and search, both backends (plain HTTP) -----------------------------------

FAR = "2999-01-01T00:00:00.000Z"  # a time no test reaches: nothing runs or publishes
# Byte order (code points of the UTF-8): "Alpha-x" and "Zulu" before every lowercase name,
# "émile" after them all; LIKE's wildcards among them, meant literally by a search.
NAMES = [f"alpha-{n:03d}" for n in range(120)] + [
    "alpha", "alphabet", "Alpha-x", "Zulu", "beta", "a_b", "a%b", "axb", "émile",
]  # fmt: skip


def insert_schedules(url: str, names: list[str]) -> None:
    fetch(url, "INSERT INTO scheduler_runnable_targets (target) VALUES ('sample.noop') "
          "ON CONFLICT DO NOTHING")  # fmt: skip
    values = ", ".join(
        f"(${n}, 'every 1h', '{FAR}', 'runtime', 'sample.noop', 3600)"
        for n in range(1, len(names) + 1)
    )
    fetch(url, "INSERT INTO scheduler_plugin_tasks (name, schedule, next_run_at, source, target, "
          f"every_seconds) VALUES {values}", *names)  # fmt: skip


def shown(html: str, what: str) -> list[str]:
    """The schedules' names (``what="schedules"``) or publications' ids a page lists."""
    pattern = rf'<td><a href="/{what}/[^"]*">#?([^<]*)</a></td>'
    return [htmllib.unescape(found) for found in re.findall(pattern, html)]


def link(html: str, rel: str) -> str | None:
    """The address of the pager's link ``rel`` (next, prev, first, last), if it has one."""
    found = re.search(rf'<a href="([^"]+)" rel="{rel}">', html)
    return htmllib.unescape(found[1]) if found else None


def walk(url: str, path: str, rel: str, what: str = "schedules") -> list[list[str]]:
    """Each page from ``path`` on, following the ``rel`` links to the end."""
    pages: list[list[str]] = []
    following: str | None = path
    while following is not None:
        assert len(pages) < 20, "the pages never end"
        status, html = get(url + following)
        assert status == 200, (following, re.findall(r'role="alert">([^<]*)', html))
        pages.append(shown(html, what))
        following = link(html, rel)
    return pages


def flat(pages: Iterable[list[str]]) -> list[str]:
    return [each for page in pages for each in page]


def dashboard(url: str, daemons: Daemons, name: str) -> str:
    process = daemons.start(replica_env(url, name, SCHEDULER_PLUGIN__ENABLED="false"), name=name)
    served = base_url(process)
    # The HTTP server answers before the replica has connected (503 until then).
    wait_until(lambda: get(served + "/schedules")[0] == 200, 20, "connected")
    return served


def test_schedules_page_by_name_both_ways(database_url: str, daemons: Daemons) -> None:
    """Forward from the first page and back from the last, every schedule is on exactly
    one page, in byte order; the first page offers no way back, the last no way on."""
    insert_schedules(database_url, NAMES)
    url = dashboard(database_url, daemons, "dash-pages")
    in_order = sorted(NAMES)  # Python compares code points: byte order of the UTF-8
    forward = walk(url, "/schedules", "next")
    assert [len(names) for names in forward] == [50, 50, 29]
    assert flat(forward) == in_order
    backward = walk(url, "/schedules?last=1", "prev")
    assert [len(names) for names in backward] == [50, 50, 29]
    assert flat(reversed(backward)) == in_order
    _, first = get(url + "/schedules")
    assert link(first, "prev") is None
    assert link(first, "first") is None
    assert link(first, "last") == "/schedules?last=1"
    _, last = get(url + "/schedules?last=1")
    assert link(last, "next") is None
    assert link(last, "last") is None
    assert link(last, "first") == "/schedules"
    # The page after a name that is gone, or that never was, starts at the next name.
    assert shown(get(url + "/schedules?after=alpha-0995")[1], "schedules")[0] == "alpha-100"
    # Past the end: nothing, and the way back to the first page.
    _, past = get(url + "/schedules?after=%F4%8F%BF%BF")
    assert shown(past, "schedules") == []
    assert link(past, "first") == "/schedules"
    # How many there are: counted exactly on SQLite, estimated from PostgreSQL's statistics.
    wait_until(
        lambda: re.search(r"(About )?129 schedules in all", get(url + "/schedules")[1]),
        10, "the count",
    )  # fmt: skip


def test_a_search_finds_names_by_prefix_case_sensitively(
    database_url: str, daemons: Daemons
) -> None:
    insert_schedules(database_url, NAMES)
    url = dashboard(database_url, daemons, "dash-search")
    alphas = [name for name in sorted(NAMES) if name.startswith("alpha")]
    found = walk(url, "/schedules?q=alpha", "next")
    assert [len(names) for names in found] == [50, 50, 22]
    assert flat(found) == alphas  # not "Alpha-x": case counts
    back = walk(url, "/schedules?q=alpha&last=1", "prev")
    assert flat(reversed(back)) == alphas
    # Each link keeps the search.
    _, html = get(url + "/schedules?q=alpha")
    assert link(html, "next") == "/schedules?after=alpha-048&q=alpha"

    def names_of(query: str) -> list[str]:
        status, html = get(url + "/schedules?q=" + query)
        assert status == 200, query
        return shown(html, "schedules")

    assert names_of("alpha-1") == [f"alpha-{n}" for n in range(100, 120)]
    assert names_of("ALPHA") == []
    assert names_of("Alpha") == ["Alpha-x"]
    assert names_of("a_") == ["a_b"]  # LIKE's wildcards are plain characters here
    assert names_of("a%25") == ["a%b"]
    assert names_of("%C3%A9") == ["émile"]
    assert names_of("%20%20alpha-11%20") == [f"alpha-{n}" for n in range(110, 120)]
    assert names_of("nothing") == []
    # No name holds a NUL or a lone surrogate: searching for one finds nothing, no error.
    assert names_of("a%00") == []
    assert names_of("a%ED%A0%80") == []


def test_a_prefix_is_one_range_of_names() -> None:
    """[prefix, successor(prefix)) holds exactly the strings that start with the prefix,
    in code point order: no surrogate is a character, and U+10FFFF has no successor."""
    assert successor("alpha") == "alphb"
    assert successor("a\ud7ff") == "a\ue000"
    assert successor("a\U0010ffff") == "b"
    assert successor("") is None
    assert successor("\U0010ffff\U0010ffff") is None
    names = ["a", "a\U0010ffff", "a\U0010ffffz", "b", "a\ud7ff", "a\ue000", "`", "ab"]
    for prefix in ("a", "a\U0010ffff", "a\ud7ff"):
        end = successor(prefix)
        in_range = [n for n in names if prefix <= n and (end is None or n < end)]
        assert in_range == [n for n in names if n.startswith(prefix)], prefix


def insert_publications(url: str, status: str, first: str, count: int) -> None:
    """``count`` publications in ``status``: the first half due at ``first`` together
    (the keyset is (publish_at, id), not publish_at alone), the rest a second apart."""
    at = [first if n < count // 2 else f"{first[:14]}{n // 60:02d}:{n % 60:02d}.000Z"
          for n in range(count)]  # fmt: skip
    done = "now()" if url.startswith("postgres") else f"'{FAR}'"
    published = done if status == "published" else "NULL"
    values = ", ".join(
        f"(${n + 1}, '{when}', '{status}', {published})" for n, when in enumerate(at)
    )
    keys = [f"{status}-{n}" for n in range(count)]
    fetch(url, "INSERT INTO scheduler_publications (key, publish_at, status, published_at) "
          f"VALUES {values}", *keys)  # fmt: skip


def test_publications_page_by_time_and_id(database_url: str, daemons: Daemons) -> None:
    insert_publications(database_url, "scheduled", "2998-01-01T00:00:00.000Z", 120)
    insert_publications(database_url, "published", "2020-01-01T00:00:00.000Z", 110)
    url = dashboard(database_url, daemons, "dash-publications")
    rows = fetch(database_url, "SELECT id, publish_at, status FROM scheduler_publications")
    soonest = sorted((r for r in rows if r["status"] == "scheduled"),
                     key=lambda r: (r["publish_at"], r["id"]))  # fmt: skip
    latest = sorted((r for r in rows if r["status"] != "scheduled"),
                    key=lambda r: (r["publish_at"], r["id"]), reverse=True)  # fmt: skip
    upcoming = walk(url, "/publications", "next", "publications")
    assert [len(ids) for ids in upcoming] == [50, 50, 20]
    assert flat(upcoming) == [str(r["id"]) for r in soonest]
    for path in ("/publications?view=recent", "/publications?view=recent&status=published"):
        done = walk(url, path, "next", "publications")
        assert [len(ids) for ids in done] == [50, 50, 10], path
        assert flat(done) == [str(r["id"]) for r in latest], path
    assert walk(url, "/publications?view=recent&status=failed", "next", "publications") == [[]]
    _, html = get(url + f"/publications?after={soonest[49]['id']}")
    assert link(html, "first") == "/publications?view=upcoming"


def test_a_port_others_reach_shows_no_payloads_or_errors_without_opting_in(
    pg_url: str, daemons: Daemons
) -> None:
    marker = "payload-marker-7f3a"
    [row] = fetch(pg_url, "INSERT INTO scheduler_publications (publish_at, payload, status, "
                  "published_at, last_error, attempts) VALUES (now(), $1::jsonb, 'failed', now(), "
                  "'error-marker-91c2', 1) RETURNING id", json.dumps({"secret": marker}))  # fmt: skip
    process = daemons.start(
        replica_env(pg_url, "dash-net", SCHEDULER_HTTP__HOST="0.0.0.0"), PLUGIN_ONLY,
        name="dash-net",
    )  # fmt: skip
    url = base_url(process)
    wait_until(
        lambda: bool(fetch(pg_url, "SELECT 1 FROM scheduler_plugin_runs WHERE status = 'failed'")),
        20, "a failed run",
    )  # fmt: skip
    [run] = fetch(pg_url, "SELECT id FROM scheduler_plugin_runs WHERE status = 'failed' LIMIT 1")
    pages = ["/", "/runs", "/runs?failed=1", f"/runs/{run['id']}", "/schedules",
             "/schedules/broken", "/publications?view=recent", f"/publications/{row['id']}"]  # fmt: skip
    for path in pages:
        status, html = get(url + path)
        assert status == 200, path
        for secret in (marker, "error-marker-91c2", "no_such_table_here", "postgresql://"):
            assert secret not in html, (path, secret)
        assert "Summary view" in html
