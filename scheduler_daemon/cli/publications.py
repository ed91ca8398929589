"""The publication commands: ``schedule``, ``cancel``, and the ``publications`` group
(``list``, ``show``).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import click

from ..client.pool import MAX_PAYLOAD_DEPTH, ignored_changes
from ..db import Publication, PublicationFilter, ScheduleResult
from ..errors import InvalidInput, NotFound
from ..output import dumps, json_row, json_rows
from .common import (
    _client,
    _database_now,
    _run,
    _settings,
    _table,
    _text,
    _when,
    config_option,
    handles_errors,
    parse_when,
)

# Publication ids are bigints: a larger number can name nothing, and no driver sends it.
PUBLICATION_ID = click.IntRange(-(2**63), 2**63 - 1)


def _describe(publication: Publication) -> dict[str, Any]:
    row = json_row(publication)
    return {column: row[column] for column in ("id", "key", "status", "publish_at")}


@click.command()
@config_option
@click.option(
    "--at", "at", required=True, help="When: ISO 8601 with timezone, or +10m (-10m: --allow-past)."
)
@click.option("--payload", callback=_text, default="{}", show_default=True, help="JSON payload.")
@click.option(
    "--key",
    callback=_text,
    default=None,
    help="Idempotency key: scheduling it again changes nothing (the first request wins).",
)
@click.option(
    "--allow-past",
    is_flag=True,
    help="Accept an --at earlier than now (this machine's clock): it is published at once.",
)
@handles_errors
def schedule(
    config_file: Path | None, at: str, payload: str, key: str | None, allow_past: bool
) -> None:
    """Schedule a publication and print its id."""
    settings = _settings(config_file)
    now = datetime.now(UTC)
    when = parse_when(at, now)
    if when < now and not allow_past:
        raise InvalidInput(
            f"--at {at!r} is {_span(now - when)} in the past by this machine's clock; "
            "pass --allow-past to publish it at once"
        )
    try:
        data = json.loads(payload)
    except RecursionError:
        raise InvalidInput(
            f"--payload is nested deeper than {MAX_PAYLOAD_DEPTH} levels of arrays and objects"
        ) from None
    except ValueError as exc:  # not JSON, or an integer longer than Python reads (4300 digits)
        raise InvalidInput(f"--payload is not valid JSON: {exc}") from None

    async def main() -> None:
        publish_at = when
        async with _client(settings) as client:
            if at.strip()[:1] in ("+", "-"):
                # Counted from the database's clock, which decides due-ness: on a client
                # whose clock is minutes off, `+10s` must still mean ten seconds.
                publish_at = when + (await _database_now(client.store) - now)
            result = await client.schedule(publish_at, data, key=key)
        if not result.created:
            click.echo(_repeated_key_notice(result, publish_at, data), err=True)
        click.echo(result.publication.id)

    _run(main())


@click.command()
@config_option
@click.argument("publication_id", type=PUBLICATION_ID)
@handles_errors
def cancel(config_file: Path | None, publication_id: int) -> None:
    """Cancel a scheduled publication."""
    settings = _settings(config_file)

    async def main() -> None:
        async with _client(settings) as client:
            publication = await client.cancel(publication_id)
        click.echo(json.dumps(_describe(publication)))

    _run(main())


PUBLICATION_STATUSES = ("scheduled", "published", "cancelled", "failed")


def _span(delta: timedelta) -> str:
    """A duration for people: ``45s``, ``12m``, ``3h 5m``, ``2d 4h``."""
    seconds = int(abs(delta.total_seconds()))
    for unit, size, smaller, smaller_size in (
        ("d", 86400, "h", 3600),
        ("h", 3600, "m", 60),
        ("m", 60, "", 0),
    ):
        if seconds >= size:
            text = f"{seconds // size}{unit}"
            rest = (seconds % size) // smaller_size if smaller_size else 0
            return f"{text} {rest}{smaller}" if rest else text
    return f"{seconds}s"


def _repeated_key_notice(result: ScheduleResult, when: datetime, payload: Any) -> str:
    """What `schedule` says when its --key already named a publication: which one it is,
    and that the first request won (nothing was changed)."""
    existing = result.publication
    head = (
        f"key {existing.key!r} already scheduled as id {existing.id} "
        f"({existing.status}, at {existing.publish_at.astimezone(UTC).isoformat()})"
    )
    ignored = ignored_changes(result, when, payload)
    if not ignored:
        return f"{head}: same time and payload, nothing changed"
    asked = " and ".join({"publish_at": "--at", "payload": "--payload"}[name] for name in ignored)
    return (
        f"{head}: the first request wins, this {asked} {'were' if len(ignored) > 1 else 'was'} "
        "ignored "
        f"(to change it: cancel {existing.id}, then schedule under a new key)"
    )


@click.group()
def publications() -> None:
    """See publications: status, attempts, when due and published, by whom, last error."""


def _publication_lines(publication: Publication) -> list[tuple[str, str]]:
    shown = json_row(publication)
    now = datetime.now(UTC)
    publish_at = str(shown["publish_at"])
    if publication.status == "scheduled":
        delta = publication.publish_at - now
        publish_at += f"  (due in {_span(delta)})" if delta.total_seconds() > 0 else (
            f"  (due {_span(delta)} ago: is a publish leader running? "
            "see `scheduler-daemon status`)"
        )  # fmt: skip
    return [
        ("id", str(publication.id)),
        ("key", "-" if publication.key is None else publication.key),
        ("status", publication.status),
        ("publish_at", publish_at),
        ("published_at", shown["published_at"] or "-"),
        ("published_by", publication.published_by or "-"),
        ("attempts", str(publication.attempts)),
        ("last_error", publication.last_error or "-"),
        ("created_at", str(shown["created_at"])),
        ("payload", json.dumps(publication.payload, ensure_ascii=False)),
    ]


def _one_line(text: str | None, limit: int = 60) -> str:
    if not text:
        return "-"
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


@publications.command("list")
@config_option
@click.option(
    "--status",
    "statuses",
    multiple=True,
    type=click.Choice(PUBLICATION_STATUSES),
    help="Only publications in this status (repeat for several).",
)
@click.option("--due-after", help="publish_at at or after this: ISO 8601, or +10m / -1h.")
@click.option("--due-before", help="publish_at before this: ISO 8601, or +10m / -1h.")
@click.option(
    "--key",
    callback=_text,
    help="This key; with a trailing *, every key that starts with the rest.",
)
@click.option(
    "--limit",
    type=click.IntRange(1, 10_000),
    default=100,
    show_default=True,
    help="Show at most this many.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (every column).")
@handles_errors
def publications_list(
    config_file: Path | None,
    statuses: tuple[str, ...],
    due_after: str | None,
    due_before: str | None,
    key: str | None,
    limit: int,
    as_json: bool,
) -> None:
    """Publications in publish_at order, filtered; the first --limit of them."""
    settings = _settings(config_file)
    now = datetime.now(UTC)
    exact, prefix = (None, key[:-1]) if key and key.endswith("*") else (key, None)
    where = PublicationFilter(
        statuses=tuple(statuses) or None,  # type: ignore[arg-type]  # click.Choice checked it
        due_after=None if due_after is None else parse_when(due_after, now, "--due-after"),
        due_before=None if due_before is None else parse_when(due_before, now, "--due-before"),
        key=exact,
        key_prefix=prefix,
        limit=limit + 1,  # one more: tells whether the list was cut
    )

    async def main() -> list[Publication]:
        async with _client(settings) as client:
            return await client.find(where)

    found = _run(main())
    shown = found[:limit]
    if as_json:
        click.echo(dumps(json_rows(shown)))
    elif not shown:
        click.echo("no publications match")
    else:
        headers = ("ID", "STATUS", "PUBLISH AT", "PUBLISHED AT", "ATTEMPTS", "KEY", "LAST ERROR")
        rows = [
            (
                str(p.id), p.status, _when(p.publish_at), _when(p.published_at), str(p.attempts),
                p.key or "-", _one_line(p.last_error),
            )
            for p in shown
        ]  # fmt: skip
        for line in _table(headers, rows):
            click.echo(line)
    if len(found) > limit:
        click.echo(
            f"scheduler-daemon: showing the first {limit}; more match "
            "(raise --limit, or narrow with --status, --due-after/--due-before, --key)",
            err=True,
        )


@publications.command("show")
@config_option
@click.argument("publication_id", type=PUBLICATION_ID, required=False)
@click.option(
    "--key", callback=_text, help="The publication scheduled with this key, instead of an ID."
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@handles_errors
def publications_show(
    config_file: Path | None, publication_id: int | None, key: str | None, as_json: bool
) -> None:
    """One publication, every column: `show ID` or `show --key K`."""
    if (publication_id is None) == (key is None):
        raise click.UsageError("give a publication ID or --key K (one of them)")
    settings = _settings(config_file)

    async def main() -> Publication | None:
        async with _client(settings) as client:
            if publication_id is not None:
                return await client.get(publication_id)
            assert key is not None
            return await client.get_by_key(key)

    publication = _run(main())
    if publication is None:
        what = f"id {publication_id}" if key is None else f"key {key!r}"
        raise NotFound(f"no publication with {what}")
    if as_json:
        click.echo(dumps(json_row(publication)))
        return
    for line in _table(("", ""), _publication_lines(publication))[1:]:
        click.echo(line)
