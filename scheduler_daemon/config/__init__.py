"""Configuration: defaults < TOML file < environment (``SCHEDULER_*``, nested with ``__``).

:func:`load_settings` builds the effective :class:`~.settings.Settings` or raises
:class:`ConfigError` with one line. The package, bottom up: ``values`` (durations, lock
keys, the :class:`~.values.Section` base), ``timing`` (the lock section and the failover
timing rules), ``settings`` (every section and :class:`~.settings.Settings`), ``explain``
(a refusal as one line naming the key or the variable).
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import ValidationError
from pydantic_settings import SettingsError

from ..errors import ConfigError
from .explain import CONFIG_FILE_ENV, _describe, _read_toml, _task_names, check_environment
from .settings import Settings


def load_settings(config_file: str | Path | None = None) -> Settings:
    """Build the effective settings; raise :class:`ConfigError` with one line naming the key
    (or the variable)."""
    check_environment(os.environ)
    path = config_file or os.environ.get(CONFIG_FILE_ENV) or None
    file_values = _read_toml(Path(path)) if path else {}
    try:
        return Settings(**file_values)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        first = _describe(errors[0], _task_names(file_values))
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise ConfigError(f"invalid config: {first}{more}") from None
    except SettingsError as exc:
        # e.g. SCHEDULER_PUBLISH__PUBLISHERS that is not JSON; the message names the field.
        raise ConfigError(f"invalid config: {exc}") from None
