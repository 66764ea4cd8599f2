"""TcpForwarder: a real TCP relay on 127.0.0.1 in front of a server (Postgres), that can go down.

Listens on port 0 and relays every connection to ``target`` in two daemon threads. ``down()``
cuts every open connection and refuses new ones (as a database host that has gone away); ``up()``
accepts again. ``stall()`` keeps every connection open but forwards nothing more either way (a
hung PgBouncer, a network path that stopped carrying packets: a statement sent gets no answer, a
new connection no reply to its startup); ``flow()`` forwards what was held and carries on.
``close()`` stops listening. Use it to point a service at a database it then loses.
"""

from __future__ import annotations

import contextlib
import socket
import threading


def _cut(socks: list[socket.socket] | tuple[socket.socket, ...]) -> None:
    for s in socks:
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            s.close()


class TcpForwarder:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        self._up = True
        self._flowing = threading.Event()
        self._flowing.set()
        threading.Thread(target=self._accept, name="tcp-forwarder", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._sock.accept()
            except OSError:  # closed
                return
            with self._lock:
                if not self._up:
                    client.close()
                    continue
                try:
                    server = socket.create_connection(self.target, timeout=5)
                except OSError:
                    client.close()
                    continue
                server.settimeout(None)
                self._open += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(
                    target=self._pipe, args=(a, b), name="tcp-forwarder-pipe", daemon=True
                ).start()

    def _pipe(self, source: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                self._flowing.wait()  # stalled: held here, unanswered
                dst.sendall(data)
        except OSError:
            pass
        finally:
            _cut((source, dst))

    def down(self) -> None:
        """Cut every relayed connection and refuse new ones."""
        with self._lock:
            self._up = False
            conns, self._open = self._open, []
        _cut(conns)
        # only now: held data goes to a cut socket and its pipe ends (released before the cut, a
        # stalled answer could still reach its client)
        self._flowing.set()

    def up(self) -> None:
        with self._lock:
            self._up = True

    def stall(self) -> None:
        """Keep every connection open, forward nothing more (see the module doc)."""
        self._flowing.clear()

    def flow(self) -> None:
        self._flowing.set()

    def close(self) -> None:
        self.down()
        with contextlib.suppress(OSError):
            self._sock.close()
