"""Failover timing: the lock section and the rules its durations must keep, so that a
cut-off leader has stopped all of its work before the server can free its lock for a
standby (and before a standby can evict it).

Here: :func:`earliest_lock_release` (when the server's kernel can drop a cut-off leader's
session, from the TCP settings the session sent), and :class:`LockSettings`, whose
validators refuse timings that break those inequalities and whose properties give the
bounds the guards run on (``step_down_after``, ``stopped_after``, ``quiet_proof_interval``,
``server_frees_lock_after``). docs/leadership.md explains the arithmetic.

In the config package, not in ``leadership/``: the rules are checked when the settings are
loaded, so ``settings.py`` imports them, and the leadership package imports the settings
(``leadership/__init__`` -> ``leadership/base`` -> config): a ``leadership/timing.py`` would
make config import a layer above it and close an import cycle.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from .values import Duration, LockKeys, Section

# Linux's limits for TCP_KEEPIDLE and TCP_KEEPINTVL: PostgreSQL only logs a refused
# setsockopt, so a larger value would silently leave the session on the old one.
_MAX_KEEPALIVE_SECONDS = 32767
_MAX_TCP_USER_TIMEOUT = (2**31 - 1) / 1000  # tcp_user_timeout is an int of milliseconds

# Slack in every timing inequality: asyncio and kernel timer lateness, a round trip and a
# delayed ACK, the cost of deciding to step down. Tens of milliseconds in practice.
TIMING_MARGIN = 1.0
_EPSILON = 1e-9  # float noise, so 0.1 + 0.2 is not refused for exceeding 0.3


def earliest_lock_release(idle: int, interval: int, count: int, user_timeout_ms: int) -> float:
    """Seconds from a network cut until, at the earliest, the server's kernel can drop the
    cut-off leader's session (and PostgreSQL free its lock), given the TCP settings the
    session sent: ``tcp_keepalives_idle``/``_interval`` (s), ``_count``, ``tcp_user_timeout``
    (ms). Nothing is assumed about when the leader last used the connection.

    The kernel probes a silent socket at the latest ``max(idle, interval)`` after the last
    packet it received (``interval`` after a previous, answered probe), so at the cut that
    packet may be this old and the next probe may go out at once. Linux with
    TCP_USER_TIMEOUT set then drops the socket at a probe (one every ``interval``, not
    the first) once ``user_timeout`` has passed since that packet; keepalive_count is
    ignored (``tcp_keepalive_timer``): ``max(interval, user_timeout - max(idle, interval))``.
    Data the server sends after the cut and never sees acknowledged dies ``user_timeout``
    after it was sent (``tcp_write_timeout``). A server without TCP_USER_TIMEOUT (not
    Linux) drops the socket after ``count`` unanswered probes: ``interval x count``.
    """
    user_timeout = user_timeout_ms / 1000
    keepalive = max(interval, user_timeout - max(idle, interval))
    return float(min(user_timeout, keepalive, interval * count))


def _whole(value: float, unit: float) -> float | None:
    """``value`` as a whole number of ``unit``s (exactly), or None if it is not one."""
    count = round(value / unit)
    return count * unit if abs(value / unit - count) < 1e-6 else None


class LockSettings(Section):
    mode: Literal["session", "transaction"] = "session"
    standby: Literal["wait", "poll"] = "wait"
    keys: LockKeys = Field(default_factory=LockKeys)
    heartbeat_interval: Duration = 2.0
    # A lock session silent this long is ended by the server (idle_session_timeout):
    # the eviction of a frozen leader. Whole milliseconds, as PostgreSQL takes it.
    stall_timeout: Duration = Field(default=15.0, le=_MAX_TCP_USER_TIMEOUT)
    # Work cancelled because leadership ends (or a run timed out, or shutdown_timeout ran
    # out) gets this long to stop before it is killed (worker processes) or we exit.
    stop_grace: Duration = 1.0
    poll_interval: Duration = 1.0
    # Sent as the lock session's tcp_keepalives_idle/_interval/_count and tcp_user_timeout,
    # exactly: PostgreSQL takes whole seconds (and whole milliseconds for the last).
    keepalive_idle: Duration = Field(default=2.0, le=_MAX_KEEPALIVE_SECONDS)
    keepalive_interval: Duration = Field(default=2.0, le=_MAX_KEEPALIVE_SECONDS)
    keepalive_count: int = Field(default=4, ge=1, le=100)
    tcp_user_timeout: Duration = Field(default=10.0, le=_MAX_TCP_USER_TIMEOUT)

    @field_validator("keepalive_idle", "keepalive_interval")
    @classmethod
    def _whole_seconds(cls, value: float) -> float:
        whole = _whole(value, 1.0)
        if whole is None:
            raise ValueError("PostgreSQL takes whole seconds")
        return whole

    @field_validator("tcp_user_timeout", "stall_timeout")
    @classmethod
    def _whole_milliseconds(cls, value: float) -> float:
        whole = _whole(value, 0.001)
        if whole is None:
            raise ValueError("PostgreSQL takes whole milliseconds")
        return round(whole * 1000) / 1000

    def server_tcp_settings(self) -> dict[str, int]:
        """The lock session's TCP parameters, as PostgreSQL receives them (seconds; the
        user timeout in milliseconds). The timing check below is done on these."""
        return {
            "tcp_keepalives_idle": round(self.keepalive_idle),
            "tcp_keepalives_interval": round(self.keepalive_interval),
            "tcp_keepalives_count": self.keepalive_count,
            "tcp_user_timeout": round(self.tcp_user_timeout * 1000),
        }

    @property
    def step_down_after(self) -> float:
        """Worst case from the last good heartbeat to the leader deciding to step down: the
        next heartbeat starts one interval later and is given one interval to succeed."""
        return 2 * self.heartbeat_interval

    @property
    def quiet_proof_interval(self) -> float:
        """How often a leader with no work running proves its lock (session mode): only to
        keep the server from ending its session as frozen (idle for stall_timeout), so a
        third of that, leaving two proofs of slack; and soon enough that, cut off, it
        learns so (its proof unanswered one interval later) before the server can free its
        lock for a standby: two replicas never both say they lead. Never more often than
        a working leader. Its work starts on a fresh proof, and is then held to the
        step-down bound as always (leadership/heartbeat.py)."""
        before_freed = self.server_frees_lock_after - self.heartbeat_interval - TIMING_MARGIN
        return max(self.heartbeat_interval, min(self.stall_timeout / 3, before_freed))

    @property
    def stopped_after(self) -> float:
        """Worst case from the last good heartbeat until the leader's work has stopped:
        the decision, then stop_grace for cancelled work to end (or be killed)."""
        return self.step_down_after + self.stop_grace

    @property
    def server_frees_lock_after(self) -> float:
        """The earliest the server can drop a silently cut-off leader's session (freeing
        its lock), counted from the cut: :func:`earliest_lock_release` of what it gets."""
        tcp = self.server_tcp_settings()
        return earliest_lock_release(
            tcp["tcp_keepalives_idle"],
            tcp["tcp_keepalives_interval"],
            tcp["tcp_keepalives_count"],
            tcp["tcp_user_timeout"],
        )

    @model_validator(mode="after")
    def _leader_gives_up_first(self) -> LockSettings:
        # Promise 5: a cut-off leader must have stopped all of its work before the server
        # can hand its lock to a standby; and before a standby can evict it, which is what
        # frees the lock when the cut leaves its TCP session up (a proxy) -- which also
        # means a live leader is never evicted for one late heartbeat.
        stopped = self.stopped_after + TIMING_MARGIN
        tcp = self.server_tcp_settings()
        idle, interval = tcp["tcp_keepalives_idle"], tcp["tcp_keepalives_interval"]
        user_timeout = tcp["tcp_user_timeout"] / 1000
        frees = self.server_frees_lock_after
        if stopped > frees + _EPSILON:
            raise ValueError(
                f"timings: 2 x heartbeat_interval + stop_grace + {TIMING_MARGIN:g}s = "
                f"{stopped:g}s must not exceed the earliest the server frees a cut-off "
                "leader's lock, min(tcp_user_timeout, max(keepalive_interval, "
                "tcp_user_timeout - max(keepalive_idle, keepalive_interval)), "
                f"keepalive_interval x keepalive_count) = min({user_timeout:g}, "
                f"max({interval}, {user_timeout:g} - max({idle}, {interval})), "
                f"{interval} x {tcp['tcp_keepalives_count']}) = {frees:g}s"
            )
        if self.standby == "poll" and self.poll_interval + TIMING_MARGIN > self.stall_timeout:
            raise ValueError(
                f"lock.poll_interval ({self.poll_interval:g}s) + {TIMING_MARGIN:g}s must not "
                f"exceed lock.stall_timeout ({self.stall_timeout:g}s): the server ends a "
                "lock session that is silent for stall_timeout, a polling standby's too"
            )
        if stopped > self.stall_timeout + _EPSILON:
            raise ValueError(
                f"timings: stall_timeout ({self.stall_timeout:g}s) must be at least "
                f"2 x heartbeat_interval + stop_grace + {TIMING_MARGIN:g}s ({stopped:g}s), "
                "or the server could end the session of a leader whose work has not stopped yet"
            )
        return self
