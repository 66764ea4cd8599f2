"""The launcher's writes, as the simulated launcher and an export's replay make them: the tables,
one scheduled session per row of job_environments, one step per row of session_steps.

Owns: running those statements (launcher_sql.py holds them) on a connection the caller owns and
retries on. INSERT only: a launcher never updates nor deletes a row, and the service never writes
here at all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from rollout_buffer.core.errors import StorageError
from rollout_buffer.storage import launcher_sql
from rollout_buffer.storage.database import Database


def tables_exist(db: Database) -> bool:
    """True when both of the launcher's tables can be read."""
    try:
        db.rows("SELECT 1 FROM session_steps WHERE 1 = 0")
        db.rows("SELECT 1 FROM job_environments WHERE 1 = 0")
        return True
    except StorageError:
        return False


def create_tables(db: Database, failed: Callable[[StorageError], None]) -> None:
    """Run the launcher's DDL statement by statement; a statement that fails (another creator
    raced this one) goes to ``failed`` and the next one runs."""
    for stmt in launcher_sql.LAUNCHER_DDL[db.backend]:
        try:
            db.execute(stmt)
        except StorageError as exc:
            failed(exc)


def insert_sessions(db: Database, rows: Sequence[Sequence[Any]]) -> None:
    """Schedule sessions: job_environments rows (launcher_sql.ENV_COLUMNS), in one transaction."""
    with db.transaction():
        db.executemany(launcher_sql.INSERT_ENV, rows)


def insert_step(db: Database, row: Sequence[Any]) -> None:
    """Write one step: a session_steps row (launcher_sql.STEP_COLUMNS)."""
    db.execute(launcher_sql.INSERT_STEP, row)


def insert_steps(db: Database, rows: Sequence[Sequence[Any]]) -> None:
    """Write a flush of steps (session_steps rows) in one transaction, as the launcher flushes."""
    with db.transaction():
        db.executemany(launcher_sql.INSERT_STEP, rows)
