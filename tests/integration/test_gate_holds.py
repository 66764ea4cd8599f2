"""What the pacing gate holds, and for how long (issue 34, items 2-5): through the real gate socket
of a service, forwarding to a real HTTP server standing in for the LLM proxy."""

from __future__ import annotations

import concurrent.futures
import socket
import threading
import time
from typing import Any

import pytest
import requests
from fakes.fake_llm import FakeLLM
from gatelib import HI, admission, call, gated, held, schedule, url
from support import Writer, wait_until


@pytest.fixture
def llm() -> Any:
    with FakeLLM(version=7) as server:
        yield server


@pytest.fixture
def pool() -> Any:
    executor = concurrent.futures.ThreadPoolExecutor(8)
    yield executor
    # A call still held ends when the service stops, in the harness's teardown, which runs after
    # this one: waiting for it here would wait out its hold.
    executor.shutdown(wait=False, cancel_futures=True)


def two_groups(h: Any, db_url: str) -> Writer:
    """g1 (a1, a2) and g2 (b1, b2) listed; the job started with K 2."""
    w = Writer(db_url)
    schedule(w, "g1", ["a1", "a2"])
    schedule(w, "g2", ["b1", "b2"])
    h.start(k=2)
    h.settle()
    return w


def test_a_first_call_waits_for_the_budget_and_goes_when_the_trainer_takes(
    harness_factory: Any, db_url: str, llm: FakeLLM, pool: Any
) -> None:
    """S 0, B 1: one group may be in progress. g1's calls go (all of them: admission is per
    group); g2's first call is held until g1 is ready and served, and the trainer's next poll."""
    h, port = gated(harness_factory, db_url, llm)
    w = two_groups(h, db_url)
    try:
        assert call(port, "a1").status_code == 200
        assert call(port, "a2").status_code == 200  # its group started: never held
        pending = pool.submit(call, port, "b1")
        wait_until(lambda: held(h) == 1, 5, "b1 held")
        doc = admission(h)
        assert doc["terms"] == {"in_progress": 1, "ready": 0, "trainer_holds": 0}
        assert doc["budget"] == 0 and doc["capacity"] == 1 and doc["why"] == "budget_spent"
        w.step("g1", "a1", 1, completed=True)
        w.step("g1", "a2", 1, completed=True)
        h.settle()
        assert admission(h)["terms"]["ready"] == 1
        assert not pending.done()
        assert len(h.poll()["data"]["data"]) == 2  # served: the trainer holds it (no version)
        assert admission(h)["terms"]["trainer_holds"] == 1
        time.sleep(0.5)
        assert not pending.done(), admission(h)
        h.poll()  # the trainer is back: what it took last no longer counts
        assert pending.result(timeout=5).status_code == 200
        assert llm.sessions() == ["a1", "a2", "b1"]
    finally:
        w.close()


def test_steps_made_before_the_current_version_was_known_count(
    harness_factory: Any, lite_url: str, llm: FakeLLM
) -> None:
    """Item 4: the rows' versions count steps from the current version (no single row moves it),
    also when the first rows came before it was known. g1 and g2 were read at version 0 before
    the first poll; the next row the budget sees is of version 2: the trainer made two steps."""
    h, _ = gated(harness_factory, lite_url, llm, pacing_staleness=1, pacing_batch_groups=1)
    w = Writer(lite_url)
    try:
        for group in ("g1", "g2", "g3"):
            schedule(w, group, [f"{group}-a"])
        h.start(k=1)
        for group in ("g1", "g2"):
            w.step(group, f"{group}-a", 1, completed=True, env_state={"weight_version": 0})
        h.settle()
        assert admission(h)["trainer"]["versions"] == {}  # none known yet: none counts
        assert len(h.poll()["data"]["data"]) == 2  # version 0, agreed on by two groups
        w.step("g3", "g3-a", 1, env_state={"weight_version": 2})
        h.settle()
        wait_until(lambda: admission(h)["trainer"]["versions"] == {"rows": 2}, 5, "version 2")
        doc = admission(h)
        assert doc["trainer"]["steps"] == 2 and doc["terms"]["trainer_holds"] == 0, doc
    finally:
        w.close()


def test_a_long_polls_arrival_not_its_end_tells_the_budget_the_trainer_is_back(
    harness_factory: Any, db_url: str, llm: FakeLLM, pool: Any
) -> None:
    """Item 4: with no version, the last take counts until the next poll arrives. A long poll
    that waits for g2 frees g2's first call as it arrives (were it its end, they would wait for
    each other until the poll's wait ran out)."""
    h, port = gated(harness_factory, db_url, llm)
    w = two_groups(h, db_url)
    try:
        call(port, "a1")
        w.step("g1", "a1", 1, completed=True)
        w.step("g1", "a2", 1, completed=True)
        assert len(h.poll()["data"]["data"]) == 2  # the trainer holds g1
        pending = pool.submit(call, port, "b1")
        wait_until(lambda: held(h) == 1, 5, "b1 held")
        started = time.monotonic()
        polling = pool.submit(h.poll, wait_s=20, min_groups=1)
        assert pending.result(timeout=10).status_code == 200
        assert not polling.done()  # b1 went while the poll waited
        w.step("g2", "b1", 1, completed=True)
        w.step("g2", "b2", 1, completed=True)
        assert len(polling.result(timeout=20)["data"]["data"]) == 2
        assert time.monotonic() - started < 10
    finally:
        w.close()


def test_no_call_is_held_past_the_hold_limit_and_its_retry_may_be_held_again(
    harness_factory: Any, lite_url: str, llm: FakeLLM
) -> None:
    h, port = gated(harness_factory, lite_url, llm, gate_max_hold_s=1.0)
    w = two_groups(h, lite_url)
    try:
        call(port, "a1")
        for _ in range(2):
            started = time.monotonic()
            r = call(port, "b1")
            assert r.status_code == 503 and r.json()["reason"] == "max_hold", r.text
            assert r.headers["retry-after"] == "1"
            assert 0.9 < time.monotonic() - started < 4
        assert admission(h)["refused"]["max_hold"] == 2
        assert "b1" not in llm.sessions()
    finally:
        w.close()


def test_held_bytes_are_capped_and_a_first_call_past_it_gets_503(
    harness_factory: Any, lite_url: str, llm: FakeLLM, pool: Any
) -> None:
    h, port = gated(harness_factory, lite_url, llm, gate_max_held_bytes=150_000)
    w = two_groups(h, lite_url)
    big = {"model": "m", "messages": [{"role": "user", "content": "x" * 100_000}]}
    try:
        call(port, "a1")
        first = pool.submit(requests.post, url(port, "b1"), json=big, timeout=30)
        wait_until(lambda: admission(h)["gate"]["held_bytes"] > 100_000, 5, "b1 held")
        r = requests.post(url(port, "b2"), json=big, timeout=30)
        assert r.status_code == 503 and r.json()["reason"] == "held_bytes", r.text
        assert r.headers["retry-after"] == "1"
        assert not first.done()
        assert admission(h)["refused"]["held_bytes"] == 1
    finally:
        w.close()


def test_a_held_call_whose_client_gave_up_is_never_forwarded(
    harness_factory: Any, lite_url: str, llm: FakeLLM
) -> None:
    """The launcher's client times out a held call and retries it: the call it gave up must not
    reach the model when the group is admitted (a duplicate first call, generated for nobody)."""
    h, port = gated(harness_factory, lite_url, llm)
    w = two_groups(h, lite_url)
    try:
        call(port, "a1")
        with pytest.raises(requests.exceptions.ReadTimeout):
            call(port, "b1", timeout=1.0)
        wait_until(lambda: held(h) == 0, 5, "the abandoned call forgotten")
        w.step("g1", "a1", 1, completed=True)
        w.step("g1", "a2", 1, completed=True)
        h.settle()
        h.poll()
        h.poll()
        time.sleep(0.5)
        assert "b1" not in llm.sessions()
        assert call(port, "b1").status_code == 200  # its retry goes at once, once
        assert llm.sessions().count("b1") == 1
    finally:
        w.close()


def test_a_group_gone_quiet_frees_its_place_and_takes_it_back_at_its_next_call(
    harness_factory: Any, lite_url: str, llm: FakeLLM, pool: Any
) -> None:
    """Item 5: a started group whose session has no call in flight and none for the session
    timeout (1 s here) is gone: g2 may start. The session's next call counts it again."""
    h, port = gated(harness_factory, lite_url, llm, pacing_session_timeout_s=1.0)
    w = two_groups(h, lite_url)
    try:
        call(port, "a1")
        started = time.monotonic()
        assert call(port, "b1").status_code == 200  # held until a1 went quiet
        assert time.monotonic() - started > 0.8
        doc = admission(h)
        assert doc["gone_groups"] == 1 and doc["terms"]["in_progress"] == 1
        call(port, "a1")
        assert admission(h)["terms"]["in_progress"] == 2
    finally:
        w.close()


def keep_calling(port: int, session: str, stop: Any) -> int:
    """Calls of ``session`` every 0.2 s until ``stop`` is set; how many."""
    made = 0
    while not stop.wait(0.2):
        assert call(port, session).status_code == 200
        made += 1
    return made


def test_one_quiet_session_frees_its_groups_place_while_the_other_keeps_calling(
    harness_factory: Any, lite_url: str, llm: FakeLLM, pool: Any
) -> None:
    """Item 5 is per session: a2 went quiet (a crashed or stuck session: its group can never
    reach K), so g1 frees its place after the timeout although a1 calls all along."""
    h, port = gated(harness_factory, lite_url, llm, pacing_session_timeout_s=1.0)
    w = two_groups(h, lite_url)
    stop = threading.Event()
    try:
        call(port, "a1")
        call(port, "a2")
        busy = pool.submit(keep_calling, port, "a1", stop)
        started = time.monotonic()
        assert call(port, "b1").status_code == 200
        assert 0.8 < time.monotonic() - started < 5
        assert not busy.done()  # a1 was calling all the while
        assert admission(h)["gone_groups"] == 1
    finally:
        stop.set()
        w.close()
    assert busy.result(timeout=10) >= 3


def test_a_session_that_finished_is_never_gone(
    harness_factory: Any, lite_url: str, llm: FakeLLM, pool: Any
) -> None:
    """a2 wrote its terminal row: its quiet is the end of its episode, not a lost session. While
    a1 calls, g1 keeps its place and b1 stays held."""
    h, port = gated(harness_factory, lite_url, llm, pacing_session_timeout_s=1.0)
    w = two_groups(h, lite_url)
    stop = threading.Event()
    try:
        call(port, "a1")
        call(port, "a2")
        w.step("g1", "a2", 1, completed=True)
        h.settle()
        busy = pool.submit(keep_calling, port, "a1", stop)
        pending = pool.submit(call, port, "b1")
        time.sleep(2.5)  # past the timeout of a2's last call
        assert not pending.done(), admission(h)
        assert admission(h)["terms"]["in_progress"] == 1
        stop.set()  # a1 quiet now: gone after the timeout
        assert pending.result(timeout=10).status_code == 200
    finally:
        stop.set()
        w.close()
    assert busy.result(timeout=10) >= 3


def test_a_bogus_row_version_never_moves_the_budget(
    harness_factory: Any, lite_url: str, llm: FakeLLM
) -> None:
    """Item 4: the trainer's steps count by plausible versions only. A row version of
    1700000000000 (a timestamp, more than ROLLOUT_BUFFER_MAX_VERSION_JUMP above the current
    version) would say the trainer trained on everything it holds."""
    h, _ = gated(harness_factory, lite_url, llm, pacing_staleness=1, pacing_batch_groups=2)
    w = Writer(lite_url)
    try:
        for group in ("g1", "g2", "g3", "g4", "g5"):
            schedule(w, group, [f"{group}-a"])
        h.start(k=1)
        for group in ("g1", "g2"):
            w.step(group, f"{group}-a", 1, completed=True, env_state={"weight_version": 0})
        assert len(h.poll()["data"]["data"]) == 2  # served at version 0 (now the current one)
        w.step("g3", "g3-a", 1, env_state={"weight_version": 0})
        h.settle()
        before = admission(h)
        assert before["trainer"]["versions"] == {"rows": 0}
        assert before["terms"]["trainer_holds"] == 2
        w.step("g4", "g4-a", 1, env_state={"weight_version": 1_700_000_000_000})
        h.settle()
        time.sleep(0.3)
        after = admission(h)
        assert after["trainer"]["versions"] == {"rows": 0}, after
        assert after["terms"]["trainer_holds"] == 2 and after["trainer"]["steps"] is None
        w.step("g5", "g5-a", 1, env_state={"weight_version": 1})  # a real step moves it
        h.settle()
        time.sleep(0.3)
        moved = admission(h)
        assert moved["trainer"]["steps"] == 1 and moved["terms"]["trainer_holds"] == 0, moved
    finally:
        w.close()


def test_an_answers_version_moves_the_trainers_steps_before_its_row_is_written(
    harness_factory: Any, lite_url: str
) -> None:
    """Item 4: the proxy stamps the policy's version on its answers, and the launcher writes it
    into rows only at its next flush (every 5 s). The gate reads the version of the answers it
    relays: a step shows as soon as a call is answered at the new version. An answer's version
    more than S + 1 above the newest seen (a timestamp) moves nothing."""
    with FakeLLM(version=0) as llm:
        h, port = gated(harness_factory, lite_url, llm, pacing_staleness=1, pacing_batch_groups=2)
        w = Writer(lite_url)
        try:
            for group in ("g1", "g2", "g3", "g4"):
                schedule(w, group, [f"{group}-a"])
            h.start(k=1)
            for group in ("g1", "g2"):
                w.step(group, f"{group}-a", 1, completed=True, env_state={"weight_version": 0})
            assert len(h.poll()["data"]["data"]) == 2  # served at version 0 (now the current one)
            w.step("g3", "g3-a", 1, env_state={"weight_version": 0})
            h.settle()
            wait_until(lambda: admission(h)["trainer"]["versions"] == {"rows": 0}, 5, "rows")
            assert admission(h)["terms"]["trainer_holds"] == 2
            llm.version = 1_700_000_000_000  # a bogus stamp first: it moves nothing
            assert call(port, "g3-a").json()["metadata"]["weight_version"] == llm.version
            ended = lambda: admission(h)["gate"]["connections"] == 0  # noqa: E731
            wait_until(ended, 5, "the call ended at the gate")
            assert admission(h)["trainer"]["versions"] == {"rows": 0}
            llm.version = 1  # the trainer trained on one batch: the proxy stamps its new version
            assert call(port, "g3-a").status_code == 200
            wait_until(ended, 5, "the call ended at the gate")
            doc = admission(h)  # no row of version 1 was written
            assert doc["trainer"]["versions"] == {"rows": 1}, doc
            assert doc["trainer"]["steps"] == 1 and doc["terms"]["trainer_holds"] == 0, doc
        finally:
            w.close()


def test_a_call_in_flight_keeps_its_group_in_progress_however_long(
    harness_factory: Any, lite_url: str, pool: Any
) -> None:
    with FakeLLM(delay_s=2.5) as slow:
        h, port = gated(harness_factory, lite_url, slow, pacing_session_timeout_s=1.0)
        w = two_groups(h, lite_url)
        try:
            running = pool.submit(call, port, "a1")
            wait_until(lambda: admission(h)["gate"]["connections"] == 1, 5, "a1 in flight")
            time.sleep(1.5)
            assert admission(h)["terms"]["in_progress"] == 1
            assert running.result(timeout=10).status_code == 200
        finally:
            w.close()


def test_held_calls_go_in_the_launchers_order(
    harness_factory: Any, lite_url: str, llm: FakeLLM, pool: Any
) -> None:
    """When the budget frees, the group listed first in job_environments goes first (the
    launcher starts its sessions in that order), whatever the order the calls came in."""
    h, port = gated(harness_factory, lite_url, llm)
    w = Writer(lite_url)
    try:
        for group in ("g1", "g2", "g3"):
            schedule(w, group, [f"{group}-a"])
        h.start(k=1)
        h.settle()
        call(port, "g1-a")
        late = pool.submit(call, port, "g3-a")
        wait_until(lambda: held(h) == 1, 5)
        early = pool.submit(call, port, "g2-a")
        wait_until(lambda: held(h) == 2, 5)
        w.step("g1", "g1-a", 1, completed=True)
        h.settle()
        h.poll()
        h.poll()
        assert early.result(timeout=5).status_code == 200
        time.sleep(0.5)
        assert not late.done()
    finally:
        w.close()


def test_stopping_the_service_ends_held_calls_at_once(
    harness_factory: Any, lite_url: str, llm: FakeLLM, pool: Any
) -> None:
    h, port = gated(harness_factory, lite_url, llm)
    w = two_groups(h, lite_url)
    try:
        call(port, "a1")
        pending = pool.submit(call, port, "b1")
        wait_until(lambda: held(h) == 1, 5)
        started = time.monotonic()
        h.stop()
        with pytest.raises(requests.ConnectionError):
            pending.result(timeout=10)  # its client retries (SPEC §5)
        assert time.monotonic() - started < 8
        assert "b1" not in llm.sessions()
    finally:
        w.close()


def test_answers_are_relayed_whole_chunked_without_interim_answers_and_with_100_continue(
    harness_factory: Any, lite_url: str
) -> None:
    with FakeLLM(version=3, chunk_bytes=7, early_hints=True) as chunky:
        h, port = gated(harness_factory, lite_url, chunky)
        w = two_groups(h, lite_url)
        try:
            r = requests.post(
                url(port, "a1"), json=HI, timeout=30, headers={"Expect": "100-continue"}
            )
            # (a proxy's 103 Early Hints is not passed on: http.client takes it for the answer)
            assert r.status_code == 200 and r.json()["metadata"]["weight_version"] == 3
            assert "expect" not in chunky.calls[0]["headers"]
        finally:
            w.close()


def test_a_call_whose_client_left_mid_answer_ends_at_the_proxy_too(
    harness_factory: Any, lite_url: str
) -> None:
    with FakeLLM(delay_s=3.0) as slow:
        h, port = gated(harness_factory, lite_url, slow)
        w = two_groups(h, lite_url)
        try:
            with pytest.raises(requests.exceptions.ReadTimeout):
                call(port, "a1", timeout=0.5)
            wait_until(lambda: admission(h)["gate"]["connections"] == 0, 5, "the call ended")
        finally:
            w.close()


def test_pacing_off_has_no_gate_and_admission_says_off(harness_factory: Any, lite_url: str) -> None:
    h = harness_factory(lite_url)
    assert h.client.get("/admission").get_json() == {"pacing": "off"}
    assert h.service.pacing is None
    assert "gate" not in h.client.get("/metrics").get_data(as_text=True)


def test_a_call_goes_through_while_the_accumulators_lock_is_held(
    harness_factory: Any, lite_url: str, llm: FakeLLM
) -> None:
    """The gate learns the job from the accumulator's change feed, never from its lock: a long
    ingest batch (which holds it) does not stall a model call."""
    h, port = gated(harness_factory, lite_url, llm)
    w = two_groups(h, lite_url)
    try:
        call(port, "a1")
        accumulator = h.service.jobs.current.accumulator
        with accumulator.lock:  # as an ingest batch of 20,000 rows does
            started = time.monotonic()
            assert call(port, "a2", timeout=5).status_code == 200
            assert time.monotonic() - started < 2.0
            assert h.client.get("/admission").status_code == 200
    finally:
        w.close()


def test_connections_past_the_bound_are_refused_and_the_rest_still_served(
    harness_factory: Any, lite_url: str, llm: FakeLLM
) -> None:
    """The bound is half the descriptors left to the process (thousands here): lowered to 3 for
    the test, the fourth connection gets 503 connections while three stall."""
    h, port = gated(harness_factory, lite_url, llm)
    w = two_groups(h, lite_url)
    h.service.pacing.gate.max_connections = 3
    stalls = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
    try:
        wait_until(lambda: admission(h)["gate"]["connections"] == 3, 5)
        r = call(port, "a1")
        assert r.status_code == 503 and r.json()["reason"] == "connections", r.text
        assert r.headers["retry-after"] == "1"
        assert llm.calls == []
        for s in stalls:
            s.close()
        wait_until(lambda: admission(h)["gate"]["connections"] == 0, 5)
        assert call(port, "a1").status_code == 200
    finally:
        w.close()


def test_a_job_switch_with_calls_held_refuses_them_and_the_old_jobs_sessions(
    harness_factory: Any, lite_url: str, llm: FakeLLM, pool: Any
) -> None:
    """Calls held for job1's sessions are not job2's: after the switch they are refused
    (not_listed), never admitted into job2's budget nor forwarded."""
    h, port = gated(harness_factory, lite_url, llm)
    w = two_groups(h, lite_url)
    try:
        call(port, "a1")
        pending = pool.submit(call, port, "b1")
        wait_until(lambda: held(h) == 1, 5)
        schedule(w, "n1", ["c1"], job="job2")
        h.start(k=1, job="job2")
        h.settle()
        r = pending.result(timeout=20)
        assert r.status_code == 403 and r.json()["reason"] == "not_listed", r.text
        assert call(port, "c1").status_code == 200  # job2's own session goes
        assert call(port, "a2").json()["reason"] == "not_listed"  # job1's: not any more
        assert llm.sessions() == ["a1", "c1"]
        assert admission(h)["job_session"] == "job2"
    finally:
        w.close()
