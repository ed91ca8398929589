"""An older replica never leads on a schema newer than the newest migration it carries.

During a rolling upgrade the new build migrates while replicas of the old one still run.
The old code cannot know what the new schema means, so from the moment the migration
commits it does no more work:

- every fenced transaction reads the schema version in its first statement, with its
  proof of the lock (session mode's ``scheduler_fence`` or a member's ``scheduler_fence_shards``,
  transaction mode's ``compete``; on
  SQLite the first statement of the ``BEGIN IMMEDIATE`` transaction), and the transaction
  that claims a lock just granted reads it too;
- ``migrate`` takes ``scheduler_schema_version`` in ACCESS EXCLUSIVE mode before it
  applies anything (SQLite: its ``BEGIN IMMEDIATE``), so it waits for the fenced
  transactions in flight — each holds ACCESS SHARE on the table from that first statement
  until it ends — and every fenced transaction after it sees the new version;
- a replica that sees a newer version does no work in that transaction, hands over the
  locks it holds, and contends for none again. It stays up as an idle standby that says
  why (``schema.newer``, ``/readyz``, ``/status``, systemd's ``STATUS=``) until the new
  build replaces it: exiting instead would make a supervisor restart it for ever.

The gate is per daemon (one replica), shared by its loops: whichever notices first stops
them all.
"""

from __future__ import annotations

import asyncio

from .config.url import Backend
from .db.sqlfiles import migrations
from .logs import Logger


class SchemaNewer(Exception):
    """The database's schema is newer than any migration this build carries."""

    def __init__(self, found: int, newest: int) -> None:
        super().__init__(
            f"the schema is at version {found}, newer than this build's newest migration ({newest})"
        )
        self.found = found
        self.newest = newest


class SchemaGate:
    def __init__(self, backend: Backend) -> None:
        self.newest = migrations(backend)[-1].version
        self.found: int | None = None  # the newer version seen, once seen
        self.newer = asyncio.Event()  # set once: a schema never goes back

    @property
    def outdated(self) -> bool:
        return self.newer.is_set()

    def note(self, version: int | None, log: Logger, noticed: str) -> bool:
        """Take note of the version the database reported; True if it is newer than this
        build knows (the replica is outdated from now on). ``noticed``: where it was read,
        for the log line (``startup``, ``fence``, ``lock granted``)."""
        if version is None or version <= self.newest:
            return False
        first = not self.newer.is_set()
        self.found = max(version, self.found or 0)
        self.newer.set()
        if first:
            log.warning(
                "schema.newer", schema_version=version, newest_migration=self.newest,
                noticed=noticed, hint="a newer build migrated the database: this replica "
                "leads no loop from now on and stays a standby until that build replaces it",
            )  # fmt: skip
        return True

    def check(self, version: int | None, log: Logger, noticed: str) -> None:
        """Raise :class:`SchemaNewer` if ``version`` is newer than this build knows."""
        if self.note(version, log, noticed):
            raise self.error()

    def error(self) -> SchemaNewer:
        assert self.found is not None, "only once a newer version was seen"
        return SchemaNewer(self.found, self.newest)

    def describe(self) -> str:
        """One line for people: systemd's STATUS=, the readiness reason."""
        return (
            f"outdated: schema v{self.found} is newer than this build's newest migration "
            f"(v{self.newest}); standing by, leading nothing"
        )
