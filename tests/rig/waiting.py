"""Bounded waits for a condition on real processes and databases."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    condition: Callable[[], T],
    timeout: float = 30.0,
    what: str = "a condition",
    every: float = 0.02,
) -> T:
    """The first truthy value of ``condition()``, asked every `every` seconds; fails the
    test with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout:g}s: {what}")
        time.sleep(every)


async def until(
    check: Callable[[], Awaitable[T]], what: str, within: float = 20.0, every: float = 0.1
) -> T:
    """Poll ``check`` until it returns something truthy; fail the test after ``within`` s."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        value = await check()
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"gave up after {within}s waiting for {what} (last: {value!r})")
        await asyncio.sleep(every)
