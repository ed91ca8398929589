"""Database URLs: which backend a URL selects, the ones the driver would misread (refused),
and how one prints: never with its password."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qsl, unquote, urlsplit

from pydantic import GetCoreSchemaHandler
from pydantic_core import core_schema

from ..redact import redact

Backend = Literal["postgres", "sqlite"]

_POSTGRES_SCHEMES = {"postgres", "postgresql", "postgresql+asyncpg", "postgres+asyncpg"}


# scheme://authority/path?query#fragment, split the way urllib (and so asyncpg) splits it.
_URL_PARTS = re.compile(
    r"[^:/?#]+://(?P<authority>[^/?#]*)(?P<path>[^?#]*)(?:\?(?P<query>[^#]*))?(?P<fragment>#.*)?",
    re.S,
)


def _refuse_misread_userinfo(raw: str) -> None:
    """Refuse a URL that asyncpg (like libpq) would split elsewhere than its author meant.

    Both end the user info at the *first* ``@`` and the authority at the first ``/``,
    ``?`` or ``#``: a raw one of those in a password connects with part of it as the host,
    the port or a query parameter, and the driver's errors then quote that part where no
    redaction can recognise it (``invalid literal for int() with base 10: 'pa'``). The
    messages never show the URL's user info.
    """
    parts = _URL_PARTS.fullmatch(raw)
    if parts is None:
        return
    hosts = parts["authority"].rpartition("@")[2].split(",")
    ports = [host.rpartition("]")[2].partition(":")[2] for host in hosts]
    if parts["authority"].count("@") > 1:
        problem = "a raw '@' in the user name or password (two before the host)"
    elif "@" in parts["path"] or parts["fragment"] is not None:
        problem = "a raw '/' or '#' in the password (an '@' after the host, or a '#')"
    elif any(port and not port.isdigit() for port in ports):
        problem = "a raw '/', '?' or '#' in the password (a port that is not a number)"
    elif any("=" not in field for field in (parts["query"] or "").split("&") if field):
        problem = "a raw '?' in the password (a query parameter without '=')"
    else:
        return
    raise ValueError(
        f"{problem}, which ends the password early for libpq and asyncpg: percent-encode "
        "it (@ as %40, / as %2F, ? as %3F, # as %23)"
    )


def postgres_ports(url: str) -> list[str]:
    """The ports a PostgreSQL URL names, as written: one per host of the (multi-)host list
    (``postgresql://u@db1:5432,[::1]:5433/app``) and those of a ``port=`` parameter."""
    rest = url.split("://", 1)[-1]
    netloc = re.split(r"[/?#]", rest, maxsplit=1)[0]
    ports = []
    for host in netloc.rpartition("@")[2].split(","):
        host = host.rsplit("]", 1)[-1]  # past an IPv6 literal's own colons
        if ":" in host:
            ports.append(host.rsplit(":", 1)[1])
    query = rest[len(netloc) :].partition("?")[2].partition("#")[0]
    for key, value in parse_qsl(query, keep_blank_values=True):
        if key == "port":
            ports += value.split(",")
    return ports


def _refuse_ports_out_of_range(raw: str) -> None:
    """A port the driver cannot even try is a typo, not an unreachable database."""
    for port in postgres_ports(raw):
        # Not quoted unless a number: a misparsed URL could make it a password.
        if port and not port.isdigit():
            raise ValueError("a port is not a number (1-65535)")
        if port and (len(port) > 5 or not 1 <= int(port) <= 65535):
            shown = port if len(port) <= 6 else port[:6] + "…"
            raise ValueError(f"port {shown} is out of range (1-65535)")


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
            _refuse_misread_userinfo(raw)
            _refuse_ports_out_of_range(raw)
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
