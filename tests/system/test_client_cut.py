"""A poll's answer cut off mid-body (the server killed while it sent it) is retried by BufferClient
with the same request_id, like a connection reset, instead of raising ChunkedEncodingError out of
the trainer's loop (found by the failover soak: its trainer thread died and 236 groups went
missing). A real HTTP server on loopback cuts the first answer."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from rollout_buffer.client import BufferClient

ANSWER = {"success": False, "message": "No data available to read", "data": {"data": []}}


def test_an_answer_cut_mid_body_is_retried_with_the_same_request_id() -> None:
    bodies: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            bodies.append(json.loads(raw or b"{}"))
            data = json.dumps(ANSWER).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if len(bodies) == 1:  # the first answer stops half-way: the connection closes
                self.wfile.write(data[: len(data) // 2])
                self.close_connection = True
                return
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        with BufferClient(url, retries=3, backoff_s=0.01) as client:
            doc = client.get_rollout_data()
        assert doc["success"] is False and len(bodies) == 2
        assert bodies[0]["request_id"] == bodies[1]["request_id"]  # a retry, not a new poll
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)
