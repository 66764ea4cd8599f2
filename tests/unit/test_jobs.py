"""The active job (unit tier): selecting a job records it, a fresh instance resumes it, another job
ends the previous one's undecided groups, restart_training reads after the floor, a missing
launcher table is waited for. Real SQLite files, a fake clock, no thread."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from parts import Parts

from rollout_buffer.core.model import JOB_ENDED, RESTART_TRAINING
from rollout_buffer.runtime.jobs import Jobs


@pytest.fixture
def parts(tmp_path) -> Iterator[Parts]:
    made = Parts(tmp_path)
    made.tick()  # the bootstrap: the state tables
    yield made
    made.close()


def test_a_selected_job_is_recorded_and_resumed_by_a_fresh_instance(parts: Parts) -> None:
    job_state = parts.select("job1", k=3)
    assert parts.jobs.current is job_state and job_state.k == 3
    pair = parts.conns.get()
    assert pair.store.active_job()["job_id"] == "job1"
    fresh = Jobs(parts.config, parts.outbox, clock=parts.clock)
    row = fresh.resume(pair.source, pair.store)
    assert row is not None and fresh.current is not None
    assert (fresh.current.job_id, fresh.current.k) == ("job1", 3)


def test_the_same_job_with_another_k_keeps_its_state(parts: Parts) -> None:
    job_state = parts.select("job1", k=2)
    assert parts.select("job1", k=4) is job_state and job_state.k == 4
    assert int(parts.conns.get().store.get_job("job1")["k"]) == 4


def test_another_job_ends_the_undecided_groups_of_the_previous_one(parts: Parts) -> None:
    parts.select("job1", k=2)
    parts.writer.group("g1", 2, complete=1)
    parts.tick()
    parts.select("job2", k=2)
    assert parts.jobs.current is not None and parts.jobs.current.job_id == "job2"
    assert parts.conns.get().store.group_decision("job1", "g1") == ("dropped", JOB_ENDED)


def test_restart_training_reads_after_the_floor_and_drops_the_groups_below(parts: Parts) -> None:
    parts.select("job1", k=2)
    parts.writer.group("g1", 2, complete=1)  # undecided when the trainer restarts
    pair = parts.conns.get()
    with parts.locks.ticking(), parts.locks.serving():
        job_state = parts.jobs.select(pair.source, pair.store, "job1", 2, True)
    assert job_state.floor_pk > 0 and job_state.reader.cursor >= job_state.floor_pk
    assert pair.store.group_decision("job1", "g1") == ("dropped", RESTART_TRAINING)


def test_a_missing_launcher_table_is_waited_for_with_one_warning(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "empty").mkdir()
    parts = Parts(tmp_path / "empty")
    try:
        pair = parts.conns.get()
        pair.source.execute("DROP TABLE session_steps")
        jobs = Jobs(parts.config, parts.outbox)
        assert not jobs.find_launcher_tables(pair.source)  # a query: no warning
        assert not [r for r in caplog.records if "session_steps" in r.getMessage()]
        assert not jobs.wait_for_launcher_tables(pair.source)
        assert not jobs.wait_for_launcher_tables(pair.source)
        warnings = [r for r in caplog.records if "session_steps does not exist" in r.getMessage()]
        assert len(warnings) == 1
        pair.source.execute("CREATE TABLE session_steps (id INTEGER PRIMARY KEY)")
        assert jobs.find_launcher_tables(pair.source) and jobs.wait_for_launcher_tables(pair.source)
    finally:
        parts.close()
