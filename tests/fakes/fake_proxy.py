"""FakeProxy: a real HTTP server on 127.0.0.1 that records POST /admin/clear_sessions bodies.

Runs ``http.server.ThreadingHTTPServer`` in a daemon thread on port 0 (or a port you
reserved with :func:`closed_port`, to bring a "down" proxy up later). Knobs: ``status``
(what to answer), ``script`` (statuses answered first, one per request, e.g. ``[503, 503]``),
``hold_s`` (hold each request that long before answering, to simulate a hung proxy; ``close()``
releases held requests at once).
"""
from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

CLEAR_PATH = "/admin/clear_sessions"


def closed_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (bound to port 0, then closed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # held handler threads must not block server_close()
    block_on_close = False

    def handle_error(self, request, client_address) -> None:  # noqa: ANN001 - stdlib signature
        # The client gave up on a held request (read timeout): a broken pipe is expected.
        pass


class FakeProxy:
    """A recording stand-in for the LLM proxy; usable as a context manager."""

    def __init__(self, *, port: int = 0, status: int = 200, hold_s: float = 0.0,
                 script: list[int] | None = None) -> None:
        self.status = status
        self.hold_s = hold_s
        self.script = list(script or [])
        self._lock = threading.Lock()
        self._calls: list[dict[str, Any]] = []
        self._answers: list[tuple[int, dict[str, Any]]] = []
        self._released = threading.Event()
        self._changed = threading.Condition()
        self._server = _Server(("127.0.0.1", port), self._handler_class())
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"fake-proxy-{self.port}", daemon=True)
        self._thread.start()
        self._closed = False

    @property
    def port(self) -> int:
        """The port the server listens on."""
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def calls(self) -> list[dict[str, Any]]:
        """Copy of every JSON body received on POST /admin/clear_sessions, whatever was answered."""
        with self._lock:
            return list(self._calls)

    @property
    def delivered(self) -> list[dict[str, Any]]:
        """Copy of the bodies that were answered with a 2xx (sent after any hold)."""
        with self._lock:
            return [body for status, body in self._answers if 200 <= status < 300]

    def wait_for(self, predicate: Callable[[FakeProxy], bool], timeout: float = 5.0) -> bool:
        """Wait until ``predicate(self)`` is true; returns False on timeout."""
        deadline = time.monotonic() + timeout
        while not predicate(self):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            with self._changed:  # woken by every request; the short cap covers a missed notify
                self._changed.wait(min(remaining, 0.05))
        return True

    def close(self) -> None:
        """Release held requests, stop serving and close the socket; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._released.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def __enter__(self) -> FakeProxy:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ handler

    def _record(self, body: dict[str, Any]) -> int:
        with self._lock:
            self._calls.append(body)
            status = self.script.pop(0) if self.script else self.status
        with self._changed:
            self._changed.notify_all()
        return status

    def _answered(self, status: int, body: dict[str, Any]) -> None:
        with self._lock:
            self._answers.append((status, body))
        with self._changed:
            self._changed.notify_all()

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib name
                pass

            def do_POST(self) -> None:  # noqa: N802 - stdlib name
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                if self.path != CLEAR_PATH:
                    self._reply(404, b'{"error": "not found"}')
                    return
                try:
                    body = json.loads(raw)
                except ValueError:
                    self._reply(400, b'{"error": "bad json"}')
                    return
                status = fake._record(body)
                if fake.hold_s > 0 and fake._released.wait(fake.hold_s):
                    self.close_connection = True  # closing: drop the connection unanswered
                    return
                fake._answered(status, body)
                self._reply(status, json.dumps({"cleared": len(body.get("session_ids", []))}).encode())

            def _reply(self, status: int, payload: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        return Handler
