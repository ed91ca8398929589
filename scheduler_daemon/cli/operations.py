"""The commands that run and look after a replica: ``run``, ``migrate``, ``check-config``,
``preflight``, ``status`` and ``healthcheck``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from ..errors import EXIT_SOFTWARE, SchedulerError
from ..logs import get_logger
from ..signals import stop_on_signals
from ..status import collect_status, render_status
from .common import _run, _settings, _store, config_option, handles_errors


@click.command()
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
    settings = _settings(config_file, quiet=False)
    # Imported here, once the configuration is valid: the daemon's machinery (loops,
    # leadership, worker processes) costs a few tenths of a second to import, which every
    # short-lived command, and a refused configuration's exit 78, would pay.
    from ..daemon import Daemon

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


@click.command()
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


@click.command("check-config")
@config_option
@handles_errors
def check_config(config_file: Path | None) -> None:
    """Validate and print the effective config (secrets redacted); exit 78 if invalid."""
    # Imported here, like the daemon in `run`: publishers bring in aiohttp, plugin tasks
    # their targets, which the short-lived commands (status, schedule, tasks) never need.
    from ..plugins.builtin import builtin_tasks
    from ..plugins.tasks import load_tasks
    from ..publishers import build_publishers

    settings = _settings(config_file)
    tasks = load_tasks(settings, builtin_tasks(settings))  # imports targets: exit 78 if broken
    build_publishers(settings, settings.database_url.backend)
    report = settings.redacted()
    report["plugin"]["effective_tasks"] = [
        {"name": t.name, "schedule": t.schedule.describe(), "source": t.source} for t in tasks
    ]
    click.echo(json.dumps(report, indent=2))


@click.command()
@config_option
@handles_errors
def preflight(config_file: Path | None) -> None:
    """Check all that `run` checks before starting its loops, migrating included; exit 0,
    or with the code `run` would exit with. A one-shot step before replicas start."""
    from ..daemon import Daemon

    settings = _settings(config_file)
    daemon = Daemon(settings, get_logger(instance=settings.instance_id))
    version = _run(daemon.preflight())
    click.echo(
        f"preflight passed: configuration valid, database login ok, schema version {version}"
    )


@click.command()
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


@click.command()
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
