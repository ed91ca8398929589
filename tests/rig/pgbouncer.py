"""PgBouncer in front of the throwaway cluster, for the transaction-pooler tests.

Runs the ``pgbouncer`` binary (Debian package ``pgbouncer``) as a child process with an
ini file of its own in a temp dir: ``auth_type = trust``, listening on a free port of
127.0.0.1, no Unix socket. PgBouncer refuses to run as root, so as root it runs as the
``postgres`` OS user (the same one the cluster runs as).
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Self

from rig.ports import free_port

# asyncpg sends these as startup parameters (the daemon's server_settings). PgBouncer
# only passes on a few it tracks and refuses a connection that sends any other, unless
# told to ignore it. A deployment behind PgBouncer needs the same line.
IGNORED_STARTUP_PARAMETERS = (
    "statement_timeout,tcp_keepalives_idle,tcp_keepalives_interval,"
    "tcp_keepalives_count,tcp_user_timeout,extra_float_digits,search_path"
)


def find_pgbouncer() -> str | None:
    return shutil.which("pgbouncer") or next(
        (p for p in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if os.access(p, os.X_OK)),
        None,
    )


class PgBouncer:
    """``PgBouncer(binary, host, port, pool_mode=...)`` as a context manager; ``.port``."""

    def __init__(
        self,
        binary: str,
        target_host: str,
        target_port: int,
        *,
        pool_mode: str = "transaction",
        pool_size: int = 10,
    ) -> None:
        self.binary = binary
        self.target_host = target_host
        self.target_port = target_port
        self.pool_mode = pool_mode
        self.pool_size = pool_size
        self.port = free_port()
        self.directory = Path(tempfile.mkdtemp(prefix="scheduler-pgbouncer-"))
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        return self.directory / "pgbouncer.log"

    def dsn(self, dbname: str, user: str = "postgres") -> str:
        return f"postgresql://{user}@127.0.0.1:{self.port}/{dbname}"

    def start(self) -> Self:
        ini = self.directory / "pgbouncer.ini"
        (self.directory / "userlist.txt").write_text('"postgres" ""\n')
        ini.write_text(
            "[databases]\n"
            f"* = host={self.target_host} port={self.target_port}\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            "auth_type = trust\n"
            f"auth_file = {self.directory / 'userlist.txt'}\n"
            f"pool_mode = {self.pool_mode}\n"
            f"default_pool_size = {self.pool_size}\n"
            "max_client_conn = 200\n"
            f"ignore_startup_parameters = {IGNORED_STARTUP_PARAMETERS}\n"
            f"logfile = {self.log_path}\n"
            f"pidfile = {self.directory / 'pgbouncer.pid'}\n"
        )
        extra: dict[str, object] = {}
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            for path in (self.directory, *self.directory.iterdir()):
                os.chown(path, user.pw_uid, user.pw_gid)
            extra = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
        self._process = subprocess.Popen(  # type: ignore[call-overload]
            [self.binary, str(ini)],
            cwd=self.directory,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            **extra,
        )
        self._wait_listening()
        return self

    def _wait_listening(self, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self._process is not None
            if self._process.poll() is not None:
                raise RuntimeError(
                    f"pgbouncer exited with {self._process.returncode}\n{self.log()}"
                )
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"pgbouncer not listening: {exc}\n{self.log()}") from None
                time.sleep(0.05)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except FileNotFoundError:
            return "(no pgbouncer log)"

    def close(self) -> None:
        process = self._process
        if process is not None and process.poll() is None:
            process.terminate()  # SIGTERM: PgBouncer 1.18 shuts down at once
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._process = None
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
