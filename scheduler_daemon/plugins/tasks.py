"""Task declarations: from config, from installed plugins, and the built-ins; one model.

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
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from ..config import PluginTaskSettings, Settings
from ..errors import ConfigError
from .schedule import Cron, Every, Misfire, Schedule, check_timezone

if TYPE_CHECKING:
    from .context import TaskContext

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
    source: str  # "config", "plugin:<entry point>", "builtin"
    enabled: bool = True

    @property
    def is_async(self) -> bool:
        return self.target is not None and inspect.iscoroutinefunction(self.target)

    @property
    def wants_context(self) -> bool:
        if self.target is None:
            return False
        try:
            return bool(inspect.signature(self.target).parameters)
        except (TypeError, ValueError):
            return True

    async def call(
        self, ctx: TaskContext, on_thread: Callable[[threading.Thread], None] | None = None
    ) -> None:
        """Run a Python target: coroutine functions on the loop, others in a thread (handed
        to ``on_thread``: the caller must know it may outlive the awaiting task)."""
        assert self.target is not None
        args = (ctx,) if self.wants_context else ()
        if self.is_async:
            await self.target(*args)
            return
        result = await run_in_daemon_thread(
            self.target, args, name=f"task:{self.name}", on_thread=on_thread
        )
        if inspect.isawaitable(result):  # a plain function that returned a coroutine
            await result


async def run_in_daemon_thread(
    function: Callable[..., Any],
    args: tuple[Any, ...],
    name: str,
    on_thread: Callable[[threading.Thread], None] | None = None,
) -> Any:
    """Like ``asyncio.to_thread``, but on a daemon thread of its own.

    A sync target cannot be cancelled. In the default executor one that never returns
    would keep the process alive after shutdown (``asyncio.run`` joins the executor's
    threads); a daemon thread is simply abandoned when the daemon exits, and a timed-out
    run does not hold an executor slot for ever.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(error: BaseException | None, result: Any) -> None:
        if future.done():  # the awaiting task was cancelled meanwhile
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        try:
            result = function(*args)
        except BaseException as exc:
            loop.call_soon_threadsafe(settle, exc, None)
        else:
            loop.call_soon_threadsafe(settle, None, result)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    if on_thread is not None:
        on_thread(thread)
    return await future


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


def build_spec(declaration: PluginTaskSettings, source: str, target: Target | None) -> TaskSpec:
    schedule: Schedule
    if declaration.every is not None:
        check_timezone(declaration.timezone)  # unused by intervals, but a typo all the same
        schedule = Every(declaration.every)
    else:
        assert declaration.cron is not None
        schedule = Cron(declaration.cron, declaration.timezone)
    if target is None and declaration.target is not None:
        target = import_target(declaration.target)
    return TaskSpec(
        name=declaration.name,
        schedule=schedule,
        timeout=declaration.timeout,
        misfire=declaration.misfire,
        target=target,
        sql=declaration.sql,
        source=source,
        enabled=declaration.enabled,
    )


def _from_mapping(raw: Mapping[str, Any], source: str) -> TaskSpec:
    data = dict(raw)
    target = data.get("target")
    callable_target = target if callable(target) else None
    if callable_target is not None:
        data["target"] = (
            f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', '?')}"
        )
    declaration = PluginTaskSettings.model_validate(data)
    return build_spec(declaration, source, callable_target)


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
