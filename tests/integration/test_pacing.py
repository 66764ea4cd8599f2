"""Pacing the producers (issue 23), through the real gate (an HTTP server in the service) and a
real HTTP server standing in for the LLM proxy: GET /admission, a held first call released as the
trainer consumes, no session of an admitted group ever held, running sessions never slowed."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import time
from typing import Any

import pytest
import requests
from fakes.fake_llm import FakeLLM
from support import Writer, now_text, wait_until

from rollout_buffer.core.config import Config
from rollout_buffer.core.errors import ConfigError
from rollout_buffer.storage import launcher_sql as q


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def schedule(writer: Writer, group: str, sessions: list[str]) -> None:
    for sid in sessions:
        writer.db.execute(
            q.INSERT_ENV, ("job1", sid, "env", json.dumps({}), None, group, 0, 0, now_text())
        )


def call(port: int, session: str) -> dict[str, Any]:
    """One model call of a session, as the launcher makes it (session-suffixed base URL)."""
    sent = time.monotonic()
    r = requests.post(
        f"http://127.0.0.1:{port}/v1/{session}/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return {"session": session, "sent": sent, "done": time.monotonic(), "doc": r.json()}


URL = "http://127.0.0.1:{port}/v1/{session}/chat/completions"
HI = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def gated(
    harness_factory: Any, db_url: str, llm: FakeLLM, port: int | None = None, **overrides: Any
) -> tuple[Any, int]:
    """A service with the pacing gate on (on ``port``, else a free one) forwarding to ``llm``:
    S 0, B 1 and an idle gap of 0.2 s unless overridden."""
    port = port or free_port()
    settings: dict[str, Any] = {
        "pacing": "gate",
        "gate_port": port,
        "proxy_host": "127.0.0.1",
        "proxy_port": llm.port,
        "pacing_staleness": 0,
        "pacing_batch_groups": 1,
        "pacing_idle_gap_s": 0.2,
    }
    h = harness_factory(db_url, **{**settings, **overrides})
    return h, port


@pytest.fixture
def llm() -> Any:
    with FakeLLM(version=7) as server:
        yield server


def test_admission_is_published_with_its_inputs_and_why(harness_factory: Any, db_url: str) -> None:
    h = harness_factory(db_url, pacing_staleness=2, pacing_batch_groups=3)
    h.start(k=2)
    doc = h.client.get("/admission").get_json()
    assert doc["budget"] == 9 and doc["capacity"] == 9  # (2 + 1) x 3, nothing in progress
    assert doc["inputs"]["staleness"] == {
        "value": 2,
        "source": "setting ROLLOUT_BUFFER_PACING_STALENESS",
    }
    assert doc["inputs"]["batch_groups"]["source"].startswith("setting")
    assert doc["inputs"]["in_progress"]["value"] == 0
    # no gap between calls seen yet: a session quiet for its client's longest backoff is dead
    assert doc["inputs"]["in_progress"]["session_dead_after_s"] == 36.0
    spare = doc["inputs"]["spare"]  # no group ended yet: no share lost, no spare
    assert spare["value"] == 0 and spare["per_step"] == 0 and spare["lost_share"] is None
    assert spare["waste_bound"] == 0.03 and "ROLLOUT_BUFFER_PACING_SPARE_WASTE" in spare["source"]
    assert "current_weight_version" in doc and doc["why"]
    assert doc["pacing"] == "off"

    w = Writer(db_url)
    try:
        for i in range(4):
            w.group(f"g{i}", 2, steps=1, complete=1)  # one session of two completed: pending
    finally:
        w.close()
    h.settle()
    doc = h.client.get("/admission").get_json()
    assert doc["inputs"]["in_progress"]["pending"] == 4
    assert doc["budget"] == 5


def test_defaults_say_they_are_defaults_and_b_is_learned_from_the_trainers_bursts(
    harness_factory: Any, db_url: str
) -> None:
    h = harness_factory(db_url, pacing_idle_gap_s=0.2)
    h.start(k=2)
    doc = h.client.get("/admission").get_json()
    assert doc["inputs"]["staleness"]["source"] == "default"
    assert doc["inputs"]["batch_groups"]["source"].startswith("default")
    w = Writer(db_url)
    try:
        for burst in range(2):
            for i in range(3):
                w.group(f"b{burst}-{i}", 2, steps=1)
            h.settle()
            assert len(h.poll()["data"]["data"]) == 6
            time.sleep(0.3)  # an idle gap: the trainer trains
            h.poll()  # an empty poll after the gap closes the burst
    finally:
        w.close()
    doc = h.client.get("/admission").get_json()
    assert doc["inputs"]["batch_groups"]["value"] == 3
    assert doc["inputs"]["batch_groups"]["source"].startswith("learned")


def test_gate_pacing_needs_a_proxy_to_forward_to() -> None:
    with pytest.raises(ConfigError, match="LLM_PROXY_HOST"):
        Config.from_env({"ROLLOUT_BUFFER_PACING": "gate"})


def test_a_held_session_is_released_as_the_trainer_consumes(
    harness_factory: Any, db_url: str, llm: FakeLLM
) -> None:
    """Capacity (S 0 + 1) x B 1 = one group in progress: g1 runs; a session of g2 is held at its
    first call until the trainer has consumed g1 (taken it, and come back after a training step).
    g1's second session and g1's later calls are never held, and answered as fast as without the
    gate."""
    port = free_port()
    h = harness_factory(
        db_url,
        pacing="gate",
        gate_port=port,
        proxy_host="127.0.0.1",
        proxy_port=llm.port,
        pacing_staleness=0,
        pacing_batch_groups=1,
        pacing_idle_gap_s=0.2,
    )
    w = Writer(db_url)
    pool = concurrent.futures.ThreadPoolExecutor(4)
    try:
        schedule(w, "g1", ["a1", "a2"])
        schedule(w, "g2", ["b1", "b2"])
        h.start(k=2)
        h.settle()
        first = call(port, "a1")  # g1 admitted: the budget was 1
        assert first["doc"]["metadata"]["weight_version"] == 7  # forwarded untouched
        held = pool.submit(call, port, "b1")  # g2 is not admitted: the budget is spent
        wait_until(
            lambda: h.client.get("/admission").get_json()["gate"]["held_calls"],
            5,
            lambda: f"b1 held: {h.client.get('/admission').get_json()} {llm.sessions()}",
        )
        # an admitted group's other session, and a running session's next call, go at once
        for session in ("a2", "a1", "a2"):
            c = call(port, session)
            assert c["done"] - c["sent"] < 2.0
        assert not held.done(), "g2's first call went through while the budget was spent"
        doc = h.client.get("/admission").get_json()
        assert doc["budget"] == 0 and doc["inputs"]["in_progress"]["running"] == 1

        # g1 completes and the trainer takes it: the budget frees and b1 goes
        w.step("g1", "a1", 1, completed=True, step_reward=0.1)
        w.step("g1", "a2", 1, completed=True, step_reward=0.2)
        assert "b1" not in llm.sessions()
        assert len(h.poll()["data"]["data"]) == 2
        # the trainer trains on g1 (a group that starts now is trained after it: still held)...
        assert not held.done()
        time.sleep(0.3)  # ...a training step, longer than the idle gap: its next poll ends it
        consumed_at = time.monotonic()
        h.poll()
        released = held.result(timeout=10)
        assert released["done"] >= consumed_at, "released only once the trainer consumed g1"
        assert llm.sessions().count("b1") == 1
        # b2 belongs to the admitted g2: never held
        c = call(port, "b2")
        assert c["done"] - c["sent"] < 2.0
        gate = h.client.get("/admission").get_json()["gate"]
        assert gate["held_total"] == 1 and gate["held_calls"] == 0
        assert gate["admitted_total"] == 2
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        w.close()


def test_waste_is_measured_per_group_and_by_reason(harness_factory: Any, db_url: str) -> None:
    h = harness_factory(db_url, max_off_policy=0)
    h.start(k=2)
    w = Writer(db_url)
    try:
        w.group("served", 2, steps=2, env_state={"weight_version": 5})
        h.settle()
        # the trainer reports its version (one group's rows alone never set it)
        assert len(h.poll(current_weight_version=5)["data"]["data"]) == 4
        w.group("old", 2, steps=2, env_state={"weight_version": 1})  # stale: 5 - 1 > 0
        h.settle()
    finally:
        w.close()
    waste = h.stats()["waste"]
    assert waste["served"]["groups"] == 1 and waste["served"]["rows"] == 4
    assert waste["discarded_by_reason"]["stale"]["groups"] == 1
    assert waste["discarded"]["rows"] == 4
    assert waste["discarded_share"]["groups"] == 0.5
    assert waste["served"]["generation_s"] >= 0.0
    metrics = h.client.get("/metrics").get_data(as_text=True)
    assert (
        'rollout_buffer_generated_groups_total{job_session="job1",outcome="discarded",'
        'reason="stale"} 1' in metrics
    )
    assert 'rollout_buffer_discarded_generation_share{job_session="job1"}' in metrics


def test_the_budget_sees_a_step_end_in_the_proxys_stamp_and_drops_a_stale_surplus(
    harness_factory: Any, db_url: str, llm: FakeLLM
) -> None:
    """S 1, B 1: two groups may be ahead. The trainer takes two groups of version 7 (one to train
    on, one held): nothing more may start. The proxy stamps 8 on an answer through the gate (the
    step ended): the batch is consumed, one group may start. It stamps 9: the held group of
    version 7 is too old for the trainer's next step, so it no longer claims a place either."""
    port = free_port()
    h = harness_factory(
        db_url,
        pacing="gate",
        gate_port=port,
        proxy_host="127.0.0.1",
        proxy_port=llm.port,
        pacing_staleness=1,
        pacing_batch_groups=1,
        pacing_idle_gap_s=60,  # no idle gap ends a burst here: only the stamp tells
    )
    w = Writer(db_url)

    def admission_at(version: int) -> dict[str, Any]:
        llm.version = version
        call(port, "a1")  # a session of an admitted group: never held
        return wait_until(
            lambda: (
                (d := h.client.get("/admission").get_json())["proxy_weight_version"] == version
                and d
            ),
            5,
            lambda: f"{h.client.get('/admission').get_json()}",
        )

    try:
        schedule(w, "g1", ["a1", "a2"])
        schedule(w, "g2", ["b1", "b2"])
        h.start(k=2)
        h.settle()
        for sid in ("a1", "a2", "b1", "b2"):
            call(port, sid)  # stamped 7
        for group, sessions in (("g1", ("a1", "a2")), ("g2", ("b1", "b2"))):
            for sid in sessions:
                w.step(
                    group,
                    sid,
                    1,
                    completed=True,
                    step_reward=float(sid[1]),
                    env_state={"weight_version": 7},
                )
        h.settle()
        assert len(h.poll()["data"]["data"]) == 4
        doc = admission_at(7)
        surplus = doc["inputs"]["trainer_surplus"]
        assert (surplus["training"], surplus["fresh"], doc["budget"]) == (1, 1, 0), doc

        doc = admission_at(8)
        surplus = doc["inputs"]["trainer_surplus"]
        assert (surplus["training"], surplus["fresh"], doc["budget"]) == (0, 1, 1), doc

        doc = admission_at(9)
        surplus = doc["inputs"]["trainer_surplus"]
        assert (surplus["fresh"], surplus["going_stale"], doc["budget"]) == (0, 1, 2), doc
        assert doc["version_for_staleness"] == 9
    finally:
        w.close()
