"""Attacks on the pacing gate (issue 23): what a held call's client does while it waits."""

from __future__ import annotations

import socket
import time
from typing import Any

import pytest
import requests
from fakes.fake_llm import FakeLLM
from support import Writer, wait_until
from test_pacing import call, gated, schedule

from rollout_buffer.core.errors import ConfigError


@pytest.fixture
def llm() -> Any:
    with FakeLLM(version=7) as server:
        yield server


@pytest.fixture
def db_url(lite_url: str) -> str:
    """The gate does not depend on the backend: these run on SQLite only."""
    return lite_url


def held_calls(h: Any) -> int:
    return int(h.client.get("/admission").get_json()["gate"]["held_calls"])


def test_a_held_call_whose_client_gave_up_is_never_forwarded(
    harness_factory: Any, db_url: str, llm: FakeLLM
) -> None:
    """The launcher's client times out a held call and retries it (SPEC §5): the call it gave up
    must not reach the model when the group is admitted (a duplicate first call of the session,
    generated for nobody), nor stay counted as held."""
    h, port = gated(harness_factory, db_url, llm)
    w = Writer(db_url)
    try:
        schedule(w, "g1", ["a1", "a2"])
        schedule(w, "g2", ["b1", "b2"])
        h.start(k=2)
        h.settle()
        call(port, "a1")  # g1 takes the budget of one group
        with pytest.raises(requests.exceptions.ReadTimeout):
            requests.post(
                f"http://127.0.0.1:{port}/v1/b1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                timeout=1.0,
            )
        # the client is gone: nothing is held for it any more
        assert wait_until(lambda: held_calls(h) == 0, 5), h.client.get("/admission").get_json()
        # g1 completes and is consumed: g2 may start; its given-up call never reaches the model
        w.step("g1", "a1", 1, completed=True, step_reward=0.1)
        w.step("g1", "a2", 1, completed=True, step_reward=0.2)
        assert len(h.poll()["data"]["data"]) == 2
        time.sleep(0.3)
        h.poll()
        time.sleep(RECHECK)
        assert "b1" not in llm.sessions()
        c = call(port, "b1")  # the client's retry goes at once, once
        assert c["done"] - c["sent"] < 2.0
        assert llm.sessions().count("b1") == 1
    finally:
        w.close()


RECHECK = 1.5


def raw(port: int, data: bytes, timeout: float = 5.0) -> bytes:
    """Send raw bytes to the gate; what it answers before it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                return out
            if not chunk:
                return out
            out += chunk


@pytest.mark.parametrize("length", [b"abc", b"-5", b"99999999999999"])
def test_a_bad_content_length_is_answered_with_an_error(
    harness_factory: Any, db_url: str, llm: FakeLLM, length: bytes
) -> None:
    h, port = gated(harness_factory, db_url, llm)
    w = Writer(db_url)
    schedule(w, "g1", ["x1", "x2"])
    w.close()
    h.start(k=2)
    h.settle()
    answer = raw(
        port,
        b"POST /v1/x1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Length: "
        + length
        + b"\r\n\r\n{}",
        timeout=3.0,
    )
    assert answer.startswith((b"HTTP/1.1 400", b"HTTP/1.1 413")), answer
    # the gate still forwards
    c = call(port, "x2")
    assert c["doc"]["metadata"]["weight_version"] == 7


def test_a_first_call_with_few_shot_assistant_turns_is_paced_like_any_other(
    harness_factory: Any, db_url: str, llm: FakeLLM
) -> None:
    """An environment whose prompt holds worked examples (assistant turns) must not have every
    session taken for one the gate restarted under (admitted whatever the budget): past the first
    moments after the gate starts, a session mid-way has rows, and its group is started."""
    h, port = gated(harness_factory, db_url, llm)
    gate = h.service.pacing.gate
    gate.resume_window_s = 0.0  # long after the gate started
    w = Writer(db_url)
    try:
        schedule(w, "g1", ["a1", "a2"])
        schedule(w, "g2", ["b1", "b2"])
        h.start(k=2)
        h.settle()
        call(port, "a1")  # g1 takes the budget of one group
        few_shot = [
            {"role": "system", "content": "solve"},
            {"role": "user", "content": "1+1?"},
            {"role": "assistant", "content": "2"},
            {"role": "user", "content": "2+2?"},
        ]
        with pytest.raises(requests.exceptions.ReadTimeout):
            requests.post(
                f"http://127.0.0.1:{port}/v1/b1/chat/completions",
                json={"model": "m", "messages": few_shot},
                timeout=1.5,
            )
        assert "b1" not in llm.sessions()
    finally:
        w.close()


def test_a_gate_port_that_is_taken_fails_the_start_naming_its_setting(
    harness_factory: Any, db_url: str, llm: FakeLLM
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match="ROLLOUT_BUFFER_GATE_PORT"):
            harness_factory(
                db_url,
                pacing="gate",
                gate_port=port,
                proxy_host="127.0.0.1",
                proxy_port=llm.port,
            )


def test_stopping_the_service_with_held_calls_ends_them_promptly(
    harness_factory: Any, db_url: str, llm: FakeLLM
) -> None:
    import concurrent.futures

    h, port = gated(harness_factory, db_url, llm)
    w = Writer(db_url)
    pool = concurrent.futures.ThreadPoolExecutor(50)
    try:
        schedule(w, "g1", ["a1", "a2"])
        for i in range(40):
            schedule(w, f"h{i}", [f"h{i}-1"])
        h.start(k=2)
        h.settle()
        call(port, "a1")
        held = [pool.submit(call, port, f"h{i}-1") for i in range(40)]
        assert wait_until(lambda: held_calls(h) == 40, 10), held_calls(h)
        started = time.monotonic()
        h.stop()
        assert time.monotonic() - started < 8
        for f in held:
            with pytest.raises(requests.exceptions.ConnectionError):
                f.result(timeout=5)
        assert "h0-1" not in llm.sessions()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        w.close()


def test_without_job_environments_first_calls_are_not_delayed(
    harness_factory: Any, db_url: str, llm: FakeLLM
) -> None:
    """A writer that keeps no job_environments (not the upstream launcher): its sessions cannot be
    paced by group, and each first call must not wait the 10 s meant for a list not read yet."""
    h, port = gated(harness_factory, db_url, llm)
    w = Writer(db_url)
    try:
        w.db.execute("DROP TABLE job_environments")
        h.start(k=2)
        h.settle()
        h.settle()
        c = call(port, "u1")
        assert c["done"] - c["sent"] < 2.0
    finally:
        w.close()


def test_the_gate_remembers_a_bounded_number_of_started_sessions(
    harness_factory: Any, db_url: str, llm: FakeLLM
) -> None:
    """Every session of every job stayed in the gate's memory; a forgotten session's next call is
    asked again, and goes at once (its group has started)."""
    h, port = gated(harness_factory, db_url, llm, pacing_batch_groups=4)
    gate = h.service.pacing.gate
    gate.max_started_sessions = 2
    w = Writer(db_url)
    try:
        schedule(w, "g1", ["a1", "a2"])
        schedule(w, "g2", ["b1", "b2"])
        h.start(k=2)
        h.settle()
        for session in ("a1", "a2", "b1", "b2"):
            call(port, session)
        assert len(gate.started_sessions) == 2
        for session in ("a1", "a2", "b1", "b2"):
            c = call(port, session)
            assert c["done"] - c["sent"] < 2.0
        assert h.client.get("/admission").get_json()["gate"]["held_total"] == 0
    finally:
        w.close()


def test_a_call_whose_client_gave_up_mid_answer_ends_upstream_too(
    harness_factory: Any, db_url: str
) -> None:
    """The launcher's client times out a slow call and retries it: the gate must not keep the
    original upstream call (a generation for nobody; a task and a socket for ever if the upstream
    hangs)."""
    with FakeLLM(delay_s=8.0) as slow:
        h, port = gated(harness_factory, db_url, slow, pacing_batch_groups=4)
        w = Writer(db_url)
        try:
            schedule(w, "g1", ["a1", "a2"])
            h.start(k=2)
            h.settle()
            with pytest.raises(requests.exceptions.ReadTimeout):
                requests.post(
                    f"http://127.0.0.1:{port}/v1/a1/chat/completions",
                    json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                    timeout=1.0,
                )
            gate = h.service.pacing.gate
            assert wait_until(lambda: gate.in_flight == 0, 3), gate.stats()
        finally:
            w.close()
