"""``Client``: the scheduling API on the daemon's own connection pool (a store it opens),
each call in a transaction of its own."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any

from ..config.settings import Settings
from ..db import (
    AddedSchedule,
    Publication,
    PublicationFilter,
    ScheduleRecord,
    ScheduleResult,
    Store,
)
from ..db.connect import connect
from ..db.schedules import ScheduleStore
from ..logs import Logger, get_logger
from .rules import DurationLike, validate_publication, validate_runtime_schedule


class Client:
    def __init__(self, store: Store, max_payload_bytes: int) -> None:
        self.store = store
        self.max_payload_bytes = max_payload_bytes

    @classmethod
    @asynccontextmanager
    async def connect(cls, settings: Settings, log: Logger | None = None) -> AsyncIterator[Client]:
        """Open the store, retrying within ``database.startup_budget``; past it, raise
        :class:`~scheduler_daemon.errors.DatabaseUnavailable` (password redacted)."""
        log = log or get_logger(instance=settings.instance_id)
        store = await connect(settings, log)
        try:
            yield cls(store, settings.publish.max_payload_bytes)
        finally:
            await store.close()

    async def schedule(
        self, at: datetime, payload: Any = None, key: str | None = None
    ) -> ScheduleResult:
        """Schedule a publication; with ``key``, scheduling twice returns the first one
        unchanged (see :func:`ignored_changes`)."""
        request = validate_publication(at, payload, key, max_payload_bytes=self.max_payload_bytes)
        return await self.store.schedule(request.publish_at, request.payload_json, request.key)

    async def cancel(self, publication_id: int) -> Publication:
        return await self.store.cancel(publication_id)

    async def get(self, publication_id: int) -> Publication | None:
        return await self.store.get(publication_id)

    async def get_by_key(self, key: str) -> Publication | None:
        return await self.store.get_by_key(key)

    async def find(self, where: PublicationFilter | None = None) -> list[Publication]:
        """Publications in ``publish_at`` order (the first 100 unless ``where.limit``)."""
        return await self.store.find_publications(where or PublicationFilter())

    # Runtime schedules: docs/plugins.md, "Schedules as data".

    async def add_schedule(
        self,
        name: str,
        *,
        target: str,
        every: DurationLike | None = None,
        cron: str | None = None,
        timezone: str = "UTC",
        args: Mapping[str, Any] | None = None,
        timeout: DurationLike = 300.0,  # noqa: ASYNC109 (each run's, not this call's)
        misfire: str = "run_once",
        jitter: DurationLike = 0.0,
        start: datetime | None = None,
        replace: bool = False,
    ) -> AddedSchedule:
        """Add a runtime schedule: ``target`` (a ``"package.module:function"`` the
        deployment declares runnable: ``plugin.runnable``) runs with ``ctx.args == args``
        at every slot of ``every`` or ``cron`` (see :func:`validate_runtime_schedule` for
        each parameter). The first slot is ``start``, else the schedule's first after the
        database's now: an interval schedule runs at once.

        A name in use is refused (:class:`InvalidInput`, nothing changed), unless
        ``replace``: then a runtime schedule of that name gets this definition, keeping
        its ``next_run_at`` unless the schedule (every, cron, timezone, jitter) changed or
        ``start`` is given, and keeping its paused state and history. A task the
        deployment declares is never replaced. ``created`` in the result says which
        happened. The current plugin leader sees it at once on PostgreSQL in session
        mode, else at its next tick."""
        request = validate_runtime_schedule(
            name, target=target, every=every, cron=cron, timezone=timezone, args=args,
            timeout=timeout, misfire=misfire, jitter=jitter, start=start,
            max_args_bytes=self.max_payload_bytes,
        )  # fmt: skip
        async with self.store.transaction() as tx:
            return await ScheduleStore(tx).add(request.definition(), replace=replace)

    async def remove_schedule(self, name: str) -> ScheduleRecord:
        """Remove a runtime schedule, returning its last state: no slot of it runs after
        this commits, and a run in flight ends normally (its history stays in
        ``scheduler_plugin_runs``). :class:`~scheduler_daemon.errors.NotFound` for an
        unknown name, and for a task the deployment declares (left as it is)."""
        async with self.store.transaction() as tx:
            return await ScheduleStore(tx).remove(name)

    async def get_schedule(self, name: str) -> ScheduleRecord | None:
        """A runtime schedule or declared task by name (see ``ScheduleRecord.runtime``)."""
        async with self.store.transaction(readonly=True) as tx:
            return await ScheduleStore(tx).get(name)

    async def list_schedules(
        self, *, after: str | None = None, limit: int | None = None
    ) -> list[ScheduleRecord]:
        """Runtime schedules and declared tasks in name order: those after ``after``
        (None: from the first), at most ``limit`` (None: all of them). A page costs its
        own rows: to go through a million, ask for pages, each ``after`` the last name of
        the one before."""
        async with self.store.transaction(readonly=True) as tx:
            return await ScheduleStore(tx).list_page(after, limit)

    async def count_schedules(self) -> int:
        """How many runtime schedules and declared tasks there are."""
        async with self.store.transaction(readonly=True) as tx:
            return await ScheduleStore(tx).count()

    async def pause_schedule(self, name: str) -> ScheduleRecord:
        """Stop running its slots (a run in flight finishes), as ``tasks pause``."""
        async with self.store.transaction() as tx:
            return await ScheduleStore(tx).set_paused(name, True)

    async def resume_schedule(self, name: str) -> ScheduleRecord:
        """Run its slots again and clear its failure count, as ``tasks resume``."""
        async with self.store.transaction() as tx:
            return await ScheduleStore(tx).set_paused(name, False)
