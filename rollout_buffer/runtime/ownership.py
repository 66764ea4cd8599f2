"""Who owns a buffer, and how its lease and its locks are named.

Owns: the lease row as an instance reads it (:class:`Holder`), the SQLite lock of a buffer (a byte
of the database file itself, one per buffer name, whatever path reaches the file), the name a fenced
Postgres backend carries while its transaction runs (so that a taker can end the backends of an
expired owner, and ending them), and the message an unnamed instance exits with when the database's
unnamed buffer already has a live owner. It must not open a connection (it is handed the lease
thread's) or change a role: lease.py does.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import struct
import threading
from dataclasses import dataclass
from typing import Any

from rollout_buffer.core.errors import StorageError
from rollout_buffer.core.redact import redact
from rollout_buffer.launcher import procfs
from rollout_buffer.storage import lease_sql as sql
from rollout_buffer.storage.db import Database, sqlite_path

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Holder:
    """The lease row as this instance last read it."""

    instance: str | None
    url: str | None
    host: str | None
    pid: int | None
    start_ticks: int | None
    epoch: int
    expires_in: float  # seconds of lease left when it was read, by the database's clock
    length: float  # the owner's lease (lease_until - renewed_at): it renews every third of it
    released: bool  # given up by a graceful stop
    read_at: float  # monotonic

    def left(self, now: float) -> float:
        return self.expires_in - (now - self.read_at)

    def shown(self, now: float) -> dict[str, Any]:
        return {
            "url": self.url,
            "instance": self.instance,
            "host": self.host,
            "epoch": self.epoch,
            "lease_expires_in_s": round(max(0.0, self.left(now)), 1),
        }


def holder_of(row: dict[str, Any] | None, now: float) -> Holder | None:
    if row is None:
        return None
    until, renewed = float(row["lease_until"]), float(row["renewed_at"])
    return Holder(
        row["owner"],
        row["owner_url"],
        row["owner_host"],
        row["owner_pid"],
        row["owner_start_ticks"],
        int(row["epoch"]),
        until - float(row["db_now"]),
        max(0.0, until - renewed),
        until < renewed,
        now,
    )


def why_free(
    h: Holder, sqlite: bool, instance_id: str, host_id: str, grace_s: float = 0.0
) -> str | None:
    """Why the lease ``h`` may be taken now by this instance, or None. On SQLite the lock file
    decides (this instance holds it). ``grace_s``: how long after its end an expired lease may be
    taken."""
    if sqlite:
        return "the previous owner's lock is free"
    if h.released:
        return f"{h.url or h.instance} gave it up"
    if h.expires_in <= -grace_s:
        return f"the lease of {h.url or h.instance} ended {-h.expires_in:.1f} s ago"
    if h.instance == instance_id:
        return "it is this instance's own"
    if h.host == host_id and h.pid:
        process = procfs.stat(int(h.pid))
        if (
            process is None
            or not process.alive
            or (h.start_ticks is not None and process.start_ticks != int(h.start_ticks))
        ):
            return f"its owner's process (pid {h.pid} on this host) has ended"
    return None


# An open-file-description record lock (Linux), struct flock: type, whence, start, length, pid (0).
_FLOCK = "hhqqi4x"
LOCK_BASE = 1 << 62  # far above every byte SQLite locks (they start at 1 GiB)


def lock_byte(buffer: str) -> int:
    """The byte of the database file whose lock is a buffer's lease (one per name)."""
    return LOCK_BASE + int.from_bytes(hashlib.sha256(buffer.encode()).digest()[:5], "big")


# The descriptor each instance opened on a database file to lock a byte of it, by (device, inode,
# instance). It stays open while the instance runs: closing any descriptor of a file drops every
# POSIX lock this process holds on it, SQLite's own included, and SQLite then finds its locks gone
# ("disk I/O error"); a failed attempt every half second did. It is closed once, when the instance
# stops. One per instance, not per process: an OFD lock excludes other descriptions only.
_DESCRIPTORS: dict[tuple[int, int, str], int] = {}
_DESCRIPTORS_LOCK = threading.Lock()


def _descriptor(path: str, instance: str) -> int:
    """The instance's one descriptor of the file at ``path`` (opened once, kept open)."""
    stat = os.stat(path)
    key = (stat.st_dev, stat.st_ino, instance)
    with _DESCRIPTORS_LOCK:
        fd = _DESCRIPTORS.get(key)
        if fd is None:
            fd = _DESCRIPTORS[key] = os.open(path, os.O_RDWR)
        return fd


def file_lock(url: str, buffer: str, instance: str) -> int | None:
    """SQLite: the buffer's lease is a write lock on one byte of the database file itself (an
    open-file-description lock, so it is keyed by the file's device and inode: every path that
    reaches the file holds the same lock, be it a symlink, a hard link or a bind mount of the file
    or of a directory above it). The kernel releases it when this process dies; SQLite closing its
    own descriptors of the file does not. The descriptor that holds it, or None when another
    process does (the descriptor stays open: see ``_DESCRIPTORS``)."""
    fd = _descriptor(sqlite_path(url), instance)
    lock = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, lock_byte(buffer), 1, 0)
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, lock)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EAGAIN):
            return None
        raise
    return fd


def close_descriptors(instance: str) -> None:
    """The instance stops: close its descriptors of database files (once, at the end)."""
    with _DESCRIPTORS_LOCK:
        for key in [k for k in _DESCRIPTORS if k[2] == instance]:
            os.close(_DESCRIPTORS.pop(key))


def file_unlock(fd: int, buffer: str) -> None:
    """Give the buffer's byte up (the descriptor stays open: see ``_DESCRIPTORS``)."""
    unlock = struct.pack(_FLOCK, fcntl.F_UNLCK, os.SEEK_SET, lock_byte(buffer), 1, 0)
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, unlock)


def end_fenced(db: Database, holder: Holder) -> None:
    """Postgres, before taking over an expired lease: its owner may be paused or cut off inside a
    fenced transaction, holding the lease row's lock that the takeover waits for. End those
    backends (the same role may) rather than wait for their idle-transaction timeout."""
    try:
        ended = int(db.scalar(sql.TERMINATE_FENCED, (fence_name(holder.instance, holder.epoch),)))
    except StorageError as exc:
        logger.warning(
            "could not end the expired owner's backends (%s): the takeover waits for their "
            "idle-transaction timeout",
            redact(str(exc)),
        )
        return
    if ended:
        logger.warning(
            "ended %d backend(s) of the expired owner %s (epoch %s) left inside a fenced "
            "transaction",
            ended,
            holder.url or holder.instance,
            holder.epoch,
        )


def fence_name(instance: str | None, epoch: int) -> str:
    """What a backend is called (application_name) inside a fenced transaction of an owner's epoch
    (at most 63 bytes: Postgres truncates longer names)."""
    return f"rb-fence {instance} {epoch}"[:63]


def refusal(holder: Holder | None, job: dict[str, Any] | None) -> str:
    """Why an unnamed instance must not run next to a live owner of the unnamed buffer."""
    owner = (
        f"host {holder.host}, pid {holder.pid}, URL {holder.url or 'not advertised'}"
        if holder is not None
        else "its lease row is not written yet"
    )
    return (
        "refusing to start: another instance owns this state database's unnamed buffer ("
        f"{owner}, job {job['job_id'] if job else 'none'}). Two services on one database must be "
        "named: give each independent buffer its own ROLLOUT_BUFFER_NAME, or start a standby of a "
        "buffer with that buffer's ROLLOUT_BUFFER_NAME (set on the owner too); or stop the owner "
        "first (its lease must end before another unnamed instance may start)"
    )
