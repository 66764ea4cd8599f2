"""Every session of the job, including those that never write a trainable row (issue 22).

Under the original's ``--message-cut 0`` only a session's terminal row is trainable. A session
that reaches ``--max-steps`` without its environment ending it, or that fails for good, writes no
terminal row, so the trainable rows alone never show it: its group waited for the TTL, and only
the sessions that finished were cleared at the proxy. The launcher lists every session and its
group in ``job_environments`` when it starts, and writes every step, trainable or not; the census
learns the sessions from both (never reading a message) and says which groups can no longer
reach K.

It also measures what generating each group cost (issue 23): a session's generation seconds run
from its first sign (its first model call through the pacing gate when pacing is on, else its
first row of any kind) to its last row, on the buffer's monotonic clock; when the group is decided
its sessions' seconds and rows go to ``served`` or to ``discarded`` under the decision's reason.

Owns: the job's sessions by group, the sessions seen with a trainable row, the sessions that ended
without a result, and the generation figures. It must not do I/O nor decide: the accumulator
drops the groups it names, under the accumulator's lock (the census has no lock of its own).
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple, TypeGuard

from rollout_buffer.core.liveness import RETRY_QUIET_S, Liveness

# A group one of whose sessions ended without a result, so that it can never reach K.
SESSION_WITHOUT_RESULT = "session_without_result"
SPANS_KEPT = 200
RECENT_ENDS = 200  # the groups that ended last, whose share lost sizes the budget's spares
MIN_ENDS = 20  # groups ended before a share is given
STALL_FACTOR = 3.0  # idle this many times the 90th percentile of the spans: stalled
STALL_MIN_S = 2.0
# a lost group none of whose sessions showed a sign for this long (and four times the quiet
# threshold) is set aside: not looked at again until one of them does
SET_ASIDE_S = 600.0
# a session of a group that ran before the gate saw it (the service restarted under it) that has
# made no call through the gate this long after the gate saw its first call (and after its last
# row) is taken for dead: a call in flight at the restart is retried within the launcher's
# longest backoff (SPEC §5), and nothing else would ever decide it (no gap between calls may ever
# be learned while every other session is held, and a group with no trainable row has no TTL)
RESUMED_QUIET_S = RETRY_QUIET_S


class StepFact(NamedTuple):
    """The metadata of one launcher row that the census needs (never its messages)."""

    session_id: str
    group_id: str | None  # unchecked: a rejected row may have none (observe skips it)
    step_id: int | None
    terminal: bool


@dataclass
class Generated:
    """What generating some groups cost: groups, sessions, rows and generation seconds."""

    groups: int = 0
    sessions: int = 0
    rows: int = 0
    generation_s: float = 0.0

    def add(self, sessions: int, rows: int, seconds: float) -> None:
        self.groups += 1
        self.sessions += sessions
        self.rows += rows
        self.generation_s += seconds

    def as_dict(self) -> dict[str, float]:
        return {
            "groups": self.groups,
            "sessions": self.sessions,
            "rows": self.rows,
            "generation_s": round(self.generation_s, 3),
        }


class Census:
    """The sessions of one job and how they ended (see the module docstring)."""

    def __init__(self, max_steps: int | None) -> None:
        self.max_steps = max_steps
        self.started: set[str] = set()  # groups with a sign of life (a row, or a gate call)
        # groups that started before the gate saw them (their first sign a row, or a call that
        # carries a model answer: the service restarted under them): the gate has no first
        # call of their sessions, so none of them is taken for passed over
        self.resumed: set[str] = set()
        # session -> [first sign, last row, rows] on the monotonic clock, until its group is decided
        self.timing: dict[str, list[float]] = {}
        self.served = Generated()
        self.discarded: defaultdict[str, Generated] = defaultdict(Generated)
        # how long groups took from their first trainable row to ready (the last completions)
        self.spans: deque[float] = deque(maxlen=SPANS_KEPT)
        self.reached_k = 0  # groups that became ready
        self.liveness = Liveness()  # the running sessions' model calls through the gate
        self.stalled: set[str] = set()  # groups seen stalled (a session failed for good)
        # groups ever taken for stalled, those that reached K after all too: it never goes down,
        # so the losses since a moment are this less the count then
        self.lost_total = 0
        # how the last RECENT_ENDS groups ended: True reached K, False taken for lost (a
        # launcher's bad start or a burst of made-up groups weighs only until they roll out)
        self.recent_ends: deque[bool] = deque(maxlen=RECENT_ENDS)
        # lost groups with no sign for long (every session of a broken task died before a
        # trainable row: nothing decides such a group before the job ends): each question of
        # the budget looked at each of their sessions again (16 ms at a thousand groups of 8)
        self.set_aside: set[str] = set()
        self.group_sessions: defaultdict[str, set[str]] = defaultdict(set)
        self.session_group: dict[str, str] = {}
        self.scheduled: set[str] = set()  # listed in job_environments
        self.place: dict[str, int] = {}  # a listed session's place in job_environments
        self._places = 0
        self.placed: set[str] = set()  # placed in their group by a row of theirs
        self.trainable: set[str] = set()  # wrote at least one trainable row
        self.without_result: set[str] = set()  # ended without a terminal row
        # a decided group's sessions leave the sets above for these counts (a long job decides
        # millions of sessions: only their group stays known, for the gate and their late rows)
        self.settled: set[str] = set()  # decided groups
        self.settled_counts = {"scheduled": 0, "trainable": 0, "without_result": 0}
        self.resumed_quiet_s = RESUMED_QUIET_S

    def schedule(self, sessions: Iterable[tuple[str, str]]) -> None:
        """Sessions listed in ``job_environments``: (session_id, group_id)."""
        for session_id, group_id in sessions:
            if _text(session_id) and _text(group_id):
                self.scheduled.add(session_id)
                self._know(session_id, group_id)
                if session_id not in self.place:
                    self.place[session_id] = self._places
                    self._places += 1

    def observe(self, facts: Iterable[StepFact], *, trainable: bool, now: float) -> set[str]:
        """Rows of the job (trainable or not); the groups that just got a session without a
        result."""
        doomed: set[str] = set()
        for fact in facts:
            if not (_text(fact.session_id) and _text(fact.group_id)):
                continue  # the accumulator rejects such rows; the census cannot place them
            if fact.group_id in self.settled:
                continue  # a late row of a decided group: the accumulator counts it
            self._place(fact.session_id, fact.group_id)
            if fact.group_id not in self.started:
                self.resumed.add(fact.group_id)
            self.started.add(fact.group_id)
            self.set_aside.discard(fact.group_id)
            self.liveness.row(fact.session_id, now, fact.step_id, bool(fact.terminal))
            timing = self.timing.get(fact.session_id)
            if timing is None:
                self.timing[fact.session_id] = [now, now, 1.0]
            else:
                timing[1] = now
                timing[2] += 1
            if trainable:
                self.trainable.add(fact.session_id)
            if self._capped(fact) and fact.session_id not in self.without_result:
                self.without_result.add(fact.session_id)
                doomed.add(fact.group_id)
        return doomed

    def first_call(self, session_id: str, now: float, resumed: bool = False) -> str | None:
        """A session's first model call through the pacing gate: its first sign (``resumed``:
        a call that carries a model answer, the service restarted under the session). Returns
        its group (None when job_environments has not listed it)."""
        group_id = self.session_group.get(session_id)
        if group_id in self.settled:
            return group_id  # a late session of a decided group: nothing would settle its timing
        if group_id is not None:
            if resumed and group_id not in self.started:
                self.resumed.add(group_id)
            self.started.add(group_id)
            self.set_aside.discard(group_id)
        self.timing.setdefault(session_id, [now, now, 0.0])
        return group_id

    def settle(self, group_id: str, outcome: str) -> None:
        """The group was decided (``served``, or dropped with reason ``outcome``): its sessions'
        generation figures go to that outcome and are forgotten."""
        seconds = 0.0
        rows = 0
        sessions = self.group_sessions.pop(group_id, set())
        self.liveness.forget(sessions)
        for session_id in sessions:
            self.place.pop(session_id, None)
            timing = self.timing.pop(session_id, None)
            if timing is not None:
                seconds += timing[1] - timing[0]
                rows += int(timing[2])
            for name, members in (
                ("scheduled", self.scheduled),
                ("trainable", self.trainable),
                ("without_result", self.without_result),
            ):
                if session_id in members:
                    members.discard(session_id)
                    self.settled_counts[name] += 1
            self.placed.discard(session_id)
        self.settled.add(group_id)
        self.started.discard(group_id)
        self.resumed.discard(group_id)
        self.set_aside.discard(group_id)
        target = self.served if outcome == "served" else self.discarded[outcome]
        target.add(len(sessions), rows, seconds)

    def waste(self) -> dict[str, object]:
        """Served against discarded groups, by reason, with the share discarded."""
        discarded = Generated()
        for g in self.discarded.values():
            discarded.groups += g.groups
            discarded.sessions += g.sessions
            discarded.rows += g.rows
            discarded.generation_s += g.generation_s
        total_groups = self.served.groups + discarded.groups
        total_s = self.served.generation_s + discarded.generation_s
        return {
            "served": self.served.as_dict(),
            "discarded": discarded.as_dict(),
            "discarded_by_reason": {r: g.as_dict() for r, g in sorted(self.discarded.items())},
            "discarded_share": {
                "groups": round(discarded.groups / total_groups, 4) if total_groups else 0.0,
                "generation_s": round(discarded.generation_s / total_s, 4) if total_s else 0.0,
            },
        }

    def sign(self, session_id: str, now: float) -> None:
        """A model call of the session went through the pacing gate: a sign of life."""
        if self.set_aside:
            self.set_aside.discard(self.session_group.get(session_id, ""))
        timing = self.timing.get(session_id)
        if timing is None:
            if self.session_group.get(session_id) in self.settled:
                return  # a late session of a decided group: nothing would settle its timing
            self.timing[session_id] = [now, now, 0.0]
        else:
            timing[1] = now
        # a session of a group that showed a row before a call through the gate ran before the
        # service saw it: its calls were not all counted
        counted = self.session_group.get(session_id) not in self.resumed
        self.liveness.call_started(session_id, now, counted)

    def _dead(self, session_id: str, now: float, silent: float | None) -> bool:
        """Quiet for good at the gate (for :data:`RESUMED_QUIET_S` while ``silent`` is not
        learned), passed over by the launcher before its first call, or (a session that ran
        before the gate saw it) no call since the gate came up (:data:`RESUMED_QUIET_S`).
        ``silent``: :meth:`silent_after` (None: not learned yet)."""
        if session_id in self.liveness.calls:
            # before the threshold is learned (twenty gaps between calls), a session quiet for
            # longer than its client's longest backoff: if the first admitted groups all died
            # early no gap is ever seen while every other first call is held
            quiet = self.resumed_quiet_s if silent is None else silent
            return self.liveness.dead(session_id, now, quiet)
        if session_id in self.liveness.arrived:
            return False  # held at the gate: its group is not admitted
        if self.session_group.get(session_id) in self.resumed:
            since = self.liveness.first_seen
            if since is None:
                return False  # the gate saw no call: pacing is off, or it has just come up
            timing = self.timing.get(session_id)
            if timing is not None:
                since = max(since, timing[1])
            return now - since > max(self.resumed_quiet_s, silent or 0.0)
        place = self.place.get(session_id)
        return silent is not None and place is not None and self.liveness.passed(place, now, silent)

    def arrived(self, session_id: str, now: float) -> None:
        """The session's first model call reached the gate (held or let through)."""
        in_order = self.liveness.in_order
        self.liveness.arrive(session_id, self.place.get(session_id), now)
        if self.set_aside:
            self.set_aside.discard(self.session_group.get(session_id, ""))
            if in_order and not self.liveness.in_order:
                self.set_aside.clear()  # sessions taken for passed over may only be queued

    def answered(self, session_id: str, now: float, retried: bool = False) -> None:
        """A model call of the session came back through the gate (answered, or abandoned;
        ``retried``: so that its client retries it after a backoff)."""
        self.liveness.call_ended(session_id, now, retried)

    def silent_after(self) -> float | None:
        """Seconds of quiet after which a started session with no call in flight is taken for
        dead (:meth:`Liveness.quiet_after`); None until enough calls were seen."""
        return self.liveness.quiet_after()

    def lost(
        self, group_id: str, completed: set[str], k: int, now: float, silent: float | None
    ) -> bool:
        """The group cannot reach K: so many of its sessions ended without a result or died
        (quiet for longer than ``silent``, :meth:`silent_after`, with no call in flight) that
        fewer than K can still complete. One dead session is enough when the group runs K."""
        sessions = self.group_sessions.get(group_id)
        if not sessions:
            return False
        gone = 0
        for session_id in sessions:
            if session_id in completed:
                continue
            if session_id in self.without_result or self._dead(session_id, now, silent):
                gone += 1
        return gone > 0 and max(len(sessions), k) - gone < k

    def set_aside_quiet(self, group_ids: Iterable[str], now: float, silent: float | None) -> None:
        """Of these lost groups, set aside those none of whose sessions showed a sign (a call, a
        row) for :data:`SET_ASIDE_S` and four times ``silent``: :meth:`lost` is not asked again
        about them until one does (a call, a row or a first call of one of them)."""
        if silent is None:
            return
        horizon = now - max(SET_ASIDE_S, 4.0 * silent)
        for group_id in group_ids:
            if self._last_sign(group_id) < horizon:
                self.set_aside.add(group_id)

    def _last_sign(self, group_id: str) -> float:
        """When a session of the group last showed a sign (infinite: a call is in flight)."""
        last = float("-inf")
        for session_id in self.group_sessions.get(group_id, ()):
            entry = self.liveness.calls.get(session_id)
            if entry is not None:
                if entry.in_flight > 0:
                    return float("inf")
                last = max(last, entry.last_end)
            timing = self.timing.get(session_id)
            if timing is not None:
                last = max(last, timing[1])
        return last

    def completed_in(self, seconds: float) -> None:
        """A group became ready ``seconds`` after its first trainable row."""
        self.spans.append(max(0.0, seconds))
        self.reached_k += 1
        self.recent_ends.append(True)

    def completion_rate(self) -> float | None:
        """The share of the groups that ended (ready, or stalled) that reached K; None until
        twenty did."""
        ended = self.reached_k + len(self.stalled)
        return None if ended < MIN_ENDS else self.reached_k / ended

    def recent_lost_share(self) -> float | None:
        """The share of the last :data:`RECENT_ENDS` groups that ended that were taken for lost;
        None until :data:`MIN_ENDS` did."""
        ends = self.recent_ends
        if len(ends) < MIN_ENDS:
            return None
        return 1.0 - sum(ends) / len(ends)

    def stall_after(self) -> float:
        """Idle seconds after which a pending group is taken for stalled (one of its sessions
        failed for good); infinite until groups have completed."""
        if len(self.spans) < 5:
            return float("inf")
        ordered = sorted(self.spans)
        p90 = ordered[int(0.9 * (len(ordered) - 1))]
        return max(STALL_MIN_S, STALL_FACTOR * p90)

    def sessions_of(self, group_id: str) -> set[str]:
        """Every session the census knows for the group."""
        return self.group_sessions.get(group_id, set())

    def cannot_complete(self, group_id: str, k: int, runs: int | None = None) -> bool:
        """Fewer than K of the group's sessions can still end with a result. ``runs``: how many
        sessions the launcher runs per group (K + the over-sampled ones): sessions not seen yet
        (no row, job_environments not read or absent) can still complete."""
        sessions = self.group_sessions.get(group_id)
        if not sessions:
            return False
        failed = len(sessions & self.without_result)
        return failed > 0 and max(len(sessions), k, runs or 0) - failed < k

    def stats(self) -> dict[str, int]:
        """Counts for /stats, the page and the export."""
        known = len(self.session_group)
        settled = self.settled_counts
        trainable = len(self.trainable) + settled["trainable"]
        return {
            "known": known,
            "scheduled": len(self.scheduled) + settled["scheduled"],
            "with_trainable_row": trainable,
            "without_trainable_row": known - trainable,
            "ended_without_result": len(self.without_result) + settled["without_result"],
        }

    def _know(self, session_id: str, group_id: str) -> None:
        if session_id not in self.session_group:
            self.session_group[session_id] = group_id
            self.group_sessions[group_id].add(session_id)

    def _place(self, session_id: str, group_id: str) -> None:
        """A row names the session's group: the rows are what the accumulator groups, so the
        first row's group wins over a job_environments row that names another (else the
        session's cap would doom the wrong group, and clear it at the proxy with that group)."""
        listed = self.session_group.get(session_id)
        if listed is None:
            self._know(session_id, group_id)
        elif listed != group_id and session_id not in self.placed:
            others = self.group_sessions.get(listed)
            if others is not None:
                others.discard(session_id)
            self.session_group[session_id] = group_id
            self.group_sessions[group_id].add(session_id)
        self.placed.add(session_id)

    def _capped(self, fact: StepFact) -> bool:
        """A row at the step cap that is not terminal: its session ended without a result."""
        return (
            not fact.terminal
            and self.max_steps is not None
            # a number: an untyped SQLite column may hold text, and one row that raised here
            # would lose the census's whole batch (its cursor has moved past it)
            and isinstance(fact.step_id, (int, float))
            and not isinstance(fact.step_id, bool)
            and fact.step_id >= self.max_steps
        )


def _text(value: object) -> TypeGuard[str]:
    return isinstance(value, str) and bool(value)
