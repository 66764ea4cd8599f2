"""Who owns a buffer, and how its lease and its locks are named.

Owns: the lease row as an instance reads it (:class:`Holder`), the SQLite lock file of a buffer
(one per database file and buffer name, whatever path reaches the file), the name a fenced
Postgres backend carries while its transaction runs (so that a taker can end the backends of an
expired owner), and the message an unnamed instance exits with when the database's unnamed buffer
already has a live owner. It must not open a connection or change a role: lease.py does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from rollout_buffer.storage.db import sqlite_path


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


def lock_path(url: str, buffer: str) -> str:
    """The lock file of a buffer on a SQLite database: next to the database file as the kernel
    resolves it (symlinks followed), so every path that reaches the file (a symlink to it or to a
    directory above it, a bind mount of a directory above it) reaches the same lock file. The
    unnamed buffer's is the one earlier versions used for a path without symlinks."""
    real = os.path.realpath(sqlite_path(url))
    return f"{real}.{buffer}.owner.lock" if buffer else f"{real}.owner.lock"


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
