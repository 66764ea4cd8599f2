"""The pacing gate against unlucky proxies and clients (issue 23): the proxy's version stamp is
read from the answer's payload, not from its framing; the answer ends where its framing says, not
when the proxy closes; interim answers pass through; a client's ``Expect: 100-continue`` is
answered. Real gate sockets, a real HTTP server standing in for the proxy, raw clients."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests
from fakes.fake_llm import FakeLLM
from support import wait_until

from rollout_buffer.runtime.gate import Gate

BODY = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'


@pytest.fixture
def llm() -> Iterator[FakeLLM]:
    with FakeLLM(version=12345) as server:
        yield server


@pytest.fixture
def gate(llm: FakeLLM) -> Iterator[tuple[Gate, list[int]]]:
    versions: list[int] = []
    g = Gate(
        host="127.0.0.1",
        port=0,
        upstream=f"http://127.0.0.1:{llm.port}",
        may_start=bool,
        on_version=versions.append,
    )
    g.start()
    try:
        yield g, versions
    finally:
        g.close()


def post(port: int, session: str = "s1") -> requests.Response:
    return requests.post(
        f"http://127.0.0.1:{port}/v1/{session}/chat/completions",
        data=BODY,
        headers={"Content-Type": "application/json"},
        timeout=10,
    )


def read_to_end(s: socket.socket, timeout: float) -> tuple[bytes, bool]:
    """What the gate sends until it closes the connection; False if it had not within
    ``timeout``."""
    s.settimeout(timeout)
    out = b""
    while True:
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            return out, False
        if not chunk:
            return out, True
        out += chunk


def test_the_version_stamp_is_read_whole_from_a_chunked_answer(
    gate: tuple[Gate, list[int]], llm: FakeLLM
) -> None:
    """A proxy that streams its answer chunked (an SSE relay, a re-chunking proxy): a chunk's
    size line between two digits of the stamp made the gate read 1 for 12345. The first stamp
    read is where the trainer's steps are counted from: read too low, every later stamp looked
    like thousands of steps and the trainer's claims vanished from the budget."""
    g, versions = gate
    sizes = range(1, 90)
    for size in sizes:  # wherever the chunks break the answer
        llm.chunk_bytes = size
        answer = post(g.port)
        assert answer.status_code == 200
        assert answer.json()["metadata"]["weight_version"] == 12345  # relayed untouched
    wait_until(lambda: len(versions) == len(sizes), 5, lambda: f"versions {versions}")
    assert set(versions) == {12345}


def test_an_answer_ends_where_its_framing_says_even_if_the_proxy_keeps_the_connection(
    gate: tuple[Gate, list[int]], llm: FakeLLM
) -> None:
    """A proxy that ignores the gate's ``Connection: close``: the gate waited for it to close,
    so the answer was never seen to end (no version read, the call counted in flight until the
    client left) and a client reading to the end of the connection waited for ever."""
    g, versions = gate
    llm.keep_open = True
    for chunked in (None, 7):
        llm.chunk_bytes = chunked
        with socket.create_connection(("127.0.0.1", g.port)) as s:
            s.sendall(
                b"POST /v1/s1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
            )
            answer, closed = read_to_end(s, 3.0)
        assert answer.startswith(b"HTTP/1.1 200"), answer
        assert closed, "the gate kept the connection after the whole answer"
    assert versions == [12345, 12345]
    assert g.stats()["forwarded"] == 2 and g.stats()["in_flight"] == 0


def test_interim_answers_pass_through_and_the_final_answer_says_close(
    gate: tuple[Gate, list[int]], llm: FakeLLM
) -> None:
    """A proxy that sends a 1xx before its answer (103 Early Hints): the gate took the interim
    head for the answer's, so the stamp was never read (not a 2xx) and the real answer kept its
    keep-alive head (the client's next call went on a closing connection)."""
    g, versions = gate
    llm.early_hints = True
    with socket.create_connection(("127.0.0.1", g.port)) as s:
        s.sendall(
            b"POST /v1/s1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
        )
        answer, closed = read_to_end(s, 3.0)
    interim, _, final = answer.partition(b"\r\n\r\n")
    assert interim.startswith(b"HTTP/1.1 103") and b"Link: </style.css>" in interim, answer
    head = final.partition(b"\r\n\r\n")[0]
    assert head.startswith(b"HTTP/1.1 200") and b"\r\nConnection: close" in head, answer
    assert versions == [12345] and closed


def test_a_client_expecting_100_continue_is_answered_at_once(
    gate: tuple[Gate, list[int]], llm: FakeLLM
) -> None:
    """curl and libcurl-based clients send ``Expect: 100-continue`` with large bodies (a long
    history, images) and wait for it before the body: the gate said nothing, so every such call
    waited out the client's 1 s, then the proxy's own 100 Continue was taken for the answer."""
    g, versions = gate
    with socket.create_connection(("127.0.0.1", g.port)) as s:
        s.sendall(
            b"POST /v1/s1/chat/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
            b"Content-Length: %d\r\n\r\n" % len(BODY)
        )
        s.settimeout(2.0)
        started = time.monotonic()
        interim = s.recv(65536)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        assert time.monotonic() - started < 0.5
        s.sendall(BODY)
        answer, closed = read_to_end(s, 3.0)
    head = answer.partition(b"\r\n\r\n")[0]
    assert head.startswith(b"HTTP/1.1 200") and b"\r\nConnection: close" in head, answer
    assert versions == [12345] and closed
    assert "expect" not in llm.calls[0]["headers"]  # the gate has the body: nothing to ask


def test_two_different_content_lengths_are_refused(
    gate: tuple[Gate, list[int]], llm: FakeLLM
) -> None:
    """The gate read the body by one Content-Length and forwarded both: the proxy, reading by
    the other, saw a different request than the one the gate paced (RFC 9112 6.3: an error)."""
    g, _ = gate
    with socket.create_connection(("127.0.0.1", g.port)) as s:
        s.sendall(
            b"POST /v1/s1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
        )
        answer, _ = read_to_end(s, 3.0)
    assert answer.startswith(b"HTTP/1.1 400"), answer
    assert llm.calls == []
    same: Any = None
    with socket.create_connection(("127.0.0.1", g.port)) as s:  # the same length twice is one
        s.sendall(
            b"POST /v1/s1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(BODY), len(BODY), BODY)
        )
        same, _ = read_to_end(s, 3.0)
    assert same.startswith(b"HTTP/1.1 200"), same
