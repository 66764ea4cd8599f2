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

Owns: the gate's socket, its event loop and thread, and the calls it forwards (the held ones are
:mod:`rollout_buffer.runtime.held`'s). It must not decide admission (it asks) nor touch the
accumulator.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import resource
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from urllib.parse import urlsplit

from rollout_buffer.runtime.held import HeldCalls

logger = logging.getLogger(__name__)

MAX_HEAD_BYTES = 64 * 1024
MAX_BODY_BYTES = 256 * 1024 * 1024  # a model call's body (long histories, images) is far smaller
RESUME_WINDOW_S = 120.0  # after the gate starts, a call with an assistant turn is a running one
HEAD_TIMEOUT_S = 60.0  # a connection that never finishes its head is closed (slowloris)
FD_WANTED = 65536  # descriptors the gate asks for (its calls take one or two each)
MAX_STARTED_SESSIONS = 100_000  # sessions remembered as started (~100 bytes each)
CONNECT_TIMEOUT_S = 10.0
# the proxy's version stamp in an answer; searched in the last bytes of a chunk with the next
VERSION_STAMP = re.compile(rb'"weight_version"\s*:\s*(\d{1,12})(?![\d.eE])')
VERSION_TAIL_BYTES = 64
NOT_RELAYED = {  # hop-by-hop, and Expect: the gate has read the whole body already
    b"connection",
    b"keep-alive",
    b"proxy-connection",
    b"transfer-encoding",
    b"upgrade",
    b"te",
    b"trailer",
    b"expect",
}


class Gate:
    """An HTTP/1.1 forwarder that holds first calls of sessions of groups not admitted yet.

    ``may_start(session_id)`` answers True (forward now) or False (hold, ask again later);
    ``running(session_id)`` says a session is seen mid-way (its call carries a model answer: the
    gate restarted under it), so its group is admitted. ``answered(session_id, retried)`` says a
    call ended; ``retried``: in a way the launcher's client retries after a backoff (no answer,
    a 5xx or a 429, SPEC §5), so the session is alive though quiet meanwhile. They are called
    on the gate's thread and must be quick. ``upstream`` is the real proxy's base URL
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
        answered: Callable[[str, bool], None] = lambda session, retried: None,
        on_hold: Callable[[], None] = lambda: None,
        on_version: Callable[[int], None] = lambda version: None,
        place: Callable[[str], int | None] = lambda session: None,
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
        self.answered = answered
        self.on_hold = on_hold
        self.on_version = on_version
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._asker: asyncio.Task[None] | None = None  # the held calls' (HeldCalls.run)
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._started_at = time.monotonic()
        # the launcher's client retries a refused call within 30 s (SPEC §5), and a running
        # session's rows are flushed within 5 s and read by the census at the next tick
        self.resume_window_s = RESUME_WINDOW_S
        # sessions seen started, the most recent last: bounded, since an evicted session's next
        # call is asked again and goes (its group has started: a call, a row, or decided)
        self.started_sessions: OrderedDict[str, None] = OrderedDict()
        self.max_started_sessions = MAX_STARTED_SESSIONS
        self.sessions_started = 0  # (a session forgotten and seen again counts again)
        self.in_flight = 0
        # first calls held now: the gate's, whatever job is active (``on_hold`` tells the
        # active job's figures of each call held); let go in the launcher's order (``place``:
        # a session's place in job_environments)
        self.held_calls = HeldCalls(may_start, place, on_hold)
        self.forwarded = 0
        self.upstream_errors = 0

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Bind now (a taken port fails the start, not a thread later), then serve on a thread."""
        self._started_at = time.monotonic()
        raise_descriptor_limit()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
            sock.listen(1024)
        except OSError:
            sock.close()
            raise
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
        """The budget may have moved (a poll took groups, rows arrived): held calls ask again
        now."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self.held_calls.wake)

    def stats(self) -> dict[str, int]:
        return {
            "port": self.port,
            "in_flight": self.in_flight,
            "held_calls": self.held_calls.held,
            "forwarded": self.forwarded,
            "upstream_errors": self.upstream_errors,
            "sessions_started": self.sessions_started,
        }

    # -- the event loop ---------------------------------------------------------------------------
    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            server = loop.run_until_complete(asyncio.start_server(self._serve, sock=self._sock))
            self._asker = loop.create_task(self.held_calls.run())
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
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT_S)
        except (
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
            ConnectionError,
            asyncio.TimeoutError,
        ):
            writer.close()
            return
        try:
            await self._forward(head, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # either side went away: nothing to answer
        except asyncio.CancelledError:
            # the gate is closing (held and in-flight calls: their clients retry, SPEC §5); ended
            # here, not re-raised, or asyncio logs a traceback for every held call at shutdown
            pass
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
        try:
            length, expects = _body_of(headers)
        except _Refused as refused:
            await _answer(writer, refused.status, str(refused))
            return
        if expects and length:
            # curl and libcurl-based clients ask before sending a large body, and wait a second
            # for the answer: the gate takes every body (it reads it before asking the budget)
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await writer.drain()
        body = await reader.readexactly(length) if length else b""
        session = _session_of(target.decode("latin-1"))
        if session is not None and not self._remembered(session):
            if _continues(body) and time.monotonic() - self._started_at < self.resume_window_s:
                # a call that carries an answer of the model, just after the gate started: the
                # session runs already (the gate restarted under it); holding it could keep an
                # admitted group from completing. Later, a session mid-way has rows (its group has
                # started and is never held), and an assistant turn is a prompt's worked example:
                # taken for a running session, every session of such an environment would be
                # admitted whatever the budget
                self._started(session)
                self.running(session)
            elif not await self._admit(session, reader):
                return  # its client gave up while it was held (it retries with a new call)
        if session is not None:
            self.seen(session)  # a sign of life: a silent session is taken for dead sooner
        self.in_flight += 1
        call = _Call()
        relay = asyncio.ensure_future(self._relay(method, target, headers, body, writer, call))
        # the client going away (its timeout: it retries) ends the upstream call too, as a direct
        # connection would: an upstream that aborts a request whose client left (vLLM does) stops
        # generating for nobody, and a hung upstream does not keep a task and a socket for ever
        gone = asyncio.ensure_future(reader.read(1))
        try:
            await asyncio.wait({relay, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not relay.done() and not (gone.cancelled() or gone.exception() or gone.result()):
                relay.cancel()
            await asyncio.gather(relay, return_exceptions=True)
            if relay.done() and not relay.cancelled() and relay.exception() is not None:
                raise relay.exception()  # type: ignore[misc]
        finally:
            gone.cancel()
            if not relay.done():
                relay.cancel()
            self.in_flight -= 1
            if session is not None:
                status = call.status
                self.answered(session, status is None or status == 429 or status >= 500)

    async def _admit(self, session: str, reader: asyncio.StreamReader) -> bool:
        """Hold the first call of ``session`` until its group may start (:class:`HeldCalls`).
        False when its client went away meanwhile."""
        if not await self.held_calls.admit(session, reader):
            return False
        self._started(session)
        return True

    def _remembered(self, session: str) -> bool:
        if session in self.started_sessions:
            self.started_sessions.move_to_end(session)
            return True
        return False

    def _started(self, session: str) -> None:
        if session not in self.started_sessions:
            self.sessions_started += 1
        self.started_sessions[session] = None
        while len(self.started_sessions) > self.max_started_sessions:
            self.started_sessions.popitem(last=False)

    async def _relay(
        self,
        method: bytes,
        target: bytes,
        headers: list[bytes],
        body: bytes,
        writer: asyncio.StreamWriter,
        call: _Call,
    ) -> None:
        """Forward the call to the proxy and its answer back; ``call.status`` is the status
        the client was answered (once its head is sent)."""
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(self.upstream_host, self.upstream_port), CONNECT_TIMEOUT_S
            )
        except (OSError, asyncio.TimeoutError) as exc:
            self.upstream_errors += 1
            # a 502 is retried by the launcher's LLM client, as any 5xx (SPEC §5)
            call.status = 502
            await _answer(writer, 502, f"the LLM proxy cannot be reached: {exc}")
            return
        answered = False
        stamp = VersionStamp()
        try:
            # the gate sends the whole body at once: the proxy has nothing to agree to first
            kept = [h for h in headers if h.partition(b":")[0].strip().lower() not in NOT_RELAYED]
            out = [method + b" " + target + b" HTTP/1.1", *kept, b"Connection: close", b"", b""]
            up_writer.write(b"\r\n".join(out) + body)
            await up_writer.drain()
            while True:
                try:
                    head = await up_reader.readuntil(b"\r\n\r\n")
                except asyncio.LimitOverrunError:
                    self.upstream_errors += 1
                    call.status = 502
                    await _answer(writer, 502, "the LLM proxy's answer has a head over 64 KiB")
                    return
                status = _status(head)
                if status is None or not 100 <= status < 200 or status == 101:
                    break
                writer.write(head)  # an interim answer (103 Early Hints): the final one follows
                await writer.drain()
            stamp.feed(head)
            # the gate answers one call per connection: the client is told so, or it would send
            # its next call on a connection the gate is closing (a keep-alive client, like
            # requests, then sees it dropped and backs off 2 s before retrying, SPEC §5)
            call.status = status
            writer.write(_closing(head))
            await writer.drain()
            answered = True
            # the answer ends where its framing says, whether or not the proxy closes then; the
            # stamp is read from the payload, never from a chunk's size line
            framing = _framing(head, method, status)
            if framing == CHUNKED:
                await _relay_chunked(up_reader, writer, stamp)
            else:
                remaining = framing
                while remaining != 0:
                    want = 65536 if remaining < 0 else min(remaining, 65536)
                    chunk = await up_reader.read(want)
                    if not chunk:
                        if remaining > 0:  # cut short: the client sees its answer cut, retries
                            raise asyncio.IncompleteReadError(b"", remaining)
                        break
                    if remaining > 0:
                        remaining -= len(chunk)
                    stamp.feed(chunk)
                    writer.write(chunk)
                    await writer.drain()
        finally:
            # counted and read even when cancelled: a client that has the whole answer closes
            # its end at once (the answer said Connection: close), often before the proxy's end
            if answered:
                self.forwarded += 1
                if stamp.version is not None:
                    self.on_version(stamp.version)
            up_writer.close()
            with contextlib.suppress(Exception):
                await up_writer.wait_closed()


class _Call:
    """What became of a forwarded call: the status its client was answered (None: none)."""

    status: int | None = None


class VersionStamp:
    """The weight version the LLM proxy stamped on a successful answer
    (``metadata.weight_version``, SPEC §2), read from the bytes as they are forwarded: a
    version's number may straddle two chunks, so the end of the previous chunk is searched with
    the next. An answer that is not a 2xx, or a stamp that is not a plain integer, gives None."""

    def __init__(self) -> None:
        self.version: int | None = None
        self._ok: bool | None = None  # the status line: 2xx or not, once read
        self._tail = b""

    def feed(self, chunk: bytes) -> None:
        if self._ok is None:
            head = (self._tail + chunk)[:16]
            if len(head) < 12:
                self._tail += chunk
                return
            self._ok = head.startswith(b"HTTP/1.") and head[9:10] == b"2"
        if not self._ok:
            return
        text = self._tail + chunk
        for match in VERSION_STAMP.finditer(text):
            self.version = int(match.group(1))
        self._tail = text[-VERSION_TAIL_BYTES:]


def raise_descriptor_limit(wanted: int = FD_WANTED) -> int:
    """Raise this process's soft limit on open descriptors towards its hard limit: a held call
    takes one and an in-flight call two, and a soft limit of 1024 (many hosts' default) let the
    gate carry only ~400 calls, the rest answered 502 (the launcher backing off up to 30 s).
    Returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return soft
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError) as exc:
            logger.warning("the pacing gate could not raise the descriptor limit: %s", exc)
            return soft
        logger.info("pacing gate: open-descriptor limit raised from %d to %d", soft, target)
        return target
    return soft


CHUNKED = -2  # _framing: the body is chunked
UNTIL_CLOSE = -1  # _framing: the body runs until the proxy closes


def _status(head: bytes) -> int | None:
    """An answer's status code, None when its status line is not HTTP's."""
    parts = head.split(b"\r\n", 1)[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
        return None
    return int(parts[1])


def _framing(head: bytes, method: bytes, status: int | None) -> int:
    """Where the answer's body ends (RFC 9112 6.3): its length (0: none), CHUNKED, or
    UNTIL_CLOSE."""
    if method.upper() == b"HEAD" or status in (204, 304):
        return 0
    length: int | None = None
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"transfer-encoding":
            codings = [c.strip() for c in value.lower().split(b",")]
            return CHUNKED if codings[-1] == b"chunked" else UNTIL_CLOSE
        if name == b"content-length" and value.strip().isdigit():
            length = int(value.strip())
    return UNTIL_CLOSE if length is None else length


async def _relay_chunked(
    up_reader: asyncio.StreamReader, writer: asyncio.StreamWriter, stamp: VersionStamp
) -> None:
    """Relay a chunked body as it comes, byte for byte, up to its last chunk and trailers; only
    the chunks' data goes to ``stamp``."""
    while True:
        line = await _line(up_reader)
        writer.write(line)
        size_text = line.split(b";", 1)[0].strip()
        if not size_text or any(c not in b"0123456789abcdefABCDEF" for c in size_text):
            raise ConnectionError(f"the LLM proxy sent a bad chunk size line {line[:40]!r}")
        size = int(size_text, 16)
        if size == 0:
            while line != b"\r\n":  # the trailers, up to the empty line
                line = await _line(up_reader)
                writer.write(line)
            await writer.drain()
            return
        while size:
            data = await up_reader.read(min(size, 65536))
            if not data:
                raise asyncio.IncompleteReadError(b"", size)
            size -= len(data)
            stamp.feed(data)
            writer.write(data)
            await writer.drain()
        writer.write(await up_reader.readexactly(2))  # the chunk's CRLF


async def _line(up_reader: asyncio.StreamReader) -> bytes:
    """A line of a chunked body (a size line, a trailer), with its CRLF."""
    try:
        return await up_reader.readuntil(b"\r\n")
    except asyncio.LimitOverrunError as exc:
        raise ConnectionError("the LLM proxy sent a chunked body's line over 64 KiB") from exc


class _Refused(Exception):
    """A request the gate answers with an error itself."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _body_of(headers: list[bytes]) -> tuple[int, bool]:
    """A request's body length, and whether its client waits for ``100 Continue`` before
    sending it; raises :class:`_Refused` for a request the gate does not forward."""
    length: int | None = None
    expects = False
    for h in headers:
        name, _, value = h.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            text = value.strip()
            if not text.isdigit():  # not a number, or negative: no body can be read by it
                raise _Refused(400, "Content-Length is a non-negative integer")
            if length is not None and int(text) != length:
                # the gate would read the body by one and the proxy by the other: the proxy would
                # see another request than the one paced (RFC 9112 6.3: an error)
                raise _Refused(400, "two different Content-Lengths")
            length = int(text)
            if length > MAX_BODY_BYTES:  # never buffered: it would take the service's memory
                raise _Refused(413, f"the gate forwards bodies of at most {MAX_BODY_BYTES} bytes")
        elif name == b"transfer-encoding":
            raise _Refused(411, "the gate takes bodies with a Content-Length")
        elif name == b"expect" and value.strip().lower() == b"100-continue":
            expects = True
    return length or 0, expects


def _closing(head: bytes) -> bytes:
    """An answer's head, saying that the connection closes after it."""
    lines = head.split(b"\r\n")
    kept = [
        line
        for line in lines[1:]
        if line and line.partition(b":")[0].strip().lower() not in (b"connection", b"keep-alive")
    ]
    return b"\r\n".join([lines[0], *kept, b"Connection: close", b"", b""])


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
    reason = {
        400: "Bad Request",
        411: "Length Required",
        413: "Payload Too Large",
        502: "Bad Gateway",
    }.get(status, "Error")
    writer.write(
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )
    with contextlib.suppress(ConnectionError):
        await writer.drain()
