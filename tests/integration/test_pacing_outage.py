"""The LLM proxy unavailable for a while (a restart, a weight reload answering 503): the launcher's
client backs off and retries, up to 30 s between tries (SPEC §5). Its sessions are quiet at the
gate meanwhile, but alive: their groups must keep their place in the budget, or every running
group is taken for lost and a whole new (S + 1) x B is admitted, to be generated next to the old
ones once the proxy is back (issue 23). Real gate, real HTTP server standing in for the proxy."""

from __future__ import annotations

import time
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


def test_sessions_backing_off_from_a_failing_proxy_keep_their_groups_place(
    harness_factory: Any, db_url: str
) -> None:
    with FakeLLM(version=3) as llm:
        h, port = gated(harness_factory, db_url, llm, pacing_batch_groups=2, pacing_idle_gap_s=10.0)
        w = Writer(db_url)
        try:
            schedule(w, "g1", ["a1", "a2"])
            schedule(w, "g2", ["b1", "b2"])
            schedule(w, "g3", ["c1", "c2"])
            h.start(k=2)
            h.settle()
            running = ["a1", "a2", "b1", "b2"]
            for _ in range(6):  # g1 and g2 take the budget of two; their steps are quick
                for session in running:
                    r = requests.post(URL.format(port=port, session=session), json=HI, timeout=5)
                    assert r.status_code == 200
            accumulator = h.service.jobs.current.accumulator
            quiet = accumulator.quiet_after()
            assert quiet is not None and quiet < 2.0  # learned: live sessions are never this quiet

            llm.status = 503  # the proxy reloads its weights
            for session in running:  # each session's next call fails: its client backs off
                r = requests.post(URL.format(port=port, session=session), json=HI, timeout=5)
                assert r.status_code == 503
            time.sleep(quiet + 0.5)  # quieter than live sessions are, within the first backoff

            doc = h.client.get("/admission").get_json()
            assert doc["inputs"]["in_progress"]["stalled"] == 0, doc["inputs"]["in_progress"]
            assert doc["budget"] == 0, doc["why"]
            with pytest.raises(requests.exceptions.ReadTimeout):  # g3 waits for a place
                requests.post(URL.format(port=port, session="c1"), json=HI, timeout=1.5)
            assert wait_until(
                lambda: h.client.get("/admission").get_json()["gate"]["held_calls"] == 0, 5
            )
            assert "c1" not in llm.sessions()
        finally:
            w.close()
