"""The scheduling API's requests, checked, then sent on the daemon's pool: the rules every
way in shares, and :class:`Client`. One module because the rules serve this API alone:
each ``Client`` call that writes checks its request by them, then runs the store's
statements; ``in_transaction.py`` (the same calls, in the application's transaction) and
the CLI import them from here.

The rules, checked before anything reaches the database: a publication's payload, time
and key (:func:`validate_publication`, :class:`PublicationRequest`,
:func:`validate_schedule`, :func:`encode_payload`, :func:`ignored_changes`), a runtime
schedule (:func:`validate_runtime_schedule`, :class:`RuntimeSchedule`), and the limits
they hold to (the ``MAX_*`` constants). :class:`Client` runs each call on a store it opens,
in a transaction of its own.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Final

from pydantic import ValidationError

from ..config.settings import MAX_TASK_NAME_LENGTH, PluginTaskSettings, PublishSettings, Settings
from ..db import (
    AddedSchedule,
    Publication,
    PublicationFilter,
    ScheduleDefinition,
    ScheduleRecord,
    ScheduleResult,
    Store,
)
from ..db.connect import connect
from ..db.schedules import ScheduleStore
from ..errors import InvalidInput
from ..logs import Logger, get_logger

if TYPE_CHECKING:
    from ..plugins.tasks import Schedule

#: ``publish.max_payload_bytes`` unless configured otherwise (1 MiB).
DEFAULT_MAX_PAYLOAD_BYTES: Final[int] = PublishSettings.model_fields["max_payload_bytes"].default
#: Arrays and objects inside one another, at most. Far beyond any real payload, and far
#: below what every reader copes with: Python's json (about 1,000 levels), PostgreSQL's
#: parser, the CLI's output. A PostgreSQL constraint holds plain SQL to it too.
MAX_PAYLOAD_DEPTH: Final = 100
#: Characters in a key, as in a task name: a unique index entry must stay under
#: PostgreSQL's 2,704 bytes, and a `notify` message carrying it under 8,000.
MAX_KEY_LENGTH: Final = MAX_TASK_NAME_LENGTH

_SURROGATE = re.compile("[\ud800-\udfff]")


def _unstorable(text: str) -> str | None:
    """Why PostgreSQL cannot store this text (SQLite could: refused on both alike)."""
    if "\x00" in text:
        return "a NUL character (\\u0000), which PostgreSQL text and jsonb cannot hold"
    found = _SURROGATE.search(text)
    if found is not None:
        return f"a lone surrogate ({ascii(found.group())[1:-1]}), which is not Unicode text"
    return None


def _check_payload(payload: Any) -> None:
    """Depth and text of a payload that json.dumps accepted (so it has no cycle); without
    recursion, so that no payload can exhaust the stack here."""
    pending: list[tuple[Any, int]] = [(payload, 0)]
    while pending:
        value, depth = pending.pop()
        if isinstance(value, str):
            problem = _unstorable(value)
            if problem is not None:
                raise InvalidInput(f"payload holds {problem}")
        elif isinstance(value, dict | list | tuple) and value:
            if depth >= MAX_PAYLOAD_DEPTH:
                raise InvalidInput(
                    f"payload is nested deeper than {MAX_PAYLOAD_DEPTH} levels of arrays "
                    "and objects"
                )
            items = [*value, *value.values()] if isinstance(value, dict) else value
            pending.extend((item, depth + 1) for item in items)


def encode_payload(payload: Any, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> str:
    """``payload`` as compact JSON text; refused (:class:`InvalidInput`) if it is not JSON
    (a set, NaN, …), is nested deeper than :data:`MAX_PAYLOAD_DEPTH`, holds text no
    database can store (NUL, a lone surrogate) or is longer than ``max_payload_bytes``
    once encoded."""
    try:
        text = json.dumps(payload, allow_nan=False, separators=(",", ":"))
    except RecursionError:
        raise InvalidInput(
            f"payload is nested deeper than {MAX_PAYLOAD_DEPTH} levels of arrays and objects"
        ) from None
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"payload is not JSON-serialisable: {exc}") from None
    size = len(text.encode())
    if size > max_payload_bytes:
        raise InvalidInput(
            f"payload is {size} bytes, over the limit of {max_payload_bytes} "
            "(publish.max_payload_bytes)"
        )
    _check_payload(payload)
    return text


@dataclass(frozen=True, slots=True)
class PublicationRequest:
    """A publication that passed :func:`validate_publication`: what :meth:`Client.schedule`
    and :func:`schedule_in` write (db/publications.py)."""

    publish_at: datetime
    payload: Any  # as asked, None read as {}
    payload_json: str  # the payload as compact JSON text, for scheduler_publications.payload
    key: str | None


def validate_publication(
    publish_at: datetime,
    payload: Any = None,
    key: str | None = None,
    *,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
) -> PublicationRequest:
    """Every rule a scheduling request must pass; returns the request, its payload as JSON
    text ready for ``scheduler_publications.payload``. Raises :class:`InvalidInput`.

    The rules: ``publish_at`` is timezone-aware and in the years 1 to 9999 in UTC;
    ``key`` is None, or not blank, at most :data:`MAX_KEY_LENGTH` characters, and text
    PostgreSQL can store (no NUL, no lone surrogate); the payload (None means ``{}``) is
    JSON of at most ``max_payload_bytes``, nested at most :data:`MAX_PAYLOAD_DEPTH`
    levels, its strings storable text too. A time in the past is accepted: the
    publication is due at once.
    """
    if publish_at.tzinfo is None or publish_at.utcoffset() is None:
        raise InvalidInput("publish time must be timezone-aware (e.g. 2027-01-01T09:00Z)")
    try:
        publish_at.astimezone(UTC)
    except OverflowError:
        raise InvalidInput(
            f"publish time {publish_at.isoformat()} is out of range (years 1 to 9999, in UTC)"
        ) from None
    if key is not None:
        if not key.strip():
            raise InvalidInput("key must not be empty")
        if len(key) > MAX_KEY_LENGTH:
            raise InvalidInput(f"key is {len(key)} characters, over the limit of {MAX_KEY_LENGTH}")
        problem = _unstorable(key)
        if problem is not None:
            raise InvalidInput(f"key holds {problem}")
    payload = {} if payload is None else payload
    return PublicationRequest(publish_at, payload, encode_payload(payload, max_payload_bytes), key)


def validate_schedule(
    publish_at: datetime,
    payload: Any = None,
    key: str | None = None,
    *,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
) -> str:
    """:func:`validate_publication`'s rules, returning the payload as JSON text only: for
    an application that runs the ``schedule`` statement itself (docs/publishing.md)."""
    request = validate_publication(publish_at, payload, key, max_payload_bytes=max_payload_bytes)
    return request.payload_json


def ignored_changes(result: ScheduleResult, publish_at: datetime, payload: Any = None) -> list[str]:
    """What a repeated request asked for that the first one did not: ``publish_at`` and/or
    ``payload``. Scheduling an existing key changes nothing, so the first request wins;
    empty when this request created the publication or asked for the same."""
    if result.created:
        return []
    existing = result.publication
    changed = []
    if existing.publish_at != publish_at:
        changed.append("publish_at")
    # Compared as decoded JSON: jsonb may reorder keys or respace, never change a value.
    if existing.payload != json.loads(json.dumps({} if payload is None else payload)):
        changed.append("payload")
    return changed


# -- runtime schedules ------------------------------------------------------------------

#: A runtime schedule's target, as the deployment names it in ``plugin.runnable``:
#: ``package.module:function`` (or ``module:Class.method``).
_TARGET = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*", re.ASCII)

#: Seconds (``30``, ``2.5``), a duration as config reads it (``"30s"``, ``"250ms"``,
#: ``"5m"``, ``"1h"``, ``"1d"``), or a timedelta.
DurationLike = float | str | timedelta


@dataclass(frozen=True, slots=True)
class RuntimeSchedule:
    """A runtime schedule that passed :func:`validate_runtime_schedule`: what
    :meth:`Client.add_schedule` and :func:`add_schedule_in` write."""

    name: str
    target: str
    args: dict[str, Any]
    args_json: str
    every_seconds: float | None
    cron: str | None
    timezone: str
    timeout_seconds: float
    misfire: str
    jitter_seconds: float
    start: datetime | None
    schedule: Schedule  # when its slots fall (plugins/tasks.py)

    def definition(self) -> ScheduleDefinition:
        return ScheduleDefinition(
            name=self.name,
            target=self.target,
            args_json=self.args_json,
            schedule=self.schedule.describe(),
            every_seconds=self.every_seconds,
            cron=self.cron,
            timezone=self.timezone,
            timeout_seconds=self.timeout_seconds,
            misfire=self.misfire,
            jitter_seconds=self.jitter_seconds,
            start=self.start,
            # From the database's clock, read in the transaction that writes the row.
            first_slot=self.schedule.first,
        )


def _seconds(value: DurationLike) -> Any:
    return value.total_seconds() if isinstance(value, timedelta) else value


def _first_problem(exc: ValidationError) -> str:
    """The first problem pydantic found, named by its parameter (``every: not a
    duration: 'soon' …``)."""
    error = exc.errors(include_url=False)[0]
    message = str(error["msg"]).removeprefix("Value error, ")
    key = ".".join(str(part) for part in error["loc"])
    return f"{key}: {message}" if key else message


def _check_names(name: str, target: str, cron: str | None, timezone: str) -> None:
    """A runtime schedule's name and target as the database can keep them."""
    if not isinstance(name, str) or not name.strip():
        raise InvalidInput("name must not be empty")
    if len(name) > MAX_TASK_NAME_LENGTH:
        raise InvalidInput(
            f"name is {len(name)} characters, over the limit of {MAX_TASK_NAME_LENGTH}"
        )
    for what, text in (("name", name), ("cron", cron), ("timezone", timezone)):
        problem = _unstorable(text) if isinstance(text, str) else None
        if problem is not None:
            raise InvalidInput(f"{what} holds {problem}")
    if not isinstance(target, str) or _TARGET.fullmatch(target) is None:
        raise InvalidInput(f"target {target!r} is not of the form 'package.module:function'")


def _args_json(args: Mapping[str, Any] | None, max_args_bytes: int) -> str:
    """``args`` as stored: a JSON object within the payload limits (None: ``{}``)."""
    if args is None:
        args = {}
    if not isinstance(args, Mapping):
        raise InvalidInput(f"args must be a JSON object, not {type(args).__name__}")
    try:
        return encode_payload(dict(args), max_args_bytes)
    except InvalidInput as exc:
        raise InvalidInput("args" + str(exc).removeprefix("payload")) from None


def validate_runtime_schedule(
    name: str,
    *,
    target: str,
    every: DurationLike | None = None,
    cron: str | None = None,
    timezone: str = "UTC",
    args: Mapping[str, Any] | None = None,
    timeout: DurationLike = 300.0,
    misfire: str = "run_once",
    jitter: DurationLike = 0.0,
    start: datetime | None = None,
    max_args_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
) -> RuntimeSchedule:
    """Every rule a runtime schedule must pass before it reaches the database; raises
    :class:`InvalidInput` naming the parameter.

    The rules: ``name`` is not blank, at most :data:`MAX_TASK_NAME_LENGTH` characters of
    storable text; exactly one of ``every`` (a positive duration) and ``cron`` (a cron
    expression that matches some date, read in ``timezone``, an IANA name); ``target``
    is ``package.module:function`` (whether the deployment declares it runnable is the
    database's to say, at the write); ``args`` is a JSON object (None: ``{}``) within
    ``max_args_bytes`` (the daemon's ``publish.max_payload_bytes``) and
    :data:`MAX_PAYLOAD_DEPTH`; ``timeout`` a positive duration, ``misfire`` ``run_once``
    or ``skip``, ``jitter`` a duration of 0 or more; durations as config reads them
    (``30``, ``"30s"``, ``"5m"``) or timedeltas; ``start`` None (the schedule's first
    slot after the database's now: an interval runs at once, a cron expression at its
    next match) or a timezone-aware time (in the past: due at once).
    """
    _check_names(name, target, cron, timezone)
    args_json = _args_json(args, max_args_bytes)
    fields: dict[str, Any] = {
        "name": name,
        "target": target,
        "timezone": timezone,
        "timeout": _seconds(timeout),
        "misfire": misfire,
    }
    if every is not None:
        fields["every"] = _seconds(every)
    if cron is not None:
        fields["cron"] = cron
    fields["jitter"] = _seconds(jitter)
    try:
        declared = PluginTaskSettings.model_validate(fields)
    except ValidationError as exc:
        raise InvalidInput(_first_problem(exc)) from None
    # Imported here: the CLI imports this module, and only a schedule needs croniter.
    from ..plugins.tasks import make_schedule

    try:
        schedule = make_schedule(
            name, declared.every, declared.cron, declared.timezone, declared.jitter
        )
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None
    if start is not None:
        if start.tzinfo is None or start.utcoffset() is None:
            raise InvalidInput("start must be timezone-aware (e.g. 2027-01-01T09:00Z)")
        try:
            start = start.astimezone(UTC)
        except OverflowError:
            raise InvalidInput(
                f"start {start.isoformat()} is out of range (years 1 to 9999, in UTC)"
            ) from None
    return RuntimeSchedule(
        name=name,
        target=target,
        args=json.loads(args_json),
        args_json=args_json,
        every_seconds=declared.every,
        cron=declared.cron,
        timezone=declared.timezone,
        timeout_seconds=declared.timeout,
        misfire=declared.misfire,
        jitter_seconds=declared.jitter,
        start=start,
        schedule=schedule,
    )


# -- the client on the daemon's pool ----------------------------------------------------


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
