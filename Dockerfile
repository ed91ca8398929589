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
COPY pyproject.toml README.md constraints.txt ./
COPY scheduler_daemon ./scheduler_daemon
# Every dependency at the version constraints.txt pins, so a rebuild next month ships
# what was tested. pip and setuptools leave the venv once it is filled: the runtime never
# installs anything.
RUN python -m pip wheel --no-deps --wheel-dir /wheels . \
    && python -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir --only-binary=:all: \
       --constraint constraints.txt /wheels/*.whl \
    && /opt/venv/bin/pip uninstall --yes pip setuptools \
    && rm -f /opt/venv/lib/python3*/site-packages/distutils-precedence.pth

FROM ${PYTHON_IMAGE}
# The base image's own pip, setuptools and wheel are dead weight here (and tools an
# intruder would like). Removed by path: a distribution's Python (Debian's) refuses to
# let pip uninstall what its package manager installed.
RUN python3 -c "import importlib.util as u, pathlib, shutil, sys; \
[shutil.rmtree(p) for d in sys.path if d and pathlib.Path(d).is_dir() \
 for p in pathlib.Path(d).iterdir() if p.is_dir() and p.name.split('-')[0] in \
 ('pip', 'setuptools', 'wheel', 'pkg_resources', '_distutils_hack')]" \
    && rm -f /usr/local/bin/pip* /usr/bin/pip* \
       /usr/local/lib/python3*/site-packages/distutils-precedence.pth \
    && ! python3 -c "import pip" 2>/dev/null
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
# /healthz answers while the event loop does. `healthcheck` reads the same configuration
# as `run`, so it follows a changed http.host/http.port, and passes with http disabled.
HEALTHCHECK --interval=15s --timeout=5s --start-period=90s --retries=3 \
    CMD ["scheduler-daemon", "healthcheck"]
# SIGTERM starts the graceful handover; give it more than shutdown_timeout (30s), e.g.
# `docker stop -t 45` or compose's stop_grace_period.
STOPSIGNAL SIGTERM
ENTRYPOINT ["scheduler-daemon"]
CMD ["run"]
