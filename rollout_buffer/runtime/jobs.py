"""The active job: resuming it from the store, selecting another, and ``restart_training``.

Owns: :class:`JobState` (the accumulator, reader and restart filter of the active job) and the
rules for where a job's reading (re)starts. The resume point never passes what the store
promises is accounted (the low-water mark) nor what the reader knows is safe. It must not serve,
and it does not run the loop: callers hold the tick and serve locks while it swaps the job.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from rollout_buffer.core.accumulator import Accumulator
from rollout_buffer.core.census import ignore
from rollout_buffer.core.config import Config
from rollout_buffer.core.errors import StorageError
from rollout_buffer.core.model import JOB_ENDED, RESTART_TRAINING, Decisions, Drop
from rollout_buffer.core.redact import redact
from rollout_buffer.core.redeliveries import Redeliveries
from rollout_buffer.launcher.command import step_cap
from rollout_buffer.runtime.notifications import Outbox
from rollout_buffer.storage import launcher_tables
from rollout_buffer.storage.db import Database
from rollout_buffer.storage.reader import MIN_ID, Accounted, CensusReader, Reader, first_read_after
from rollout_buffer.storage.store import Store

logger = logging.getLogger(__name__)


class JobState:
    """Everything the service holds for the active job."""

    def __init__(
        self,
        job_id: str,
        k: int,
        floor_pk: int,
        accumulator: Accumulator,
        reader: Reader,
        accounted: Accounted | None,
        redeliveries: Redeliveries | None = None,
    ) -> None:
        self.job_id = job_id
        self.k = k
        self.floor_pk = floor_pk
        self.accumulator = accumulator
        self.reader = reader
        self.accounted = accounted
        # launcher_exited: the tick at which the launcher was seen finished, and whether its
        # incomplete groups were dropped already.
        self.launcher_finished_tick: int | None = None
        self.launcher_drop_done = False
        self.cursor_saved_at = 0.0
        self.saved_cursor: tuple | None = (
            None  # (cursor, low-water, trainer version, rows version) saved
        )
        self.saved_marker: tuple | None = None
        # served groups to deliver again, ahead of ready ones
        self.redeliveries = redeliveries if redeliveries is not None else Redeliveries()
        self.census = CensusReader(job_id)  # every session, those without a trainable row too

    # -- the loop's view of the launcher and of the saved cursor (only the owner's methods write)
    def launcher_finished(self, tick: int) -> None:
        """The launcher was seen finished at this tick: its incomplete groups are dropped once the
        reader caught up after it."""
        self.launcher_finished_tick = tick

    def no_launcher_drop(self) -> None:
        """No (further) ``launcher_exited`` drop for the launcher seen finished: it was done, or the
        finished launcher is not this job's (until its own is spawned)."""
        self.launcher_drop_done = True

    def launcher_started(self) -> None:
        """A launcher of this job was spawned: the view of the previous one's end starts over."""
        self.launcher_finished_tick, self.launcher_drop_done = None, False

    def cursor_saved(self, at: float, marker: tuple, saved: tuple) -> None:
        """The loop saved (or found current) the durable cursor at ``at``."""
        self.cursor_saved_at, self.saved_marker, self.saved_cursor = at, marker, saved

    def ready_count(self) -> int:
        """Groups a poll could be given now: queued redeliveries and ready groups."""
        return len(self.redeliveries) + self.accumulator.snapshot.ready

    def in_flight(self) -> bool:
        """A poll holds groups it has not recorded yet (it may be binding a request_id)."""
        return bool(self.accumulator.snapshot.in_flight or self.redeliveries.taken)

    def stats(self, launcher_db: Database | None, prebuilt: int | None = 0) -> dict:
        """The job's accounting and gauges for /stats; ``launcher_db`` (if given) for the lag (rows
        not read yet). ``prebuilt`` groups (taken into the draft built before the poll; None: every
        taken group, a draft is being built) count as ready, not in flight."""
        s = self.accumulator.stats()
        g = s["groups"]
        moved = g["in_flight"] if prebuilt is None else min(prebuilt, g["in_flight"])
        g["ready"], g["in_flight"], g["prebuilt"] = (
            g["ready"] + moved,
            g["in_flight"] - moved,
            moved,
        )
        s["cursor"] = (
            0 if self.reader.cursor == MIN_ID else self.reader.cursor
        )  # (nothing read yet)
        s["floor_pk"] = self.floor_pk
        s["lag_rows"] = None
        if launcher_db is not None:
            with contextlib.suppress(StorageError):
                s["lag_rows"] = launcher_tables.unread_rows(
                    launcher_db, self.job_id, self.reader.max_seen
                )
        r = s["rows"]
        s["accounting_balanced"] = (
            r["read"] == r["served"] + r["dropped_total"] + r["rejected_total"] + r["pending"]
        )
        s["redelivery"] = self.redeliveries.stats()
        return s


class Jobs:
    """Holds the active job (``current``) and swaps it."""

    def __init__(
        self,
        config: Config,
        outbox: Outbox,
        *,
        clock: Callable[[], float] = time.monotonic,
        changes: Callable[[tuple[Any, ...]], None] = ignore,
    ) -> None:
        self.config = config
        self.outbox = outbox
        self.clock = clock
        self.changes = changes  # each accumulator's change feed (Accumulator.publish)
        self.current: JobState | None = None
        self._tables_seen = False
        self._tables_warned = False

    def drop(self) -> JobState | None:
        """Forget the active job (this instance lost it; callers hold the serve lock); returns
        it."""
        job_state, self.current = self.current, None
        return job_state

    @staticmethod
    def find_launcher_tables(launcher_db: Database) -> bool:
        """True when session_steps exists (a fresh database has it only after the launcher
        starts). A query: it changes nothing and logs nothing."""
        return launcher_tables.steps_table_exists(launcher_db)

    def wait_for_launcher_tables(self, launcher_db: Database) -> bool:
        """One step of the loop's wait for the launcher's tables: True once they exist (then never
        asked again); the first miss logs how to create them."""
        if not self._tables_seen:
            self._tables_seen = self.find_launcher_tables(launcher_db)
        if not self._tables_seen and not self._tables_warned:
            self._tables_warned = True
            logger.warning(
                "the launcher's table session_steps does not exist yet in %s; waiting for it "
                "(`rollout-buffer init-db --db URL` creates it)",
                redact(self.config.db_url),
            )
        return self._tables_seen

    def load(
        self,
        launcher_db: Database,
        store: Store,
        job_id: str,
        k: int,
        floor_pk: int,
        start_after: int,
    ) -> JobState:
        """Build a JobState from the durable records of a job (fresh or resumed)."""
        totals = store.load_totals(job_id)
        accumulator = Accumulator(
            job_id,
            k,
            clock=self.clock,
            changes=self.changes,
            policy=self.config.policy,
            max_steps=step_cap(self.config),
        )
        accumulator.restore_decided(totals.decided)
        accumulator.counts.load(totals)
        row = store.get_job(job_id)
        if (
            row is not None
        ):  # the versions saved with the cursor (the trainer's last, the rows' largest)
            accumulator.set_versions(row.get("trainer_version"), row.get("rows_version"))
        accumulator.tainted.update(store.tainted_sessions(job_id))
        accumulator.tainted_groups.update(
            g for g in store.tainted_groups(job_id) if g not in totals.decided
        )
        accumulator.excluded.update(store.oversampled_sessions(job_id))
        accumulator.publish_snapshot()  # the restored counts, before any reader sees the job
        accounted = None
        if (totals.decided or totals.accounted_rows) and self.find_launcher_tables(launcher_db):
            upto = launcher_tables.max_job_id(launcher_db, job_id)
            accounted = Accounted(
                job_id, upto, store.row_pks_from(job_id, first_read_after(start_after))
            )
        reader = Reader(job_id, start_after, self.config.ingest_batch, clock=self.clock)
        redeliveries = Redeliveries(store.redelivery_queue(job_id), store.redelivery_totals(job_id))
        return JobState(job_id, k, floor_pk, accumulator, reader, accounted, redeliveries)

    def resume(self, launcher_db: Database, store: Store) -> dict | None:
        """At start: make the stored active job current again. Returns its stored row, or None."""
        row = store.active_job()
        if row is None or self.current is not None:
            return row
        start_after = max(int(row["floor_pk"]), int(row["low_water_pk"]) - 1)
        job_state = self.load(
            launcher_db, store, row["job_id"], int(row["k"]), int(row["floor_pk"]), start_after
        )
        self.current = job_state
        logger.info(
            "resumed job %s (K=%s, reading from id %s; %s groups decided before)",
            job_state.job_id,
            job_state.k,
            start_after,
            len(job_state.accumulator.decided),
        )
        return row

    def select(
        self, launcher_db: Database, store: Store, job_id: str, k: int, restart_training: bool
    ) -> JobState:
        """Make job_id the active job (callers hold the tick and serve locks)."""
        store.ensure_schema()
        self.outbox.flush(store)
        prev = self.current
        if prev is not None and prev.job_id == job_id and not restart_training:
            if prev.k != k:
                prev.k = k
                store.set_k(job_id, k)
                self.outbox.act(store, job_id, prev.accumulator.set_k(k)[1])
            return prev
        if prev is not None and prev.job_id != job_id:
            prev.accumulator.end()  # followers first: its drops free nothing for its sessions
            plan = prev.accumulator.drop_all(JOB_ENDED, include_ready=True)
            self.outbox.act(store, prev.job_id, plan)
            if plan.drops:
                logger.warning(
                    "job %s ended: dropped %d undecided groups", prev.job_id, len(plan.drops)
                )
        existing = store.get_job(job_id)
        tables = self.find_launcher_tables(launcher_db)
        if restart_training:
            floor = launcher_tables.max_terminal_id(launcher_db, job_id) if tables else 0
            start_after, low_water = floor, floor + 1
        elif existing is not None:
            floor = int(existing["floor_pk"])
            low_water = int(existing["low_water_pk"])
            start_after = max(floor, low_water - 1)
        else:
            floor, start_after, low_water = 0, 0, 1
        tombstones = (
            self._restart_tombstones(launcher_db, store, job_id, floor)
            if restart_training and floor > 0
            else []
        )
        store.activate_job(job_id, k, floor, start_after, low_water, tombstones)
        job_state = self.load(launcher_db, store, job_id, k, floor, start_after)
        self.current = job_state
        if tombstones:
            self.outbox.notify(job_id, Decisions(drops=tombstones))
            logger.warning(
                "restart_training: job %s reads after id %s; %d groups with rows at or below it "
                "are dropped",
                job_id,
                floor,
                len(tombstones),
            )
        return job_state

    @staticmethod
    def _restart_tombstones(
        launcher_db: Database, store: Store, job_id: str, floor: int
    ) -> list[Drop]:
        """Undecided groups with trainable rows at or below the floor, with those rows (counted as
        read and dropped, so the job's accounting keeps them) and their sessions to clear."""
        decided = set(store.decided_groups(job_id))
        accounted = store.row_pks_from(job_id, 0)
        below: dict[str, tuple[list[int], set[str]]] = {}
        for pk, gid, sid in launcher_tables.rows_at_or_below(launcher_db, job_id, floor):
            if gid is None or str(gid) in decided or int(pk) in accounted:
                continue
            pks, sids = below.setdefault(str(gid), ([], set()))
            pks.append(int(pk))
            sids.add(sid)
        return [
            Drop(gid, RESTART_TRAINING, sorted(pks), sorted(sids))
            for gid, (pks, sids) in below.items()
        ]
