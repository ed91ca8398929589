"""SQLite leadership keys on the database file's identity, not on how its path is spelled.

A leader holds two locks per loop: an flock on a sidecar ``<real db file>.<loop>.lock``
next to the real file (found by path), and a byte lock on the database file itself (found
by inode). So processes reaching one database through a symlink to the file or to a
directory on the way, through a bind-mounted directory, under a new name after a rename,
or after the sidecar was removed, elect one leader between them; a leader whose path
no longer names its file steps down and leads no more. Setups that cannot be made safe
are refused at startup (exit 78): a hard-linked database file or a file mounted on its own
(SQLite's -wal and -shm are per path) and a network filesystem (flock is not reliable
across hosts). No network filesystem is available here, so that refusal is tested on
crafted ``/proc/self/mountinfo`` text. Exclusion is proven by the wall-clock intervals the
probe's runs record outside the database.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import os
import shutil
import signal
import struct
import subprocess
import time
from pathlib import Path

import pytest
from rig.databases import copy_sqlite
from rig.plugin import ci_is_set
from rig.processes import CLI, DaemonProcess, Daemons, daemon_env, run_cli
from rig.ticks import (
    PLUGIN_ONLY,
    assert_no_overlap,
    event_time,
    first_leader,
    python_probe_env,
    python_ticks,
    stop_all,
    wait_for_event,
    wait_for_ticks,
)

from scheduler_daemon.config.settings import Settings
from scheduler_daemon.db.sqlite import SqliteStore
from scheduler_daemon.db.sqlite_file import (
    Mount,
    check_database_file,
    is_network_filesystem,
    mount_containing,
    parse_mountinfo,
    real_path,
    system_mounts,
)
from scheduler_daemon.errors import ConfigError
from scheduler_daemon.leadership.sqlite_flock import DATABASE_LOCK_BYTES, FlockGuard, lock_path
from scheduler_daemon.logs import get_logger
from scheduler_daemon.metrics import Metrics
from scheduler_daemon.schema_gate import SchemaGate


def _url(path: Path) -> str:
    """``sqlite:////abs/path`` for `path` as spelled (rig's ``sqlite_url_for`` resolves)."""
    assert path.is_absolute()
    return f"sqlite:///{path}"


def _lock_files(root: Path) -> set[Path]:
    """Every ``*.lock`` file under `root`, found without following symlinks."""
    found: set[Path] = set()
    for directory, _, files in os.walk(root):
        found.update(Path(directory, name) for name in files if name.endswith(".lock"))
    return found


def _held(path: Path) -> bool:
    """Whether some process holds an flock on `path` (we try to take it, and let go)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _byte_held(database: Path, loop: str) -> bool:
    """Whether some process holds `loop`'s byte lock on the database file (asked without
    taking it). Only ever on a file this test process has no SQLite connection to: closing
    a descriptor drops the process's fcntl locks on the file."""
    fd = os.open(database, os.O_RDONLY | os.O_CLOEXEC)
    try:
        request = struct.pack("hhqqi", fcntl.F_WRLCK, os.SEEK_SET, DATABASE_LOCK_BYTES[loop], 1, 0)
        answer = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, request)
    finally:
        os.close(fd)
    return struct.unpack("hhqqi", answer)[0] != fcntl.F_UNLCK


def _plugin_events(process: DaemonProcess, event: str) -> list[dict[str, object]]:
    return [
        entry
        for entry in process.log_events()
        if entry.get("event") == event and entry.get("loop") == "plugin"
    ]


# -- two paths to one file: one leader ------------------------------------------------------


@pytest.mark.parametrize("link", ["file", pytest.param("directory", marks=pytest.mark.chaos_long)])
def test_two_paths_to_one_sqlite_file_elect_one_leader(
    link: str, sqlite_template: Path, daemons: Daemons, tmp_path: Path
) -> None:
    """One process opens the database by its real path, the other through a symlink (to
    the file, or to its directory): exactly one leads, both use the sidecar next to the
    real file, and after a SIGTERM the other takes over from it."""
    data = tmp_path / "data"
    data.mkdir()
    database = data / "scheduler.db"
    copy_sqlite(sqlite_template, database)
    aliases = tmp_path / "aliases"
    aliases.mkdir()
    if link == "file":
        alias = aliases / "alias.db"
        alias.symlink_to(database)
    else:
        (aliases / "data").symlink_to(data, target_is_directory=True)
        alias = aliases / "data" / "scheduler.db"
    expected_lock = real_path(data) / "scheduler.db.plugin.lock"

    probe_log = tmp_path / "probe.jsonl"
    # Runs of 0.3 s back to back: two leaders could not help overlapping.
    env = {
        **python_probe_env(probe_log, every="0.1s", sleep=0.3),
        "SCHEDULER_LOCK__HEARTBEAT_INTERVAL": "0.5",
    }
    replicas = [
        daemons.start(
            {**env, "SCHEDULER_DATABASE_URL": _url(path), "SCHEDULER_INSTANCE_ID": name},
            PLUGIN_ONLY,
            name=name,
        )
        for name, path in (("by-real-path", database), ("by-alias", alias))
    ]
    leader = first_leader(replicas)
    (standby,) = (replica for replica in replicas if replica is not leader)
    waiting = standby.wait_for_log("leader.waiting", loop="plugin")
    # Side by side, the standby stays a standby while the leader works (four runs of 0.3 s:
    # more than two heartbeats, at which the leader looks at its path again).
    wait_for_ticks(probe_log, 4, instance=leader.name, since=event_time(waiting))

    assert _held(expected_lock)
    assert _lock_files(tmp_path) == {expected_lock}  # none next to the alias
    acquired = [
        entry for replica in replicas for entry in _plugin_events(replica, "leader.acquired")
    ]
    assert [entry["lock_file"] for entry in acquired] == [str(expected_lock)], acquired
    assert waiting["lock_file"] == str(expected_lock)

    handed_over_at = time.time()
    leader.signal(signal.SIGTERM)
    assert leader.wait(30) == 0, leader.output()[-3000:]
    taken = wait_for_event(standby, "leader.acquired", after=handed_over_at, loop="plugin")
    assert taken["lock_file"] == str(expected_lock)
    takeover = (event_time(taken) - handed_over_at) * 1000
    wait_for_ticks(probe_log, 4, instance=standby.name)
    stop_all([standby])

    summary = assert_no_overlap(python_ticks(probe_log), min_ticks=8, min_instances=2)
    print(
        f"\nsymlinked {link}: ticks per instance {summary['plugin']}, "
        f"first leader {leader.name}, takeover after SIGTERM {takeover:.0f} ms"
    )
    assert set(summary["plugin"]) == {leader.name, standby.name}
    assert _lock_files(tmp_path) == {expected_lock}


def _replica(env: dict[str, str], database: Path, name: str) -> dict[str, str]:
    return {**env, "SCHEDULER_DATABASE_URL": _url(database), "SCHEDULER_INSTANCE_ID": name}


# -- the file renamed, its lock file removed: still one leader -------------------------------


@pytest.mark.parametrize("change", ["renamed", "replaced"])
def test_a_database_renamed_or_replaced_under_its_leader_keeps_one_leader(
    change: str, sqlite_template: Path, daemons: Daemons, tmp_path: Path
) -> None:
    """Issue 20: the old leader kept the old lock file, a process started on the new name
    locked a new one, and both ran the loop's work. Now a newcomer on the new name waits on
    the byte lock of the file itself; one on a new file put at the old path (a restored
    copy) waits on the lock file. The old leader, finding its path changed at its next
    heartbeat, steps down, leads no more and exits 78 naming the cause."""
    path, aside = tmp_path / "scheduler.db", tmp_path / "renamed.db"
    copy_sqlite(sqlite_template, path)
    probe_log = tmp_path / "probe.jsonl"
    # The default heartbeat (2 s): the newcomer usually starts, and waits, before the old
    # leader looks at its path again. Exclusion does not depend on it.
    env = python_probe_env(probe_log, every="0.1s", sleep=0.3)
    first = daemons.start(_replica(env, path, "first"), PLUGIN_ONLY, name="first")
    first.wait_for_log("leader.acquired", loop="plugin")
    changed_at = time.time()
    for suffix in ("", "-wal", "-shm"):  # as a careful operator would: nothing is lost
        os.rename(f"{path}{suffix}", f"{aside}{suffix}")
    if change == "renamed":
        newcomer_path, why = aside, "nothing is there now"
        assert _byte_held(aside, "plugin")  # whoever opens the new name now is kept out
    else:
        copy_sqlite(sqlite_template, path)
        newcomer_path, why = path, "another file is there now"
        assert _held(lock_path(path, "plugin"))  # whoever opens the old path is kept out
    second = daemons.start(_replica(env, newcomer_path, "second"), PLUGIN_ONLY, name="second")

    taken = wait_for_event(second, "leader.acquired", loop="plugin")
    assert taken["lock_file"] == str(lock_path(newcomer_path, "plugin"))
    assert first.wait(30) == 78, first.output()[-3000:]
    (stepped,) = _plugin_events(first, "leader.stepped_down")
    reason = str(stepped["reason"])
    assert reason.startswith(
        f"database_url: {path} is no longer the database file this process opened ({why}: "
        "it was renamed, removed or replaced while the daemon ran)"
    ), reason
    assert len(_plugin_events(first, "leader.acquired")) == 1  # never led again
    waited = second.wait_for_log("leader.waiting", loop="plugin")
    wait_for_ticks(probe_log, 3, instance="second")
    stop_all([second])

    summary = assert_no_overlap(python_ticks(probe_log), min_ticks=4, min_instances=2)
    kept_out = event_time(waited) < event_time(stepped)
    print(
        f"\n{change}: runs per instance {summary['plugin']}; the old leader stepped down "
        f"{event_time(stepped) - changed_at:.2f}s after the change; the newcomer "
        f"{'waited on a lock' if kept_out else 'started after the old leader left'} and led "
        f"{event_time(taken) - event_time(stepped):.3f}s after that"
    )


def test_a_lock_file_removed_under_its_leader_keeps_one_leader(
    sqlite_template: Path, daemons: Daemons, tmp_path: Path
) -> None:
    """The lock file removed under a leader and a standby: a newcomer makes a new one and
    takes its flock, but the database file's byte keeps it waiting; the leader locks the
    new lock file at its next heartbeat; after two hand-overs (SIGTERM, SIGKILL) each of
    the three has led, never two at once."""
    database = tmp_path / "scheduler.db"
    copy_sqlite(sqlite_template, database)
    lock = lock_path(database, "plugin")
    probe_log = tmp_path / "probe.jsonl"
    env = {
        **python_probe_env(probe_log, every="0.1s", sleep=0.3),
        "SCHEDULER_LOCK__HEARTBEAT_INTERVAL": "0.5",
    }
    leader = daemons.start(_replica(env, database, "a"), PLUGIN_ONLY, name="a")
    leader.wait_for_log("leader.acquired", loop="plugin")
    standby = daemons.start(_replica(env, database, "b"), PLUGIN_ONLY, name="b")
    standby.wait_for_log("leader.waiting", loop="plugin")

    lock.unlink()
    removed_at = time.time()
    newcomer = daemons.start(_replica(env, database, "c"), PLUGIN_ONLY, name="c")
    newcomer.wait_for_log("leader.waiting", loop="plugin")
    restored = wait_for_event(leader, "leader.lock_file_restored", after=removed_at, loop="plugin")
    assert _held(lock)
    # All three side by side: the two others stay standbys while the leader works on.
    wait_for_ticks(probe_log, 3, instance="a", since=event_time(restored))
    assert _lock_files(tmp_path) == {lock}

    leader.signal(signal.SIGTERM)
    assert leader.wait(30) == 0, leader.output()[-3000:]
    second = first_leader([standby, newcomer])
    wait_for_ticks(probe_log, 2, instance=second.name)
    second.kill()
    (third,) = (p for p in (standby, newcomer) if p is not second)
    first_leader([third])
    wait_for_ticks(probe_log, 2, instance=third.name)
    stop_all([third])

    summary = assert_no_overlap(python_ticks(probe_log), min_ticks=6, min_instances=3)
    print(
        f"\nlock file removed: runs per instance {summary['plugin']}; the leader locked "
        f"the new one {event_time(restored) - removed_at:.2f}s after the removal"
    )


# -- bind mounts -------------------------------------------------------------------------------


def _in_mount_namespace(source: Path, target: Path, argv: list[str]) -> list[str]:
    """`argv` run in a private mount namespace of its own where `source` is bind-mounted
    on `target` (exec'd: the pid is the daemon's, signals reach it)."""
    script = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
            str(source), str(target), *argv]  # fmt: skip


@pytest.fixture(scope="module")
def mount_namespaces() -> None:
    reason = None
    if os.geteuid() != 0:
        reason = "bind mounts need root"
    elif shutil.which("unshare") is None:
        reason = "no unshare command"
    elif subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode != 0:
        reason = "cannot make a mount namespace here"
    if reason is not None:
        if ci_is_set():
            pytest.fail(f"bind mounts are required under CI: {reason}")
        pytest.skip(reason)


def test_bind_mounts_a_mounted_directory_shares_the_locks_a_mounted_file_is_refused(
    mount_namespaces: None, sqlite_template: Path, daemons: Daemons, tmp_path: Path
) -> None:
    """A file mounted on its own would put its -wal and -shm beside the mount point: refused
    (exit 78). Its directory mounted elsewhere (what the refusal advises) is one set of
    files: a process there and one on the real path elect one leader."""
    data = tmp_path / "data"
    data.mkdir()
    database = data / "scheduler.db"
    copy_sqlite(sqlite_template, database)
    mounts = tmp_path / "mounts"
    (mounts / "dir").mkdir(parents=True)
    alone = mounts / "alone.db"
    alone.touch()
    # `migrate` refuses it as `run` does, and starts faster; alongside the rest.
    refused = daemons.spawn(
        _in_mount_namespace(database, alone, [*CLI, "migrate"]),
        daemon_env({"SCHEDULER_DATABASE_URL": _url(alone)}),
        name="refused",
    )

    probe_log = tmp_path / "probe.jsonl"
    env = {
        **python_probe_env(probe_log, every="0.1s", sleep=0.3),
        "SCHEDULER_LOCK__HEARTBEAT_INTERVAL": "0.5",
    }
    direct = daemons.start(_replica(env, database, "direct"), PLUGIN_ONLY, name="direct")
    direct.wait_for_log("leader.acquired", loop="plugin")
    mounted = daemons.spawn(
        _in_mount_namespace(data, mounts / "dir", [*CLI, *PLUGIN_ONLY]),
        daemon_env(_replica(env, mounts / "dir" / "scheduler.db", "mounted")),
        name="mounted",
    )
    waiting = mounted.wait_for_log("leader.waiting", loop="plugin")
    # Side by side, the mounted one stays a standby while the leader works.
    wait_for_ticks(probe_log, 3, instance="direct", since=event_time(waiting))
    direct.signal(signal.SIGTERM)
    assert direct.wait(30) == 0, direct.output()[-3000:]
    first_leader([mounted])
    wait_for_ticks(probe_log, 2, instance="mounted")
    stop_all([mounted])

    assert refused.wait(30) == 78, refused.output()[-3000:]
    message = refused.output().strip().splitlines()[-1]
    assert message.startswith(
        f"scheduler-daemon: database_url: {alone} is a file mounted on its own"
    ), message
    assert "Mount the directory that holds it instead" in message
    summary = assert_no_overlap(python_ticks(probe_log), min_ticks=4, min_instances=2)
    print(f"\nbind-mounted directory: runs per instance {summary['plugin']}")


def test_lock_path_names_the_sidecar_of_the_real_file(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    database = data / "scheduler.db"
    database.touch()
    (tmp_path / "alias.db").symlink_to(database)
    (tmp_path / "dir").symlink_to(data, target_is_directory=True)
    (tmp_path / "chain.db").symlink_to(tmp_path / "alias.db")
    expected = real_path(data) / "scheduler.db.plugin.lock"
    for spelling in (
        database,
        tmp_path / "alias.db",
        tmp_path / "chain.db",
        tmp_path / "dir" / "scheduler.db",
        tmp_path / "dir" / ".." / "data" / "scheduler.db",
    ):
        assert lock_path(spelling, "plugin") == expected, spelling
    assert lock_path(database, "publish") == expected.with_name("scheduler.db.publish.lock")
    # Not created yet: resolved through its (symlinked) directory.
    assert (
        lock_path(tmp_path / "dir" / "new.db", "plugin") == real_path(data) / "new.db.plugin.lock"
    )


# -- refused: hard links ---------------------------------------------------------------------


def test_a_hard_linked_database_is_refused_by_run_and_migrate(
    sqlite_template: Path, tmp_path: Path
) -> None:
    database = tmp_path / "scheduler.db"
    copy_sqlite(sqlite_template, database)
    other = tmp_path / "other.db"
    os.link(database, other)
    for args, path in ((PLUGIN_ONLY, other), (("migrate",), other), (PLUGIN_ONLY, database)):
        result = run_cli(args, {"SCHEDULER_DATABASE_URL": _url(path)}, timeout=30, cwd=tmp_path)
        assert result.returncode == 78, (args, result.stdout, result.stderr[-3000:])
        lines = result.stderr.strip().splitlines()
        message = lines[-1]
        assert message.startswith("scheduler-daemon: database_url: "), lines
        assert f"{path} has 2 hard links" in message
        assert "Remove the extra links" in message
        assert "leader.acquired" not in result.stderr  # refused before leading
    assert _lock_files(tmp_path) == set()


def test_check_database_file_accepts_a_plain_new_or_symlinked_file(tmp_path: Path) -> None:
    database = tmp_path / "scheduler.db"
    assert check_database_file(database) == real_path(database)  # created on open
    database.touch()
    (tmp_path / "alias.db").symlink_to(database)
    assert check_database_file(tmp_path / "alias.db") == real_path(database)
    os.link(database, tmp_path / "hard.db")
    with pytest.raises(
        ConfigError, match=r"^database_url: .*alias\.db \(really .*scheduler\.db\) has 2 hard links"
    ):
        check_database_file(tmp_path / "alias.db")


# -- refused: network filesystems (crafted mountinfo) -----------------------------------------

MOUNTINFO = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw,discard
40 27 0:40 / /srv rw,relatime shared:2 master:7 - xfs /dev/vdb1 rw
41 40 0:41 /exports/app /srv/app rw,relatime - nfs4 fileserver:/exports/app rw,vers=4.2
42 40 0:42 / /srv/app-local rw - btrfs /dev/vdc rw,subvol=/
43 27 0:43 / /mnt/my\\040share rw - cifs //nas/share rw,vers=3.1.1
44 27 0:44 / /home/u/remote rw,nosuid - fuse.sshfs u@host:/home/u rw,user_id=1000
45 27 0:45 / /mnt/vm rw - 9p hostshare rw,trans=virtio
46 27 0:46 / /tmp rw - tmpfs tmpfs rw
56 27 0:56 / /tmp rw - ext4 /dev/vde rw
47 27 0:47 / /var/lib/docker/overlay2/x/merged rw - overlay overlay rw,lowerdir=/a
48 56 0:48 / /tmp/tab\\011and\\134back rw - nfs host:/x rw
49 27 0:49 / /mnt/old rw - fuse sshfs#u@host:/ rw
50 27 0:50 / /mnt/crypt rw - fuse.gocryptfs /home/u/.c rw
51 44 0:51 / /home/u/remote/local rw - ext4 /dev/vdd rw
52 27 0:52 / /mnt/ceph rw - ceph 10.0.0.1:6789:/ rw
53 27 0:53 / /mnt/gluster rw - fuse.glusterfs gl:/vol rw
54 27 0:54 / /mnt/lustre rw - lustre mgs@tcp:/fs rw
55 27 0:55 / /afs rw - afs AFS rw
garbage line
"""

MOUNTS = parse_mountinfo(MOUNTINFO)


def test_parse_mountinfo_fields_and_escapes() -> None:
    assert len(MOUNTS) == 19  # the garbage line is skipped
    assert MOUNTS[1] == Mount("/", "ext4", "/dev/vda")
    # Optional fields (shared:2 master:7) before the separator do not shift the rest.
    assert MOUNTS[2] == Mount("/srv", "xfs", "/dev/vdb1")
    assert MOUNTS[3] == Mount("/srv/app", "nfs4", "fileserver:/exports/app")
    assert MOUNTS[5].mount_point == "/mnt/my share"
    assert MOUNTS[11].mount_point == "/tmp/tab\tand\\back"


@pytest.mark.parametrize(
    ("path", "mount_point", "fstype"),
    [
        ("/var/lib/scheduler.db", "/", "ext4"),
        ("/srv/scheduler.db", "/srv", "xfs"),
        ("/srv/app/scheduler.db", "/srv/app", "nfs4"),
        ("/srv/app", "/srv/app", "nfs4"),
        # A prefix of the string, not of the path: /srv/app-local is not under /srv/app.
        ("/srv/app-local/scheduler.db", "/srv/app-local", "btrfs"),
        ("/srv/application.db", "/srv", "xfs"),
        ("/mnt/my share/scheduler.db", "/mnt/my share", "cifs"),
        ("/mnt/my/scheduler.db", "/", "ext4"),
        ("/home/u/remote/x/scheduler.db", "/home/u/remote", "fuse.sshfs"),
        ("/home/u/remote/local/scheduler.db", "/home/u/remote/local", "ext4"),
        ("/tmp/tab\tand\\back/s.db", "/tmp/tab\tand\\back", "nfs"),
        # Two mounts on /tmp: the later one (ext4) hides the tmpfs.
        ("/tmp/scheduler.db", "/tmp", "ext4"),
    ],
)
def test_the_mount_of_a_path_is_its_longest_mount_point(
    path: str, mount_point: str, fstype: str
) -> None:
    mount = mount_containing(MOUNTS, Path(path))
    assert mount is not None
    assert (mount.mount_point, mount.fstype) == (mount_point, fstype)


def test_no_mounts_no_mount() -> None:
    assert mount_containing([], Path("/x/y.db")) is None
    assert (
        mount_containing(parse_mountinfo("1 0 0:1 / /srv rw - ext4 /dev/a rw\n"), Path("/x"))
        is None
    )


@pytest.mark.parametrize(
    ("fstype", "source"),
    [
        ("nfs", "h:/x"),
        ("nfs4", "h:/x"),
        ("cifs", "//nas/share"),
        ("smb3", "//nas/share"),
        ("9p", "hostshare"),
        ("fuse.sshfs", "u@h:/"),
        ("fuse", "sshfs#u@h:/"),
        ("ceph", "10.0.0.1:/"),
        ("fuse.ceph-fuse", "ceph-fuse"),
        ("glusterfs", "gl:/vol"),
        ("fuse.glusterfs", "gl:/vol"),
        ("lustre", "mgs@tcp:/fs"),
        ("afs", "AFS"),
        ("fuse.rclone", "remote:"),
        ("fuse.s3fs", "s3fs"),
        ("NFS4", "h:/x"),
    ],
)
def test_network_filesystems_are_refused(fstype: str, source: str) -> None:
    assert is_network_filesystem(Mount("/m", fstype, source))


@pytest.mark.parametrize(
    ("fstype", "source"),
    [
        ("ext4", "/dev/vda"),
        ("xfs", "/dev/vdb"),
        ("tmpfs", "tmpfs"),
        ("overlay", "overlay"),
        ("btrfs", "/dev/vdc"),
        ("zfs", "tank/data"),
        ("f2fs", "/dev/vdd"),
        ("fuse.fuse-overlayfs", "fuse-overlayfs"),  # rootless containers
        ("fuse.gocryptfs", "/home/u/.c"),
        ("fuse", "/dev/sda1"),
        ("fuseblk", "/dev/sda1"),
    ],
)
def test_local_filesystems_are_accepted(fstype: str, source: str) -> None:
    assert not is_network_filesystem(Mount("/m", fstype, source))


def test_a_database_on_a_network_filesystem_is_refused_in_one_line(tmp_path: Path) -> None:
    database = tmp_path / "scheduler.db"
    real_dir = str(real_path(tmp_path))
    mounts = parse_mountinfo(
        "27 1 254:0 / / rw - ext4 /dev/vda rw\n"
        f"90 27 0:90 / {real_dir.replace(' ', chr(92) + '040')} rw - nfs4 files:/share rw\n"
    )
    with pytest.raises(ConfigError) as refused:
        check_database_file(database, mounts=mounts)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"database_url: {database}")
    assert f"network filesystem (nfs4 mounted at {real_dir})" in message
    assert "local filesystem" in message
    assert "PostgreSQL" in message
    # Through a symlinked directory, the real location is what is judged.
    (tmp_path / "link").mkdir()
    (tmp_path / "link" / "d").symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(ConfigError, match="nfs4"):
        check_database_file(tmp_path / "link" / "d" / "scheduler.db", mounts=mounts)
    local = parse_mountinfo("27 1 254:0 / / rw - ext4 /dev/vda rw\n")
    assert check_database_file(database, mounts=local) == real_path(database)


def test_a_database_file_mounted_on_its_own_is_refused(tmp_path: Path) -> None:
    database = tmp_path / "scheduler.db"
    database.touch()
    escaped = str(real_path(tmp_path)).replace(" ", "\\040")
    root = "27 1 254:0 / / rw - ext4 /dev/vda rw\n"
    file_mount = parse_mountinfo(
        f"{root}91 27 254:0 /srv/x.db {escaped}/scheduler.db rw - ext4 /dev/vda rw\n"
    )
    with pytest.raises(ConfigError) as refused:
        check_database_file(database, mounts=file_mount)
    message = str(refused.value)
    assert message.startswith(f"database_url: {database} is a file mounted on its own")
    assert "-wal and -shm" in message
    assert "Mount the directory that holds it instead" in message
    # Its directory mounted (what the message advises) is fine.
    directory_mount = parse_mountinfo(f"{root}92 27 254:0 /srv {escaped} rw - ext4 /dev/vda rw\n")
    assert check_database_file(database, mounts=directory_mount) == real_path(database)


def test_this_hosts_mount_table_is_read() -> None:
    mounts = system_mounts()
    if not Path("/proc/self/mountinfo").exists():
        assert mounts == []
        return
    root = mount_containing(mounts, Path("/"))
    assert root is not None
    assert root.mount_point == "/"


@pytest.mark.parametrize(
    ("code", "refused"), [(errno.EACCES, True), (errno.EISDIR, True), (errno.EMFILE, False),
                          (errno.ENOSPC, False), (errno.EIO, False)],
)  # fmt: skip
def test_a_lock_file_that_cannot_be_opened_now_is_retried_one_never_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, refused: bool
) -> None:
    """Opening the lock file at a standby's try: a permission or a directory in its place
    is for good (exit 78, naming the path); out of descriptors, a full disk or an I/O
    error may pass, so the loop retries as for database trouble (exit 78 would also keep
    systemd from restarting it: RestartPreventExitStatus=78)."""
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'db.sqlite'}")
    guard = FlockGuard("plugin", 1, SqliteStore.__new__(SqliteStore), settings, get_logger(),
                       Metrics(), asyncio.Event(), SchemaGate("sqlite"))  # fmt: skip

    def fail(*args: object, **kwargs: object) -> int:
        raise OSError(code, os.strerror(code))

    # A leader whose lock file was removed, reopening it at its heartbeat, whatever the
    # error: it logs and tries again at the next one (the heartbeat task must not die).
    guard.store._file = tmp_path / "db.sqlite"  # type: ignore[attr-defined]
    guard._lock_file = os.open(tmp_path / "removed.lock", os.O_RDWR | os.O_CREAT)

    monkeypatch.setattr(os, "open", fail)
    expected = ConfigError if refused else OSError
    with pytest.raises(expected) as error:
        guard._open(tmp_path / "x.lock", "lock file", os.O_CREAT)
    assert isinstance(error.value, ConfigError) == refused
    guard._keep_lock_file()
    os.close(guard._lock_file)
