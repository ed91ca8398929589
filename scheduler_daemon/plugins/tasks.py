"""What a task is and when it runs: its declaration (from config, from installed plugins,
the built-ins, or a runtime schedule's row), one model (:class:`TaskSpec`), and its
schedule (when its slots fall, and what runs after a misfire). One module because a task
is its schedule as much as its target: each declaration is checked by building both, and
the plugin loop plans each slot on the schedule the spec holds.

A plugin is a distribution that declares an entry point in the group
``scheduler_daemon.plugins``; the entry point is a callable returning task declarations,
each a mapping with the same keys as a ``[[plugin.tasks]]`` table, where ``target`` may
also be the callable itself::

    [project.entry-points."scheduler_daemon.plugins"]
    my_plugin = "my_plugin:tasks"

    def tasks():
        return [{"name": "my-plugin.refresh", "every": "5m", "target": refresh}]

Everything is validated before the daemon starts: a bad declaration is a config error
(exit 78) that names the task.

Schedules: fixed intervals (:class:`Every`), or cron expressions in an IANA timezone
(:class:`Cron`), either one spread by a jitter (:class:`Jittered`). Slots are instants
(aware UTC datetimes). :func:`plan` turns "the slot the database says is next" and "the
database's now" into what to run and what comes after, applying the misfire policy: after
downtime, at most one catch-up run, never a burst.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterBadDateError, croniter
from pydantic import ValidationError

from ..config.settings import PluginTaskSettings, Settings
from ..config.values import MAX_DURATION
from ..errors import ConfigError
from .workers import check_picklable

if TYPE_CHECKING:
    from ..db.plugin_store import RuntimeDefinition
    from .context import TaskContext

# -- when a task runs: its schedule ------------------------------------------------------

Misfire = Literal["run_once", "skip"]


def check_timezone(name: str) -> None:
    """Raise ValueError unless ``name`` is an IANA timezone this system knows."""
    try:
        ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"unknown timezone {name!r}") from None


@dataclass(frozen=True, slots=True)
class Every:
    seconds: float

    def first(self, now: datetime) -> datetime:
        return now  # a new interval task runs at once, then every `seconds`

    @property
    def step(self) -> timedelta:
        # Slots are whole steps of microseconds (timedelta's resolution) from the first:
        # exact integer arithmetic, so "strictly after now" never rounds onto now.
        return max(timedelta(seconds=self.seconds), timedelta(microseconds=1))

    def next_after(self, slot: datetime) -> datetime:
        return slot + self.step

    def first_after(self, slot: datetime, now: datetime) -> datetime:
        """The first slot strictly after ``now``, keeping the phase of ``slot``."""
        periods = (now - slot) // self.step + 1
        return slot + self.step * max(periods, 1)

    def describe(self) -> str:
        return f"every {self.seconds:g}s"


@dataclass(frozen=True, slots=True)
class Cron:
    expression: str
    timezone: str
    # Parsed once: every run computes its next slot from it (croniter parses anew per
    # instance, about 4 times the cost of the step itself).
    _iter: Any = field(init=False, repr=False, compare=False, hash=False)
    _tz: ZoneInfo = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        check_timezone(self.timezone)
        if not croniter.is_valid(self.expression):
            raise ValueError(f"invalid cron expression {self.expression!r}")
        object.__setattr__(self, "_tz", ZoneInfo(self.timezone))
        object.__setattr__(self, "_iter", croniter(self.expression, datetime.now(self._tz)))
        # A valid expression may name no date at all (30 February): every plugin tick would
        # fail computing its next slot, the other tasks' runs with it.
        try:
            self.next_after(datetime.now(UTC))
        except (CroniterBadDateError, OverflowError):
            raise ValueError(f"cron expression {self.expression!r} never matches a date") from None

    @property
    def _fixed_hours(self) -> bool:
        fields = self.expression.split()
        return len(fields) >= 2 and fields[1] != "*"

    def first(self, now: datetime) -> datetime:
        return self.next_after(now)

    def next_after(self, slot: datetime) -> datetime:
        tz = self._tz
        self._iter.set_current(slot.astimezone(tz), force=True)
        candidate: datetime = self._iter.get_next(datetime)
        # When clocks go back, an hour repeats. Like cron, a job pinned to an hour runs
        # once in it (the first time); a job on every hour runs at each real instant.
        while self._fixed_hours and _repeated_wall_time(candidate, tz):
            candidate = self._iter.get_next(datetime)
        return candidate.astimezone(UTC)

    def first_after(self, slot: datetime, now: datetime) -> datetime:
        return self.next_after(now)

    def describe(self) -> str:
        return f"cron {self.expression} {self.timezone}"


def _repeated_wall_time(local: datetime, tz: ZoneInfo) -> bool:
    """Whether ``local`` is the second occurrence of its wall time in ``tz`` (the hour
    that repeats when clocks go back)."""
    first = local.replace(tzinfo=None).replace(tzinfo=tz, fold=0)
    return first.astimezone(UTC) < local.astimezone(UTC)


def name_hash(name: str) -> int:
    """A schedule's name as a 64-bit number, the same in every process and release: what
    spreads schedules that are alike (their jitter, their history trims) over a range."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big")


def jitter_offset(name: str, jitter: float) -> timedelta:
    """A schedule's own offset in ``[0, jitter)``: from a hash of its name, so it is the
    same on every replica and across restarts, and thousands of schedules on one period
    spread over the jitter instead of all firing at one instant."""
    if jitter <= 0:
        return timedelta(0)
    fraction = name_hash(name) / 2**64
    return timedelta(microseconds=int(fraction * jitter * 1_000_000))


@dataclass(frozen=True, slots=True)
class Jittered:
    """``base``'s slots, each ``offset`` later (see :func:`jitter_offset`).

    A cron schedule's slots are its expression's instants plus the offset. An interval
    schedule's are put on a grid of their own: whole periods from the Unix epoch plus the
    offset. So schedules created at one instant (a bulk INSERT, whose rows all default to
    ``now()``) run together at most once, their first slot, and then each on its own phase,
    however their first slot was set."""

    base: Every | Cron
    offset: timedelta
    jitter: float  # the bound the offset was drawn within (part of the description)

    def first(self, now: datetime) -> datetime:
        if isinstance(self.base, Every):
            return self._on_grid(now, strictly_after=False)
        return self.next_after(now)

    def next_after(self, slot: datetime) -> datetime:
        if isinstance(self.base, Every):
            return self._on_grid(slot, strictly_after=True)
        return self.base.next_after(slot - self.offset) + self.offset

    def first_after(self, slot: datetime, now: datetime) -> datetime:
        if isinstance(self.base, Every):
            return self._on_grid(now, strictly_after=True)
        return self.base.first_after(slot - self.offset, now - self.offset) + self.offset

    def _on_grid(self, instant: datetime, strictly_after: bool) -> datetime:
        assert isinstance(self.base, Every)
        step = self.base.step
        origin = _EPOCH + self.offset % step
        periods, rest = divmod(instant - origin, step)
        if rest or strictly_after:
            periods += 1
        return origin + step * periods

    def describe(self) -> str:
        return f"{self.base.describe()} jitter {self.jitter:g}s"


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def with_jitter(base: Every | Cron, name: str, jitter: float) -> Schedule:
    if jitter <= 0:
        return base
    return Jittered(base, jitter_offset(name, jitter), jitter)


Schedule = Every | Cron | Jittered


@dataclass(frozen=True, slots=True)
class Plan:
    run: bool  # claim and run ``slot`` now
    next_run_at: datetime
    missed: bool  # at least one whole period passed without a run


def plan(schedule: Schedule, slot: datetime, now: datetime, misfire: Misfire) -> Plan:
    following = schedule.next_after(slot)
    if following > now:
        return Plan(run=True, next_run_at=following, missed=False)
    return Plan(
        run=misfire == "run_once",
        next_run_at=schedule.first_after(slot, now),
        missed=True,
    )


# -- what a task is: its declaration and its spec ----------------------------------------

ENTRY_POINT_GROUP = "scheduler_daemon.plugins"
Target = Callable[..., Any]


@dataclass(frozen=True, slots=True)
class TaskSpec:
    name: str
    schedule: Schedule
    timeout: float
    misfire: Misfire
    target: Target | None
    sql: str | None
    source: str  # "config", "plugin:<entry point>", "builtin", "runtime"
    enabled: bool = True
    args: dict[str, Any] = field(default_factory=dict)
    # How the target is named ("pkg.mod:func"): what a runtime schedule names to run it.
    target_path: str | None = None

    # Looked at once, not per run (inspect.signature is a good part of a no-op run's cost).
    is_async: bool = field(init=False, repr=False, compare=False)
    wants_context: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        target = self.target
        object.__setattr__(
            self, "is_async", target is not None and inspect.iscoroutinefunction(target)
        )
        object.__setattr__(self, "wants_context", _wants_context(target))

    async def call(self, ctx: TaskContext) -> None:
        """Run an async target on the event loop (sync targets run in a worker process:
        see loops/plugin.py)."""
        assert self.target is not None
        assert self.is_async
        await self.target(*((ctx,) if self.wants_context else ()))


def _wants_context(target: Target | None) -> bool:
    if target is None:
        return False
    try:
        return bool(inspect.signature(target).parameters)
    except (TypeError, ValueError):
        return True


def import_target(path: str) -> Target:
    """``"package.module:function"`` (or ``:Class.method``) -> the callable."""
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"target {path!r} is not of the form 'package.module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"target {path!r}: cannot import {module_name!r}: {exc}") from None
    except Exception as exc:  # the module itself failed while being imported
        raise ValueError(
            f"target {path!r}: cannot import {module_name!r}: {type(exc).__name__}: {exc}"
        ) from None
    for part in attribute.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"target {path!r}: {module_name} has no {attribute!r}") from None
    if not callable(obj):
        raise ValueError(f"target {path!r} is not callable")
    return obj  # type: ignore[no-any-return]


def make_schedule(
    name: str, every: float | None, cron: str | None, timezone: str, jitter: float
) -> Schedule:
    """Raise ValueError for a schedule that cannot be followed."""
    if (every is None) == (cron is None):
        raise ValueError("give exactly one of 'every' and 'cron'")
    if every is not None:
        check_timezone(timezone)  # unused by intervals, but a typo all the same
        if every <= 0:
            raise ValueError(f"every must be positive, not {every:g}s")
        return with_jitter(Every(every), name, jitter)
    assert cron is not None
    return with_jitter(Cron(cron, timezone), name, jitter)


def check_runnable(target: Target) -> None:
    """Sync targets run in a worker process: they must be importable by name there."""
    if not inspect.iscoroutinefunction(target) and (problem := check_picklable(target)):
        raise ValueError(problem)


def build_spec(declaration: PluginTaskSettings, source: str, target: Target | None) -> TaskSpec:
    schedule = make_schedule(
        declaration.name,
        declaration.every,
        declaration.cron,
        declaration.timezone,
        declaration.jitter,
    )
    if target is None and declaration.target is not None:
        target = import_target(declaration.target)
    if target is not None:
        check_runnable(target)
    return TaskSpec(
        name=declaration.name,
        schedule=schedule,
        timeout=declaration.timeout,
        misfire=declaration.misfire,
        target=target,
        sql=declaration.sql,
        source=source,
        enabled=declaration.enabled,
        args=dict(declaration.args),
        target_path=declaration.target,
    )


def runnable_targets(settings: Settings, declared: Iterable[TaskSpec]) -> dict[str, Target]:
    """What runtime schedules may run, by the name they give it: the targets of the
    declared tasks and ``plugin.runnable``. Raises :class:`ConfigError` naming an entry of
    ``plugin.runnable`` that cannot be imported or run."""
    runnable = {
        spec.target_path: spec.target
        for spec in declared
        if spec.target is not None and spec.target_path is not None
    }
    for path in settings.plugin.runnable:
        try:
            target = import_target(path)
            check_runnable(target)
        except ValueError as exc:
            raise ConfigError(f"plugin.runnable: {exc}") from None
        runnable[path] = target
    return runnable


def runtime_spec(
    name: str, definition: RuntimeDefinition, runnable: Mapping[str, Target]
) -> TaskSpec:
    """The task a runtime schedule's row describes. ValueError, with the reason, when this
    replica cannot run it: a target it does not declare runnable, a schedule it cannot
    follow, arguments that are not a JSON object."""
    target = runnable.get(definition.target)
    if target is None:
        raise ValueError(
            f"target {definition.target!r} is not runnable on this replica (declare it in "
            "plugin.runnable or as a declared task's target)"
        )
    try:
        args = json.loads(definition.args_json)
    except (ValueError, RecursionError):
        raise ValueError("args are not JSON this replica can read") from None
    if not isinstance(args, dict):
        raise ValueError("args must be a JSON object")
    if definition.misfire not in ("run_once", "skip"):
        raise ValueError(f"misfire must be 'run_once' or 'skip', not {definition.misfire!r}")
    # What config's durations allow: a row written by plain SQL gets no other check.
    for column, value, low in (
        ("every_seconds", definition.every_seconds, 0.0),
        ("jitter_seconds", definition.jitter, -1.0),
        ("timeout_seconds", definition.timeout, 0.0),
    ):
        if value is not None and not (low < value <= MAX_DURATION and math.isfinite(value)):
            raise ValueError(f"{column} {value!r} is outside (0, {MAX_DURATION:g}]")
    schedule = make_schedule(
        name, definition.every_seconds, definition.cron, definition.timezone, definition.jitter
    )
    return TaskSpec(
        name=name,
        schedule=schedule,
        timeout=definition.timeout,
        misfire=definition.misfire,  # type: ignore[arg-type]  # checked above
        target=target,
        sql=None,
        source="runtime",
        args=args,
        target_path=definition.target,
    )


def _from_mapping(raw: Mapping[str, Any], source: str) -> TaskSpec:
    data = dict(raw)
    target = data.get("target")
    callable_target = target if callable(target) else None
    if callable_target is not None:
        data["target"] = target_name(callable_target)
    declaration = PluginTaskSettings.model_validate(data)
    return build_spec(declaration, source, callable_target)


def target_name(target: Target) -> str:
    """How a callable is named as a target: ``module:qualified.name``."""
    return f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', '?')}"


def _plugin_declarations() -> Iterable[tuple[str, Mapping[str, Any]]]:
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        source = f"plugin:{entry.name}"
        try:
            provider = entry.load()
            declared = provider() if callable(provider) else provider
            for item in declared:
                if isinstance(item, PluginTaskSettings):
                    item = item.model_dump(exclude_none=True)
                if not isinstance(item, Mapping):
                    raise ConfigError(
                        f"plugin {entry.name!r} ({entry.value}): a task declaration must be "
                        f"a mapping, not {type(item).__name__}"
                    )
                yield source, item
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(f"plugin {entry.name!r} ({entry.value}): {exc}") from None


def _first_error(exc: ValidationError) -> str:
    """The first problem with a declaration, naming its key (``every: not a duration``)."""
    error = exc.errors(include_url=False)[0]
    message = str(error["msg"]).removeprefix("Value error, ")
    key = ".".join(str(part) for part in error["loc"])
    if error["type"] == "extra_forbidden":
        return f"{key}: unknown key"
    return f"{key}: {message}" if key else message


def load_tasks(settings: Settings, builtins: Iterable[Mapping[str, Any]] = ()) -> list[TaskSpec]:
    """Every enabled task, validated. Raises :class:`ConfigError` naming the task."""
    specs: dict[str, TaskSpec] = {}
    disabled = set(settings.plugin.disabled)

    def add(name: str, source: str, make: Callable[..., TaskSpec], *args: Any) -> None:
        try:
            spec = make(*args)
        except (ValueError, ValidationError) as exc:
            message = _first_error(exc) if isinstance(exc, ValidationError) else str(exc)
            raise ConfigError(f"invalid task {name!r} ({source}): {message}") from None
        if spec.name in specs:
            raise ConfigError(
                f"invalid task {spec.name!r}: declared twice ({specs[spec.name].source} "
                f"and {source})"
            )
        specs[spec.name] = spec

    for declaration in settings.plugin.tasks:
        add(declaration.name, "config", build_spec, declaration, "config", None)
    for builtin in builtins:
        add(str(builtin.get("name")), "builtin", _from_mapping, builtin, "builtin")
    if settings.plugin.entry_points:
        for source, item in _plugin_declarations():
            add(str(item.get("name")), source, _from_mapping, item, source)
    return [spec for spec in specs.values() if spec.enabled and spec.name not in disabled]
