"""Blackhole: a real TCP forwarder to a server (Postgres) that can stop forwarding without closing.

While ``stuck()`` is on, it reads and forwards nothing in either direction and keeps every socket
open: a statement already sent never gets its answer, and a new connection gets no reply to its
startup packet. That is a hung PgBouncer, or a network path that stopped carrying packets, as the
service sees it (its server-side timeouts cannot fire an answer it never receives). ``flowing()``
resumes forwarding what was buffered.
"""
from __future__ import annotations

import contextlib
import select
import socket
import threading


class Blackhole:
    def __init__(self, target: tuple[str, int] = ("127.0.0.1", 5432)) -> None:
        self.target = target
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._stuck = threading.Event()
        self._closed = threading.Event()
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="blackhole-accept", daemon=True).start()

    def url(self, url: str) -> str:
        """``url`` (to the target) rewritten to go through this forwarder."""
        host, port = self.target
        return url.replace(f"{host}:{port}", f"127.0.0.1:{self.port}", 1)

    def stuck(self) -> None:
        self._stuck.set()

    def flowing(self) -> None:
        self._stuck.clear()

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            socks, self._socks = self._socks, []
        for s in [self._server, *socks]:
            with contextlib.suppress(OSError):
                s.close()

    def __enter__(self) -> "Blackhole":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._server.accept()
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                continue
            with self._lock:
                self._socks += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream), name="blackhole-pump", daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        while not self._closed.is_set():
            try:
                ready, _, _ = select.select([a, b], [], [], 0.1)
            except (OSError, ValueError):
                return
            if self._stuck.is_set():
                continue  # read nothing: what was sent waits, unanswered
            for s in ready:
                try:
                    data = s.recv(65536)
                    if data:
                        (b if s is a else a).sendall(data)
                        continue
                except OSError:
                    pass
                for x in (a, b):
                    with contextlib.suppress(OSError):
                        x.close()
                return
