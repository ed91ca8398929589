"""Publishers: what "publish" does beyond the state flip (see base.py)."""

from __future__ import annotations

from importlib.metadata import entry_points

from ..config.settings import Settings
from ..db.publications import Published
from ..errors import ConfigError
from .base import Publisher
from .notify import NotifyPublisher
from .sql import SqlPublisher

ENTRY_POINT_GROUP = "scheduler_daemon.publishers"
BUILTIN = ("notify", "sql", "webhook")

__all__ = ["Published", "Publisher", "build_publishers"]


def build_publishers(settings: Settings, backend: str) -> list[Publisher]:
    """The configured publishers, in order. Unknown names are a config error."""
    plugins = {entry.name: entry for entry in entry_points(group=ENTRY_POINT_GROUP)}
    publishers: list[Publisher] = []
    for name in settings.publish.publishers:
        if name == "notify":
            if backend != "postgres":
                raise ConfigError("publish.publishers: 'notify' needs PostgreSQL")
            publishers.append(NotifyPublisher(settings.publish.notify))
        elif name == "sql":
            if backend != "postgres" and settings.publish.sql.mode == "batch":
                raise ConfigError("publish.sql.mode: 'batch' needs PostgreSQL; use 'row'")
            publishers.append(SqlPublisher(settings.publish.sql))
        elif name == "webhook":
            from .webhook import WebhookPublisher  # aiohttp: only where webhooks are sent

            publishers.append(WebhookPublisher(settings.publish.webhook))
        elif name in plugins:
            try:
                factory = plugins[name].load()
                publishers.append(factory(settings))
            except Exception as exc:
                raise ConfigError(f"publisher {name!r} ({plugins[name].value}): {exc}") from None
        else:
            known = ", ".join([*BUILTIN, *sorted(plugins)])
            raise ConfigError(f"publish.publishers: unknown publisher {name!r} (known: {known})")
    return publishers
