"""The launcher's tables as the service reads them beside ingest: whether they exist yet, the ids
a job has reached, the rows a restart_training floor leaves behind, the rows not read yet, and what
generating a group cost (the export).

Owns: running those reads on the source connection (the launcher's database) and turning their
results into plain values. Ingest's reads are the reader's (reader.py) and row bodies fetch.py's;
the statements are in launcher_sql.py. It must not write: the launcher's tables are its own.
"""

from __future__ import annotations

from typing import Any

from rollout_buffer.storage import launcher_sql
from rollout_buffer.storage.database import Database


def steps_table_exists(source: Database) -> bool:
    """True once the launcher has created session_steps (a fresh database has it only after the
    launcher starts)."""
    return bool(int(source.scalar(launcher_sql.HAS_STEPS_TABLE[source.backend]) or 0))


def sequence_cache(source: Database) -> Any:
    """How many ids the sequence of session_steps.id caches per connection (Postgres only; falsy
    when the table does not exist yet)."""
    return source.scalar(launcher_sql.HAS_STEPS_TABLE[source.backend]) and source.scalar(
        launcher_sql.SEQUENCE_CACHE
    )


def max_job_id(source: Database, job_id: str) -> int:
    """The largest id of the job's rows, 0 when it has none."""
    return int(source.scalar(launcher_sql.MAX_JOB_ID, (job_id,)) or 0)


def max_terminal_id(source: Database, job_id: str) -> int:
    """The id of the job's last terminal row, 0 when it has none."""
    return int(source.scalar(launcher_sql.MAX_TERMINAL_ID, (job_id,)) or 0)


def rows_at_or_below(source: Database, job_id: str, floor: int) -> list[tuple[Any, ...]]:
    """(id, group_id, session_id) of the job's trainable rows at or below ``floor``."""
    return source.rows(launcher_sql.ROWS_AT_OR_BELOW, (job_id, floor))


def unread_rows(source: Database, job_id: str, after: int) -> int:
    """How many trainable rows of the job have an id above ``after`` (written, not read yet)."""
    return int(source.scalar(launcher_sql.COUNT_AFTER, (job_id, after)) or 0)


def generation_rows(source: Database, job_id: str, group_id: str) -> list[tuple[Any, ...]]:
    """Per session of a group: (session_id, its rows of any kind, first and last created_at,
    whether it wrote a trainable row), what generating the group cost (the export)."""
    return source.rows(launcher_sql.EXPORT_GENERATION, (job_id, group_id))


def scheduled_sessions(source: Database, job_id: str, group_id: str) -> list[str]:
    """The sessions the launcher scheduled for a group (job_environments: a StorageError when a
    writer that is not the launcher has no such table)."""
    return [r[0] for r in source.rows(launcher_sql.EXPORT_SCHEDULED, (job_id, group_id))]
