"""Handing a job's ready groups to polls, and settling them once a poll's plan is recorded.

Owns: the take/commit protocol of :class:`~rollout_buffer.core.accumulator.Accumulator` with a poll:
ready groups taken in the serve order stay undecided until the poll's recorded plan settles them
(served or dropped), or the poll gives them back; rows that arrive while a group is taken become
its late rows. It works on the accumulator's state under the same lock, and like it does no I/O.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Container
from typing import TYPE_CHECKING

from rollout_buffer.core.accounting import Counts
from rollout_buffer.core.census import Census
from rollout_buffer.core.group import Group
from rollout_buffer.core.model import (
    DROPPED,
    IMPLAUSIBLE_VERSION,
    LATE_DROPPED,
    MALFORMED,
    PARTIAL,
    REJECTED,
    ROW_DROPPED,
    SERVED,
    Decisions,
    RowEvent,
    Take,
)
from rollout_buffer.core.ready import ReadyQueue
from rollout_buffer.core.salvage import late_reason, served_sessions, unread


class Handover:
    """The accumulator's side of a poll. Every public method takes ``self.lock``."""

    # The accumulator's state the handover reads and changes (set in Accumulator.__init__).
    k: int
    lock: threading.Lock
    changes: int
    pending: dict[str, Group]
    ready: ReadyQueue
    taken: dict[str, Group]
    decided: dict[str, str]
    tainted: set[str]
    tainted_groups: set[str]
    implausible: set[str]
    counts: Counts
    census: Census
    _late_served: str

    if TYPE_CHECKING:
        # Decisions the accumulator's other parts own.
        def _choose(self, g: Group, out: Decisions) -> None: ...

        def _drop(self, g: Group, reason: str, out: Decisions) -> None: ...

        def _forget(self, g: Group) -> None: ...

    def take_ready(self, max_groups: int | None) -> list[Take]:
        """Hand ready groups to a poll, first ready first; they stay undecided until
        commit/release."""
        takes: list[Take] = []
        with self.lock:
            self.changes += 1
            while self.ready and (max_groups is None or len(takes) < max_groups):
                g = self.ready.pop_next()
                gid = g.group_id
                completed, incomplete, salvage = served_sessions(g, self.k)  # (salvage: issue 38)
                if salvage is not None:
                    salvage = dataclasses.replace(salvage, generation_s=self.census.seconds_of(gid))
                g.taken = {sid: len(pks) for sid, pks in g.sessions.items()}
                self.taken[gid] = g
                takes.append(
                    Take(
                        gid,
                        completed,
                        incomplete,
                        g.rewards(),
                        g.partial and len(completed) < self.k,
                        g.ready_at,
                        g.min_version(completed),
                        salvage=salvage,
                    )
                )
        return takes

    def retake(self, takes: list[Take]) -> list[Take]:
        """Hand back exactly these earlier takes (released after a COMMIT that did happen after
        all), so commit() settles them with their original snapshot. Returns those still
        undecided."""
        found = []
        with self.lock:
            self.changes += 1
            for t in takes:
                g = self.ready.pop(t.group_id, None) or self.pending.pop(t.group_id, None)
                if g is None:
                    continue
                g.taken = {
                    sid: len(pks)
                    for sid, pks in list(t.completed.items()) + list(t.incomplete.items())
                }
                self.taken[t.group_id] = g
                found.append(t)
        return found

    def release(self, takes: list[Take]) -> Decisions:
        """Give taken groups back, at the front and in their order (the poll failed or ran out of
        budget).

        A group one of whose sessions wrote a row without group_id meanwhile is dropped instead
        (``malformed_row``), and so is one that got a row with an implausible version."""
        out = Decisions()
        with self.lock:
            for t in reversed(takes):
                g = self.taken.pop(t.group_id, None)
                if g is None:
                    continue
                g.taken = None
                if (
                    self.tainted and not self.tainted.isdisjoint(g.sessions)
                ) or t.group_id in self.tainted_groups:
                    self._drop(g, MALFORMED, out)
                    continue
                if t.group_id in self.implausible:
                    self._drop(g, IMPLAUSIBLE_VERSION, out)
                    continue
                self._choose(g, out)  # its other sessions may have completed while it was taken
                self.ready.put_front(g)  # first again, at its old place in a version order
        return out

    def commit(self, plan: Decisions) -> Decisions:
        """Apply a RECORDED serving plan to memory: its served groups become served and its drops
        (malformed groups) dropped, with their rejected rows counted; nothing is derived again.

        Only groups this accumulator still holds as taken are settled (a plan applied twice counts
        once). Rows added to a group while it was taken become late rows of the decided group:
        returns them, as a new plan for the caller to record.
        """
        out = Decisions()
        with self.lock:
            self.changes += 1
            settled: set[str] = set()
            for s in plan.served:
                g = self.taken.pop(s.group_id, None)
                if g is None:
                    continue
                settled.add(s.group_id)
                truncated = s.take.salvage.sessions if s.take.salvage is not None else {}
                self._settle(g, out, self._late_served, truncated)
                self.decided[s.group_id] = SERVED
                self.census.settle(s.group_id, SERVED)
                if s.take.salvage is not None:  # its truncated sessions' last rows are read now
                    self.counts.rows_read += s.take.extra_pks
                    self.counts.salvaged.served(s.take.salvage)
                self.counts.group_served(
                    len(s.take.served_pks),
                    len(s.take.incomplete_pks),
                    len(s.take.completed),
                    s.rewards,
                    s.take.partial,
                )
            for d in plan.drops:
                g = self.taken.pop(d.group_id, None)
                if g is None:
                    continue
                settled.add(d.group_id)
                self._settle(g, out, LATE_DROPPED)
                self.decided[d.group_id] = DROPPED
                self.census.settle(d.group_id, d.reason)
                if g.salvage is not None:  # refused when built: its last rows were read then
                    self.counts.rows_read += unread(g, d.group_id, d.pks, plan.rows)
                self.counts.group_dropped(d.reason, len(d.pks), len(d.clear_sessions), d.rewards)
            for r in plan.rows:
                if r.outcome == REJECTED and r.group_id in settled:
                    self.counts.rejected[r.reason] += 1
            if plan.batch is not None and plan.batch.meta:
                self.counts.batch_reported(plan.batch.meta.get("filtered"))
        return out

    def recheck(self, t: Take) -> Take | None:
        """A taken group about to be served from a draft built earlier: None when an unbuilt poll
        would serve it otherwise (its served sessions grew or another completed) or drop it (a
        session wrote a row without group_id, or a row with an implausible version came); else its
        take with the sessions that appeared or grew since as incomplete (cleared as incomplete in
        a served group, as at any poll, not as late rows)."""
        with self.lock:
            g = self.taken.get(t.group_id)
            if (
                g is None
                or g.taken is None
                or t.group_id in self.tainted_groups
                or t.group_id in self.implausible
                or not self.tainted.isdisjoint(g.sessions)
                or set(served_sessions(g, self.k)[0]) != set(t.completed)
                or any(len(g.sessions.get(sid, ())) != len(pks) for sid, pks in t.completed.items())
            ):
                return None
            incomplete = {
                sid: tuple(pks) for sid, pks in g.sessions.items() if sid not in t.completed
            }
            g.taken.update((sid, len(pks)) for sid, pks in incomplete.items())
            for sid in t.incomplete:  # (salvage: truncated sessions beyond K, without a row here)
                incomplete.setdefault(sid, ())
            return dataclasses.replace(t, incomplete=incomplete)

    def filtered_since_batch(self) -> dict[str, int]:
        """Groups dropped since the last served batch, by reason (meta_info.filtered)."""
        with self.lock:
            return dict(+self.counts.filtered)

    def settle_decided(
        self, takes: list[Take], decided: dict[str, tuple[str, str | None]]
    ) -> Decisions:
        """Taken groups that another instance already decided ({group_id: (status, reason)}, from
        its record in the store): take its word, count them as it decided, never serve them again.
        Returns the late rows (rows that arrived while taken) for the caller to record."""
        out = Decisions()
        with self.lock:
            self.changes += 1
            for t in takes:
                g = self.taken.pop(t.group_id, None)
                if g is None:
                    continue
                status, reason = decided[t.group_id]
                self._settle(g, out, self._late_served if status == SERVED else LATE_DROPPED)
                self.decided[t.group_id] = status
                self.census.publish(("decided", t.group_id, status == SERVED))
                self.counts.rows_read += t.extra_pks  # (a salvaged group's last rows, read)
                if status == SERVED:
                    self.counts.salvaged.load(reason, 1)  # (when its record says it was salvaged)
                    self.counts.group_served(
                        len(t.served_pks),
                        len(t.incomplete_pks),
                        len(t.completed),
                        t.rewards,
                        reason == PARTIAL,
                    )
                else:
                    self.counts.group_dropped(
                        reason or MALFORMED, len(t.all_pks), len(t.sessions), t.rewards
                    )
        return out

    def _settle(self, g: Group, out: Decisions, late: str, truncated: Container[str] = ()) -> None:
        """Remove a taken group from pending state; rows that arrived while taken become late
        rows: ``late``, or for a session served truncated (``truncated``), what
        :func:`~rollout_buffer.core.salvage.late_reason` says."""
        assert g.taken is not None
        self.counts.pending_rows -= g.n_rows
        self._forget(g)
        for sid, pks in g.sessions.items():
            extra = pks[g.taken.get(sid, 0) :]
            reason = late_reason(late, sid, truncated)
            for pk in extra:
                self.counts.dropped[reason] += 1
                out.rows.append(RowEvent(pk, ROW_DROPPED, reason, g.group_id, sid))
        g.taken = None
