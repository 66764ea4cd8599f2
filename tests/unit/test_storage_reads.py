"""The storage functions other layers call instead of running SQL (launcher_tables.py,
exports.py), on a real SQLite file."""

from __future__ import annotations

import pytest

from rollout_buffer.core.errors import StorageError
from rollout_buffer.core.model import INVALID_SESSION, REJECTED, Decisions, Drop, RowEvent
from rollout_buffer.storage import launcher_tables
from rollout_buffer.storage.db import Database, connect
from rollout_buffer.storage.exports import ExportPages
from rollout_buffer.storage.store import Store

CREATED = "2026-01-01 00:00:00.000000+00:00"


@pytest.fixture
def db(tmp_path):
    db = connect(f"sqlite://{tmp_path / 'rl.db'}")
    yield db
    db.close()


def _step(db: Database, job: str, group: str, session: str, step: int, *, terminal: bool) -> None:
    flag = 1 if terminal else 0
    row = (session, step, "env", "model", group, job, "[]", "r", 0.0, 0.0, None, flag, 0, flag, 1)
    launcher_tables.insert_step(db, (*row, CREATED))


def test_the_launcher_tables_are_seen_once_created_and_a_failed_statement_is_reported(db):
    assert not launcher_tables.tables_exist(db) and not launcher_tables.steps_table_exists(db)
    failed: list[StorageError] = []
    launcher_tables.create_launcher_tables(db, failed.append)
    assert (
        failed == [] and launcher_tables.tables_exist(db) and launcher_tables.steps_table_exists(db)
    )
    db.execute("DROP INDEX idx_session_steps_job_trainable_id")
    db.execute("CREATE TABLE idx_session_steps_job_trainable_id (x INT)")  # a name taken
    launcher_tables.create_launcher_tables(db, failed.append)
    assert len(failed) == 1 and launcher_tables.tables_exist(db)


def test_a_jobs_ids_floor_rows_and_unread_rows(db):
    launcher_tables.create_launcher_tables(db, pytest.fail)
    launcher_tables.insert_sessions(db, [("j", "s1", "env", "{}", None, "g1", 0, 0, CREATED)])
    assert db.scalar("SELECT COUNT(*) FROM job_environments") == 1
    assert (
        launcher_tables.max_job_id(db, "j") == 0 and launcher_tables.max_terminal_id(db, "j") == 0
    )
    _step(db, "j", "g1", "s1", 1, terminal=False)  # id 1
    _step(db, "other", "g9", "s9", 1, terminal=True)  # id 2, another job's
    _step(db, "j", "g1", "s1", 2, terminal=True)  # id 3
    _step(db, "j", "g2", "s2", 1, terminal=False)  # id 4
    assert (
        launcher_tables.max_job_id(db, "j") == 4 and launcher_tables.max_terminal_id(db, "j") == 3
    )
    assert sorted(launcher_tables.rows_at_or_below(db, "j", 3)) == [
        (1, "g1", "s1"),
        (3, "g1", "s1"),
    ]
    assert (
        launcher_tables.unread_rows(db, "j", 1) == 2
        and launcher_tables.unread_rows(db, "j", 4) == 0
    )


def test_export_pages_stream_every_decision_across_page_boundaries(db):
    store = Store(db)
    store.ensure_schema()
    store.activate_job("j", 1, 0, 0, 1, [])
    groups = [f"g{i}" for i in (3, 1, 5, 2, 4)]
    rows = [RowEvent(pk, REJECTED, INVALID_SESSION, groups[pk % 5], None) for pk in range(10, 17)]
    orphans = [RowEvent(pk, REJECTED, "missing_group", None, f"s{pk}") for pk in (9, 1, 5)]
    drops = [Drop(g, "ttl", [100 + i], [f"s{g}"]) for i, g in enumerate(groups)]
    store.record("j", Decisions(drops=drops, rows=rows + orphans))
    pages = ExportPages(db, "j", 2)
    assert pages.job_known() and not ExportPages(db, "nope", 2).job_known()
    assert pages.recent_jobs() == ["j"]
    assert pages.count() == len(groups) + len(orphans)
    assert [g["group_id"] for g in pages.groups()] == sorted(groups)
    assert [(r[0], r[1]) for r in pages.group_rows()] == sorted(
        (r.group_id, r.step_pk) for r in rows
    )
    assert [r[0] for r in pages.orphans()] == [1, 5, 9]
    assert pages.batch_seed("no-such-batch") is None
