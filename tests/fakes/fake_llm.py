"""FakeLLM: a real HTTP server on 127.0.0.1 standing in for the LLM proxy's model endpoint.

It answers ``POST <anything>/<session_id>/chat/completions`` with an OpenAI-shaped completion whose
``metadata.weight_version`` is :attr:`FakeLLM.version` (the proxy stamps the policy version, SPEC
§2), after ``delay_s``; every call is recorded with its session and the time it arrived and was
answered. Any other path gets a 404 (the upstream proxy has no clear-sessions endpoint), except
``POST /admin/clear_sessions`` with ``clear_status`` set: that status, its JSON body kept in
:attr:`FakeLLM.clears` (a proxy that frees sessions, on the same port as its model endpoint).

An unlucky proxy, on request: ``status`` answers every call with that status (a 503 while it
reloads weights: the launcher's client backs off and retries); ``chunk_bytes`` sends the body
with ``Transfer-Encoding: chunked`` in chunks of that many bytes; ``early_hints`` sends an
interim ``103 Early Hints`` before the answer; ``keep_open`` ignores the caller's
``Connection: close`` and waits for another request on the connection. A caller that
sends ``Expect: 100-continue`` gets an interim ``100 Continue`` first (http.server does that).
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    request_queue_size = 1024  # hundreds of calls arrive at once through a gate

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that gave up (a gate or launcher killed mid-call): expected here


class FakeLLM:
    """A recording model endpoint; usable as a context manager."""

    def __init__(
        self,
        *,
        delay_s: float = 0.0,
        version: int = 0,
        status: int = 200,
        chunk_bytes: int | None = None,
        early_hints: bool = False,
        keep_open: bool = False,
        clear_status: int | None = None,
    ) -> None:
        self.delay_s = delay_s
        self.version = version
        self.status = status
        self.chunk_bytes = chunk_bytes
        self.early_hints = early_hints
        self.keep_open = keep_open
        self.clear_status = clear_status
        self._lock = threading.Lock()
        self.calls: list[dict[str, Any]] = []
        self.clears: list[Any] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                arrived = time.monotonic()
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                if self.path == "/admin/clear_sessions" and owner.clear_status is not None:
                    with owner._lock:
                        owner.clears.append(json.loads(body or b"null"))
                    self._send(owner.clear_status, {"cleared": True})
                    return
                parts = self.path.rstrip("/").split("/")
                if parts[-2:] != ["chat", "completions"] or len(parts) < 3:
                    self._send(404, {"detail": "Not Found"})
                    return
                if owner.delay_s:
                    time.sleep(owner.delay_s)
                with owner._lock:
                    version = owner.version
                    owner.calls.append(
                        {
                            "session": parts[-3],
                            "path": self.path,
                            "headers": {k.lower(): v for k, v in self.headers.items()},
                            "arrived": arrived,
                            "answered": time.monotonic(),
                            "body": json.loads(body or b"{}"),
                        }
                    )
                if owner.status != 200:
                    self._send(owner.status, {"detail": "unavailable"})
                    return
                self._send(
                    200,
                    {
                        "id": "cmpl",
                        "object": "chat.completion",
                        "choices": [
                            {
                                "index": 0,
                                "finish_reason": "stop",
                                "message": {"role": "assistant", "content": "Action: look"},
                            }
                        ],
                        "metadata": {"weight_version": version},
                    },
                )

            def _send(self, status: int, doc: dict[str, Any]) -> None:
                data = json.dumps(doc).encode()
                if owner.early_hints:
                    self.wfile.write(b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>\r\n\r\n")
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                size = owner.chunk_bytes
                if size:
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for i in range(0, len(data), size):
                        piece = data[i : i + size]
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                else:
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                if owner.keep_open:
                    self.close_connection = False  # whatever the caller asked

        self._server = _Server(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def sessions(self) -> list[str]:
        with self._lock:
            return [c["session"] for c in self.calls]

    def __enter__(self) -> FakeLLM:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
