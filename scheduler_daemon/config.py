"""Configuration: defaults < TOML file < environment (``SCHEDULER_*``, nested with ``__``).

Everything the daemon can be told lives in :class:`Settings`. It is validated once, at the
edge; the rest of the code receives plain, already-checked values.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
import socket
import tomllib
from collections.abc import Mapping
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from .db.url import DatabaseUrl
from .errors import ConfigError
from .redact import redact_webhook_url

CONFIG_FILE_ENV = "SCHEDULER_CONFIG"

_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def parse_duration(value: Any) -> Any:
    """Accept ``5``, ``2.5``, ``"5s"``, ``"250ms"``, ``"2m"``, ``"1h"``; return seconds.

    Anything else is passed through for pydantic to reject with its usual message.
    """
    if isinstance(value, bool):
        return value  # bool is an int: let the float validator refuse it
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        match = _DURATION_RE.match(value)
        if match is None:
            raise ValueError(f"not a duration: {value!r} (use e.g. 5, '5s', '250ms', '2m')")
        number, unit = match.groups()
        return float(number) * _DURATION_UNITS[unit]
    return value


# The longest any duration may be: 100 years. Durations become datetimes (a task's next
# slot), asyncio timers and PostgreSQL intervals, none of which takes infinity, and a slot
# computed past the year 9999 does not exist in Python.
MAX_DURATION = 100 * 365 * 86400.0

# Seconds, as a float. Positive: zero-length intervals and timeouts are always a mistake.
Duration = Annotated[
    float, BeforeValidator(parse_duration), Field(gt=0, le=MAX_DURATION, allow_inf_nan=False)
]

# The same, where 0 means "none" (a task's jitter): `jitter = "0s"` is no mistake.
NonNegativeDuration = Annotated[
    float, BeforeValidator(parse_duration), Field(ge=0, le=MAX_DURATION, allow_inf_nan=False)
]

# PostgreSQL's integers (statement_timeout in milliseconds, counters compared in SQL).
_PG_INT_MAX = 2**31 - 1
_MAX_STATEMENT_TIMEOUT = _PG_INT_MAX / 1000


def refuse_nul(value: Any) -> Any:
    """Refuse text holding U+0000 (TOML's ``\\u0000``): no PostgreSQL text, file name, host
    name, URL or environment variable can hold it, so it would fail later, far from here."""
    texts = value if isinstance(value, list | tuple) else [value]
    if any(isinstance(text, str) and "\x00" in text for text in texts):
        raise ValueError("contains a NUL character (\\x00), which no setting can hold")
    return value


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def lock_key_from_name(name: str) -> int:
    """The stable 64-bit signed lock key for a name: the first 8 bytes of its SHA-256.

    Stable across Python versions, processes and machines (unlike ``hash()``), so replicas
    configured with the same name always contend for the same key.
    """
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)


def parse_lock_key(value: Any) -> Any:
    """An advisory-lock key: an integer, a hex string (``0x…``), or a name to hash.

    Unsigned 64-bit values are folded into PostgreSQL's signed ``bigint`` range
    (two's complement), so ``0xffffffffffffffff`` is ``-1``.
    """
    if isinstance(value, bool):
        raise ValueError("a lock key cannot be a boolean")
    if isinstance(value, str):
        text = value.strip()
        if re.fullmatch(r"[+-]?\d+", text):
            value = int(text)
        elif re.fullmatch(r"0[xX][0-9a-fA-F]+", text):
            value = int(text, 16)
        elif text:
            return lock_key_from_name(text)
        else:
            raise ValueError("a lock key cannot be empty")
    if isinstance(value, int):
        if _INT64_MAX < value < 2**64:
            value -= 2**64
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise ValueError(f"lock key {value} does not fit in 64 bits")
        return value
    return value


LockKey = Annotated[int, BeforeValidator(parse_lock_key)]

DEFAULT_PUBLISH_KEY = 0x9A37B7A1
DEFAULT_PLUGIN_KEY = 0x7B9C5F3E
# A member's lock packs the shard count beside its backend pid (leadership/shards.py).
MAX_SHARDS = 1024


class Section(BaseModel):
    """Config sections refuse unknown keys so a typo is an error, not a silent default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_nul(cls, value: Any) -> Any:
        return refuse_nul(value)


# asyncpg sets up every place of a pool up front: a size of 10**9 would never start.
_MAX_POOL_SIZE = 10_000


class DatabaseSettings(Section):
    pool_min_size: int = Field(default=1, ge=0, le=_MAX_POOL_SIZE)
    pool_max_size: int = Field(default=5, ge=1, le=_MAX_POOL_SIZE)
    connect_timeout: Duration = 5.0
    statement_timeout: Duration = Field(default=30.0, le=_MAX_STATEMENT_TIMEOUT)
    startup_budget: Duration = 60.0
    # The same, for the one-shot commands someone waits for (status, schedule, tasks, …).
    command_budget: Duration = 5.0

    @model_validator(mode="after")
    def _pool_bounds(self) -> DatabaseSettings:
        if self.pool_min_size > self.pool_max_size:
            raise ValueError("pool_min_size must not exceed pool_max_size")
        return self


class NotifyPublisherSettings(Section):
    channel: str = Field(default="scheduler_published", min_length=1, max_length=63)


class SqlPublisherSettings(Section):
    # Run in the publishing transaction. "batch": once per batch, each parameter an array
    # over the batch (PostgreSQL: `... WHERE id = ANY($1)`). "row": once per row.
    statement: str | None = None
    params: list[str] = Field(default_factory=lambda: ["id"])
    mode: Literal["batch", "row"] = "batch"

    @field_validator("params")
    @classmethod
    def _known_params(cls, params: list[str]) -> list[str]:
        for param in params:
            if param not in ("id", "key", "publish_at") and not param.startswith("$."):
                raise ValueError(
                    f"param {param!r}: use id, key, publish_at or a payload path like $.post_id"
                )
        return params


class WebhookPublisherSettings(Section):
    # A SecretStr: Slack-style hook URLs carry their token in the path.
    url: SecretStr | None = None
    secret: SecretStr | None = None
    timeout: Duration = 10.0
    max_attempts: int = Field(default=8, ge=1)
    backoff: Duration = 1.0
    max_backoff: Duration = 300.0
    concurrency: int = Field(default=8, ge=1, le=256)

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: SecretStr | None) -> SecretStr | None:
        # The messages never quote the URL: it may carry a token.
        text = "" if url is None else url.get_secret_value()
        if not text:
            return url  # unset: `publishers` says so if 'webhook' needs it
        try:
            parts = urlsplit(text)
            parts.port  # noqa: B018  # parsing the port is what may raise
        except ValueError:
            raise ValueError("not a URL with a valid port (0-65535)") from None
        if parts.scheme.lower() not in ("http", "https"):
            raise ValueError("needs an http:// or https:// URL")
        if not parts.hostname:
            raise ValueError("needs a host, as in https://hooks.example.com/path")
        return url


class PublishSettings(Section):
    enabled: bool = True
    interval: Duration = 5.0
    batch_size: int = Field(default=500, ge=1, le=100_000)
    publishers: list[str] = Field(default_factory=list)
    notify: NotifyPublisherSettings = Field(default_factory=NotifyPublisherSettings)
    sql: SqlPublisherSettings = Field(default_factory=SqlPublisherSettings)
    webhook: WebhookPublisherSettings = Field(default_factory=WebhookPublisherSettings)
    max_payload_bytes: int = Field(default=1024 * 1024, ge=2)
    # The longest one publisher may take over one call (a batch, or one row when a failed
    # batch is retried row by row); past it the call is cancelled and fails like an error.
    # In session and transaction mode alike the leader keeps its lock meanwhile, so this
    # may exceed lock.stall_timeout; rows due behind the batch wait that long at most
    # (and batch_size times that if the batch is then retried row by row and every row
    # hangs too).
    publisher_timeout: Duration = 30.0
    # Published, cancelled and failed rows older than this are purged by the built-in
    # plugin task purge_publications.
    retention: Duration = 30 * 86400.0

    @model_validator(mode="after")
    def _publishers_configured(self) -> PublishSettings:
        if len(set(self.publishers)) != len(self.publishers):
            raise ValueError("a publisher is listed twice")
        if "sql" in self.publishers and not self.sql.statement:
            raise ValueError("publisher 'sql' needs publish.sql.statement")
        webhook = self.webhook
        if "webhook" in self.publishers and not (
            webhook.url and webhook.url.get_secret_value() and webhook.secret
        ):
            raise ValueError("publisher 'webhook' needs publish.webhook.url and .secret")
        return self


# A task name is a primary key: its index entry must stay under PostgreSQL's 2,704 bytes
# (four bytes a character at most). The same as a publication key's limit (client.py).
MAX_TASK_NAME_LENGTH = 500


class PluginTaskSettings(Section):
    name: str = Field(min_length=1, max_length=MAX_TASK_NAME_LENGTH)
    every: Duration | None = None
    cron: str | None = None
    timezone: str = "UTC"
    # An SQL task's statement_timeout is its timeout plus a second (loops/plugin.py).
    timeout: Duration = Field(default=300.0, le=_MAX_STATEMENT_TIMEOUT - 1)
    misfire: Literal["run_once", "skip"] = "run_once"
    # Each slot runs up to this much later, by an offset fixed per task (a hash of its
    # name): tasks on one period spread out instead of all firing at one instant.
    jitter: NonNegativeDuration = 0.0
    enabled: bool = True
    target: str | None = None
    sql: str | None = None
    # JSON object handed to the target as ctx.args.
    args: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_schedule_one_action(self) -> PluginTaskSettings:
        if (self.every is None) == (self.cron is None):
            raise ValueError(f"task {self.name!r}: give exactly one of 'every' and 'cron'")
        if (self.target is None) == (self.sql is None):
            raise ValueError(f"task {self.name!r}: give exactly one of 'target' and 'sql'")
        if self.args and self.sql is not None:
            raise ValueError(f"task {self.name!r}: 'args' are for a target, not 'sql'")
        return self


class PluginSettings(Section):
    enabled: bool = True
    interval: Duration = 1.0
    # Task runs in flight at once; a due task waits for a free place (docs/performance.md
    # measured the default: async targets that wait on I/O need many places).
    concurrency: int = Field(default=100, ge=1, le=10_000)
    # Of those, runs of sync targets at once: each takes a worker process.
    sync_concurrency: int = Field(default=4, ge=1, le=1000)
    # A task that fails this many times in a row is paused (resume with `tasks resume`).
    max_consecutive_failures: int = Field(default=5, ge=1, le=_PG_INT_MAX)
    # Rows of run history kept per task in scheduler_plugin_runs.
    history: int = Field(default=1000, ge=1, le=_PG_INT_MAX)
    # Load tasks from the entry-point group scheduler_daemon.plugins.
    entry_points: bool = True
    # Task names (from config, plugins or built-ins) not to run.
    disabled: list[str] = Field(default_factory=list)
    # Targets ("pkg.mod:func") that runtime schedules may name, beyond the targets of the
    # declared tasks (docs/plugins.md, "Schedules as data"). Nothing else can be run from
    # a row in the database.
    runnable: list[str] = Field(default_factory=list)
    tasks: list[PluginTaskSettings] = Field(default_factory=list)
    # Sharded leadership (docs/leadership.md, "Shards"): every schedule belongs to one of
    # this many shards (its name's hash), each led by one replica at a time; the replicas
    # share them out. 1: one replica leads every schedule. Every replica must say the same
    # (a replica with another count stands by until no replica of the first is left).
    shards: int = Field(default=1, ge=1, le=MAX_SHARDS)
    # A replica giving shards away (a replica joined) lets their runs in flight end for
    # this long, then stops them; the next owner starts only after that.
    handover_timeout: Duration = 10.0

    @field_validator("tasks")
    @classmethod
    def _unique_names(cls, tasks: list[PluginTaskSettings]) -> list[PluginTaskSettings]:
        seen: set[str] = set()
        for task in tasks:
            if task.name in seen:
                raise ValueError(f"duplicate task name {task.name!r}")
            seen.add(task.name)
        return tasks


class LockKeys(Section):
    publish: LockKey = DEFAULT_PUBLISH_KEY
    plugin: LockKey = DEFAULT_PLUGIN_KEY

    @model_validator(mode="after")
    def _distinct(self) -> LockKeys:
        # Compared after parsing: "0x10" and 16 are one key, and so is one name twice.
        if self.publish == self.plugin:
            raise ValueError(
                f"publish and plugin are the same key ({self.publish}): the loops would "
                "share one lock and only one of them could ever lead; give each its own"
            )
        return self


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
        step-down bound as always (leadership/base.py, ``heartbeat``)."""
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


class HttpSettings(Section):
    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = Field(default=9464, ge=0, le=65535)
    # /status shows a summary safe for the network unless the operator opts in to the full
    # report (database URL without password, host names, pids, client addresses).
    status_detail: bool = False


class DashboardSettings(Section):
    """The browser dashboard at ``/`` of the HTTP server (scheduler_daemon/dashboard/)."""

    enabled: bool = True
    # How often an open page's live parts are read again (server-sent events).
    refresh: Duration = Field(default=1.0, le=60.0)
    # Pause, resume and trigger schedules; cancel and retry publications. Off unless
    # configured, and then only for HTTP Basic credentials user:password.
    actions: bool = False
    user: str = Field(default="admin", min_length=1, max_length=200, pattern=r"^[^:]+$")
    password: SecretStr | None = None
    # A file holding the password (a Docker or systemd secret), read at start.
    password_file: Path | None = None

    @model_validator(mode="after")
    def _actions_need_a_password(self) -> DashboardSettings:
        if self.password is not None and self.password_file is not None:
            raise ValueError("give dashboard.password or dashboard.password_file, not both")
        if self.password is not None and len(self.password.get_secret_value()) < 12:
            raise ValueError("dashboard.password: at least 12 characters")
        if self.actions and self.password is None and self.password_file is None:
            raise ValueError(
                "dashboard.actions needs credentials: set dashboard.password_file (or "
                "dashboard.password); the actions are refused to anyone without them"
            )
        return self


class LogSettings(Section):
    format: Literal["auto", "json", "console"] = "auto"
    level: Literal["debug", "info", "warning", "error"] = "info"
    # At level debug, other libraries' stdlib loggers (aiosqlite, asyncpg, aiohttp, asyncio)
    # still log at info and above unless this is true: their debug lines (aiosqlite's, one
    # per statement of SQLite's 100 ms watch) would drown the daemon's own.
    debug_libraries: bool = False

    @field_validator("level", mode="before")
    @classmethod
    def _lowercase(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value


def transaction_pool_users(settings: Settings) -> dict[str, int]:
    """What can hold a pooled connection at the same time in lock mode ``transaction``,
    as the daemon runs with ``settings``; the pool's floor is the sum.

    Each transaction that keeps a loop's lock while something else runs (a hold) proves it
    with a heartbeat, through the pool while a statement runs on the hold's own connection:
    one more connection per hold. A loop has at most one hold of its own holding the lock
    (its ticks' try-locks fail meanwhile), but a hold may still be ending while a tick that
    won after it hands the next batch to another. The HTTP endpoints share one database
    check (``/readyz``, ``/metrics``), one status report and one dashboard read in flight
    (http.py).
    """
    users: dict[str, int] = {}
    if settings.publish.enabled:
        # Its transactions run publishers that may await an API: heartbeated like a hold.
        users["publish tick and its proof"] = 2
        if "webhook" in settings.publish.publishers:
            users["webhook round's hold and its proof"] = 2
    if settings.plugin.enabled:
        users["plugin tick"] = 1
        users["plugin batch's hold and its proof"] = 2
        users["hold a plugin tick hands the next batch to"] = 1
    if settings.http.enabled:
        users["/readyz and /metrics check"] = 1
        users["/status report"] = 1
        if settings.dashboard.enabled:
            users["dashboard read"] = 1
    return users or {"one-shot command": 1}


def default_instance_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="SCHEDULER_",
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
    )

    database_url: DatabaseUrl = Field(
        default_factory=lambda: DatabaseUrl.parse("sqlite:///./scheduler.db")
    )
    instance_id: str = Field(default_factory=default_instance_id, min_length=1)
    shutdown_timeout: Duration = 30.0
    database: DatabaseSettings = Field(default_factory=DatabaseSettings)
    publish: PublishSettings = Field(default_factory=PublishSettings)
    plugin: PluginSettings = Field(default_factory=PluginSettings)
    lock: LockSettings = Field(default_factory=LockSettings)
    http: HttpSettings = Field(default_factory=HttpSettings)
    dashboard: DashboardSettings = Field(default_factory=DashboardSettings)
    log: LogSettings = Field(default_factory=LogSettings)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The TOML file's contents arrive as init kwargs (see load_settings); listing
        # env first makes the environment win over the file.
        return (env_settings, init_settings)

    @field_validator("*", mode="before")
    @classmethod
    def _no_nul(cls, value: Any) -> Any:
        return refuse_nul(value)

    @model_validator(mode="after")
    def _shards_need_session_mode(self) -> Settings:
        if self.plugin.shards == 1:
            return self
        if self.database_url.backend != "postgres":
            raise ValueError(
                "plugin.shards: sharded leadership needs PostgreSQL (SQLite runs on one "
                "host, where one replica leads every schedule); set it to 1"
            )
        if self.lock.mode != "session":
            raise ValueError(
                "plugin.shards: sharded leadership needs lock.mode 'session' (a replica "
                "holds its shards' locks on its own session, which a transaction pooler "
                "cannot keep); set it to 1, or use a direct or session-pooled connection"
            )
        return self

    @model_validator(mode="after")
    def _pool_fits_transaction_mode(self) -> Settings:
        # Transaction mode works on pooled connections only, and a heartbeat's proof that
        # waited for a free one counts as failed (leadership/base.py): the hold steps down
        # and its work is cancelled on a healthy leader. So the pool fits everything that
        # can hold a connection at once, and no proof ever waits for one.
        if self.lock.mode != "transaction":
            return self
        users = transaction_pool_users(self)
        floor = sum(users.values())
        if self.database.pool_max_size >= floor:
            return self
        if "pool_max_size" not in self.database.model_fields_set:
            # The default (5) is session mode's; this mode's is what it needs. The model
            # is frozen, but this validator still builds it.
            database = self.database.model_copy(update={"pool_max_size": floor})
            object.__setattr__(self, "database", database)
            return self
        needs = ", ".join(f"{what} {count}" for what, count in users.items())
        raise ValueError(
            f"database.pool_max_size: lock.mode 'transaction' needs at least {floor} pooled "
            f"connections, one for each that can be in use at once ({needs}); got "
            f"{self.database.pool_max_size}"
        )

    def redacted(self) -> dict[str, Any]:
        """The effective config as plain data, safe to print or serve."""
        data = self.model_dump(mode="json")
        data["database_url"] = self.database_url.redacted
        url = self.publish.webhook.url
        if url is not None:
            data["publish"]["webhook"]["url"] = redact_webhook_url(url.get_secret_value())
        return data


def _printable(text: str) -> str:
    """``text`` as it is, or quoted with its escapes if it holds a newline, a control
    character or a surrogate: an error stays one readable line whatever it names."""
    return text if text.isprintable() else repr(text)


def _read_toml(path: Path) -> dict[str, Any]:
    shown = _printable(str(path))
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {shown}: not found") from None
    except OSError as exc:
        raise ConfigError(f"config file {shown}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {shown}: invalid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {shown}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at "
            f"offset {exc.start}); TOML files are UTF-8"
        ) from None
    except RecursionError:
        raise ConfigError(f"config file {shown}: invalid TOML: nested too deeply") from None


def _task_names(file_values: Mapping[str, Any]) -> list[Any]:
    """Task names by position, from the environment (which wins) or the file, so that an
    error in ``plugin.tasks.2`` can say which task it is."""
    raw = os.environ.get("SCHEDULER_PLUGIN__TASKS")
    plugin = file_values.get("plugin", {})
    try:
        # `plugin` may be anything but a table: the error being explained may be that.
        tasks = (
            json.loads(raw) if raw else plugin.get("tasks", []) if isinstance(plugin, dict) else []
        )
    except (json.JSONDecodeError, RecursionError):
        return []
    if not isinstance(tasks, list):
        return []
    return [task.get("name") if isinstance(task, dict) else None for task in tasks]


_SECRET_NAME = re.compile(r"(secret|password|url|token)$", re.I)


def _is_secret(loc: list[str], value: Any) -> bool:
    """Whether a failed value may carry a secret: by its field's name or type."""
    if isinstance(value, SecretStr | DatabaseUrl):
        return True
    if any(_SECRET_NAME.search(part) for part in loc):
        return True
    return _field_is_secret(loc)


def _types_in(annotation: Any) -> list[Any]:
    """``annotation`` and every type nested in it (``X | None``, ``list[X]``, …)."""
    found = [annotation]
    for arg in get_args(annotation):
        found += _types_in(arg)
    return found


def _field_is_secret(loc: list[str]) -> bool:
    """Follow ``loc`` through the settings models; true if it reaches a secret-typed field."""
    model: Any = Settings
    for part in loc:
        fields = getattr(model, "model_fields", {})
        if part not in fields:
            continue  # a list index or a union member tag: stay on the same model
        types = _types_in(fields[part].annotation)
        if any(t in (SecretStr, DatabaseUrl) for t in types):
            return True
        models = [t for t in types if isinstance(t, type) and issubclass(t, BaseModel)]
        model = models[0] if models else None
    return False


def _describe(error: Mapping[str, Any], task_names: list[Any]) -> str:
    loc = [str(part) for part in error["loc"]]
    parts = [_printable(part) for part in loc]
    if parts[:2] == ["plugin", "tasks"] and len(parts) > 2 and parts[2].isdigit():
        index = int(parts[2])
        if index < len(task_names) and task_names[index]:
            parts[2] = f"[{task_names[index]}]"
    location = ".".join(parts).replace(".[", "[") or "config"
    message = str(error["msg"]).removeprefix("Value error, ")
    if not parts:  # a rule across sections: its message names the keys itself
        return message
    if error["type"] == "extra_forbidden":
        return f"{location}: unknown key"
    value = error.get("input")
    if _is_secret(loc, value) or isinstance(value, dict | list):
        # A URL, token or password must not reach a terminal or a log; a whole section or
        # list is noise. Never echo either.
        return f"{location}: {message}"
    if repr(value) in message:
        return f"{location}: {message}"  # the validator quoted it already: once is enough
    return f"{location}: {message} (got {value!r})"


ENV_PREFIX = "SCHEDULER_"
# SCHEDULER_* variables that are not settings but are read by name: the config file's
# path, the test suite's sample plugin switch; and whole families used by the test rig and
# the benchmarks (SCHEDULER_TEST_DATABASE_URL, SCHEDULER_BENCH_DATABASE_URL, …).
OTHER_ENV = frozenset({CONFIG_FILE_ENV, "SCHEDULER_SAMPLE_PLUGIN"})
OTHER_ENV_PREFIXES = ("SCHEDULER_TEST_", "SCHEDULER_BENCH_")


def _alternatives(annotation: Any) -> tuple[Any, ...]:
    """``X | None`` -> ``(X, None)``; anything else -> ``(annotation,)``."""
    if get_origin(annotation) in (Union, UnionType):
        return get_args(annotation)
    return (annotation,)


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    """The section a field holds (``X`` or ``X | None``), whose keys are variables too."""
    for candidate in _alternatives(annotation):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _is_list(annotation: Any) -> bool:
    return any(get_origin(t) in (list, tuple, set, frozenset) for t in _alternatives(annotation))


def _is_json(annotation: Any) -> bool:
    """Whether pydantic-settings reads this field's variable as JSON (a section, a list)."""
    return any(
        get_origin(t) in (list, tuple, set, frozenset, dict)
        or (isinstance(t, type) and issubclass(t, BaseModel | list | tuple | set | dict))
        for t in _types_in(annotation)
    )


def setting_variables(
    model: type[BaseModel] = Settings, prefix: str = ENV_PREFIX
) -> dict[str, tuple[str, Any]]:
    """Every variable that sets something, at every depth, mapped to its dotted key and
    type: ``SCHEDULER_PUBLISH`` (the section, as JSON), ``SCHEDULER_PUBLISH__INTERVAL``, …"""
    found: dict[str, tuple[str, Any]] = {}
    dotted = prefix.removeprefix(ENV_PREFIX).replace("__", ".").lower()
    for name, field in model.model_fields.items():
        variable = f"{prefix}{name.upper()}"
        found[variable] = (f"{dotted}{name}", field.annotation)
        section = _nested_model(field.annotation)
        if section is not None:
            found.update(setting_variables(section, f"{variable}__"))
    return found


def check_environment(environ: Mapping[str, str]) -> None:
    """Refuse a ``SCHEDULER_*`` variable that names no setting (``SCHEDULER_DATABASE_ULR``
    would otherwise leave the default in place, silently), suggesting the closest name;
    and one that must hold JSON and does not, naming the variable."""
    known = setting_variables()
    for variable in sorted(environ):
        name = variable.upper()  # pydantic-settings reads them case-insensitively
        shown = _printable(variable)
        if not name.startswith(ENV_PREFIX) or name in OTHER_ENV:
            continue
        if name.startswith(OTHER_ENV_PREFIXES):
            continue
        if name not in known:
            close = difflib.get_close_matches(name, [*known, *OTHER_ENV], n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(
                f"invalid config: {shown}: unknown variable, not a setting{hint} "
                "(every setting is listed in config.example.toml)"
            )
        key, annotation = known[name]
        if _is_json(annotation):
            try:
                json.loads(environ[variable])
            except RecursionError:
                raise ConfigError(
                    f"invalid config: {shown}: JSON nested too deeply for {key}"
                ) from None
            except ValueError as exc:
                shape = (
                    'a JSON list, e.g. \'["a", "b"]\''
                    if _is_list(annotation)
                    else 'a JSON object, e.g. \'{"key": "value"}\''
                )
                where = getattr(exc, "msg", str(exc))
                raise ConfigError(
                    f"invalid config: {shown}: not valid JSON ({where}); {key} takes {shape}"
                ) from None


def load_settings(config_file: str | Path | None = None) -> Settings:
    """Build the effective settings; raise :class:`ConfigError` with one line naming the key
    (or the variable)."""
    check_environment(os.environ)
    path = config_file or os.environ.get(CONFIG_FILE_ENV) or None
    file_values = _read_toml(Path(path)) if path else {}
    try:
        return Settings(**file_values)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        first = _describe(errors[0], _task_names(file_values))
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise ConfigError(f"invalid config: {first}{more}") from None
    except SettingsError as exc:
        # e.g. SCHEDULER_PUBLISH__PUBLISHERS that is not JSON; the message names the field.
        raise ConfigError(f"invalid config: {exc}") from None
