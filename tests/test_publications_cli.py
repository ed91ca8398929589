"""Publications as an operator sees them from the command line, on both backends:
`publications list|show`, scheduling in the past, a repeated --key, and one JSON shape
(booleans, ISO 8601 times) for `publications` and `tasks list`."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from rig.processes import run_cli
from rig.sql import fetch

# What every time in the CLI's JSON looks like, whichever backend it came from.
ISO_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{6})?\+00:00$")

PUBLICATION_COLUMNS = {
    "id", "key", "payload", "publish_at", "status", "published_at", "published_by",
    "attempts", "last_error", "created_at",
}  # fmt: skip


def cli(url: str, *args: str) -> Any:
    result = run_cli(list(args), {"SCHEDULER_DATABASE_URL": url})
    assert result.returncode == 0, result.stderr
    return result


def iso(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat(timespec="seconds")


@pytest.fixture
def arranged(database_url: str) -> dict[str, Any]:
    """Four publications: two scheduled (in 1 h and 2 h), one published, one failed;
    their ids by key, and ``now``, the instant their times are counted from."""
    now = datetime.now(UTC).replace(microsecond=0)
    ids: dict[str, Any] = {"now": now}
    for key, at in [
        ("post-1", now + timedelta(hours=1)),
        ("post-2", now + timedelta(hours=2)),
        ("page-1", now - timedelta(hours=2)),
        ("post-3", now - timedelta(hours=1)),
    ]:
        out = cli(database_url, "schedule", "--at", at.isoformat(), "--key", key,
                  "--payload", json.dumps({"key": key}), "--allow-past")  # fmt: skip
        ids[key] = int(out.stdout)
    fetch(
        database_url,
        "UPDATE scheduler_publications SET status = 'published', published_at = publish_at, "
        "published_by = 'replica-a', attempts = 1 WHERE id = $1",
        ids["page-1"],
    )
    fetch(
        database_url,
        "UPDATE scheduler_publications SET status = 'failed', attempts = 1, "
        "last_error = 'webhook: HTTP 500' WHERE id = $1",
        ids["post-3"],
    )
    return ids


def listed(url: str, *filters: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = json.loads(
        cli(url, "publications", "list", "--json", *filters).stdout
    )
    return rows


def test_list_filters_and_one_json_shape(database_url: str, arranged: dict[str, Any]) -> None:
    url = database_url
    everything = listed(url)
    # publish_at order, every column, times in ISO 8601 UTC on both backends.
    assert [row["key"] for row in everything] == ["page-1", "post-3", "post-1", "post-2"]
    for row in everything:
        assert set(row) == PUBLICATION_COLUMNS
        assert ISO_UTC.match(row["publish_at"]), row
        assert ISO_UTC.match(row["created_at"]), row
        assert row["payload"] == {"key": row["key"]}
        assert isinstance(row["attempts"], int)
    published = everything[0]
    assert ISO_UTC.match(published["published_at"])
    assert published["published_by"] == "replica-a"
    assert everything[1]["last_error"] == "webhook: HTTP 500"

    def keys(*filters: str) -> list[str]:
        return [row["key"] for row in listed(url, *filters)]

    assert keys("--status", "scheduled") == ["post-1", "post-2"]
    assert keys("--status", "failed", "--status", "published") == ["page-1", "post-3"]
    assert keys("--due-after", "-90m", "--due-before", "+90m") == ["post-3", "post-1"]
    in_an_hour = (arranged["now"] + timedelta(hours=1)).isoformat()
    assert keys("--due-after", in_an_hour) == ["post-1", "post-2"]  # inclusive...
    assert keys("--due-before", in_an_hour) == ["page-1", "post-3"]  # ...exclusive
    assert keys("--key", "post-*") == ["post-3", "post-1", "post-2"]
    assert keys("--key", "post-2") == ["post-2"]
    assert keys("--key", "Post-*") == [], "keys match case-sensitively on both backends"
    assert keys("--status", "cancelled") == []

    cut = run_cli(["publications", "list", "--limit", "2"], {"SCHEDULER_DATABASE_URL": url})
    assert cut.returncode == 0, cut.stderr
    lines = cut.stdout.splitlines()
    assert lines[0].split() == [
        "ID", "STATUS", "PUBLISH", "AT", "PUBLISHED", "AT", "ATTEMPTS", "KEY", "LAST", "ERROR"
    ]  # fmt: skip
    assert len(lines) == 3
    assert lines[2].split()[:2] == [str(arranged["post-3"]), "failed"]
    assert lines[2].endswith("post-3  webhook: HTTP 500")
    assert "showing the first 2; more match" in cut.stderr

    empty = cli(url, "publications", "list", "--status", "cancelled")
    assert empty.stdout == "no publications match\n"


def test_show_by_id_and_by_key(database_url: str, arranged: dict[str, Any]) -> None:
    url = database_url
    failed = arranged["post-3"]
    text = cli(url, "publications", "show", str(failed)).stdout
    fields = dict(line.split(None, 1) for line in text.splitlines())
    assert fields["id"] == str(failed)
    assert fields["key"] == "post-3"
    assert fields["status"] == "failed"
    assert fields["attempts"] == "1"
    assert fields["last_error"] == "webhook: HTTP 500"
    assert fields["published_by"] == "-"
    assert fields["payload"] == '{"key": "post-3"}'
    assert ISO_UTC.match(fields["publish_at"])

    scheduled = cli(url, "publications", "show", "--key", "post-1").stdout
    assert re.search(r"^publish_at +\S+  \(due in 59m\)$", scheduled, re.M), scheduled

    by_key = json.loads(cli(url, "publications", "show", "--key", "page-1", "--json").stdout)
    [from_list] = listed(url, "--key", "page-1")
    assert by_key == from_list
    assert by_key["status"] == "published"

    for args, message in [
        (["99999"], "no publication with id 99999"),
        (["--key", "nope"], "no publication with key 'nope'"),
    ]:
        result = run_cli(["publications", "show", *args], {"SCHEDULER_DATABASE_URL": url})
        assert result.returncode == 65
        assert result.stderr == f"scheduler-daemon: {message}\n"
    for args in ([], ["1", "--key", "post-1"]):
        result = run_cli(["publications", "show", *args], {"SCHEDULER_DATABASE_URL": url})
        assert result.returncode == 2  # a usage error, as click reports them
        assert "give a publication ID or --key K" in result.stderr


def test_scheduling_in_the_past_needs_allow_past(database_url: str) -> None:
    env = {"SCHEDULER_DATABASE_URL": database_url}
    for at in ("2020-01-01T09:00:00Z", "-10m"):
        refused = run_cli(["schedule", "--at", at, "--key", "late"], env)
        assert refused.returncode == 65
        [line] = refused.stderr.splitlines()
        assert line.startswith(f"scheduler-daemon: --at '{at}' is ")
        assert line.endswith(
            " in the past by this machine's clock; pass --allow-past to publish it at once"
        )
    assert listed(database_url) == [], "a refusal schedules nothing"
    accepted = cli(database_url, "schedule", "--at", "-10m", "--key", "late", "--allow-past")
    [row] = listed(database_url)
    assert row["id"] == int(accepted.stdout)
    assert datetime.fromisoformat(row["publish_at"]) < datetime.now(UTC) - timedelta(minutes=9)
    # Now and the future need no flag.
    cli(database_url, "schedule", "--at", "+0s")
    cli(database_url, "schedule", "--at", "+1m")


def test_a_repeated_key_says_the_first_request_wins(database_url: str) -> None:
    url = database_url
    at = (datetime.now(UTC) + timedelta(hours=3)).replace(microsecond=0)
    first = cli(url, "schedule", "--at", at.isoformat(), "--payload", '{"v": 1}', "--key", "k")
    publication = first.stdout.strip()
    head = f"key 'k' already scheduled as id {publication} (scheduled, at {at.isoformat()})"
    later = (at + timedelta(hours=1)).isoformat()
    for args, notice in [
        ([at.isoformat(), '{"v": 1}'], "same time and payload, nothing changed"),
        ([at.isoformat(), '{"v": 2}'], "the first request wins, this --payload was ignored"),
        ([later, '{"v": 1}'], "the first request wins, this --at was ignored"),
        ([later, '{"v": 2}'], "the first request wins, this --at and --payload were ignored"),
    ]:
        again = cli(url, "schedule", "--at", args[0], "--payload", args[1], "--key", "k")
        assert again.stdout == first.stdout, "it prints the first publication's id"
        [line] = again.stderr.splitlines()
        assert line.startswith(f"{head}: {notice}"), line
        if "ignored" in notice:
            assert line.endswith(
                f"(to change it: cancel {publication}, then schedule under a new key)"
            )
    [row] = listed(url, "--key", "k")
    assert (row["payload"], row["publish_at"]) == ({"v": 1}, at.isoformat())


def test_tasks_list_json_has_booleans_and_iso_times(database_url: str) -> None:
    fetch(
        database_url,
        "INSERT INTO scheduler_plugin_tasks (name, schedule, next_run_at, paused, last_started_at) "
        "VALUES ('nightly', 'cron 0 3 * * * UTC', '2026-12-01T03:00:00.951Z', $1, "
        "'2026-11-30T03:00:00Z')",
        True,
    )
    [task] = json.loads(cli(database_url, "tasks", "list", "--json").stdout)
    assert task["active"] is True
    assert task["paused"] is True
    assert task["next_run_at"] == "2026-12-01T03:00:00.951000+00:00"
    assert task["last_started_at"] == "2026-11-30T03:00:00+00:00"
    assert task["last_finished_at"] is None
    assert task["run_count"] == 0
    assert iso(datetime.fromisoformat(task["next_run_at"])) == "2026-12-01T03:00:00+00:00"
