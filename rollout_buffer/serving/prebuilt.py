"""Responses built before the poll: one draft, built while ready groups wait and no poll runs.

The trainer polls, trains for seconds, and polls again; building a 256 MiB response costs about a
second of CPU on the poll's path. While ready groups wait and the serve lock is free, this thread
builds the next response (a :class:`~rollout_buffer.serving.draft.Draft`) for the shape the trainer
last asked for (before its first poll, ``{}``: what the upstream client sends). A poll of that shape
claims it and records it exactly as a draft built on its own path: the same checks (staleness is
checked again at the poll's versions), the same durable record before the first byte, the same
replay (the draft's seed is the batch's). A draft is not a decision: it is not recorded, and a kill
-9 loses nothing (its groups are read again).

Owns: the one draft (at most one, bounded by the response budget, shown in /stats), the last
shape, and the thread that builds and extends it. A new ready group extends the draft while it
has room; another shape, a moved version (a policy verdict), a new K or job, a redelivery or a
lost lease discards it (its groups go back to the front of their queues). It must not record or
send anything, and it takes the serve lock only without waiting (a poll is never kept behind it
for more than one build).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from rollout_buffer.core.config import Config
from rollout_buffer.core.errors import LeaseLost, StorageError
from rollout_buffer.core.model import Take
from rollout_buffer.runtime.jobs import Jobs
from rollout_buffer.runtime.locks import Locks
from rollout_buffer.runtime.signals import Signals
from rollout_buffer.serving.draft import Draft, Shape
from rollout_buffer.storage.db import Database
from rollout_buffer.storage.store import LazyPair

logger = logging.getLogger(__name__)


class Prebuilder:
    """The prebuilt draft, and the worker (of the runtime) that builds it."""

    name = "rollout-buffer-prebuild"
    IDLE_S = 0.05  # after an interrupt (stop_rollout, a role change): never spin
    YIELD_S = 0.01  # a poll runs or waits: it serves what is ready
    FAILED_S = 0.5  # after a failed build

    def __init__(
        self,
        config: Config,
        *,
        jobs: Jobs,
        signals: Signals,
        locks: Locks,
        fence: Callable[[Database], None] | None,
        failed: Callable[[Any, Take, Exception], bool],
        release: Callable[[Any, Any, list[Take]], None],
        ready: Callable[[], bool],
    ) -> None:
        self.config = config
        self.enabled = config.prebuild
        self.jobs, self.signals, self.locks, self._fence = jobs, signals, locks, fence
        self._failed, self._release, self._ready = failed, release, ready
        self.draft: Draft | None = None  # read and replaced only under the serve lock
        self.shape = Shape()  # the last poll's; before any, the upstream client's: {}
        self.counts = {"builds": 0, "claims": 0, "discards": 0}
        self.building = False  # set under the serve lock, read by polls without it
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self._conns: LazyPair | None = None  # the worker thread's own

    # -- under the serve lock (serving) ----------------------------------------------------------
    def claim(self, job_state: Any, shape: Shape, policy: Any) -> tuple[Draft | None, list[Take]]:
        """A poll takes the draft when it was built for this job and shape and the policies'
        verdicts hold at the job's version now; else the draft is discarded. Returns (the draft or
        None, the takes the caller must give back)."""
        self.shape = shape
        d, self.draft = self.draft, None
        if d is None:
            return None, []
        # in a version order a group that became ready since may come before the draft's: rebuild
        in_order = policy.serve_order == "ready" or not job_state.accumulator.snapshot.ready
        if (
            d.job_id == job_state.job_id
            and d.shape == shape
            and in_order
            and d.still_holds(job_state.accumulator, policy)
        ):
            self.counts["claims"] += 1
            return d, []
        self.counts["discards"] += 1
        return None, d.taken

    def discard(self) -> Draft | None:
        """Drop the draft (the caller releases its takes); counted."""
        d, self.draft = self.draft, None
        if d is not None:
            self.counts["discards"] += 1
        return d

    def forget(self) -> None:
        """(Serve lock held.) The job's state is gone: its draft goes with it, uncounted."""
        self.draft = None

    def groups(self, job_state: Any) -> int:
        """Groups the draft holds for this job, built or refused (a poll must come for them: they
        count as ready), and at least 1 while a build runs (its groups are neither ready nor in a
        draft yet)."""
        held = self.held(job_state)
        return 1 if held is None else held  # (while building: at least one, so a poll waits for it)

    def held(self, job_state: Any) -> int | None:
        """Groups the draft holds for this job (taken, waiting for a poll); None while a build runs:
        then every taken group is the builder's (no poll holds the serve lock meanwhile)."""
        d = self.draft
        if self.building:
            return None
        return (
            len(d.built) + len(d.refused) if d is not None and d.job_id == job_state.job_id else 0
        )

    def stats(self) -> dict[str, Any]:
        d = self.draft
        draft = (
            None
            if d is None
            else {
                "job_session": d.job_id,
                "groups": len(d.built),
                "refused": len(d.refused),
                "bytes": len(d.buf),
                "full": not d.room(),
                "max_groups": d.shape.max_groups,
                "build_s": round(d.built_s, 6),
            }
        )
        return {"enabled": self.enabled, "draft": draft, **self.counts}

    # -- the worker ------------------------------------------------------------------------------
    def _wanted(self) -> bool:
        """(Cheap, no lock.) Groups wait, and there is no draft or one that may be extended; or
        the draft holds a doomed group."""
        job_state, d = self.jobs.current, self.draft
        if job_state is not None and self._doomed(job_state, d):
            return True
        return (
            job_state is not None
            and job_state.ready_count() > 0  # (a version order is not extended: see claim)
            and (
                d is None
                or (
                    d.job_id == job_state.job_id and d.room() and self.config.serve_order == "ready"
                )
            )
        )

    @staticmethod
    def _doomed(job_state: Any, d: Draft | None) -> bool:
        """(Cheap, no lock: membership tests only.) The draft holds a group that a row with an
        implausible version came for since it was built: the draft is discarded and that group
        dropped now, not at the next poll, which may be long in coming."""
        doomed = job_state.accumulator.implausible
        return (
            bool(doomed)
            and d is not None
            and d.job_id == job_state.job_id
            and any(t.group_id in doomed for t in d.taken)
        )

    def tick(self) -> float:
        """Wait (holding no lock) for groups to build; build or extend the draft if no poll runs or
        waits; returns the wait before the next round."""
        self.signals.ready.wait(self._wanted, 1.0, self.stopping)
        if self.stopping.is_set() or not self._wanted() or not self._ready():
            return self.IDLE_S
        if self.locks.serve_waiters:
            return self.YIELD_S  # never keep a poll behind extension after extension
        with self.locks.try_serving() as taken:
            if not taken:
                return self.YIELD_S
            try:
                if self._conns is None:
                    self._conns = LazyPair(self.config, self._fence)
                self._build(self._conns)
            except Exception as exc:
                if isinstance(exc, (LeaseLost, StorageError)):
                    # a standby, or the database: polls say so
                    logger.debug("prebuild skipped: %s", exc)
                else:
                    logger.exception("building a response ahead of the poll failed")
                self.close()
                return self.FAILED_S
        return 0.0

    def close(self) -> None:
        """(The worker's thread.) Close its connections."""
        conns, self._conns = self._conns, None
        if conns is not None:
            conns.close()

    def _build(self, conns: LazyPair) -> None:
        """(Serve lock held.) Build or extend the draft for the last shape."""
        job_state, shape = self.jobs.current, self.shape
        if job_state is None or not self._wanted():
            return
        pair = conns.get()
        if self._doomed(job_state, self.draft):
            doomed = self.discard()
            assert doomed is not None
            self._release(pair, job_state, doomed.taken)  # the doomed group is dropped there
            if not self._wanted():
                return
        d = (
            self.draft
            if self.draft is not None
            else Draft(job_state.job_id, shape, self.config.max_response_bytes)
        )
        self.building = True  # (cleared only once the draft is in place: a poll never sees neither)
        try:
            d.build(
                pair,
                job_state,
                self.config.policy,
                self.config.max_group_bytes,
                lambda t, e: self._failed(job_state, t, e),
            )
            self._release(pair, job_state, d.give_back())
            self.draft = d if d.taken else None
            self.counts["builds"] += 1
        except BaseException:
            self.draft = None
            self._release(pair, job_state, d.taken)
            raise
        finally:
            self.building = False
