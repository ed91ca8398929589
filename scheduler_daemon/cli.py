"""The ``scheduler-daemon`` command line.

Every command reads the same configuration (file from ``--config``/``SCHEDULER_CONFIG``,
then ``SCHEDULER_*`` variables) and reports a failure as one line on stderr, never a
traceback, with a sysexits-style exit code: 65 bad input, 66 no schema (run ``migrate``),
69 database unavailable, 70 internal error, 75 database busy (try again), 78 invalid
config or a login/privilege the database refused. See docs/operations.md, Exit codes.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import sys
import traceback
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import click

from . import __version__
from .client import MAX_PAYLOAD_DEPTH, Client, ignored_changes
from .config import Settings, load_settings, parse_duration
from .db import (
    AddedSchedule,
    Publication,
    PublicationFilter,
    ScheduleRecord,
    ScheduleResult,
    Store,
)
from .db.connect import connect, explain_database_error
from .errors import (
    EXIT_SOFTWARE,
    InvalidInput,
    NotFound,
    SchedulerError,
    describe,
)
from .logs import configure_logging, get_logger
from .output import dumps, json_row, json_rows
from .redact import redact
from .signals import stop_on_signals
from .status import collect_status, render_status

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")

config_option = click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="TOML config file (env: SCHEDULER_CONFIG). SCHEDULER_* variables override it.",
)


def _text(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A string a database can store (a click callback). An argument's bytes that are not
    UTF-8 reach Python as lone surrogates (``\\udcff`` for the byte 0xff), which no driver
    can encode: refused here, as a usage error naming the option, not as an internal error
    later."""
    if value is None:
        return None
    if "\x00" in value:  # impossible in a real argv; possible from Python
        raise click.BadParameter("contains a NUL character", ctx, param)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        char = ord(value[exc.start])
        what = f"the byte {char - 0xDC00:#04x}" if 0xDC80 <= char <= 0xDCFF else "a surrogate"
        raise click.BadParameter(
            f"is not UTF-8 text ({what} at position {exc.start})", ctx, param
        ) from None
    return value


# Publication ids are bigints: a larger number can name nothing, and no driver sends it.
PUBLICATION_ID = click.IntRange(-(2**63), 2**63 - 1)


# Where _settings() leaves the command's settings (click's per-invocation context), for
# handles_errors to name the database in what it prints.
_SETTINGS = "scheduler_daemon.settings"


class InternalError(SchedulerError):
    """Not a refusal: a bug. One line too; the traceback only at log level debug."""

    exit_code = EXIT_SOFTWARE


def _fail(error: SchedulerError) -> None:
    click.echo(f"scheduler-daemon: {error}", err=True)
    sys.exit(error.exit_code)


def _explain(exc: Exception) -> SchedulerError:
    context = click.get_current_context(silent=True)
    settings: Settings | None = context.meta.get(_SETTINGS) if context else None
    if settings is not None:
        explained = explain_database_error(exc, settings.database_url)
        if explained is not None:
            return explained
    if settings is not None and settings.log.level == "debug":
        click.echo(redact("".join(traceback.format_exception(exc))), err=True, nl=False)
    hint = "a bug; SCHEDULER_LOG__LEVEL=debug prints the traceback"
    return InternalError(f"internal error ({hint}): {describe(exc)}")


def handles_errors(command: F) -> F:
    """Turn every failure into one line on stderr and an exit code, never a traceback: the
    daemon's own errors as they are, a database's explained (``explain_database_error``:
    no schema, busy, privilege, …), anything else as an internal error (70)."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except BrokenPipeError:
            # `scheduler-daemon publications list | head`: the reader is gone, which is no
            # error worth a line. stdout goes to /dev/null so the exit flush cannot fail.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(1)
        except SchedulerError as error:
            _fail(error)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise  # click's own: usage errors print themselves (exit 2)
        except Exception as exc:
            _fail(_explain(exc))

    return wrapper  # type: ignore[return-value]


def _settings(config_file: Path | None, quiet: bool = True) -> Settings:
    settings = load_settings(config_file)
    context = click.get_current_context(silent=True)
    if context is not None:
        context.meta[_SETTINGS] = settings
    # One-shot commands only log problems (e.g. retries); `run` logs at the configured level.
    level = "warning" if quiet and settings.log.level in ("debug", "info") else settings.log.level
    configure_logging(
        settings.log.model_copy(update={"level": level}), instance=settings.instance_id
    )
    return settings


def _run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


@asynccontextmanager
async def _store(settings: Settings, *, create: bool = False) -> AsyncIterator[Store]:
    """The database for one command: an unreachable one is retried for
    ``database.command_budget`` (not the daemon's startup budget: someone is waiting), and
    a SQLite file that does not exist is left uncreated unless ``create`` (``migrate``)."""
    log = get_logger(instance=settings.instance_id)
    store = await connect(settings, log, create=create, budget="command_budget")
    try:
        yield store
    finally:
        await store.close()


@asynccontextmanager
async def _client(settings: Settings) -> AsyncIterator[Client]:
    """:class:`Client` on :func:`_store`."""
    async with _store(settings) as store:
        yield Client(store, settings.publish.max_payload_bytes)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="scheduler-daemon")
def cli() -> None:
    """A replicated scheduler: run any number of replicas; the database picks one per loop."""


@cli.command()
@config_option
@click.option(
    "--only",
    type=click.Choice(["publish", "plugin"]),
    default=None,
    help="Run just this loop (both enabled loops run by default).",
)
@handles_errors
def run(config_file: Path | None, only: str | None) -> None:
    """Run the daemon until SIGTERM/SIGINT (migrates first)."""
    # Imported here: the daemon's machinery (HTTP server, loops, worker processes) costs a
    # few tenths of a second to import, which every short-lived command would pay.
    from .daemon import Daemon

    settings = _settings(config_file, quiet=False)
    log = get_logger(instance=settings.instance_id)

    async def main() -> int:
        daemon = Daemon(settings, log, only=only)  # type: ignore[arg-type]
        with stop_on_signals(
            graceful=lambda sig: daemon.request_stop(sig.name),
            force=lambda sig: daemon.force_stop(sig.name),
        ):
            try:
                return await daemon.run()
            except SchedulerError:
                raise
            except Exception:
                # A bug or a database failure during startup: one structured line with the
                # traceback, then a non-zero exit for the supervisor to act on.
                log.exception("daemon.crashed")
                return EXIT_SOFTWARE

    sys.exit(_run(main()))


@cli.command()
@config_option
@handles_errors
def migrate(config_file: Path | None) -> None:
    """Create or upgrade the schema. Safe to run from many replicas at once."""
    settings = _settings(config_file)

    async def main() -> None:
        async with _store(settings, create=True) as store:
            applied = await store.migrate()
            version = await store.schema_version()
        names = ", ".join(f"{m.version:04d}_{m.name}" for m in applied) or "nothing to apply"
        click.echo(f"schema at version {version} ({names})")

    _run(main())


@cli.command("check-config")
@config_option
@handles_errors
def check_config(config_file: Path | None) -> None:
    """Validate and print the effective config (secrets redacted); exit 78 if invalid."""
    # Imported here, like the daemon in `run`: publishers bring in aiohttp, plugin tasks
    # their targets, which the short-lived commands (status, schedule, tasks) never need.
    from .plugins.builtin import builtin_tasks
    from .plugins.tasks import load_tasks
    from .publishers import build_publishers

    settings = _settings(config_file)
    tasks = load_tasks(settings, builtin_tasks(settings))  # imports targets: exit 78 if broken
    build_publishers(settings, settings.database_url.backend)
    report = settings.redacted()
    report["plugin"]["effective_tasks"] = [
        {"name": t.name, "schedule": t.schedule.describe(), "source": t.source} for t in tasks
    ]
    click.echo(json.dumps(report, indent=2))


@cli.command()
@config_option
@handles_errors
def preflight(config_file: Path | None) -> None:
    """Check all that `run` checks before starting its loops, migrating included; exit 0,
    or with the code `run` would exit with. A one-shot step before replicas start."""
    from .daemon import Daemon

    settings = _settings(config_file)
    daemon = Daemon(settings, get_logger(instance=settings.instance_id))
    version = _run(daemon.preflight())
    click.echo(
        f"preflight passed: configuration valid, database login ok, schema version {version}"
    )


def parse_when(text: str, now: datetime | None = None, option: str = "--at") -> datetime:
    """ISO 8601 with a timezone (``2027-01-01T09:00:00+02:00``, ``…Z``), or relative to
    this machine's clock: ``+10m``, ``-1h``."""
    text = text.strip()
    if text[:1] in ("+", "-"):
        try:
            seconds = parse_duration(text[1:])
        except ValueError:
            raise InvalidInput(
                f"{option} {text!r}: not a relative time like +90s, +10m or -1h"
            ) from None
        sign = -1 if text[0] == "-" else 1
        try:
            return (now or datetime.now(UTC)) + timedelta(seconds=sign * seconds)
        except OverflowError:
            raise InvalidInput(f"{option} {text!r}: {_OUT_OF_RANGE}") from None
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise InvalidInput(f"{option} {text!r}: not an ISO 8601 time") from None
    if when.tzinfo is None:
        raise InvalidInput(f"{option} {text!r}: give a timezone (e.g. Z or +02:00)")
    try:
        when.astimezone(UTC)  # 9999-12-31T23:00-05:00 is in the year 10000 in UTC
    except OverflowError:
        raise InvalidInput(f"{option} {text!r}: {_OUT_OF_RANGE}") from None
    return when


_OUT_OF_RANGE = "out of range (years 1 to 9999, in UTC)"


def _describe(publication: Publication) -> dict[str, Any]:
    row = json_row(publication)
    return {column: row[column] for column in ("id", "key", "status", "publish_at")}


@cli.command()
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


async def _database_now(store: Store) -> datetime:
    async with store.transaction(readonly=True) as tx:
        now: datetime = (await tx.fetch("now"))[0]["now"]
    return now


@cli.command()
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


@cli.command()
@config_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@handles_errors
def status(config_file: Path | None, as_json: bool) -> None:
    """Per loop: leader, standbys, backlog, next due."""
    settings = _settings(config_file)

    async def main() -> dict[str, Any]:
        async with _store(settings) as store:
            return await collect_status(store, settings)

    report = _run(main())
    click.echo(json.dumps(report, indent=2) if as_json else render_status(report))


@cli.command()
@config_option
@click.option("--timeout", default=4.0, show_default=True, help="Seconds to wait for /healthz.")
@handles_errors
def healthcheck(config_file: Path | None, timeout: float) -> None:
    """Ask this host's daemon for /healthz (the image's HEALTHCHECK); exit 0 if it answers.

    Reads the same configuration as `run`, so a changed `http.host`/`http.port` is
    followed; with `http.enabled = false` there is no endpoint and the check passes.
    """
    settings = _settings(config_file)
    if not settings.http.enabled:
        click.echo("http.enabled is false: no endpoint to probe")
        return
    url = f"http://{_local_address(settings.http.host)}:{settings.http.port}/healthz"
    # urllib, not aiohttp: this runs every few seconds and should cost a few tenths at most.
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            click.echo(f"{url}: {response.status}")
    except (OSError, ValueError) as exc:
        click.echo(f"scheduler-daemon: {url}: {exc}", err=True)
        sys.exit(1)


def _local_address(host: str) -> str:
    """Where a process on this host reaches a server bound to ``host``."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


@cli.group()
def tasks() -> None:
    """List and operate plugin tasks."""


def _task_rows(
    settings: Settings, query: str, *args: Any, readonly: bool = False
) -> list[dict[str, Any]]:
    async def main() -> list[dict[str, Any]]:
        async with _store(settings) as store, store.transaction(readonly=readonly) as tx:
            return await tx.fetch(query, *args)

    return _run(main())


def _when(value: datetime | None) -> str:
    return value.isoformat(timespec="seconds") if value else "-"


@tasks.command("list")
@config_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON (every column).")
@handles_errors
def tasks_list(config_file: Path | None, as_json: bool) -> None:
    """Each task: schedule, next run, last run and status, run count; a runtime
    schedule's schedule also names its target."""
    settings = _settings(config_file)

    async def main() -> list[ScheduleRecord]:
        async with _client(settings) as client:
            return await client.list_schedules()

    rows = _run(main())
    if as_json:
        click.echo(dumps(json_rows(rows)))
        return
    header = f"{'TASK':<28} {'STATE':<9} {'NEXT RUN':<26} {'LAST STATUS':<12} {'RUNS':>6}  SCHEDULE"
    click.echo(header)
    for row in rows:
        state = "inactive" if not row.active else "paused" if row.paused else "active"
        click.echo(
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


def _task_action(query: str, done: str) -> Callable[[Path | None, str], None]:
    @config_option
    @click.argument("name", callback=_text)
    @handles_errors
    def action(config_file: Path | None, name: str) -> None:
        if not _task_rows(_settings(config_file), query, name):
            raise NotFound(f"no task named {name!r} (see `scheduler-daemon tasks list`)")
        click.echo(f"{name}: {done}")

    return action


tasks.command("pause", help="Stop running a task's slots until resumed.")(
    _task_action("task_pause", "paused")
)
tasks.command("resume", help="Resume a paused task (also clears its failure count).")(
    _task_action("task_resume", "resumed")
)
tasks.command("trigger", help="Run a task once, as soon as the leader sees it.")(
    _task_action("task_trigger", "triggered")
)


# -- publications ---------------------------------------------------------------------

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


@cli.group()
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


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Left-aligned columns, as wide as their widest cell; the last one is not padded."""
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(headers))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in [headers, *rows]
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


def main() -> None:
    cli()
