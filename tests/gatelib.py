"""Helpers of the pacing tests: a service with the gate on (the Flask harness, the gate a real
socket) forwarding to a real HTTP server standing in for the LLM proxy, and calls made as the
launcher makes them."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import requests
from fakes.fake_llm import FakeLLM
from support import Writer, now_text, wait_until

from rollout_buffer.storage import launcher_sql as q
from rollout_buffer.tools.runner import free_port

HI = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def gated(harness_factory: Any, db_url: str, llm: FakeLLM, **overrides: Any) -> tuple[Any, int]:
    """A service with the pacing gate on (S 0, B 1 unless overridden), listening; its port."""
    settings: dict[str, Any] = {
        "pacing": "gate",
        "gate_port": free_port(),
        "proxy_host": "127.0.0.1",
        "proxy_port": llm.port,
        "pacing_staleness": 0,
        "pacing_batch_groups": 1,
    }
    settings.update(overrides)
    h = harness_factory(db_url, **settings)
    wait_until(lambda: admission(h)["gate"]["listening"], 10, "the gate listening")
    return h, settings["gate_port"]


def admission(h: Any) -> dict[str, Any]:
    r = h.client.get("/admission")
    assert r.status_code == 200
    return dict(r.get_json())


def schedule(writer: Writer, group: str, sessions: list[str], job: str = "job1") -> None:
    """List sessions in job_environments, as the launcher does when it starts."""
    for sid in sessions:
        writer.db.execute(
            q.INSERT_ENV, (job, sid, "env", json.dumps({}), None, group, 0, 0, now_text())
        )


def url(port: int, session: str, base: str = "/v1") -> str:
    return f"http://127.0.0.1:{port}{base}/{session}/chat/completions"


def call(port: int, session: str, timeout: float = 60, **kw: Any) -> requests.Response:
    """One model call of a session, as the launcher makes it (session-suffixed base URL)."""
    return requests.post(url(port, session, kw.pop("base", "/v1")), json=HI, timeout=timeout, **kw)


def raw(port: int, data: bytes, timeout: float = 5.0) -> bytes:
    """Send raw bytes to the gate; all it answers before it closes (or the timeout)."""
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


def refusal(answer: bytes) -> tuple[int, dict[str, Any]]:
    """The status and JSON body of a raw answer."""
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body)


def post(path: str, host: str, body: bytes = b"{}", extra: bytes = b"") -> bytes:
    """A raw POST with a Content-Length."""
    return (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n".encode()
        + extra
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )


def held(h: Any) -> int:
    return int(admission(h)["gate"]["held_calls"])


def settled(h: Any, seconds: float = 0.3) -> None:
    """Ingest caught up, and the gate's round after it run."""
    h.settle()
    time.sleep(seconds)
