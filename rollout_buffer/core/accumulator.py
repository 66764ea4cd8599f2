"""In-memory grouping of one job's rows, under one lock, with no I/O.

Owns: the undecided groups of one job (pending, ready in the serve order, taken by a poll), the
tombstones of decided ones, ingesting rows into them, the policies' decisions when a group becomes
ready or cannot wait (over-sampling, refusals, the TTL, the minimum group size, a change of K,
salvage's truncated sessions), handing ready groups to polls and settling them once a poll's plan is
recorded, and the job's counters (:mod:`~rollout_buffer.core.accounting`). Pending state holds
metadata only (see :mod:`~rollout_buffer.core.group`); bodies stay in the database until served.
Every method returns *decisions* (a plan: drops, rows accounted one by one, groups ready) for the
caller to record and act on after the lock is released; it must not touch the database, the proxy
or the clock beyond its own monotonic one.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Container, Iterable, Iterator
from typing import Any

from rollout_buffer.core.accounting import Counts
from rollout_buffer.core.census import SESSION_WITHOUT_RESULT, Census, StepFact, ignore
from rollout_buffer.core.group import Group, ReadyQueue, Undecided
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
    PARTIAL,
    REJECTED,
    ROW_DROPPED,
    SERVED,
    STEP_CAP,
    TTL,
    BadText,
    Decisions,
    Drop,
    Policy,
    Row,
    RowEvent,
    Salvage,
    Take,
)
from rollout_buffer.core.salvage import (
    TRUNCATE,
    late_reason,
    served_count,
    served_sessions,
    truncation,
    unread,
)
from rollout_buffer.core.versions import Versions

logger = logging.getLogger(__name__)

# Rows ingested per hold of the lock, and groups expired per hold: about 3 ms of work each, so a
# poll never waits more than that behind ingest or TTL cleanup, whatever the batch.
PIECE = 200


class Accumulator:
    """Groups one job's rows until K sessions of a group have completed.

    All state is guarded by ``self.lock``; every method that changes it takes the lock (ingest and
    TTL cleanup a piece at a time) and swaps :attr:`snapshot` before releasing it; readers read the
    snapshot, never the lock. No method does I/O.
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
        self.snapshot = self._snapshot()  # swapped after each change (see _change)
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
        with self._change():
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
        with self._change():
            if rows is None and trainer is not None:
                self.versions.report(trainer)
            else:
                self.versions.restore(trainer, rows)

    def judge_versions(self, group_id: str, versions: Iterable[int | None]) -> str | None:
        """A group about to be served, with every version of its rows (a draft reads them all):
        ``implausible_version`` when one cannot be true, else None and it counts toward the
        agreement on the current version (:meth:`~rollout_buffer.core.versions.Versions.judge`)."""
        with self._change():
            return self.versions.judge(group_id, versions)

    def recount_versions(self, served: Iterable[tuple[str, int | None]]) -> None:
        """Rows of served groups read again after a restart count toward the agreement again."""
        with self._change():
            self.versions.recount(served)

    # -- ingest -------------------------------------------------------------------------------
    def ingest(
        self, rows: Iterable[Row], between: Callable[[], object] = lambda: None
    ) -> Decisions:
        """Add new rows (distinct step_pks, each seen once), ``PIECE`` rows per hold of the lock:
        a poll waits behind one piece, never behind a whole batch (up to 20,000 rows). A piece is
        what a smaller batch would have been: the same rows in the same order. ``between`` runs
        before each piece but the first, without the lock (the loop lets a running poll finish)."""
        out = Decisions()
        rows = rows if isinstance(rows, list) else list(rows)
        for start in range(0, len(rows), PIECE):
            if start:
                between()
            with self._change():
                self._ingest_piece(rows[start : start + PIECE], out)
        return out

    def _ingest_piece(self, rows: list[Row], out: Decisions) -> None:
        """(Lock held.) Add one piece of rows."""
        self.changes += 1
        now = self.clock()
        track_wv, k = self._track_wv, self.k
        # with a staleness bound, a row version the version rule refuses dooms its group now,
        # complete or not (issue 35): not only when it completes, which it may never do
        plausible = self.versions.plausible if self.policy.max_off_policy is not None else None
        # the census first: a group decided in this batch is settled with these rows' figures
        facts = (StepFact(r[1], r[2], r[4] if len(r) > 4 else None, bool(r[3])) for r in rows)
        doomed = self.census.observe(facts, trainable=True, now=now)
        ended: set[str] = set()  # groups a session of which completed in this piece
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
                g.exclude(sid)  # a session beyond the K it serves: never served, even if K changes
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
        # completed session changes what salvage decides, never checked for every piece
        self._doom(doomed | (self.capped & ended), out)
        self._publish_version(rows)

    def _publish_version(self, rows: list[Row]) -> None:
        """(Lock held.) Tell followers of the newest version of these rows, if it is newer and
        plausible (:meth:`_shown`). The first one they see is the current version, which no
        single row moves: the steps made since the rows read before it was known count too."""
        newest = max(
            (r[6] for r in rows if len(r) > 6 and type(r[6]) is int and self._shown(r[6])),
            default=None,
        )  # (a bool or a text is no version)
        if newest is None:
            return
        if self._rows_version is None:
            self._rows_version = min(self.versions.current, newest)
            self.publish(("version", self._rows_version))
        if newest > self._rows_version:
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
        with self._change():
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

    # -- when a group is ready, and when it cannot wait (the policies) --------------------------
    def _became_ready(self, g: Group, out: Decisions) -> None:
        """(Lock held.) A group has K completed sessions, or is served short at the TTL: choose its
        sessions (over-sampling), apply the policies, and queue it or drop it."""
        self.capped.discard(g.group_id)  # (salvage: it waits for its other sessions no more)
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
        more = True
        while more:  # PIECE groups per hold of the lock: a poll never waits behind a long cleanup
            with self._change():
                now = self.clock()
                for _ in range(PIECE):
                    g = next(iter(self.pending.values()), None)
                    if g is None or now - g.last_seen < ttl_s:
                        more = False
                        break
                    self._give_up(g, TTL, out)
        return out

    def drop_all(self, reason: str, *, include_ready: bool, partial: bool = False) -> Decisions:
        """Drop every incomplete group (and the ready ones when include_ready); with ``partial``
        (the launcher exited: they can never complete) those with the minimum group size are served
        short. PIECE groups per hold of the lock, as in :meth:`expire`."""
        out = Decisions()
        for ready in (False, True) if include_ready else (False,):
            more = True
            while more:  # each group leaves its queue when it is decided (or made ready)
                with self._change():
                    queue = self.ready if ready else self.pending
                    piece = list(itertools.islice(queue.values(), PIECE))
                    for g in piece:
                        if partial and not ready:
                            self._give_up(g, reason, out)
                        else:
                            self._drop(g, reason, out)
                    more = len(piece) == PIECE
        # groups whose sessions all ended before any trainable row: only the census knew them
        with self.lock:
            known = list(self.census.group_sessions)
        for start in range(0, len(known), PIECE):
            with self._change():
                for gid in known[start : start + PIECE]:
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
        with self._change():
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
            if self.capped:  # salvage: a lowered K may be what a capped group waited for
                self._doom(set(self.capped), out)
        return out.newly_ready, out

    # -- handing ready groups to a poll, and settling them ------------------------------------
    def take_ready(self, max_groups: int | None) -> list[Take]:
        """Hand ready groups to a poll, first ready first; they stay undecided until
        commit/release."""
        takes: list[Take] = []
        with self._change():
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
        with self._change():
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
        with self._change():
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
        with self._change():
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
        with self._change():
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
        with self._change():
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

    # -- reading -------------------------------------------------------------------------------
    def low_water(self, cursor: int) -> int:
        """Smallest pk that is still pending (rows below it are all accounted), or cursor + 1."""
        with self.lock:
            low = self.undecided.low_water()
        return cursor + 1 if low is None else low

    def stats(self) -> dict[str, Any]:
        """Counters and gauges as of the last change; the accounting identity holds in them. Reads
        the snapshot, never the lock."""
        return self.snapshot.stats(self.clock())

    # -- the snapshot readers read -------------------------------------------------------------
    @contextlib.contextmanager
    def _change(self) -> Iterator[None]:
        """Hold the lock for a change; swap the snapshot before releasing it, so that a reader
        right after the change (a /stats after a poll) sees it."""
        with self.lock:
            try:
                yield
            finally:
                self.snapshot = self._snapshot()

    def publish_snapshot(self) -> None:
        """Swap the snapshot after a change made before the accumulator is shared (restored
        counts, tainted sessions)."""
        with self._change():
            pass

    def _snapshot(self) -> Snapshot:
        """(Lock held.) The figures now: O(reasons), never O(groups or rows)."""
        first = self.undecided.oldest()
        return Snapshot(
            job_id=self.job_id,
            k=self.k,
            pending=len(self.pending),
            ready=len(self.ready),
            in_flight=len(self.taken),
            oldest_first_seen=None if first is None else first.first_seen,
            counts=self.counts.view(),
            salvaged=self.counts.salvaged.view(),
            sessions=self.census.stats(),
            waste=self.census.waste(),
            versions={
                "current": self.current_version,
                "trainer": self.trainer_version,
                "rows": self.rows_version,
            },
        )


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """What the readers see of a job's accumulator (/stats, /metrics, the status page, the CLI
    table, a poll's check for ready groups): taken under the lock after each change and never
    changed; ``stats`` hands out a copy."""

    job_id: str
    k: int
    pending: int
    ready: int
    in_flight: int
    oldest_first_seen: float | None
    counts: dict[str, Any]
    salvaged: dict[str, Any]  # served groups with truncated sessions (issue 38)
    sessions: dict[str, int]
    waste: dict[str, Any]
    versions: dict[str, int | None]

    def stats(self, now: float) -> dict[str, Any]:
        """The /stats document of the job's accumulator, at ``now`` on its clock."""
        oldest = self.oldest_first_seen
        counts = copy.deepcopy(self.counts)
        return {
            "salvaged": copy.deepcopy(self.salvaged),
            "job_id": self.job_id,
            "k": self.k,
            "rows": counts["rows"],
            "groups": {
                "pending": self.pending,
                "ready": self.ready,
                "in_flight": self.in_flight,
                **counts["groups"],
            },
            "oldest_pending_group_age_s": None if oldest is None else round(now - oldest, 3),
            "sessions": dict(self.sessions),
            "waste": copy.deepcopy(self.waste),
            "figures": counts["figures"],
            "versions": dict(self.versions),
        }
