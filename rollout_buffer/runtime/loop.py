"""The background loop (huey's shape) and the database health it measures (GET /health's answer:
whether background work against the database fails, since when, and its last error, redacted).

Owns: the ``rollout-buffer-loop`` thread and its connections, and what one tick does, in order:
follow the lease (drop the job's state when this instance lost it or took it again under another
epoch; as a standby, watch a launcher on this host), bootstrap (schema, resume the active job,
adopt its launcher, queue unconfirmed notifications), record the outbox, ingest new rows, TTL
drops, the launcher's fate (``launcher_exited``, a launcher on another host, a fresh one after a
takeover), and the durable cursor. It must not serve: a tick takes the serve lock only to save
the cursor (never waiting for it) and to drop the job's state.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from rollout_buffer.core.config import Config
from rollout_buffer.core.errors import ConfigError, LeaseLost, OperationFailed, StorageError
from rollout_buffer.core.history import History
from rollout_buffer.core.model import LAUNCHER_EXITED, SERVED, LauncherState
from rollout_buffer.core.redact import redact
from rollout_buffer.launcher.launcher import Launcher
from rollout_buffer.runtime.jobs import Jobs, JobState
from rollout_buffer.runtime.lease import OWNER, Lease
from rollout_buffer.runtime.locks import LOCK_WAIT_S, Locks
from rollout_buffer.runtime.notifications import Outbox
from rollout_buffer.runtime.signals import Signals
from rollout_buffer.storage import launcher_tables
from rollout_buffer.storage.db import Database
from rollout_buffer.storage.store import LazyPair, Store, steady_wall

logger = logging.getLogger(__name__)

HOUSEKEEPING_S = 30.0


def check_sequence(launcher_db: Database) -> None:
    """Refuse a Postgres source whose id sequence caches values: the safe cursor assumes ids are
    handed out in time order, and with CACHE n a backend can write an id far below ones already
    committed by others, which the cursor would have passed (the row would never be read)."""
    if launcher_db.backend != "postgres":
        return
    cache = launcher_tables.sequence_cache(launcher_db)
    if cache and int(cache) > 1:
        raise ConfigError(
            f"the sequence of session_steps.id caches {int(cache)} values per connection, so ids "
            "are not handed out in commit order and rows could be skipped; fix it with: ALTER "
            "TABLE session_steps ALTER COLUMN id SET CACHE 1 (or ALTER SEQUENCE <its sequence> "
            "CACHE 1), then the service recovers by itself"
        )


class Health:
    """Whether background work against the database is failing, and since when."""

    def __init__(self, config: Config, clock: Callable[[], float]) -> None:
        self.config = config
        self.clock = clock
        self.failing_since: float | None = None
        self.last_error: str | None = None
        self._logged_at = 0.0

    def failed(self, exc: BaseException) -> None:
        now = self.clock()
        if self.failing_since is None:
            self.failing_since = now
        self.last_error = redact(
            f"{type(exc).__name__}: {exc}"
        )  # /health shows it, unauthenticated
        if now - self._logged_at > 30.0:
            self._logged_at = now
            if isinstance(exc, (StorageError, ConfigError)):
                logger.error("background work failed (retrying): %s", exc)
            else:
                logger.exception("background tick failed (retrying)", exc_info=exc)

    def ok(self) -> None:
        if self.failing_since is not None:
            logger.info("database reachable again after %.1f s", self.clock() - self.failing_since)
        self.failing_since = None
        self.last_error = None

    def problem(self) -> str | None:
        """An error message when background work has been failing too long, else None."""
        since = self.failing_since
        if since is not None and self.clock() - since >= self.config.db_unhealthy_after_s:
            return self.last_error or "database unreachable"
        return None


class Loop:
    """The ingest loop, a worker of the runtime: one tick every interval, or sooner when nudged."""

    name = "rollout-buffer-loop"

    def __init__(
        self,
        config: Config,
        *,
        jobs: Jobs,
        outbox: Outbox,
        launcher: Launcher,
        health: Health,
        locks: Locks,
        signals: Signals,
        on_reset: Callable[[], None],
        clock: Callable[[], float] = time.monotonic,
        history: History | None = None,
        lease: Lease | None = None,
    ) -> None:
        self.config = config
        self.lease = lease  # None: no lease, this instance always owns the job
        self.on_reset = on_reset  # serving forgets what it knew of the job's polls
        self.history = history or History()  # the status page's ingest rate
        self.jobs = jobs
        self.outbox = outbox
        self.launcher = launcher
        self.health = health
        self.locks = locks
        self.signals = signals
        self.clock = clock
        self.wake = signals.wake  # a nudge from anyone: a tick now
        self.stopping = threading.Event()
        self._conns = LazyPair(config, lease.fence if lease is not None else None)
        self._watched_at = float("-inf")
        self._tick_no = 0
        self._ticks_done = 0
        self._tick_done = threading.Condition()
        self._last_tick_end: float | None = None
        self._housekept_at = float("-inf")
        self._started_at = clock()
        self.interval = config.ingest_interval_s
        if config.ttl_s > 0:
            self.interval = min(self.interval, config.ttl_s / 10.0, 10.0)

    # -- the worker ------------------------------------------------------------------------------
    def tick(self) -> float:
        """One round, then the wait before the next (missed ticks are skipped, never burst)."""
        started = self.clock()
        try:
            self.round()
        except Exception as exc:  # the loop must survive anything: /health says what failed
            self.health.failed(exc)
        self._last_tick_end = self.clock()
        with self._tick_done:
            self._ticks_done += 1
            self._tick_done.notify_all()
        return max(0.0, self.interval - (self.clock() - started))

    def close(self) -> None:
        """(The loop's thread, as it ends.) Its connections are its own."""
        self._conns.close()

    def mark_started(self) -> None:
        """The service starts the loop now: a tick that does not come from here on is stuck."""
        self._started_at = self.clock()
        self._last_tick_end = None

    def tick_age(self) -> float:
        """Seconds since the last tick completed (since the start before the first one)."""
        last = self._last_tick_end
        return self.clock() - (self._started_at if last is None else last)

    @property
    def stale_after(self) -> float:
        """A tick older than this means the loop is stuck (a hung statement, a dead thread)."""
        return max(10.0, 5 * self.config.ingest_interval_s)

    def stuck(self) -> str | None:
        """Why the loop looks stuck, or None."""
        age = self.tick_age()
        if age <= self.stale_after:
            return None
        return (
            f"the background loop has not completed a tick for {age:.0f} s (a statement may be "
            "stuck on a lock)"
        )

    def sync(self, timeout: float = 10.0) -> bool:
        """Wait until a full tick has run after this call (tests, CLI). Only the loop thread touches
        its connections, so this asks it rather than ticking here."""
        with self._tick_done:
            target = self._ticks_done + 2
            deadline = time.monotonic() + timeout
            while self._ticks_done < target:
                self.wake.set()
                left = deadline - time.monotonic()
                if left <= 0 or self.stopping.is_set():
                    return False
                self._tick_done.wait(min(left, 0.05))
        return True

    # -- one tick ------------------------------------------------------------------------------
    def round(self) -> None:
        """One round (loop thread only): bootstrap, record the outbox, ingest, TTL, launcher,
        cursor."""
        with self.locks.ticking():
            self._tick_no += 1
            try:
                if not self._owned():
                    return
                pair = self._conns.get()
                if not self.signals.bootstrapped.is_set():
                    self._bootstrap(pair.source, pair.store)
                self.outbox.flush(pair.store)
                job_state = self.jobs.current
                if job_state is not None:
                    self._ingest(pair.source, pair.store, job_state)
                    self.outbox.act(
                        pair.store,
                        job_state.job_id,
                        job_state.accumulator.expire(self.config.ttl_s),
                    )
                    self._check_launcher(pair.store, job_state)
                    self._save_cursor(pair.store, job_state)
                self._housekeeping(pair.source, pair.store)
            except LeaseLost:
                return  # the lease thread finds out who owns the job; the next tick follows it
            except (StorageError, ConfigError) as exc:
                self._conns.close()
                self.health.failed(exc)
                return
            self.health.ok()

    # -- the lease --------------------------------------------------------------------------------
    def _owned(self) -> bool:
        """Whether this tick runs as the owner. The job's state goes when the lease was lost, or
        taken again under another epoch (others decided meanwhile); a standby watches a launcher
        here instead."""
        lease = self.lease
        if (
            lease is None
            or not lease.enabled
            or (lease.role == OWNER and lease.epoch == lease.state_epoch)
        ):
            return True
        if (
            lease.state_epoch is not None or self.jobs.current is not None
        ) and not self._drop_state():
            return False
        if lease.role != OWNER:
            self._standby_tick()
            return False
        lease.state_loaded()  # the bootstrap below loads the job under this epoch
        return True

    def _drop_state(self) -> bool:
        """Forget the job (the owner has it, in the database); False when a poll holds the serve
        lock."""
        assert self.lease is not None
        with self.locks.try_serving(LOCK_WAIT_S) as taken:
            if not taken:
                return False
            job_state = self.jobs.drop()
            self.signals.bootstrapped.clear()
            self.lease.state_dropped()
            unrecorded = self.outbox.discard()
            self.on_reset()
            self.launcher.let_go()
        self.signals.ready.interrupt()  # waiting polls answer now, as a standby answers
        logger.warning(
            "dropped the in-memory state of job %s: this instance does not own it now (%d "
            "unrecorded decisions left to the owner)",
            job_state.job_id if job_state else None,
            unrecorded,
        )
        return True

    def _standby_tick(self) -> None:
        """Once a second: report (and stop, if the owner cannot supervise it) a launcher on this
        host."""
        assert self.lease is not None
        now = self.clock()
        if now - self._watched_at < 1.0:
            return
        self._watched_at = now
        h = self.lease.holder
        owner_host = h.host if h is not None and not h.released and h.left(now) > 0 else None
        try:
            row = self._conns.get().store.active_job()
        except StorageError:
            self._conns.close()
            return  # the lease thread reports the database
        self.lease.report_launcher(self.launcher.watch_here(row, owner_host))

    def _housekeeping(self, launcher_db: Database, store: Store) -> None:
        """Every HOUSEKEEPING_S: check the source's sequence, and retention in small steps."""
        now = self.clock()
        if now - self._housekept_at < HOUSEKEEPING_S:
            return
        self._housekept_at = now
        self.outbox.events.flush()  # the rate-limited log lines' summaries
        check_sequence(launcher_db)
        wall = steady_wall()
        store.prune_batches(wall - 2 * self.config.replay_retention_s)
        if self.config.job_retention_s > 0:
            for job in store.ended_jobs(wall - self.config.job_retention_s):
                if store.purge_step(job["job_id"]) == 0:
                    upto = launcher_tables.max_job_id(launcher_db, job["job_id"])
                    read = max(
                        upto,
                        int(job["cursor_pk"]),
                        int(job["floor_pk"]),
                        int(job["low_water_pk"]) - 1,
                    )
                    store.mark_purged(job["job_id"], read)
                    logger.info(
                        "purged the decisions of ended job %s (retention %.0f s)",
                        job["job_id"],
                        self.config.job_retention_s,
                    )
                break  # one job a pass: small steps, never a long transaction

    def _bootstrap(self, launcher_db: Database, store: Store) -> None:
        """First tick: create tables, resume the active job, adopt its launcher, queue
        notifications."""
        store.ensure_schema()
        check_sequence(launcher_db)
        if self.lease is not None:
            self.lease.refuse_unfenced(store.db)
        row = self.jobs.resume(launcher_db, store)
        job_state = self.jobs.current
        if row is not None and job_state is not None and job_state.job_id == row["job_id"]:
            state = LauncherState.parse(row["launcher_state"])
            if self.launcher.resume_restart(store, job_state.job_id, job_state.k, row):
                pass
            elif state is LauncherState.HANDED_OVER and self.launcher.managed:
                job_state.launcher_finished(
                    self._tick_no
                )  # stopped for this owner: drop, then a fresh one
                self.launcher.want_relaunch(job_state.job_id)
            elif state is not None and (state.finished or state is LauncherState.RESTART_PENDING):
                job_state.launcher_finished(
                    self._tick_no
                )  # it ended before the crash: drop after catch-up
            elif self.launcher.adopt(store, job_state.job_id, row) is False:
                job_state.launcher_finished(self._tick_no)
        self.outbox.resend_unnotified(store)
        self.signals.bootstrapped.set()
        if self.lease is not None:
            self.lease.resumed()

    def _ingest(self, launcher_db, store: Store, job_state: JobState) -> None:
        if not self.jobs.wait_for_launcher_tables(launcher_db):
            job_state.reader.nothing_to_read()  # nothing can have been written
            return
        deadline = self.clock() + 1.0
        while True:
            rows = job_state.reader.read(launcher_db)
            if job_state.accounted is not None:
                read = rows
                rows = job_state.accounted.filter(
                    lambda gid: store.group_pks(job_state.job_id, gid),
                    job_state.accumulator.decided,
                    rows,
                )
                if len(rows) < len(read):  # accounted before a restart, maybe after the last save
                    decided = job_state.accumulator.decided
                    job_state.accumulator.recount_versions(
                        (r.group_id, r.weight_version)
                        for r in read
                        if isinstance(r.group_id, str) and decided.get(r.group_id) == SERVED
                    )
            plan = job_state.accumulator.ingest(rows, self.locks.yield_to_polls) if rows else None
            if rows:
                self.history.ingested(len(rows))
            job_state.reader.advance()  # only now: a failure above re-reads these rows next tick
            if plan is not None:
                if plan.newly_ready:
                    self.signals.ready.notify()
                self.outbox.act(store, job_state.job_id, plan)
            # drained, not caught_up: on Postgres the safe cursor only moves between ticks, so
            # waiting for caught_up here re-read the window in a busy loop for the whole second.
            if job_state.reader.drained or self.clock() > deadline or self.stopping.is_set():
                break
        job_state.reader.end_tick()
        scheduled, facts = job_state.census.read(launcher_db)
        if scheduled or facts:
            self.outbox.act(
                store, job_state.job_id, job_state.accumulator.observe(scheduled, facts)
            )

    def _check_launcher(self, store: Store, job_state: JobState) -> None:
        lease = self.lease
        if lease is not None and not lease.holds():
            # the lease may be ending: nothing the database cannot fence (no restart, no spawn)
            return
        self.launcher.check(store, job_state.job_id)
        e = self.launcher.elsewhere
        if (
            lease is not None
            and lease.enabled
            and e is not None
            and self.launcher.runs_elsewhere()
            and self.clock() - self._watched_at >= 1.0
        ):
            self._watched_at = self.clock()
            reports = [
                i["launcher_report"]
                for i in lease.live_instances(store.db, lease.seconds)
                if i["host_id"] == e.host
            ]
            self.launcher.check_elsewhere(store, job_state.job_id, reports)
        if self.launcher.finished() and job_state.launcher_finished_tick is None:
            job_state.launcher_finished(self._tick_no)
        if (
            job_state.launcher_finished_tick is not None
            and not job_state.launcher_drop_done
            and self._tick_no > job_state.launcher_finished_tick
            and job_state.reader.caught_up
        ):
            job_state.no_launcher_drop()
            plan = job_state.accumulator.drop_all(
                LAUNCHER_EXITED, include_ready=False, partial=True
            )
            if plan.drops:
                logger.warning(
                    "launcher of job %s has exited: dropping %d incomplete groups",
                    job_state.job_id,
                    len(plan.drops),
                )
            self.outbox.act(store, job_state.job_id, plan)
        if job_state.launcher_drop_done and self.launcher.relaunch_for == job_state.job_id:
            self._relaunch(store, job_state)

    def _relaunch(self, store: Store, job_state: JobState) -> None:
        """After a takeover: the job's launcher was lost with its owner (and its incomplete groups
        are dropped): a fresh one, as /start_rollout would start, so the job goes on. Not while a
        /start_rollout is in progress (it starts one itself): never waits for its lock."""
        with self.locks.try_starting() as taken:
            if not taken:
                return
            try:
                pid = self.launcher.start_for(store, job_state)
            except OperationFailed as exc:
                logger.error(
                    "could not start a fresh launcher for job %s: %s", job_state.job_id, exc.message
                )
                self.launcher.cancel_relaunch()
                return
        logger.warning(
            "started a fresh launcher for job %s (pid %s): the previous one was lost with its "
            "owner",
            job_state.job_id,
            pid,
        )

    def _save_cursor(self, store: Store, job_state: JobState) -> None:
        """Persist the cursor and the low-water mark (at most once a second, only when they can have
        moved).

        Never while a decision is unrecorded: the low-water mark would pass rows whose group's
        decision exists only in memory."""
        now = self.clock()
        if now - job_state.cursor_saved_at < 1.0:
            return
        marker = (
            job_state.reader.cursor,
            job_state.accumulator.changes,
            job_state.accumulator.trainer_version,
        )
        if marker == job_state.saved_marker or not self.outbox.empty():
            return  # idle: no O(groups) low-water scan, nothing to write
        with self.locks.try_serving() as taken:
            if not taken:
                return  # a poll is deciding groups; save next time
            if not self.outbox.empty():
                return  # a poll queued decisions meanwhile: they must be recorded first
            # Never past the reader's safe cursor: on Postgres a row below the smallest pending pk
            # can still be in flight in an open transaction, and a resume above it would skip it.
            cursor = job_state.reader.cursor
            cur = (
                cursor,
                min(job_state.accumulator.low_water(cursor), cursor + 1),
                job_state.accumulator.trainer_version,
                job_state.accumulator.rows_version,
            )
            if cur != job_state.saved_cursor:
                store.save_cursor(job_state.job_id, *cur)
            job_state.cursor_saved(now, marker, cur)
