"""Database URLs: which backend a URL selects, and how to print one without its password."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

from pydantic import GetCoreSchemaHandler
from pydantic_core import core_schema

Backend = Literal["postgres", "sqlite"]

_POSTGRES_SCHEMES = {"postgres", "postgresql", "postgresql+asyncpg", "postgres+asyncpg"}

# user:password@ in any URL-looking text, and password=… in key/value DSNs and messages.
_URL_PASSWORD = re.compile(r"(?P<head>[a-zA-Z][\w+.-]*://[^:/@\s]*:)(?P<secret>[^@\s]*)(?=@)")
_KV_PASSWORD = re.compile(
    r"(?P<head>\bpassword\s*=\s*)(?P<secret>'[^']*'|\"[^\"]*\"|[^\s&]+)", re.I
)
REDACTED = "***"


def redact(text: str) -> str:
    """Remove passwords from any text that may contain a DSN (log lines, error messages)."""
    text = _URL_PASSWORD.sub(lambda m: m["head"] + REDACTED, text)
    return _KV_PASSWORD.sub(lambda m: m["head"] + REDACTED, text)


class DatabaseUrl:
    """A validated database URL whose ``str``/``repr`` never shows the password.

    The raw value is only reachable through :meth:`secret`, so it cannot end up in a log
    line or an error message by accident.
    """

    # Deliberately not a dataclass: pydantic-settings would then expect JSON in the env var.
    __slots__ = ("_raw", "backend")

    def __init__(self, raw: str, backend: Backend) -> None:
        self._raw = raw
        self.backend: Backend = backend

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DatabaseUrl) and other._raw == self._raw

    def __hash__(self) -> int:
        return hash(self._raw)

    @classmethod
    def parse(cls, raw: str) -> DatabaseUrl:
        scheme = raw.split("://", 1)[0].lower() if "://" in raw else ""
        if scheme in _POSTGRES_SCHEMES:
            return cls(raw, "postgres")
        if scheme == "sqlite":
            url = cls(raw, "sqlite")
            if url.sqlite_path is None:
                raise ValueError(
                    "sqlite in-memory databases cannot be shared between connections or "
                    "replicas; give a file path, e.g. sqlite:///./scheduler.db"
                )
            return url
        shown = redact(raw) if scheme else "(no scheme)"
        raise ValueError(f"unsupported database URL {shown}: use postgresql://… or sqlite:///path")

    def secret(self) -> str:
        return self._raw

    @property
    def redacted(self) -> str:
        return redact(self._raw)

    @property
    def postgres_dsn(self) -> str:
        """The DSN for asyncpg, which only knows the plain ``postgresql`` scheme."""
        _, rest = self._raw.split("://", 1)
        return "postgresql://" + rest

    @property
    def sqlite_path(self) -> Path | None:
        """``sqlite:///rel/path`` is relative, ``sqlite:////abs/path`` absolute."""
        parts = urlsplit(self._raw)
        path = unquote(parts.netloc + parts.path)
        if path.startswith("/"):
            path = path[1:]
        if path in ("", ":memory:") or "mode=memory" in parts.query:
            return None
        return Path(path)

    def __str__(self) -> str:
        return self.redacted

    def __repr__(self) -> str:
        return f"DatabaseUrl({self.redacted!r})"

    @classmethod
    def __get_pydantic_core_schema__(
        cls, source: type[Any], handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        def validate(value: Any) -> DatabaseUrl:
            if isinstance(value, DatabaseUrl):
                return value
            if not isinstance(value, str):
                raise ValueError("must be a URL string")
            return cls.parse(value.strip())

        return core_schema.no_info_plain_validator_function(
            validate,
            serialization=core_schema.plain_serializer_function_ser_schema(
                lambda url: url.redacted
            ),
        )
