"""SQL kept in files: numbered migrations, and named queries in one file per backend.

A queries file is a list of blocks, each introduced by a line ``-- name: <query_name>``;
the block's text up to the next such line is the statement (or, where a block says so,
the statements). Parameters are the driver's (``$1``, ``?``) or named (``:name``, see
:func:`positional`); a statement that takes no bind parameters (``SET``, ``PRAGMA``) has
``{name}`` placeholders instead, which :func:`formatted` fills with integers (and names
of the daemon's own) only.

The rule: transaction control statements are spelled by the driver code (``BEGIN``,
``COMMIT``, ``ROLLBACK``, ``SAVEPOINT`` and ``RELEASE`` of a savepoint: asyncpg's
``transaction()``, the SQLite store's own); every statement that reads or writes data,
or takes a lock, is a named block, and so is every setting a session or transaction
makes for itself. Python holds no other SQL text, but for text it shows an operator and
never runs (a ``GRANT`` to run, in an error message). A test scans the package's string
literals for SQL and keeps it so (tests/test_store.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from importlib.resources import files

from ..config.url import Backend

_NAME_LINE = re.compile(r"^--\s*name:\s*(\w+)\s*$", re.M)
# A named parameter, ``:name``; not a cast (``::jsonb``) nor a time inside a literal.
_NAMED_PARAMETER = re.compile(r"(?<![:\w]):([a-z_][a-z0-9_]*)")
_MIGRATION_FILE = re.compile(r"^(\d{4})_(\w+)\.sql$")
# A value written into a statement's text, ``{name}`` (see :func:`formatted`).
_PLACEHOLDER = re.compile(r"\{([a-z_][a-z0-9_]*)\}")
_SAFE_NAME = re.compile(r"[a-z][a-z0-9_/]*")


# A PostgreSQL migration whose file holds this line runs outside a transaction, one
# statement at a time: for CREATE INDEX CONCURRENTLY, which writers of a big table do not
# wait for (a plain CREATE INDEX holds them up for as long as it reads the table). Its
# statements must each be safe to run again (IF NOT EXISTS, or a DROP first): a migrate
# cut short repeats them. Only what the release before runs beside (an index).
OUTSIDE_A_TRANSACTION = "-- migrate: outside a transaction"


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def transactional(self) -> bool:
        return OUTSIDE_A_TRANSACTION not in (line.strip() for line in self.sql.splitlines())

    @property
    def statements(self) -> list[str]:
        """A migration outside a transaction, statement by statement: each ends a line with
        ``;`` (no dollar-quoted bodies in such a file); comment lines are dropped."""
        statements, current = [], []
        for line in self.sql.splitlines():
            if line.lstrip().startswith("--") or not line.strip():
                continue
            current.append(line)
            if line.rstrip().endswith(";"):
                statements.append("\n".join(current))
                current = []
        if current:
            raise ValueError(
                f"migration {self.version:04d}_{self.name}: no ';' after {current[-1]!r}"
            )
        return statements


@cache
def queries(backend: Backend) -> dict[str, str]:
    text = files("scheduler_daemon.db").joinpath(f"{backend}.sql").read_text("utf-8")
    parts = _NAME_LINE.split(text)
    # parts = [preamble, name1, body1, name2, body2, ...]
    named = {name: _statement(body) for name, body in zip(parts[1::2], parts[2::2], strict=True)}
    if len(named) != len(parts[1::2]):
        raise RuntimeError(f"{backend}.sql defines a query name twice")
    return named


# Comment lines at a block's end introduce the next section of the file, not this query.
_TRAILING_COMMENTS = re.compile(r"(\n[ \t]*(--[^\n]*)?)+\Z")


def _statement(body: str) -> str:
    return _TRAILING_COMMENTS.sub("", body.strip())


@cache
def positional(backend: Backend, query: str) -> tuple[str, tuple[str, ...]]:
    """A query written with named parameters (``:name``) as the driver's positional text
    (``$1``…), and the parameter names in position order (a name used twice is one
    position). For asyncpg, which knows positions only."""
    order: list[str] = []

    def number(match: re.Match[str]) -> str:
        name = match[1]
        if name not in order:
            order.append(name)
        return f"${order.index(name) + 1}"

    text = _NAMED_PARAMETER.sub(number, queries(backend)[query])
    return text, tuple(order)


def formatted(text: str, **values: int | str | tuple[int, ...]) -> str:
    """A named block's text with each ``{name}`` placeholder replaced by ``values[name]``.

    For the statements that take no bind parameters (``SET``, ``PRAGMA``, and what is sent
    with them in one round trip), whose values must be part of the text. Integers (not
    bools), or a name of the daemon's own (a loop's fencing row, ``plugin/7``) written as a
    quoted literal: lowercase letters, digits, ``_`` and ``/`` only; or a tuple of integers,
    as an array literal (``'{1,2}'``): so nothing written here can be read as SQL. Every
    placeholder must be given a value, and every value must have a placeholder."""
    for name, value in values.items():
        if type(value) is tuple:
            if not all(type(each) is int for each in value):
                raise TypeError(f"{{{name}}} takes a tuple of ints only")
        elif type(value) is str:
            if not _SAFE_NAME.fullmatch(value):
                raise ValueError(f"{{{name}}} takes a name of [a-z0-9_/], not {value!r}")
        elif type(value) is not int:
            raise TypeError(f"{{{name}}} takes an int or a name, not {type(value).__name__}")
    used = set(_PLACEHOLDER.findall(text))
    if used != set(values):
        raise ValueError(f"placeholders {sorted(used)}, values given for {sorted(values)}")

    def literal(value: int | str | tuple[int, ...]) -> str:
        if isinstance(value, tuple):
            return "'{" + ",".join(map(str, value)) + "}'"
        return f"'{value}'" if isinstance(value, str) else str(value)

    return _PLACEHOLDER.sub(lambda match: literal(values[match[1]]), text)


@cache
def migrations(backend: Backend) -> tuple[Migration, ...]:
    folder = files("scheduler_daemon.migrations").joinpath(backend)
    found = []
    for entry in folder.iterdir():
        match = _MIGRATION_FILE.match(entry.name)
        if match:
            found.append(Migration(int(match[1]), match[2], entry.read_text("utf-8")))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if versions != list(range(1, len(found) + 1)):
        raise RuntimeError(f"{backend} migrations are not numbered 1..n: {versions}")
    return tuple(found)
