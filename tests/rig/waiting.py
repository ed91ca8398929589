"""Bounded waits for a condition on real processes and databases.

A wait is over at the condition's first *truthy* value: an empty list of log lines is
"not yet", as None or False are. On timeout it fails with what it waited for and the last
value it saw; the test's scene (rig/scene.py) adds the state of its processes and
databases to the report.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

# How much of the last value a timeout shows.
LAST_CHARS = 2000


def wait_until(
    condition: Callable[[], T],
    timeout: float = 30.0,
    what: str = "a condition",
    every: float = 0.02,
    not_yet: tuple[type[BaseException], ...] = (),
) -> T:
    """The first truthy value of ``condition()``, asked every `every` seconds; fails the
    test with `what` and the last value after `timeout` seconds. An exception of a type
    in `not_yet` counts as a falsy value (a container still starting, say)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value: Any = condition()
        except not_yet as exc:
            value = exc
        else:
            if value:
                return value  # type: ignore[no-any-return]
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout:g}s: {what} (last: {last(value)})")
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
            raise AssertionError(f"not within {within:g}s: {what} (last: {last(value)})")
        await asyncio.sleep(every)


def last(value: object) -> str:
    text = repr(value)
    return text if len(text) <= LAST_CHARS else f"{text[:LAST_CHARS]}... ({len(text)} chars)"
