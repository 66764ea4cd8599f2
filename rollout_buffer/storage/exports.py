"""The buffer's decisions of one job as an export reads them: a keyset page at a time.

Owns: paging through a job's group decisions (by group_id, in byte order on both backends), the
rows accounted one by one that belong to a group (by group_id, step_pk) and those with no usable
group (by step_pk), so that the export merges the streams in constant memory; and the counts, the
job check and a delivered batch's uid seed an export needs. It reads only the state connection.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from rollout_buffer.storage import queries as q
from rollout_buffer.storage.db import Database


class ExportPages:
    """One job's decisions through one state connection, ``page`` rows a statement."""

    def __init__(self, state_db: Database, job_id: str, page: int) -> None:
        self.state_db = state_db
        self.job_id = job_id
        self.page = page

    def count(self) -> int:
        """How many records an ``all`` export has."""
        return int(self.state_db.scalar(q.EXPORT_COUNT_GROUPS, (self.job_id,)) or 0) + int(
            self.state_db.scalar(q.EXPORT_COUNT_ORPHANS, (self.job_id,)) or 0
        )

    def job_known(self) -> bool:
        """True when the buffer's tables hold the job."""
        return self.state_db.fetchone(q.GET_JOB, (self.job_id,)) is not None

    def recent_jobs(self) -> list[str]:
        """The newest jobs' ids (to name them when an unknown one is asked for)."""
        return [r[0] for r in self.state_db.rows(q.EXPORT_RECENT_JOBS)]

    def groups(self) -> Iterator[dict[str, Any]]:
        """The job's group decisions in group_id order."""
        after = ""
        while True:
            page = self.state_db.fetchall(
                q.EXPORT_GROUPS[self.state_db.backend], (self.job_id, after, self.page)
            )
            yield from page
            if len(page) < self.page:
                return
            after = page[-1]["group_id"]

    def group_rows(self) -> Iterator[tuple[Any, ...]]:
        """The rows accounted one by one that belong to a group, by (group_id, step_pk)."""
        gid, pk = "", -1 << 62
        while True:
            page = self.state_db.rows(
                q.EXPORT_GROUP_ROWS[self.state_db.backend], (self.job_id, gid, gid, pk, self.page)
            )
            yield from page
            if len(page) < self.page:
                return
            gid, pk = page[-1][0], int(page[-1][1])

    def orphans(self) -> Iterator[tuple[Any, ...]]:
        """The rejected rows with no usable group, by step_pk."""
        pk = -1 << 62
        while True:
            page = self.state_db.rows(q.EXPORT_ORPHAN_ROWS, (self.job_id, pk, self.page))
            yield from page
            if len(page) < self.page:
                return
            pk = int(page[-1][0])

    def batch_seed(self, batch_id: str) -> dict[str, Any] | None:
        """A delivered batch's uid seed and meta, None once the batch was pruned."""
        return self.state_db.fetchone(q.BATCH_SEED, (batch_id,))
