"""The pacing gate answers one call per connection, and says so (issue 23, found by the
benchmark). Every answer is counted and its version stamp read, even when the client, told the
connection closes, closes its end before the proxy closes its own (the gate then cancels the
relay: one stamp in ten was lost that way).

Before, a keep-alive client (requests, as the simulated launcher and many LLM clients use)
sent its next call on the connection the gate was closing, saw it dropped, and backed off 2 s
before retrying (SPEC §5): 116 retries in one benchmark run, each session's calls stretched."""

from __future__ import annotations

import time
from typing import Any

import pytest
import requests
from fakes.fake_llm import FakeLLM
from support import wait_until

from rollout_buffer.runtime.gate import Gate


@pytest.fixture
def gate() -> Any:
    with FakeLLM(version=3) as llm:
        g = Gate(host="127.0.0.1", port=0, upstream=f"http://127.0.0.1:{llm.port}", may_start=bool)
        g.start()
        try:
            yield g, llm
        finally:
            g.close()


def test_a_keep_alive_client_makes_call_after_call_through_the_gate(gate: Any) -> None:
    g, llm = gate
    versions: list[int] = []
    g.on_version = versions.append
    http = requests.Session()  # one pooled connection per host, reused unless told otherwise
    url = f"http://127.0.0.1:{g.port}/v1/s1/chat/completions"
    started = time.monotonic()
    for _ in range(20):
        answer = http.post(url, json={"messages": [{"role": "user", "content": "hi"}]}, timeout=5)
        assert answer.status_code == 200
        assert answer.headers["Connection"].lower() == "close"
        assert answer.json()["metadata"]["weight_version"] == 3  # the body untouched
    assert time.monotonic() - started < 5.0  # twenty calls, none dropped and retried
    wait_until(lambda: g.stats()["forwarded"] == 20, 5, lambda: f"forwarded {g.stats()}")
    assert len(llm.calls) == 20
    assert versions == [3] * 20  # the proxy's stamp, read as the answers went by
