"""A gthread worker that reads each request's head in its event loop, never in a thread.

gunicorn's gthread worker hands a connection to a thread as soon as it is readable; the thread
then blocks reading the request head. A client that sends part of a head and stalls ties up the
thread, and 16 such clients (no token needed) take every thread: /health and polls hang for as
long as the sockets stay open. Here the event loop reads heads without blocking, a few KiB at a
time, and gives a connection to a thread only once its head is complete (the bytes are handed
back to the thread's parser). A connection whose head is not complete within HEAD_TIMEOUT_S is
closed. Once a thread has the request, reading the body and sending the answer time out after
IO_TIMEOUT_S of silence, so a stalled upload or a reader that stops reading frees its thread too.
No reverse proxy is needed for any of it.

Owns: how a connection's head is read and how long a thread waits on a silent client. It must not
know the app or change what gthread does with a complete request.
"""
from __future__ import annotations

import selectors
import time
from collections import deque
from typing import Any

from gunicorn.workers.gthread import ThreadWorker

HEAD_TIMEOUT_S = 5.0   # a request head must be complete this long after its first byte could be read
IO_TIMEOUT_S = 60.0    # longest silence while a thread reads a body or sends an answer
MAX_HEAD_BYTES = 64 << 10  # gunicorn's own limits (8190-byte lines, 100 fields) refuse far smaller heads
_END = b"\r\n\r\n"


class HeadFirstWorker(ThreadWorker):
    """ThreadWorker whose threads only ever see connections with a complete request head."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reading_heads: deque = deque()  # connections reading their head, oldest deadline first

    def enqueue_req(self, conn: Any) -> None:
        """Instead of a thread: read the head in the event loop (a complete one goes to a thread)."""
        if getattr(conn, "head_ready", False):
            conn.head_ready = False
            super().enqueue_req(conn)
            return
        conn.head = b""
        conn.head_deadline = time.monotonic() + HEAD_TIMEOUT_S
        conn.sock.setblocking(False)
        self.reading_heads.append(conn)
        self.poller.register(conn.sock, selectors.EVENT_READ, lambda sock: self._read_head(conn))

    def _read_head(self, conn: Any) -> None:
        try:
            data = conn.sock.recv(16384)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # closed by the client
            self._drop_head(conn)
            return
        conn.head += data
        if _END in conn.head or len(conn.head) > MAX_HEAD_BYTES:  # too large: the parser says why
            self.poller.unregister(conn.sock)
            self.reading_heads.remove(conn)
            conn.head_ready = True
            conn.data_ready = True
            super().enqueue_req(conn)

    def _drop_head(self, conn: Any) -> None:
        try:
            self.poller.unregister(conn.sock)
        except (OSError, KeyError, ValueError):
            pass
        try:
            self.reading_heads.remove(conn)
        except ValueError:
            pass
        self.nr_conns -= 1
        conn.close()

    def murder_pending(self) -> None:
        """Also close the connections whose head was not complete in time (slow or stalled clients)."""
        super().murder_pending()
        now = time.monotonic()
        while self.reading_heads and self.reading_heads[0].head_deadline <= now:
            self._drop_head(self.reading_heads[0])

    def handle(self, conn: Any) -> Any:
        """In a thread: give the head read by the event loop back to the parser, then handle."""
        head = getattr(conn, "head", b"")
        conn.head = b""
        if head:
            init = conn.init

            def init_and_unread() -> None:
                init()
                conn.parser.unreader.unread(head)
                conn.sock.settimeout(IO_TIMEOUT_S)

            conn.init = init_and_unread
        try:
            return super().handle(conn)
        finally:
            if head:
                del conn.init  # back to the class's method for the next request on this connection

