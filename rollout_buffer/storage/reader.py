"""The job's cursors over the launcher's tables: ingest's (:class:`Reader`), the restart filter
(:class:`Accounted`) and the census's (:class:`CensusReader`).

Owns: which trainable rows of the active job have been returned to the accumulator. It reads
only the launcher's ``session_steps`` metadata (ids, flags, step_id, step_reward and the
weight_version of env_state); it never writes, and it knows nothing of groups or decisions.
The census (see :mod:`rollout_buffer.core.census`) has two id cursors of its own, one over the
sessions the launcher scheduled (``job_environments``) and one over the job's rows that are not
trainable. It reads ids, sessions, groups, step ids and the terminal flag, never messages. On
Postgres a row committed late with a smaller id than one already read is missed there: the census
only makes a drop earlier (the TTL and the launcher's exit still drop such a group), so it does not
pay for the ingest reader's safe cursor.

It must not write or account: the restart filter only says which rows were accounted before.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any, TypeVar

from rollout_buffer.core.census import StepFact
from rollout_buffer.core.errors import StorageError
from rollout_buffer.core.items import ingest_fields
from rollout_buffer.core.model import Row
from rollout_buffer.storage import launcher_sql
from rollout_buffer.storage.db import Database

MIN_ID = -(2**63)  # the smallest id a BIGINT (or a SQLite INTEGER) holds


def first_read_after(start_after: int) -> int:
    """The id reading starts after. 0 (no floor, nothing read yet) means before the smallest id
    there can be: a row written with an id of 0 or below (by hand, into an identity column) is read
    and accounted like any other, never skipped for good."""
    return MIN_ID if start_after == 0 else start_after


RowT = TypeVar("RowT", bound=tuple[Any, ...])  # a row read, whatever its tuple type


class Reader:
    """The job's ingest cursor: every trainable row is returned exactly once.

    On SQLite writers are serialised, so ids become visible in order and ``id > cursor`` is enough.
    On Postgres a smaller id can commit after a larger one. The reader keeps a *safe* cursor,
    below which every row is known to be visible, re-reads the window between it and the largest
    id seen, and skips ids it already returned. Just before each read it asks which transactions
    are writing ``session_steps`` (they hold its RowExclusiveLock from before they take an id until
    they end). At the first read of a tick it pairs those writers with the largest id seen at the
    end of a tick at least ``HORIZON_LAG_S`` earlier: a transaction that could still commit a
    smaller id is one of them (the lag covers the instant between an INSERT taking its id and the
    lock list showing it). Once none of them is writing any more, at a later read, that read's
    snapshot holds every such row, and the safe cursor moves up to that id. Only writers of this
    table count: a transaction left open elsewhere on the server (another database, pg_dump, an
    idle session) no longer holds the cursor back, as the snapshot's xmin did, which made every
    tick re-read a window that grew for as long as it stayed open.

    ``read`` does not move the cursor: ``advance`` does, once the caller has ingested the rows, so a
    failure in between re-reads them instead of losing them.
    """

    HORIZON_LAG_S = 1.0

    def __init__(
        self, job_id: str, start_after: int, batch: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.job_id = job_id
        start_after = first_read_after(start_after)
        self.cursor = start_after
        self.max_seen = start_after
        self.batch = batch
        self.clock = clock
        self.seen: set[int] = set()
        self.horizons: collections.deque[tuple[frozenset[str], int]] = collections.deque()
        self.tick_ends: collections.deque[tuple[float, int]] = collections.deque(
            [(float("-inf"), start_after)]
        )
        self.first_read_of_tick = True
        self.caught_up = False
        self.drained = False  # the last read returned less than a batch: nothing more to read now
        self._staged: tuple[Any, ...] | None = None
        self._postgres = False

    def end_tick(self) -> None:
        if self._postgres:
            self.tick_ends.append((self.clock(), self.max_seen))
        self.first_read_of_tick = True

    def read(self, db: Database) -> list[Row]:
        """The next rows not returned before, as :class:`~rollout_buffer.core.model.Row` values."""
        # before the snapshot: a writer that has ended by now committed before it (or rolled back)
        horizon = db.table_writers()
        with db.read_snapshot():
            window: list[tuple[Any, ...]] = []
            if horizon is not None and self.cursor < self.max_seen:
                window = db.rows(
                    launcher_sql.READ_WINDOW[db.backend], (self.job_id, self.cursor, self.max_seen)
                )
            batch = db.rows(
                launcher_sql.READ_AFTER[db.backend], (self.job_id, self.max_seen, self.batch)
            )
        drained = len(batch) < self.batch
        if horizon is None:
            self._staged = (batch, batch, drained, None)
            return [Row(r[0], r[1], r[2], r[3], *ingest_fields(r[4], r[5], r[6])) for r in batch]
        new = [r for r in window if r[0] not in self.seen]
        new.extend(batch)
        self._staged = (new, batch, drained, horizon)
        return [Row(r[0], r[1], r[2], r[3], *ingest_fields(r[4], r[5], r[6])) for r in new]

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
        writers: frozenset[str] = horizon
        if self.first_read_of_tick:
            self.first_read_of_tick = False
            limit = self.clock() - self.HORIZON_LAG_S
            paired = None
            while self.tick_ends and self.tick_ends[0][0] <= limit:
                paired = self.tick_ends.popleft()
            if paired is not None:
                self.tick_ends.appendleft(
                    paired
                )  # still the newest old-enough end for the next tick
                if not self.horizons or self.horizons[-1][1] < paired[1]:
                    self.horizons.append((writers, paired[1]))
        moved = False
        while self.horizons and not (self.horizons[0][0] & writers):
            self.cursor = max(self.cursor, self.horizons.popleft()[1])
            moved = True
        if moved:
            self.seen = {pk for pk in self.seen if pk > self.cursor}
        self.caught_up = drained and self.cursor >= self.max_seen

    def nothing_to_read(self) -> None:
        """The launcher's table does not exist yet: nothing can have been written, so the reader is
        caught up."""
        self.caught_up = True


class Accounted:
    """After a restart: which re-read rows were already accounted before it (skip them)."""

    def __init__(self, job_id: str, upto_pk: int, row_pks: set[int]) -> None:
        self.job_id = job_id
        self.upto_pk = upto_pk
        self.row_pks = row_pks
        self.group_pks: dict[str, set[int]] = {}

    def filter(
        self, group_pks: Callable[[str], list[int]], decided: dict[str, str], rows: list[RowT]
    ) -> list[RowT]:
        """The rows not accounted before the restart; ``group_pks(group_id)`` gives the pks a
        decided group's record accounted (asked once per group)."""
        if not rows or (rows[0][0] > self.upto_pk and not self.row_pks):
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
                    pks = self.group_pks[str(gid)] = set(group_pks(str(gid)))
                if pk in pks:
                    continue
            out.append(r)
        return out


class CensusReader:
    """The job's census cursors: each scheduled session and each non-trainable row, once."""

    def __init__(self, job_id: str, batch: int = 20_000) -> None:
        self.job_id = job_id
        self.batch = batch
        self.scheduled_after = MIN_ID
        self.steps_after = MIN_ID
        self.no_schedule = False  # job_environments is missing (a writer that is not a launcher)

    def read(self, db: Database) -> tuple[list[tuple[str, str]], list[StepFact]]:
        """The next scheduled sessions (session, group) and non-trainable rows."""
        scheduled: list[tuple[str, str]] = []
        if not self.no_schedule:
            try:
                rows = db.rows(
                    launcher_sql.CENSUS_SCHEDULED, (self.job_id, self.scheduled_after, self.batch)
                )
            except StorageError:
                if db.broken or self._has_schedule(db):
                    raise  # the table is there: a real failure, retried at the next tick
                self.no_schedule = True
                rows = []
            if rows:
                self.scheduled_after = rows[-1][0]
            scheduled = [(r[1], r[2]) for r in rows]
        steps = db.rows(launcher_sql.CENSUS_STEPS, (self.job_id, self.steps_after, self.batch))
        if steps:
            self.steps_after = steps[-1][0]
        facts = [StepFact(r[1], r[2], r[3], bool(r[4])) for r in steps]
        return scheduled, facts

    @staticmethod
    def _has_schedule(db: Database) -> bool:
        try:
            db.rows(launcher_sql.HAS_SCHEDULE)
        except StorageError:
            return False
        return True
