"""What `scheduler-daemon status` and `/status` report, gathered from the database."""

from __future__ import annotations

from typing import Any

from .config import Settings
from .db.connect import connect
from .logs import get_logger


async def collect_status(settings: Settings) -> dict[str, Any]:
    store = await connect(settings, get_logger(instance=settings.instance_id))
    try:
        stats = await store.publication_stats()
        version = await store.schema_version()
    finally:
        await store.close()
    return {
        "database": str(settings.database_url),
        "backend": store.backend,
        "schema_version": version,
        "publications": {
            "scheduled": stats.scheduled,
            "due": stats.due,
            "next_due": stats.next_due.isoformat() if stats.next_due else None,
        },
    }


def render_status(report: dict[str, Any]) -> str:
    publications = report["publications"]
    lines = [
        f"database        {report['database']} ({report['backend']}, "
        f"schema v{report['schema_version']})",
        f"publications    {publications['scheduled']} scheduled, {publications['due']} due now, "
        f"next due {publications['next_due'] or '-'}",
    ]
    return "\n".join(lines)
