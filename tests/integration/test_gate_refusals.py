"""The pacing gate forwards only the launcher's model calls (issue 34, items 1 and 2): through the
real gate socket of a service, to a real HTTP server standing in for the LLM proxy. Every refusal
is a JSON answer with its reason, counted in /admission and /metrics, and reaches the proxy
never."""

from __future__ import annotations

import concurrent.futures
import socket
import time
from typing import Any

import pytest
import requests
from fakes.fake_llm import FakeLLM
from gatelib import HI, admission, call, gated, post, raw, refusal, schedule, url
from support import Writer, wait_until


@pytest.fixture
def llm() -> Any:
    with FakeLLM(version=7) as server:
        yield server


@pytest.fixture
def gate(harness_factory: Any, lite_url: str, llm: FakeLLM) -> Any:
    """A gate whose job lists s1 (group g1), with a budget of one group."""
    h, port = gated(harness_factory, lite_url, llm)
    w = Writer(lite_url)
    try:
        schedule(w, "g1", ["s1", "s2"])
        h.start(k=2)
        h.settle()
    finally:
        w.close()
    return h, port


HOST = "127.0.0.1:{port}"


@pytest.mark.parametrize(
    ("name", "request_bytes", "status", "reason"),
    [
        (
            "admin",
            b"POST /admin/clear_sessions HTTP/1.1\r\nHost: {host}\r\nContent-Length: 2\r\n\r\n{{}}",
            404,
            "path",
        ),
        (
            "other path",
            b"POST /v1/models HTTP/1.1\r\nHost: {host}\r\nContent-Length: 0\r\n\r\n",
            404,
            "path",
        ),
        (
            "query",
            b"POST /v1/s1/chat/completions?x=1 HTTP/1.1\r\nHost: {host}\r\n"
            b"Content-Length: 2\r\n\r\n{{}}",
            404,
            "path",
        ),
        (
            "encoded slash",
            b"POST /v1/s1%2F..%2Fadmin/chat/completions HTTP/1.1\r\n"
            b"Host: {host}\r\nContent-Length: 2\r\n\r\n{{}}",
            404,
            "path",
        ),
        ("GET", b"GET /v1/s1/chat/completions HTTP/1.1\r\nHost: {host}\r\n\r\n", 405, "method"),
        (
            "absolute",
            b"GET http://169.254.169.254/latest HTTP/1.1\r\nHost: {host}\r\n\r\n",
            400,
            "target",
        ),
        (
            "absolute POST",
            b"POST http://{host}/v1/s1/chat/completions HTTP/1.1\r\n"
            b"Host: {host}\r\nContent-Length: 2\r\n\r\n{{}}",
            400,
            "target",
        ),
        ("CONNECT", b"CONNECT 169.254.169.254:80 HTTP/1.1\r\nHost: {host}\r\n\r\n", 400, "target"),
        (
            "rebound Host",
            b"POST /v1/s1/chat/completions HTTP/1.1\r\nHost: evil.example:80\r\n"
            b"Content-Length: 2\r\n\r\n{{}}",
            421,
            "host",
        ),
        (
            "browser",
            b"POST /v1/s1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
            b"Origin: http://evil.example\r\nContent-Type: text/plain\r\n"
            b"Content-Length: 2\r\n\r\n{{}}",
            403,
            "origin",
        ),
        (
            "bare LF",
            b"POST /v1/s1/chat/completions HTTP/1.1\nHost: {host}\nContent-Length: 2\n\n{{}}",
            400,
            "malformed",
        ),
        (
            "one bare LF",
            b"POST /v1/s1/chat/completions HTTP/1.1\r\nHost: {host}\nContent-Length: 2\r\n\r\n{{}}",
            400,
            "malformed",
        ),
        (
            "folded",
            b"POST /v1/s1/chat/completions HTTP/1.1\r\nHost: {host}\r\nX-A: b\r\n c\r\n"
            b"Content-Length: 2\r\n\r\n{{}}",
            400,
            "malformed",
        ),
        (
            "two lengths",
            b"POST /v1/s1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
            b"Content-Length: 2\r\nContent-Length: 2\r\n\r\n{{}}",
            400,
            "malformed",
        ),
        (
            "length list",
            b"POST /v1/s1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
            b"Content-Length: 2, 2\r\n\r\n{{}}",
            400,
            "malformed",
        ),
        (
            "length and chunked",
            b"POST /v1/s1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
            b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            400,
            "malformed",
        ),
        (
            "two codings",
            b"POST /v1/s1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
            b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            400,
            "malformed",
        ),
        (
            "gzip coding",
            b"POST /v1/s1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
            b"Transfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
            400,
            "malformed",
        ),
        (
            "bad length",
            b"POST /v1/s1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Length: -5\r\n\r\n",
            400,
            "malformed",
        ),
        (
            "no Host",
            b"POST /v1/s1/chat/completions HTTP/1.1\r\nContent-Length: 2\r\n\r\n{{}}",
            400,
            "malformed",
        ),
    ],
)
def test_what_is_not_a_launcher_model_call_is_refused_and_never_reaches_the_proxy(
    gate: Any, llm: FakeLLM, name: str, request_bytes: bytes, status: int, reason: str
) -> None:
    h, port = gate
    data = request_bytes.decode("latin-1").format(host=HOST.format(port=port)).encode("latin-1")
    got, doc = refusal(raw(port, data))
    assert (got, doc["reason"]) == (status, reason), doc
    assert doc["ok"] is False and doc["error"]
    assert llm.calls == [], "a refused request reached the proxy"
    assert admission(h)["refused"][reason] == 1
    metrics = h.client.get("/metrics").get_data(as_text=True)
    assert f'rollout_buffer_gate_refused_total{{reason="{reason}"}} 1' in metrics


def test_a_listed_session_is_forwarded_as_the_proxy_reads_it(gate: Any, llm: FakeLLM) -> None:
    """Judged and forwarded percent-decoded: s%31 is s1 (the proxy reads it so)."""
    _h, port = gate
    r = requests.post(url(port, "s%31"), json=HI, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["metadata"]["weight_version"] == 7
    assert r.headers["connection"] == "close"
    assert [c["path"] for c in llm.calls] == ["/v1/s1/chat/completions"]
    assert llm.calls[0]["body"] == HI
    assert llm.calls[0]["headers"]["host"] == f"127.0.0.1:{llm.port}"


def test_a_session_the_job_does_not_list_is_held_then_refused(gate: Any, llm: FakeLLM) -> None:
    """Held up to 10 s (the launcher lists its sessions when it starts), then 403 not_listed:
    never forwarded unpaced. An id of another job, or one that decodes to another, the same."""
    h, port = gate
    started = time.monotonic()
    r = call(port, "s9")
    assert r.status_code == 403 and r.json()["reason"] == "not_listed", r.text
    assert 9.5 < time.monotonic() - started < 15
    assert llm.calls == []
    assert admission(h)["refused"]["not_listed"] == 1


def test_a_session_listed_while_its_call_is_held_goes(
    gate: Any, llm: FakeLLM, lite_url: str
) -> None:
    h, port = gate
    w = Writer(lite_url)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(call, port, "late")
            wait_until(lambda: admission(h)["gate"]["held_calls"] == 1, 5, "the call held")
            schedule(w, "g1", ["late"])  # listed now: the budget admits its group
            h.settle()
            assert pending.result(timeout=10).status_code == 200
    finally:
        w.close()
    assert llm.sessions() == ["late"]


def test_a_head_over_64_kib_gets_431(gate: Any, llm: FakeLLM) -> None:
    _h, port = gate
    big = b"X-Big: " + b"a" * 70_000 + b"\r\n"
    got, doc = refusal(raw(port, post("/v1/s1/chat/completions", f"127.0.0.1:{port}", extra=big)))
    assert (got, doc["reason"]) == (431, "head_too_large")
    assert llm.calls == []


def test_a_body_over_the_limit_gets_413_before_it_is_read(
    harness_factory: Any, lite_url: str, llm: FakeLLM
) -> None:
    _h, port = gated(harness_factory, lite_url, llm, gate_max_body_bytes=4096)
    head = (
        f"POST /v1/s1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        "Content-Length: 100000000\r\n\r\n"
    ).encode()
    got, doc = refusal(raw(port, head))  # the body is never sent: the answer comes anyway
    assert (got, doc["reason"]) == (413, "body_too_large")
    chunked = (
        (
            f"POST /v1/s1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            "Transfer-Encoding: chunked\r\n\r\n2000\r\n"
        ).encode()
        + b"a" * 0x2000
        + b"\r\n0\r\n\r\n"
    )
    got, doc = refusal(raw(port, chunked))
    assert (got, doc["reason"]) == (413, "body_too_large")
    assert llm.calls == []


def test_a_stalled_head_or_body_is_closed(
    harness_factory: Any, lite_url: str, llm: FakeLLM
) -> None:
    h, port = gated(harness_factory, lite_url, llm, gate_stall_s=1.0)
    for partial in (
        b"POST /v1/s1/chat/completions HTTP/1.1\r\nHost: x",  # a head that never ends
        post("/v1/s1/chat/completions", f"127.0.0.1:{port}", body=b"{}")[:-1],  # a body short
    ):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(partial)
            started = time.monotonic()
            assert s.recv(1024) == b""  # closed, with no answer
            assert 0.9 < time.monotonic() - started < 5
    assert admission(h)["refused"]["stalled"] == 2
    assert llm.calls == []


def test_the_gate_url_needs_its_secret_when_one_is_set(
    harness_factory: Any, lite_url: str, llm: FakeLLM
) -> None:
    secret = "s3cret-s3cret-s3cret"
    h, port = gated(harness_factory, lite_url, llm, gate_secret=secret)
    w = Writer(lite_url)
    try:
        schedule(w, "g1", ["s1"])
        h.start(k=1)
        h.settle()
    finally:
        w.close()
    assert call(port, "s1").json()["reason"] == "path"  # without it
    assert call(port, "s1", base="/wrong-wrong-wrong-wrong/v1").json()["reason"] == "path"
    r = call(port, "s1", base=f"/{secret}/v1")
    assert r.status_code == 200, r.text
    assert [c["path"] for c in llm.calls] == ["/v1/s1/chat/completions"]  # never forwarded
    shown = h.client.get("/admission").get_data(as_text=True)
    shown += h.client.get("/stats").get_data(as_text=True)
    shown += h.client.get("/health").get_data(as_text=True)
    assert secret not in shown


def test_the_secret_is_in_no_answer_nor_log_of_a_launcher_that_fails(
    harness_factory: Any, lite_url: str, llm: FakeLLM, caplog: Any
) -> None:
    """The launcher's argv carries the gate's URL: a /start_rollout answer that shows its argv
    and the tail of its log (which prints its argv) shows no secret."""
    secret = "zq-very-secret-0123456789"
    printer = "import sys; print(' '.join(sys.argv)); sys.exit(3)"
    _h, _port = gated(
        harness_factory,
        lite_url,
        llm,
        gate_secret=secret,
        launcher="auto",
        launcher_cmd=("python3", "-c", printer, "--llm-base-url", "{llm_base_url}"),
    )
    r = _h.client.post("/start_rollout", json={"num_repeat_per_sample": 1})
    assert r.status_code == 500, r.get_data(as_text=True)
    answer = r.get_data(as_text=True)
    assert "--llm-base-url" in answer and "/v1" in answer
    assert secret not in answer
    assert secret not in caplog.text
