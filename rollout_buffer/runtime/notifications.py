"""Acting on decisions: record a plan, then hand it to the proxy notifier; the outbox in between.

Owns: the rule "record first, then notify", the outbox of plans whose recording failed (retried
by the loop before anything else is recorded, so a decision made in memory is always either in
the database or in this queue), turning a recorded plan into ``clear_sessions`` calls with
typed keys, and marking them delivered. It must not decide anything, and never calls the proxy
itself: :class:`~rollout_buffer.runtime.proxy.ProxyNotifier` does, on its own thread.
"""

from __future__ import annotations

import contextlib
import logging
import threading

from rollout_buffer.core.config import Config
from rollout_buffer.core.errors import StorageError
from rollout_buffer.core.logconfig import EventLog
from rollout_buffer.core.model import (
    INCOMPLETE_IN_SERVED,
    REJECTED,
    Decisions,
    GroupKey,
    NotifyKey,
    RowKey,
)
from rollout_buffer.runtime.proxy import ProxyNotifier
from rollout_buffer.storage.db import state_connection
from rollout_buffer.storage.store import Store

logger = logging.getLogger(__name__)


class Outbox:
    """Records plans and queues their notifications; keeps the plans it could not record yet."""

    def __init__(self, *, notifier: ProxyNotifier, config: Config) -> None:
        self.notifier = notifier
        self.config = config  # for the notifier thread's own short connection (on_delivered)
        self._lock = threading.Lock()
        self._queue: list[tuple[str, Decisions]] = []
        self.events = EventLog(logger)  # per kind of event: the first line, then a summary a minute

    def act(self, store: Store, job_id: str, plan: Decisions) -> None:
        """Record the plan, then notify. On a storage error the plan is queued and the error
        raised."""
        if not plan:
            return
        try:
            store.record(job_id, plan)
        except StorageError:
            with self._lock:
                self._queue.append((job_id, plan))
            raise
        self.notify(job_id, plan)

    def act_quietly(self, store: Store, job_id: str, plan: Decisions) -> None:
        """act(), where a failure only queues the plan (the loop records it on its next tick)."""
        with contextlib.suppress(StorageError):
            self.act(store, job_id, plan)

    def flush(self, store: Store) -> None:
        """Record the queued plans, oldest first; stops at the first failure (raised)."""
        with self._lock:
            pending, self._queue = self._queue, []
        for i, (job_id, plan) in enumerate(pending):
            try:
                store.record(job_id, plan)
            except StorageError:
                with self._lock:
                    self._queue[:0] = pending[i:]
                raise
            self.notify(job_id, plan)

    def empty(self) -> bool:
        with self._lock:
            return not self._queue

    def discard(self) -> int:
        """This instance lost the job: its unrecorded plans are forgotten (the new owner decides
        those groups again from the rows). Returns how many there were."""
        with self._lock:
            n, self._queue = len(self._queue), []
        return n

    def notify(self, job_id: str, plan: Decisions) -> None:
        """Hand a RECORDED plan's sessions to the notifier (and log it, once per kind of event)."""
        for s in plan.served:
            if s.take.incomplete:
                self.notifier.notify(
                    INCOMPLETE_IN_SERVED,
                    sorted(s.take.incomplete),
                    [s.group_id],
                    [GroupKey(job_id, s.group_id)],
                )
        for d in plan.drops:
            if d.clear_sessions:
                self.notifier.notify(
                    d.reason, d.clear_sessions, [d.group_id], [GroupKey(job_id, d.group_id)]
                )
            self.events.event(
                f"dropped group ({d.reason})",
                logging.INFO,
                "dropped group %s of job %s: %s (%d rows, %d sessions)",
                d.group_id,
                job_id,
                d.reason,
                len(d.pks),
                len(d.clear_sessions),
            )
        by_reason: dict[str, tuple[set[str], set[str], list[NotifyKey]]] = {}
        for r in plan.rows:
            if r.outcome == REJECTED:
                self.events.event(
                    f"rejected row ({r.reason})",
                    logging.WARNING,
                    "rejected row step_pk=%s of job %s (group %s): %s",
                    r.step_pk,
                    job_id,
                    r.group_id,
                    r.reason,
                )
            if r.session_id:
                sessions, groups, keys = by_reason.setdefault(r.reason, (set(), set(), []))
                sessions.add(r.session_id)
                if r.group_id:
                    groups.add(r.group_id)
                keys.append(RowKey(job_id, r.step_pk))
        for reason, (sessions, groups, keys) in by_reason.items():
            self.events.event(
                f"rows accounted as {reason}",
                logging.WARNING,
                "%d rows of job %s accounted as %s; clearing their %d sessions",
                len(keys),
                job_id,
                reason,
                len(sessions),
            )
            self.notifier.notify(reason, sessions, groups, keys)

    def resend_unnotified(self, store: Store) -> None:
        """At start: queue again every recorded decision the proxy has not confirmed."""
        for u in store.unnotified():
            self.notifier.notify(u.reason, u.sessions, u.group_ids, [u.key])

    def on_delivered(
        self, reason: str, session_ids: list[str], group_ids: list[str], keys: list[NotifyKey]
    ) -> None:
        """Notifier thread: the proxy cleared these sessions; remember it durably (best effort)."""
        try:
            with state_connection(self.config) as state:
                Store(state).mark_notified(keys)
        except StorageError as exc:
            logger.warning(
                "could not record a delivered clear_sessions (%s); it will be sent again after "
                "a restart, which is harmless",
                exc,
            )
