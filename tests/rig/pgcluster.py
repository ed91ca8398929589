"""A throwaway PostgreSQL cluster: initdb into a temp dir, start, stop, crash, clean up.

The postmaster runs as a direct child of the test process instead of being daemonised
by ``pg_ctl``. Owning it is what makes ``kill()`` reliable: we reap the killed
postmaster ourselves, whereas a daemonised one is reaped (or not) by whatever PID 1
the machine has, and an unreaped zombie still "owns" ``postmaster.pid``, so the next
start would refuse to run. Shutdown modes send the signals ``pg_ctl`` sends, and
readiness is read from ``postmaster.pid`` the way ``pg_ctl -w`` reads it.

For streaming replication (``rig.standby`` builds a primary and a standby from two of
these): ``clone_from()`` makes a cluster a standby of another with ``pg_basebackup -R``,
``promote()`` ends its recovery, ``start(tcp=False)`` serves the Unix socket only (to read
a demoted primary's data where no TCP client can reach it), and ``run_tool()`` runs any
server binary (``pg_waldump``, ``pg_controldata``) as the server's OS user.

Linux only (``kill()`` reads ``/proc``). Never touches any other PostgreSQL server.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Literal, Self, TypedDict

from rig.ports import free_port

StopMode = Literal["smart", "fast", "immediate"]

# What `pg_ctl stop -m MODE` sends to the postmaster.
_STOP_SIGNALS: dict[StopMode, signal.Signals] = {
    "smart": signal.SIGTERM,
    "fast": signal.SIGINT,
    "immediate": signal.SIGQUIT,
}

# Tuned for tests, not durability, except where a test could notice: with fsync off,
# a commit is still written to the kernel before it is acknowledged
# (synchronous_commit=on), so kill() -- which kills processes, not the OS -- never
# loses a commit a client saw succeed. With synchronous_commit=off the last ~0.2 s of
# acknowledged commits vanish on kill(), which would look like a product bug in any
# exactly-once test; with fsync off, keeping it on costs one write() per commit.
DEFAULT_SETTINGS: Mapping[str, str] = {
    "listen_addresses": "127.0.0.1",
    "fsync": "off",
    "synchronous_commit": "on",
    "full_page_writes": "off",
    "max_connections": "300",
    "logging_collector": "off",
    "log_line_prefix": "%m [%p] %a: ",
}

_SERVER_BINARIES = ("initdb", "postgres")
_PID_FILE_STATUS_LINE = 7  # 0-based line of postmaster.pid that reads "ready" once up


class PgClusterError(RuntimeError):
    """The cluster could not be created, started or stopped; the message has the log tail."""


def find_pg_bindir() -> Path | None:
    """The directory of the PostgreSQL server binaries, or None if there are none.

    ``pg_config --bindir`` first (it may name a client-only install, hence the check),
    then the newest ``/usr/lib/postgresql/*/bin`` (Debian/Ubuntu keep the server
    binaries off PATH).
    """
    candidates: list[Path] = []
    pg_config = shutil.which("pg_config")
    if pg_config is not None:
        try:
            result = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, check=True, timeout=10
            )
        except (OSError, subprocess.SubprocessError):
            pass
        else:
            candidates.append(Path(result.stdout.strip()))
    candidates += sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=_version_key, reverse=True)
    for bindir in candidates:
        if all(os.access(bindir / name, os.X_OK) for name in _SERVER_BINARIES):
            return bindir
    return None


def _version_key(bindir: Path) -> tuple[int, ...]:
    return tuple(int(part) for part in bindir.parent.name.split(".") if part.isdigit())


@dataclass(frozen=True)
class _OsUser:
    uid: int
    gid: int


def _server_os_user() -> _OsUser | None:
    """Who runs initdb and postgres: us, unless we are root, which both refuse."""
    if os.geteuid() != 0:
        return None
    try:
        entry = pwd.getpwnam("postgres")
    except KeyError:
        raise PgClusterError(
            "running as root, and initdb/postgres refuse root: create a 'postgres' OS user"
        ) from None
    return _OsUser(entry.pw_uid, entry.pw_gid)


class PgCluster:
    """A PostgreSQL cluster in a temporary directory, listening on 127.0.0.1 only.

    ``start()`` creates it the first time; after ``stop()``, ``restart()`` or ``kill()``
    it starts again on the same data and the same port. ``cleanup()`` (or leaving the
    ``with`` block) stops it and deletes everything.
    """

    host = "127.0.0.1"

    def __init__(
        self,
        bindir: Path | None = None,
        *,
        settings: Mapping[str, str] | None = None,
        timeout: float = 60.0,
    ) -> None:
        found = bindir or find_pg_bindir()
        if found is None:
            raise PgClusterError("no PostgreSQL server binaries (initdb, postgres) found")
        self.bindir = found
        self.timeout = timeout
        self._settings = {**DEFAULT_SETTINGS, **(settings or {})}
        self._os_user = _server_os_user()
        self._base_dir: Path | None = None
        self._port: int | None = None
        self._postmaster: subprocess.Popen[bytes] | None = None

    # -- where things are ------------------------------------------------------------

    @property
    def base_dir(self) -> Path:
        """The temp dir holding ``data/``, the server log and the Unix socket."""
        if self._base_dir is None:
            raise PgClusterError("the cluster has not been created yet: call start()")
        return self._base_dir

    @property
    def data_dir(self) -> Path:
        return self.base_dir / "data"

    @property
    def log_path(self) -> Path:
        return self.base_dir / "postgres.log"

    @property
    def port(self) -> int:
        if self._port is None:
            raise PgClusterError("the cluster has no port yet: call start()")
        return self._port

    @property
    def pid(self) -> int | None:
        """The postmaster's pid while it runs."""
        postmaster = self._postmaster
        return postmaster.pid if postmaster is not None and postmaster.poll() is None else None

    def dsn(self, dbname: str = "postgres") -> str:
        return f"postgresql://postgres@{self.host}:{self.port}/{dbname}"

    def socket_dsn(self, dbname: str = "postgres") -> str:
        """A DSN through the Unix socket, which also answers after ``start(tcp=False)``."""
        return f"postgresql://postgres@/{dbname}?host={self.base_dir}&port={self.port}"

    def is_running(self) -> bool:
        return self._postmaster is not None and self._postmaster.poll() is None

    def log_tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except (FileNotFoundError, PgClusterError):
            return "(no server log)"
        return "\n".join(lines[-n:])

    # -- lifecycle -------------------------------------------------------------------

    def start(self, *, tcp: bool = True) -> None:
        """Start the server and wait until it accepts connections.

        ``tcp=False``: on the Unix socket in ``base_dir`` only (``listen_addresses=''``;
        see :meth:`socket_dsn`), so that no client of the TCP port can reach this server.
        """
        if self.is_running():
            raise PgClusterError("the cluster is already running")
        if self._base_dir is None:
            self._initdb()
        if self._port is not None:
            self._launch(self._port, tcp=tcp)
            return
        # A port that was free when probed can be taken before the postmaster binds it;
        # only the first start may move to another one (later ones keep the DSN stable).
        for attempt in range(3):
            port = free_port()
            try:
                self._launch(port, tcp=tcp)
            except PgClusterError:
                if attempt == 2 or "could not bind" not in self.log_tail(5):
                    raise
            else:
                self._port = port
                return

    def stop(self, mode: StopMode = "fast") -> None:
        """Shut the server down (no-op if it is not running); "fast" ends sessions."""
        postmaster = self._postmaster
        if postmaster is None or postmaster.poll() is not None:
            self._postmaster = None
            return
        postmaster.send_signal(_STOP_SIGNALS[mode])
        try:
            postmaster.wait(self.timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise PgClusterError(
                f"postgres did not stop ({mode}) within {self.timeout}s; killed it\n"
                + self.log_tail()
            ) from None
        self._postmaster = None

    def restart(self, mode: StopMode = "fast") -> None:
        self.stop(mode)
        self.start()

    def kill(self) -> None:
        """Crash the server: SIGKILL the postmaster, then every process it had forked.

        Every session drops at once and the next ``start()`` runs crash recovery. The
        children are killed and waited for too (they would exit by themselves soon):
        a backend that outlives its postmaster keeps the old shared memory attached,
        and a new postmaster refuses to start until it has gone.
        """
        postmaster = self._postmaster
        if postmaster is None or postmaster.poll() is not None:
            raise PgClusterError("the cluster is not running")
        # Stopped, the postmaster cannot fork a child we would miss in the scan.
        postmaster.send_signal(signal.SIGSTOP)
        children = _child_pids(postmaster.pid)
        postmaster.kill()
        postmaster.wait()
        self._postmaster = None
        for pid in children:
            with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
                os.kill(pid, signal.SIGKILL)
        _wait_gone(children, timeout=self.timeout)

    def cleanup(self) -> None:
        """Stop the server and delete its directory; safe to call more than once."""
        try:
            with contextlib.suppress(PgClusterError):  # it raises after killing the server
                self.stop("fast")
        finally:
            if self._base_dir is not None:
                shutil.rmtree(self._base_dir, ignore_errors=True)
                self._base_dir = None

    # -- replication ------------------------------------------------------------------

    def clone_from(
        self, host: str, port: int, *, application_name: str, primary_conninfo: str | None = None
    ) -> None:
        """Make this cluster a standby of the server at ``host:port``: a fresh data
        directory from ``pg_basebackup -R`` (WAL streamed alongside), replacing whatever
        data it had. It keeps its directory and its port, so a DSN naming it stays valid
        when a demoted primary is rebuilt as a standby. Start it afterwards.

        ``primary_conninfo`` (default: ``host``/``port``) is where the standby streams
        from, under ``application_name`` (what ``synchronous_standby_names`` names).
        Settings a copied ``postgresql.auto.conf`` carried from the source's own role
        (its ``synchronous_standby_names``, its ``primary_conninfo``) are dropped: the
        standby would inherit them on promotion.
        """
        if self.is_running():
            raise PgClusterError("stop the cluster before cloning another into it")
        if self._base_dir is None:
            self._make_base_dir()
        shutil.rmtree(self.data_dir, ignore_errors=True)
        self.run_tool(
            "pg_basebackup", "-D", str(self.data_dir), "-R", "-X", "stream", "-c", "fast",
            "--no-sync", "-h", host, "-p", str(port), "-U", "postgres",
        )  # fmt: skip
        conninfo = primary_conninfo or f"host={host} port={port} user=postgres"
        auto_conf = self.data_dir / "postgresql.auto.conf"
        dropped = ("synchronous_standby_names", "primary_conninfo")
        kept = [
            line
            for line in auto_conf.read_text().splitlines()
            if not line.strip().startswith(dropped)
        ]
        kept.append(
            _conf_line("primary_conninfo", f"{conninfo} application_name={application_name}")
        )
        auto_conf.write_text("\n".join(kept) + "\n")

    def promote(self, *, wait: bool = True) -> None:
        """End a standby's recovery (``pg_ctl promote``). ``wait``: return once it is a
        primary (``-w``, which looks every 0.1 s); else at once, for a caller that
        watches more closely itself."""
        if not self.is_running():
            raise PgClusterError("the cluster is not running")
        how = ["-w", "-t", str(int(self.timeout))] if wait else ["-W"]
        self.run_tool("pg_ctl", "promote", *how, "-D", str(self.data_dir))

    def run_tool(
        self, tool: str, *args: str, check: bool = True, env: Mapping[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run a binary of ``bindir`` as the server's OS user, in ``base_dir``; with
        ``check``, a non-zero exit raises :class:`PgClusterError` with its output."""
        result = subprocess.run(
            [str(self.bindir / tool), *args],
            capture_output=True,
            text=True,
            timeout=self.timeout,
            env={**os.environ, **env} if env is not None else None,
            **self._as_server(),
        )
        if check and result.returncode != 0:
            raise PgClusterError(
                f"{tool} failed ({result.returncode}):\n{result.stdout}{result.stderr}"
            )
        return result

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.cleanup()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cleanup()

    # -- internals -------------------------------------------------------------------

    def _make_base_dir(self) -> Path:
        base_dir = Path(tempfile.mkdtemp(prefix="scheduler-pg-"))
        self._base_dir = base_dir
        if self._os_user is not None:
            # mkdtemp makes it 0700 root: the server user must own what it writes into.
            os.chown(base_dir, self._os_user.uid, self._os_user.gid)
        return base_dir

    def _initdb(self) -> None:
        base_dir = self._make_base_dir()
        command = [str(self.bindir / "initdb"), "-D", str(self.data_dir), "-A", "trust"]
        command += ["-U", "postgres", "--no-sync", "-E", "UTF8", "--no-locale"]
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=self.timeout, **self._as_server()
        )
        if result.returncode != 0:
            hint = ""
            if self._os_user is not None:
                hint = f"\n(the 'postgres' OS user must be able to enter {base_dir.parent})"
            raise PgClusterError(
                f"initdb failed ({result.returncode}):\n{result.stdout}{result.stderr}{hint}"
            )

    def _launch(self, port: int, *, tcp: bool = True) -> None:
        settings = {
            **self._settings,
            "port": str(port),
            "unix_socket_directories": str(self.base_dir),
        }
        if not tcp:
            settings["listen_addresses"] = ""
        command = [str(self.bindir / "postgres"), "-D", str(self.data_dir)]
        for name, value in settings.items():
            command += ["-c", f"{name}={value}"]
        with self.log_path.open("ab") as log:
            # Its own session, so a Ctrl-C meant for pytest does not shut it down
            # before the fixtures' teardown does.
            postmaster = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                **self._as_server(),
            )
        self._postmaster = postmaster
        try:
            self._wait_ready(postmaster)
        except BaseException:
            if postmaster.poll() is None:
                postmaster.kill()
                postmaster.wait()
            self._postmaster = None
            raise

    def _wait_ready(self, postmaster: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + self.timeout
        pid_file = self.data_dir / "postmaster.pid"
        while True:
            if postmaster.poll() is not None:
                raise PgClusterError(
                    f"postgres exited with {postmaster.returncode} while starting\n"
                    + self.log_tail()
                )
            try:
                lines = pid_file.read_text().splitlines()
            except FileNotFoundError:
                lines = []
            # The pid check skips a stale file left behind by a killed postmaster.
            if (
                len(lines) > _PID_FILE_STATUS_LINE
                and lines[0].strip() == str(postmaster.pid)
                and lines[_PID_FILE_STATUS_LINE].strip() == "ready"
            ):
                return
            if time.monotonic() > deadline:
                raise PgClusterError(
                    f"postgres was not ready within {self.timeout}s\n" + self.log_tail()
                )
            time.sleep(0.01)

    def _as_server(self) -> _ServerProcessArgs:
        """Popen arguments that run a command as the server's OS user, in a dir it can read."""
        if self._os_user is None:
            return {"cwd": self.base_dir}
        return {
            "cwd": self.base_dir,
            "user": self._os_user.uid,
            "group": self._os_user.gid,
            "extra_groups": [],
        }


class _ServerProcessArgs(TypedDict, total=False):
    cwd: Path
    user: int
    group: int
    extra_groups: list[int]


def _conf_line(name: str, value: str) -> str:
    """``name = 'value'`` as postgresql.conf quotes it (a quote doubled)."""
    quoted = value.replace("'", "''")
    return f"{name} = '{quoted}'"


def _child_pids(parent: int) -> list[int]:
    """Pids whose parent is `parent`, from /proc."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # The command name in parentheses may contain spaces: split after it.
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the process exited while we looked
        if int(fields[1]) == parent:
            children.append(int(stat.parent.name))
    return children


def _wait_gone(pids: list[int], timeout: float) -> None:
    """Wait until none of `pids` is alive; a zombie counts as gone (it holds no memory)."""
    deadline = time.monotonic() + timeout
    while any(_is_alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            raise PgClusterError(f"postgres processes {pids} still alive after SIGKILL")
        time.sleep(0.01)


def _is_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")
