"""The training-data policies' decisions on one job's groups: when a group is ready, when it
cannot wait any longer, and what a change of K does.

Owns: the over-sampling choice of a group's K sessions, the refusal policies applied when a group
becomes ready (stale, zero variance: :meth:`~rollout_buffer.core.group.Group.refusal`), the TTL and
the minimum group size of a group that cannot complete, and re-deciding ready and pending groups
when K changes. It is a part of :class:`~rollout_buffer.core.accumulator.Accumulator`, on the same
state under the same lock, and like it does no I/O: it returns decisions.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from rollout_buffer.core.accounting import Counts
from rollout_buffer.core.census import Census
from rollout_buffer.core.group import Group, Undecided
from rollout_buffer.core.model import OVERSAMPLED, ROW_DROPPED, TTL, Decisions, Policy, RowEvent
from rollout_buffer.core.ready import ReadyQueue
from rollout_buffer.core.salvage import served_count
from rollout_buffer.core.versions import Versions


class Policies:
    """The accumulator's policy decisions. Every method either takes ``self.lock`` or says that
    its caller holds it."""

    # The accumulator's state these decisions read and change (set in Accumulator.__init__).
    k: int
    clock: Callable[[], float]
    policy: Policy
    lock: threading.Lock
    pending: OrderedDict[str, Group]
    ready: ReadyQueue
    counts: Counts
    session_group: dict[str, str]
    undecided: Undecided
    versions: Versions
    census: Census
    decided: dict[str, str]
    capped: set[str]

    if TYPE_CHECKING:
        # What the accumulator's other parts own.
        @property
        def current_version(self) -> int: ...

        def _drop(self, g: Group, reason: str, out: Decisions) -> None: ...

        def _undecided(self, gid: str | None) -> Group | None: ...

        def _tombstone(self, gid: str, reason: str, out: Decisions) -> None: ...

        def _salvage(self, g: Group | None, gid: str, reason: str, out: Decisions) -> bool: ...

        def _doom(self, group_ids: set[str], out: Decisions) -> None: ...

    def _became_ready(self, g: Group, out: Decisions) -> None:
        """(Lock held.) A group has K completed sessions, or is served short at the TTL: choose its
        sessions (over-sampling), apply the policies, and queue it or drop it."""
        self._choose(g, out)
        reason = None
        if self.policy.max_off_policy is not None:  # a version that cannot be true goes first
            served = g.chosen if g.chosen is not None else g.completed
            reason = self.versions.judge(g.group_id, [g.min_version(served)])
        reason = reason or g.refusal(self.policy, self.current_version)
        if reason is not None:
            self._drop(g, reason, out)
            return
        g.ready_at = self.clock()
        self.ready.push(g)
        self.census.publish(("ready", g.group_id))
        out.newly_ready += 1

    def _choose(self, g: Group, out: Decisions) -> None:
        """Over-sampling: a group with K completed sessions that has not chosen K yet (ready, ready
        short of K at the TTL, given back by a poll, or K lowered) keeps its first K; the rows of
        every other session are dropped as oversampled now (and so are their later rows)."""
        if (
            not self.policy.oversample
            or len(g.completed) < self.k
            or (g.chosen is not None and len(g.chosen) <= self.k)
        ):
            return
        for sid, pks in g.choose(self.k).items():
            if self.session_group.get(sid) == g.group_id:
                del self.session_group[sid]
            self.counts.pending_rows -= len(pks)
            self.counts.dropped[OVERSAMPLED] += len(pks)
            out.rows.extend(RowEvent(pk, ROW_DROPPED, OVERSAMPLED, g.group_id, sid) for pk in pks)
        self.undecided.min_pk_changed(g)

    # -- dropping -------------------------------------------------------------------------------
    def expire(self, ttl_s: float) -> Decisions:
        """Drop incomplete groups idle for ttl_s on the monotonic clock (oldest first, O(expired)).

        With a minimum group size, a group with at least that many completed sessions is made
        ready instead, to be served with only its completed sessions (``partial``)."""
        out = Decisions()
        if ttl_s <= 0:
            return out
        with self.lock:
            now = self.clock()
            while self.pending:
                g = next(iter(self.pending.values()))
                if now - g.last_seen < ttl_s:
                    break
                self._give_up(g, TTL, out)
        return out

    def drop_all(self, reason: str, *, include_ready: bool, partial: bool = False) -> Decisions:
        """Drop every incomplete group (and the ready ones when include_ready); with ``partial``
        (the launcher exited: they can never complete) those with the minimum group size are served
        short."""
        out = Decisions()
        with self.lock:
            for g in list(self.pending.values()):
                self._give_up(g, reason, out) if partial else self._drop(g, reason, out)
            if include_ready:
                for g in list(self.ready.values()):
                    self._drop(g, reason, out)
            # groups whose sessions all ended before any trainable row: only the census knew them
            for gid in list(self.census.group_sessions):
                if (
                    gid not in self.decided
                    and self._undecided(gid) is None
                    and not (partial and self._salvage(None, gid, reason, out))
                ):
                    self._tombstone(gid, reason, out)
        return out

    def _give_up(self, g: Group, reason: str, out: Decisions) -> None:
        """(Lock held.) An incomplete group that cannot wait any longer: ready short of K when it
        has the minimum group size (ROLLOUT_BUFFER_MIN_GROUP_SIZE), else dropped with ``reason``.

        A group that was ready under a smaller K (K raised since) is no exception: the trainer asked
        for the K in force, and a group short of it is never served but as a partial group.
        Salvage goes first: the minimum group size applies to groups it cannot salvage."""
        if self._salvage(g, g.group_id, reason, out):
            return
        if self.policy.serves(self.k, len(g.completed)):
            del self.pending[g.group_id]
            g.partial = True
            self._became_ready(g, out)
        else:
            self._drop(g, reason, out)

    # -- K -------------------------------------------------------------------------------------
    def set_k(self, k: int) -> tuple[int, Decisions]:
        """Change K; groups that now have K completed sessions become ready (or are dropped by a
        policy). Returns how many became ready, and the plan of what the policies decided."""
        with self.lock:
            self.k = k
            moved, out = False, Decisions()
            for gid, g in list(self.ready.items()):
                if (
                    served_count(g) < k
                ):  # K was raised: not ready any more (and open to more sessions)
                    del self.ready[gid]
                    self.pending[gid], g.chosen, moved = g, None, True
                    g.salvage = None  # short of the new K: salvaged again (or not) when it ends
                    self.census.publish(("started", gid))  # in progress again
                elif len(g.completed) > k:  # K was lowered: over-sampling keeps the first K
                    self._choose(g, out)
            if moved:  # expire() stops at the first live group: put them back in idle order (rare)
                self.pending = OrderedDict(
                    sorted(self.pending.items(), key=lambda kv: kv[1].last_seen)
                )
            for gid, g in list(self.pending.items()):
                if len(g.completed) >= k:
                    del self.pending[gid]
                    self._became_ready(g, out)
            self._doom(set(self.capped), out)  # salvage at the step cap under the new K
        return out.newly_ready, out
