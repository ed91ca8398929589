"""Runtime schedules' statements, for both backends: typed methods over the named queries
``schedule_*`` of ``postgres.sql`` / ``sqlite.sql``, inside a transaction the caller holds.

``Client`` runs them in a transaction of the store's (``Client.add_schedule`` …); the
application's API runs them on its own asyncpg connection, inside the transaction it has
open there (``client.add_schedule_in``). Either way a refusal is decided before anything
is written, so that it raises :class:`InvalidInput` and leaves that transaction usable.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from ..errors import InvalidInput, NotFound
from .base import AddedSchedule, ScheduleDefinition, ScheduleRecord, Tx

# What the database's refusals start with (migration 0006): the trigger that keeps
# runtime schedules to runnable targets, and the CHECK on a runtime row's columns.
TARGET_CHECK: Final = "scheduler_plugin_tasks_target_check"
RUNTIME_CHECK: Final = "scheduler_plugin_tasks_runtime_check"

# Attempts of an add that raced with another writer of the same name (a row inserted or
# removed between the lookup and the write): each sees the other's commit.
_ATTEMPTS: Final = 3


def not_runnable(target: str) -> InvalidInput:
    """The refusal of a target the deployment does not declare runnable."""
    return InvalidInput(
        f"target {target!r} is not runnable: the deployment must declare it, in "
        f'plugin.runnable (e.g. runnable = ["{target}"] under [plugin], or '
        f"SCHEDULER_PLUGIN__RUNNABLE='[\"{target}\"]') or as a declared task's target, on "
        "the replicas that run the plugin loop; their leader publishes the runnable "
        "targets when it takes over (docs/plugins.md, Schedules as data)"
    )


def declared_task(name: str, source: str | None) -> str:
    return (
        f"{name!r} is a task the deployment declares ({source or 'config'}), not a runtime schedule"
    )


def explain_refusal(exc: BaseException, target: str) -> InvalidInput | None:
    """The database's own refusal of a runtime row (a writer that raced past the lookup,
    or a target removed from the runnable set meanwhile), as InvalidInput; None for any
    other error."""
    message = str(exc)
    if TARGET_CHECK in message:
        return not_runnable(target)
    if RUNTIME_CHECK in message:
        return InvalidInput(f"the database refused the schedule's definition: {message}")
    return None


def schedule_record(row: Mapping[str, Any]) -> ScheduleRecord:
    """A row of the ``schedule_*`` queries. ``args`` arrive decoded (the store's jsonb
    codec) or as JSON text (SQLite; an application's connection without a codec)."""
    data = dict(row)
    args = data["args"]
    if isinstance(args, str):
        args = json.loads(args)
    data["args"] = args if isinstance(args, dict) else {}
    data["active"], data["paused"] = bool(data["active"]), bool(data["paused"])
    # SQLite hands back a REAL column's whole numbers as ints in RETURNING rows.
    for column in ("every_seconds", "timeout_seconds", "jitter_seconds"):
        if data[column] is not None:
            data[column] = float(data[column])
    return ScheduleRecord(**data)


class ScheduleStore:
    """The runtime-schedule statements, inside one transaction (``tx``)."""

    def __init__(self, tx: Tx) -> None:
        self.tx = tx

    async def add(self, definition: ScheduleDefinition, *, replace: bool) -> AddedSchedule:
        name, target = definition.name, definition.target
        for _ in range(_ATTEMPTS):
            [look] = await self.tx.query("schedule_lookup", name=name, target=target)
            existing = look["existing"] is not None
            if existing and look["existing_target"] is None:
                raise InvalidInput(
                    f"{declared_task(name, look['existing_source'])}: a runtime schedule "
                    "cannot replace it; choose another name"
                )
            if existing and not replace:
                raise InvalidInput(
                    f"a schedule named {name!r} already exists (target "
                    f"{look['existing_target']!r}): pass replace=True (CLI: --replace) to "
                    "change its definition, or remove it first"
                )
            if not look["runnable"]:
                raise not_runnable(target)
            start = definition.start
            params = {
                "name": name,
                "target": target,
                "args": definition.args_json,
                "schedule": definition.schedule,
                "every_seconds": definition.every_seconds,
                "cron": definition.cron,
                "timezone": definition.timezone,
                "timeout_seconds": definition.timeout_seconds,
                "misfire": definition.misfire,
                "jitter_seconds": definition.jitter_seconds,
                "first": start if start is not None else definition.first_slot(look["now"]),
            }
            try:
                if existing:
                    rows = await self.tx.query("schedule_replace", reschedule=start is not None,
                                               **params)  # fmt: skip
                else:
                    rows = await self.tx.query("schedule_insert", **params)
            except Exception as exc:
                refusal = explain_refusal(exc, target)
                if refusal is None:
                    raise
                raise refusal from None
            if rows:
                return AddedSchedule(schedule_record(rows[0]), created=not existing)
            # Another writer inserted or removed that name since the lookup: look again.
        raise InvalidInput(
            f"schedule {name!r} kept changing under this request (added and removed by "
            "others at once): nothing was changed, try again"
        )

    async def remove(self, name: str) -> ScheduleRecord:
        rows = await self.tx.query("schedule_remove", name=name)
        if rows:
            return schedule_record(rows[0])
        current = await self.get(name)
        if current is None:
            raise NotFound(f"no schedule named {name!r} (see `scheduler-daemon tasks list`)")
        raise NotFound(
            f"no runtime schedule named {name!r}: {declared_task(name, current.source)}, "
            "so it is left as it is; remove it from the deployment (or list it in "
            f"plugin.disabled), or pause it (scheduler-daemon tasks pause {name})"
        )

    async def get(self, name: str) -> ScheduleRecord | None:
        rows = await self.tx.query("schedule_get", name=name)
        return schedule_record(rows[0]) if rows else None

    async def list_page(self, after: str | None, limit: int | None) -> list[ScheduleRecord]:
        """Schedules in name order after ``after`` (None: from the first), at most
        ``limit`` (None: all)."""
        rows = await self.tx.query("schedules_list", after=after, limit=limit)
        return [schedule_record(row) for row in rows]

    async def count(self) -> int:
        [row] = await self.tx.query("schedules_count")
        return int(row["n"])

    async def pause(self, name: str) -> bool:
        """Pause the schedule (runtime or declared) named so; False if there is none."""
        return bool(await self.tx.query("task_pause", name=name))

    async def resume(self, name: str) -> bool:
        """Resume it, its failures in a row forgotten; False if there is none."""
        return bool(await self.tx.query("task_resume", name=name))

    async def trigger(self, name: str) -> bool:
        """Ask for one run now, outside its schedule; False if there is none."""
        return bool(await self.tx.query("task_trigger", name=name))

    async def set_paused(self, name: str, paused: bool) -> ScheduleRecord:
        changed = await (self.pause(name) if paused else self.resume(name))
        current = await self.get(name) if changed else None
        if current is None:
            raise NotFound(f"no schedule named {name!r} (see `scheduler-daemon tasks list`)")
        return current
