"""ProxyNotifier: tells the LLM proxy to free the sessions of dropped groups, in the background.

``POST {base_url}/admin/clear_sessions`` with ``{"session_ids": [...], "reason": ..., "group_ids":
[...]}`` (SPEC §3). Callers only ever touch an in-memory pending map under a small lock; one named
daemon thread owns the ``requests.Session`` and does all network I/O, so a dead or hung proxy can
never slow down a poll (the original called it synchronously inside the poll, SPEC §7.6).

A proxy without the endpoint (404 or 405, ``proxy_answers``) is logged once, and from then on its
notifications are dropped (counted) instead of retried forever; other 4xx answers are tried
``rejected_tries`` times in a row, then their sessions are given up (counted as rejected).

Owns: the pending map of sessions to clear, coalescing and retries, and the one thread that calls
the proxy. It must not block a caller on the network, nor know about groups beyond their ids and
keys.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import requests

from rollout_buffer.core.errors import RolloutBufferError
from rollout_buffer.runtime.clear_sessions import (
    ABSENT,
    ABSENT_WARNING,
    CLEAR_PATH,
    DELIVERED,
    REJECTED,
    RETRY,
    Entry,
    merge_into,
    outcome,
    sessions_per_reason,
)
from rollout_buffer.runtime.threads import Runtime, StillRunning

logger = logging.getLogger(__name__)

#: Called after every session of one reason was acknowledged by the proxy:
#: ``on_delivered(reason, session_ids, group_ids, keys)``.
DeliveredCallback = Callable[[str, list[str], list[str], list[Any]], None]


class ProxyNotifierError(RolloutBufferError):
    """The proxy notifier cannot be started: its previous thread is still running."""


class ProxyNotifier:
    """Delivers clear_sessions notifications to the LLM proxy from one background thread (a worker
    of the service's runtime; used alone, ``start()`` and ``stop()`` run it in a runtime of its
    own).

    ``notify()`` never blocks on the network and never raises: it coalesces ids into a
    pending map and wakes the thread. The thread sends one POST per reason (split into
    requests of at most ``max_ids_per_request`` session ids), retries failures with
    exponential backoff, and calls ``on_delivered`` once every id of a reason was
    acknowledged, so the caller can mark its persisted records as delivered. What is
    still pending at ``stop()`` stays pending: the caller persisted it and re-sends it
    after a restart. With ``base_url=None`` notifications are disabled (one warning).
    """

    #: At most one failure WARNING per this many seconds while the proxy stays unreachable.
    WARN_INTERVAL_S = 60.0
    #: After a 404/405, notifications are dropped for this long; then the next one is sent again.
    ABSENT_RECHECK_S = 600.0
    #: How long the idle thread sleeps when nothing wakes it (a safety net, not a poll).
    IDLE_WAIT_S = 5.0

    def __init__(
        self,
        *,
        base_url: str | None,
        connect_timeout: float = 2.0,
        read_timeout: float = 10.0,
        backoff_s: float = 0.5,
        backoff_max_s: float = 30.0,
        on_delivered: DeliveredCallback | None = None,
        name: str = "rollout-buffer-proxy",
        max_ids_per_request: int = 5000,
        rejected_tries: int = 5,
    ) -> None:
        if max_ids_per_request < 1:
            raise ValueError(f"max_ids_per_request must be >= 1, got {max_ids_per_request!r}")
        self.base_url = base_url.rstrip("/") if base_url else None
        self.url = f"{self.base_url}{CLEAR_PATH}" if self.base_url else None
        self.connect_timeout = float(connect_timeout)
        self.read_timeout = float(read_timeout)
        self.backoff_s = float(backoff_s)
        self.backoff_max_s = float(backoff_max_s)
        self.on_delivered = on_delivered
        self.name = name
        self.max_ids_per_request = int(max_ids_per_request)
        # a 4xx other than 404/405 may be a proxy's passing mood or a request it will never take:
        # tried this many times in a row, then the request's sessions are given up
        self.rejected_tries = max(1, int(rejected_tries))

        self._lock = threading.Lock()  # guards _pending, _inflight and the counters below
        self._pending: dict[str, Entry] = {}
        self._inflight: dict[str, Entry] = {}  # taken by the thread, not yet acknowledged
        self._failures = 0
        self._delivered_calls = 0
        self._last_error: str | None = None
        # "unknown" until the proxy answers; "present" once it cleared something; "absent" after a
        # 404/405 (for the life of this process: its notifications are dropped from then on)
        self._clear_endpoint = "unknown"
        self._dropped_sessions = 0  # not sent: the proxy has no clear endpoint
        self._rejected_sessions = 0  # given up after rejected_tries 4xx answers in a row

        # Owned by the notifier thread only (no lock needed).
        self._fail_streak = 0
        self._last_answered: bool | None = None  # None: no attempt yet
        self._last_warn_at: float | None = None
        self._warned_since = 0  # failures since the last WARNING line
        self._rejected_streak = 0  # 4xx answers (other than 404/405) in a row
        self._recheck_at = 0.0  # (monotonic) when a proxy without the endpoint is asked again

        self.wake = threading.Event()  # a notify: send now (unless a backoff is running)
        self.stopping = threading.Event()  # set by the runtime on stop
        self._retry_at: float | None = None  # the end of the running backoff (monotonic)
        self._lifecycle = threading.Lock()  # serialises start()/stop() when used alone
        self._runtime: Runtime | None = None  # used alone: a runtime of its own
        self._session: requests.Session | None = None
        self._warned_disabled = False

    def deliver_to(self, on_delivered: DeliveredCallback) -> None:
        """Call ``on_delivered`` once every session of a reason was acknowledged (the outbox marks
        its records delivered); set once, before the thread starts."""
        self.on_delivered = on_delivered

    # ------------------------------------------------------------------ lifecycle

    @property
    def enabled(self) -> bool:
        """True when a proxy URL is configured."""
        return self.base_url is not None

    def start(self) -> None:
        """Used alone: start the notifier thread; idempotent. Starts nothing when no proxy is
        configured.

        A stopped notifier may be started again (pending ids are kept), unless its old
        thread is still stuck, which raises :class:`ProxyNotifierError`.
        """
        with self._lifecycle:
            if not self.enabled:
                return
            if self._runtime is None:
                self._runtime = Runtime()
                self._runtime.add(self)
            try:
                self._runtime.start(monitor=False)
            except StillRunning as exc:
                raise ProxyNotifierError(
                    f"cannot restart proxy notifier {self.name!r}: its previous thread is still "
                    "alive"
                ) from exc
            logger.info("proxy notifier started, url=%s", self.url)

    def stop(self, timeout: float = 5.0) -> None:
        """Used alone: stop the thread and close its session; idempotent. Pending ids stay
        pending."""
        with self._lifecycle:
            runtime = self._runtime
            if runtime is None or self.stopping.is_set():
                return
            runtime.stop_worker(self, timeout)
            session = self._session
            if session is not None:
                session.close()  # idempotent: a thread stuck in a POST gives up sooner
            self.log_stopped()

    def log_stopped(self) -> None:
        """Say what a stop leaves pending (re-sent after a restart)."""
        stats = self.pending()
        if stats["sessions"]:
            logger.info(
                "proxy notifier stopped with %d session(s) still pending (%s); "
                "they are re-sent after a restart",
                stats["sessions"],
                stats["reasons"],
            )
        else:
            logger.info("proxy notifier stopped")

    # ------------------------------------------------------------------ callers' side

    def notify(
        self,
        reason: str,
        session_ids: Iterable[str],
        group_ids: Iterable[str],
        keys: Iterable[Any] = (),
    ) -> None:
        """Queue sessions to be cleared at the proxy. Never blocks on the network, never raises.

        Repeated ids are stored once per reason. ``keys`` are opaque tokens handed back to
        ``on_delivered`` once the proxy acknowledged every session of the reason.
        """
        try:
            if not self.enabled:
                if not self._warned_disabled:
                    self._warned_disabled = True
                    logger.warning(
                        "no LLM proxy configured (LLM_PROXY_HOST unset): "
                        "clear_sessions notifications are disabled"
                    )
                return
            sessions = {str(s) for s in session_ids}
            groups = {str(g) for g in group_ids}
            keys = list(keys)
            if not sessions and not groups and not keys:
                return
            with self._lock:
                self._pending.setdefault(str(reason), Entry()).merge(sessions, groups, keys)
            self.wake.set()
        except Exception:  # a caller's bad argument must not break a poll
            logger.exception("proxy notify(%r) failed; notification not queued", reason)

    def pending(self) -> dict[str, Any]:
        """Counters for /health and stats: pending (including in-flight) sessions per reason."""
        with self._lock:
            reasons = sessions_per_reason(self._pending, self._inflight)
            return {
                "sessions": sum(reasons.values()),
                "reasons": reasons,
                "failures": self._failures,
                "delivered_calls": self._delivered_calls,
                "last_error": self._last_error,
                "enabled": self.enabled,
                "clear_endpoint": self._clear_endpoint,
                "dropped_sessions": self._dropped_sessions,
                "rejected_sessions": self._rejected_sessions,
            }

    # ------------------------------------------------------------------ the thread

    def tick(self) -> float:
        """(The notifier's thread.) Send everything pending; returns the wait before the next
        attempt: the backoff after a failure, else the idle wait. A notify during a backoff wakes
        the thread, which then waits out the rest of it: new ids never cut a backoff short."""
        now = time.monotonic()
        if self._retry_at is not None and now < self._retry_at:
            return self._retry_at - now
        # No urllib3 Retry: POST is not retried by it anyway, and this tick is the retry (with a
        # backoff that a stop interrupts).
        if self._session is None:
            self._session = requests.Session()
        delay: float | None
        try:
            delay = self._tick(self._session)
        except Exception:
            logger.exception("proxy notifier tick failed")
            delay = self._backoff_delay()
        if delay is None:
            self._retry_at = None
            return self.IDLE_WAIT_S
        self._retry_at = time.monotonic() + delay
        return delay

    def close(self) -> None:
        """(The notifier's thread, as it stops.) One final attempt, only if the proxy answered last
        time: a dead proxy must not delay shutdown. Anything left stays pending for the caller to
        re-send."""
        session, self._session = self._session, None
        if session is None:
            return
        try:
            if self._last_answered:
                try:
                    self._tick(session)
                except Exception:
                    logger.exception("proxy notifier final flush failed")
        finally:
            session.close()
        self._retry_at = None

    def _tick(self, session: requests.Session) -> float | None:
        """Send everything pending. Returns a backoff delay after a failure, else None. (The runtime
        clears ``wake`` before the tick: a notify from here on wakes the next wait.)"""
        with self._lock:
            if not self._pending:
                return None
            batch, self._pending = self._pending, {}
            self._inflight = batch
        try:
            for reason in sorted(batch):
                entry = batch[reason]
                all_ids = sorted(entry.sessions)
                groups = sorted(entry.groups)
                given_up = 0
                for start in range(0, max(len(all_ids), 1), self.max_ids_per_request):
                    chunk = all_ids[start : start + self.max_ids_per_request]
                    result = (
                        ABSENT
                        if self._clear_endpoint == ABSENT and time.monotonic() < self._recheck_at
                        else self._post(session, reason, chunk, groups)
                    )
                    if result == RETRY or (
                        result == REJECTED and self._rejected_streak < self.rejected_tries
                    ):
                        return self._backoff_delay()
                    if result == REJECTED:
                        given_up += len(chunk)
                        self._rejected_streak = 0
                    with self._lock:
                        entry.sessions.difference_update(chunk)
                        if result == ABSENT:
                            self._dropped_sessions += len(chunk)
                        elif result == REJECTED:
                            self._rejected_sessions += len(chunk)
                with self._lock:
                    del self._inflight[reason]
                if given_up:
                    # not marked delivered: the records stay unconfirmed, so a restart (after the
                    # proxy's configuration is fixed, say) sends them once more
                    logger.error(
                        "proxy rejected clear_sessions %d times in a row (%s): giving up %d "
                        "session(s) of reason=%s",
                        self.rejected_tries,
                        self._last_error,
                        given_up,
                        reason,
                    )
                    continue
                if self._clear_endpoint != ABSENT:
                    logger.info(
                        "proxy cleared %d session(s), %d group(s), reason=%s",
                        len(all_ids),
                        len(groups),
                        reason,
                    )
                # Absent: marked as handled too, so a restart does not send them to a proxy that
                # cannot take them, and the records do not pile up across jobs.
                if self.on_delivered is not None:
                    try:
                        self.on_delivered(reason, all_ids, groups, list(entry.keys))
                    except Exception:
                        logger.exception("proxy on_delivered callback failed for reason=%s", reason)
            return None
        finally:
            # Whatever was not acknowledged goes back to pending (merged with newer notifies).
            with self._lock:
                leftover, self._inflight = self._inflight, {}
                merge_into(self._pending, leftover)

    def _post(
        self, session: requests.Session, reason: str, session_ids: list[str], group_ids: list[str]
    ) -> str:
        """One POST; what it came to (``clear_sessions.outcome``). Records and logs (rate-limited)
        failures."""
        assert self.url is not None  # (the thread runs only with a proxy configured)
        body = {"session_ids": session_ids, "reason": reason, "group_ids": group_ids}
        status: int | None = None
        try:
            # A redirect is not the proxy clearing anything (an auth gateway's login page would
            # answer 200 to the GET it turns into): never followed, it is a failure and retried.
            resp = session.post(
                self.url,
                json=body,
                timeout=(self.connect_timeout, self.read_timeout),
                allow_redirects=False,
            )
            try:
                status = resp.status_code
            finally:
                resp.close()  # the body is ignored
            error = f"HTTP {status} from {self.url}"
        except requests.RequestException as exc:
            error = f"{type(exc).__name__}: {exc}"
        result = outcome(status)
        if result == DELIVERED:
            self._on_success()
        elif result == ABSENT:
            self._on_absent(status)
        else:
            if result == REJECTED:
                self._rejected_streak += 1
            self._on_failure(error, len(session_ids), reason)
        return result

    def _on_absent(self, status: int | None) -> None:
        """The proxy has no clear endpoint: said once, loudly; nothing is sent until the recheck (a
        404 may also come from a proxy being deployed behind its gateway)."""
        first = self._clear_endpoint != ABSENT
        with self._lock:
            self._clear_endpoint = ABSENT
            self._last_error = f"HTTP {status} from {self.url}: no clear_sessions endpoint"
        self._fail_streak = 0
        self._last_answered = True
        self._recheck_at = time.monotonic() + self.ABSENT_RECHECK_S
        if first:
            logger.warning(ABSENT_WARNING, status, self.url, self.ABSENT_RECHECK_S)

    def _on_success(self) -> None:
        self._rejected_streak = 0
        if self._clear_endpoint == ABSENT:
            logger.warning("the LLM proxy at %s clears sessions again", self.url)
        if self._fail_streak:
            logger.info(
                "proxy reachable again at %s after %d failed attempt(s)",
                self.url,
                self._fail_streak,
            )
        self._fail_streak = 0
        self._last_answered = True
        self._last_warn_at = None
        self._warned_since = 0
        with self._lock:
            self._delivered_calls += 1
            self._last_error = None
            self._clear_endpoint = "present"

    def _on_failure(self, error: str, n_sessions: int, reason: str) -> None:
        self._fail_streak += 1
        self._last_answered = False
        self._warned_since += 1
        with self._lock:
            self._failures += 1
            self._last_error = error
        now = time.monotonic()
        if self._last_warn_at is None or now - self._last_warn_at >= self.WARN_INTERVAL_S:
            logger.warning(
                "proxy clear_sessions failed (%d failure(s) since last report, %d in a row): "
                "%s; %d session(s) for reason=%s kept pending, retrying in %.1fs",
                self._warned_since,
                self._fail_streak,
                error,
                n_sessions,
                reason,
                self._peek_delay(),
            )
            self._last_warn_at = now
            self._warned_since = 0

    def _peek_delay(self) -> float:
        # The exponent is capped so a long outage cannot overflow the float.
        return min(
            self.backoff_s * (2 ** min(max(self._fail_streak - 1, 0), 30)), self.backoff_max_s
        )

    def _backoff_delay(self) -> float:
        """Delay before the next attempt: backoff_s doubling per consecutive failure, capped."""
        if self._fail_streak == 0:  # an unexpected exception rather than a failed POST
            self._fail_streak = 1
        return self._peek_delay()
