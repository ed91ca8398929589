"""Why a configuration is refused, in one line naming the key or the variable (exit 78):
a config file that cannot be read or is not TOML, a ``SCHEDULER_*`` variable that names
no setting (:func:`setting_variables` lists those that do) or holds no JSON where JSON is
due, and pydantic's validation errors, with secret-bearing values never echoed.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from types import UnionType
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, SecretStr

from ..errors import ConfigError
from .settings import Settings
from .url import DatabaseUrl

CONFIG_FILE_ENV = "SCHEDULER_CONFIG"


def _printable(text: str) -> str:
    """``text`` as it is, or quoted with its escapes if it holds a newline, a control
    character or a surrogate: an error stays one readable line whatever it names."""
    return text if text.isprintable() else repr(text)


def _read_toml(path: Path) -> dict[str, Any]:
    shown = _printable(str(path))
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {shown}: not found") from None
    except OSError as exc:
        raise ConfigError(f"config file {shown}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {shown}: invalid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {shown}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at "
            f"offset {exc.start}); TOML files are UTF-8"
        ) from None
    except RecursionError:
        raise ConfigError(f"config file {shown}: invalid TOML: nested too deeply") from None


def _task_names(file_values: Mapping[str, Any]) -> list[Any]:
    """Task names by position, from the environment (which wins) or the file, so that an
    error in ``plugin.tasks.2`` can say which task it is."""
    raw = os.environ.get("SCHEDULER_PLUGIN__TASKS")
    plugin = file_values.get("plugin", {})
    try:
        # `plugin` may be anything but a table: the error being explained may be that.
        tasks = (
            json.loads(raw) if raw else plugin.get("tasks", []) if isinstance(plugin, dict) else []
        )
    except (json.JSONDecodeError, RecursionError):
        return []
    if not isinstance(tasks, list):
        return []
    return [task.get("name") if isinstance(task, dict) else None for task in tasks]


_SECRET_NAME = re.compile(r"(secret|password|url|token)$", re.I)


def _is_secret(loc: list[str], value: Any) -> bool:
    """Whether a failed value may carry a secret: by its field's name or type."""
    if isinstance(value, SecretStr | DatabaseUrl):
        return True
    if any(_SECRET_NAME.search(part) for part in loc):
        return True
    return _field_is_secret(loc)


def _types_in(annotation: Any) -> list[Any]:
    """``annotation`` and every type nested in it (``X | None``, ``list[X]``, …)."""
    found = [annotation]
    for arg in get_args(annotation):
        found += _types_in(arg)
    return found


def _field_is_secret(loc: list[str]) -> bool:
    """Follow ``loc`` through the settings models; true if it reaches a secret-typed field."""
    model: Any = Settings
    for part in loc:
        fields = getattr(model, "model_fields", {})
        if part not in fields:
            continue  # a list index or a union member tag: stay on the same model
        types = _types_in(fields[part].annotation)
        if any(t in (SecretStr, DatabaseUrl) for t in types):
            return True
        models = [t for t in types if isinstance(t, type) and issubclass(t, BaseModel)]
        model = models[0] if models else None
    return False


def _describe(error: Mapping[str, Any], task_names: list[Any]) -> str:
    loc = [str(part) for part in error["loc"]]
    parts = [_printable(part) for part in loc]
    if parts[:2] == ["plugin", "tasks"] and len(parts) > 2 and parts[2].isdigit():
        index = int(parts[2])
        if index < len(task_names) and task_names[index]:
            parts[2] = f"[{task_names[index]}]"
    location = ".".join(parts).replace(".[", "[") or "config"
    message = str(error["msg"]).removeprefix("Value error, ")
    if not parts:  # a rule across sections: its message names the keys itself
        return message
    if error["type"] == "extra_forbidden":
        return f"{location}: unknown key"
    value = error.get("input")
    if _is_secret(loc, value) or isinstance(value, dict | list):
        # A URL, token or password must not reach a terminal or a log; a whole section or
        # list is noise. Never echo either.
        return f"{location}: {message}"
    if repr(value) in message:
        return f"{location}: {message}"  # the validator quoted it already: once is enough
    return f"{location}: {message} (got {value!r})"


ENV_PREFIX = "SCHEDULER_"
# SCHEDULER_* variables that are not settings but are read by name: the config file's
# path, the test suite's sample plugin switch; and whole families used by the test rig and
# the benchmarks (SCHEDULER_TEST_DATABASE_URL, SCHEDULER_BENCH_DATABASE_URL, …).
OTHER_ENV = frozenset({CONFIG_FILE_ENV, "SCHEDULER_SAMPLE_PLUGIN"})
OTHER_ENV_PREFIXES = ("SCHEDULER_TEST_", "SCHEDULER_BENCH_")


def _alternatives(annotation: Any) -> tuple[Any, ...]:
    """``X | None`` -> ``(X, None)``; anything else -> ``(annotation,)``."""
    if get_origin(annotation) in (Union, UnionType):
        return get_args(annotation)
    return (annotation,)


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    """The section a field holds (``X`` or ``X | None``), whose keys are variables too."""
    for candidate in _alternatives(annotation):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _is_list(annotation: Any) -> bool:
    return any(get_origin(t) in (list, tuple, set, frozenset) for t in _alternatives(annotation))


def _is_json(annotation: Any) -> bool:
    """Whether pydantic-settings reads this field's variable as JSON (a section, a list)."""
    return any(
        get_origin(t) in (list, tuple, set, frozenset, dict)
        or (isinstance(t, type) and issubclass(t, BaseModel | list | tuple | set | dict))
        for t in _types_in(annotation)
    )


def setting_variables(
    model: type[BaseModel] = Settings, prefix: str = ENV_PREFIX
) -> dict[str, tuple[str, Any]]:
    """Every variable that sets something, at every depth, mapped to its dotted key and
    type: ``SCHEDULER_PUBLISH`` (the section, as JSON), ``SCHEDULER_PUBLISH__INTERVAL``, …"""
    found: dict[str, tuple[str, Any]] = {}
    dotted = prefix.removeprefix(ENV_PREFIX).replace("__", ".").lower()
    for name, field in model.model_fields.items():
        variable = f"{prefix}{name.upper()}"
        found[variable] = (f"{dotted}{name}", field.annotation)
        section = _nested_model(field.annotation)
        if section is not None:
            found.update(setting_variables(section, f"{variable}__"))
    return found


def check_environment(environ: Mapping[str, str]) -> None:
    """Refuse a ``SCHEDULER_*`` variable that names no setting (``SCHEDULER_DATABASE_ULR``
    would otherwise leave the default in place, silently), suggesting the closest name;
    and one that must hold JSON and does not, naming the variable."""
    known = setting_variables()
    for variable in sorted(environ):
        name = variable.upper()  # pydantic-settings reads them case-insensitively
        shown = _printable(variable)
        if not name.startswith(ENV_PREFIX) or name in OTHER_ENV:
            continue
        if name.startswith(OTHER_ENV_PREFIXES):
            continue
        if name not in known:
            close = difflib.get_close_matches(name, [*known, *OTHER_ENV], n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(
                f"invalid config: {shown}: unknown variable, not a setting{hint} "
                "(every setting is listed in config.example.toml)"
            )
        key, annotation = known[name]
        if _is_json(annotation):
            try:
                json.loads(environ[variable])
            except RecursionError:
                raise ConfigError(
                    f"invalid config: {shown}: JSON nested too deeply for {key}"
                ) from None
            except ValueError as exc:
                shape = (
                    'a JSON list, e.g. \'["a", "b"]\''
                    if _is_list(annotation)
                    else 'a JSON object, e.g. \'{"key": "value"}\''
                )
                where = getattr(exc, "msg", str(exc))
                raise ConfigError(
                    f"invalid config: {shown}: not valid JSON ({where}); {key} takes {shape}"
                ) from None
