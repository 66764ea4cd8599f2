"""Taking and renewing the lease row (the lease's protocol), for :class:`~rollout_buffer.runtime.
lease.Lease`: renew it while this instance owns it; take it when it is free (the first owner of a
database, an expired lease, a released one, a dead owner on this host), after ending the fenced
transactions an expired owner left open (Postgres), under the database's lock.

Owns: the statements' order of a takeover. It must not decide the role's consequences: the lease
(``_set``) does.
"""

from __future__ import annotations

import collections
import logging
import os
from collections.abc import Callable

from rollout_buffer.launcher import procfs
from rollout_buffer.runtime.ownership import Holder, end_fenced, file_lock, holder_of, why_free
from rollout_buffer.storage import lease_sql as sql
from rollout_buffer.storage.db import Database

logger = logging.getLogger("rollout_buffer.runtime.lease")

OWNER, STANDBY = "owner", "standby"


class Takeover:
    """The lease's renewal and takeover steps (a mixin of :class:`Lease`, its state)."""

    seconds: float
    margin: float
    scope: str
    buffer: str
    instance_id: str
    host_id: str
    url: str | None
    advertised: str | None
    problem: str | None
    epoch: int | None
    holder: Holder | None
    counts: collections.Counter[str]
    clock: Callable[[], float]
    _leaving: bool
    _lock_fd: int | None
    _deadline: float
    _took_at: float | None
    _free_for: float
    _quiet_start: bool

    def _set(self, role: str, epoch: int | None, why: str, *, start: bool = False) -> None:
        raise NotImplementedError

    def _check_advertised(self) -> None:
        raise NotImplementedError

    def _renew(self, db: Database, started: float) -> None:
        if (
            db.execute(
                sql.LEASE_RENEW[db.backend],
                (self.seconds, self.scope, self.instance_id, self.epoch),
            )
            == 1
        ):
            self._deadline = started + self.seconds - self.margin
            self.counts["renewals"] += 1
            if (self.problem or "").startswith("cannot renew"):
                logger.warning("the lease is renewed again (epoch %s): deciding again", self.epoch)
                self.problem = None
            return
        self._read(db)
        h = self.holder
        self._set(
            STANDBY,
            None,
            f"another instance took the job over ({h.url or h.instance if h else 'unknown'}, "
            f"epoch {h.epoch if h else '?'})",
        )

    def _try_acquire(self, db: Database, started: float) -> None:
        if self._leaving:
            return
        if self.url and self.advertised is None:
            self._check_advertised()
        sqlite = db.backend == "sqlite"
        if sqlite and self._lock_fd is None:
            self._lock_fd = file_lock(db.url, self.buffer, self.instance_id)
        if sqlite and self._lock_fd is None:
            self._read(db)
            self._set(STANDBY, None, "another instance holds the database's lock")
            return
        h = self._read(db)
        if h is None:
            if (
                db.execute(sql.LEASE_INSERT[db.backend], (self.scope, *self._me(), self.seconds))
                == 1
            ):
                self._won(1, started, 0.0, "the first owner of this database", start=True)
                return
            h = self._read(db)
        if h is None or self._why_free(h, sqlite) is None:
            self._set(STANDBY, None, f"the owner is {h.url or h.instance}" if h else "no lease row")
            return
        if not sqlite and not h.released and h.expires_in <= 0:
            end_fenced(db, h)
        with db.transaction():
            # waits for fenced writes
            locked = holder_of(db.fetchone(sql.LEASE_LOCK[db.backend], (self.scope,)), self.clock())
            why = self._why_free(locked, sqlite) if locked is not None else None
            taken = (
                locked is not None
                and why is not None
                and db.execute(
                    sql.LEASE_TAKE[db.backend],
                    (*self._me(), self.seconds, self.scope, locked.epoch),
                )
                == 1
            )
        if taken and locked is not None and why is not None:
            h = locked
            self._won(
                h.epoch + 1,
                started,
                0.0 if h.released or h.expires_in > 0 else -h.expires_in,
                why,
                start=h.released,  # a restart after a clean stop; not a takeover
            )
        else:
            self._read(db)
            self._set(STANDBY, None, "another instance took the lease first")

    def _why_free(self, h: Holder, sqlite: bool) -> str | None:
        """Why the lease may be taken now, or None (ownership.why_free); with a wrong advertised
        URL, a correctly configured standby gets the first go (a third of a lease)."""
        grace = self.seconds / 3 if self.advertised == "wrong" else 0.0
        return why_free(h, sqlite, self.instance_id, self.host_id, grace)

    def _me(self) -> tuple:
        pid = os.getpid()
        return (self.instance_id, self.url, self.host_id, pid, procfs.start_ticks(pid))

    def _read(self, db: Database) -> Holder | None:
        self.holder = holder_of(db.fetchone(sql.LEASE_GET[db.backend], (self.scope,)), self.clock())
        return self.holder

    def _won(
        self, epoch: int, started: float, free_for: float, why: str, *, start: bool = False
    ) -> None:
        self._deadline = started + self.seconds - self.margin
        self._took_at, self._free_for = self.clock(), free_for
        self.counts["acquired"] += 1
        if epoch > 1:
            self.counts["takeovers"] += 1
        self._set(OWNER, epoch, f"{why} (epoch {epoch})", start=start)
