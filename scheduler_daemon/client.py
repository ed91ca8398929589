"""The scheduling API for applications: schedule, cancel and look up publications.

    async with Client.connect(load_settings()) as client:
        result = await client.schedule(datetime(2027, 1, 1, 9, tzinfo=UTC), {"post": 42},
                                       key="post-42")

Validation happens here, before anything reaches the database, so a bad request changes
nothing. (Applications may also INSERT into ``scheduler_publications`` with plain SQL.)
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any

from .config import Settings
from .db import Publication, ScheduleResult, Store
from .db.connect import connect
from .errors import InvalidInput
from .logs import Logger, get_logger


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

    def encode_payload(self, payload: Any) -> str:
        try:
            text = json.dumps(payload, allow_nan=False, separators=(",", ":"))
        except (TypeError, ValueError) as exc:
            raise InvalidInput(f"payload is not JSON-serialisable: {exc}") from None
        size = len(text.encode())
        if size > self.max_payload_bytes:
            raise InvalidInput(
                f"payload is {size} bytes, over the limit of {self.max_payload_bytes} "
                "(publish.max_payload_bytes)"
            )
        return text

    async def schedule(
        self, at: datetime, payload: Any = None, key: str | None = None
    ) -> ScheduleResult:
        """Schedule a publication; with ``key``, scheduling twice returns the first one."""
        if at.tzinfo is None or at.utcoffset() is None:
            raise InvalidInput("publish time must be timezone-aware (e.g. 2027-01-01T09:00Z)")
        if key is not None and not key.strip():
            raise InvalidInput("key must not be empty")
        encoded = self.encode_payload({} if payload is None else payload)
        return await self.store.schedule(at, encoded, key)

    async def cancel(self, publication_id: int) -> Publication:
        return await self.store.cancel(publication_id)

    async def get(self, publication_id: int) -> Publication | None:
        return await self.store.get(publication_id)
