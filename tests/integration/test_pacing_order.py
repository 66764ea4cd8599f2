"""Held first calls go in the order the launcher started their sessions (issue 23). A held call
keeps its session's place in the launcher's pool, and the launcher starts sessions in the order of
job_environments: a group admitted ahead of its turn may have sessions not started yet, waiting
for a place the held sessions of earlier groups keep (in the pacing bench such a group finished
3 s late, a poll cadence lost). Real gate, real HTTP server standing in for the proxy."""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

import pytest
from fakes.fake_llm import FakeLLM
from support import Writer, wait_until
from test_pacing import call, gated, schedule


@pytest.fixture
def db_url(lite_url: str) -> str:
    """The gate does not depend on the backend: SQLite only."""
    return lite_url


def test_when_the_budget_frees_the_group_listed_first_goes_first(
    harness_factory: Any, db_url: str
) -> None:
    with FakeLLM(version=3) as llm:
        h, port = gated(harness_factory, db_url, llm)  # (S 0 + 1) x B 1: one group at a time
        w = Writer(db_url)
        pool = concurrent.futures.ThreadPoolExecutor(4)
        try:
            for group, sessions in (
                ("g1", ["a1", "a2"]),
                ("g2", ["b1", "b2"]),
                ("g3", ["c1", "c2"]),
            ):
                schedule(w, group, sessions)
            h.start(k=2)
            h.settle()
            call(port, "a1")  # g1 takes the budget
            call(port, "a2")

            def held() -> int:
                return int(h.client.get("/admission").get_json()["gate"]["held_calls"])

            later = pool.submit(call, port, "c1")  # g3's session arrives first...
            assert wait_until(lambda: held() == 1, 5)
            earlier = pool.submit(call, port, "b1")  # ...then g2's, listed before it
            assert wait_until(lambda: held() == 2, 5)
            w.step("g1", "a1", 1, completed=True, step_reward=0.1)
            w.step("g1", "a2", 1, completed=True, step_reward=0.2)
            h.settle()
            assert len(h.poll()["data"]["data"]) == 2  # the trainer takes g1...
            time.sleep(0.3)
            h.poll()  # ...and comes back after its step: one place frees
            earlier.result(timeout=10)
            time.sleep(0.6)  # more than two rounds of the held calls
            assert not later.done(), "g3 went before g2, listed before it"
            assert llm.sessions() == ["a1", "a2", "b1"]
            assert held() == 1
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
            w.close()
