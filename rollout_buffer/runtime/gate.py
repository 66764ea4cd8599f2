"""The pacing gate (issue 23, ``ROLLOUT_BUFFER_PACING=gate``): the launcher's LLM base URL.

The service hands the launcher this gate's URL as ``--llm-base-url``. Every call is forwarded to
the real LLM proxy untouched (method, path, headers, body; the answer streamed back), except that
the first call of a session whose group is not admitted yet is held while the admission budget
is spent. Admission is per group (:class:`rollout_buffer.core.admission.Admission`): once a group
is admitted, no call of it is ever held.

Why an asyncio server on a thread of its own, inside the service: a held call costs a coroutine,
not a thread, so thousands of held or in-flight model calls never take the web server's request
threads (a sync, threaded WSGI service must not spend them on 15-minute LLM calls); and the gate
reads the live budget without any inter-process protocol. A kill -9 of the service takes the
gate down with it: the launcher's LLM client retries a refused connection forever with a backoff
of at most 30 s (SPEC §5), so its sessions resume within 30 s of the service being back on the
same port, and nothing is lost (the gate keeps no state that the database does not hold: the
admitted groups are learned again from the rows). The launcher must run with
``AIEVOBOX_LLM_MAX_CONCURRENCY=0``: with its semaphore on, held calls keep their slots and the
launcher deadlocks (SPEC §5); the service sets it.

Owns: the gate's socket, its event loop and thread, and the held calls. It must not decide
admission (it asks) nor touch the accumulator.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
from collections.abc import Callable
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)

MAX_HEAD_BYTES = 64 * 1024
RECHECK_S = 1.0  # a held call asks again at least this often (the budget moves with polls)
CONNECT_TIMEOUT_S = 10.0
HOP_BY_HOP = {
    b"connection",
    b"keep-alive",
    b"proxy-connection",
    b"transfer-encoding",
    b"upgrade",
    b"te",
    b"trailer",
}


class Gate:
    """An HTTP/1.1 forwarder that holds first calls of sessions of groups not admitted yet.

    ``may_start(session_id)`` answers True (forward now) or False (hold, ask again later);
    ``running(session_id)`` says a session is seen mid-way (its call carries a model answer: the
    gate restarted under it), so its group is admitted. Both are called on the gate's thread and
    must be quick. ``upstream`` is the real proxy's base URL
    (``http://host:port``): a call to ``/v1/<session>/chat/completions`` here goes to the same
    path there.
    """

    name = "pacing-gate"

    def __init__(
        self,
        *,
        host: str,
        port: int,
        upstream: str,
        may_start: Callable[[str], bool],
        running: Callable[[str], None] = lambda session: None,
        seen: Callable[[str], None] = lambda session: None,
        on_hold: Callable[[int], None] = lambda delta: None,
    ) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"the gate forwards to an http:// proxy, got {upstream!r}")
        self.upstream_host = parts.hostname
        self.upstream_port = parts.port or 80
        self.host = host
        self.port = port
        self.may_start = may_start
        self.running = running
        self.seen = seen
        self.on_hold = on_hold
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._wake: asyncio.Event | None = None
        self._ready = threading.Event()
        self.started_sessions: set[str] = set()
        self.in_flight = 0
        self.forwarded = 0
        self.upstream_errors = 0

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Bind now (a taken port fails the start, not a thread later), then serve on a thread."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(1024)
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        self._sock = sock
        self._thread = threading.Thread(target=self._run, name="rollout-buffer-gate", daemon=True)
        self._thread.start()
        self._ready.wait(10)

    def close(self, timeout: float = 5.0) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("the pacing gate's thread is still alive after %.0f s", timeout)
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def poke(self) -> None:
        """The budget may have moved (a poll took groups, a group was decided): held calls ask
        again now."""
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(wake.set)

    def stats(self) -> dict[str, int]:
        return {
            "port": self.port,
            "in_flight": self.in_flight,
            "forwarded": self.forwarded,
            "upstream_errors": self.upstream_errors,
            "sessions_started": len(self.started_sessions),
        }

    # -- the event loop ---------------------------------------------------------------------------
    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        self._wake = asyncio.Event()
        try:
            server = loop.run_until_complete(asyncio.start_server(self._serve, sock=self._sock))
            self._ready.set()
            loop.run_forever()
            server.close()
        except Exception:  # the gate must say why it stopped; the service reports it in /health
            logger.exception("the pacing gate stopped")
        finally:
            self._ready.set()
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()  # held and in-flight calls: their clients retry (SPEC §5)
            with contextlib.suppress(Exception):
                loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            writer.close()
            return
        try:
            await self._forward(head, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # either side went away: nothing to answer
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _forward(
        self, head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        lines = head.split(b"\r\n")
        request_line = lines[0]
        try:
            method, target, _version = request_line.split(b" ", 2)
        except ValueError:
            await _answer(writer, 400, "a request line is METHOD TARGET VERSION")
            return
        headers = [h for h in lines[1:] if h]
        length = 0
        for h in headers:
            name, _, value = h.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value.strip() or 0)
            elif name.strip().lower() == b"transfer-encoding":
                await _answer(writer, 411, "the gate takes bodies with a Content-Length")
                return
        body = await reader.readexactly(length) if length else b""
        session = _session_of(target.decode("latin-1"))
        if session is not None and session not in self.started_sessions:
            if _continues(body):
                # a call that carries an answer of the model: the session runs already (the gate
                # restarted under it); holding it could keep an admitted group from completing
                self.started_sessions.add(session)
                self.running(session)
            else:
                await self._admit(session)
        if session is not None:
            self.seen(session)  # a sign of life: a silent session is taken for dead sooner
        self.in_flight += 1
        try:
            await self._relay(method, target, headers, body, writer)
        finally:
            self.in_flight -= 1

    async def _admit(self, session: str) -> None:
        """Hold the first call of ``session`` until its group may start."""
        if not self.may_start(session):
            self.on_hold(+1)
            try:
                assert self._wake is not None
                while not self.may_start(session):
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), RECHECK_S)
                    self._wake.clear()
            finally:
                self.on_hold(-1)
        self.started_sessions.add(session)

    async def _relay(
        self,
        method: bytes,
        target: bytes,
        headers: list[bytes],
        body: bytes,
        writer: asyncio.StreamWriter,
    ) -> None:
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(self.upstream_host, self.upstream_port), CONNECT_TIMEOUT_S
            )
        except (OSError, asyncio.TimeoutError) as exc:
            self.upstream_errors += 1
            # a 502 is retried by the launcher's LLM client, as any 5xx (SPEC §5)
            await _answer(writer, 502, f"the LLM proxy cannot be reached: {exc}")
            return
        try:
            kept = [h for h in headers if h.partition(b":")[0].strip().lower() not in HOP_BY_HOP]
            out = [method + b" " + target + b" HTTP/1.1", *kept, b"Connection: close", b"", b""]
            up_writer.write(b"\r\n".join(out) + body)
            await up_writer.drain()
            while True:
                chunk = await up_reader.read(65536)
                if not chunk:
                    break
                writer.write(chunk)
                await writer.drain()
            self.forwarded += 1
        finally:
            up_writer.close()
            with contextlib.suppress(Exception):
                await up_writer.wait_closed()


def _continues(body: bytes) -> bool:
    """The request's messages hold an assistant turn: not a session's first call."""
    try:
        doc = json.loads(body or b"{}")
    except ValueError:
        return False
    messages = doc.get("messages") if isinstance(doc, dict) else None
    return isinstance(messages, list) and any(
        isinstance(m, dict) and m.get("role") == "assistant" for m in messages
    )


def _session_of(target: str) -> str | None:
    """The session id of ``.../<session_id>/chat/completions`` (the launcher's session-suffixed
    URL), or None for any other path (forwarded without admission)."""
    path = target.split("?", 1)[0].rstrip("/")
    parts = path.split("/")
    if len(parts) >= 3 and parts[-2:] == ["chat", "completions"] and parts[-3]:
        return parts[-3]
    return None


async def _answer(writer: asyncio.StreamWriter, status: int, message: str) -> None:
    body = json.dumps({"ok": False, "status": status, "error": message}).encode()
    reason = {400: "Bad Request", 411: "Length Required", 502: "Bad Gateway"}.get(status, "Error")
    writer.write(
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )
    with contextlib.suppress(ConnectionError):
        await writer.drain()
