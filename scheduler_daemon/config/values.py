"""What a setting's value can be: durations, advisory-lock keys, text without NUL; and
:class:`Section`, the base of every config section, which refuses unknown keys.

The building blocks the sections (``settings.py``, ``timing.py``) are made of; nothing
here knows about a particular setting.
"""

from __future__ import annotations

import hashlib
import re
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def parse_duration(value: Any) -> Any:
    """Accept ``5``, ``2.5``, ``"5s"``, ``"250ms"``, ``"2m"``, ``"1h"``; return seconds.

    Anything else is passed through for pydantic to reject with its usual message.
    """
    if isinstance(value, bool):
        return value  # bool is an int: let the float validator refuse it
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        match = _DURATION_RE.match(value)
        if match is None:
            raise ValueError(f"not a duration: {value!r} (use e.g. 5, '5s', '250ms', '2m')")
        number, unit = match.groups()
        return float(number) * _DURATION_UNITS[unit]
    return value


# The longest any duration may be: 100 years. Durations become datetimes (a task's next
# slot), asyncio timers and PostgreSQL intervals, none of which takes infinity, and a slot
# computed past the year 9999 does not exist in Python.
MAX_DURATION = 100 * 365 * 86400.0

# Seconds, as a float. Positive: zero-length intervals and timeouts are always a mistake.
Duration = Annotated[
    float, BeforeValidator(parse_duration), Field(gt=0, le=MAX_DURATION, allow_inf_nan=False)
]

# The same, where 0 means "none" (a task's jitter): `jitter = "0s"` is no mistake.
NonNegativeDuration = Annotated[
    float, BeforeValidator(parse_duration), Field(ge=0, le=MAX_DURATION, allow_inf_nan=False)
]


def refuse_nul(value: Any) -> Any:
    """Refuse text holding U+0000 (TOML's ``\\u0000``): no PostgreSQL text, file name, host
    name, URL or environment variable can hold it, so it would fail later, far from here."""
    texts = value if isinstance(value, list | tuple) else [value]
    if any(isinstance(text, str) and "\x00" in text for text in texts):
        raise ValueError("contains a NUL character (\\x00), which no setting can hold")
    return value


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def lock_key_from_name(name: str) -> int:
    """The stable 64-bit signed lock key for a name: the first 8 bytes of its SHA-256.

    Stable across Python versions, processes and machines (unlike ``hash()``), so replicas
    configured with the same name always contend for the same key.
    """
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)


def parse_lock_key(value: Any) -> Any:
    """An advisory-lock key: an integer, a hex string (``0x…``), or a name to hash.

    Unsigned 64-bit values are folded into PostgreSQL's signed ``bigint`` range
    (two's complement), so ``0xffffffffffffffff`` is ``-1``.
    """
    if isinstance(value, bool):
        raise ValueError("a lock key cannot be a boolean")
    if isinstance(value, str):
        text = value.strip()
        if re.fullmatch(r"[+-]?\d+", text):
            value = int(text)
        elif re.fullmatch(r"0[xX][0-9a-fA-F]+", text):
            value = int(text, 16)
        elif text:
            return lock_key_from_name(text)
        else:
            raise ValueError("a lock key cannot be empty")
    if isinstance(value, int):
        if _INT64_MAX < value < 2**64:
            value -= 2**64
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise ValueError(f"lock key {value} does not fit in 64 bits")
        return value
    return value


LockKey = Annotated[int, BeforeValidator(parse_lock_key)]

DEFAULT_PUBLISH_KEY = 0x9A37B7A1
DEFAULT_PLUGIN_KEY = 0x7B9C5F3E


class Section(BaseModel):
    """Config sections refuse unknown keys so a typo is an error, not a silent default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_nul(cls, value: Any) -> Any:
        return refuse_nul(value)


class LockKeys(Section):
    publish: LockKey = DEFAULT_PUBLISH_KEY
    plugin: LockKey = DEFAULT_PLUGIN_KEY

    @model_validator(mode="after")
    def _distinct(self) -> LockKeys:
        # Compared after parsing: "0x10" and 16 are one key, and so is one name twice.
        if self.publish == self.plugin:
            raise ValueError(
                f"publish and plugin are the same key ({self.publish}): the loops would "
                "share one lock and only one of them could ever lead; give each its own"
            )
        return self
