"""In-memory grouping of one job's rows, under one lock, with no I/O.

Owns: the undecided groups of one job (pending, ready in the serve order, taken by a poll), the
tombstones of decided ones, ingesting rows into them, and the job's counters
(:mod:`~rollout_buffer.core.accounting`). Two parts work on the same state under the same lock:
the policies' decisions when a group becomes ready or cannot wait
(:mod:`~rollout_buffer.core.policies`), and handing ready groups to polls and settling them
(:mod:`~rollout_buffer.core.handover`). Pending state holds metadata only (see
:mod:`~rollout_buffer.core.group`); bodies stay in the database until served. Every method returns
*decisions* (a plan: drops, rows accounted one by one, groups ready) for the caller to record and
act on after the lock is released; it must not touch the database, the proxy or the clock beyond
its own monotonic one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

from rollout_buffer.core.accounting import Counts
from rollout_buffer.core.census import SESSION_WITHOUT_RESULT, Census, StepFact, ignore
from rollout_buffer.core.group import Group, Undecided
from rollout_buffer.core.handover import Handover
from rollout_buffer.core.model import (
    DROPPED,
    IMPLAUSIBLE_VERSION,
    INVALID_GROUP,
    INVALID_SESSION,
    LATE_DROPPED,
    LATE_SERVED,
    MALFORMED,
    MISSING_GROUP,
    OVERSAMPLED,
    REJECTED,
    ROW_DROPPED,
    SERVED,
    STEP_CAP,
    BadText,
    Decisions,
    Drop,
    Policy,
    Row,
    RowEvent,
    Salvage,
)
from rollout_buffer.core.policies import Policies
from rollout_buffer.core.ready import ReadyQueue
from rollout_buffer.core.salvage import TRUNCATE, late_reason, truncation
from rollout_buffer.core.versions import Versions

logger = logging.getLogger(__name__)


class Accumulator(Handover, Policies):
    """Groups one job's rows until K sessions of a group have completed.

    All state is guarded by ``self.lock``; every public method takes it, and no method does I/O.
    """

    def __init__(
        self,
        job_id: str,
        k: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        policy: Policy | None = None,
        max_steps: int | None = None,
        changes: Callable[[tuple[Any, ...]], None] = ignore,
    ) -> None:
        self.job_id = job_id
        # what followers (pacing) learn without the lock: each change, published under the lock
        # at a cost that does not grow with the job (see :meth:`publish`)
        self.feed = changes
        self._rows_version: int | None = None  # the newest weight version of a row, published
        self.k = k
        self.clock = clock
        self.policy = policy or Policy()
        self.lock = threading.Lock()
        self.pending: OrderedDict[str, Group] = OrderedDict()  # incomplete, oldest activity first
        self.ready = ReadyQueue(self.policy.serve_order)  # ready, in the serve order
        self._track_wv = (
            self.policy.max_off_policy is not None or self.policy.serve_order != "ready"
        )
        # with over-sampling, a served group's late rows are its other sessions' (a served session
        # writes nothing after its completed row), whether they come while it is built or after
        self._late_served = OVERSAMPLED if self.policy.oversample else LATE_SERVED
        self.versions = Versions(self.policy.max_version_jump)  # no single row moves the current
        self.counts = Counts()
        self.taken: dict[str, Group] = {}  # handed to a poll, not yet decided
        self.decided: dict[str, str] = {}  # group_id -> served | dropped
        self.tainted: set[str] = set()  # sessions with a row lacking group_id
        self.tainted_groups: set[str] = set()  # groups with a row lacking a session_id
        # taken groups (a poll's or the prebuilt draft's) a row with an implausible version came
        # for: dropped when given back, never served from a draft built before it came
        self.implausible: set[str] = set()
        self.session_group: dict[str, str] = {}  # session -> its undecided group (O(1) lookups)
        self.excluded: dict[
            str, set[str]
        ] = {}  # group -> sessions dropped as oversampled before a restart
        self.undecided = (
            Undecided()
        )  # every undecided group: the oldest and the low-water mark in O(log n)
        # salvage: undecided groups with a session at the step cap, waiting for their other sessions
        self.capped: set[str] = set()
        self.changes = 0  # bumped on every mutation: lets the caller skip work when nothing changed
        # every session of the job, those without a trainable row too (max_steps: the launcher's)
        self.census = Census(max_steps, self.publish, self.decided)
        self.publish(("job",))

    def publish(self, event: tuple[Any, ...]) -> None:
        """(Lock held, or in the constructor.) Tell the followers of one change, with the job it
        is of: ``("job",)`` (a new accumulator), ``("listed", session, group, place)``,
        ``("started", group)`` (its first row, or ready no more), ``("ready", group)``,
        ``("decided", group, served)`` (served: to the trainer, else dropped), ``("finished",
        session)`` (its terminal row), ``("version", v)`` (the newest plausible weight version of
        a row, once a current version is known), ``("ended",)`` (another job replaces it)."""
        self.feed((self.job_id, *event))

    def _shown(self, version: int) -> bool:
        """(Lock held.) A row version followers may count the trainer's steps by: one the version
        rule finds plausible once a current version is known (a bogus version, such as a
        timestamp, never moves them; before a current version is known, any could be one)."""
        return self.versions.known and self.versions.plausible(version)

    def end(self) -> None:
        """Another job replaces this one: followers forget it (``("ended",)``) before its groups
        are dropped, so that their drops start none of its held sessions."""
        with self.lock:
            self.publish(("ended",))

    def restore_decided(self, decided: dict[str, str]) -> None:
        """The groups decided before a restart (before the accumulator is shared: no lock): their
        late rows are late, and followers learn them (not as served now: the trainer's
        holdings start again with this instance)."""
        self.decided.update(decided)
        for group_id in decided:
            self.publish(("decided", group_id, False))

    # -- versions ---------------------------------------------------------------------------------
    @property
    def current_version(self) -> int:
        """The job's current version (:mod:`~rollout_buffer.core.versions` owns the rule)."""
        return self.versions.current

    @property
    def known_version(self) -> int | None:
        """The current version once one is known (reported by the trainer, agreed on by two
        complete groups, or restored), else None."""
        return self.versions.current if self.versions.known else None

    @property
    def trainer_version(self) -> int | None:
        return self.versions.trainer

    @property
    def rows_version(self) -> int:
        return self.versions.rows

    def set_versions(self, trainer: int | None = None, rows: int | None = None) -> None:
        """A poll's current_weight_version (the last one wins); with ``rows``, the stored ones
        after a restart."""
        if rows is None and trainer is not None:
            self.versions.report(trainer)
        else:
            self.versions.restore(trainer, rows)

    # -- ingest -------------------------------------------------------------------------------
    def ingest(self, rows: Iterable[Row]) -> Decisions:
        """Add new rows (distinct step_pks, each seen once)."""
        out = Decisions()
        rows = rows if isinstance(rows, list) else list(rows)
        with self.lock:
            self.changes += 1
            now = self.clock()
            track_wv, k = self._track_wv, self.k
            # with a staleness bound, a row version the version rule refuses dooms its group now,
            # complete or not (issue 35): not only when it completes, which it may never do
            plausible = self.versions.plausible if self.policy.max_off_policy is not None else None
            # the census first: a group decided in this batch is settled with these rows' figures
            facts = (StepFact(r[1], r[2], r[4] if len(r) > 4 else None, bool(r[3])) for r in rows)
            doomed = self.census.observe(facts, trainable=True, now=now)
            ended: set[str] = set()  # groups a session of which completed in this batch
            for r in rows:
                pk, sid, gid, completed = r[0], r[1], r[2], r[3]
                step_id, reward, version = (r[4], r[5], r[6]) if len(r) > 4 else (None, None, 0)
                self.counts.rows_read += 1
                if isinstance(gid, (int, float)) and not isinstance(gid, bool):
                    gid = str(gid)  # a number (an untyped column) names its group as its text does
                if not isinstance(sid, str) or isinstance(sid, BadText) or not sid:
                    self._reject_session(pk, gid, out)
                    continue
                if gid is None or gid == "" or not isinstance(gid, str) or isinstance(gid, BadText):
                    self._reject_group(pk, sid, gid, out)
                    continue
                gid = str(gid)
                status = self.decided.get(gid)
                if status is not None:
                    reason = (
                        late_reason(self._late_served, sid, self.counts.salvaged.truncated)
                        if status == SERVED
                        else LATE_DROPPED
                    )
                    self.counts.dropped[reason] += 1
                    out.rows.append(RowEvent(pk, ROW_DROPPED, reason, gid, sid))
                    continue
                g = self._group_for(gid, now)
                if (g.chosen is not None and sid not in g.chosen) or (
                    g.excluded is not None and sid in g.excluded
                ):
                    g.exclude(
                        sid
                    )  # a session beyond the K it serves: never served, even if K changes
                    self.counts.dropped[OVERSAMPLED] += 1
                    out.rows.append(RowEvent(pk, ROW_DROPPED, OVERSAMPLED, gid, sid))
                    continue
                self._add_row(g, sid, pk, version, track_wv)
                if plausible is not None and version is not None and not plausible(version):
                    if g.taken is None:
                        self._drop(g, IMPLAUSIBLE_VERSION, out)
                        continue
                    self.implausible.add(gid)
                if completed:
                    self._completed_row(g, sid, pk, step_id, reward)
                    ended.add(gid)
                if (sid in self.tainted or gid in self.tainted_groups) and g.taken is None:
                    self._drop(g, MALFORMED, out)
                    continue
                if len(g.completed) >= k:
                    if gid in self.pending:
                        del self.pending[gid]
                        self._became_ready(g, out)
                    elif g.taken is None:
                        self._choose(
                            g, out
                        )  # ready short of K at the TTL, it reached K while it waited
            # a group at the step cap waiting for its other sessions: only a cap (doomed) or a
            # completed session changes what salvage decides, never checked for every batch
            self._doom(doomed | (self.capped & ended), out)
            self._publish_version(rows)
        return out

    def _publish_version(self, rows: list[Row]) -> None:
        """(Lock held.) Tell followers of the newest version of these rows, if it is newer and
        plausible (:meth:`_shown`)."""
        newest = max(
            (r[6] for r in rows if len(r) > 6 and type(r[6]) is int and self._shown(r[6])),
            default=None,
        )  # (a bool or a text is no version)
        if newest is not None and (self._rows_version is None or newest > self._rows_version):
            self._rows_version = newest
            self.publish(("version", newest))

    @staticmethod
    def _completed_row(
        g: Group, sid: str, pk: int, step_id: int | None, reward: float | None
    ) -> None:
        """(Lock held.) A completed row of session ``sid``: its first completing pk, and its
        terminal reward, which is the last completed row's (SPEC §3)."""
        c = g.completed.get(sid)
        term = (step_id if step_id is not None else -1, pk)
        if c is None:
            g.completed[sid] = (pk, term, reward)
        elif term > c[1]:
            g.completed[sid] = (min(pk, c[0]), term, reward)

    def _add_row(self, g: Group, sid: str, pk: int, version: int | None, track_wv: bool) -> None:
        """(Lock held.) Index a row of session ``sid`` in its group: metadata only."""
        pks = g.sessions.get(sid)
        if pks is None:
            g.sessions[sid] = [pk]
            self.session_group[sid] = g.group_id
        else:
            pks.append(pk)
        g.n_rows += 1
        self.counts.pending_rows += 1
        if g.min_pk is None or pk < g.min_pk:
            g.min_pk = pk
            self.undecided.min_pk_changed(g)
        if track_wv:
            g.add_version(sid, version)

    # -- the census -----------------------------------------------------------------------------
    def observe(self, scheduled: list[tuple[str, str]], facts: list[StepFact]) -> Decisions:
        """The launcher's list of sessions (``job_environments``: session, group) and its rows
        that are not trainable: a group one of whose sessions ended without a result (at the step
        cap) can never reach K, and is dropped now instead of after the TTL."""
        out = Decisions()
        with self.lock:
            self.census.schedule(scheduled)
            doomed = self.census.observe(facts, trainable=False, now=self.clock())
            if doomed:
                self.changes += 1
                self._doom(doomed, out)
        return out

    def _doom(self, group_ids: set[str], out: Decisions) -> None:
        """(Lock held.) Drop the groups that can no longer reach K (never a ready or taken one)."""
        for gid in sorted(group_ids):
            if self.policy.salvage == TRUNCATE:
                # a session at the step cap is truncated, not a reason to drop: the group is
                # served once its other sessions ended too, or decided at the TTL or launcher exit
                g = self._undecided(gid)
                if (
                    gid in self.decided
                    or (g is not None and gid not in self.pending)
                    or self._salvage(g, gid, STEP_CAP, out, ended_only=True)
                ):
                    self.capped.discard(gid)
                else:
                    self.capped.add(gid)
                continue
            runs = self.k + self.policy.oversample  # the launcher's --rl-group-size
            # with a minimum group size, a group that can still reach it is served short later
            # (at the TTL, or when the launcher exits): only one that cannot is dropped now
            least = self.policy.min_group_size
            need = least if least is not None and least < self.k else self.k
            if gid in self.decided or not self.census.cannot_complete(gid, need, runs):
                continue
            g = self._undecided(gid)
            if g is None:
                self._tombstone(gid, SESSION_WITHOUT_RESULT, out)
            elif g.taken is None and gid in self.pending:
                self._drop(g, SESSION_WITHOUT_RESULT, out)

    def _salvage(
        self, g: Group | None, gid: str, reason: str, out: Decisions, *, ended_only: bool = False
    ) -> bool:
        """(Lock held.) Salvage (issue 38, :mod:`~rollout_buffer.core.salvage`): a pending group (or
        one only the census knows) whose ended sessions can be truncated becomes ready with them.
        False: salvage is off, or the group cannot be salvaged (the caller drops it as before)."""
        if self.policy.salvage != TRUNCATE:
            return False
        sessions = truncation(g, gid, self.census, self.k, reason, ended_only=ended_only)
        if sessions is None:
            return False
        if g is None:
            g = self._group_for(gid, self.clock())
        self.pending.pop(gid, None)
        self.changes += 1
        g.salvage = Salvage(
            sessions,
            reason,
            self.policy.salvage_reward,
            self.policy.message_cut <= 0,
            max_steps=self.census.max_steps,
        )
        self._became_ready(g, out)
        return True

    def _tombstone(self, gid: str, reason: str, out: Decisions) -> None:
        """(Lock held.) Drop a group that no trainable row has shown yet: its later rows are late
        rows, and every session the census knows for it is cleared."""
        sessions = sorted(self.census.sessions_of(gid))
        self.changes += 1
        self.decided[gid] = DROPPED
        self.capped.discard(gid)
        self.counts.group_dropped(reason, 0, len(sessions), ())
        self.census.settle(gid, reason)
        out.drops.append(Drop(gid, reason, [], sessions, ()))

    def _group_for(self, gid: str, now: float) -> Group:
        """(Lock held.) The undecided group a row of ``gid`` joins (a new one is pending), active
        at ``now``."""
        g = self.pending.get(gid)
        if g is None:
            g = self.ready.get(gid) or self.taken.get(gid)
            if g is None:
                g = self.pending[gid] = Group(gid, now)
                self.undecided.add(g)
                if self.excluded:  # sessions it dropped as oversampled before a restart
                    g.excluded = self.excluded.pop(gid, None)
        else:
            self.pending.move_to_end(gid)
        g.last_seen = now
        return g

    def _reject_group(self, pk: int, sid: str, gid: object, out: Decisions) -> None:
        """(Lock held.) A row with no group, or one that is not text (undecodable, a BLOB): never
        served under a garbled id. Its session can never be served whole: its undecided group is
        dropped now, and any group it joins later (``tainted``)."""
        reason = MISSING_GROUP if gid is None or gid == "" else INVALID_GROUP
        self.counts.rejected[reason] += 1
        out.rows.append(RowEvent(pk, REJECTED, reason, None, sid))
        self.tainted.add(sid)
        other = self._undecided(self.session_group.get(sid))  # O(1): the session index
        if other is not None and other.taken is None:
            self._drop(other, MALFORMED, out)

    def _undecided(self, gid: str | None) -> Group | None:
        if gid is None:
            return None
        return self.pending.get(gid) or self.ready.get(gid) or self.taken.get(gid)

    def _reject_session(self, pk: int, gid: object, out: Decisions) -> None:
        """A row whose session_id is not text (a BLOB, NULL, a number, invalid UTF-8): it cannot be
        served nor cleared at the proxy. Its group can never be served whole: it is dropped now, or
        as soon as it appears, or (taken by a poll) when the poll gives it back."""
        self.counts.rejected[INVALID_SESSION] += 1
        ok_gid = str(gid) if isinstance(gid, str) and gid and not isinstance(gid, BadText) else None
        out.rows.append(RowEvent(pk, REJECTED, INVALID_SESSION, ok_gid, None))
        if ok_gid is None or ok_gid in self.decided:
            return
        self.tainted_groups.add(ok_gid)
        g = self._undecided(ok_gid)
        if g is not None and g.taken is None:
            self._drop(g, MALFORMED, out)

    def _drop(self, g: Group, reason: str, out: Decisions) -> None:
        """Decide an undecided group as dropped (lock held). Never a taken group: its poll decides
        it."""
        gid = g.group_id
        assert g.taken is None, gid
        # every session of the group, those without a trainable row too (the census knows them)
        sessions = sorted(set(g.session_ids()) | self.census.sessions_of(gid))
        drop = Drop(
            gid, reason, g.all_pks(), sessions, g.rewards()
        )  # first: nothing is mutated if this fails
        self.changes += 1
        self.pending.pop(gid, None)
        self.ready.pop(gid, None)
        self.decided[gid] = DROPPED
        self.capped.discard(gid)
        self.counts.pending_rows -= g.n_rows
        self.counts.group_dropped(reason, g.n_rows, len(g.sessions), drop.rewards)
        self.census.settle(gid, reason)
        self._forget(g)
        out.drops.append(drop)

    def _forget(self, g: Group) -> None:
        """A group was decided: drop it from the session index (O(its sessions)) and the
        undecided."""
        self.undecided.remove(g)
        for sid in g.sessions:
            if self.session_group.get(sid) == g.group_id:
                del self.session_group[sid]
        self.tainted_groups.discard(g.group_id)
        self.implausible.discard(g.group_id)

    # -- reading -------------------------------------------------------------------------------
    def low_water(self, cursor: int) -> int:
        """Smallest pk that is still pending (rows below it are all accounted), or cursor + 1."""
        with self.lock:
            low = self.undecided.low_water()
        return cursor + 1 if low is None else low

    def stats(self) -> dict[str, Any]:
        """Counters and gauges; the accounting identity holds in them."""
        with self.lock:
            now = self.clock()
            first = self.undecided.oldest()
            oldest = None if first is None else first.first_seen
            counts = self.counts.view()
            return {
                "salvaged": self.counts.salvaged.view(),
                "job_id": self.job_id,
                "k": self.k,
                "rows": counts["rows"],
                "groups": {
                    "pending": len(self.pending),
                    "ready": len(self.ready),
                    "in_flight": len(self.taken),
                    **counts["groups"],
                },
                "oldest_pending_group_age_s": None if oldest is None else round(now - oldest, 3),
                "sessions": self.census.stats(),
                "waste": self.census.waste(),
                "figures": counts["figures"],
                "versions": {
                    "current": self.current_version,
                    "trainer": self.trainer_version,
                    "rows": self.rows_version,
                },
            }
