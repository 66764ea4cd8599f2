"""Slow and stalled clients never take the service's threads (issue 14, scenario 3), through a real
gunicorn: 100 connections that send part of a request head and stall, and slow uploads."""
from __future__ import annotations

import socket
import time

import pytest
import requests

from rollout_buffer import gunicorn_worker
from servers import Server

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
    except socket.timeout:
        return False


def test_stalled_request_heads_do_not_starve_health_or_polls(lite_url, tmp_path):
    srv = Server(lite_url, tmp_path / "srv", env={"ROLLOUT_BUFFER_THREADS": "16"})
    srv.start()
    socks: list[socket.socket] = []
    try:
        r = requests.post(srv.url + "/start_rollout", json={"num_repeat_per_sample": 2, "job_session": "j"},
                          timeout=10)
        assert r.status_code == 200
        socks = stalled(srv.port, 100, b"POST /get_rollout_data HTTP/1.1\r\nHost: x\r\nContent-Le")
        socks += stalled(srv.port, 20, b"")  # connected, nothing sent
        for _ in range(5):
            took = timed(lambda: requests.get(srv.url + "/health", timeout=5).raise_for_status())
            assert took < 1.0, f"/health took {took:.2f} s with 120 stalled connections open"
            took = timed(lambda: requests.post(srv.url + "/get_rollout_data", json={}, timeout=5).raise_for_status())
            assert took < 1.0, f"a poll took {took:.2f} s with 120 stalled connections open"
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
        for part in (b"GET /health HTTP/1.1\r\n", b"Host: x\r\n", b"Connection: close\r\n", b"\r\n"):
            s.sendall(part)
            time.sleep(0.3)  # a slow client: each piece is a separate read of the event loop
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 200") and b'"status"' in answer
        s.close()
    finally:
        srv.stop()
