"""Slow and stalled clients never take the service's threads (issue 14, scenario 3), through a real
gunicorn: 100 connections that send part of a request head and stall, and slow uploads."""

from __future__ import annotations

import socket
import time

import pytest
import requests
from servers import Server

from rollout_buffer.web import gunicorn_worker

pytestmark = pytest.mark.slow


def stalled(url_port: int, n: int, head: bytes) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", url_port), timeout=5)
        s.sendall(head)
        socks.append(s)
    return socks


def timed(fn) -> float:
    t0 = time.monotonic()
    fn()
    return time.monotonic() - t0


def closed_by_server(s: socket.socket, within: float) -> bool:
    s.settimeout(within)
    try:
        return s.recv(1) == b""  # EOF: the server closed it
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def assert_others_answered_at_once(srv: Server, what: str, rounds: int = 5) -> None:
    for _ in range(rounds):
        took = timed(lambda: requests.get(srv.url + "/health", timeout=30).raise_for_status())
        assert took < 1.0, f"/health took {took:.2f} s with {what}"
        took = timed(
            lambda: requests.post(
                srv.url + "/get_rollout_data", json={}, timeout=30
            ).raise_for_status()
        )
        assert took < 1.0, f"a poll took {took:.2f} s with {what}"


def test_stalled_request_heads_do_not_starve_health_or_polls(lite_url, tmp_path):
    srv = Server(lite_url, tmp_path / "srv", env={"ROLLOUT_BUFFER_THREADS": "16"})
    srv.start()
    socks: list[socket.socket] = []
    try:
        r = requests.post(
            srv.url + "/start_rollout",
            json={"num_repeat_per_sample": 2, "job_session": "j"},
            timeout=10,
        )
        assert r.status_code == 200
        socks = stalled(srv.port, 100, b"POST /get_rollout_data HTTP/1.1\r\nHost: x\r\nContent-Le")
        socks += stalled(srv.port, 20, b"")  # connected, nothing sent
        assert_others_answered_at_once(srv, "120 stalled connections open")
        # the stalled heads are closed by the server after the head timeout
        assert closed_by_server(socks[0], gunicorn_worker.HEAD_TIMEOUT_S + 3)
        assert all(closed_by_server(s, 2) for s in socks[1:100])
    finally:
        for s in socks:
            s.close()
        srv.stop()


def test_a_request_sent_slowly_but_whole_is_still_served(lite_url, tmp_path):
    srv = Server(lite_url, tmp_path / "srv")
    srv.start()
    try:
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        for part in (
            b"GET /health HTTP/1.1\r\n",
            b"Host: x\r\n",
            b"Connection: close\r\n",
            b"\r\n",
        ):
            s.sendall(part)
            time.sleep(0.3)  # a slow client: each piece is a separate read of the event loop
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 200") and b'"status"' in answer
        s.close()
    finally:
        srv.stop()


def read_answer(s: socket.socket, timeout: float = 10) -> bytes:
    """Everything the server sends until it closes the connection."""
    s.settimeout(timeout)
    answer = b""
    while chunk := s.recv(65536):
        answer += chunk
    return answer


def test_stalled_request_bodies_do_not_starve_health_or_polls(lite_url, tmp_path):
    """A complete head, then a body that never comes: the event loop waits for it, not a thread."""
    srv = Server(lite_url, tmp_path / "srv", env={"ROLLOUT_BUFFER_THREADS": "16"})
    srv.start()
    socks: list[socket.socket] = []
    try:
        head = (
            b"POST /get_rollout_data HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{"
        )
        socks = stalled(srv.port, 100, head)
        chunked = (
            b"POST /start_rollout HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            b'5\r\n{"num'
        )
        socks += stalled(srv.port, 20, chunked)
        time.sleep(0.3)  # the heads are read by now
        assert_others_answered_at_once(srv, "120 stalled bodies open")
        assert closed_by_server(socks[0], gunicorn_worker.BODY_TIMEOUT_S + 3)
        assert all(closed_by_server(s, 2) for s in socks[1:])
    finally:
        for s in socks:
            s.close()
        srv.stop()


def test_clients_that_never_close_their_end_do_not_stall_the_others(lite_url, tmp_path):
    """gunicorn's graceful close lingered up to 2 s per connection in the event loop: 20 clients
    that send 'Connection: close' and then neither read nor close stalled every other client for 40
    s."""
    srv = Server(lite_url, tmp_path / "srv")
    srv.start()
    socks: list[socket.socket] = []
    try:
        socks = stalled(
            srv.port, 20, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        time.sleep(0.3)
        assert_others_answered_at_once(srv, "20 clients that never close their end", rounds=3)
        assert socks[0].recv(65536).startswith(b"HTTP/1.1 200")  # they were answered, whole
        assert closed_by_server(socks[0], gunicorn_worker.LINGER_S + 3)
    finally:
        for s in socks:
            s.close()
        srv.stop()


def exchange(port: int, *parts: bytes, pause: float = 0.0) -> tuple[bytes, float]:
    """Send the parts (pausing between them), read the answer until the server closes; (answer,
    seconds)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        t0 = time.monotonic()
        for i, part in enumerate(parts):
            if i:
                time.sleep(pause)
            s.sendall(part)
        return read_answer(s), time.monotonic() - t0


def test_bodies_sent_slowly_chunked_pipelined_or_after_100_continue_are_served(lite_url, tmp_path):
    srv = Server(lite_url, tmp_path / "srv", env={"ROLLOUT_BUFFER_MAX_REQUEST_BYTES": "4096"})
    srv.start()
    try:
        body = b'{"num_repeat_per_sample": 2, "job_session": "slow"}'
        head = (
            b"POST /start_rollout HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: "
            b"%d\r\n\r\n" % len(body)
        )
        # each piece is a separate read of the event loop
        answer, _ = exchange(
            srv.port, head, *(body[i : i + 10] for i in range(0, len(body), 10)), pause=0.2
        )
        assert answer.startswith(b"HTTP/1.1 200") and b'"job_session":"slow"' in answer

        answer, _ = exchange(
            srv.port,
            b"POST /get_rollout_data HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b'Transfer-Encoding: chunked\r\n\r\n3\r\n{"m\r\n',
            b'e\r\nax_groups": 1}\r\n0\r\n\r\n',
            pause=0.3,
        )
        assert answer.startswith(b"HTTP/1.1 200") and b"No data available" in answer, answer[:300]

        # curl sends Expect: 100-continue for larger bodies and waits for the interim answer
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
            s.sendall(
                b"POST /get_rollout_data HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                b"Expect: 100-continue\r\nContent-Length: 2\r\n\r\n"
            )
            s.settimeout(5)
            assert s.recv(65536) == b"HTTP/1.1 100 Continue\r\n\r\n"
            s.sendall(b"{}")
            answer = read_answer(s)
        assert answer.startswith(b"HTTP/1.1 200") and b"HTTP/1.1 100" not in answer, answer[:300]

        # two requests in one write on a kept-alive connection: both answered at once
        answer, took = exchange(
            srv.port,
            b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
            b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        )
        assert answer.count(b"HTTP/1.1 200") == 2 and took < 2.0, (took, answer[:300])

        # a body over the cap is refused at once, without waiting for it, and the connection closed
        answer, took = exchange(
            srv.port,
            b"POST /get_rollout_data HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n{",
        )
        assert answer.startswith(b"HTTP/1.1 413") and took < 2.0, (took, answer[:300])
    finally:
        srv.stop()


def test_more_clients_than_open_files_never_kill_the_worker_nor_its_launcher(lite_url, tmp_path):
    """With a low open-files limit, 1,100 idle connections made accept() fail with EMFILE: the error
    killed the worker, and the worker's exit stopped the launcher (then every new worker died
    too)."""
    import resource

    from rollout_buffer.launcher import procfs

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    srv = Server(
        lite_url,
        tmp_path / "srv",
        launcher="simulate",
        env={"ROLLOUT_BUFFER_SIMULATE_ARGS": "--groups 100000 --pace 0.2 --quiet"},
    )
    resource.setrlimit(resource.RLIMIT_NOFILE, (512, hard))  # the server inherits it
    try:
        srv.start()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    socks: list[socket.socket] = []
    try:
        r = requests.post(
            srv.url + "/start_rollout",
            json={"num_repeat_per_sample": 2, "job_session": "j"},
            timeout=10,
        )
        assert r.status_code == 200, r.text
        launcher = r.json()["pid"]
        for _ in range(1100):
            socks.append(socket.create_connection(("127.0.0.1", srv.port), timeout=5))
        time.sleep(2)
        for s in socks:
            s.close()
        socks = []
        # at the bound, idle kept-alive connections make room: a new client is not locked out for
        # their keep-alive time (75 s) behind them
        bound = 512 - gunicorn_worker.FD_RESERVE - gunicorn_worker.FD_PER_THREAD * 16
        for _ in range(bound - 16):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            socks.append(s)
        for s in socks:
            assert s.recv(65536).startswith(b"HTTP/1.1 200")
        socks += stalled(srv.port, 20, b"GET /health HTTP/1.1\r\n")
        time.sleep(0.5)
        took = timed(lambda: requests.get(srv.url + "/health", timeout=30).raise_for_status())
        assert took < 2.0, (
            f"/health took {took:.2f} s with the connection bound reached by idle clients"
        )
        health = requests.get(srv.url + "/health", timeout=30).json()
        stat = procfs.stat(launcher)
        assert stat is not None and stat.alive, "the launcher was stopped"
        assert health["launcher"]["pid"] == launcher and health["aievobox_running"] is True
        assert (
            "Exception in worker process" not in srv.log()
            and "Too many open files" not in srv.log()
        )
    finally:
        for s in socks:
            s.close()
        srv.stop()
