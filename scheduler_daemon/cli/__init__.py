"""The ``scheduler-daemon`` command line.

Every command reads the same configuration (file from ``--config``/``SCHEDULER_CONFIG``,
then ``SCHEDULER_*`` variables) and reports a failure as one line on stderr, never a
traceback, with a sysexits-style exit code: 65 bad input, 66 no schema (run ``migrate``),
69 database unavailable, 70 internal error, 75 database busy (try again), 78 invalid
config or a login/privilege the database refused. See docs/operations.md, Exit codes.

The commands live by what they act on: ``operations`` (run, migrate, check-config,
preflight, status, healthcheck), ``publications`` (schedule, cancel, publications list and
show), ``tasks`` (the tasks group); ``common`` holds what they share.
"""

from __future__ import annotations

import click

from .. import __version__
from .operations import check_config, healthcheck, migrate, preflight, run, status
from .publications import cancel, publications, schedule
from .tasks import tasks


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="scheduler-daemon")
def cli() -> None:
    """A replicated scheduler: run any number of replicas; the database picks one per loop."""


for command in (run, migrate, check_config, preflight, status, healthcheck, schedule, cancel):
    cli.add_command(command)
cli.add_command(publications)
cli.add_command(tasks)


def main() -> None:
    cli()
