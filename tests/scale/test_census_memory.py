"""What the census keeps per session over a long job (issue 22): once a group is decided, its
sessions leave every per-session set (only their group stays known), and late rows of a decided
group (over-sampled sessions still running) start no timing that nothing would ever settle."""

from __future__ import annotations

import tracemalloc
import uuid

import pytest

from rollout_buffer.core.census import Census, StepFact

pytestmark = pytest.mark.slow  # tens of thousands of sessions, measured: the slow tier


def test_a_decided_groups_sessions_cost_little_and_late_rows_nothing() -> None:
    census = Census(10)
    n = 40_000
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for g in range(n // 8):
            gid = f"group-{g}"
            sessions = [str(uuid.uuid4()) for _ in range(8)]
            census.schedule((s, gid) for s in sessions)
            census.observe((StepFact(s, gid, 3, True) for s in sessions), trainable=True, now=1.0)
            census.settle(gid, "served")
            # an over-sampled session of the served group goes on writing
            census.observe([StepFact(sessions[0], gid, 4, False)], trainable=False, now=2.0)
        per_session = (tracemalloc.get_traced_memory()[0] - base) / n
    finally:
        tracemalloc.stop()
    assert per_session < 200, f"{per_session:.0f} bytes kept per decided session"
    assert not census.timing and not census.started
    assert census.stats() == {
        "known": n,
        "scheduled": n,
        "with_trainable_row": n,
        "without_trainable_row": 0,
        "ended_without_result": 0,
    }
