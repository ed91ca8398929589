"""The SQLite database file: which real file a configured path names, and whether it is safe.

Leadership on SQLite locks the database file itself and a sidecar next to it (see
leadership/sqlite_flock.py), so every process must derive the same sidecar from the same
database, whatever path it was given: :func:`real_path` resolves symlinks (to the file and
to any directory on the way). Three setups cannot be made safe that way, and
:func:`check_database_file` refuses them:

- **a hard-linked file** (``st_nlink > 1``): SQLite keeps its ``-wal`` and ``-shm`` files
  per *path*, so processes opening two links of one file do not even see each other's
  writes; their sidecars would differ too.
- **a file mounted on its own** (a bind mount of the file, a one-file container volume):
  the same split of ``-wal`` and ``-shm``, between the mount point and the file's own
  directory. Found from ``/proc/self/mountinfo``, where the file is a mount point.
- **a network filesystem** (NFS, CIFS/SMB, 9p, sshfs, Ceph, GlusterFS, Lustre, AFS, …):
  ``flock`` there is not reliable across hosts, and SQLite's WAL needs memory shared by
  every process on the file. Found from ``/proc/self/mountinfo`` (Linux only; elsewhere
  the mount checks are skipped).

A running daemon compares the file its configured path names with the one it opened
(:func:`path_identity`, :func:`descriptor_identity`): a file renamed, removed or replaced
under it is noticed, since all of the above was checked only at startup.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError

MOUNTINFO = Path("/proc/self/mountinfo")

# Kernel filesystem types (the mountinfo field after " - ") where flock does not exclude
# processes on different hosts, or where SQLite's shared-memory WAL index cannot work.
NETWORK_FILESYSTEMS = frozenset(
    {"nfs", "nfs4", "cifs", "smb3", "smbfs", "ncpfs", "9p", "ceph", "glusterfs", "lustre",
     "afs", "openafs", "coda", "gpfs", "beegfs", "orangefs", "pvfs2", "davfs", "vboxsf",
     "prl_fs", "vmhgfs"}
)  # fmt: skip
# FUSE filesystems are local or remote depending on the program behind them: these are
# remote ("fuse.<subtype>" in mountinfo, or "fuse" with a "<subtype>#…" source).
NETWORK_FUSE = frozenset(
    {"sshfs", "s3fs", "rclone", "gcsfuse", "goofys", "glusterfs", "ceph-fuse", "ceph",
     "juicefs", "davfs2", "mfs", "moosefs", "lizardfs", "cvmfs2", "vmhgfs-fuse", "smbnetfs",
     "curlftpfs", "blobfuse", "blobfuse2", "davfs"}
)  # fmt: skip

_ESCAPE = re.compile(r"\\([0-7]{3})")


# (device, inode): what makes two paths, or a path and a descriptor, one file.
FileIdentity = tuple[int, int]


@dataclass(frozen=True, slots=True)
class Mount:
    mount_point: str
    fstype: str
    source: str


def real_path(path: Path) -> Path:
    """The absolute path of the file `path` names, with every symlink resolved.

    A file that does not exist yet resolves through its directory (SQLite creates it
    there); a dangling symlink resolves to where SQLite will create the file.
    """
    return Path(os.path.realpath(path))


def path_identity(path: Path) -> FileIdentity | None:
    """The file `path` names now (symlinks followed); None if it names none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def descriptor_identity(fd: int) -> FileIdentity:
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino)


def check_database_file(path: Path, *, mounts: Sequence[Mount] | None = None) -> Path:
    """The real path of the database at `path`; :class:`ConfigError` if it is hard-linked,
    mounted on its own or on a network filesystem.

    `mounts` defaults to this process's mount table (Linux), or no check elsewhere.
    """
    real = real_path(path)
    shown = str(path) if real == path else f"{path} (really {real})"
    try:
        links = os.stat(real).st_nlink
    except OSError:
        links = 1  # not there yet (created on open), or unreadable (SQLite will say so)
    if links > 1:
        raise ConfigError(
            f"database_url: {shown} has {links} hard links; SQLite keeps its -wal and -shm "
            "files per path, so processes opening different links would not see each "
            "other's writes and would each lead. Remove the extra links and give every "
            "replica the same file (a symlink is fine)."
        )
    if mounts is None:
        mounts = system_mounts()
    mount = mount_containing(mounts, real)
    if mount is not None and is_network_filesystem(mount):
        raise ConfigError(
            f"database_url: {shown} is on a network filesystem ({mount.fstype} mounted at "
            f"{mount.mount_point}), where flock does not exclude processes on other hosts "
            "and SQLite's WAL does not work. Put the database on a local filesystem, or "
            "use PostgreSQL to run replicas on several hosts."
        )
    if mount is not None and mount.mount_point == str(real):
        raise ConfigError(
            f"database_url: {shown} is a file mounted on its own (a bind mount of the file, "
            "a one-file volume); SQLite keeps its -wal and -shm files next to the path it "
            "opened, so they would not be shared with processes using the file through its "
            "own directory, nor kept with it. Mount the directory that holds it instead."
        )
    return real


def system_mounts() -> list[Mount]:
    """This process's mount table; empty where there is no ``/proc/self/mountinfo``."""
    if not sys.platform.startswith("linux"):
        return []
    try:
        # surrogateescape: a mount point is bytes, and need not be UTF-8.
        text = MOUNTINFO.read_text(encoding="utf-8", errors="surrogateescape")
    except OSError:
        return []
    return parse_mountinfo(text)


def parse_mountinfo(text: str) -> list[Mount]:
    """Parse ``/proc/<pid>/mountinfo`` (proc(5)), in file order; malformed lines skipped.

    ``36 35 98:0 /root /mount/point rw,noatime shared:1 - ext4 /dev/sda1 rw`` — the
    optional fields before ``-`` vary in number, so the filesystem type is found from
    that separator, not by position.
    """
    mounts = []
    for line in text.splitlines():
        fields = line.split(" ")
        try:
            separator = fields.index("-", 6)
            mount_point, fstype = fields[4], fields[separator + 1]
        except (ValueError, IndexError):
            continue
        source = fields[separator + 2] if len(fields) > separator + 2 else ""
        mounts.append(Mount(_unescape(mount_point), _unescape(fstype), _unescape(source)))
    return mounts


def _unescape(field: str) -> str:
    """The kernel writes space, tab, newline and backslash as octal escapes (``\\040``)."""

    def char(match: re.Match[str]) -> str:
        code = int(match[1], 8)
        # A byte past ASCII, as os.fsdecode would have decoded it.
        return chr(code) if code < 0x80 else chr(0xDC00 + code)

    return _ESCAPE.sub(char, field)


def mount_containing(mounts: Sequence[Mount], path: Path) -> Mount | None:
    """The mount `path` (absolute, resolved) lives on: the longest mount point that is
    `path` or one of its directories. Of several mounts on one point the last mounted,
    listed last, is the one visible."""
    target = str(path)
    best: Mount | None = None
    for mount in mounts:
        point = mount.mount_point
        inside = point == "/" or target == point or target.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best.mount_point)):
            best = mount
    return best


def is_network_filesystem(mount: Mount) -> bool:
    fstype = mount.fstype.lower()
    if fstype in NETWORK_FILESYSTEMS:
        return True
    if fstype.startswith("fuse."):
        return fstype.removeprefix("fuse.") in NETWORK_FUSE
    if fstype in ("fuse", "fuseblk") and "#" in mount.source:
        # Older mount helpers: type "fuse", source "sshfs#user@host:/dir".
        return mount.source.split("#", 1)[0].lower() in NETWORK_FUSE
    return False
