"""A real Docker engine for tests: is one here, run the CLI with a timeout, clean up.

Tests that need the engine skip (with the reason from ``docker_available``) when there is
none or an image they need is missing; that is the one skip CI allows, since a machine
without Docker cannot run these tests at all. Everything a test creates should be named
(``unique_name``) and registered with ``Cleanup`` so it goes away even when the test fails.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import uuid
from collections.abc import Iterable
from types import TracebackType
from typing import Self

DEFAULT_TIMEOUT = 60.0


class DockerError(RuntimeError):
    """A docker command failed (non-zero exit or timeout); carries its output."""


def docker(
    *args: str,
    timeout: float = DEFAULT_TIMEOUT,
    check: bool = True,
    input: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``docker ARGS`` to completion, capturing text output.

    Raises ``DockerError`` (with the command's output) on a timeout, or on a non-zero exit
    when `check` is true.
    """
    cmd = ["docker", *args]
    try:
        proc = subprocess.run(
            cmd,
            input=input,
            stdin=None if input is not None else subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise DockerError(f"timed out after {timeout}s: {' '.join(cmd)}\n{_out(exc)}") from exc
    if check and proc.returncode != 0:
        raise DockerError(
            f"exit {proc.returncode}: {' '.join(cmd)}\n"
            f"--- stdout\n{proc.stdout}--- stderr\n{proc.stderr}"
        )
    return proc


def _out(exc: subprocess.TimeoutExpired) -> str:
    parts = []
    for stream in (exc.stdout, exc.stderr):
        if stream:
            parts.append(stream.decode(errors="replace") if isinstance(stream, bytes) else stream)
    return "".join(parts)


def docker_available(images: Iterable[str] = ()) -> str | None:
    """None if the engine answers and every image in `images` exists; else why not."""
    if shutil.which("docker") is None:
        return "no docker CLI on PATH"
    try:
        info = docker("info", "--format", "{{.ServerVersion}}", timeout=20, check=False)
    except DockerError as exc:
        return f"docker engine not answering: {exc}"
    if info.returncode != 0 or not info.stdout.strip():
        return f"no docker engine (`docker info` failed): {info.stderr.strip()[:300]}"
    missing = [
        image
        for image in images
        if docker("image", "inspect", image, timeout=20, check=False).returncode != 0
    ]
    if missing:
        return f"docker image(s) missing: {', '.join(missing)}"
    return None


def image_exists(image: str) -> bool:
    return docker("image", "inspect", image, timeout=20, check=False).returncode == 0


def unique_name(prefix: str) -> str:
    """A container/network name that cannot collide with a concurrent run's."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


class Cleanup:
    """Removes the containers and networks registered with it on exit, even on failure.

    Containers go first (``docker rm -f``), then networks; errors during cleanup are
    swallowed so that they never hide the test's own failure.

        with Cleanup() as cleanup:
            net = cleanup.network(unique_name("sd-net"))
            docker("network", "create", net)
            db = cleanup.container(unique_name("sd-db"))
            docker("run", "-d", "--name", db, "--network", net, "postgres:16")
    """

    def __init__(self) -> None:
        self.containers: list[str] = []
        self.networks: list[str] = []

    def container(self, name: str) -> str:
        self.containers.append(name)
        return name

    def network(self, name: str) -> str:
        self.networks.append(name)
        return name

    def close(self) -> None:
        for name in reversed(self.containers):
            _quietly("rm", "-f", "-v", name)
        for name in reversed(self.networks):
            _quietly("network", "rm", name)
        self.containers.clear()
        self.networks.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _quietly(*args: str) -> None:
    with contextlib.suppress(DockerError):
        docker(*args, timeout=60, check=False)
