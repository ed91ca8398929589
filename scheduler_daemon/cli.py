"""The ``scheduler-daemon`` command line.

Every command reads the same configuration (file from ``--config``/``SCHEDULER_CONFIG``,
then ``SCHEDULER_*`` variables) and reports a refusal as one line on stderr with a
sysexits-style exit code: 78 invalid config, 69 database unavailable, 65 bad input.
"""

from __future__ import annotations

import asyncio
import functools
import json
import sys
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import click

from . import __version__
from .client import Client
from .config import LogSettings, Settings, load_settings, parse_duration
from .db import Publication
from .db.connect import connect
from .errors import EXIT_SOFTWARE, InvalidInput, NotFound, SchedulerError
from .logs import configure_logging, get_logger
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


def _fail(error: SchedulerError) -> None:
    click.echo(f"scheduler-daemon: {error}", err=True)
    sys.exit(error.exit_code)


def handles_errors(command: F) -> F:
    """Turn the daemon's own errors into one line and an exit code, not a traceback."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except SchedulerError as error:
            _fail(error)

    return wrapper  # type: ignore[return-value]


def _settings(config_file: Path | None, quiet: bool = True) -> Settings:
    settings = load_settings(config_file)
    # One-shot commands only log problems (e.g. retries); `run` logs at the configured level.
    level = "warning" if quiet and settings.log.level in ("debug", "info") else settings.log.level
    configure_logging(LogSettings(format=settings.log.format, level=level))
    return settings


def _run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


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
        store = await connect(settings, get_logger(instance=settings.instance_id))
        try:
            applied = await store.migrate()
            version = await store.schema_version()
        finally:
            await store.close()
        names = ", ".join(f"{m.version:04d}_{m.name}" for m in applied) or "nothing to apply"
        click.echo(f"schema at version {version} ({names})")

    _run(main())


@cli.command("check-config")
@config_option
@click.option(
    "--connect",
    "and_connect",
    is_flag=True,
    help="Also log in to the database: exit 78 if it refuses the login, 69 if unreachable.",
)
@handles_errors
def check_config(config_file: Path | None, and_connect: bool) -> None:
    """Validate and print the effective config (secrets redacted); exit 78 if invalid.

    With --connect this is a preflight for a supervisor that cannot be told "do not
    restart on 78" (Docker Compose): run it once, and start replicas only if it passed.
    """
    # Imported here, like the daemon in `run`: publishers bring in aiohttp, plugin tasks
    # their targets, which the short-lived commands (status, schedule, tasks) never need.
    from .plugins.builtin import builtin_tasks
    from .plugins.tasks import load_tasks
    from .publishers import build_publishers

    settings = load_settings(config_file)
    tasks = load_tasks(settings, builtin_tasks(settings))  # imports targets: exit 78 if broken
    build_publishers(settings, settings.database_url.backend)
    report = settings.redacted()
    report["plugin"]["effective_tasks"] = [
        {"name": t.name, "schedule": t.schedule.describe(), "source": t.source} for t in tasks
    ]
    click.echo(json.dumps(report, indent=2))
    if and_connect:

        async def main() -> int | None:
            configure_logging(LogSettings(format=settings.log.format, level="warning"))
            store = await connect(settings, get_logger(instance=settings.instance_id))
            try:
                return await store.schema_version()
            finally:
                await store.close()

        version = _run(main())
        click.echo(f"database login ok, schema version {version}", err=True)


def parse_when(text: str, now: datetime | None = None) -> datetime:
    """ISO 8601 with a timezone (``2027-01-01T09:00:00+02:00``, ``…Z``) or ``+10m``."""
    text = text.strip()
    if text.startswith("+"):
        try:
            seconds = parse_duration(text[1:])
        except ValueError:
            raise InvalidInput(f"--at {text!r}: not a relative time like +90s or +10m") from None
        return (now or datetime.now(UTC)) + timedelta(seconds=seconds)
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise InvalidInput(f"--at {text!r}: not an ISO 8601 time") from None
    if when.tzinfo is None:
        raise InvalidInput(f"--at {text!r}: give a timezone (e.g. Z or +02:00)")
    return when


def _describe(publication: Publication) -> dict[str, Any]:
    return {
        "id": publication.id,
        "key": publication.key,
        "status": publication.status,
        "publish_at": publication.publish_at.isoformat(),
    }


@cli.command()
@config_option
@click.option("--at", "at", required=True, help="When: ISO 8601 with timezone, or +10m.")
@click.option("--payload", default="{}", show_default=True, help="JSON payload.")
@click.option("--key", default=None, help="Idempotency key: scheduling it again is a no-op.")
@handles_errors
def schedule(config_file: Path | None, at: str, payload: str, key: str | None) -> None:
    """Schedule a publication and print its id."""
    settings = _settings(config_file)
    when = parse_when(at)
    try:
        data = json.loads(payload)
    except json.JSONDecodeError as exc:
        raise InvalidInput(f"--payload is not valid JSON: {exc}") from None

    async def main() -> None:
        async with Client.connect(settings, get_logger(instance=settings.instance_id)) as client:
            result = await client.schedule(when, data, key=key)
        if not result.created:
            click.echo(f"key {key!r} already scheduled as id {result.publication.id}", err=True)
        click.echo(result.publication.id)

    _run(main())


@cli.command()
@config_option
@click.argument("publication_id", type=int)
@handles_errors
def cancel(config_file: Path | None, publication_id: int) -> None:
    """Cancel a scheduled publication."""
    settings = _settings(config_file)

    async def main() -> None:
        async with Client.connect(settings, get_logger(instance=settings.instance_id)) as client:
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
        store = await connect(settings, get_logger(instance=settings.instance_id))
        try:
            return await collect_status(store, settings)
        finally:
            await store.close()

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


def _task_rows(settings: Settings, query: str, *args: Any) -> list[dict[str, Any]]:
    async def main() -> list[dict[str, Any]]:
        store = await connect(settings, get_logger(instance=settings.instance_id))
        try:
            async with store.transaction() as tx:
                return await tx.fetch(query, *args)
        finally:
            await store.close()

    return _run(main())


def _when(value: datetime | None) -> str:
    return value.isoformat(timespec="seconds") if value else "-"


@tasks.command("list")
@config_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@handles_errors
def tasks_list(config_file: Path | None, as_json: bool) -> None:
    """Each task: schedule, next run, last run and status, run count."""
    rows = _task_rows(_settings(config_file), "tasks_list")
    if as_json:
        click.echo(json.dumps(rows, indent=2, default=str))
        return
    header = f"{'TASK':<28} {'STATE':<9} {'NEXT RUN':<26} {'LAST STATUS':<12} {'RUNS':>6}  SCHEDULE"
    click.echo(header)
    for row in rows:
        state = "inactive" if not row["active"] else "paused" if row["paused"] else "active"
        click.echo(
            f"{row['name']:<28} {state:<9} {_when(row['next_run_at']):<26} "
            f"{row['last_status'] or '-':<12} {row['run_count']:>6}  {row['schedule']}"
        )


def _task_action(query: str, done: str) -> Callable[[Path | None, str], None]:
    @config_option
    @click.argument("name")
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


def main() -> None:
    cli()
