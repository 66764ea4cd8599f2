"""FakeProxy: a real HTTP server on 127.0.0.1 that records POST /admin/clear_sessions bodies.

Runs ``http.server.ThreadingHTTPServer`` in a daemon thread on port 0 (or a port you reserved with
:func:`closed_port`, to bring a "down" proxy up later). Knobs: ``status`` (what to answer),
``script`` (statuses answered first, one per request, e.g. ``[503, 503]``), ``hold_s`` (hold each
request that long before answering, to simulate a hung proxy; ``close()`` releases held requests at
once), ``location`` (sent with a 3xx status: a redirect, as an auth gateway in front of the proxy
answers; every GET is answered 200, like its login page). :meth:`FakeProxy.set_mode` switches a
running proxy between ``"up"``, ``"down"`` (the socket is closed: connection refused) and ``"hung"``
(requests are read and recorded, then held without an answer until the mode changes, when they are
dropped)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

CLEAR_PATH = "/admin/clear_sessions"


def closed_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (bound to port 0, then closed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # held handler threads must not block server_close()
    block_on_close = False

    def handle_error(self, request, client_address) -> None:
        # The client gave up on a held request (read timeout): a broken pipe is expected.
        pass


class FakeProxy:
    """A recording stand-in for the LLM proxy; usable as a context manager."""

    def __init__(
        self,
        *,
        port: int = 0,
        status: int = 200,
        hold_s: float = 0.0,
        script: list[int] | None = None,
        location: str | None = None,
    ) -> None:
        self.status = status
        self.location = location
        self.gets = 0
        self.hold_s = hold_s
        self.script = list(script or [])
        self._lock = threading.Lock()
        self._calls: list[dict[str, Any]] = []
        self._answers: list[tuple[int, dict[str, Any]]] = []
        self._released = threading.Event()
        self._unhung = threading.Event()
        self._unhung.set()
        self._changed = threading.Condition()
        self._port = port
        self.mode = "up"
        self._listen()
        self._closed = False

    def _listen(self) -> None:
        self._server = _Server(("127.0.0.1", self._port), self._handler_class())
        self._port = self._server.server_address[
            1
        ]  # port 0 becomes the real one, kept for "up" again
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"fake-proxy-{self._port}",
            daemon=True,
        )
        self._thread.start()

    def _unlisten(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def set_mode(self, mode: str) -> None:
        """Switch to ``"up"``, ``"down"`` (not listening) or ``"hung"`` (never answers); see the
        module doc."""
        assert mode in ("up", "down", "hung"), mode
        if mode == self.mode or self._closed:
            return
        if self.mode == "down":
            self._listen()  # HTTPServer sets SO_REUSEADDR, so the same port binds again at once
        if mode == "down":
            self._unlisten()
        if mode == "hung":
            self._unhung.clear()
        else:
            self._unhung.set()  # held requests are dropped unanswered
        self.mode = mode

    @property
    def port(self) -> int:
        """The port the server listens on (also while it is down)."""
        return self._port

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
        self._unhung.set()
        if self.mode != "down":
            self._unlisten()

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

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
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
                if not fake._unhung.is_set():
                    fake._unhung.wait()
                    self.close_connection = True  # a hung proxy never answers
                    return
                if fake.hold_s > 0 and fake._released.wait(fake.hold_s):
                    self.close_connection = True  # closing: drop the connection unanswered
                    return
                fake._answered(status, body)
                self._reply(
                    status, json.dumps({"cleared": len(body.get("session_ids", []))}).encode()
                )

            def do_GET(self) -> None:
                with fake._lock:
                    fake.gets += 1
                self._reply(200, b'{"page": "login"}')

            def _reply(self, status: int, payload: bytes) -> None:
                self.send_response(status)
                if 300 <= status < 400 and fake.location:
                    self.send_header("Location", fake.location)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        return Handler
