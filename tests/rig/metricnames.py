"""The names the daemon's metrics registry exports, read from the registry itself."""

from __future__ import annotations

from prometheus_client.metrics import MetricWrapperBase

from scheduler_daemon.metrics import Metrics


def daemon_metrics() -> list[MetricWrapperBase]:
    """Every metric a daemon's `Metrics` defines."""
    return [m for m in vars(Metrics()).values() if isinstance(m, MetricWrapperBase)]


def exposed_name(metric: MetricWrapperBase) -> str:
    """The family name as exposed: counters end in ``_total``, infos in ``_info``."""
    [family] = metric.describe()
    suffix = {"counter": "_total", "info": "_info"}.get(family.type, "")
    return family.name + suffix


def exposed_series(metric: MetricWrapperBase) -> set[str]:
    """The series names a query can select: a histogram's ``_bucket``, ``_sum``, ``_count``."""
    [family] = metric.describe()
    name = exposed_name(metric)
    if family.type == "histogram":
        return {name + suffix for suffix in ("_bucket", "_sum", "_count")}
    return {name}
