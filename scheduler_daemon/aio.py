"""The two waiting patterns the daemon uses everywhere, written once.

Both own every task they create and leave none behind, whatever happens to the caller.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import TypeVar

T = TypeVar("T")


async def unless_set(work: Awaitable[T], *events: asyncio.Event) -> asyncio.Future[T]:
    """Await ``work`` unless one of ``events`` is set first; then cancel it and wait until
    the cancellation has landed (for asyncpg: the server was asked to cancel the query).

    Returns the finished future: ``.cancelled()`` says the events won; ``.result()`` gives
    the work's value or raises its own exception. If the caller is cancelled, the work is
    cancelled with it.
    """
    task = asyncio.ensure_future(work)
    waiters = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait({task, *waiters}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
        if not task.done():
            task.cancel()
        await asyncio.wait({task, *waiters})
    return task


async def wait_any(events: Iterable[asyncio.Event], seconds: float) -> bool:
    """Sleep up to ``seconds``; return True as soon as one of ``events`` is set."""
    waiters = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        done, _ = await asyncio.wait(
            waiters, timeout=max(seconds, 0.0), return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        for waiter in waiters:
            waiter.cancel()
        await asyncio.wait(waiters)
    return bool(done)
