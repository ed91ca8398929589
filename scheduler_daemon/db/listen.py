"""One LISTEN connection per replica, shared by the loops it leads (PostgreSQL, session
lock mode).

A leader sleeps until its next planned tick when something will wake it sooner: a
NOTIFY sent by a trigger when a row is scheduled (publish) or a task is triggered or
resumed (plugin). That is only safe while the LISTEN is in place, so a loop asks
:attr:`Listener.listening` before it sleeps long, and sleeps no longer than its interval
otherwise. LISTEN needs a connection of its own (the pool's reset would run
``UNLISTEN *``); it sends nothing while idle, so it costs the database no transactions.

Through a transaction pooler (lock mode ``transaction``) LISTEN cannot work: the
notification arrives on whichever server session ran it. There is no listener then.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import asyncpg

from ..errors import describe
from ..logs import Logger
from .postgres import PostgresStore, detect_dead_peer

# After a failed LISTEN connection, how long before trying again; meanwhile the loops tick
# on their interval, which bounds lateness without notifications.
LISTEN_RETRY = 30.0

Callback = Callable[[str], None]


class _Subscription:
    """A channel's callback, in the shape asyncpg calls (and identifies) listeners by."""

    def __init__(self, channel: str, callback: Callback) -> None:
        self.channel = channel
        self.callback = callback

    def __call__(self, _conn: Any, _pid: int, _channel: str, payload: str) -> None:
        self.callback(payload)


class Listener:
    def __init__(self, store: PostgresStore, log: Logger) -> None:
        self.store = store
        self.log = log
        self._subscriptions: dict[str, _Subscription] = {}
        self._conn: asyncpg.Connection | None = None
        self._retry_at = 0.0

    @property
    def listening(self) -> bool:
        """Whether every subscribed channel is LISTENed to right now."""
        return self._conn is not None and not self._conn.is_closed()

    async def subscribe(self, channel: str, callback: Callback) -> None:
        """Call ``callback(payload)`` for each notification on ``channel``, and with ``""``
        whenever notifications may have been missed (the connection was reopened)."""
        await self.unsubscribe(channel)
        subscription = _Subscription(channel, callback)
        self._subscriptions[channel] = subscription
        if self._conn is not None and self.listening:
            try:
                await self._conn.add_listener(channel, subscription)
            except Exception as exc:
                self.log.warning("listen.failed", channel=channel, error=describe(exc))
                self.close()
        else:
            await self.ensure()

    async def unsubscribe(self, channel: str) -> None:
        subscription = self._subscriptions.pop(channel, None)
        if subscription is None or self._conn is None:
            return
        if not self._subscriptions:
            self.close()
            return
        try:
            await self._conn.remove_listener(channel, subscription)
        except Exception as exc:  # the connection is going anyway; ensure() reopens it
            self.log.debug("listen.unlisten_failed", channel=channel, error=describe(exc))
            self.close()

    async def ensure(self) -> None:
        """(Re)open the connection if it is gone and channels want it; at most every
        LISTEN_RETRY after a failure."""
        if self.listening or not self._subscriptions or time.monotonic() < self._retry_at:
            return
        self.close()
        conn = None
        try:
            conn = await self.store.connect_dedicated("listen")
            # A dead path must not leave us trusting a LISTEN that hears nothing.
            detect_dead_peer(conn, self.store.settings.lock.step_down_after)
            for channel, subscription in self._subscriptions.items():
                await conn.add_listener(channel, subscription)
        except Exception as exc:
            if conn is not None:
                conn.terminate()
            self._retry_at = time.monotonic() + LISTEN_RETRY
            self.log.warning("listen.failed", error=describe(exc))
            return
        self._conn = conn
        conn.add_termination_listener(self._lost)
        self._wake_all()  # whatever was sent while nobody listened is lost: look again

    def _lost(self, conn: Any) -> None:
        # A loop sleeping long because it trusted the LISTEN must look now, and from now
        # on tick on its interval until ensure() reopens it.
        if conn is self._conn:
            self._conn = None
            self._wake_all()

    def _wake_all(self) -> None:
        for subscription in list(self._subscriptions.values()):
            subscription.callback("")

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.remove_termination_listener(self._lost)
            conn.terminate()
