"""The lease as it is stored: the ``rollout_buffer_lease`` row (one per buffer), the
``rollout_buffer_instances`` table, and on SQLite a lock on a byte of the database file.

Owns: every statement of the lease, named, with a one-line purpose, per backend (``{now}`` is the
database's clock in epoch seconds, and only Postgres has row locks), and running them on the
connection the lease's thread hands in. It returns plain values: the lease row as an instance reads
it (:class:`Holder`), whether a write took, the live instances. The tables themselves are in
queries.py's STATE_DDL, with the buffer's others. On SQLite the lease is the file's lock
(:func:`file_lock`), one per buffer name, whatever path reaches the file. It must not decide who
owns the job: runtime/lease.py does.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollout_buffer.storage.db import Database, sqlite_path

_NOW = {
    "postgres": "EXTRACT(EPOCH FROM now())",
    "sqlite": "(julianday('now') - 2440587.5) * 86400.0",
}


def _by_backend(sql: str) -> dict[str, str]:
    return {backend: sql.format(now=now) for backend, now in _NOW.items()}


# The lease as it is, with the database's time (LOCK: for a takeover, it waits for every fenced
# transaction).
LEASE_GET = _by_backend("SELECT *, {now} AS db_now FROM rollout_buffer_lease WHERE scope = ?")
LEASE_LOCK = {b: sql + (" FOR UPDATE" if b == "postgres" else "") for b, sql in LEASE_GET.items()}
# The first owner of a fresh database (two racing instances: one INSERT wins); columns in table
# order.
LEASE_INSERT = _by_backend(
    "INSERT INTO rollout_buffer_lease VALUES (?, ?, ?, ?, ?, ?, 1, {now} + ?, {now}, {now}) "
    "ON CONFLICT (scope) DO NOTHING"
)
# A takeover: a new owner and the next epoch, if nobody took it meanwhile.
LEASE_TAKE = _by_backend(
    "UPDATE rollout_buffer_lease SET owner = ?, owner_url = ?, owner_host = ?, owner_pid = ?, "
    "owner_start_ticks = ?, epoch = epoch + 1, lease_until = {now} + ?, acquired_at = {now}, "
    "renewed_at = {now} WHERE scope = ? AND epoch = ?"
)
# The owner renews (no lock the fence waits for); renewed for -1 s it is given up (a graceful stop).
LEASE_RENEW = _by_backend(
    "UPDATE rollout_buffer_lease SET lease_until = {now} + ?, renewed_at = {now} "
    "WHERE scope = ? AND owner = ? AND epoch = ?"
)
# The fence, first in every transaction that records a decision: a row only while this owner's epoch
# holds. On Postgres it also names the backend after the owner and epoch until the transaction ends
# (SET LOCAL application_name), so that a taker can end it should this owner be paused inside it.
LEASE_FENCE = {
    "postgres": "SELECT set_config('application_name', ?, true) FROM rollout_buffer_lease "
    "WHERE scope = ? AND owner = ? AND epoch = ? FOR KEY SHARE",
    "sqlite": "SELECT ? FROM rollout_buffer_lease WHERE scope = ? AND owner = ? AND epoch = ?",
}
# A taker (Postgres): end the backends still inside a fenced transaction of an expired owner's epoch
# (paused, stuck or cut off, they hold the lease row's KEY SHARE lock). The same role may do it.
TERMINATE_FENCED = (
    "SELECT COUNT(pg_terminate_backend(pid)) FROM pg_catalog.pg_stat_activity "
    "WHERE application_name = ? AND pid <> pg_backend_pid()"
)
# This instance of a buffer is alive (its role, URL and what it saw of a launcher on its host).
INSTANCE_SEEN = _by_backend(
    "INSERT INTO rollout_buffer_instances (instance_id, host_id, url, role, seen_at, "
    "launcher_report, buffer) VALUES (?, ?, ?, ?, {now}, ?, ?) ON CONFLICT "
    "(instance_id) DO UPDATE SET url = excluded.url, role = excluded.role, "
    "seen_at = excluded.seen_at, launcher_report = excluded.launcher_report"
)
# A buffer's instances seen within some seconds.
INSTANCES_LIVE = _by_backend(
    "SELECT * FROM rollout_buffer_instances WHERE seen_at >= {now} - ? AND buffer = ?"
)
# Forget instances not seen for a while (every restart is a new instance), and one that stops.
INSTANCES_PRUNE = _by_backend(
    "DELETE FROM rollout_buffer_instances WHERE seen_at < {now} - ? OR instance_id = ?"
)

GONE = 1e18  # "not seen for this long" matches no row: only the instance named goes


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


def _holder(row: dict[str, Any] | None, now: float) -> Holder | None:
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


# (instance_id, url, host_id, pid, start_ticks): who an owner is, in the lease row's column order
Me = tuple[str, str | None, str, int, int | None]


def read(db: Database, scope: str, now: float) -> Holder | None:
    """The buffer's lease row, or None when no instance has owned it yet."""
    return _holder(db.fetchone(LEASE_GET[db.backend], (scope,)), now)


def insert(db: Database, scope: str, me: Me, seconds: float) -> bool:
    """Become the first owner of a fresh database (epoch 1); False when another was first."""
    return db.execute(LEASE_INSERT[db.backend], (scope, *me, seconds)) == 1


def take(
    db: Database,
    scope: str,
    me: Me,
    seconds: float,
    now: float,
    why: Callable[[Holder], str | None],
) -> tuple[Holder, str] | None:
    """Take the lease over, under its row lock (on Postgres this waits for every transaction that
    passed the fence), if ``why`` says it is free as it is then. (The holder taken from and why), or
    None when it is not free or another instance took it first."""
    with db.transaction():
        locked = _holder(db.fetchone(LEASE_LOCK[db.backend], (scope,)), now)
        reason = why(locked) if locked is not None else None
        if locked is None or reason is None:
            return None
        if db.execute(LEASE_TAKE[db.backend], (*me, seconds, scope, locked.epoch)) != 1:
            return None
    return locked, reason


def renew(db: Database, scope: str, owner: str, epoch: int, seconds: float) -> bool:
    """Extend the owner's lease by ``seconds`` (-1: given up); False once its epoch has ended."""
    return db.execute(LEASE_RENEW[db.backend], (seconds, scope, owner, epoch)) == 1


def fence(db: Database, name: str, scope: str, owner: str, epoch: int) -> bool:
    """(First in a decision's transaction.) True while the owner's epoch holds; Postgres: the
    backend is called ``name`` until the transaction ends."""
    return db.scalar(LEASE_FENCE[db.backend], (name, scope, owner, epoch)) is not None


def end_fenced(db: Database, name: str) -> int:
    """(Postgres) End the backends inside a fenced transaction called ``name``; how many."""
    return int(db.scalar(TERMINATE_FENCED, (name,)))


def instance_seen(
    db: Database,
    instance_id: str,
    host: str,
    url: str | None,
    role: str,
    report: str | None,
    buffer: str,
) -> None:
    """This instance of ``buffer`` is alive in this role (its row in rollout_buffer_instances)."""
    db.execute(INSTANCE_SEEN[db.backend], (instance_id, host, url, role, report, buffer))


def prune_instances(db: Database, keep_s: float) -> None:
    """Forget the instances not seen for ``keep_s`` seconds (every restart is a new instance)."""
    db.execute(INSTANCES_PRUNE[db.backend], (keep_s, ""))


def instance_left(db: Database, instance_id: str) -> None:
    """This instance stops (or stops counting as a standby): its row goes."""
    db.execute(INSTANCES_PRUNE[db.backend], (GONE, instance_id))


def live_instances(db: Database, within_s: float, buffer: str = "") -> list[dict[str, Any]]:
    """A buffer's instances (owner and standbys) seen within the last seconds."""
    return db.fetchall(INSTANCES_LIVE[db.backend], (within_s, buffer))


# -- SQLite: the lease is a lock on a byte of the database file ---------------------------------
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


def file_unlock(fd: int, buffer: str) -> None:
    """Give the buffer's byte up (the descriptor stays open: see ``_DESCRIPTORS``)."""
    unlock = struct.pack(_FLOCK, fcntl.F_UNLCK, os.SEEK_SET, lock_byte(buffer), 1, 0)
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, unlock)


def close_descriptors(instance: str) -> None:
    """The instance stops: close its descriptors of database files (once, at the end)."""
    with _DESCRIPTORS_LOCK:
        for key in [k for k in _DESCRIPTORS if k[2] == instance]:
            os.close(_DESCRIPTORS.pop(key))
