"""The service restarted under a running launcher, pacing on (issue 23): the sessions that were
running make their next call when their environment's step ends, or when their client's backoff
does (up to 30 s, SPEC §5). Until then the gate has not seen them, while the sessions the launcher
starts now make their first calls: they must not be taken for sessions the launcher passed over
(it started them before the restart), or their groups are taken for lost and the budget admits
new groups next to them. Real gate, real HTTP server standing in for the proxy."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import pytest
import requests
from fakes.fake_llm import FakeLLM
from support import Writer, wait_until
from test_pacing import HI, URL, free_port, gated, schedule


@pytest.fixture
def db_url(lite_url: str) -> str:
    """The gate does not depend on the backend: SQLite only."""
    return lite_url


def test_sessions_running_before_a_restart_are_not_taken_for_passed_over(
    harness_factory: Any, db_url: str
) -> None:
    with FakeLLM(version=3) as llm:
        w = Writer(db_url)
        for group, sessions in (
            ("g1", ["a1", "a2"]),
            ("g2", ["b1", "b2"]),
            ("g3", ["c1", "c2"]),
            ("g4", ["d1", "d2"]),
        ):
            schedule(w, group, sessions)
        for group, session in (("g1", "a1"), ("g1", "a2"), ("g2", "b1"), ("g2", "b2")):
            w.step(group, session, 1, trainable=False)  # before the restart: a step each
        port = free_port()
        h, _port = gated(  # the service, just restarted (with the default idle gap)
            harness_factory, db_url, llm, port, pacing_batch_groups=3, pacing_idle_gap_s=10.0
        )
        stop = threading.Event()
        threads: list[threading.Thread] = []
        try:
            h.start(k=2)
            h.settle()
            assert h.client.get("/admission").get_json()["inputs"]["in_progress"]["running"] == 2

            def run(session: str) -> None:  # g3 starts now, and runs: quick steps
                while not stop.is_set():
                    with contextlib.suppress(requests.exceptions.RequestException):
                        requests.post(URL.format(port=port, session=session), json=HI, timeout=5)
                    time.sleep(0.02)

            threads += [threading.Thread(target=run, args=(s,), daemon=True) for s in ("c1", "c2")]
            for t in threads:
                t.start()
            accumulator = h.service.jobs.current.accumulator
            assert wait_until(lambda: accumulator.quiet_after() is not None, 10)
            quiet = accumulator.quiet_after()
            time.sleep(quiet + 1.0)  # g1's and g2's sessions are still in their steps

            doc = h.client.get("/admission").get_json()
            assert doc["inputs"]["in_progress"]["stalled"] == 0, doc["inputs"]["in_progress"]
            assert doc["budget"] == 0, doc["why"]
            with pytest.raises(requests.exceptions.ReadTimeout):  # g4 waits for a place
                requests.post(URL.format(port=port, session="d1"), json=HI, timeout=1.5)
            assert "d1" not in llm.sessions()
        finally:
            stop.set()
            for t in threads:
                t.join(10)
            w.close()


def test_a_group_whose_sessions_died_before_a_restart_does_not_hold_its_place_for_ever(
    harness_factory: Any, db_url: str
) -> None:
    """g1's sessions wrote a step each and died, then the service restarted (kill -9). The gate
    has no call of them, and none comes: every other session is held, so no gap between calls is
    ever learned, and g1 has no trainable row (no TTL decides it). g1 held the budget of one for
    good and the held calls were never released (seen with the simulator: a kill -9 left a
    launcher's whole pool held). A session of a group that ran before the restart and makes no
    call once its client's longest backoff has passed since the gate saw any call is taken for
    dead: only waste if it was in a long step after all."""
    with FakeLLM(version=3) as llm:
        w = Writer(db_url)
        schedule(w, "g1", ["a1", "a2"])
        schedule(w, "g2", ["b1", "b2"])
        for session in ("a1", "a2"):
            w.step("g1", session, 1, trainable=False)  # before the restart; then they died
        port = free_port()
        h, _port = gated(  # (with the default idle gap)
            harness_factory, db_url, llm, port, pacing_batch_groups=1, pacing_idle_gap_s=10.0
        )
        try:
            h.start(k=2)
            h.settle()
            census = h.service.jobs.current.accumulator.census
            census.resumed_quiet_s = 1.0  # (the launcher's client backs off up to 36 s)
            assert h.client.get("/admission").get_json()["budget"] == 0
            sent = time.monotonic()
            r = requests.post(URL.format(port=port, session="b1"), json=HI, timeout=15)
            assert r.status_code == 200
            assert time.monotonic() - sent >= 1.0, "b1 went before g1's sessions could call"
            doc = h.client.get("/admission").get_json()
            assert doc["inputs"]["in_progress"]["stalled"] == 1, doc["inputs"]["in_progress"]
        finally:
            w.close()
