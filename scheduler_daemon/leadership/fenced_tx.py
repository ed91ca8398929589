"""The transactions a session leader's fence hands out (leadership/session_lease.py): a
fenced transaction of its own on a pooled connection (``PooledTx``), and statements that
each fence themselves outside one (``SelfFencedTx``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import asyncpg

from ..db.base import ShardScope
from ..db.postgres import PgTx
from ..db.sqlfiles import formatted, queries

QUERIES = queries("postgres")

# scheduler_fence's answers (migrations 0015, 0016).
SUPERSEDED = "SDF01"
SCHEMA_NEWER = "SDF02"


class SqlEndedFence(RuntimeError):
    """A task's SQL ended its fenced transaction (a COMMIT of its own): what it ran up to
    there was fenced, what ran after was not. Its run fails, saying so."""

    def __init__(self) -> None:
        super().__init__(
            "SQL in a fenced transaction ended it (COMMIT or ROLLBACK): statements after "
            "that ran unfenced; a task's SQL must not end its transaction"
        )


# What a self-fenced statement may be without a fence of its own: reads.
UNFENCED_READS = frozenset({"now"})


class SelfFencedTx(PgTx):
    """Statements outside a transaction, each its own: only those that fence themselves
    (``fence_*`` parameters) may write (see :meth:`TokenFence.statements`)."""

    async def query(self, query: str, **params: Any) -> list[dict[str, Any]]:
        if query not in UNFENCED_READS and ":fence_loop" not in QUERIES[query]:
            raise RuntimeError(f"{query} does not fence itself: run it in lease.transaction()")
        return await super().query(query, **params)

    async def fetch(self, query: str, *args: Any) -> list[dict[str, Any]]:
        raise RuntimeError("only self-fenced named queries run outside a transaction")

    async def execute(self, sql: str, statement_timeout: float | None = None) -> None:
        raise RuntimeError("only self-fenced named queries run outside a transaction")

    async def run(self, sql: str, *args: Any) -> None:
        raise RuntimeError("only self-fenced named queries run outside a transaction")

    async def run_many(self, sql: str, args: Sequence[Sequence[Any]]) -> None:
        raise RuntimeError("only self-fenced named queries run outside a transaction")

    @asynccontextmanager
    async def savepoint(self) -> AsyncIterator[None]:
        raise RuntimeError("no savepoint outside a transaction")
        yield  # a generator, as the method it replaces


class PooledTx(PgTx):
    """A fenced transaction of its own on a pooled connection: nothing else runs in it, so
    a statement's own timeout is set for the transaction and sent with the statement, in
    one round trip, and put back after it in the same message.

    ``prelude``: BEGIN, the settings and the fence, not sent yet: they go with the first
    statement, in the same message (a ``sql`` task is then two round trips: that, and the
    COMMIT). Within one message PostgreSQL runs nothing after a statement that fails, so
    SQL sent after a fence that refuses never runs; ``refused`` says what the fence's
    error means (a loss, a newer schema). A prelude is sent on its own before a statement
    with parameters, which cannot share a message."""

    def __init__(
        self,
        conn: asyncpg.Connection,
        token: int | None,
        statement_lock: asyncio.Lock,
        shards: ShardScope | None,
        prelude: str | None = None,
        refused: Callable[[asyncpg.PostgresError], None] = lambda exc: None,
    ):
        super().__init__(conn, token, statement_lock, shards)
        self._savepoints = 0
        self.prelude = prelude
        self._refused = refused

    def _statement(self) -> asyncio.Lock:
        assert self.statement_lock is not None
        return self.statement_lock

    async def _send(self, text: str | None, limit: float | None = None) -> None:
        """``text``, after the prelude if it is still to be sent, in one message (None:
        the prelude alone)."""
        prelude, self.prelude = self.prelude, None
        if prelude is None:
            if text is not None:
                await self.conn.execute(text, timeout=limit)
            return
        message = prelude if text is None else ";\n".join((prelude, text))
        try:
            await self.conn.execute(message, timeout=limit)
        except asyncpg.PostgresError as exc:
            if exc.sqlstate in (SUPERSEDED, SCHEMA_NEWER):
                # Rolled back before the loss is said: saying it cancels the work that
                # waits here, which would leave the transaction open for the pool's reset.
                with contextlib.suppress(Exception):
                    await self.conn.execute("ROLLBACK")
                self._refused(exc)
            raise

    async def _begun(self) -> None:
        if self.prelude is not None:
            async with self._statement():
                await self._send(None)

    async def _execute(self, sql: str, statement_timeout: float | None) -> None:
        if statement_timeout is None:
            await self._send(sql)
            return
        milliseconds = int(statement_timeout * 1000)
        text = ";\n".join(
            (
                formatted(QUERIES["statement_timeout_local"], milliseconds=milliseconds),
                sql,
                QUERIES["statement_timeout_reset"],
            )
        )
        # asyncpg's own limit too: the pool's command_timeout would cut it short.
        await self._send(text, limit=statement_timeout + 1.0)

    async def fetch(self, query: str, *args: Any) -> list[dict[str, Any]]:
        await self._begun()
        return await super().fetch(query, *args)

    async def query(self, query: str, **params: Any) -> list[dict[str, Any]]:
        await self._begun()
        return await super().query(query, **params)

    async def run(self, sql: str, *args: Any) -> None:
        await self._begun()
        await super().run(sql, *args)

    async def run_many(self, sql: str, args: Sequence[Sequence[Any]]) -> None:
        await self._begun()
        await super().run_many(sql, args)

    @asynccontextmanager
    async def savepoint(self) -> AsyncIterator[None]:
        # Spelled here: asyncpg's transaction() refuses to nest in a transaction it did not
        # begin (ours begins with the fence, in one round trip).
        self._savepoints += 1
        name = f"sp_{self._savepoints}"
        async with self._statement():
            await self._send(f"SAVEPOINT {name}")
        try:
            yield
        except BaseException:
            if not self.conn.is_closed():
                async with self._statement():
                    await self.conn.execute(f"ROLLBACK TO {name}")
            raise
        async with self._statement():
            await self.conn.execute(f"RELEASE {name}")
