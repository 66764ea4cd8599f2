"""A gthread worker that reads each whole request in its event loop, never in a thread.

gunicorn's gthread worker hands a connection to a thread as soon as it is readable; the thread
then blocks reading the request head and body. A client that sends part of a request and stalls
ties up the thread, and 16 such clients (no token needed) take every thread: /health and polls
hang for as long as the sockets stay open. Here the event loop reads the head and then the body
without blocking, a few KiB at a time, and gives a connection to a thread only once its request
is complete (the bytes are handed back to the thread's parser). A head not complete within
HEAD_TIMEOUT_S, or a body not complete BODY_TIMEOUT_S after its head, closes the connection. A
body larger than the service's cap is not read: the thread answers 413 at once. Once a thread
has the request, sending the answer times out after IO_TIMEOUT_S of silence.

The event loop never waits on a client either: a connection that is not kept alive is closed
by half-closing it and draining what the client still sends from the loop (gunicorn's own
graceful close lingers up to 2 s in the loop, so 20 clients that never close their end stalled
every other client for 40 s). Connections are bounded by the descriptors the process may open,
an accept that finds none left pauses accepting instead of killing the worker (and, through it,
the launcher), and at the bound the oldest idle kept-alive connection makes room for a new one.
No reverse proxy is needed for any of it.

Owns: how a connection's head is read and how long a thread waits on a silent client. It must not
know the app or change what gthread does with a complete request.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import resource
import selectors
import socket
import time
from collections import deque
from typing import Any

from gunicorn.workers.gthread import ThreadWorker

from rollout_buffer.core.config import Config

logger = logging.getLogger(__name__)

# a request head must be complete this long after its first byte could be read
HEAD_TIMEOUT_S = 5.0
# its body (at most ROLLOUT_BUFFER_MAX_REQUEST_BYTES) this long after the head
BODY_TIMEOUT_S = 10.0
IO_TIMEOUT_S = 60.0  # longest silence while a thread sends an answer
LINGER_S = 2.0  # a closing connection is drained this long at most, from the event loop
# gunicorn's own limits (8190-byte lines, 100 fields) refuse far smaller heads
MAX_HEAD_BYTES = 64 << 10
# no descriptor left: stop accepting this long (connections wait in the backlog)
ACCEPT_PAUSE_S = 0.5
FD_RESERVE = 64  # descriptors kept for the service itself, plus FD_PER_THREAD per thread
FD_PER_THREAD = 8  # (a request's database connections: SQLite holds 3 per connection)
_RESOURCE_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_END = b"\r\n\r\n"


def connection_budget(threads: int, wanted: int) -> int:
    """How many client connections fit in the descriptors this process may open."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(threads + 1, min(wanted, soft - FD_RESERVE - FD_PER_THREAD * threads))


def _recv(sock: socket.socket) -> bytes | None:
    """What a non-blocking socket has: None when nothing yet, b"" when the client closed or
    failed."""
    try:
        return sock.recv(65536)
    except (BlockingIOError, InterruptedError):
        return None
    except OSError:
        return b""


class _Request:
    """What the event loop knows of a request it is reading: its bytes and where its body ends."""

    __slots__ = ("buf", "chunk_at", "deadline", "head_end", "need")

    def __init__(self, data: bytes, deadline: float) -> None:
        self.buf = bytearray(data)
        self.head_end: int | None = None  # offset just past the head's blank line
        self.need: int | None = None  # total bytes of head and body (a Content-Length body)
        self.chunk_at: int | None = None  # offset of the next chunk-size line (a chunked body)
        self.deadline = deadline


class HeadFirstWorker(ThreadWorker):
    """ThreadWorker whose threads only ever see connections with a complete request."""

    worker_connections: int  # gunicorn's setting, lowered to what the open-files limit allows

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reading_heads: deque = deque()  # connections reading their head, oldest deadline first
        # connections reading their body, oldest deadline first
        self.reading_bodies: deque = deque()
        self.lingering: deque = deque()  # connections being closed, oldest deadline first
        self.max_body = Config.from_env().max_request_bytes
        self.worker_connections = connection_budget(self.cfg.threads, self.worker_connections)
        self.max_keepalived = self.worker_connections - self.cfg.threads
        self._accept_paused_until = 0.0
        self._accept_warned_at = float("-inf")

    # -- accepting --------------------------------------------------------------------------------
    def accept(self, listener: Any) -> None:
        """gunicorn's accept, except that running out of descriptors pauses accepting for a moment
        (the connections wait in the listen backlog) instead of raising out of the event loop,
        which would kill the worker and, with it, the service and its launcher."""
        try:
            super().accept(listener)
        except OSError as exc:
            if exc.errno not in _RESOURCE_ERRNOS:
                raise
            now = time.monotonic()
            self._accept_paused_until = now + ACCEPT_PAUSE_S
            self.set_accept_enabled(False)
            if now - self._accept_warned_at > 60.0:
                self._accept_warned_at = now
                logger.warning(
                    "cannot accept a connection (%s) with %d open; pausing accepts for %.1f s "
                    "(raise the open-files limit, ulimit -n, for more clients)",
                    exc,
                    self.nr_conns,
                    ACCEPT_PAUSE_S,
                )

    def set_accept_enabled(self, enabled: bool) -> None:
        if enabled and time.monotonic() < self._accept_paused_until:
            enabled = False
        super().set_accept_enabled(enabled)

    # -- reading a request in the event loop
    # ----------------------------------------------------------
    def enqueue_req(self, conn: Any) -> None:
        """Instead of a thread: read the request in the event loop (a complete one goes to a
        thread)."""
        if getattr(conn, "request_ready", False):
            conn.request_ready = False
            super().enqueue_req(conn)
            return
        # bytes a thread read ahead (a pipelined request) are where this request starts
        ahead = conn.parser.unreader.take_buffered() if conn.parser is not None else b""
        conn.req = _Request(ahead, time.monotonic() + HEAD_TIMEOUT_S)
        conn.sock.setblocking(False)
        self.reading_heads.append(conn)
        self.poller.register(conn.sock, selectors.EVENT_READ, lambda sock: self._read(conn))
        if ahead:
            self._advance(conn)

    def _read(self, conn: Any) -> None:
        data = _recv(conn.sock)
        if data is None:
            return
        if not data:  # closed by the client
            self._drop(conn)
            return
        conn.req.buf += data
        self._advance(conn)

    def _advance(self, conn: Any) -> None:
        """Look at what was read: hand a complete request to a thread, or wait for more."""
        req: _Request = conn.req
        if req.head_end is None:
            end = req.buf.find(_END)
            if end < 0:
                if len(req.buf) > MAX_HEAD_BYTES:  # too large: the parser says why
                    self._hand_over(conn)
                return
            req.head_end = end + len(_END)
            if not self._plan_body(conn, req):
                self._hand_over(conn)
                return
            self.reading_heads.remove(conn)
            req.deadline = time.monotonic() + BODY_TIMEOUT_S
            self.reading_bodies.append(conn)
        if self._body_complete(req):
            self._hand_over(conn)

    def _plan_body(self, conn: Any, req: _Request) -> bool:
        """From the head: where the body ends. False when a thread can take the request as it is
        (no body, a malformed head for the parser to refuse, a body over the cap for the app to
        refuse with a 413 without reading it)."""
        head_end = req.head_end
        assert head_end is not None  # (called once the head is complete)
        length = chunked = None
        expect = False
        lines = bytes(req.buf[:head_end]).split(b"\r\n")
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                continue
            name, value = name.strip().lower(), value.strip()
            if name == b"content-length":
                if length is not None or not value.isdigit():
                    return False
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = value.lower().endswith(b"chunked")
            elif name == b"expect":
                expect = value.lower() == b"100-continue"
        if chunked and length is None:
            req.chunk_at = head_end
        elif length and not chunked and length <= self.max_body:
            req.need = head_end + length
        else:
            if length and length > self.max_body:
                # the app answers 413 without reading it; the connection must then close, or
                # gunicorn would hold the thread draining a body the client may never send
                self._rewrite_head(req, lines, b"connection", b"Connection: close")
            return False
        if expect and len(req.buf) < (req.need or head_end + 1):
            # the client waits for this before it sends the body; the thread must not send it again
            with contextlib.suppress(OSError):
                conn.sock.send(b"HTTP/1.1 100 Continue\r\n\r\n")
            self._rewrite_head(req, lines, b"expect", None)
        return True

    @staticmethod
    def _rewrite_head(
        req: _Request, lines: list[bytes], name: bytes, replacement: bytes | None
    ) -> None:
        """Replace (or drop) the header ``name`` in the buffered head; the body offsets follow."""
        kept = [ln for ln in lines if ln.partition(b":")[0].strip().lower() != name or not ln]
        if replacement is not None:
            kept.insert(1, replacement)
        head = b"\r\n".join(kept)
        assert req.head_end is not None  # (the head is complete)
        shift = len(head) - req.head_end
        req.buf[: req.head_end] = head
        req.head_end += shift
        if req.need is not None:
            req.need += shift
        if req.chunk_at is not None:
            req.chunk_at += shift

    def _body_complete(self, req: _Request) -> bool:
        """True once the whole body is in the buffer (or a chunked one passes the cap)."""
        if req.need is not None:
            return len(req.buf) >= req.need
        assert req.chunk_at is not None and req.head_end is not None
        buf = req.buf
        while True:
            if req.chunk_at - req.head_end > self.max_body:
                return True  # the app refuses it (413) from what is buffered
            eol = buf.find(b"\r\n", req.chunk_at)
            if eol < 0:
                return len(buf) - req.chunk_at > 1024  # a chunk-size line that long is malformed
            size_text = bytes(buf[req.chunk_at : eol]).split(b";")[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                return True  # malformed: the parser refuses it
            if size == 0:  # the last chunk, then trailer lines up to a blank line
                return buf.find(b"\r\n", eol + 2) == eol + 2 or buf.find(_END, eol) >= 0
            nxt = eol + 2 + size + 2
            if nxt > len(buf):
                return False
            req.chunk_at = nxt

    def _hand_over(self, conn: Any) -> None:
        """The request is complete (or for the parser to refuse): give it to a thread."""
        self.poller.unregister(conn.sock)
        for queue in (self.reading_heads, self.reading_bodies):
            with contextlib.suppress(ValueError):
                queue.remove(conn)
        conn.head = bytes(conn.req.buf)
        conn.req = None
        conn.request_ready = True
        conn.data_ready = True
        super().enqueue_req(conn)

    def _drop(self, conn: Any) -> None:
        """Close a connection whose request never came whole (or whose client went away)."""
        with contextlib.suppress(OSError, KeyError, ValueError):
            self.poller.unregister(conn.sock)
        for queue in (self.reading_heads, self.reading_bodies):
            with contextlib.suppress(ValueError):
                queue.remove(conn)
        self.nr_conns -= 1
        conn.close()

    # -- closing without waiting
    # --------------------------------------------------------------------
    def finish_request(self, conn: Any, fs: Any) -> None:
        """As gunicorn's, except that a connection that is not kept alive is closed from the event
        loop without blocking it (see _linger)."""
        try:
            result = fs.result() if not fs.cancelled() else False
        except Exception:
            result = None
        if result:
            super().finish_request(conn, fs)
        elif result is None:
            self.nr_conns -= 1
            conn.close()
        else:
            self._linger(conn)

    def _linger(self, conn: Any) -> None:
        """Half-close (the client sees the end of the answer) and drain what it still sends until
        it closes too or LINGER_S passes, so the kernel never resets a connection whose answer is
        still in flight. The connection counts against the bound until it is closed."""
        try:
            conn.sock.shutdown(socket.SHUT_WR)
            conn.sock.setblocking(False)
        except OSError:
            self.nr_conns -= 1
            conn.close()
            return
        conn.linger_deadline = time.monotonic() + LINGER_S
        conn.drained = 0
        self.lingering.append(conn)
        self.poller.register(conn.sock, selectors.EVENT_READ, lambda sock: self._drain(conn))

    def _drain(self, conn: Any) -> None:
        data = _recv(conn.sock)
        if data is None:
            return
        conn.drained += len(data)
        if not data or conn.drained > 1 << 20:
            self._close_lingering(conn)

    def _close_lingering(self, conn: Any) -> None:
        with contextlib.suppress(OSError, KeyError, ValueError):
            self.poller.unregister(conn.sock)
        with contextlib.suppress(ValueError):
            self.lingering.remove(conn)
        self.nr_conns -= 1
        conn.close()

    # -- timeouts and the bound --------------------------------------------------------------------
    def murder_pending(self) -> None:
        """Also close the connections whose request was not complete in time (slow or stalled
        clients), the lingering ones past LINGER_S, and, at the bound, the oldest idle kept-alive
        connections (a client simply connects again)."""
        super().murder_pending()
        now = time.monotonic()
        for queue in (self.reading_heads, self.reading_bodies):
            while queue and queue[0].req.deadline <= now:
                self._drop(queue[0])
        while self.lingering and self.lingering[0].linger_deadline <= now:
            self._close_lingering(self.lingering[0])
        while self.nr_conns >= self.worker_connections and self.keepalived_conns:
            conn = self.keepalived_conns.popleft()
            with contextlib.suppress(OSError, KeyError, ValueError):
                self.poller.unregister(conn.sock)
            self.nr_conns -= 1
            conn.close()

    def handle(self, conn: Any) -> Any:
        """In a thread: give the request read by the event loop back to the parser, then handle."""
        head = getattr(conn, "head", b"")
        conn.head = b""
        if head:
            init = conn.init

            def init_and_unread() -> None:
                init()
                conn.parser.unreader.unread(head)
                conn.sock.settimeout(IO_TIMEOUT_S)  # after gunicorn made the socket blocking

            conn.init = init_and_unread
        try:
            return super().handle(conn)
        finally:
            if head:
                del conn.init  # back to the class's method for the next request on this connection
