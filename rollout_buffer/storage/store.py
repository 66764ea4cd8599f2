"""The buffer's durable state: the ``rollout_buffer_*`` tables, and a thread's connections.

Owns: their schema and version, loading a job's decisions and counters, recording a plan
(:class:`~rollout_buffer.core.model.Decisions`) in ONE transaction, the cursor and low-water mark,
the launcher identity, delivered batches, the notified flags, and retention. The values those
tables hold are built here too: the one builder of a ``rollout_buffer_groups`` row
(:func:`group_record`), what loading a job gives back (:class:`JobTotals`), the launcher identity
(:class:`LauncherRecord`), an unconfirmed decision for the proxy (:class:`Unnotified`), and the
steady wall clock records are aged by. Every write of a decision (a plan, the job's activation and
K, the cursor, the launcher, retention) runs the lease's fence first in its transaction
(``fence``, see runtime/lease.py): an instance that lost the job rolls back with LeaseLost. It must
not touch the launcher's tables (it is handed only the state connection) and holds no in-memory
state of its own: a :class:`Store` is a thin wrapper around one connection, cheap to build per
thread or per request.

A thread's connections are a :class:`Pair`: the launcher's database (source) and the buffer's
state database, one connection unless a separate state database is configured, with the store over
the state side. A pair belongs to one thread and never crosses a fork (STYLE §9.7): the loop
thread keeps one, each request opens one lazily (:class:`LazyPair`) and closes it at teardown, and
the notifier thread opens the state side alone when it needs it (db.state_connection)."""

from __future__ import annotations

import contextlib
import json
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from rollout_buffer.core.accounting import finite_sum
from rollout_buffer.core.config import Config
from rollout_buffer.core.errors import JobOwned, StorageError
from rollout_buffer.core.model import (
    DROPPED,
    INCOMPLETE_IN_SERVED,
    PARTIAL,
    REJECTED,
    SERVED,
    Batch,
    Decisions,
    Drop,
    GroupKey,
    LauncherState,
    NotifyKey,
    RowKey,
    Served,
)
from rollout_buffer.core.salvage import record_reason
from rollout_buffer.storage import queries as q
from rollout_buffer.storage.db import Database, connect, service_connect
from rollout_buffer.storage.launcher_tables import create_launcher_tables

STATE_NAMES = frozenset(ddl.split(" IF NOT EXISTS ", 1)[1].split()[0] for ddl in q.STATE_DDL)


_WALL0, _MONO0 = time.time(), time.monotonic()


def steady_wall() -> float:
    """Epoch seconds for ageing what was recorded (batches, ended jobs), never ahead of this
    process's monotonic clock: a wall clock stepped forward (NTP, a resumed VM) would otherwise age
    everything at once, and housekeeping would delete the batch of a poll answered a second ago (its
    retry would then get new groups, and the first batch's groups would be lost)."""
    return min(time.time(), _WALL0 + time.monotonic() - _MONO0)


@dataclass
class JobTotals:
    """A job's durable decisions and counters, to load into a fresh accumulator."""

    decided: dict[str, str] = field(default_factory=dict)
    served_rows: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    rejected: Counter[str] = field(default_factory=Counter)
    groups_served: int = 0
    groups_partial: int = 0  # served short of K (recorded with the reason ``partial``)
    groups_dropped: Counter[str] = field(default_factory=Counter)
    # (outcome: "served" or a drop reason, groups, sessions, steps, reward_sum, sessions with a
    # reward)
    figures: list[tuple[str, int, int, int, float, int]] = field(default_factory=list)
    filtered: dict[str, int] = field(
        default_factory=dict
    )  # groups dropped since the last served one
    salvaged: list[tuple[str, int]] = field(
        default_factory=list
    )  # (recorded reason, groups) of served salvaged groups (core.salvage.record_reason)

    @property
    def accounted_rows(self) -> int:
        return self.served_rows + sum(self.dropped.values()) + sum(self.rejected.values())


@dataclass(frozen=True)
class LauncherRecord:
    """The launcher identity stored with a job (adopted after a crash only if it still matches)."""

    pid: int | None
    pgid: int | None
    start_ticks: int | None
    state: LauncherState
    host: str | None = None  # adopted only on this host (procfs.host_id)


@dataclass(frozen=True)
class Unnotified:
    """A recorded decision whose sessions the proxy has not confirmed clearing."""

    reason: str
    sessions: list[str]
    group_ids: list[str]
    key: NotifyKey


def group_record(job_id: str, d: Served | Drop, now: float) -> tuple[Any, ...]:
    """The one builder of a rollout_buffer_groups row (q.INSERT_GROUP's columns)."""
    figures = finite_sum(d.rewards)
    if isinstance(d, Served):
        t = d.take
        inc = t.incomplete_pks
        pks = sorted(t.served_pks + inc)
        clear = sorted(t.incomplete)
        return (
            job_id,
            t.group_id,
            SERVED,
            PARTIAL if t.partial else record_reason(t.salvage) if t.salvage else None,
            d.batch_id,
            len(t.served_pks),
            len(inc),
            ",".join(map(str, pks)),
            json.dumps(clear),
            0 if clear else 1,
            now,
            len(t.completed),
            *figures,
        )
    return (
        job_id,
        d.group_id,
        DROPPED,
        d.reason,
        None,
        0,
        len(d.pks),
        ",".join(map(str, d.pks)),
        json.dumps(d.clear_sessions),
        0 if d.clear_sessions else 1,
        now,
        len(d.clear_sessions),
        *figures,
    )


class Store:
    """The ``rollout_buffer_*`` tables through one connection (the calling thread's), as one
    buffer (``ROLLOUT_BUFFER_NAME``; "" is the unnamed one) sees them: its active job, its ended
    jobs and its notifications; a job of another buffer is never activated."""

    def __init__(
        self, db: Database, fence: Callable[[Database], None] | None = None, buffer: str = ""
    ) -> None:
        self.db = db
        self.fence = fence
        self.buffer = buffer

    @contextlib.contextmanager
    def decision(self) -> Iterator[Database]:
        """A transaction that records a decision: the lease's fence first (it raises LeaseLost, and
        the transaction rolls back, once this instance does not own the job)."""
        with self.db.transaction():
            if self.fence is not None:
                self.fence(self.db)
            yield self.db

    # -- schema --------------------------------------------------------------------------------
    def ensure_schema(self) -> None:
        """Create the tables and indexes if missing and check the schema version."""
        db = self.db
        if not {r[0] for r in db.rows(q.STATE_OBJECTS[db.backend])} >= STATE_NAMES:
            with db.transaction():
                for ddl in q.STATE_DDL:
                    db.execute(ddl)
                if db.scalar(q.GET_META, ("schema_version",)) is None:
                    db.execute(q.PUT_META, ("schema_version", "1"))  # STATE_DDL is version 1's
        version = int(db.scalar(q.GET_META, ("schema_version",)))
        if version > q.SCHEMA_VERSION:
            raise StorageError(
                f"rollout_buffer_* tables are schema version {version}; this build knows "
                f"{q.SCHEMA_VERSION}: upgrade rollout-buffer"
            )
        while version < q.SCHEMA_VERSION:
            with db.transaction():
                # re-read inside the transaction: another instance may have migrated meanwhile
                if int(db.scalar(q.GET_META, ("schema_version",))) == version:
                    for ddl in q.MIGRATIONS[version]:
                        db.execute(ddl)
                    db.execute(q.PUT_META, ("schema_version", str(version + 1)))
            version = int(db.scalar(q.GET_META, ("schema_version",)))

    # -- jobs ----------------------------------------------------------------------------------
    def active_job(self) -> dict[str, Any] | None:
        return self.db.fetchone(q.ACTIVE_JOB, (self.buffer,))

    def job_buffer(self, job_id: str) -> str | None:
        """The buffer a job belongs to, or None when no buffer has selected it yet."""
        buffer = self.db.scalar(q.JOB_BUFFER, (job_id,))
        return None if buffer is None else str(buffer)

    def get_job(self, job_id: str) -> dict[str, Any] | None:
        return self.db.fetchone(q.GET_JOB, (job_id,))

    def activate_job(
        self,
        job_id: str,
        k: int,
        floor: int,
        start_after: int,
        low_water: int,
        tombstones: list[Drop],
    ) -> None:
        """Make job_id the buffer's only active job, with its floor and the tombstones below it,
        atomically (a crash in between would resume above the floor and serve those groups half).
        JobOwned, and nothing changes, when the job is another buffer's."""
        now = time.time()
        with self.decision():
            self.db.execute(q.DEACTIVATE_JOBS, (now, self.buffer))
            row = (job_id, k, floor, start_after, low_water, now, now, self.buffer)
            if self.db.execute(q.UPSERT_JOB, row) != 1:
                raise JobOwned(job_id, self.job_buffer(job_id) or "")
            self.db.executemany(
                q.INSERT_GROUP_IF_ABSENT, [group_record(job_id, d, now) for d in tombstones]
            )

    def set_k(self, job_id: str, k: int) -> None:
        with self.decision():
            self.db.execute(q.SET_K, (k, time.time(), job_id))

    def save_cursor(
        self,
        job_id: str,
        cursor: int,
        low_water: int,
        trainer_version: int | None = None,
        rows_version: int = 0,
    ) -> None:
        """Persist the ingest cursor, the low-water mark below which every row is accounted, and the
        job's versions (the trainer's last and the largest of the rows read, below the cursor)."""
        with self.decision():
            self.db.execute(
                q.SAVE_CURSOR,
                (cursor, low_water, trainer_version, rows_version, time.time(), job_id),
            )

    def save_launcher(self, job_id: str, rec: LauncherRecord, owner: str | None) -> None:
        """Record the job's launcher process, its host and state, and the instance that owns it."""
        with self.decision():
            self.db.execute(
                q.SAVE_LAUNCHER,
                (
                    rec.pid,
                    rec.pgid,
                    rec.start_ticks,
                    rec.state.value,
                    owner,
                    rec.host,
                    time.time(),
                    job_id,
                ),
            )

    def launcher_owner(self, job_id: str) -> str | None:
        owner: str | None = self.db.scalar(q.LAUNCHER_OWNER, (job_id,))
        return owner

    def load_totals(self, job_id: str) -> JobTotals:
        """Every decided group of the job and the rows each outcome accounted."""
        t = JobTotals(decided=self.decided_groups(job_id))
        for r in self.db.fetchall(q.GROUP_TOTALS, (job_id,)):
            if r["status"] == SERVED:
                t.groups_served += int(r["n_groups"])
                if r["reason"] == PARTIAL:
                    t.groups_partial += int(r["n_groups"])
                elif r["reason"]:  # a salvaged group's counts (issue 38)
                    t.salvaged.append((r["reason"], int(r["n_groups"])))
                t.served_rows += int(r["n_served"] or 0)
                if r["n_dropped"]:
                    t.dropped[INCOMPLETE_IN_SERVED] += int(r["n_dropped"])
                steps = int(r["n_served"] or 0)
            else:
                t.groups_dropped[r["reason"]] += int(r["n_groups"])
                if r["n_dropped"]:
                    t.dropped[r["reason"]] += int(r["n_dropped"])
                steps = int(r["n_dropped"] or 0)
            if r["n_sessions"] is not None:  # groups recorded before schema 3 have no figures
                t.figures.append(
                    (
                        SERVED if r["status"] == SERVED else r["reason"],
                        int(r["n_groups"]),
                        int(r["n_sessions"]),
                        steps,
                        float(r["reward_sum"] or 0.0),
                        int(r["n_rewarded"] or 0),
                    )
                )
        t.filtered = {
            r["reason"]: int(r["n"])
            for r in self.db.fetchall(q.FILTERED_SINCE_SERVED, (job_id, job_id))
        }
        for r in self.db.fetchall(q.ROW_TOTALS, (job_id,)):
            (t.rejected if r["outcome"] == REJECTED else t.dropped)[r["reason"]] += int(r["n"])
        return t

    def tainted_sessions(self, job_id: str) -> list[str]:
        """Sessions that wrote a row without a usable group_id (their groups are malformed)."""
        return [r[0] for r in self.db.rows(q.TAINTED_SESSIONS, (job_id,))]

    def tainted_groups(self, job_id: str) -> list[str]:
        """Groups with a row whose session_id was not text (they are dropped when they appear)."""
        return [r[0] for r in self.db.rows(q.TAINTED_GROUPS, (job_id,))]

    def oversampled_sessions(self, job_id: str) -> dict[str, set[str]]:
        """Undecided groups -> their sessions dropped as oversampled (never to be served)."""
        out: dict[str, set[str]] = {}
        for gid, sid in self.db.rows(q.OVERSAMPLED_SESSIONS, (job_id,)):
            out.setdefault(gid, set()).add(sid)
        return out

    def row_pks_from(self, job_id: str, pk: int) -> set[int]:
        """pks accounted one by one at or above pk."""
        return {int(r[0]) for r in self.db.rows(q.ROW_PKS_FROM, (job_id, pk))}

    def group_pks(self, job_id: str, group_id: str) -> list[int]:
        """The pks a decided group accounted for."""
        text = self.db.scalar(q.GROUP_PKS, (job_id, group_id)) or ""
        return [int(p) for p in text.split(",") if p]

    def group_decision(self, job_id: str, group_id: str) -> tuple[str, str | None] | None:
        """(status, reason) of a decided group, or None when it is undecided."""
        rows = self.db.rows(q.GROUP_STATUS, (job_id, group_id))
        return (rows[0][0], rows[0][1]) if rows else None

    def decided_groups(self, job_id: str) -> dict[str, str]:
        """Every decided group of the job and its status."""
        return {r[0]: r[1] for r in self.db.rows(q.JOB_GROUP_STATUS, (job_id,))}

    # -- decisions ---------------------------------------------------------------------------
    def record(self, job_id: str, plan: Decisions) -> None:
        """Write a plan in one transaction: its batch, served groups, drops, accounted rows.

        Drops and rows are idempotent (a COMMIT that reported an error after it happened is retried
        harmlessly); a served group is strict: a second decision for it is an IntegrityError."""
        now = time.time()
        db = self.db
        with self.decision():
            b = plan.batch
            if b is not None:
                db.execute(
                    q.INSERT_BATCH,
                    (
                        b.batch_id,
                        b.job_id,
                        b.request_id,
                        b.seed.hex(),
                        json.dumps(b.group_ids),
                        b.n_items,
                        b.n_bytes,
                        now,
                        json.dumps(b.meta) if b.meta else None,
                    ),
                )
            db.executemany(q.INSERT_GROUP, [group_record(job_id, s, now) for s in plan.served])
            db.executemany(
                q.INSERT_GROUP_IF_ABSENT, [group_record(job_id, d, now) for d in plan.drops]
            )
            db.executemany(
                q.INSERT_ROW,
                [
                    (
                        job_id,
                        r.step_pk,
                        r.outcome,
                        r.reason,
                        r.group_id,
                        r.session_id,
                        0 if r.session_id else 1,
                        now,
                    )
                    for r in plan.rows
                ],
            )
            db.executemany(
                q.REDELIVERY_SETTLE,
                [
                    (
                        q.DELIVERED if why is None else f"failed:{why}",
                        b.batch_id if why is None and b else None,
                        1 if why is None else 0,
                        now,
                        job_id,
                        gid,
                    )
                    for gid, why in plan.redelivered.items()
                ],
            )

    # -- redelivery (issue 11) -------------------------------------------------------------------
    def queue_redeliveries(self, job_id: str, skip: set[str]) -> tuple[list[str], int]:
        """In one fenced transaction: queue again every served group of the job not in ``skip`` (in
        the order they were served), and cancel queued ones that ``skip`` names. Returns (the queue,
        how many queued groups were cancelled)."""
        now = time.time()
        with self.decision():
            served = [r[0] for r in self.db.rows(q.REDELIVERY_SERVED_GROUPS, (job_id,))]
            again = [g for g in served if g not in skip]
            seq = int(self.db.scalar(q.REDELIVERY_NEXT_SEQ, (job_id,)))
            self.db.executemany(
                q.REDELIVERY_QUEUE, [(job_id, g, seq + i, now) for i, g in enumerate(again)]
            )
            cancel = [g for g in self.redelivery_queue(job_id) if g in skip]
            self.db.executemany(q.REDELIVERY_CANCEL, [(now, job_id, g) for g in cancel])
        return again, len(cancel)

    def redelivery_queue(self, job_id: str) -> list[str]:
        """The job's groups queued to be delivered again, in queue order."""
        return [r[0] for r in self.db.rows(q.REDELIVERY_QUEUED_GROUPS, (job_id,))]

    def redelivery_totals(self, job_id: str) -> dict[str, int]:
        """Groups of the job asked for again, delivered again, cancelled and failed (all time)."""
        r = self.db.fetchone(q.REDELIVERY_TOTALS, (job_id,)) or {}
        return {k: int(r.get(k) or 0) for k in ("requested", "delivered", "cancelled", "failed")}

    # -- batches --------------------------------------------------------------------------------
    def batch_for_request(self, job_id: str, request_id: str) -> tuple[Batch, float] | None:
        """The batch bound to a request_id and when it was recorded (epoch seconds)."""
        r = self.db.fetchone(q.BATCH_BY_REQUEST, (job_id, request_id))
        if r is None:
            return None
        batch = Batch(
            r["batch_id"],
            r["job_id"],
            r["request_id"],
            bytes.fromhex(r["seed"]),
            json.loads(r["group_ids"]),
            int(r["n_items"]),
            int(r["n_bytes"]),
            json.loads(r["meta"]) if r.get("meta") else None,
        )
        return batch, float(r["created_at"])

    def recent_request_ids(self, job_id: str, since: float) -> list[str]:
        """request_ids bound to the job's batches recorded since an epoch time."""
        return [r[0] for r in self.db.rows(q.RECENT_REQUEST_IDS, (job_id, since))]

    def recent_request_ids_elsewhere(self, job_id: str, since: float) -> list[str]:
        """request_ids bound to batches of the buffer's other jobs, recorded since an epoch
        time."""
        args = (since, self.buffer, job_id)
        return [r[0] for r in self.db.rows(q.RECENT_REQUEST_IDS_ELSEWHERE, args)]

    def batch_elsewhere(self, job_id: str, request_id: str) -> tuple[str, str] | None:
        """(job, batch) of another of the buffer's jobs that a request_id is bound to, or None."""
        r = self.db.fetchone(q.BATCH_ELSEWHERE, (self.buffer, job_id, request_id))
        return None if r is None else (str(r["job_id"]), str(r["batch_id"]))

    def batch_exists(self, batch_id: str) -> bool:
        return self.db.scalar(q.BATCH_EXISTS, (batch_id,)) is not None

    # -- retention ---------------------------------------------------------------------------------
    def prune_batches(self, before: float, limit: int = 500) -> int:
        """Delete up to ``limit`` batches recorded before an epoch time; returns how many."""
        with self.decision():
            return self.db.execute(q.PRUNE_BATCHES, (before, limit))

    def ended_jobs(self, before: float) -> list[dict[str, Any]]:
        """Ended jobs not active since an epoch time whose decisions are still kept."""
        return self.db.fetchall(q.ENDED_JOBS, (before, self.buffer))

    def purge_step(self, job_id: str, limit: int = 500) -> int:
        """Delete up to ``limit`` decisions of each kind of an ended job; returns how many."""
        with self.decision():
            n = self.db.execute(q.PURGE_GROUPS, (job_id, job_id, limit))
            n += self.db.execute(q.PURGE_ROWS, (job_id, job_id, limit))
            n += self.db.execute(q.REDELIVERY_PURGE, (job_id, job_id, limit))
            return n + self.db.execute(q.PURGE_BATCHES, (job_id, limit))

    def mark_purged(self, job_id: str, read_upto: int) -> None:
        """The job's decisions are gone: should it be selected again, it reads only after
        read_upto."""
        with self.decision():
            self.db.execute(
                q.MARK_PURGED, (time.time(), read_upto, read_upto, read_upto + 1, job_id)
            )

    # -- the proxy's confirmations ----------------------------------------------------------------
    def unnotified(self) -> Iterator[Unnotified]:
        """Recorded decisions whose sessions the proxy has not confirmed clearing (all jobs)."""
        for r in self.db.fetchall(q.UNNOTIFIED_GROUPS, (self.buffer,)):
            sessions = json.loads(r["clear_sessions"])
            if sessions:
                reason = r["reason"] if r["status"] == DROPPED else INCOMPLETE_IN_SERVED
                yield Unnotified(
                    reason, sessions, [r["group_id"]], GroupKey(r["job_id"], r["group_id"])
                )
        for r in self.db.fetchall(q.UNNOTIFIED_ROWS, (self.buffer,)):
            yield Unnotified(
                r["reason"],
                [r["session_id"]],
                [r["group_id"]] if r["group_id"] else [],
                RowKey(r["job_id"], int(r["step_pk"])),
            )

    def mark_notified(self, keys: list[NotifyKey]) -> None:
        with self.db.transaction():
            self.db.executemany(
                q.MARK_GROUP_NOTIFIED, [tuple(k) for k in keys if isinstance(k, GroupKey)]
            )
            self.db.executemany(
                q.MARK_ROW_NOTIFIED, [tuple(k) for k in keys if isinstance(k, RowKey)]
            )


class Pair:
    """A source and a state connection (one object when they share the database)."""

    def __init__(self, config: Config, fence: Callable[[Database], None] | None = None) -> None:
        self.source = service_connect(config, config.db_url)
        self.state_db = self.source
        if config.state_db_url and config.state_db_url != config.db_url:
            try:
                self.state_db = service_connect(config, config.state_db_url)
            except BaseException:
                self.source.close()
                raise
        self.store = Store(self.state_db, fence, config.buffer_name)

    def close(self) -> None:
        self.source.close()
        if self.state_db is not self.source:
            self.state_db.close()


class LazyPair:
    """A pair opened on first use and closed by ``close()`` (one request, or the loop thread)."""

    def __init__(self, config: Config, fence: Callable[[Database], None] | None = None) -> None:
        self.config = config
        self.fence = fence
        self._pair: Pair | None = None

    def get(self) -> Pair:
        if self._pair is None:
            self._pair = Pair(self.config, self.fence)
        return self._pair

    @property
    def opened(self) -> bool:
        return self._pair is not None

    def close(self) -> None:
        if self._pair is not None:
            pair, self._pair = self._pair, None
            pair.close()

    def __enter__(self) -> LazyPair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def init_database(url: str) -> str:
    """Create the launcher's tables and the buffer's own where missing (``init-db``, the demo).
    Returns the URL without its password."""
    db = connect(url)
    try:
        create_launcher_tables(db)
        Store(db).ensure_schema()
        return db.safe_url
    finally:
        db.close()
