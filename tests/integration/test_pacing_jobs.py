"""A job restarted with a new job_session while the pacing gate holds calls (issue 23): the gate's
held calls are the gate's, whatever job is active; they were counted on the job's admission, so a
call held under one job and released under the next showed the new job -1 held calls, and the
call still held showed none. Real gate, real HTTP server standing in for the proxy."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import pytest
import requests
from fakes.fake_llm import FakeLLM
from support import Writer, wait_until
from test_pacing import HI, URL, gated, schedule


@pytest.fixture
def db_url(lite_url: str) -> str:
    """The gate does not depend on the backend: SQLite only."""
    return lite_url


def test_held_calls_are_counted_right_across_a_new_job_session(
    harness_factory: Any, db_url: str
) -> None:
    with FakeLLM(version=3) as llm:
        h, port = gated(harness_factory, db_url, llm, pacing_batch_groups=1, pacing_idle_gap_s=10.0)
        w = Writer(db_url)
        pool = concurrent.futures.ThreadPoolExecutor(1)
        try:
            schedule(w, "g1", ["a1", "a2"])
            schedule(w, "g2", ["b1", "b2"])
            h.start(k=2)
            h.settle()
            assert requests.post(URL.format(port=port, session="a1"), json=HI, timeout=5).ok
            held = pool.submit(
                requests.post, URL.format(port=port, session="b1"), json=HI, timeout=3.0
            )

            def gate() -> dict[str, Any]:
                return dict(h.client.get("/admission").get_json()["gate"])

            assert wait_until(lambda: gate()["held_calls"] == 1, 5)
            h.start(k=2, job="job2")  # the operator starts another job: b1 is still held
            assert h.client.get("/admission").get_json()["job_session"] == "job2"
            assert gate()["held_calls"] == 1
            with pytest.raises(requests.exceptions.ReadTimeout):
                held.result()  # its client gives up
            assert wait_until(lambda: gate()["held_calls"] == 0, 5)
            assert gate()["held_total"] == 0  # none held under job2
            assert "b1" not in llm.sessions()
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
            w.close()
