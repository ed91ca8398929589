"""One LISTEN connection per replica, shared by the loops it leads (PostgreSQL, session
lock mode). The daemon opens it at start, so a standby holds it too, idle: a leader that
takes over subscribes with one LISTEN rather than a connection's setup, which at 10 ms
from the database is about 100 ms of its takeover.

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

import asyncio
import time
from collections.abc import Callable
from typing import Any

import asyncpg

from ..errors import describe, explain_timeouts
from ..logs import Logger
from .base import Store
from .postgres import PostgresStore, detect_dead_peer

# After a failed LISTEN connection, how long before trying again; meanwhile the loops tick
# on their interval, which bounds lateness without notifications.
LISTEN_RETRY = 30.0

Callback = Callable[[str], None]


class _Subscription:
    """A channel's callback, in the shape asyncpg calls (and identifies) listeners by.
    Unsubscribing only drops the callback: the channel stays LISTENed to, on a connection
    that sends nothing, so that stepping down never waits on the network."""

    def __init__(self, callback: Callback | None) -> None:
        self.callback = callback

    def __call__(self, _conn: Any, _pid: int, _channel: str, payload: str) -> None:
        if self.callback is not None:
            self.callback(payload)


class Listener:
    def __init__(self, store: PostgresStore, log: Logger) -> None:
        self.store = store
        self.log = log
        # Channel -> subscription; every key is LISTENed to on _conn while it is open.
        self._subscriptions: dict[str, _Subscription] = {}
        self._conn: asyncpg.Connection | None = None
        self._retry_at = 0.0
        # Both loops may (re)subscribe at once: one connection, one command at a time.
        self._lock = asyncio.Lock()
        # Kept open with no channel (open()): a standby's, ready for when it leads.
        self._warm = False

    @property
    def listening(self) -> bool:
        """Whether every subscribed channel is LISTENed to right now."""
        return self._conn is not None and not self._conn.is_closed()

    async def open(self) -> None:
        """Connect now, and keep the connection open with no channel subscribed: a standby
        that takes over then sends one LISTEN, not a connection's whole setup (TCP, the
        startup, the type codecs: about ten round trips), before its first tick. If this
        fails, or the connection is lost while nothing is subscribed, the first
        subscription connects again."""
        async with self._lock:
            self._warm = True
            await self._ensure()
            # Failed (logged): the first subscription tries again at once, not after
            # LISTEN_RETRY, which is for reconnecting a leader's lost LISTEN.
            self._retry_at = 0.0

    async def subscribe(self, channel: str, callback: Callback) -> None:
        """Call ``callback(payload)`` for each notification on ``channel``, and with ``""``
        whenever notifications may have been missed (the connection was reopened or
        lost)."""
        async with self._lock:
            known = self._subscriptions.get(channel)
            if known is not None:
                known.callback = callback  # still LISTENed to, if the connection is up
            else:
                subscription = self._subscriptions[channel] = _Subscription(callback)
                conn = self._conn
                if conn is not None and self.listening:
                    try:
                        await self._listen(conn, channel, subscription)
                    except BaseException as exc:
                        # Not LISTENed to (asyncpg registers a channel once LISTEN
                        # returned): never trust this connection for it. Cancelled too:
                        # the connection stays open (warm) for the next subscription.
                        if conn is self._conn:  # (not closed meanwhile by unsubscribe)
                            if isinstance(exc, Exception):
                                self.log.warning(
                                    "listen.failed", channel=channel, error=describe(exc)
                                )
                            self._close()
                        if not isinstance(exc, Exception):
                            raise
            await self._ensure()

    def unsubscribe(self, channel: str) -> None:
        """Stop calling the channel's callback; no network round trip (see _Subscription).
        Unless the listener was opened (``open``: kept for a standby), the connection is
        closed once no channel has a callback (one still being opened by _ensure is closed
        there, when it sees nobody wants it any more)."""
        subscription = self._subscriptions.get(channel)
        if subscription is not None:
            subscription.callback = None
        if all(s.callback is None for s in self._subscriptions.values()) and not self._warm:
            self._subscriptions.clear()
            self._close()

    async def ensure(self) -> None:
        """(Re)open the connection if it is gone and a channel wants it; at most every
        LISTEN_RETRY after a failure."""
        async with self._lock:
            await self._ensure()

    async def _ensure(self) -> None:
        wanted = self._warm or bool(self._subscriptions)
        if self.listening or not wanted or time.monotonic() < self._retry_at:
            return
        self._close()
        conn = None
        try:
            conn = await self.store.connect_dedicated("listen")
            # A dead path must not leave us trusting a LISTEN that hears nothing.
            detect_dead_peer(conn, self.store.settings.lock.step_down_after)
            for channel, subscription in list(self._subscriptions.items()):
                await self._listen(conn, channel, subscription)
        except BaseException as exc:
            if conn is not None:
                conn.terminate()
            if not isinstance(exc, Exception):
                raise  # cancelled: nothing opened is left behind
            self._retry_at = time.monotonic() + LISTEN_RETRY
            self.log.warning("listen.failed", error=describe(exc))
            return
        if not self._subscriptions and not self._warm:
            # unsubscribe() (or close()) dropped the last channel while this connected,
            # without the lock and while _conn was still None: nobody wants the
            # connection now, and nothing else would ever close it.
            conn.terminate()
            return
        self._conn = conn
        conn.add_termination_listener(self._lost)
        self._wake_all()  # whatever was sent while nobody listened is lost: look again

    async def _listen(
        self, conn: asyncpg.Connection, channel: str, subscription: _Subscription
    ) -> None:
        """LISTEN, within connect_timeout: a path that went silent while the sockets stay
        up (a proxy or middlebox still acknowledging) would hold the statement, and the
        lock with it, for as long as it lasts, and a leader starting would wait there,
        outside any work its lease can stop (tests/test_logs.py froze one so)."""
        timeout = self.store.settings.database.connect_timeout
        with explain_timeouts(f"listening on {channel}: no answer within {timeout:g}s"):
            async with asyncio.timeout(timeout):
                await conn.add_listener(channel, subscription)

    def _lost(self, conn: Any) -> None:
        # A loop sleeping long because it trusted the LISTEN must look now, and from now
        # on tick on its interval until ensure() reopens it.
        if conn is self._conn:
            self._conn = None
            self._wake_all()

    def _wake_all(self) -> None:
        for subscription in list(self._subscriptions.values()):
            if subscription.callback is not None:
                subscription.callback("")

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.remove_termination_listener(self._lost)
            conn.terminate()
            self._wake_all()  # whoever still subscribes stops trusting it

    def close(self) -> None:
        """At shutdown: drop the connection."""
        self._warm = False
        self._subscriptions.clear()
        self._close()


def listener_for(store: Store, log: Logger) -> Listener | None:
    """The replica's LISTEN connection on ``store`` (it connects when opened or first
    asked to listen); None where the backend has no NOTIFY (SQLite: its
    ``commit_watch``)."""
    return Listener(store, log) if isinstance(store, PostgresStore) else None
