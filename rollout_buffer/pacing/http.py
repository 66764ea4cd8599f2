"""One exchange at the pacing gate, framed by h11 on both sides: reading and judging a request
(``read_head``, ``judge``, ``read_body``), answering a refusal (``answer``), and forwarding a call
to the LLM proxy and its answer back (``forward``).

h11 accepts a bare LF, unfolds obsolete line folding and takes the first of two equal
``Content-Length`` headers: the head is checked for these before h11 reads it
(:func:`framing_problem`).

Owns: the framing, the limits of one request and the reasons of its refusals. It must not hold a
call nor count anything: the gate does.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
import time
from typing import Any, NamedTuple
from urllib.parse import quote, unquote

import h11

MAX_HEAD_BYTES = 64 * 1024
ANSWER_KEPT_BYTES = 128 * 1024  # a copy of an answer up to this size is read for its version
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


class Relayed(NamedTuple):
    """A forwarded call: whether the proxy answered (False: no answer, or not HTTP), and the
    weight version its answer carries (None: none, or not read)."""

    answered: bool
    weight_version: int | None = None


class Refused(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class Gone(Exception):
    """The client went away, or stalled: the connection is closed without an answer."""


async def read(reader: asyncio.StreamReader, timeout: float) -> bytes:
    """The next bytes of a request: it stalls when none come within ``timeout``."""
    try:
        data = await asyncio.wait_for(reader.read(65536), max(0.0, timeout))
    except asyncio.TimeoutError:
        raise Gone("stalled") from None
    if not data:
        raise Gone("closed")
    return data


async def read_head(
    reader: asyncio.StreamReader, conn: h11.Connection, stall_s: float
) -> h11.Request:
    """Read and check a request's head (all of it within ``stall_s``); the body's first bytes
    stay in ``conn``."""
    data = b""
    deadline = time.monotonic() + stall_s
    while (end := head_end(data)) < 0:
        if len(data) > MAX_HEAD_BYTES:
            raise Refused("head_too_large", f"a request head is at most {MAX_HEAD_BYTES} bytes")
        data += await read(reader, deadline - time.monotonic())
    if end > MAX_HEAD_BYTES:
        raise Refused("head_too_large", f"a request head is at most {MAX_HEAD_BYTES} bytes")
    problem = framing_problem(data[:end])
    if problem:
        raise Refused("malformed", problem)
    conn.receive_data(data)
    try:
        event = conn.next_event()
    except h11.RemoteProtocolError as exc:
        raise Refused("malformed", f"the request is not HTTP/1.1 as it must be: {exc}") from None
    assert isinstance(event, h11.Request)  # (the whole head is there)
    return event


def judge(request: h11.Request, bound: Address | None) -> str:
    """The session of a call that may go to the proxy (``bound``: the gate's address); raises
    Refused for any other."""
    target = request.target
    if request.method == b"CONNECT" or not target.startswith(b"/"):
        raise Refused("target", "the gate takes origin-form targets only (/path)")
    if request.method != b"POST":
        raise Refused("method", "the gate forwards POST only")
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
        raise Refused("path", "the gate forwards POST <base>/<session_id>/chat/completions only")
    try:
        session = unquote(raw_session, errors="strict")
    except UnicodeDecodeError:
        session = ""
    if not session or "/" in session or session in (".", ".."):
        raise Refused("path", "the session id is not a path segment")
    return session


async def read_body(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    conn: h11.Connection,
    request: h11.Request,
    limit: int,
    stall_s: float,
) -> bytes:
    """The request's body, at most ``limit`` bytes, none of it silent for ``stall_s``."""
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
            conn.receive_data(await read(reader, stall_s))
        elif isinstance(event, h11.Data):
            body += event.data
            if len(body) > limit:
                raise Refused("body_too_large", f"a model call's body is at most {limit} bytes")
        elif isinstance(event, h11.EndOfMessage):
            return bytes(body)
        else:
            raise Gone("closed")


async def forward(
    upstream: tuple[str, int],
    request: h11.Request,
    session: str,
    body: bytes,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    conn: h11.Connection,
) -> Relayed:
    """Forward the call to the proxy (``upstream``) and its answer back. A client that leaves
    ends the call at the proxy too."""
    relay = asyncio.ensure_future(_relay(upstream, request, session, body, writer, conn))
    gone = asyncio.ensure_future(reader.read(1))
    try:
        await asyncio.wait({relay, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not relay.done():
            relay.cancel()  # its client left: the proxy stops generating for nobody
        await asyncio.gather(relay, return_exceptions=True)
    finally:
        gone.cancel()
        relay.cancel()
    if relay.done() and not relay.cancelled() and relay.exception() is None:
        return relay.result()
    return Relayed(False)


async def _relay(
    upstream: tuple[str, int],
    request: h11.Request,
    session: str,
    body: bytes,
    writer: asyncio.StreamWriter,
    conn: h11.Connection,
) -> Relayed:
    host, port = upstream
    try:
        up_reader, up_writer = await asyncio.wait_for(
            asyncio.open_connection(host, port), CONNECT_TIMEOUT_S
        )
    except (OSError, asyncio.TimeoutError) as exc:
        # a 502: the launcher's client retries it (SPEC §5)
        await answer(writer, conn, Refused("", f"the LLM proxy cannot be reached: {exc}"), 502)
        return Relayed(False)
    up = h11.Connection(h11.CLIENT)
    headers = [(n, v) for n, v in request.headers if n not in HOP_BY_HOP]
    headers += [(b"host", f"{host}:{port}".encode()), (b"connection", b"close")]
    headers.append((b"content-length", str(len(body)).encode()))
    target = "/v1/" + quote(session, safe="") + "/chat/completions"
    try:
        up_writer.write(up.send(h11.Request(method=b"POST", target=target, headers=headers)))
        up_writer.write(up.send(h11.Data(data=body)) + up.send(h11.EndOfMessage()))
        kept = await _answer_back(up, up_reader, writer, conn)
    except h11.RemoteProtocolError as exc:
        if conn.our_state is h11.SEND_RESPONSE:
            await answer(writer, conn, Refused("", f"the LLM proxy's answer: {exc}"), 502)
        return Relayed(False)
    finally:
        up_writer.close()
    return Relayed(True, weight_version(kept))


async def _answer_back(
    up: h11.Connection,
    up_reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    conn: h11.Connection,
) -> bytes | None:
    """Relay the proxy's answer; a copy of its body when it is a 200 of at most ANSWER_KEPT_BYTES
    (for its weight version), else None."""
    kept: bytearray | None = None
    while True:
        event = up.next_event()
        if event is h11.NEED_DATA:
            up.receive_data(await up_reader.read(65536))
            continue
        if isinstance(event, h11.InformationalResponse):
            continue  # (103 Early Hints: not for a model call's client; 100 was answered)
        if isinstance(event, h11.Response):
            headers = [
                (n, v) for n, v in event.headers if n not in HOP_BY_HOP - {b"content-length"}
            ]
            headers.append((b"connection", b"close"))  # one call per connection
            writer.write(conn.send(h11.Response(status_code=event.status_code, headers=headers)))
            kept = bytearray() if event.status_code == 200 else None
        elif isinstance(event, h11.Data):
            writer.write(conn.send(h11.Data(data=event.data)))
            if kept is not None:
                kept += event.data
                if len(kept) > ANSWER_KEPT_BYTES:
                    kept = None
        elif isinstance(event, h11.EndOfMessage):
            writer.write(conn.send(h11.EndOfMessage()))
            await writer.drain()
            return None if kept is None else bytes(kept)
        else:  # the proxy closed early: the client sees its answer cut, and retries
            raise ConnectionError("the LLM proxy closed the connection mid-answer")
        await writer.drain()


def weight_version(body: bytes | None) -> int | None:
    """The ``metadata.weight_version`` the proxy stamped on an answer (SPEC §2: what the launcher
    records in the row's ``env_state``); None when there is none, or it is not an integer."""
    if not body or b'"weight_version"' not in body:
        return None  # (a proxy that stamps none costs no parse)
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):  # (not JSON: a stream of events; or nested too deep)
        return None
    metadata = doc.get("metadata") if isinstance(doc, dict) else None
    version = metadata.get("weight_version") if isinstance(metadata, dict) else None
    return version if type(version) is int else None  # (a bool or a text is no version)


async def answer(
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
