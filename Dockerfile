# syntax=docker/dockerfile:1
#
# scheduler-daemon image: a wheel built in a throwaway stage, installed into a venv that is
# copied alone into a clean python:3.11-slim. No compiler, pip cache or source tree ships;
# every dependency installs from a prebuilt wheel, so the builder needs no build tools.
#
#   docker build -t scheduler-daemon .
#   docker run --rm -e SCHEDULER_DATABASE_URL=postgresql://... scheduler-daemon
#
# Configuration is by environment only (SCHEDULER_*, see config.example.toml).

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
# Only what the wheel is built from: a change to tests or docs does not rebuild it.
COPY pyproject.toml README.md ./
COPY scheduler_daemon ./scheduler_daemon
RUN python -m pip wheel --no-deps --wheel-dir /wheels . \
    && python -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir --only-binary=:all: /wheels/*.whl

FROM ${PYTHON_IMAGE}
# A fixed uid, so volume ownership and Kubernetes' runAsNonRoot checks are predictable.
RUN groupadd --system --gid 10001 scheduler \
    && useradd --system --uid 10001 --gid scheduler --no-create-home \
       --home-dir /var/lib/scheduler-daemon --shell /usr/sbin/nologin scheduler \
    && install -d -o scheduler -g scheduler -m 0750 /var/lib/scheduler-daemon
COPY --from=builder /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    SCHEDULER_LOG__FORMAT=json \
    SCHEDULER_HTTP__HOST=0.0.0.0
# The working directory is writable, so the SQLite default (./scheduler.db) works for a
# single container; mount a volume here to keep it. Replicas need PostgreSQL.
WORKDIR /var/lib/scheduler-daemon
USER 10001:10001
# /healthz, /readyz, /metrics, /status
EXPOSE 9464
# /healthz answers while the event loop does; slim has no curl, so ask Python.
HEALTHCHECK --interval=15s --timeout=5s --start-period=90s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('SCHEDULER_HTTP__PORT', '9464'), timeout=4)"]
# SIGTERM starts the graceful handover; give it more than shutdown_timeout (30s), e.g.
# `docker stop -t 45` or compose's stop_grace_period.
STOPSIGNAL SIGTERM
ENTRYPOINT ["scheduler-daemon"]
CMD ["run"]
