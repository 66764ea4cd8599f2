"""Reading the census's sources: the sessions the launcher scheduled (``job_environments``) and the
metadata of the job's rows that are not trainable (see :mod:`rollout_buffer.core.census`).

Owns: two id cursors, one per table. It reads ids, sessions, groups, step ids and the terminal
flag, never messages, and writes nothing. On Postgres a row committed late with a smaller id than
one already read is missed: the census only makes a drop earlier (the TTL and the launcher's exit
still drop such a group), so it does not pay for the ingest reader's safe cursor.
"""

from __future__ import annotations

from rollout_buffer.core.census import StepFact
from rollout_buffer.core.errors import StorageError
from rollout_buffer.storage import launcher_sql
from rollout_buffer.storage.db import Database

MIN_ID = -(2**63)


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
