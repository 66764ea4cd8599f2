"""The ingest loop (unit tier), driven by calling ``tick()`` with no thread: bootstrap, ingest,
ready signal, TTL drops recorded, the durable cursor, a failing database and the skipped ticks.
Real SQLite files in tmp_path, a fake clock, no sockets."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from parts import Parts

from rollout_buffer.core.model import TTL


@pytest.fixture
def parts(tmp_path) -> Iterator[Parts]:
    made = Parts(tmp_path, ttl_s=60.0)
    yield made
    made.close()


def test_the_first_tick_bootstraps_and_then_ingests_a_complete_group(parts: Parts) -> None:
    assert not parts.signals.bootstrapped.is_set()
    parts.tick()
    assert parts.signals.bootstrapped.is_set() and parts.jobs.current is None
    job_state = parts.select(k=2)
    parts.writer.group("g1", 2)
    parts.writer.group("g2", 2, complete=1)
    parts.tick()
    assert list(job_state.accumulator.ready) == ["g1"] and job_state.ready_count() == 1
    assert job_state.accumulator.stats()["groups"]["pending"] == 1
    assert parts.health.failing_since is None


def test_a_tick_returns_the_rest_of_the_interval_and_skips_missed_ones(parts: Parts) -> None:
    assert parts.loop.interval == pytest.approx(0.02)  # ingest_interval_s, under ttl_s / 10
    assert 0.0 <= parts.tick() <= 0.02
    parts.clock.step = 1.0  # every reading of the clock a second later: a slow tick
    assert parts.tick() == 0.0  # late: the next one at once, never a burst of the missed ones


def test_a_group_older_than_the_ttl_is_dropped_and_recorded(parts: Parts) -> None:
    parts.tick()
    job_state = parts.select(k=2)
    parts.writer.group("g1", 2, complete=1)
    parts.tick()
    assert job_state.accumulator.stats()["groups"]["pending"] == 1
    parts.tick(advance=61.0)
    assert job_state.accumulator.stats()["groups"]["pending"] == 0
    decision = parts.conns.get().store.group_decision("job1", "g1")
    assert decision == ("dropped", TTL)


def test_the_cursor_is_saved_at_most_once_a_second(parts: Parts) -> None:
    parts.tick()
    parts.select(k=2)
    pks = parts.writer.session("g1", "s1", 2)
    parts.tick(advance=2.0)
    store = parts.conns.get().store
    assert int(store.get_job("job1")["cursor_pk"]) == pks[-1]
    more = parts.writer.session("g1", "s2", 2)
    parts.tick(advance=0.1)  # within the second: not saved yet
    assert int(store.get_job("job1")["cursor_pk"]) == pks[-1]
    parts.tick(advance=1.0)
    assert int(store.get_job("job1")["cursor_pk"]) == more[-1]


def test_a_failing_database_is_reported_and_the_loop_goes_on(tmp_path) -> None:
    (tmp_path / "dir").mkdir()
    parts = Parts(tmp_path, state_db_url="sqlite://" + str(tmp_path / "dir"))
    try:
        assert parts.tick() >= 0.0  # no exception out of the tick
        assert parts.health.failing_since is not None and parts.health.last_error
        assert not parts.signals.bootstrapped.is_set()
        parts.clock.now += parts.config.db_unhealthy_after_s
        assert parts.health.problem() == parts.health.last_error
    finally:
        parts.close()


def test_sync_waits_for_ticks_run_elsewhere_and_gives_up_when_stopping(parts: Parts) -> None:
    parts.loop.stopping.set()
    assert parts.loop.sync(timeout=5.0) is False  # a stopped loop never ticks again
    assert parts.loop.wake.is_set()  # (it asked for one)
