"""In-memory grouping of one job's rows, under one lock, with no I/O.

Pending state holds metadata only: per group, per session, the primary keys of its rows and
whether the session has completed. Bodies (messages, response, rewards, ...) stay in the
database and are read when a group is served. Every method returns *decisions* (groups to
drop, rows to account one by one, groups to serve) for the caller to persist and act on after
the lock is released.

Accounting (SPEC §3), in distinct step_pks per job:
``read = served + dropped (by reason) + rejected (by reason) + pending``.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from typing import Callable, Iterable

from .model import (DROPPED, INCOMPLETE_IN_SERVED, INVALID_GROUP, LATE_DROPPED, LATE_SERVED, MALFORMED,
                    INVALID_SESSION, MISSING_GROUP, REJECTED, ROW_DROPPED, SERVED, TTL, BadText, Decisions, Drop, Row, RowEvent,
                    Take)

logger = logging.getLogger(__name__)


class Group:
    """One prompt group that is not decided yet."""

    __slots__ = ("group_id", "sessions", "completed", "n_rows", "last_seen", "first_seen", "min_pk",
                 "taken")

    def __init__(self, group_id: str, now: float) -> None:
        self.group_id = group_id
        self.sessions: dict[str, list[int]] = {}  # session -> its rows' pks (metadata only)
        self.completed: set[str] = set()          # sessions that wrote their completed row
        self.n_rows = 0
        self.last_seen = now
        self.first_seen = now
        self.min_pk: int | None = None
        self.taken: dict[str, int] | None = None  # session -> rows handed to the server

    def session_ids(self) -> list[str]:
        return sorted(self.sessions)

    def all_pks(self) -> list[int]:
        return sorted(pk for pks in self.sessions.values() for pk in pks)


class Accumulator:
    """Groups one job's rows until K sessions of a group have completed.

    All state is guarded by ``self.lock``; every public method takes it, and no method does I/O.
    """

    def __init__(self, job_id: str, k: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.job_id = job_id
        self.k = k
        self.clock = clock
        self.lock = threading.Lock()
        self.pending: OrderedDict[str, Group] = OrderedDict()  # incomplete, oldest activity first
        self.ready: OrderedDict[str, Group] = OrderedDict()    # ready, first ready first
        self.taken: dict[str, Group] = {}                      # handed to a poll, not yet decided
        self.decided: dict[str, str] = {}                      # group_id -> served | dropped
        self.tainted: set[str] = set()                         # sessions with a row lacking group_id
        self.tainted_groups: set[str] = set()                  # groups with a row lacking a session_id
        self.session_group: dict[str, str] = {}                # session -> its undecided group (O(1) lookups)
        self.changes = 0  # bumped on every mutation: lets the caller skip work when nothing changed
        self.rows_read = 0
        self.pending_rows = 0
        self.served_rows = 0
        self.dropped = Counter()
        self.rejected = Counter()
        self.groups_served = 0
        self.groups_dropped = Counter()

    # -- loading ----------------------------------------------------------------------------
    def load(self, decided: dict[str, str], rows_accounted: int, served_rows: int,
             dropped: dict[str, int], rejected: dict[str, int], groups_served: int,
             groups_dropped: dict[str, int]) -> None:
        """Restore decisions and counters after a restart (before any row is ingested)."""
        with self.lock:
            self.decided.update(decided)
            self.rows_read = rows_accounted
            self.served_rows = served_rows
            self.dropped.update(dropped)
            self.rejected.update(rejected)
            self.groups_served = groups_served
            self.groups_dropped.update(groups_dropped)

    # -- ingest -------------------------------------------------------------------------------
    def ingest(self, rows: Iterable[Row]) -> Decisions:
        """Add new rows (distinct step_pks, each seen once)."""
        out = Decisions()
        with self.lock:
            self.changes += 1
            now = self.clock()
            for pk, sid, gid, completed in rows:
                self.rows_read += 1
                if isinstance(gid, (int, float)) and not isinstance(gid, bool):
                    gid = str(gid)  # a number (an untyped column) names its group as its text does
                if not isinstance(sid, str) or isinstance(sid, BadText) or not sid:
                    self._reject_session(pk, gid, out)
                    continue
                if gid is None or gid == "" or not isinstance(gid, str) or isinstance(gid, BadText):
                    # no group, or one that is not text (undecodable, a BLOB): never served under a garbled id
                    reason = MISSING_GROUP if gid is None or gid == "" else INVALID_GROUP
                    self.rejected[reason] += 1
                    out.rows.append(RowEvent(pk, REJECTED, reason, None, sid))
                    self.tainted.add(sid)
                    other = self._undecided(self.session_group.get(sid))  # O(1): the session index
                    if other is not None and other.taken is None:
                        self._drop(other, MALFORMED, out)
                    continue
                gid = str(gid)
                status = self.decided.get(gid)
                if status is not None:
                    reason = LATE_SERVED if status == SERVED else LATE_DROPPED
                    self.dropped[reason] += 1
                    out.rows.append(RowEvent(pk, ROW_DROPPED, reason, gid, sid))
                    continue
                g = self.pending.get(gid)
                if g is None:
                    g = self.ready.get(gid) or self.taken.get(gid)
                    if g is None:
                        g = self.pending[gid] = Group(gid, now)
                else:
                    self.pending.move_to_end(gid)
                g.last_seen = now
                pks = g.sessions.get(sid)
                if pks is None:
                    g.sessions[sid] = [pk]
                    self.session_group[sid] = gid
                else:
                    pks.append(pk)
                g.n_rows += 1
                self.pending_rows += 1
                if g.min_pk is None or pk < g.min_pk:
                    g.min_pk = pk
                if completed:
                    g.completed.add(sid)
                if (sid in self.tainted or gid in self.tainted_groups) and g.taken is None:
                    self._drop(g, MALFORMED, out)
                    continue
                if len(g.completed) >= self.k and gid in self.pending:
                    del self.pending[gid]
                    self.ready[gid] = g
                    out.newly_ready += 1
        return out

    def _undecided(self, gid: str | None) -> Group | None:
        if gid is None:
            return None
        return self.pending.get(gid) or self.ready.get(gid) or self.taken.get(gid)

    def _reject_session(self, pk: int, gid: object, out: Decisions) -> None:
        """A row whose session_id is not text (a BLOB, NULL, a number, invalid UTF-8): it cannot be
        served nor cleared at the proxy. Its group can never be served whole: it is dropped now, or
        as soon as it appears, or (taken by a poll) when the poll gives it back."""
        self.rejected[INVALID_SESSION] += 1
        ok_gid = str(gid) if isinstance(gid, str) and gid and not isinstance(gid, BadText) else None
        out.rows.append(RowEvent(pk, REJECTED, INVALID_SESSION, ok_gid, None))
        if ok_gid is None or ok_gid in self.decided:
            return
        self.tainted_groups.add(ok_gid)
        g = self._undecided(ok_gid)
        if g is not None and g.taken is None:
            self._drop(g, MALFORMED, out)

    def _drop(self, g: Group, reason: str, out: Decisions) -> None:
        """Decide an undecided group as dropped (lock held). Never a taken group: its poll decides it."""
        gid = g.group_id
        assert g.taken is None, gid
        drop = Drop(gid, reason, g.all_pks(), g.session_ids())  # first: nothing is mutated if this fails
        self.changes += 1
        self.pending.pop(gid, None)
        self.ready.pop(gid, None)
        self.decided[gid] = DROPPED
        self.pending_rows -= g.n_rows
        self.dropped[reason] += g.n_rows
        self.groups_dropped[reason] += 1
        self._forget(g)
        out.drops.append(drop)

    def _forget(self, g: Group) -> None:
        """A group was decided: drop it from the session index (O(its sessions))."""
        for sid in g.sessions:
            if self.session_group.get(sid) == g.group_id:
                del self.session_group[sid]
        self.tainted_groups.discard(g.group_id)

    # -- dropping -------------------------------------------------------------------------------
    def expire(self, ttl_s: float) -> Decisions:
        """Drop incomplete groups idle for ttl_s on the monotonic clock (oldest first, O(expired))."""
        out = Decisions()
        if ttl_s <= 0:
            return out
        with self.lock:
            now = self.clock()
            while self.pending:
                gid, g = next(iter(self.pending.items()))
                if now - g.last_seen < ttl_s:
                    break
                self._drop(g, TTL, out)
        return out

    def drop_all(self, reason: str, *, include_ready: bool) -> Decisions:
        """Drop every incomplete group (and the ready ones when include_ready)."""
        out = Decisions()
        with self.lock:
            for g in list(self.pending.values()):
                self._drop(g, reason, out)
            if include_ready:
                for g in list(self.ready.values()):
                    self._drop(g, reason, out)
        return out

    # -- serving ----------------------------------------------------------------------------------
    def take_ready(self, max_groups: int | None) -> list[Take]:
        """Hand ready groups to a poll, first ready first; they stay undecided until commit/release."""
        takes: list[Take] = []
        with self.lock:
            self.changes += 1
            while self.ready and (max_groups is None or len(takes) < max_groups):
                gid, g = self.ready.popitem(last=False)
                completed, incomplete = {}, {}
                for sid, pks in g.sessions.items():
                    (completed if sid in g.completed else incomplete)[sid] = tuple(pks)
                g.taken = {sid: len(pks) for sid, pks in g.sessions.items()}
                self.taken[gid] = g
                takes.append(Take(gid, completed, incomplete))
        return takes

    def retake(self, takes: list[Take]) -> list[Take]:
        """Hand back exactly these earlier takes (released after a COMMIT that did happen after all),
        so commit() settles them with their original snapshot. Returns those still undecided."""
        found = []
        with self.lock:
            self.changes += 1
            for t in takes:
                g = self.ready.pop(t.group_id, None) or self.pending.pop(t.group_id, None)
                if g is None:
                    continue
                g.taken = {sid: len(pks) for sid, pks in list(t.completed.items()) + list(t.incomplete.items())}
                self.taken[t.group_id] = g
                found.append(t)
        return found

    def release(self, takes: list[Take]) -> Decisions:
        """Give taken groups back, at the front and in their order (the poll failed or ran out of budget).

        A group one of whose sessions wrote a row without group_id meanwhile is dropped instead."""
        out = Decisions()
        with self.lock:
            for t in reversed(takes):
                g = self.taken.pop(t.group_id, None)
                if g is None:
                    continue
                g.taken = None
                if (self.tainted and not self.tainted.isdisjoint(g.sessions)) or t.group_id in self.tainted_groups:
                    self._drop(g, MALFORMED, out)
                    continue
                self.ready[t.group_id] = g
                self.ready.move_to_end(t.group_id, last=False)
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
                self._settle(g, out, LATE_SERVED)
                self.decided[s.group_id] = SERVED
                self.groups_served += 1
                self.served_rows += len(s.take.served_pks)
                n_inc = len(s.take.incomplete_pks)
                if n_inc:
                    self.dropped[INCOMPLETE_IN_SERVED] += n_inc
            for d in plan.drops:
                g = self.taken.pop(d.group_id, None)
                if g is None:
                    continue
                settled.add(d.group_id)
                self._settle(g, out, LATE_DROPPED)
                self.decided[d.group_id] = DROPPED
                self.groups_dropped[d.reason] += 1
                self.dropped[d.reason] += len(d.pks)
            for r in plan.rows:
                if r.outcome == REJECTED and r.group_id in settled:
                    self.rejected[r.reason] += 1
        return out

    def settle_decided(self, takes: list[Take], decided: dict[str, tuple[str, str | None]]) -> Decisions:
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
                self._settle(g, out, LATE_SERVED if status == SERVED else LATE_DROPPED)
                self.decided[t.group_id] = status
                if status == SERVED:
                    self.groups_served += 1
                    self.served_rows += len(t.served_pks)
                    self.dropped[INCOMPLETE_IN_SERVED] += len(t.incomplete_pks)
                else:
                    self.groups_dropped[reason or MALFORMED] += 1
                    self.dropped[reason or MALFORMED] += len(t.all_pks)
        return out

    def _settle(self, g: Group, out: Decisions, late_reason: str) -> None:
        """Remove a taken group from pending state; rows that arrived while taken become late rows."""
        assert g.taken is not None
        self.pending_rows -= g.n_rows
        self._forget(g)
        for sid, pks in g.sessions.items():
            extra = pks[g.taken.get(sid, 0):]
            for pk in extra:
                self.dropped[late_reason] += 1
                out.rows.append(RowEvent(pk, ROW_DROPPED, late_reason, g.group_id, sid))
        g.taken = None

    # -- reading -------------------------------------------------------------------------------
    def set_k(self, k: int) -> int:
        """Change K; groups that now have K completed sessions become ready. Returns how many."""
        n = 0
        with self.lock:
            self.k = k
            moved = False
            for gid, g in list(self.ready.items()):
                if len(g.completed) < k:  # K was raised: not ready any more
                    del self.ready[gid]
                    self.pending[gid] = g
                    moved = True
            if moved:
                # expire() walks pending oldest activity first and stops at the first live group:
                # groups put back must take their place by idle time, not at the end (rare: K changed)
                self.pending = OrderedDict(sorted(self.pending.items(), key=lambda kv: kv[1].last_seen))
            for gid, g in list(self.pending.items()):
                if len(g.completed) >= k:
                    del self.pending[gid]
                    self.ready[gid] = g
                    n += 1
        return n

    def has_ready(self) -> bool:
        """True when a poll would get data (no lock needed for a racy peek, but take it anyway)."""
        with self.lock:
            return bool(self.ready)

    def low_water(self, cursor: int) -> int:
        """Smallest pk that is still pending (rows below it are all accounted), or cursor + 1."""
        with self.lock:
            mins = [g.min_pk for d in (self.pending, self.ready, self.taken) for g in d.values()
                    if g.min_pk is not None]
        return min(mins) if mins else cursor + 1

    def stats(self) -> dict:
        """Counters and gauges; the accounting identity holds in them."""
        with self.lock:
            now = self.clock()
            oldest = min((g.first_seen for d in (self.pending, self.ready, self.taken) for g in d.values()),
                         default=None)
            return {
                "job_id": self.job_id,
                "k": self.k,
                "rows": {
                    "read": self.rows_read,
                    "served": self.served_rows,
                    "dropped": dict(self.dropped),
                    "dropped_total": sum(self.dropped.values()),
                    "rejected": dict(self.rejected),
                    "rejected_total": sum(self.rejected.values()),
                    "pending": self.pending_rows,
                },
                "groups": {
                    "pending": len(self.pending),
                    "ready": len(self.ready),
                    "in_flight": len(self.taken),
                    "served": self.groups_served,
                    "dropped": dict(self.groups_dropped),
                    "dropped_total": sum(self.groups_dropped.values()),
                },
                "oldest_pending_group_age_s": None if oldest is None else round(now - oldest, 3),
            }
