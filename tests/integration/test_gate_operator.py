"""What the operator of a paced job sees and gives the launcher (issue 34, items 1-4 and 7):
through the real gate socket of a service, forwarding to a real HTTP server standing in for the
LLM proxy. Why a job's calls are refused when it lists no session, each reason logged at most once
a minute, the launcher's --llm-base-url and environment, where S and B come from, and the hold
limit bounding an unlisted session's call too."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import requests
from fakes.fake_llm import FakeLLM
from gatelib import admission, call, gated, post, raw, refusal, schedule
from support import Writer, wait_until

from rollout_buffer.pacing import gate as gate_module


@pytest.fixture
def llm() -> Any:
    with FakeLLM(version=7) as server:
        yield server


def test_a_job_that_lists_no_session_says_why_logs_it_once_and_refuses_its_calls(
    harness_factory: Any, lite_url: str, llm: FakeLLM, monkeypatch: Any, caplog: Any
) -> None:
    """Item 1: no session listed 60 s after the job began (1 s here) -> ``"why":
    "no_sessions_listed"``, one log line, and calls refused (not_listed), never forwarded. Once a
    session is listed, pacing works again."""
    assert (gate_module.NO_SESSIONS_S, gate_module.NOT_LISTED_WAIT_S) == (60.0, 10.0)
    monkeypatch.setattr(gate_module, "NO_SESSIONS_S", 1.0)
    monkeypatch.setattr(gate_module, "NOT_LISTED_WAIT_S", 1.0)
    caplog.set_level(logging.WARNING, logger="rollout_buffer.pacing.gate")
    h, port = gated(harness_factory, lite_url, llm)
    assert admission(h)["why"] == "no_job"
    h.start(k=2)
    assert admission(h)["why"] == "budget_free"  # (not yet: the launcher lists at its start)
    wait_until(lambda: admission(h)["why"] == "no_sessions_listed", 5, "why: no sessions")
    r = call(port, "s1")
    assert r.status_code == 403 and r.json()["reason"] == "not_listed", r.text
    time.sleep(1.0)  # five rounds of the gate more: still one line
    said = [m for m in caplog.messages if "lists no session" in m]
    assert len(said) == 1, said
    assert llm.calls == []
    w = Writer(lite_url)
    try:
        schedule(w, "g1", ["s1"])
        h.settle()
    finally:
        w.close()
    wait_until(lambda: admission(h)["why"] == "budget_free", 5, "sessions listed")
    assert call(port, "s1").status_code == 200
    assert llm.sessions() == ["s1"]


def test_each_refusal_reason_is_logged_at_most_once_a_minute(
    harness_factory: Any, lite_url: str, llm: FakeLLM, caplog: Any
) -> None:
    caplog.set_level(logging.WARNING, logger="rollout_buffer.pacing.gate")
    h, port = gated(harness_factory, lite_url, llm)
    host = f"127.0.0.1:{port}"
    for _ in range(3):
        assert refusal(raw(port, post("/admin/clear_sessions", host)))[1]["reason"] == "path"
    for _ in range(2):
        get = f"GET /v1/s1/chat/completions HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
        assert refusal(raw(port, get))[1]["reason"] == "method"
    lines = [m for m in caplog.messages if m.startswith("pacing gate: refused")]
    assert [("(path)" in m, "(method)" in m) for m in lines] == [(True, False), (False, True)]
    assert {k: v for k, v in admission(h)["refused"].items() if v} == {"path": 3, "method": 2}


DUMP = (
    "import json, os, sys, time\n"
    "env = {k: v for k, v in os.environ.items() if 'AIEVOBOX' in k or 'ROLLOUT' in k}\n"
    "json.dump({'argv': sys.argv[1:], 'env': env}, open(os.environ['DUMP_TO'], 'w'))\n"
    "time.sleep(60)\n"
)


def test_the_launcher_is_handed_the_gates_url_and_no_concurrency_limit_of_its_own(
    harness_factory: Any, lite_url: str, llm: FakeLLM, tmp_path: Path, monkeypatch: Any
) -> None:
    """Item 7: ``{llm_base_url}`` in ROLLOUT_BUFFER_LAUNCHER_CMD is the gate's URL (its secret a
    path segment), and the launcher gets AIEVOBOX_LLM_MAX_CONCURRENCY=0 (SPEC §5) and not the
    secret's setting. Its model calls at that URL go through."""
    secret = "launcher-secret-0123456789"
    dump, script = tmp_path / "launcher.json", tmp_path / "launcher.py"
    script.write_text(DUMP)
    monkeypatch.setenv("DUMP_TO", str(dump))
    monkeypatch.setenv("AIEVOBOX_LLM_MAX_CONCURRENCY", "32")  # the operator's, overridden
    h, port = gated(
        harness_factory,
        lite_url,
        llm,
        gate_secret=secret,
        launcher="auto",
        launcher_cmd=(sys.executable, str(script), "--llm-base-url", "{llm_base_url}"),
    )
    w = Writer(lite_url)
    try:
        schedule(w, "g1", ["s1"])
    finally:
        w.close()
    h.start(k=1)
    wait_until(lambda: dump.exists() and dump.stat().st_size > 0, 10, "the launcher started")
    seen = json.loads(dump.read_text())
    base_url = seen["argv"][seen["argv"].index("--llm-base-url") + 1]
    assert base_url == f"http://127.0.0.1:{port}/{secret}/v1"
    assert seen["env"]["AIEVOBOX_LLM_MAX_CONCURRENCY"] == "0"
    assert "ROLLOUT_BUFFER_GATE_SECRET" not in seen["env"]
    r = requests.post(base_url + "/s1/chat/completions", json={"messages": []}, timeout=30)
    assert r.status_code == 200, r.text
    assert [c["path"] for c in llm.calls] == ["/v1/s1/chat/completions"]


@pytest.mark.parametrize(
    ("settings", "staleness"),
    [
        ({"max_off_policy": 3}, (3, "setting ROLLOUT_BUFFER_MAX_OFF_POLICY")),
        (
            {"max_off_policy": 3, "pacing_staleness": 2},
            (2, "setting ROLLOUT_BUFFER_PACING_STALENESS"),
        ),
        ({}, (1, "default")),
    ],
)
def test_admission_shows_where_s_and_b_come_from(
    harness_factory: Any, lite_url: str, llm: FakeLLM, settings: dict[str, Any], staleness: Any
) -> None:
    """Item 4: S is ROLLOUT_BUFFER_PACING_STALENESS, else ROLLOUT_BUFFER_MAX_OFF_POLICY, else 1;
    B the min_groups a poll states (a ``{}`` poll states none), else 8."""
    unset = {"pacing_staleness": None, "pacing_batch_groups": None}
    h, _port = gated(harness_factory, lite_url, llm, **{**unset, **settings})
    h.start(k=1)
    s = {"value": staleness[0], "source": staleness[1]}
    assert admission(h)["inputs"] == {
        "staleness": s,
        "batch_groups": {"value": 8, "source": "default"},
    }
    h.poll(min_groups=5)
    h.poll()  # a {} poll states no B
    doc = admission(h)
    assert doc["inputs"] == {
        "staleness": s,
        "batch_groups": {"value": 5, "source": "the min_groups of the trainer's last poll"},
    }
    assert doc["capacity"] == (staleness[0] + 1) * 5


def test_the_batch_setting_wins_over_what_polls_state(
    harness_factory: Any, lite_url: str, llm: FakeLLM
) -> None:
    h, _port = gated(harness_factory, lite_url, llm, pacing_batch_groups=4)
    h.start(k=1)
    h.poll(min_groups=5)
    assert admission(h)["inputs"]["batch_groups"] == {
        "value": 4,
        "source": "setting ROLLOUT_BUFFER_PACING_BATCH_GROUPS",
    }


def test_a_hold_limit_below_10_s_bounds_an_unlisted_sessions_call_too(
    harness_factory: Any, lite_url: str, llm: FakeLLM
) -> None:
    """Item 3: no call is held past ROLLOUT_BUFFER_GATE_MAX_HOLD_SECONDS, an unlisted session's
    included (it would be held 10 s otherwise)."""
    h, port = gated(harness_factory, lite_url, llm, gate_max_hold_s=1.0)
    h.start(k=1)
    started = time.monotonic()
    r = call(port, "nobody")
    assert r.status_code == 503 and r.json()["reason"] == "max_hold", r.text
    assert r.headers["retry-after"] == "1"
    assert 0.9 < time.monotonic() - started < 4
    assert llm.calls == []
