"""A trainer-side client for rollout-buffer (and for the original buffer server where features
overlap).

Typical use in a trainer::

    from rollout_buffer.client import BufferClient

    client = BufferClient("http://buffer-host:18889", token=os.environ.get("ROLLOUT_BUFFER_TOKEN"))
    client.start_rollout(num_repeat_per_sample=8)
    for group_id, items in client.iter_groups(n=64, poll_interval=3.0):
        train_on(items)

Delivery contract (SPEC §4, issue 4): every logical ``get_rollout_data`` call carries one fresh
``request_id`` (a uuid4 hex, never a counter) that is reused only for that call's retries. When a
response is lost in transit (connection reset, read timeout, 5xx), the retry with the same id gets
the same batch back (``meta_info.replayed: true``) instead of losing it. The original server has no
request_id: pass ``use_request_id=False`` to send none (delivery is then at-most-once).

Errors: a 4xx answer raises :class:`BufferError` (with ``.status`` and the server's message);
connection errors, timeouts and 5xx answers are retried with exponential backoff (honouring
``Retry-After``), and :class:`BufferUnavailable` is raised once the retries are exhausted.

Failover (issue 12): give it every instance's URL (a list, or one string with commas). A standby
answers 307 with the owner's URL: the client follows it itself (requests would drop the
Authorization header on a redirect to another host), with the same method, body and request_id,
and goes to the owner first from then on. A URL that refuses the connection is left for the next
one at once; a retried request_id is replayed by whichever instance owns the job by then.

Owns: the trainer's side of the HTTP contract (request_ids, retries, long-poll, following a
standby to the owner). It must not import the service or talk to a database: it speaks HTTP only.
"""

from __future__ import annotations

import email.utils
import logging
import random
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from urllib.parse import urljoin, urlsplit

import requests

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
MAX_REDIRECTS = 5  # standby -> owner is one; more means a loop between misconfigured instances


class BufferError(Exception):
    """The buffer answered with an error (HTTP 4xx) or could not be used."""

    def __init__(self, message: str, status: int | None = None, body: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.body = body


class BufferUnavailable(BufferError):
    """The buffer could not be reached (connection errors, timeouts or 5xx) after every retry."""


class _Transient(Exception):
    """Internal: one attempt failed in a way that may succeed when retried."""

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


class BufferClient:
    """HTTP client of one rollout-buffer service (its owner and standbys).

    :param url: base URL, e.g. ``http://127.0.0.1:18889``; or every instance's URL, as a list or
        separated by commas: the next is tried when one refuses the connection.
    :param token: bearer token (``ROLLOUT_BUFFER_TOKEN`` of the service), or None.
    :param timeout: read timeout of every call in seconds (the connect timeout is 5 s).
    :param retries: retries after the first attempt on connection errors, timeouts and 5xx (the
        default 8, with the default backoff, outlasts a takeover after the default 10 s lease).
    :param backoff_s: first retry delay; doubled per retry, capped at ``backoff_max_s``.
    :param backoff_max_s: the largest delay between attempts (also caps ``Retry-After``).
    :param use_request_id: send a request_id with every poll (False for the original server).
    """

    def __init__(
        self,
        url: str | Sequence[str],
        token: str | None = None,
        *,
        timeout: float = 120.0,
        retries: int = 8,
        backoff_s: float = 0.5,
        backoff_max_s: float = 10.0,
        use_request_id: bool = True,
    ) -> None:
        if retries < 0:
            raise ValueError(f"retries={retries!r}: expected an integer >= 0")
        urls = url.split(",") if isinstance(url, str) else list(url)
        self.urls = [u.strip().rstrip("/") for u in urls if u.strip()]
        if not self.urls:
            raise ValueError(f"url={url!r}: expected a URL or a list of URLs")
        self._next = 0  # the URL tried first
        self._owner: str | None = None  # where a standby sent us last: tried first while it answers
        self.timeout = float(timeout)
        self.retries = int(retries)
        self.backoff_s = float(backoff_s)
        self.backoff_max_s = float(backoff_max_s)
        self.use_request_id = use_request_id
        self._exited_launcher: Any = None  # the exited launcher last warned about (once each)
        self.session = requests.Session()
        if token:
            self.session.headers["Authorization"] = f"Bearer {token}"

    # -- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        """Close the HTTP session (its pooled connections)."""
        self.session.close()

    def __enter__(self) -> BufferClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"BufferClient({self.urls if len(self.urls) > 1 else self.urls[0]!r})"

    @property
    def url(self) -> str:
        """The base URL the next call goes to first (the owner, once a standby named it)."""
        return self._owner or self.urls[self._next]

    def _unreachable(self, base: str) -> None:
        """``base`` refused the connection: the next URL of the list goes first."""
        if base == self._owner:
            self._owner = None
        if base in self.urls:
            self._next = (self.urls.index(base) + 1) % len(self.urls)

    # -- plumbing
    # -------------------------------------------------------------------------------------
    def _once(
        self, method: str, path: str, body: dict[str, Any] | None, read_timeout: float
    ) -> Any:
        """One attempt: the parsed JSON body of a 2xx, BufferError for 4xx, _Transient otherwise
        (429, too many replays at once, is transient too: it says when to retry). A 307 from a
        standby is followed here, with the same method, body and headers (the token included)."""
        base = self.url
        target = base + path
        for _hop in range(MAX_REDIRECTS + 1):
            try:
                resp = self.session.request(
                    method,
                    target,
                    json=body,
                    timeout=(CONNECT_TIMEOUT_S, read_timeout),
                    allow_redirects=False,
                )
            except requests.exceptions.ConnectTimeout as exc:
                self._unreachable(base)
                raise _Transient(f"connect timeout: {exc}", sent=False) from exc
            except requests.exceptions.ConnectionError as exc:
                self._unreachable(base)
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
            self._owner = base
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

    def _delay(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            return min(retry_after, self.backoff_max_s)
        base = min(self.backoff_max_s, self.backoff_s * (2**attempt))
        return base * (
            0.5 + random.random() / 2
        )  # jitter: many trainers must not retry in lockstep

    def _call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        retry_if_sent: bool = True,
        retry_500: bool = True,
        wait_s: float = 0.0,
    ) -> Any:
        """Call with retries. ``retry_if_sent=False``: retry only what surely did not take effect.

        ``retry_500=False``: an HTTP 500 (a deterministic server-side failure, such as a launcher
        that cannot be started) raises :class:`BufferError` at once instead of being retried.
        """
        last: _Transient | None = None
        for attempt in range(self.retries + 1):
            try:
                # a long-poll may take wait_s before its first byte; an instance that refuses the
                # connection is left for the next one at once (each once per attempt)
                for left in range(len(self.urls) - 1, -1, -1):
                    try:
                        return self._once(method, path, body, self.timeout + wait_s)
                    except _Transient as exc:
                        if exc.sent or not left:
                            raise
            except _Transient as exc:
                last = exc
                if exc.status == 500 and not retry_500:
                    raise BufferError(f"{method} {path} -> {exc.message}", status=500) from None
                retriable = retry_if_sent or not exc.sent or exc.status == 503
                if not retriable or attempt == self.retries:
                    break
                delay = self._delay(attempt, exc.retry_after)
                logger.warning(
                    "%s %s failed (%s); retry %d/%d in %.2f s",
                    method,
                    path,
                    exc.message,
                    attempt + 1,
                    self.retries,
                    delay,
                )
                time.sleep(delay)
        assert last is not None
        raise BufferUnavailable(
            f"{method} {self.url}{path} failed after {attempt + 1} attempt(s): {last.message}",
            status=last.status,
        )

    # -- endpoints ---------------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        """GET /health (no token needed)."""
        return self._call("GET", "/health")

    def stats(self) -> dict[str, Any]:
        """GET /stats: per-job accounting, groups, cursor, lag, launcher state."""
        return self._call("GET", "/stats")

    def start_rollout(
        self,
        num_repeat_per_sample: int = 16,
        job_session: str | None = None,
        restart_training: bool = False,
        **extra: Any,
    ) -> dict[str, Any]:
        """POST /start_rollout: select the job (K sessions per group) and start its launcher.

        Without ``job_session`` the server picks a new job, so a retry after the request may have
        been processed could select yet another one: only failures that surely did not reach the
        server (and 503) are retried then. With ``job_session`` the call is idempotent and every
        transient failure is retried. An HTTP 500 (e.g. the launcher could not be started) is
        raised as :class:`BufferError` without retrying.
        """
        body: dict[str, Any] = dict(extra)
        body["num_repeat_per_sample"] = num_repeat_per_sample
        body["restart_training"] = restart_training
        if job_session is not None:
            body["job_session"] = job_session
        return self._call(
            "POST", "/start_rollout", body, retry_if_sent=job_session is not None, retry_500=False
        )

    def stop_rollout(self) -> dict[str, Any]:
        """POST /stop_rollout: stop the launcher (idempotent); ready groups stay servable."""
        return self._call("POST", "/stop_rollout", {})

    def get_rollout_data(
        self,
        max_groups: int | None = None,
        request_id: str | None = None,
        *,
        wait_s: float = 0.0,
        min_groups: int | None = None,
        current_weight_version: int | None = None,
        max_off_policy: int | None = None,
    ) -> dict[str, Any]:
        """POST /get_rollout_data; returns the raw response document.

        One logical call = one request_id (a fresh uuid4 hex unless given), reused for every retry,
        so a response lost in transit is replayed rather than lost. ``success`` is false (with
        "No data available to read") when no group is ready. With ``wait_s`` the server holds the
        poll until ``min_groups`` (default 1) groups are ready or ``wait_s`` has passed (long-poll).
        ``current_weight_version`` tells the service the trainer's version (the job keeps the last
        one sent) and ``max_off_policy`` overrides its staleness bound for this poll: groups with
        current - min(weight_version) > max_off_policy are dropped as ``stale``, never served.
        """
        body: dict[str, Any] = {}
        if max_groups is not None:
            body["max_groups"] = max_groups
        if current_weight_version is not None:
            body["current_weight_version"] = current_weight_version
        if max_off_policy is not None:
            body["max_off_policy"] = max_off_policy
        if wait_s:
            body["wait_s"] = wait_s
            if min_groups is not None:
                body["min_groups"] = min_groups
        if self.use_request_id:
            body["request_id"] = request_id or uuid.uuid4().hex
        elif request_id is not None:
            body["request_id"] = request_id
        doc = self._call("POST", "/get_rollout_data", body, wait_s=wait_s)
        self._warn_launcher_exited(doc)
        return doc

    def _warn_launcher_exited(self, doc: dict[str, Any]) -> None:
        """Once per launcher: the server says it has exited, so no new group will come."""
        data = doc.get("data")
        meta = data.get("meta_info") if isinstance(data, dict) else None
        launcher = meta.get("launcher") if isinstance(meta, dict) else None
        if not isinstance(meta, dict) or not isinstance(launcher, dict):
            return
        if launcher.get("state") != "exited":
            return
        seen = (meta.get("job_session"), launcher.get("pid"))
        if seen != self._exited_launcher:
            self._exited_launcher = seen
            logger.warning(
                "the launcher of job %s exited with code %s: no new groups will come until a "
                "/start_rollout starts another (its log: %s on the server)",
                seen[0],
                launcher.get("exit_code"),
                launcher.get("log_path"),
            )

    def iter_groups(
        self,
        n: int | None = None,
        *,
        max_groups: int | None = None,
        poll_interval: float = 3.0,
        timeout: float | None = None,
        wait_s: float = 30.0,
        current_weight_version: int | Callable[[], int | None] | None = None,
        max_off_policy: int | None = None,
    ) -> Iterator[tuple[str, list[dict[str, Any]]]]:
        """Yield complete groups as ``(group_id, items)`` in the order served.

        Items of a response are grouped by ``instance_id`` (order preserved). Each poll long-polls
        up to ``wait_s`` (0 for the original server, which does not know it); after an empty answer
        without long-poll it sleeps ``poll_interval``. Stops after ``n`` groups (never when None);
        raises TimeoutError when ``timeout`` seconds pass first. Each poll asks for at most the
        groups still wanted, so no group is taken from the server and not yielded; groups of a
        response the caller stops consuming midway are, however, marked served on the server. A
        group id is never yielded twice (a duplicate is logged and skipped).
        ``current_weight_version`` (a number, or a callable asked before every poll, as the
        trainer's version moves while it iterates) and ``max_off_policy`` are sent with every
        poll."""
        deadline = None if timeout is None else time.monotonic() + timeout
        seen: set[str] = set()
        yielded = 0
        while n is None or yielded < n:
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"iter_groups: {yielded} of {n if n is not None else 'unbounded'} groups "
                    f"after {timeout:g} s"
                )
            want = max_groups
            if n is not None:
                left = n - yielded
                want = left if want is None or want <= 0 else min(want, left)
            wait = (
                wait_s if deadline is None else min(wait_s, max(0.0, deadline - time.monotonic()))
            )
            asked = time.monotonic()
            version = (
                current_weight_version()
                if callable(current_weight_version)
                else current_weight_version
            )
            doc = self.get_rollout_data(
                max_groups=want,
                wait_s=wait,
                current_weight_version=version,
                max_off_policy=max_off_policy,
            )
            groups = groups_of(doc) if doc.get("success") else []
            # an empty answer well before wait_s: no long-poll there (the original server, or every
            # waiting slot taken), so pause as the original client does instead of spinning
            if (not groups and time.monotonic() - asked < wait / 2) or (not groups and wait <= 0):
                pause = poll_interval
                if deadline is not None:
                    pause = min(pause, max(0.0, deadline - time.monotonic()))
                time.sleep(pause)
                continue
            if not groups:
                continue
            for i, (gid, items) in enumerate(groups):
                if gid in seen:
                    logger.error(
                        "group %s was served twice; skipping the duplicate (%d items)",
                        gid,
                        len(items),
                    )
                    continue
                if n is not None and yielded >= n:
                    logger.warning(
                        "the server sent %d groups more than asked for; they are not yielded: %s",
                        len(groups) - i,
                        [g for g, _ in groups[i:]],
                    )
                    break
                seen.add(gid)
                yielded += 1
                yield gid, items


def groups_of(doc: dict[str, Any]) -> list[tuple[str, list[dict[str, Any]]]]:
    """The items of a /get_rollout_data answer grouped by instance_id, in order of first
    appearance."""
    data = doc.get("data") or {}
    items = data.get("data") if isinstance(data, dict) else None
    out: dict[str, list[dict[str, Any]]] = {}
    for item in items or []:
        gid = item.get("instance_id")
        if gid is None:
            gid = (item.get("extra_info") or {}).get("group_id")
        out.setdefault(str(gid), []).append(item)
    return list(out.items())
