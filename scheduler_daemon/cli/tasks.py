"""The ``tasks`` commands: list, show, add and remove runtime schedules; pause, resume and
trigger any task.
"""

from __future__ import annotations

import json
import shlex
import textwrap
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path

import click

from ..client.pool import MAX_PAYLOAD_DEPTH
from ..db import AddedSchedule, ScheduleRecord
from ..db.schedules import ScheduleStore
from ..errors import InvalidInput, NotFound
from ..output import dumps, json_row
from .common import (
    _client,
    _database_now,
    _run,
    _settings,
    _store,
    _table,
    _text,
    _when,
    config_option,
    handles_errors,
    parse_when,
)

# `tasks list` reads this many rows a transaction: memory and the first line's wait stay
# small however many tasks there are.
LIST_PAGE = 1000


@click.group()
def tasks() -> None:
    """List and operate plugin tasks."""


@tasks.command("list")
@config_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON (every column).")
@click.option("--limit", type=click.IntRange(min=1), help="At most this many tasks (default: all).")
@click.option("--after", callback=_text, help="Only tasks whose name sorts after this one.")
@handles_errors
def tasks_list(
    config_file: Path | None, as_json: bool, limit: int | None, after: str | None
) -> None:
    """Each task, in name order: schedule, next run, last run and status, run count; a
    runtime schedule's schedule also names its target. Printed as it is read, a page at a
    time, so a million tasks start printing at once; the text ends with how many there
    are (and, with --limit, the --after that gives the next page)."""
    settings = _settings(config_file)
    header = f"{'TASK':<28} {'STATE':<9} {'NEXT RUN':<26} {'LAST STATUS':<12} {'RUNS':>6}  SCHEDULE"

    async def main() -> None:
        async with _client(settings) as client:
            shown, last, more = 0, after, True
            click.echo("[" if as_json else header, nl=not as_json)
            while more and (limit is None or shown < limit):
                want = LIST_PAGE if limit is None else min(LIST_PAGE, limit - shown)
                # One row more than is printed: whether another page follows.
                page = await client.list_schedules(after=last, limit=want + 1)
                more = len(page) > want
                for row in page[:want]:
                    if as_json:
                        comma = "," if shown else ""
                        text = textwrap.indent(dumps(json_row(row)), "  ")
                        click.echo(f"{comma}\n{text}", nl=False)
                    else:
                        click.echo(_task_line(row))
                    shown += 1
                    last = row.name
            if as_json:
                click.echo("\n]" if shown else "]")
                return
            total = await client.count_schedules()
            if more and last is not None:
                click.echo(f"{shown:,} of {total:,} tasks; the next: --after {shlex.quote(last)}")
            else:
                click.echo(f"{shown:,} of {total:,} tasks" if after else f"{total:,} tasks")

    _run(main())


def _task_line(row: ScheduleRecord) -> str:
    state = "inactive" if not row.active else "paused" if row.paused else "active"
    return (
        f"{row.name:<28} {state:<9} {_when(row.next_run_at):<26} "
        f"{row.last_status or '-':<12} {row.run_count:>6}  {_schedule_text(row)}"
    )


def _schedule_text(row: ScheduleRecord) -> str:
    """A task's schedule as `tasks list` shows it; a runtime schedule's with its target
    (and described from its columns if SQL inserted it without a description)."""
    if not row.runtime:
        return row.schedule
    described = row.schedule
    if not described:
        described = (
            f"every {row.every_seconds:g}s"
            if row.every_seconds is not None
            else f"cron {row.cron} {row.timezone}"
        )
        if row.jitter_seconds:
            described += f" jitter {row.jitter_seconds:g}s"
    return f"{described} -> {row.target} (runtime)"


@tasks.command("add")
@config_option
@click.argument("name", callback=_text)
@click.option("--every", callback=_text, help="Interval: 30, 30s, 250ms, 5m, 1h, 1d.")
@click.option("--cron", callback=_text, help="Cron expression (five fields, or six: seconds).")
@click.option(
    "--timezone", callback=_text, default="UTC", show_default=True, help="IANA zone of --cron."
)
@click.option(
    "--target",
    callback=_text,
    required=True,
    help="package.module:function, declared runnable by the deployment (plugin.runnable).",
)
@click.option(
    "--args", "args_json", callback=_text, default="{}", show_default=True,
    help="JSON object: the target's ctx.args.",
)  # fmt: skip
@click.option(
    "--timeout", callback=_text, default="300s", show_default=True,
    help="How long one run may take.",
)  # fmt: skip
@click.option(
    "--misfire",
    type=click.Choice(["run_once", "skip"]),
    default="run_once",
    show_default=True,
    help="After missed periods: one catch-up run, or none.",
)
@click.option(
    "--jitter", callback=_text, default="0", show_default=True,
    help="Each slot up to this much later, by an offset fixed per name.",
)  # fmt: skip
@click.option(
    "--start",
    callback=_text,
    help="First slot: ISO 8601 with timezone, or +10m (default: the schedule's first, "
    "from now: an interval runs at once).",
)
@click.option(
    "--replace",
    is_flag=True,
    help="Change the runtime schedule of this name if there is one (next run kept unless "
    "the schedule or --start changes it).",
)
@handles_errors
def tasks_add(
    config_file: Path | None,
    name: str,
    every: str | None,
    cron: str | None,
    timezone: str,
    target: str,
    args_json: str,
    timeout: str,
    misfire: str,
    jitter: str,
    start: str | None,
    replace: bool,
) -> None:
    """Add a runtime schedule: --target runs with --args at every slot of --every or --cron.

    Durations as in config (30, 30s, 250ms, 5m, 1h, 1d)."""
    settings = _settings(config_file)
    now = datetime.now(UTC)
    when = None if start is None else parse_when(start, now, "--start")
    try:
        args = json.loads(args_json)
    except RecursionError:
        raise InvalidInput(
            f"--args is nested deeper than {MAX_PAYLOAD_DEPTH} levels of arrays and objects"
        ) from None
    except ValueError as exc:
        raise InvalidInput(f"--args is not valid JSON: {exc}") from None
    if not isinstance(args, dict):
        raise InvalidInput(f"--args must be a JSON object, not {type(args).__name__}")

    async def main() -> AddedSchedule:
        first = when
        async with _client(settings) as client:
            if first is not None and start is not None and start.strip()[:1] in ("+", "-"):
                # Counted from the database's clock, as `schedule --at +10m`.
                first = first + (await _database_now(client.store) - now)
            return await client.add_schedule(
                name, target=target, every=every, cron=cron, timezone=timezone, args=args,
                timeout=timeout, misfire=misfire, jitter=jitter, start=first, replace=replace,
            )  # fmt: skip

    added = _run(main())
    done = "added" if added.created else "replaced"
    click.echo(f"{name}: {done}, next run {added.schedule.next_run_at.astimezone(UTC).isoformat()}")


@tasks.command("remove")
@config_option
@click.argument("name", callback=_text)
@handles_errors
def tasks_remove(config_file: Path | None, name: str) -> None:
    """Remove a runtime schedule (a run in flight finishes; declared tasks are refused)."""
    settings = _settings(config_file)

    async def main() -> ScheduleRecord:
        async with _client(settings) as client:
            return await client.remove_schedule(name)

    _run(main())
    click.echo(f"{name}: removed")


@tasks.command("show")
@config_option
@click.argument("name", callback=_text)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (every column).")
@handles_errors
def tasks_show(config_file: Path | None, name: str, as_json: bool) -> None:
    """One task or runtime schedule, every column."""
    settings = _settings(config_file)

    async def main() -> ScheduleRecord | None:
        async with _client(settings) as client:
            return await client.get_schedule(name)

    row = _run(main())
    if row is None:
        raise NotFound(f"no task named {name!r} (see `scheduler-daemon tasks list`)")
    if as_json:
        click.echo(dumps(json_row(row)))
        return
    shown = json_row(row)
    state = "inactive" if not row.active else "paused" if row.paused else "active"
    lines = [("name", row.name), ("source", row.source), ("state", state)]
    if row.runtime:
        lines += [
            ("target", str(row.target)),
            ("args", json.dumps(row.args, ensure_ascii=False)),
            ("schedule", _schedule_text(row).removesuffix(f" -> {row.target} (runtime)")),
            ("timeout", f"{row.timeout_seconds:g}s"),
            ("misfire", row.misfire),
        ]
    else:
        lines += [("schedule", f"{row.schedule} (declared: the deployment holds its definition)")]
    lines += [
        (column, "-" if shown[column] is None else str(shown[column]))
        for column in (
            "next_run_at", "trigger_requested_at", "last_slot", "last_started_at",
            "last_finished_at", "last_status", "consecutive_failures", "run_count",
            "created_at", "updated_at",
        )
    ]  # fmt: skip
    lines.append(("last_error", row.last_error or "-"))
    for line in _table(("", ""), lines)[1:]:
        click.echo(line)


def _task_action(
    act: Callable[[ScheduleStore, str], Awaitable[bool]], done: str
) -> Callable[[Path | None, str], None]:
    @config_option
    @click.argument("name", callback=_text)
    @handles_errors
    def action(config_file: Path | None, name: str) -> None:
        async def main() -> bool:
            async with _store(_settings(config_file)) as store, store.transaction() as tx:
                return await act(ScheduleStore(tx), name)

        if not _run(main()):
            raise NotFound(f"no task named {name!r} (see `scheduler-daemon tasks list`)")
        click.echo(f"{name}: {done}")

    return action


tasks.command("pause", help="Stop running a task's slots until resumed.")(
    _task_action(ScheduleStore.pause, "paused")
)
tasks.command("resume", help="Resume a paused task (also clears its failure count).")(
    _task_action(ScheduleStore.resume, "resumed")
)
tasks.command("trigger", help="Run a task once, as soon as the leader sees it.")(
    _task_action(ScheduleStore.trigger, "triggered")
)
