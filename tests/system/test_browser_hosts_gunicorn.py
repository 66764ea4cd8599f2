"""DNS rebinding against the real server (issue 20, item 4): a page on evil.example whose name was
rebound to 127.0.0.1 sends ``Host: evil.example:PORT`` and a matching ``Origin``. Without a token,
it must not start a job, take groups or stop the launcher; a trainer and a page on a loopback name
keep working. Raw HTTP over a socket, so the test, not a client library, chooses every header."""

from __future__ import annotations

import json
import socket

import pytest
import requests
from servers import serve
from support import wait_until

from rollout_buffer.launcher import procfs

pytestmark = pytest.mark.slow


def raw_post(port: int, path: str, body: str, headers: dict[str, str], version: str = "1.1"):
    """POST over a fresh socket with exactly ``headers`` (no Host unless given): (status, JSON)."""
    head = [f"POST {path} HTTP/{version}", "Content-Type: text/plain"]
    head += [f"{name}: {value}" for name, value in headers.items()]
    head += [f"Content-Length: {len(body.encode())}", "Connection: close", "", ""]
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall("\r\n".join(head).encode() + body.encode())
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    _, _, payload = rest.partition(b"\r\n\r\n")
    return int(status_line.split()[1]), json.loads(payload)


def test_a_rebound_page_cannot_take_groups_or_stop_the_launcher(lite_url, tmp_path):
    with serve(
        lite_url,
        tmp_path / "srv",
        launcher="simulate",
        env={
            # a launcher that runs for minutes, its rows flushed every 0.2 s (100,000 groups
            # took 15 s to list their sessions, and rows came every 5 s)
            "ROLLOUT_BUFFER_SIMULATE_ARGS": "--groups 1000 --pace 0.02 --flush-interval 0.2 --quiet"
        },
    ) as srv:
        r = requests.post(
            srv.url + "/start_rollout",
            json={"num_repeat_per_sample": 2, "job_session": "job1"},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        launcher = r.json()["pid"]
        wait_until(
            lambda: requests.get(srv.url + "/stats", timeout=30).json()["groups"]["ready"] >= 1,
            timeout=90,  # a loaded machine may take long to start the launcher
            what=lambda: f"a ready group (server log: {srv.log()[-2000:]})",
        )
        evil = f"evil.example:{srv.port}"
        page = {"Host": evil, "Origin": f"http://{evil}", "Sec-Fetch-Site": "same-origin"}
        for path, body in (
            ("/get_rollout_data", "{}"),
            ("/start_rollout", '{"job_session":"evil","num_repeat_per_sample":1}'),
            ("/stop_rollout", "{}"),
        ):
            status, doc = raw_post(srv.port, path, body, page)
            assert status == 403, (path, doc)
            assert "ROLLOUT_BUFFER_ALLOWED_HOSTS" in doc["error"], doc
        # the same page without Origin, and a request with no Host at all (HTTP/1.0)
        status, _ = raw_post(
            srv.port, "/get_rollout_data", "{}", {"Host": evil, "Sec-Fetch-Site": "same-origin"}
        )
        assert status == 403
        status, _ = raw_post(
            srv.port, "/get_rollout_data", "{}", {"Origin": "http://localhost"}, version="1.0"
        )
        assert status == 403
        stats = requests.get(srv.url + "/stats", timeout=30).json()
        assert stats["groups"]["served"] == 0, stats["groups"]
        health = requests.get(srv.url + "/health", timeout=30).json()
        assert health["job_session"] == "job1" and health["aievobox_running"] is True
        stat = procfs.stat(launcher)
        assert stat is not None and stat.alive, "the launcher was stopped"
        # a page on a loopback name, and a trainer by any name, take groups
        for host in (f"127.0.0.1:{srv.port}", f"[::1]:{srv.port}", f"LocalHost.:{srv.port}"):
            loopback = {"Host": host, "Origin": f"http://{host}", "Sec-Fetch-Site": "same-origin"}
            status, doc = raw_post(srv.port, "/get_rollout_data", "{}", loopback)
            assert status == 200, (host, doc)
        status, doc = raw_post(
            srv.port, "/get_rollout_data", "{}", {"Host": f"buffer-1:{srv.port}"}
        )
        assert status == 200, doc
