"""The service: wires the database, the accumulator, the launcher supervisor and the proxy notifier.

One background thread (``rollout-buffer-loop``) reads new rows, drops stale groups, watches the
launcher and persists decisions. Request threads call :meth:`Service.start_rollout`,
:meth:`Service.get_rollout_data` and friends. The service's durable state is only what it
decided (tables ``rollout_buffer_*``): everything else is rebuilt from the launcher's rows
when it starts, so a crash loses nothing the database holds.

Lock order, outermost first: ``_start_lock`` (job selection), ``_tick_lock`` (one loop tick),
``_serve_lock`` (one poll serving), the accumulator's lock, ``_outbox_lock``.
"""
from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import secrets
import sys
import threading
import time
import uuid
from typing import Any, Callable, Iterator

from . import model as acc_mod
from . import queries as q
from .accumulator import Accumulator
from .model import Decisions, Take
from .config import Config
from .db import Database, connect, redact
from .errors import ApiError, ClosedError, StorageError
from .items import GroupItems, Malformed, build_group, response_chunks
from .proxy import ProxyNotifier
from .supervisor import LaunchSpec, LauncherError, Supervisor

logger = logging.getLogger(__name__)

NO_DATA = "No data available to read"
FETCH_CHUNK = 900  # pks per body query (SQLite's default variable limit is far above)


class Reader:
    """The job's ingest cursor: every trainable row is returned exactly once.

    On SQLite writers are serialised, so ids become visible in order and ``id > cursor`` is enough.
    On Postgres a smaller id can commit after a larger one. The reader keeps a *safe* cursor,
    below which every row is known to be visible, re-reads the window between it and the largest
    id seen, and skips ids it already returned. At the first read of a tick it pairs that
    snapshot's xmax with the largest id seen at the end of a tick at least ``HORIZON_LAG_S``
    earlier; once the snapshot xmin passes that xmax, every transaction that could hold a smaller
    id has finished (the lag covers the instant between an INSERT taking its id from the sequence
    and getting its transaction id), and the safe cursor moves up to that id.

    ``read`` does not move the cursor: ``advance`` does, once the caller has ingested the rows, so a
    failure in between re-reads them instead of losing them.
    """

    HORIZON_LAG_S = 1.0

    def __init__(self, job_id: str, start_after: int, batch: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.job_id = job_id
        self.cursor = start_after
        self.max_seen = start_after
        self.batch = batch
        self.clock = clock
        self.seen: set[int] = set()
        self.horizons: collections.deque[tuple[int, int]] = collections.deque()
        self.tick_ends: collections.deque[tuple[float, int]] = collections.deque([(float("-inf"), start_after)])
        self.first_read_of_tick = True
        self.caught_up = False
        self.drained = False  # the last read returned less than a batch: nothing more to read now
        self._staged: tuple | None = None
        self._postgres = False

    def end_tick(self) -> None:
        if self._postgres:
            self.tick_ends.append((self.clock(), self.max_seen))
        self.first_read_of_tick = True

    def read(self, db: Database) -> list[tuple]:
        """The next rows (id, session_id, group_id, is_session_completed) not returned before."""
        with db.read_snapshot():
            horizon = db.snapshot_horizon()
            window: list[tuple] = []
            if horizon is not None and self.cursor < self.max_seen:
                window = db.rows(q.READ_WINDOW, (self.job_id, self.cursor, self.max_seen))
            batch = db.rows(q.READ_AFTER, (self.job_id, self.max_seen, self.batch))
        drained = len(batch) < self.batch
        if horizon is None:
            self._staged = (batch, batch, drained, None)
            return batch
        new = [r for r in window if r[0] not in self.seen]
        new.extend(batch)
        self._staged = (new, batch, drained, horizon)
        return new

    def advance(self) -> None:
        """The rows of the last read were ingested: move past them."""
        if self._staged is None:
            return
        new, batch, drained, horizon = self._staged
        self._staged = None
        self.drained = drained
        if batch:
            self.max_seen = batch[-1][0]
        if horizon is None:
            self.cursor = self.max_seen
            self.caught_up = drained
            return
        self._postgres = True
        self.seen.update(r[0] for r in new)
        xmin, xmax = horizon
        if self.first_read_of_tick:
            self.first_read_of_tick = False
            limit = self.clock() - self.HORIZON_LAG_S
            paired = None
            while self.tick_ends and self.tick_ends[0][0] <= limit:
                paired = self.tick_ends.popleft()
            if paired is not None:
                self.tick_ends.appendleft(paired)  # still the newest old-enough end for the next tick
                if not self.horizons or self.horizons[-1][1] < paired[1]:
                    self.horizons.append((xmax, paired[1]))
        moved = False
        while self.horizons and xmin >= self.horizons[0][0]:
            self.cursor = max(self.cursor, self.horizons.popleft()[1])
            moved = True
        if moved:
            self.seen = {pk for pk in self.seen if pk > self.cursor}
        self.caught_up = drained and self.cursor >= self.max_seen


class Accounted:
    """After a restart: which re-read rows were already accounted before it (skip them)."""

    def __init__(self, job_id: str, upto_pk: int, row_pks: set[int]) -> None:
        self.job_id = job_id
        self.upto_pk = upto_pk
        self.row_pks = row_pks
        self.group_pks: dict[str, set[int]] = {}

    def filter(self, db: Database, decided: dict[str, str], rows: list[tuple]) -> list[tuple]:
        if not rows or rows[0][0] > self.upto_pk and not self.row_pks:
            return rows
        out = []
        for r in rows:
            pk, gid = r[0], r[2]
            if pk > self.upto_pk:
                out.append(r)
                continue
            if pk in self.row_pks:
                continue
            if gid is not None and str(gid) in decided:
                pks = self.group_pks.get(str(gid))
                if pks is None:
                    text = db.scalar(q.GROUP_PKS, (self.job_id, str(gid))) or ""
                    pks = self.group_pks[str(gid)] = {int(p) for p in text.split(",") if p}
                if pk in pks:
                    continue
            out.append(r)
        return out


class JobState:
    """Everything the service holds for the active job."""

    def __init__(self, job_id: str, k: int, floor_pk: int, acc: Accumulator, reader: Reader,
                 accounted: Accounted | None) -> None:
        self.job_id = job_id
        self.k = k
        self.floor_pk = floor_pk
        self.acc = acc
        self.reader = reader
        self.accounted = accounted
        self.launcher_finished_tick: int | None = None
        self.launcher_drop_done = False
        self.started_at = time.time()
        self.cursor_saved_at = 0.0
        self.saved_cursor: tuple[int, int] | None = None
        self.saved_marker: tuple[int, int] | None = None


class Service:
    """The rollout buffer as a plain object with a lifecycle (start/stop are idempotent)."""

    def __init__(self, config: Config, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self._start_lock = threading.Lock()
        self._tick_lock = threading.Lock()
        self._serve_lock = threading.Lock()
        self._outbox_lock = threading.Lock()
        self._outbox: list[tuple[str, Decisions]] = []
        self.current: JobState | None = None
        self.supervisor = Supervisor(
            restart_policy=config.restart_policy, max_restarts=config.restart_max,
            backoff_s=config.restart_backoff_s, stop_grace_s=config.stop_grace_s)
        self.notifier = ProxyNotifier(
            base_url=config.proxy_url, connect_timeout=config.proxy_connect_timeout_s,
            read_timeout=config.proxy_read_timeout_s, on_delivered=self._on_delivered)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop_src: Database | None = None
        self._loop_st: Database | None = None
        self._bootstrapped = threading.Event()
        self._started = False
        self._closed = False
        self._tick_no = 0
        self._tables_seen = False
        self._uncertain: tuple | None = None  # a serving COMMIT whose outcome is unknown
        self._tables_warned = False
        self._ticks_done = 0
        self._tick_done = threading.Condition()
        self._db_failing_since: float | None = None
        self._db_last_error: str | None = None
        self._db_error_logged_at = 0.0
        self.poll_latency = collections.Counter()  # histogram buckets for /metrics
        self.poll_count = 0
        self.poll_seconds = 0.0
        self.polls_with_data = 0

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the background thread and the notifier; idempotent. Touches the DB in the thread."""
        if self._closed:
            raise ClosedError("service was stopped; build a new one")
        if self._started:
            return
        self._started = True
        self._stop.clear()
        self.notifier.start()
        self._thread = threading.Thread(target=self._run, name="rollout-buffer-loop", daemon=True)
        self._thread.start()
        logger.info("rollout-buffer service started (db %s)", redact(self.config.db_url))

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop, the launcher (TERM, grace, KILL) and the notifier; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.error("background thread %s still alive after %.0f s", self._thread.name, timeout)
        if self.supervisor.state()["running"]:
            state = self.supervisor.stop("shutdown")
            js = self.current
            if js is not None and state is not None:
                with contextlib.suppress(Exception), self._connect() as (src, st):
                    st.execute(q.SAVE_LAUNCHER, (state["pid"], state["pgid"], state["start_ticks"],
                                                 "stopped:shutdown", time.time(), js.job_id))
        self.notifier.stop()
        logger.info("rollout-buffer service stopped")

    def wait_ready(self, timeout: float = 30.0) -> bool:
        """Block until the first successful bootstrap (tests, CLI)."""
        return self._bootstrapped.wait(timeout)

    def nudge(self) -> None:
        """Ask the background thread to run a tick now."""
        self._wake.set()

    def sync(self, timeout: float = 10.0) -> bool:
        """Wait until a full background tick has run after this call (tests, CLI). Only the loop
        thread touches its connections, so this asks it rather than ticking here."""
        with self._tick_done:
            target = self._ticks_done + 2
            deadline = time.monotonic() + timeout
            while self._ticks_done < target:
                self._wake.set()
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    return False
                self._tick_done.wait(min(left, 0.05))
        return True

    # -- connections -------------------------------------------------------------------------
    @contextlib.contextmanager
    def _connect(self) -> Iterator[tuple[Database, Database]]:
        """A (source, state) connection pair for the calling thread, closed afterwards."""
        src = connect(self.config.db_url)
        try:
            if self.config.state_db_url and self.config.state_db_url != self.config.db_url:
                st = connect(self.config.state_db_url)
                try:
                    yield src, st
                finally:
                    st.close()
            else:
                yield src, src
        finally:
            src.close()

    def connection(self) -> "RequestConnections":
        """Lazily opened connections for one request (closed by the API at teardown)."""
        return RequestConnections(self)

    def _loop_conns(self) -> tuple[Database, Database]:
        if self._loop_src is None:
            self._loop_src = connect(self.config.db_url)
            if self.config.state_db_url and self.config.state_db_url != self.config.db_url:
                self._loop_st = connect(self.config.state_db_url)
            else:
                self._loop_st = self._loop_src
        assert self._loop_st is not None
        return self._loop_src, self._loop_st

    def _close_loop_conns(self) -> None:
        for db in {id(d): d for d in (self._loop_src, self._loop_st) if d is not None}.values():
            db.close()
        self._loop_src = self._loop_st = None

    # -- schema and job selection ----------------------------------------------------------------
    @staticmethod
    def ensure_state_schema(st: Database) -> None:
        """Create the buffer's tables if missing and check their version."""
        for ddl in q.STATE_DDL:
            st.execute(ddl)
        version = st.scalar(q.GET_META, ("schema_version",))
        if version is None:
            st.execute(q.PUT_META, ("schema_version", str(q.SCHEMA_VERSION)))
        elif int(version) > q.SCHEMA_VERSION:
            raise StorageError(f"rollout_buffer_* tables are schema version {version}; this build knows "
                               f"{q.SCHEMA_VERSION}: upgrade rollout-buffer")

    def launcher_tables_exist(self, src: Database) -> bool:
        """True once session_steps exists (a fresh database has it only after the launcher starts)."""
        if self._tables_seen:
            return True
        if int(src.scalar(q.HAS_STEPS_TABLE[src.backend]) or 0):
            self._tables_seen = True
            return True
        if not self._tables_warned:
            self._tables_warned = True
            logger.warning("the launcher's table session_steps does not exist yet in %s; waiting for it "
                           "(`rollout-buffer init-db --db URL` creates it)", redact(self.config.db_url))
        return False

    def _load_job(self, src: Database, st: Database, job_id: str, k: int, floor_pk: int,
                  start_after: int) -> JobState:
        """Build a JobState from the durable records of a job (fresh or resumed)."""
        decided = {r[0]: r[1] for r in st.rows(q.JOB_GROUP_STATUS, (job_id,))}
        served_rows = 0
        dropped: collections.Counter = collections.Counter()
        rejected: collections.Counter = collections.Counter()
        groups_served = 0
        groups_dropped: collections.Counter = collections.Counter()
        for r in st.fetchall(q.GROUP_TOTALS, (job_id,)):
            if r["status"] == acc_mod.SERVED:
                groups_served += int(r["n_groups"])
                served_rows += int(r["n_served"] or 0)
                if r["n_dropped"]:
                    dropped[acc_mod.INCOMPLETE_IN_SERVED] += int(r["n_dropped"])
            else:
                groups_dropped[r["reason"]] += int(r["n_groups"])
                if r["n_dropped"]:
                    dropped[r["reason"]] += int(r["n_dropped"])
        for r in st.fetchall(q.ROW_TOTALS, (job_id,)):
            (rejected if r["outcome"] == "rejected" else dropped)[r["reason"]] += int(r["n"])
        accounted_rows = served_rows + sum(dropped.values()) + sum(rejected.values())
        acc = Accumulator(job_id, k, clock=self.clock)
        acc.load(decided, accounted_rows, served_rows, dict(dropped), dict(rejected), groups_served,
                 dict(groups_dropped))
        tainted = [r[0] for r in st.rows(q.TAINTED_SESSIONS, (job_id,))]
        acc.tainted.update(tainted)
        accounted = None
        if (decided or accounted_rows) and self.launcher_tables_exist(src):
            upto = src.scalar(q.MAX_JOB_ID, (job_id,)) or 0
            row_pks = {int(r[0]) for r in st.rows(q.ROW_PKS_FROM, (job_id, start_after))}
            accounted = Accounted(job_id, int(upto), row_pks)
        reader = Reader(job_id, start_after, self.config.ingest_batch, clock=self.clock)
        return JobState(job_id, k, floor_pk, acc, reader, accounted)

    def _bootstrap(self, src: Database, st: Database) -> None:
        """First tick: create tables, resume the active job, adopt its launcher, queue notifications."""
        self.ensure_state_schema(st)
        row = st.fetchone(q.ACTIVE_JOB)
        if row is not None and self.current is None:
            start_after = max(int(row["floor_pk"]), int(row["low_water_pk"]) - 1)
            js = self._load_job(src, st, row["job_id"], int(row["k"]), int(row["floor_pk"]), start_after)
            self.current = js
            logger.info("resumed job %s (K=%s, reading from id %s; %s groups decided before)",
                        js.job_id, js.k, start_after, len(js.acc.decided))
            state = row["launcher_state"]
            if state in ("exited", "stopped:requested", "gave_up") or (state or "").startswith("exited"):
                js.launcher_finished_tick = self._tick_no  # it ended before the crash: drop after catch-up
            if row["launcher_pid"] and state == "running":
                adopted = False
                with contextlib.suppress(LauncherError):
                    adopted = self.supervisor.adopt(int(row["launcher_pid"]), int(row["launcher_pgid"]),
                                                    row["launcher_start_ticks"], None)
                if not adopted:
                    logger.warning("launcher pid %s of job %s is gone: it ended while the service was down",
                                   row["launcher_pid"], js.job_id)
                    st.execute(q.SAVE_LAUNCHER, (row["launcher_pid"], row["launcher_pgid"],
                                                 row["launcher_start_ticks"], "exited", time.time(), js.job_id))
                    js.launcher_finished_tick = self._tick_no
        for r in st.fetchall(q.UNNOTIFIED_GROUPS):
            sessions = json.loads(r["clear_sessions"])
            reason = r["reason"] if r["status"] == acc_mod.DROPPED else acc_mod.INCOMPLETE_IN_SERVED
            if sessions:
                self.notifier.notify(reason, sessions, [r["group_id"]], [("g", r["job_id"], r["group_id"])])
        for r in st.fetchall(q.UNNOTIFIED_ROWS):
            self.notifier.notify(r["reason"], [r["session_id"]], [r["group_id"]] if r["group_id"] else [],
                                 [("r", r["job_id"], int(r["step_pk"]))])
        self._bootstrapped.set()

    # -- the background loop -------------------------------------------------------------------
    def _run(self) -> None:
        interval = self.config.ingest_interval_s
        if self.config.ttl_s > 0:
            interval = min(interval, self.config.ttl_s / 10.0, 10.0)
        while not self._stop.is_set():
            started = self.clock()
            try:
                self.tick()
            except Exception as exc:  # the loop must survive anything
                self._db_failed(exc)
            with self._tick_done:
                self._ticks_done += 1
                self._tick_done.notify_all()
            # skip missed ticks rather than bursting
            self._wake.wait(max(0.0, interval - (self.clock() - started)))
            self._wake.clear()
        self._close_loop_conns()

    def tick(self) -> None:
        """One round (loop thread only): bootstrap, flush unsaved decisions, ingest, TTL, launcher, cursor."""
        with self._tick_lock:
            self._tick_no += 1
            try:
                src, st = self._loop_conns()
                if not self._bootstrapped.is_set():
                    self._bootstrap(src, st)
                self._flush_outbox(st)
                js = self.current
                if js is not None:
                    self._ingest(src, st, js)
                    self._act(st, js.job_id, js.acc.expire(self.config.ttl_s))
                    self._check_launcher(st, js)
                    self._save_cursor(st, js)
            except StorageError as exc:
                self._close_loop_conns()
                self._db_failed(exc)
                return
            self._db_ok()

    def _ingest(self, src: Database, st: Database, js: JobState) -> None:
        if not self.launcher_tables_exist(src):
            js.reader.caught_up = True  # nothing can have been written
            return
        deadline = self.clock() + 1.0
        while True:
            rows = js.reader.read(src)
            if js.accounted is not None:
                rows = js.accounted.filter(st, js.acc.decided, rows)
            dec = js.acc.ingest(rows) if rows else None
            js.reader.advance()  # only now: a failure above re-reads these rows next tick
            if dec is not None:
                self._act(st, js.job_id, dec)
            # drained, not caught_up: on Postgres the safe cursor only moves between ticks, so
            # waiting for caught_up here re-read the window in a busy loop for the whole second.
            if js.reader.drained or self.clock() > deadline or self._stop.is_set():
                break
        js.reader.end_tick()

    def _check_launcher(self, st: Database, js: JobState) -> None:
        for ev in self.supervisor.poll():
            kind = ev.get("event")
            state = self.supervisor.state()
            if kind in ("exited", "restarted", "gave_up"):
                label = "running" if state["running"] else f"stopped:{state['stopped_by']}" if state[
                    "stopped_by"] else "exited"
                st.execute(q.SAVE_LAUNCHER, (state["pid"], state["pgid"], state["start_ticks"], label,
                                             time.time(), js.job_id))
            if kind == "exited" and ev.get("exit_code") not in (0, None) and not ev.get("stopped_by"):
                logger.error("launcher of job %s exited with code %s (log: %s)", js.job_id,
                             ev.get("exit_code"), state.get("log_path"))
        state = self.supervisor.state()
        if (state["finished"] and state["stopped_by"] != "shutdown" and js.launcher_finished_tick is None
                and self.config.launcher_kind != "none"):
            js.launcher_finished_tick = self._tick_no
        if (js.launcher_finished_tick is not None and not js.launcher_drop_done
                and self._tick_no > js.launcher_finished_tick and js.reader.caught_up):
            js.launcher_drop_done = True
            dec = js.acc.drop_all(acc_mod.LAUNCHER_EXITED, include_ready=False)
            if dec.drops:
                logger.warning("launcher of job %s has exited: dropping %d incomplete groups",
                               js.job_id, len(dec.drops))
            self._act(st, js.job_id, dec)

    def _save_cursor(self, st: Database, js: JobState) -> None:
        """Persist the cursor and the low-water mark (at most once a second, only when they can have moved)."""
        now = self.clock()
        if now - js.cursor_saved_at < 1.0:
            return
        marker = (js.reader.cursor, js.acc.changes)
        if marker == js.saved_marker:
            return  # idle: no O(groups) low-water scan, nothing to write
        with self._outbox_lock:
            if self._outbox:
                return
        if not self._serve_lock.acquire(blocking=False):
            return  # a poll is deciding groups; save next time
        try:
            with self._outbox_lock:
                if self._outbox:
                    return  # a poll queued decisions meanwhile: they must be recorded first
            cur = (js.reader.cursor, js.acc.low_water(js.reader.cursor))
            if cur != js.saved_cursor:
                st.execute(q.SAVE_CURSOR, (cur[0], cur[1], time.time(), js.job_id))
                js.saved_cursor = cur
            js.cursor_saved_at = now
            js.saved_marker = marker
        finally:
            self._serve_lock.release()

    # -- persisting and acting on decisions -----------------------------------------------------
    @staticmethod
    def _drop_record(job_id: str, d: acc_mod.Drop, now: float) -> tuple:
        return (job_id, d.group_id, acc_mod.DROPPED, d.reason, None, 0, len(d.pks), ",".join(map(str, d.pks)),
                json.dumps(d.clear_sessions), 0 if d.clear_sessions else 1, now)

    def _persist(self, st: Database, job_id: str, dec: Decisions) -> None:
        """Record decisions; idempotent (a COMMIT that failed after it succeeded is retried harmlessly)."""
        now = time.time()
        with st.transaction():
            st.executemany(q.INSERT_GROUP_IF_ABSENT, [self._drop_record(job_id, d, now) for d in dec.drops])
            st.executemany(q.INSERT_ROW, [
                (job_id, r.step_pk, r.outcome, r.reason, r.group_id, r.session_id, 0 if r.session_id else 1, now)
                for r in dec.rows])

    def _act(self, st: Database, job_id: str, dec: Decisions) -> None:
        """Persist decisions (or queue them when the database fails), then notify the proxy."""
        if not dec:
            return
        try:
            self._persist(st, job_id, dec)
        except StorageError:
            with self._outbox_lock:
                self._outbox.append((job_id, dec))
            raise
        self._notify(job_id, dec)

    def _flush_outbox(self, st: Database) -> None:
        with self._outbox_lock:
            pending, self._outbox = self._outbox, []
        for i, (job_id, dec) in enumerate(pending):
            try:
                self._persist(st, job_id, dec)
            except StorageError:
                with self._outbox_lock:
                    self._outbox[:0] = pending[i:]
                raise
            self._notify(job_id, dec)

    def _notify(self, job_id: str, dec: Decisions) -> None:
        for d in dec.drops:
            if d.clear_sessions:
                self.notifier.notify(d.reason, d.clear_sessions, [d.group_id], [("g", job_id, d.group_id)])
            logger.info("dropped group %s of job %s: %s (%d rows, %d sessions)", d.group_id, job_id,
                        d.reason, len(d.pks), len(d.clear_sessions))
        late: dict[str, tuple[set, set, list]] = {}
        for r in dec.rows:
            if r.outcome == "rejected":
                logger.warning("rejected row step_pk=%s of job %s (group %s): %s", r.step_pk, job_id,
                               r.group_id, r.reason)
            if r.session_id:
                s, g, k = late.setdefault(r.reason, (set(), set(), []))
                s.add(r.session_id)
                if r.group_id:
                    g.add(r.group_id)
                k.append(("r", job_id, r.step_pk))
        for reason, (s, g, k) in late.items():
            logger.warning("%d late rows for %d decided groups of job %s (%s); clearing their sessions",
                           len(k), len(g), job_id, reason)
            self.notifier.notify(reason, s, g, k)

    def _on_delivered(self, reason: str, session_ids: list[str], group_ids: list[str], keys: list[Any]) -> None:
        """Notifier thread: the proxy cleared these sessions; remember it durably (best effort)."""
        try:
            with self._connect() as (_src, st), st.transaction():
                st.executemany(q.MARK_GROUP_NOTIFIED, [(k[1], k[2]) for k in keys if k[0] == "g"])
                st.executemany(q.MARK_ROW_NOTIFIED, [(k[1], k[2]) for k in keys if k[0] == "r"])
        except StorageError as exc:
            logger.warning("could not record a delivered clear_sessions (%s); it will be sent again after "
                           "a restart, which is harmless", exc)

    # -- health --------------------------------------------------------------------------------------
    def _db_failed(self, exc: BaseException) -> None:
        now = self.clock()
        if self._db_failing_since is None:
            self._db_failing_since = now
        self._db_last_error = f"{type(exc).__name__}: {exc}"
        if now - self._db_error_logged_at > 30.0:
            self._db_error_logged_at = now
            if isinstance(exc, StorageError):
                logger.error("background read failed (retrying): %s", exc)
            else:
                logger.exception("background tick failed (retrying)", exc_info=exc)

    def _db_ok(self) -> None:
        if self._db_failing_since is not None:
            logger.info("database reachable again after %.1f s", self.clock() - self._db_failing_since)
        self._db_failing_since = None
        self._db_last_error = None

    def db_unhealthy(self) -> str | None:
        """An error message when background reads have been failing too long, else None."""
        since = self._db_failing_since
        if since is not None and self.clock() - since >= self.config.db_unhealthy_after_s:
            return self._db_last_error or "database unreachable"
        return None

    # -- /start_rollout and /stop_rollout ---------------------------------------------------------
    def start_rollout(self, conns: "RequestConnections", *, k: int, restart_training: bool,
                      job_session: str | None) -> tuple[int, dict[str, Any]]:
        """Select the job, start its launcher. Returns (HTTP status, body)."""
        with self._start_lock:
            launcher = self.supervisor.state()
            js = self.current
            if launcher["running"]:
                if js is not None and job_session not in (None, js.job_id):
                    raise ApiError(409, f"the launcher of job {js.job_id!r} is still running (pid "
                                   f"{launcher['pid']}); POST /stop_rollout first or name that job",
                                   job_session=js.job_id, pid=launcher["pid"])
                return 200, {"message": "AIEvoBox is already running", "pid": launcher["pid"],
                             "job_session": js.job_id if js else None}
            if not self._bootstrapped.is_set():
                self.nudge()
                if not self._bootstrapped.wait(10.0):
                    raise ApiError(503, "the service cannot reach its database yet: "
                                   f"{self._db_last_error or 'still starting'}")
            job_id = job_session or uuid.uuid4().hex
            src, st = conns.get()
            with self._tick_lock, self._serve_lock:
                js = self._select_job(src, st, job_id, k, restart_training)
                if self.config.launcher_kind != "none":
                    # Until its own launcher runs, the finished one the loop sees is not this job's:
                    # no launcher_exited drop for it (reset once the launcher is spawned).
                    js.launcher_drop_done = True
            self.nudge()
            pid = None
            if self.config.launcher_kind != "none":
                spec = self.launch_spec(job_id, k)
                try:
                    pid = self.supervisor.start(spec)
                except LauncherError as exc:
                    logger.error("cannot start the launcher for job %s: %s", job_id, exc)
                    raise ApiError(500, f"the launcher could not be started: {exc}", job_session=job_id,
                                   argv=list(spec.argv)) from exc
                js.launcher_finished_tick = None
                js.launcher_drop_done = False
                state = self.supervisor.state()
                st.execute(q.SAVE_LAUNCHER, (state["pid"], state["pgid"], state["start_ticks"], "running",
                                             time.time(), job_id))
            logger.info("rollout started: job %s, K=%s, restart_training=%s, launcher pid %s", job_id, k,
                        restart_training, pid)
            return 200, {"message": "Rollout started", "pid": pid, "job_session": job_id, "k": k,
                         "restart_training": restart_training, "floor_pk": js.floor_pk,
                         "launcher": self.config.launcher_kind}

    def _select_job(self, src: Database, st: Database, job_id: str, k: int, restart_training: bool) -> JobState:
        """Make job_id the active job (holding the tick and serve locks)."""
        self.ensure_state_schema(st)
        self._flush_outbox(st)
        prev = self.current
        if prev is not None and prev.job_id == job_id and not restart_training:
            if prev.k != k:
                prev.k = k
                prev.acc.set_k(k)
                st.execute(q.UPSERT_JOB, (job_id, k, prev.floor_pk, prev.reader.cursor,
                                          prev.acc.low_water(prev.reader.cursor), time.time(), time.time()))
            return prev
        if prev is not None and prev.job_id != job_id:
            dec = prev.acc.drop_all(acc_mod.JOB_ENDED, include_ready=True)
            self._act(st, prev.job_id, dec)
            if dec.drops:
                logger.warning("job %s ended: dropped %d undecided groups", prev.job_id, len(dec.drops))
        existing = st.fetchone(q.GET_JOB, (job_id,))
        tables = self.launcher_tables_exist(src)
        if restart_training:
            floor = int(src.scalar(q.MAX_TERMINAL_ID, (job_id,)) or 0) if tables else 0
            start_after, low_water = floor, floor + 1
        elif existing is not None:
            floor = int(existing["floor_pk"])
            low_water = int(existing["low_water_pk"])
            start_after = max(floor, low_water - 1)
        else:
            floor, start_after, low_water = 0, 0, 1
        tombstones = self._restart_tombstones(src, st, job_id, floor) if restart_training and floor > 0 else []
        now = time.time()
        # The floor and the tombstones of the groups below it commit together: a crash in between
        # would resume above the floor and serve those groups without their first rows.
        with st.transaction():
            st.execute(q.DEACTIVATE_JOBS, (now,))
            st.execute(q.UPSERT_JOB, (job_id, k, floor, start_after, low_water, now, now))
            st.executemany(q.INSERT_GROUP_IF_ABSENT, [self._drop_record(job_id, d, now) for d in tombstones])
        js = self._load_job(src, st, job_id, k, floor, start_after)
        self.current = js
        if tombstones:
            self._notify(job_id, Decisions(drops=tombstones))
            logger.warning("restart_training: job %s reads after id %s; %d groups with rows at or below it are "
                           "dropped", job_id, floor, len(tombstones))
        return js

    def _restart_tombstones(self, src: Database, st: Database, job_id: str, floor: int) -> list[acc_mod.Drop]:
        """Undecided groups with trainable rows at or below the floor, with those rows (counted as
        read and dropped, so the job's accounting keeps them) and their sessions to clear."""
        decided = {r[0] for r in st.rows(q.JOB_GROUP_STATUS, (job_id,))}
        accounted = {int(r[0]) for r in st.rows(q.ROW_PKS_FROM, (job_id, 0))}
        below: dict[str, tuple[list[int], set[str]]] = {}
        for pk, gid, sid in src.rows(q.ROWS_AT_OR_BELOW, (job_id, floor)):
            if gid is None or str(gid) in decided or int(pk) in accounted:
                continue
            pks, sids = below.setdefault(str(gid), ([], set()))
            pks.append(int(pk))
            sids.add(sid)
        return [acc_mod.Drop(gid, acc_mod.RESTART_TRAINING, sorted(pks), sorted(sids))
                for gid, (pks, sids) in below.items()]

    def stop_rollout(self) -> dict[str, Any]:
        """Stop the launcher (idempotent); the job stays selected and ready groups stay servable."""
        with self._start_lock:
            before = self.supervisor.state()
            state = self.supervisor.stop("requested")
            self.nudge()
            js = self.current
            return {"message": "Launcher stopped" if before["running"] else "No launcher running",
                    "job_session": js.job_id if js else None, "launcher": state}

    def launch_spec(self, job_id: str, k: int) -> LaunchSpec:
        """The launcher command for a job, from configuration only (argv list, never a shell)."""
        c = self.config
        kind = c.launcher_kind
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        log_path = os.path.join(c.run_dir, f"launcher-{job_id}.log")
        if kind == "command":
            subs = {"job_id": job_id, "k": str(k), "db_url": c.db_url, "storage_type": c.storage_type}
            argv = [a.format(**subs) if "{" in a else a for a in (c.launcher_cmd or ())]
            if "--job-id" not in argv:
                argv += ["--job-id", job_id]
            if "--rl-group-size" not in argv:
                argv += ["--rl-group-size", str(k)]
            return LaunchSpec(tuple(argv), c.aievobox_root or None, env, log_path)
        if kind == "simulate":
            argv = [sys.executable, "-m", "rollout_buffer.simulate", "--db-path", c.db_url, "--storage-type",
                    c.storage_type, "--job-id", job_id, "--rl-group-size", str(k), "--pool-size",
                    str(c.pool_size), "--rl-epoch", str(c.rl_epoch)]
            argv += list(c.simulate_args or ())
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            env.get("PYTHONPATH")) if p)
            return LaunchSpec(tuple(argv), None, env, log_path)
        root = c.aievobox_root or "."
        if c.env_config:
            env_args = ["--env-config", c.env_config]
        elif c.env_root:
            env_args = ["--env-root", c.env_root]
        else:
            raise ApiError(500, "the AIEvoBox launcher needs AIEVOBOX_ENV_CONFIG or AIEVOBOX_ENV_ROOT; "
                           "neither is set")
        proxy = f"http://{c.proxy_host}:{c.proxy_port}/v1" if c.proxy_host else "http://127.0.0.1:8000/v1"
        argv = ["python3", os.path.join(root, "launcher.py"), "--mode", c.aievobox_mode, "--db-path", c.db_url,
                "--storage-type", c.storage_type, *env_args, "--llm-base-url", proxy, "--llm-model",
                c.rl_model, "--llm-temperature", str(c.llm_temperature), "--max-steps", str(c.max_steps),
                "--message-cut", str(c.message_cut), "--pool-size", str(c.pool_size), "--multiplier",
                str(c.multiplier), "--job-id", job_id, "--no-rebuild-table", "--rl-use-session-suffix-url",
                "--rl-group-size", str(k), "--rl-epoch", str(c.rl_epoch), "--env-transport", c.env_transport,
                "--env-http-timeout-s", "600"]
        return LaunchSpec(tuple(argv), root, env, log_path)

    # -- /get_rollout_data ------------------------------------------------------------------------
    def get_rollout_data(self, conns: "RequestConnections", *, max_groups: int | None,
                         request_id: str | None) -> list[Any]:
        """Serve ready groups (or replay the batch bound to request_id). Returns the JSON body as
        bytes-like chunks (sent one after the other, never concatenated)."""
        started = time.perf_counter()
        try:
            return self._get_rollout_data(conns, max_groups, request_id)
        finally:
            self._observe_poll(time.perf_counter() - started)

    def _get_rollout_data(self, conns: "RequestConnections", max_groups: int | None,
                          request_id: str | None) -> list[Any]:
        if not self._bootstrapped.is_set():
            # Until the active job is resumed from the database, "no data" would be a lie: a trainer
            # would drop its request_id and the batch bound to it (already marked served) would be lost.
            self.nudge()
            if not self._bootstrapped.wait(2.0):
                raise ApiError(503, "the service is still loading its state from the database: "
                               f"{self._db_last_error or 'starting'}", retry_after=1)
        js = self.current
        if js is None:
            return _empty_body({})
        problem = self.db_unhealthy()
        if problem:
            raise ApiError(503, f"the database is unreachable: {problem}", retry_after=3)
        if request_id is None and not js.acc.ready:
            self.nudge()
            return _empty_body({"job_session": js.job_id})
        with self._serve_lock:
            js = self.current
            assert js is not None
            try:
                src, st = conns.get()
                if self._uncertain is not None:
                    self._reconcile(st, js)
                if request_id is not None:
                    batch = st.fetchone(q.BATCH_BY_REQUEST, (js.job_id, request_id))
                    if batch is not None:
                        return self._replay(src, st, js, batch)
                takes = js.acc.take_ready(max_groups)
                if not takes:
                    return _empty_body({"job_session": js.job_id})
                return self._serve(src, st, js, takes, request_id)
            except StorageError as exc:
                logger.error("serving failed: %s", exc)
                raise ApiError(503, f"the database is unreachable: {exc}", retry_after=3) from exc

    def _fetch(self, src: Database, pks: list[int]) -> dict[int, tuple]:
        out: dict[int, tuple] = {}
        for i in range(0, len(pks), FETCH_CHUNK):
            chunk = pks[i:i + FETCH_CHUNK]
            for r in src.rows(q.fetch_bodies(len(chunk), src.backend), q.fetch_bodies_params(chunk, src.backend),
                              binary=True):
                out[r[0]] = r
        return out

    def _release(self, st: Database, js: JobState, takes: list[Take]) -> None:
        """Give taken groups back to the ready queue (and record any that had to be dropped instead)."""
        dec = js.acc.release(takes)
        if dec:
            with contextlib.suppress(StorageError):  # queued in the outbox on failure
                self._act(st, js.job_id, dec)

    def _reconcile(self, st: Database, js: JobState) -> None:
        """After a serving COMMIT whose outcome is unknown: if it did happen, settle its groups now
        (a client that retries its request_id gets that batch replayed); never serve them again."""
        job_id, batch_id, built_takes, malformed_takes, malformed = self._uncertain  # type: ignore[misc]
        if job_id == js.job_id:
            if batch_id is not None:
                committed = st.scalar(q.BATCH_EXISTS, (batch_id,)) is not None
            else:
                committed = st.scalar(q.GROUP_STATUS, (job_id, malformed_takes[0].group_id)) is not None
            if committed:
                logger.warning("a serving commit of job %s reported an error but happened (batch %s, %d groups); "
                               "settling its groups", job_id, batch_id, len(built_takes) + len(malformed_takes))
                found = {t.group_id for t in js.acc.retake(built_takes + malformed_takes)}
                self._after_commit(st, js, [t for t in built_takes if t.group_id in found],
                                   [t for t in malformed_takes if t.group_id in found], malformed)
        self._uncertain = None

    def _after_commit(self, st: Database, js: JobState, built_takes: list[Take], malformed_takes: list[Take],
                      malformed: dict[str, dict[int, str]]) -> None:
        """Settle recorded groups in memory, record late rows, clear sessions at the proxy."""
        dec = js.acc.commit(built_takes + malformed_takes, malformed)
        # commit() re-derives the malformed drops and rejected rows already recorded; keep only the
        # late rows (rows that arrived while the groups were being built) to record now.
        late = Decisions(rows=[r for r in dec.rows if r.outcome == "dropped"])
        if late.rows:
            with contextlib.suppress(StorageError):  # queued in the outbox; the loop records it
                self._act(st, js.job_id, late)
        for t in built_takes:
            if t.incomplete:
                self.notifier.notify(acc_mod.INCOMPLETE_IN_SERVED, list(t.incomplete), [t.group_id],
                                     [("g", js.job_id, t.group_id)])
        for t in malformed_takes:
            logger.warning("group %s of job %s dropped: malformed rows %s", t.group_id, js.job_id,
                           malformed[t.group_id])
            self.notifier.notify(acc_mod.MALFORMED, sorted(set(t.completed) | set(t.incomplete)), [t.group_id],
                                 [("g", js.job_id, t.group_id)])

    def _serve(self, src: Database, st: Database, js: JobState, takes: list[Take],
               request_id: str | None) -> list[Any]:
        seed = secrets.token_bytes(16)
        budget = self.config.max_response_bytes
        built: list[tuple[Take, GroupItems]] = []
        malformed: dict[str, dict[int, str]] = {}
        malformed_takes: list[Take] = []
        buf = bytearray()
        meta_size = 1024 + 2 * len(request_id or "")
        i = 0
        try:
            while i < len(takes):
                # fetch the bodies of a few groups at a time
                j, n = i, 0
                while j < len(takes) and (n == 0 or n + len(takes[j].served_pks) <= FETCH_CHUNK):
                    n += len(takes[j].served_pks)
                    j += 1
                rows = self._fetch(src, [pk for t in takes[i:j] for pk in t.served_pks])
                over = False
                for t in takes[i:j]:
                    try:
                        g = build_group(t, rows, seed, js.job_id, buf)
                    except Malformed as exc:
                        malformed[t.group_id] = getattr(exc, "bad", {})
                        malformed_takes.append(t)
                        i += 1
                        continue
                    # the body is buf plus a head and a meta_info tail that lists the group ids
                    meta_size += len(t.group_id) + 8
                    if built and len(buf) + meta_size > budget:
                        del buf[g.start:]  # does not fit: it stays ready for the next poll
                        over = True
                        break
                    built.append((t, g))
                    i += 1
                if over:
                    break
        except BaseException:
            self._release(st, js, takes)
            raise
        leftover = takes[i:]
        self._release(st, js, leftover)
        done = [t for t, _ in built] + malformed_takes
        batch_id = uuid.uuid4().hex
        chunks: list[Any] = []
        in_commit = False
        try:
            if built:
                meta = {"job_session": js.job_id, "batch_id": batch_id, "request_id": request_id,
                        "replayed": False, "groups": len(built)}
                chunks = response_chunks([g for _, g in built], buf, meta)
            now = time.time()
            in_commit = True
            with st.transaction():
                if built:
                    st.execute(q.INSERT_BATCH, (batch_id, js.job_id, request_id, seed.hex(),
                                                json.dumps([t.group_id for t, _ in built]), sum(g.n_items for _, g in built),
                                                sum(map(len, chunks)), now))
                served_records = []
                for t, _g in built:
                    inc = sorted(pk for p in t.incomplete.values() for pk in p)
                    pks = sorted(t.served_pks + inc)
                    served_records.append((js.job_id, t.group_id, acc_mod.SERVED, None, batch_id,
                                           len(t.served_pks), len(inc), ",".join(map(str, pks)),
                                           json.dumps(sorted(t.incomplete)), 0 if t.incomplete else 1, now))
                st.executemany(q.INSERT_GROUP, served_records)
                for t in malformed_takes:
                    bad = malformed[t.group_id]
                    pks = sorted(pk for p in list(t.completed.values()) + list(t.incomplete.values())
                                 for pk in p if pk not in bad)
                    sessions = sorted(set(t.completed) | set(t.incomplete))
                    st.execute(q.INSERT_GROUP, (js.job_id, t.group_id, acc_mod.DROPPED, acc_mod.MALFORMED, None,
                                                0, len(pks), ",".join(map(str, pks)), json.dumps(sessions), 0, now))
                    st.executemany(q.INSERT_ROW, [(js.job_id, pk, "rejected", reason, t.group_id, None, 1, now)
                                                  for pk, reason in bad.items()])
        except BaseException:
            if in_commit and done:
                # the COMMIT may have happened: the next poll checks before serving anything
                self._uncertain = (js.job_id, batch_id if built else None, [t for t, _ in built],
                                   malformed_takes, malformed)
            self._release(st, js, done)
            raise
        self._after_commit(st, js, [t for t, _ in built], malformed_takes, malformed)
        if leftover:
            self.nudge()
        if not built:
            return _empty_body({"job_session": js.job_id})
        logger.debug("served %d groups (%d bytes) of job %s; %d left ready", len(built), len(buf), js.job_id,
                     len(leftover))
        self.polls_with_data += 1
        return chunks

    def _replay(self, src: Database, st: Database, js: JobState, batch: dict[str, Any]) -> list[Any]:
        age = time.time() - float(batch["created_at"])
        if age > self.config.replay_retention_s:
            raise ApiError(410, f"request_id {batch['request_id']!r} was answered {age:.0f} s ago, beyond the "
                           f"replay window of {self.config.replay_retention_s:.0f} s; its batch cannot be sent "
                           "again. Use a fresh request_id for new data.", batch_id=batch["batch_id"])
        seed = bytes.fromhex(batch["seed"])
        groups: list[GroupItems] = []
        buf = bytearray()
        for gid in json.loads(batch["group_ids"]):
            text = st.scalar(q.GROUP_PKS, (js.job_id, gid)) or ""
            pks = [int(p) for p in text.split(",") if p]
            rows = self._fetch(src, pks)
            completed: dict[str, list[int]] = {}
            incomplete: dict[str, list[int]] = {}
            done_sessions = {r[1] for r in rows.values() if r[9]}
            for pk in pks:
                r = rows.get(pk)
                if r is None:
                    continue
                (completed if r[1] in done_sessions else incomplete).setdefault(r[1], []).append(pk)
            take = Take(gid, {s: tuple(p) for s, p in completed.items()}, {s: tuple(p) for s, p in incomplete.items()})
            try:
                groups.append(build_group(take, rows, seed, js.job_id, buf))
            except Malformed as exc:  # pragma: no cover - rows are immutable
                raise ApiError(500, f"batch {batch['batch_id']} cannot be rebuilt: {exc}") from exc
        meta = {"job_session": js.job_id, "batch_id": batch["batch_id"], "request_id": batch["request_id"],
                "replayed": True, "groups": len(groups)}
        logger.info("replayed batch %s for request_id %s", batch["batch_id"], batch["request_id"])
        return response_chunks(groups, buf, meta)

    def _observe_poll(self, seconds: float) -> None:
        self.poll_count += 1
        self.poll_seconds += seconds
        for b in POLL_BUCKETS:
            if seconds <= b:
                self.poll_latency[b] += 1
                break
        else:
            self.poll_latency[float("inf")] += 1

    # -- introspection -----------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        """What GET /health reports (no database access)."""
        launcher = self.supervisor.state()
        js = self.current
        problem = self.db_unhealthy()
        return {
            "status": "healthy" if problem is None else "degraded",
            "aievobox_running": bool(launcher["running"]),
            "data_manager_initialized": js is not None,
            "job_session": js.job_id if js else None,
            "database": "ok" if problem is None else problem,
            "launcher": _launcher_summary(launcher),
            "proxy_notifications": self.notifier.pending(),
        }

    def stats(self, conns: "RequestConnections | None" = None) -> dict[str, Any]:
        """Per-job accounting and gauges for GET /stats."""
        js = self.current
        out: dict[str, Any] = {"job_session": js.job_id if js else None,
                               "launcher": _launcher_summary(self.supervisor.state()),
                               "proxy_notifications": self.notifier.pending(),
                               "database": "ok" if self.db_unhealthy() is None else self.db_unhealthy(),
                               "polls": {"count": self.poll_count, "with_data": self.polls_with_data,
                                         "seconds_total": round(self.poll_seconds, 6)}}
        if js is None:
            return out
        s = js.acc.stats()
        s["cursor"] = js.reader.cursor
        s["floor_pk"] = js.floor_pk
        lag = None
        if conns is not None:
            try:
                src, _st = conns.get()
                lag = int(src.scalar(q.COUNT_AFTER, (js.job_id, js.reader.max_seen)) or 0)
            except StorageError:
                lag = None
        s["lag_rows"] = lag
        r = s["rows"]
        s["accounting_balanced"] = r["read"] == r["served"] + r["dropped_total"] + r["rejected_total"] + r["pending"]
        out.update(s)
        return out


POLL_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0)


def _launcher_summary(state: dict[str, Any]) -> dict[str, Any]:
    keys = ("running", "pid", "exit_code", "restarts", "restart_policy", "stopped_by", "adopted", "will_restart",
            "finished", "started_at", "exited_at", "log_path")
    return {k: state.get(k) for k in keys}


def _empty_body(meta_extra: dict[str, Any]) -> list[Any]:
    return response_chunks([], bytearray(), meta_extra)


class RequestConnections:
    """Connections opened on first use by one request and closed at its end."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self._pair: tuple[Database, Database] | None = None
        self._cm: Any = None

    def get(self) -> tuple[Database, Database]:
        if self._pair is None:
            cm = self.service._connect()
            self._pair = cm.__enter__()
            self._cm = cm
        return self._pair

    def close(self) -> None:
        if self._cm is not None:
            cm, self._cm, self._pair = self._cm, None, None
            cm.__exit__(None, None, None)
