"""The pacing gate (issue 34): the launcher's LLM base URL, which forwards only the launcher's
model calls, and holds a first call while the budget is spent.

It forwards ``POST <base path>/<session_id>/chat/completions`` to the LLM proxy's
``/v1/<session_id>/chat/completions``, for a session the job lists, and answers everything else
itself with a JSON error and a ``reason`` (:data:`STATUS`). Nothing refused reaches the proxy.

HTTP framing is h11's, on both sides (see docs/pacing.md for why). h11 accepts a bare LF, unfolds
obsolete line folding and takes the first of two equal ``Content-Length`` headers: the head is
checked for these before h11 reads it (:func:`framing_problem`).

It runs an asyncio loop on a thread of its own in the service's process: a held or forwarded call
costs a coroutine and one or two descriptors, never a request thread. Only the owner listens
(``owner()``); the address is the one in the running launcher's ``--llm-base-url`` (``address()``),
so a standby that adopted a launcher serves the gate that launcher calls.

Owns: the listening socket, the event loop and its thread, the connections, the held calls and
the refusal counts. It must not read the accumulator: it asks :class:`~.budget.Budget`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import json
import logging
import re
import resource
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple
from urllib.parse import quote, unquote

import h11

from rollout_buffer.pacing.budget import Budget

logger = logging.getLogger(__name__)

MAX_HEAD_BYTES = 64 * 1024
NOT_LISTED_WAIT_S = 10.0  # the launcher lists its sessions when it starts, before any call
NO_SESSIONS_S = 60.0  # no session listed this long after the job began: pacing cannot work
ROUND_S = 0.2  # held calls are asked again at least this often (sessions go quiet with time)
KEEP_S = 0.5  # how often the gate checks that it should listen, and where
LOG_EVERY_S = 60.0  # each refusal reason is logged at most this often
RESERVED_FDS = 512  # descriptors left to the web server, the database and the launcher
CONNECT_TIMEOUT_S = 10.0
STATUS = {
    "path": 404,
    "method": 405,
    "target": 400,
    "host": 421,
    "origin": 403,
    "not_listed": 403,
    "head_too_large": 431,
    "body_too_large": 413,
    "malformed": 400,
    "held_bytes": 503,
    "connections": 503,
    "max_hold": 503,
    "stalled": 408,  # (never sent: the connection is closed)
}
HOP_BY_HOP = {
    b"connection",
    b"keep-alive",
    b"proxy-connection",
    b"transfer-encoding",
    b"te",
    b"trailer",
    b"upgrade",
    b"expect",
    b"host",
    b"content-length",
}


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int
    stall_s: float
    max_held_bytes: int
    max_hold_s: float


class Address(NamedTuple):
    """Where the gate listens, the Host its callers must name, and the base path (with the secret,
    if any) of its URL."""

    bind: str
    port: int
    host: str  # as in the URL
    base_path: str  # e.g. /<secret>/v1

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}{self.base_path}"


class Refused(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class Gone(Exception):
    """The client went away, or stalled: the connection is closed without an answer."""


class Waiter:
    __slots__ = ("arrived", "body_bytes", "future", "place", "seq", "session")

    def __init__(self, session: str, seq: int, body_bytes: int, now: float) -> None:
        self.session = session
        self.seq = seq
        self.body_bytes = body_bytes
        self.arrived = now
        self.place: float = float("inf")
        self.future: asyncio.Future[str] = asyncio.get_running_loop().create_future()


class Gate:
    """The gate's server (see the module docstring)."""

    def __init__(
        self,
        budget: Budget,
        limits: Limits,
        *,
        upstream: tuple[str, int],
        address: Callable[[], Address],
        owner: Callable[[], bool],
    ) -> None:
        self.budget = budget
        self.limits = limits
        self.upstream = upstream
        self.address = address
        self.owner = owner
        self.refused: Counter[str] = Counter({reason: 0 for reason in STATUS})
        self.forwarded = 0
        self.upstream_errors = 0
        self.bound: Address | None = None
        self.bind_error: str | None = None
        self.max_connections = max(16, (raise_descriptor_limit() - RESERVED_FDS) // 2)
        self.held: dict[int, Waiter] = {}
        self.held_bytes = 0
        self._seq = itertools.count()
        self._connections: set[asyncio.Task[Any]] = set()
        self._logged: dict[str, float] = {}
        self._since_log: Counter[str] = Counter()
        self._server: asyncio.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._said_unlisted = False
        self._poked = False

    # -- lifecycle (the service's threads) --------------------------------------------------------
    def start(self) -> None:
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(ready,), name="rollout-buffer-gate", daemon=True
        )
        self._thread.start()
        ready.wait(10)

    def close(self, timeout: float = 5.0) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout)

    def poke(self) -> None:
        """(Any thread.) The budget may have moved: held calls are asked again now."""
        loop, wake = self._loop, self._wake
        if self._poked or loop is None or wake is None or loop.is_closed():
            return  # (one wake-up for a burst: a job lists thousands of sessions at once)
        self._poked = True
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(wake.set)

    def url(self) -> str | None:
        """The URL the launcher is handed; None while the gate does not listen."""
        return None if self.bound is None else self.bound.url

    def stats(self) -> dict[str, Any]:
        return {
            "listening": None if self.bound is None else f"{self.bound.bind}:{self.bound.port}",
            "bind_error": self.bind_error,
            "connections": len(self._connections),
            "max_connections": self.max_connections,
            "held_calls": len(self.held),
            "held_bytes": self.held_bytes,
            "forwarded": self.forwarded,
            "upstream_errors": self.upstream_errors,
        }

    def _run(self, ready: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        self._wake = asyncio.Event()
        tasks = [loop.create_task(self._keep()), loop.create_task(self._pump())]
        ready.set()
        try:
            loop.run_forever()
        finally:
            self._unbind(end_connections=True)
            for task in tasks:
                task.cancel()
            with contextlib.suppress(Exception):
                loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.close()

    # -- listening only as the owner, where the launcher calls ----------------------------------
    async def _keep(self) -> None:
        while True:
            try:
                await self._follow()
            except Exception:  # a bug: the gate must go on following its role
                logger.exception("the pacing gate could not follow its role")
            await asyncio.sleep(KEEP_S)

    async def _follow(self) -> None:
        if not self.owner():
            if self.bound is not None:
                logger.warning("not the owner any more: the pacing gate closes")
                self._unbind(end_connections=True)
            return
        want = self.address()
        if self.bound is not None and want[:2] == self.bound[:2]:
            self.bound = want  # (the launcher adopted may name another path)
            return
        self._unbind(end_connections=False)
        try:
            self._server = await asyncio.start_server(
                self._accepted, want.bind, want.port, reuse_address=True, backlog=1024
            )
        except OSError as exc:
            if self.bind_error is None:
                logger.warning(
                    "the pacing gate cannot listen on %s:%d (%s): retrying until it can; "
                    "ROLLOUT_BUFFER_GATE_PORT chooses the port",
                    want.bind,
                    want.port,
                    exc,
                )
            self.bind_error = str(exc)
            return
        self.bound, self.bind_error = want, None
        logger.info("pacing gate listening on %s:%d", want.bind, want.port)

    def _unbind(self, *, end_connections: bool) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        self.bound = None
        if end_connections:  # held and forwarded calls: their clients retry (SPEC §5)
            for task in list(self._connections):
                task.cancel()

    # -- held calls ---------------------------------------------------------------------------
    async def _pump(self) -> None:
        assert self._wake is not None
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), ROUND_S)
            self._wake.clear()
            self._poked = False
            try:
                self._round()
            except Exception:  # a bug: the held calls must still be asked next time
                logger.exception("asking for the held calls failed")

    def _round(self) -> None:
        now = time.monotonic()
        budget = self.budget
        with budget.lock:
            budget.read_inbox()
            self._say_unlisted(now)
            free = budget.budget()
            for waiter in sorted(self.held.values(), key=lambda w: (w.place, w.seq)):
                verdict = self._verdict(waiter, now, free)
                if verdict == "admitted":
                    free -= 1
                if verdict is not None:
                    self._release(waiter, verdict)

    def _verdict(self, waiter: Waiter, now: float, free: int) -> str | None:
        """(Budget lock held.) What becomes of a held call now: ``go``, ``admitted`` (its group
        starts), a refusal's reason, or None (held on)."""
        listed = self.budget.group_of(waiter.session)
        if listed is None:
            return "not_listed" if now - waiter.arrived >= NOT_LISTED_WAIT_S else None
        group, waiter.place = listed[0], listed[1]
        if self.budget.runs(group):
            return "go"
        if now - waiter.arrived >= self.limits.max_hold_s:
            return "max_hold"
        if free > 0:
            self.budget.admit(group)
            return "admitted"
        return None

    def _release(self, waiter: Waiter, verdict: str) -> None:
        self.held.pop(waiter.seq, None)
        self.held_bytes -= waiter.body_bytes
        if not waiter.future.done():
            waiter.future.set_result(verdict)

    def _say_unlisted(self, now: float) -> None:
        budget = self.budget
        if budget.job is not None and not budget.sessions and not self._said_unlisted:
            if now - budget.job_since >= NO_SESSIONS_S:
                self._said_unlisted = True
                logger.warning(
                    "job %r lists no session in job_environments %.0f s after it began: pacing "
                    "cannot work, and the gate refuses every model call (not_listed)",
                    budget.job,
                    NO_SESSIONS_S,
                )
        elif budget.sessions:
            self._said_unlisted = False

    def why(self) -> str:
        """(Budget lock held.) ``no_job``, ``no_sessions_listed``, ``budget_spent`` or
        ``budget_free``."""
        budget = self.budget
        if budget.job is None:
            return "no_job"
        if not budget.sessions and time.monotonic() - budget.job_since >= NO_SESSIONS_S:
            return "no_sessions_listed"
        return "budget_free" if budget.budget() > 0 else "budget_spent"

    # -- one connection -------------------------------------------------------------------------
    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        conn = h11.Connection(h11.SERVER)
        try:
            if len(self._connections) > self.max_connections:
                raise Refused("connections", "the gate has too many connections; retry")
            await self._serve(reader, writer, conn)
        except Refused as refused:
            self._count(refused.reason)
            with contextlib.suppress(Exception):
                await _answer(writer, conn, refused)
        except Gone as gone:
            if str(gone) == "stalled":
                self._count("stalled")
        except (ConnectionError, asyncio.CancelledError, h11.ProtocolError):
            pass  # either side went away, or the gate closes: the client retries
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _serve(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: h11.Connection
    ) -> None:
        request = await self._head(reader, conn)
        session = self._judge(request)
        body = await self._body(reader, writer, conn, request)
        group = await self._admit(session, len(body), reader)
        self.budget_call(group, +1)
        try:
            await self._forward(request, session, body, reader, writer, conn)
        finally:
            self.budget_call(group, -1)

    def budget_call(self, group: str, delta: int) -> None:
        with self.budget.lock:
            self.budget.call(group, delta)

    async def _read(self, reader: asyncio.StreamReader, timeout: float | None = None) -> bytes:
        """The next bytes of a request: it stalls when none come within ``timeout`` (default:
        ROLLOUT_BUFFER_GATE_STALL_SECONDS)."""
        try:
            wait = self.limits.stall_s if timeout is None else max(0.0, timeout)
            data = await asyncio.wait_for(reader.read(65536), wait)
        except asyncio.TimeoutError:
            raise Gone("stalled") from None
        if not data:
            raise Gone("closed")
        return data

    async def _head(self, reader: asyncio.StreamReader, conn: h11.Connection) -> h11.Request:
        """Read and check a request's head (within the stall limit, all of it); the body's first
        bytes stay in ``conn``."""
        data = b""
        deadline = time.monotonic() + self.limits.stall_s
        while (end := head_end(data)) < 0:
            if len(data) > MAX_HEAD_BYTES:
                raise Refused("head_too_large", f"a request head is at most {MAX_HEAD_BYTES} bytes")
            data += await self._read(reader, deadline - time.monotonic())
        if end > MAX_HEAD_BYTES:
            raise Refused("head_too_large", f"a request head is at most {MAX_HEAD_BYTES} bytes")
        problem = framing_problem(data[:end])
        if problem:
            raise Refused("malformed", problem)
        conn.receive_data(data)
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as exc:
            raise Refused(
                "malformed", f"the request is not HTTP/1.1 as it must be: {exc}"
            ) from None
        assert isinstance(event, h11.Request)  # (the whole head is there)
        return event

    def _judge(self, request: h11.Request) -> str:
        """The session of a call that may go to the proxy; raises Refused for any other."""
        target = request.target
        if request.method == b"CONNECT" or not target.startswith(b"/"):
            raise Refused("target", "the gate takes origin-form targets only (/path)")
        if request.method != b"POST":
            raise Refused("method", "the gate forwards POST only")
        bound = self.bound
        headers = dict(request.headers)
        if bound is None or headers.get(b"host", b"").decode("latin-1").lower() != (
            f"{bound.host}:{bound.port}".lower()
        ):
            raise Refused("host", "the Host is not the gate's")
        if b"origin" in headers:
            raise Refused("origin", "a browser's request (it has an Origin) is never forwarded")
        path = target.decode("latin-1")
        base, _, rest = path.rpartition("/chat/completions")
        prefix, _, raw_session = base.rpartition("/")
        if rest or not hmac.compare_digest(prefix.encode(), bound.base_path.encode()):
            raise Refused(
                "path", "the gate forwards POST <base>/<session_id>/chat/completions only"
            )
        try:
            session = unquote(raw_session, errors="strict")
        except UnicodeDecodeError:
            session = ""
        if not session or "/" in session or session in (".", ".."):
            raise Refused("path", "the session id is not a path segment")
        return session

    async def _body(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        conn: h11.Connection,
        request: h11.Request,
    ) -> bytes:
        limit = self.limits.max_body_bytes
        length = dict(request.headers).get(b"content-length")
        if length is not None and int(length) > limit:
            raise Refused("body_too_large", f"a model call's body is at most {limit} bytes")
        if conn.they_are_waiting_for_100_continue:
            writer.write(conn.send(h11.InformationalResponse(status_code=100, headers=[])))
        body = bytearray()
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                raise Refused("malformed", f"the request's body is malformed: {exc}") from None
            if event is h11.NEED_DATA:
                conn.receive_data(await self._read(reader))
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > limit:
                    raise Refused("body_too_large", f"a model call's body is at most {limit} bytes")
            elif isinstance(event, h11.EndOfMessage):
                return bytes(body)
            else:
                raise Gone("closed")

    async def _admit(self, session: str, size: int, reader: asyncio.StreamReader) -> str:
        """Wait until the session's call may go; its group. Raises Refused (not listed, the
        hold's end, the held bytes' cap) or Gone (its client went away: never forwarded)."""
        budget = self.budget
        with budget.lock:
            budget.read_inbox()
            listed = budget.group_of(session)
            if listed is not None and budget.runs(listed[0]):
                return listed[0]
            if listed is not None and not self.held and budget.budget() > 0:
                budget.admit(listed[0])
                return listed[0]
        if self.held_bytes + size > self.limits.max_held_bytes:
            raise Refused("held_bytes", "the gate holds too many bytes of held calls; retry")
        waiter = Waiter(session, next(self._seq), size, time.monotonic())
        self.held[waiter.seq] = waiter
        self.held_bytes += size
        self.poke()
        gone = asyncio.ensure_future(reader.read(1))  # a client sends nothing after its call
        either: set[asyncio.Future[Any]] = {waiter.future, gone}
        try:
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            if not waiter.future.done():
                raise Gone("closed")  # it gave up (it retries): never forwarded
            verdict = waiter.future.result()
        finally:
            gone.cancel()
            if waiter.seq in self.held:
                self._release(waiter, "gone")
        if verdict in ("not_listed", "max_hold"):
            raise Refused(verdict, _HELD_MESSAGES[verdict])
        listed = self.budget.group_of(session)
        assert listed is not None
        return listed[0]

    # -- forwarding ---------------------------------------------------------------------------
    async def _forward(
        self,
        request: h11.Request,
        session: str,
        body: bytes,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        conn: h11.Connection,
    ) -> None:
        relay = asyncio.ensure_future(self._relay(request, session, body, writer, conn))
        gone = asyncio.ensure_future(reader.read(1))
        try:
            await asyncio.wait({relay, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not relay.done():
                relay.cancel()  # its client left: the proxy stops generating for nobody
            await asyncio.gather(relay, return_exceptions=True)
        finally:
            gone.cancel()
            relay.cancel()

    async def _relay(
        self,
        request: h11.Request,
        session: str,
        body: bytes,
        writer: asyncio.StreamWriter,
        conn: h11.Connection,
    ) -> None:
        host, port = self.upstream
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(host, port), CONNECT_TIMEOUT_S
            )
        except (OSError, asyncio.TimeoutError) as exc:
            self.upstream_errors += 1  # a 502: the launcher's client retries it (SPEC §5)
            await _answer(writer, conn, Refused("", f"the LLM proxy cannot be reached: {exc}"), 502)
            return
        up = h11.Connection(h11.CLIENT)
        headers = [(n, v) for n, v in request.headers if n not in HOP_BY_HOP]
        headers += [(b"host", f"{host}:{port}".encode()), (b"connection", b"close")]
        headers.append((b"content-length", str(len(body)).encode()))
        target = "/v1/" + quote(session, safe="") + "/chat/completions"
        try:
            up_writer.write(up.send(h11.Request(method=b"POST", target=target, headers=headers)))
            up_writer.write(up.send(h11.Data(data=body)) + up.send(h11.EndOfMessage()))
            await self._answer_back(up, up_reader, writer, conn)
        except h11.RemoteProtocolError as exc:
            self.upstream_errors += 1
            if conn.our_state is h11.SEND_RESPONSE:
                await _answer(writer, conn, Refused("", f"the LLM proxy's answer: {exc}"), 502)
        finally:
            up_writer.close()

    async def _answer_back(
        self,
        up: h11.Connection,
        up_reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        conn: h11.Connection,
    ) -> None:
        while True:
            event = up.next_event()
            if event is h11.NEED_DATA:
                up.receive_data(await up_reader.read(65536))
                continue
            if isinstance(event, h11.InformationalResponse):
                continue  # (103 Early Hints: not for a model call's client; 100 was answered)
            if isinstance(event, h11.Response):
                kept = [
                    (n, v) for n, v in event.headers if n not in HOP_BY_HOP - {b"content-length"}
                ]
                kept.append((b"connection", b"close"))  # one call per connection
                writer.write(conn.send(h11.Response(status_code=event.status_code, headers=kept)))
            elif isinstance(event, h11.Data):
                writer.write(conn.send(h11.Data(data=event.data)))
            elif isinstance(event, h11.EndOfMessage):
                writer.write(conn.send(h11.EndOfMessage()))
                self.forwarded += 1
                await writer.drain()
                return
            else:  # the proxy closed early: the client sees its answer cut, and retries
                raise ConnectionError("the LLM proxy closed the connection mid-answer")
            await writer.drain()

    # -- counting refusals ----------------------------------------------------------------------
    def _count(self, reason: str) -> None:
        self.refused[reason] += 1
        self._since_log[reason] += 1
        now = time.monotonic()
        if now - self._logged.get(reason, float("-inf")) >= LOG_EVERY_S:
            self._logged[reason] = now
            logger.warning(
                "pacing gate: refused %d request(s) (%s) since this was last logged",
                self._since_log.pop(reason),
                reason,
            )


_HELD_MESSAGES = {
    "not_listed": "the current job does not list this session in job_environments",
    "max_hold": "held for ROLLOUT_BUFFER_GATE_MAX_HOLD_SECONDS; retry",
}


async def _answer(
    writer: asyncio.StreamWriter, conn: h11.Connection, refused: Refused, status: int = 0
) -> None:
    """A JSON error from the gate itself (it closes the connection)."""
    status = status or STATUS[refused.reason]
    doc: dict[str, Any] = {"ok": False, "status": status, "error": str(refused)}
    if refused.reason:
        doc["reason"] = refused.reason
    body = json.dumps(doc).encode()
    headers = [
        ("content-type", "application/json"),
        ("content-length", str(len(body))),
        ("connection", "close"),
    ]
    if status == 503:
        headers.append(("retry-after", "1"))
    if status == 405:
        headers.append(("allow", "POST"))
    writer.write(conn.send(h11.Response(status_code=status, headers=headers)))
    writer.write(conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
    await writer.drain()


def head_end(data: bytes) -> int:
    """Where a request's head ends (after its empty line, bare LFs counted), or -1."""
    ends = [i for i in (data.find(b"\n\r\n"), data.find(b"\n\n")) if i >= 0]
    if not ends:
        return -1
    first = min(ends)
    return first + (3 if data[first + 1 : first + 2] == b"\r" else 2)


_BARE_LF = re.compile(rb"(?<!\r)\n")
_FOLDED = re.compile(rb"\n[ \t]")


def framing_problem(head: bytes) -> str | None:
    """What h11 would let through that the gate refuses: a bare LF, obsolete line folding, and
    two Content-Length or Transfer-Encoding headers, or both (RFC 9112 6.3)."""
    if _BARE_LF.search(head):
        return "a line of the head ends with a bare LF"
    if _FOLDED.search(head):
        return "a header is folded over two lines (obsolete)"
    names = [line.split(b":", 1)[0].strip().lower() for line in head.split(b"\r\n")[1:]]
    lengths, codings = names.count(b"content-length"), names.count(b"transfer-encoding")
    if lengths > 1 or codings > 1 or (lengths and codings) or b"," in _value(head, b"length"):
        return "the body's length is given twice, or two ways"
    return None


def _value(head: bytes, name: bytes) -> bytes:
    match = re.search(rb"\ncontent-" + name + rb":([^\r\n]*)", head, re.I)
    return match.group(1) if match else b""


def raise_descriptor_limit(wanted: int = 65536) -> int:
    """Raise the soft limit on open descriptors towards the hard one (a held call takes one, a
    forwarded call two); the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and target > soft:
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return target
    return soft if soft != resource.RLIM_INFINITY else wanted
