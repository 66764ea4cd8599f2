"""The client's HTTP contract as steps, without doing any I/O: retries, redirects, request ids.

Every call is written once, as a generator that yields what it needs done (a :class:`Request`
to send, a :class:`Sleep` between retries, an :class:`Emit` of a group to the caller) and is
sent back each step's outcome. :class:`~rollout_buffer.client.BufferClient` runs the steps in
the caller's thread; :class:`~rollout_buffer.client.AsyncBufferClient` runs them on the event
loop, sending each request from a worker thread. So both clients retry, follow a standby and
long-poll by the very same code, and the state they share (which URL goes first) is only ever
changed by the steps, on one thread at a time per client.

Owns: the connection settings (:class:`Connection`), one attempt (:func:`once`: a standby's 307
followed, the answer classified), a call with retries (:func:`call`: backoff, Retry-After, the
next URL when one refuses the connection, the retry window) and the request_id of the last poll
given up on, which the client's next poll resumes. It must not import the service: HTTP only.
"""

from __future__ import annotations

import email.utils
import logging
import random
import threading
import time
import uuid
from collections.abc import Generator, Sequence
from typing import Any, Generic, NamedTuple, TypeVar
from urllib.parse import urljoin, urlsplit

import requests

logger = logging.getLogger("rollout_buffer.client")  # one logger for the whole client package

CONNECT_TIMEOUT_S = 5.0
# How long a call keeps retrying after its first failure: a restart or a takeover, with room to
# spare. The service keeps a batch answerable for its request_id twice as long, or more
# (ROLLOUT_BUFFER_REPLAY_RETENTION_SECONDS).
RETRY_WINDOW_S = 120.0
MAX_REDIRECTS = 5  # standby -> owner is one; more means a loop between misconfigured instances

R = TypeVar("R")


class BufferError(Exception):
    """The buffer answered with an error (HTTP 4xx) or could not be used.

    ``request_id`` is the poll's, for an error of a poll (None for the other calls)."""

    def __init__(
        self,
        message: str,
        status: int | None = None,
        body: Any = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.body = body
        self.request_id = request_id


class BufferUnavailable(BufferError):
    """The buffer could not be reached (connection errors, timeouts or 5xx) within the retry
    window. For a poll, ``request_id`` is the one given up on: the service may have served its
    batch. The same client's next poll resumes it by itself; another client resumes it with
    ``get_batch(request_id=...)``."""


class Request(NamedTuple):
    """Step: send this request (no redirect followed) and send back the response, or throw in
    the ``requests`` exception it raised."""

    method: str
    url: str
    body: dict[str, Any] | None
    read_timeout: float


class Sleep(NamedTuple):
    """Step: wait this many seconds (between retries, or between polls of an old server)."""

    seconds: float


class Emit(NamedTuple):
    """Step: hand this value to the caller of an iterator (a group of ``iter_groups``)."""

    value: Any


Step = Request | Sleep | Emit
Steps = Generator[Step, Any, R]


class Feed(Generic[R]):
    """Runs the steps of one call: :meth:`next` gives the next step to do (None once they are
    done, their result in :attr:`value`); the driver stores the step's outcome in
    :attr:`result` or :attr:`error` before asking for the next one."""

    def __init__(self, steps: Steps[R]) -> None:
        self.steps = steps
        self.result: Any = None
        self.error: BaseException | None = None
        self.value: R | None = None

    def next(self) -> Step | None:
        error, self.error = self.error, None
        result, self.result = self.result, None
        try:
            return self.steps.throw(error) if error is not None else self.steps.send(result)
        except StopIteration as stop:
            self.value = stop.value
            return None


class _Transient(Exception):
    """One attempt failed in a way that may succeed when retried."""

    def __init__(
        self,
        message: str,
        status: int | None = None,
        retry_after: float | None = None,
        sent: bool = True,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.retry_after = retry_after
        self.sent = sent  # False when the request surely never reached the server


def _retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date), or None."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when is None:
        return None
    return max(0.0, when.timestamp() - time.time())


def _error_message(resp: requests.Response) -> tuple[str, Any]:
    """The server's error message (JSON "error", then "message", "detail") and the parsed body."""
    try:
        body = resp.json()
    except ValueError:
        text = resp.text.strip()
        return (text[:500] or resp.reason or f"HTTP {resp.status_code}"), None
    if isinstance(body, dict):
        for key in ("error", "message", "detail"):
            if body.get(key):
                return str(body[key]), body
    return str(body)[:500], body


class Connection:
    """What both clients are built on: the instances' URLs, the token, timeouts and retries.

    :param url: base URL, e.g. ``http://127.0.0.1:18889``; or every instance's URL, as a list or
        separated by commas: the next is tried when one refuses the connection.
    :param token: bearer token (``ROLLOUT_BUFFER_TOKEN`` of the service), or None.
    :param timeout: read timeout of every call in seconds (the connect timeout is 5 s).
    :param retries: at most this many retries after the first attempt on connection errors,
        timeouts and 5xx; None (the default): as many as ``retry_window_s`` allows.
    :param backoff_s: first retry delay; doubled per retry, capped at ``backoff_max_s``.
    :param backoff_max_s: the largest delay between attempts (also caps ``Retry-After``).
    :param use_request_id: send a request_id with every poll (False for the original server).
    :param retry_window_s: a call retries for this long after its first failure (default 120 s:
        a restart or a takeover), then raises :class:`BufferUnavailable`; ``retries``, when given,
        ends it sooner.
    """

    def __init__(
        self,
        url: str | Sequence[str],
        token: str | None = None,
        *,
        timeout: float = 120.0,
        retries: int | None = None,
        backoff_s: float = 0.5,
        backoff_max_s: float = 10.0,
        use_request_id: bool = True,
        retry_window_s: float = RETRY_WINDOW_S,
    ) -> None:
        if retries is not None and (
            not isinstance(retries, int) or isinstance(retries, bool) or retries < 0
        ):
            raise ValueError(f"retries={retries!r}: expected None or an integer >= 0")
        if not 0 <= retry_window_s < float("inf"):
            raise ValueError(f"retry_window_s={retry_window_s!r}: expected seconds >= 0")
        urls = url.split(",") if isinstance(url, str) else list(url)
        self.urls = [u.strip().rstrip("/") for u in urls if u.strip()]
        self.exited_launcher: Any = None  # the exited launcher last warned about (once each)
        if not self.urls:
            raise ValueError(f"url={url!r}: expected a URL or a list of URLs")
        self._next = 0  # the URL tried first
        self._owner: str | None = None  # where a standby sent us last: tried first while it answers
        self.timeout = float(timeout)
        self.retries = None if retries is None else int(retries)
        self.retry_window_s = float(retry_window_s)
        # the request_ids of polls given up on (concurrent polls may give up at once), oldest
        # first: each next poll resumes one of them (one poll each, never two at once)
        self._resume: list[str] = []
        self._resume_lock = threading.Lock()
        self.backoff_s = float(backoff_s)
        self.backoff_max_s = float(backoff_max_s)
        self.use_request_id = use_request_id
        self.session = requests.Session()
        if token:
            self.session.headers["Authorization"] = f"Bearer {token}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.urls if len(self.urls) > 1 else self.urls[0]!r})"

    @property
    def url(self) -> str:
        """The base URL the next call goes to first (the owner, once a standby named it)."""
        return self._owner or self.urls[self._next]

    def request_id(self, given: str | None) -> tuple[str | None, bool]:
        """The request_id of a poll, and whether it resumes one by itself: ``given``; else the
        oldest of the polls given up on (taken: one poll resumes it, never two at once); else a
        fresh one (None without request ids)."""
        with self._resume_lock:
            if given is not None:
                if given in self._resume:
                    self._resume.remove(given)
                return given, False
            if not self.use_request_id:
                return None, False
            pending = self._resume.pop(0) if self._resume else None
        if pending is not None:
            logger.warning("resuming request_id %s: the poll given up on before", pending)
            return pending, True
        return uuid.uuid4().hex, False

    def given_up(self, request_id: str) -> None:
        """A poll ended without the service's answer (unreachable, cancelled): the next poll of
        this client resumes its request_id, and gets its batch if the service served one."""
        with self._resume_lock:
            if request_id not in self._resume:
                self._resume.append(request_id)

    def unreachable(self, base: str) -> None:
        """``base`` refused the connection: the next URL of the list goes first."""
        if base == self._owner:
            self._owner = None
        if base in self.urls:
            self._next = (self.urls.index(base) + 1) % len(self.urls)

    def send(self, request: Request) -> requests.Response:
        """Send one request as it is (redirects are the steps' business: requests would drop the
        Authorization header on a redirect to another host)."""
        return self.session.request(
            request.method,
            request.url,
            json=request.body,
            timeout=(CONNECT_TIMEOUT_S, request.read_timeout),
            allow_redirects=False,
        )

    def delay(self, attempt: int, retry_after: float | None) -> float:
        """Seconds before retry ``attempt`` (from 0): Retry-After when given, else backoff."""
        if retry_after is not None:
            return min(retry_after, self.backoff_max_s)
        base = min(self.backoff_max_s, self.backoff_s * (2**attempt))
        return base * (0.5 + random.random() / 2)  # jitter: trainers must not retry in lockstep


def once(
    conn: Connection, method: str, path: str, body: dict[str, Any] | None, read_timeout: float
) -> Steps[Any]:
    """One attempt: the parsed JSON body of a 2xx, BufferError for 4xx, _Transient otherwise
    (429, too many replays at once, is transient too: it says when to retry). A 307 from a
    standby is followed here, with the same method, body and headers (the token included)."""
    base = conn.url
    target = base + path
    for _hop in range(MAX_REDIRECTS + 1):
        try:
            resp = yield Request(method, target, body, read_timeout)
        except requests.exceptions.ConnectTimeout as exc:
            conn.unreachable(base)
            raise _Transient(f"connect timeout: {exc}", sent=False) from exc
        except (
            requests.exceptions.ConnectionError,
            requests.exceptions.ChunkedEncodingError,  # an answer cut off (the server killed)
        ) as exc:
            conn.unreachable(base)
            # a refused/unresolvable connection never reached the server; a reset may have
            sent = "NewConnectionError" not in repr(exc) and "refused" not in str(exc).lower()
            raise _Transient(f"connection error: {exc}", sent=sent) from exc
        except requests.exceptions.Timeout as exc:
            raise _Transient(f"read timeout after {read_timeout:g} s: {exc}") from exc
        if resp.status_code not in (307, 308):
            break
        location = urljoin(target, resp.headers.get("Location", ""))
        if urlsplit(location).scheme not in ("http", "https") or (
            urlsplit(target).scheme == "https" and urlsplit(location).scheme != "https"
        ):
            raise BufferError(
                f"{method} {path}: refusing a redirect from {target} to {location!r}",
                status=resp.status_code,
            )
        target = location
        base = location[: -len(path)] if location.endswith(path) else base
        conn._owner = base
    else:
        raise _Transient(
            f"redirected more than {MAX_REDIRECTS} times (instances that name each other as "
            "the owner?)",
            status=resp.status_code,
            retry_after=1.0,
        )
    if resp.status_code >= 500 or resp.status_code == 429:
        message, _ = _error_message(resp)
        raise _Transient(
            f"HTTP {resp.status_code}: {message}",
            status=resp.status_code,
            retry_after=_retry_after(resp.headers.get("Retry-After")),
        )
    if resp.status_code >= 400:
        message, parsed = _error_message(resp)
        raise BufferError(
            f"{method} {path} -> HTTP {resp.status_code}: {message}",
            status=resp.status_code,
            body=parsed if parsed is not None else resp.text,
        )
    try:
        return resp.json()
    except ValueError as exc:
        # a truncated body (connection cut mid-response) is transient; the retry replays it
        raise _Transient(
            f"HTTP {resp.status_code} with a body that is not JSON: {exc}",
            status=resp.status_code,
        ) from exc


def call(
    conn: Connection,
    method: str,
    path: str,
    body: dict[str, Any] | None = None,
    *,
    retry_if_sent: bool = True,
    retry_500: bool = True,
    wait_s: float = 0.0,
) -> Steps[Any]:
    """A call with retries. ``retry_if_sent=False``: retry only what surely did not take effect.

    ``retry_500=False``: an HTTP 500 (a deterministic server-side failure, such as a launcher
    that cannot be started) raises :class:`BufferError` at once instead of being retried.

    Retries go on for ``conn.retry_window_s`` after the first failure (the last wait is cut to
    end with it), or until ``conn.retries`` were made when it is set, whichever comes first.
    """
    last: _Transient | None = None
    first_failure: float | None = None
    attempt = 0
    while True:
        try:
            # a long-poll may take wait_s before its first byte; an instance that refuses the
            # connection is left for the next one at once (each once per attempt)
            for left in range(len(conn.urls) - 1, -1, -1):
                try:
                    return (yield from once(conn, method, path, body, conn.timeout + wait_s))
                except _Transient as exc:
                    if exc.sent or not left:
                        raise
        except _Transient as exc:
            last = exc
            if exc.status == 500 and not retry_500:
                raise BufferError(f"{method} {path} -> {exc.message}", status=500) from None
            retriable = retry_if_sent or not exc.sent or exc.status == 503
            now = time.monotonic()
            first_failure = now if first_failure is None else first_failure
            window_left = first_failure + conn.retry_window_s - now
            if not retriable or window_left <= 0 or attempt == conn.retries:
                break
            delay = min(conn.delay(attempt, exc.retry_after), window_left)
            attempt += 1
            logger.warning(
                "%s %s failed (%s); retry %d in %.2f s (%.0f s of the %g s retry window left)",
                method,
                path,
                exc.message,
                attempt,
                delay,
                window_left,
                conn.retry_window_s,
            )
            yield Sleep(delay)
    assert last is not None
    raise BufferUnavailable(
        f"{method} {conn.url}{path} failed after {attempt + 1} attempt(s) in "
        f"{time.monotonic() - (first_failure or time.monotonic()):.0f} s: {last.message}",
        status=last.status,
    )
