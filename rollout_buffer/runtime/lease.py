"""Ownership of the job: the lease in the state database, its fence, and who else is there.

Owns: a buffer's ``rollout_buffer_lease`` row (one per buffer on a state database: ``job`` for the
unnamed one, ``job/<ROLLOUT_BUFFER_NAME>`` for a named one; a buffer holds exactly one active job):
the owner, its advertised URL, host and pid, the epoch, and ``lease_until`` by the database's
clock. Its own thread (``rollout-buffer-lease``) and connection acquire it, renew it every third of
``ROLLOUT_BUFFER_LEASE_SECONDS`` and give it up on a graceful stop, so a renewal never waits behind
a stuck tick or poll. It takes the lease when it is free: the first owner of a database, an expired
lease, a released one, a dead owner on this host (its pid is gone). On SQLite the lease is a lock
on a byte of the database file itself, whatever path reaches it (one host). It also keeps this
instance's row in ``rollout_buffer_instances``, and checks once that
``ROLLOUT_BUFFER_ADVERTISE_URL`` answers as this instance. An unnamed instance that finds a live
owner of the unnamed buffer is ``refused``: it must not run (the gunicorn worker fails its boot).
What a standby answers (307 to the owner, or 503) is the app's, from ``role`` and ``holder``.

The epoch is the fencing token. :meth:`Lease.fence` is the first statement of every transaction
that records a decision: it takes a KEY SHARE lock on the lease row while the epoch is the one the
job's state was loaded under (``state_epoch``), and raises LeaseLost (the transaction rolls back)
otherwise. A takeover locks the row FOR UPDATE: it waits for the transactions that passed the
fence, and every later fence sees the new epoch. An owner paused or cut off inside such a
transaction would hold that lock for good: the fence names the backend after the owner's epoch,
and a taker of an expired lease ends those backends first. Renewals take no lock the fence
conflicts with. No clock decides who may write: ``lease_until`` only says when a standby may take
over, and the owner's own deadline (its monotonic clock, a margin short of the lease) only stops
what the database cannot fence, such as the launcher. No session state: it works through PgBouncer
(docs/cluster.md). Every statement runs through storage/lease.py.

It must not touch the job's state or the launcher: the loop drops and resumes the job when
``epoch`` and ``state_epoch`` differ.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import requests

from rollout_buffer.core.config import Config
from rollout_buffer.core.errors import ConfigError, LeaseLost, StorageError, Unavailable
from rollout_buffer.core.redact import redact
from rollout_buffer.launcher import procfs
from rollout_buffer.runtime.threads import Runtime
from rollout_buffer.storage import lease as rows
from rollout_buffer.storage.db import Database, service_connect
from rollout_buffer.storage.lease import Holder
from rollout_buffer.storage.store import Store

logger = logging.getLogger(__name__)

SCOPE = "job"  # the unnamed buffer's row; a named buffer's is "job/<name>"
OWNER, STANDBY, STARTING = "owner", "standby", "starting"
RETRY_S = 0.5  # after a failed step
# a standby reads the lease at least this often (a released lease is taken within it)
STANDBY_POLL_S = 0.5
INSTANCE_KEEP_S = 600.0  # rows of instances not seen for this long are deleted
PRUNE_EVERY_S = 60.0
# the advertised URL's check: OK, UNVERIFIED (it did not answer from here) or WRONG (another
# instance answered)
OK, UNVERIFIED, WRONG = "ok", "unverified", "wrong"


class Lease:
    """This instance's part in the lease: its role, its epoch, and the thread that keeps them."""

    name = "rollout-buffer-lease"  # its thread's, as a worker of the runtime

    def __init__(
        self,
        config: Config,
        instance_id: str,
        *,
        on_change: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.buffer = config.buffer_name  # "" is the unnamed buffer
        self.scope = f"{SCOPE}/{self.buffer}" if self.buffer else SCOPE
        self.seconds = config.lease_s
        # the owner stops this much before the lease ends
        self.margin = min(2.0, max(0.2, self.seconds / 10))
        self.instance_id = instance_id
        self.host_id = config.host_id or procfs.host_id()
        self.url = config.advertise_url
        self.on_change = on_change
        self.clock = clock
        # 0: no lease; this instance owns the job, and nothing is fenced
        self.enabled = self.seconds > 0
        self.role = STARTING if self.enabled else OWNER
        self.epoch: int | None = None
        self.state_epoch: int | None = None  # the epoch the loop loaded the job's state under
        self.holder: Holder | None = None
        self.report: str | None = None  # the loop: what it saw of a launcher recorded on this host
        self.problem: str | None = None  # why this instance cannot own or renew (shown by /health)
        # unnamed, another instance owns the buffer: this one must not run (ROLLOUT_BUFFER_NAME)
        self.refused: str | None = None
        self.counts: collections.Counter[str] = collections.Counter()
        self.takeover_s: float | None = None
        self._deadline = 0.0
        self._took_at: float | None = None
        self._free_for = 0.0
        self._quiet_start = False  # owner by a single instance's start: no takeover to warn of
        # ROLLOUT_BUFFER_ADVERTISE_URL: None (not checked), OK, UNVERIFIED or WRONG
        self.advertised: str | None = None
        self._db: Database | None = None
        self._lock_fd: int | None = None
        self._pruned_at = float("-inf")
        self._failing_since: float | None = None
        self._leaving = False
        self.wake = threading.Event()  # a worker of the runtime: set to step now
        self.stopping = threading.Event()  # set by the runtime on stop
        self.decided = threading.Event()  # set once the first step has read or taken the lease
        self._runtime: Runtime | None = None  # used alone: a runtime of its own

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        """Used alone (tests, tools): run the lease's thread in a runtime of its own. (The service
        runs it in its runtime, then calls give_up.)"""
        if self.enabled:
            if self._runtime is None:
                self._runtime = Runtime()
                self._runtime.add(self)
            self._runtime.start(monitor=False)

    def stop(self, timeout: float = 10.0, release: bool = True) -> None:
        """Used alone: stop the thread, then :meth:`give_up`."""
        if self._runtime is not None:
            self._runtime.stop_worker(self, timeout)
        self.give_up(release)

    def give_up(self, release: bool = True) -> None:
        """(The thread stopped.) An owner gives the lease up (a standby takes it at once) unless
        ``release`` is False; leave the instances."""
        if not self.enabled:
            return
        with (
            contextlib.suppress(StorageError),
            service_connect(
                self.config, self.config.effective_state_db_url, bound_s=self.seconds / 3
            ) as db,
        ):
            if release and self.role == OWNER and self.epoch is not None:
                rows.renew(db, self.scope, self.instance_id, self.epoch, -1.0)
                logger.info(
                    "gave the lease up (epoch %s): a standby can take over at once", self.epoch
                )
            rows.instance_left(db, self.instance_id)
        self.role, self.epoch = STANDBY, None
        if self._lock_fd is not None:
            rows.file_unlock(self._lock_fd, self.buffer)
            self._lock_fd = None
        # the instance stops: its descriptor of the database file goes once (not at every failed
        # attempt, which dropped SQLite's own locks of the process: see storage/lease.py)
        rows.close_descriptors(self.instance_id)

    def nudge(self) -> None:
        self.wake.set()

    # -- the loop's view of the job's state (only these methods write it) -------------------------
    def state_loaded(self) -> None:
        """The loop loads the job's state under the current epoch (its bootstrap follows)."""
        self.state_epoch = self.epoch

    def state_dropped(self) -> None:
        """The loop dropped the job's state: no epoch has it loaded."""
        self.state_epoch = None

    def report_launcher(self, report: str | None) -> None:
        """What the loop saw of a launcher recorded on this host (kept in this instance's row)."""
        self.report = report

    def leaving(self) -> None:
        """The service is stopping: a standby no longer takes the job and stops counting as one (an
        owner that stops at the same moment must not hand its launcher to it); an owner keeps the
        lease until stop() gives it up."""
        self._leaving = True
        self.nudge()

    # -- what the others ask -----------------------------------------------------------------------
    def holds(self) -> bool:
        """Owner, and surely still so by this instance's clock (SQLite: while the flock is held)."""
        return self.role == OWNER and (
            not self.enabled or self._lock_fd is not None or self.clock() < self._deadline
        )

    def check(self, wait_s: float, sure: bool = True) -> None:
        """Raise LeaseLost unless this instance owns the job (waiting ``wait_s`` for its first look
        at the lease); a 503 when it owns it but cannot be sure it still does (renewals failing),
        unless ``sure`` is False (/stop_rollout: stopping the launcher is always safe, and must not
        wait)."""
        if self.role == STARTING:
            self.decided.wait(wait_s)
        if self.role != OWNER:
            raise LeaseLost("this instance is not the owner of the job")
        if sure and not self.holds():
            raise Unavailable(
                self.problem or "this instance cannot renew its lease; retry", retry_after=2
            )

    def fence(self, db: Database) -> None:
        """First statement of a decision's transaction: LeaseLost unless the job's state was loaded
        under the epoch the database holds for this instance."""
        if not self.enabled:
            return
        epoch = self.state_epoch
        if self.role != OWNER or epoch is None or epoch != self.epoch:
            raise LeaseLost("this instance does not own the job (any more); nothing was recorded")
        name = fence_name(self.instance_id, epoch)
        if not rows.fence(db, name, self.scope, self.instance_id, epoch):
            self.nudge()  # the thread finds out who has it
            raise LeaseLost(
                f"another instance took the job over (this instance's epoch {epoch} has ended); "
                "nothing was recorded"
            )

    def resumed(self) -> None:
        """The loop has loaded the job under the current epoch: the takeover is complete."""
        if self._took_at is not None:
            self.takeover_s = self._free_for + (self.clock() - self._took_at)
            self._took_at = None
            if self.counts["takeovers"]:
                log = logger.info if self._quiet_start else logger.warning
                log("serving as the owner %.1f s after the previous lease ended", self.takeover_s)

    def describe(self) -> dict[str, Any]:
        """Role, owner and lease for /health (no secret: URLs carry no user or password)."""
        now = self.clock()
        if self.role == OWNER:
            owner: dict[str, Any] | None = {
                "url": self.url,
                "instance": self.instance_id,
                "host": self.host_id,
                "epoch": self.epoch,
                "lease_expires_in_s": round(max(0.0, self._deadline + self.margin - now), 1),
            }
        else:
            owner = self.holder.shown(now) if self.holder is not None else None
        return {
            "role": self.role,
            "buffer": self.buffer,
            "instance": self.instance_id,
            "host": self.host_id,
            "advertise_url": self.url,
            "owner": owner if self.enabled else None,
            "lease_seconds": self.seconds,
            "lease_problem": self.problem,
        }

    def stats(self) -> dict[str, Any]:
        """Counters for /stats and /metrics."""
        return {
            "role": self.role,
            "epoch": self.epoch,
            "renewals": self.counts["renewals"],
            "renewal_failures": self.counts["renewal_failures"],
            "acquired": self.counts["acquired"],
            "takeovers": self.counts["takeovers"],
            "last_takeover_s": self.takeover_s,
        }

    def refuse_unfenced(self, db: Database) -> None:
        """(No lease) Never decide next to an instance that owns the job under a lease: unfenced,
        this one's decisions would conflict with its. A ConfigError (the loop retries) until it is
        gone."""
        h = None if self.enabled else rows.read(db, self.scope, self.clock())
        if h is not None and not h.released and h.expires_in > 0:
            raise ConfigError(
                f"instance {h.url or h.instance} owns this database's job under a lease, and "
                "this one runs with ROLLOUT_BUFFER_LEASE_SECONDS=0 (unfenced): it waits until that "
                "lease ends; give every instance a lease (the default)"
            )

    def live_instances(self, db: Database, within_s: float) -> list[dict[str, Any]]:
        """The instances of this buffer (owner and standbys) seen within the last seconds."""
        return rows.live_instances(db, within_s, self.buffer)

    def standby_hosts(self, conns: Any) -> set[str]:
        """The hosts of the other live instances that wait as standbys (a graceful stop hands the
        launcher over to one on this host); none when it cannot be known."""
        if not self.enabled:
            return set()
        with contextlib.suppress(StorageError):
            return {
                i["host_id"]
                for i in self.live_instances(conns.get().state_db, min(self.seconds, 5.0))
                if i["role"] == STANDBY and i["instance_id"] != self.instance_id
            }
        return set()

    # -- the worker (its own thread and connection) --------------------------------------------
    def tick(self) -> float:
        """One step: renew (an owner) or try to take the lease; returns the wait before the next.
        A refused instance takes no more steps (it is on its way out)."""
        if self.refused is not None:
            return 3600.0
        try:
            return self._step()
        except Exception:
            logger.exception("the lease thread failed a step (retrying)")
            self._close()
            return RETRY_S

    def close(self) -> None:
        """(The lease's thread, as it ends.) Its connection is its own."""
        self._close()

    def _step(self) -> float:
        started = self.clock()
        try:
            db = self._connect()
            if self.role == OWNER:
                self._renew(db, started)
            else:
                starting = self.role == STARTING
                self._try_acquire(db, started)
                if starting and self.role == STANDBY and not self.buffer:
                    self.refused = self._refusal(Store(db).active_job())
                    logger.error("%s", self.refused)
                    self.decided.set()
                    self.on_change()
                    return RETRY_S
            self._seen(db)
        except StorageError as exc:
            self._failed(exc)
            return RETRY_S
        if self._failing_since is not None:
            logger.info(
                "the lease's database answers again after %.1f s",
                self.clock() - self._failing_since,
            )
            self._failing_since = None
            if self.problem and self.problem.startswith("cannot"):
                self.problem = None
        self.decided.set()
        if self.role == OWNER:
            return self.seconds / 3
        left = self.holder.left(self.clock()) if self.holder is not None else 0.0
        return max(0.1, min(STANDBY_POLL_S, left + 0.05))

    def _connect(self) -> Database:
        if self._db is None:
            # a renewal must never wait longer than a third of the lease, whatever the other
            # timeouts
            db = service_connect(
                self.config, self.config.effective_state_db_url, bound_s=self.seconds / 3
            )
            try:
                Store(db).ensure_schema()
            except BaseException:
                db.close()
                raise
            self._db = db
        return self._db

    def _close(self) -> None:
        db, self._db = self._db, None
        if db is not None:
            db.close()

    def _failed(self, exc: StorageError) -> None:
        self._close()
        now = self.clock()
        first = self._failing_since is None
        if first:
            self._failing_since = now
        if self.role == OWNER:
            self.counts["renewal_failures"] += 1
            if not self.holds():
                told = (self.problem or "").startswith("cannot renew")
                self.problem = (
                    f"cannot renew the lease for {now - (self._failing_since or now):.0f} s "
                    f"({redact(str(exc))}): this owner stops deciding until it can"
                )
                if not told:
                    logger.error("%s", self.problem)
            elif first:
                logger.warning("renewing the lease failed (retrying): %s", redact(str(exc)))
        elif first:
            self.problem = f"cannot read the lease: {redact(str(exc))}"
            logger.warning("reading the lease failed (retrying): %s", redact(str(exc)))

    def _set(self, role: str, epoch: int | None, why: str, *, start: bool = False) -> None:
        """Change the role. Losing the job, or taking it over, is a WARNING; ``start``: this
        instance became the owner as a single instance does at its start (the lease was never
        held, or its last holder gave it up), which is INFO."""
        old = self.role
        if old != role:
            # all of it before the role changes: a reader that sees the new role sees it logged
            self.problem = None if self.advertised != WRONG else self.problem
            quiet = start and old == STARTING
            self._quiet_start = quiet and role == OWNER
            log = logger.warning if (old == OWNER or role == OWNER) and not quiet else logger.info
            log("role: %s -> %s: %s", old, role, why)
        self.epoch = epoch  # before the role: a reader that sees OWNER sees its epoch
        self.role = role
        if old != role:
            self.on_change()

    def _seen(self, db: Database) -> None:
        """This instance's row: alive in its role (now and then, forget long-gone instances), or
        gone once a standby is leaving."""
        if self._leaving and self.role != OWNER:
            rows.instance_left(db, self.instance_id)
            return
        rows.instance_seen(
            db, self.instance_id, self.host_id, self.url, self.role, self.report, self.buffer
        )
        now = self.clock()
        if now - self._pruned_at > PRUNE_EVERY_S:
            self._pruned_at = now
            rows.prune_instances(db, INSTANCE_KEEP_S)

    # -- renewal and takeover ------------------------------------------------------------------
    def _renew(self, db: Database, started: float) -> None:
        assert self.epoch is not None
        if rows.renew(db, self.scope, self.instance_id, self.epoch, self.seconds):
            self._deadline = started + self.seconds - self.margin
            self.counts["renewals"] += 1
            if (self.problem or "").startswith("cannot renew"):
                logger.warning("the lease is renewed again (epoch %s): deciding again", self.epoch)
                self.problem = None
            return
        h = self._read(db)
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
            self._lock_fd = rows.file_lock(db.url, self.buffer, self.instance_id)
        if sqlite and self._lock_fd is None:
            self._read(db)
            self._set(STANDBY, None, "another instance holds the database's lock")
            return
        h = self._read(db)
        if h is None:
            if rows.insert(db, self.scope, self._me(), self.seconds):
                self._won(1, started, 0.0, "the first owner of this database", start=True)
                return
            h = self._read(db)
        if h is None or self._why_free(h, sqlite) is None:
            self._set(STANDBY, None, f"the owner is {h.url or h.instance}" if h else "no lease row")
            return
        if not sqlite and not h.released and h.expires_in <= 0:
            self._end_fenced(db, h)
        taken = rows.take(
            db,
            self.scope,
            self._me(),
            self.seconds,
            self.clock(),
            lambda locked: self._why_free(locked, sqlite),
        )
        if taken is None:
            self._read(db)
            self._set(STANDBY, None, "another instance took the lease first")
            return
        h, why = taken
        self._won(
            h.epoch + 1,
            started,
            0.0 if h.released or h.expires_in > 0 else -h.expires_in,
            why,
            start=h.released,  # a restart after a clean stop; not a takeover
        )

    def _why_free(self, h: Holder, sqlite: bool) -> str | None:
        """Why the lease ``h`` may be taken now by this instance, or None. On SQLite the lock file
        decides (this instance holds it). With a wrong advertised URL, a correctly configured
        standby gets the first go at an expired lease (a third of a lease)."""
        if sqlite:
            return "the previous owner's lock is free"
        if h.released:
            return f"{h.url or h.instance} gave it up"
        grace = self.seconds / 3 if self.advertised == WRONG else 0.0
        if h.expires_in <= -grace:
            return f"the lease of {h.url or h.instance} ended {-h.expires_in:.1f} s ago"
        if h.instance == self.instance_id:
            return "it is this instance's own"
        if h.host == self.host_id and h.pid:
            process = procfs.stat(int(h.pid))
            if (
                process is None
                or not process.alive
                or (h.start_ticks is not None and process.start_ticks != int(h.start_ticks))
            ):
                return f"its owner's process (pid {h.pid} on this host) has ended"
        return None

    def _end_fenced(self, db: Database, h: Holder) -> None:
        """Postgres, before taking over an expired lease: its owner may be paused or cut off inside
        a fenced transaction, holding the lease row's lock that the takeover waits for. End those
        backends (the same role may) rather than wait for their idle-transaction timeout."""
        try:
            ended = rows.end_fenced(db, fence_name(h.instance, h.epoch))
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
                h.url or h.instance,
                h.epoch,
            )

    def _me(self) -> rows.Me:
        pid = os.getpid()
        return (self.instance_id, self.url, self.host_id, pid, procfs.start_ticks(pid))

    def _read(self, db: Database) -> Holder | None:
        self.holder = rows.read(db, self.scope, self.clock())
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

    def _check_advertised(self) -> None:
        """Once: the advertised URL must answer GET /health as this instance (standbys redirect
        clients to it). One that answers as another is reported (/health degraded), and a correctly
        configured standby takes an ended lease first. It still may own the job (a job served under
        a wrong URL beats none)."""
        assert self.url is not None
        try:
            r = requests.get(self.url + "/health", timeout=(1.0, 2.0))
            seen = r.json().get("instance") if r.status_code == 200 else f"HTTP {r.status_code}"
        except (requests.RequestException, ValueError, AttributeError) as exc:
            logger.warning(
                "could not check ROLLOUT_BUFFER_ADVERTISE_URL=%s from here (%s); standbys redirect "
                "clients to it",
                self.url,
                type(exc).__name__,
            )
            self.advertised = UNVERIFIED
            return
        if seen == self.instance_id:
            self.advertised = OK
            return
        self.advertised = WRONG
        self.problem = (
            f"ROLLOUT_BUFFER_ADVERTISE_URL={self.url} answers as another instance ({seen!r}), not "
            "as this one: while this instance owns the job, standbys redirect clients there; set "
            "it to this instance's own URL"
        )
        logger.error("%s", self.problem)

    def _refusal(self, job: dict[str, Any] | None) -> str:
        """Why an unnamed instance must not run next to a live owner of the unnamed buffer."""
        h = self.holder
        owner = (
            f"host {h.host}, pid {h.pid}, URL {h.url or 'not advertised'}"
            if h is not None
            else "its lease row is not written yet"
        )
        return (
            "refusing to start: another instance owns this state database's unnamed buffer ("
            f"{owner}, job {job['job_id'] if job else 'none'}). Two services on one database "
            "must be named: give each independent buffer its own ROLLOUT_BUFFER_NAME, or start a "
            "standby of a buffer with that buffer's ROLLOUT_BUFFER_NAME (set on the owner too); "
            "or stop the owner first (its lease must end before another unnamed instance may "
            "start)"
        )


def fence_name(instance: str | None, epoch: int) -> str:
    """What a backend is called (application_name) inside a fenced transaction of an owner's epoch
    (at most 63 bytes: Postgres truncates longer names)."""
    return f"rb-fence {instance} {epoch}"[:63]
