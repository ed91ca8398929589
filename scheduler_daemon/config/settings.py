"""The settings models: :class:`Settings` (pydantic-settings) and its sections.

Everything the daemon can be told lives in :class:`Settings`. It is validated once, at the
edge; the rest of the code receives plain, already-checked values. The lock section and
its timing rules are in ``timing.py``; loading (defaults < TOML file < environment) is
``scheduler_daemon.config.load_settings``.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from ..redact import redact_webhook_url
from .timing import LockSettings
from .url import DatabaseUrl
from .values import Duration, NonNegativeDuration, Section, refuse_nul

# PostgreSQL's integers (statement_timeout in milliseconds, counters compared in SQL).
_PG_INT_MAX = 2**31 - 1
_MAX_STATEMENT_TIMEOUT = _PG_INT_MAX / 1000


# A member's lock packs the shard count beside its backend pid (leadership/shards.py).
MAX_SHARDS = 1024


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
# (four bytes a character at most). The same as a publication key's limit (client/pool.py).
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
    # Run history kept in scheduler_plugin_runs: at most `history` rows per task, and none
    # older than `history_max_age` (by its slot's day on PostgreSQL, by when it started on
    # SQLite), whichever keeps fewer. The built-in
    # task purge_runs keeps both, off the tick (plugins/retention.py); on PostgreSQL the age
    # goes by whole days (partitions), so up to a day more is kept.
    history: int = Field(default=1000, ge=1, le=_PG_INT_MAX)
    history_max_age: Duration = 7 * 86400.0
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
        # waited for a free one counts as failed (leadership/heartbeat.py): the hold steps down
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
