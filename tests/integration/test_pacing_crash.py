"""A session that crashes mid-way (its environment failed for good: no terminal row, no next model
call) holds its group's place in the admission budget until it is taken for dead, and a group
that can complete waits meanwhile (issue 23). At the gate a crash looks like a finish: no next
call. The rows tell them apart: the row of its last call arrives and is not terminal, so it owes
its environment's next call. It must be taken for dead then, not a flush interval or more later
(the threshold a finished session needs while its terminal row is on its way). Real gate, real HTTP
server standing in for the proxy, rows written as the launcher writes them."""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

import pytest
import requests
from fakes.fake_llm import FakeLLM
from support import Writer, wait_until
from test_pacing import HI, URL, call, gated, schedule

STEPS = 11  # g0's calls: twenty gaps between calls are seen before any session is taken for dead
FLUSH_S = 2.0  # the launcher wrote g0's rows this long after its calls


@pytest.fixture
def db_url(lite_url: str) -> str:
    """The gate does not depend on the backend: SQLite only."""
    return lite_url


def run(port: int, sessions: tuple[str, ...], steps: int) -> None:
    """Quick steps, a model call each, as the launcher makes them."""
    for _step in range(steps):
        for session in sessions:
            r = requests.post(URL.format(port=port, session=session), json=HI, timeout=5)
            assert r.status_code == 200


def finish(w: Writer, group: str, session: str, steps: int) -> None:
    for step in range(1, steps + 1):
        w.step(group, session, step, trainable=step == steps, completed=step == steps)


def test_a_crashed_session_frees_its_groups_place_when_its_last_row_arrives(
    harness_factory: Any, db_url: str
) -> None:
    with FakeLLM(version=3) as llm:
        h, port = gated(harness_factory, db_url, llm)  # (S 0 + 1) x B 1: one group at a time
        w = Writer(db_url)
        pool = concurrent.futures.ThreadPoolExecutor(2)
        try:
            schedule(w, "g0", ["z1", "z2"])
            schedule(w, "g1", ["a1", "a2"])
            schedule(w, "g2", ["b1", "b2"])
            h.start(k=2)
            h.settle()
            accumulator = h.service.jobs.current.accumulator
            # g0 runs and finishes; the launcher writes its rows FLUSH_S after its last calls: a
            # finished session may stay that quiet before its terminal row arrives
            run(port, ("z1", "z2"), STEPS)
            time.sleep(FLUSH_S)
            finish(w, "g0", "z1", STEPS)
            finish(w, "g0", "z2", STEPS)
            assert wait_until(lambda: (accumulator.quiet_after() or 0) >= 2 * FLUSH_S, 5)
            quiet = accumulator.quiet_after()
            assert len(h.poll()["data"]["data"]) == 2  # the trainer takes g0...
            time.sleep(0.3)
            h.poll()  # ...and comes back after its training step: g1 may start

            run(port, ("a1", "a2"), 3)  # a1 crashes after its third step; a2 finishes
            last_call = time.monotonic()
            held = pool.submit(call, port, "b1")  # g2 waits for g1's place
            assert wait_until(
                lambda: h.client.get("/admission").get_json()["gate"]["held_calls"] == 1, 5
            )
            time.sleep(1.0)  # the launcher's flush
            finish(w, "g1", "a2", 3)
            for step in range(1, 4):
                w.step("g1", "a1", step, trainable=False)
            rows_at = time.monotonic()
            released = held.result(timeout=30)
            assert quiet is not None and released["done"] - last_call < quiet, (
                f"b1 released {released['done'] - last_call:.1f} s after a1's last call, "
                f"{released['done'] - rows_at:.1f} s after its last row arrived: no sooner than a "
                f"finished session may stay quiet ({quiet:.1f} s)"
            )
            assert released["done"] - rows_at < 3.0
            doc = h.client.get("/admission").get_json()
            assert doc["inputs"]["in_progress"]["stalled"] == 1, doc["inputs"]["in_progress"]
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
            w.close()


def test_a_session_between_calls_whose_rows_arrive_is_not_taken_for_dead(
    harness_factory: Any, db_url: str
) -> None:
    """Each row arrives while its session is between calls (it owes the next one), and the next
    call comes at once; then the sessions slow down to a call every 0.4 s with no rows: they are
    alive all along, and g2 stays held."""
    with FakeLLM(version=3) as llm:
        h, port = gated(harness_factory, db_url, llm)
        w = Writer(db_url)
        pool = concurrent.futures.ThreadPoolExecutor(2)
        try:
            schedule(w, "g1", ["a1", "a2"])
            schedule(w, "g2", ["b1", "b2"])
            h.start(k=2)
            h.settle()
            for step in range(1, STEPS + 1):
                for session in ("a1", "a2"):
                    r = requests.post(URL.format(port=port, session=session), json=HI, timeout=5)
                    assert r.status_code == 200
                    w.step("g1", session, step, trainable=False)  # each row right after its call
            held = pool.submit(call, port, "b1")
            for _ in range(4):  # a1 and a2 keep calling, slower than before
                time.sleep(0.4)
                for session in ("a1", "a2"):
                    r = requests.post(URL.format(port=port, session=session), json=HI, timeout=5)
                    assert r.status_code == 200
            assert not held.done(), "g2 was admitted while g1's sessions were alive"
            doc = h.client.get("/admission").get_json()
            assert doc["inputs"]["in_progress"]["stalled"] == 0, doc["inputs"]["in_progress"]
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
            w.close()
