"""Every session of the job, including those that never write a trainable row (issue 22).

Under the original's ``--message-cut 0`` only a session's terminal row is trainable. A session
that reaches ``--max-steps`` without its environment ending it, or that fails for good, writes no
terminal row, so the trainable rows alone never show it: its group waited for the TTL, and only
the sessions that finished were cleared at the proxy. The launcher lists every session and its
group in ``job_environments`` when it starts, and writes every step, trainable or not; the census
learns the sessions from both (never reading a message) and says which groups can no longer
reach K.

It also measures what generating each group cost (issue 23): a session's generation seconds run
from its first row of any kind to its last row, on the buffer's monotonic clock; when the group is
decided its sessions' seconds and rows go to ``served`` or to ``discarded`` under the decision's
reason.

It tells ``publish`` (the accumulator's change feed) of each session listed, with its group and its
place in ``job_environments``, of each group's first row, and of each session's terminal row.

Owns: the job's sessions by group, the sessions seen with a trainable row, the sessions that ended
without a result, and the generation figures. It must not do I/O nor decide: the accumulator
drops the groups it names, under the accumulator's lock (the census has no lock of its own).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeGuard

# A group one of whose sessions ended without a result, so that it can never reach K.
SESSION_WITHOUT_RESULT = "session_without_result"


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


def ignore(event: tuple[Any, ...]) -> None:
    """The change feed of an accumulator nobody follows."""


class Census:
    """The sessions of one job and how they ended (see the module docstring)."""

    def __init__(
        self,
        max_steps: int | None,
        publish: Callable[[tuple[Any, ...]], None] = ignore,
        decided: Container[str] = frozenset(),
    ) -> None:
        self.max_steps = max_steps
        self.publish = publish
        self.decided = decided  # the accumulator's decided groups, those of before a restart too
        self.started: set[str] = set()  # undecided groups with a row of any kind
        # session -> [first row, last row, rows] on the monotonic clock, until its group is decided
        self.timing: dict[str, list[float]] = {}
        self.served = Generated()
        self.discarded: defaultdict[str, Generated] = defaultdict(Generated)
        self.group_sessions: defaultdict[str, set[str]] = defaultdict(set)
        self.session_group: dict[str, str] = {}
        self.scheduled: set[str] = set()  # listed in job_environments
        self._places = 0  # sessions listed so far: the next one's place
        self.placed: set[str] = set()  # placed in their group by a row of theirs
        self.trainable: set[str] = set()  # wrote at least one trainable row
        self.without_result: set[str] = set()  # ended without a terminal row
        # a decided group's sessions leave the sets above for these counts (a long job decides
        # millions of sessions: only their group stays known, for their late rows)
        self.settled: set[str] = set()  # decided groups
        self.settled_counts = {"scheduled": 0, "trainable": 0, "without_result": 0}

    def schedule(self, sessions: Iterable[tuple[str, str]]) -> None:
        """Sessions listed in ``job_environments``: (session_id, group_id)."""
        for session_id, group_id in sessions:
            if _text(session_id) and _text(group_id) and session_id not in self.scheduled:
                self.scheduled.add(session_id)
                self._know(session_id, group_id)
                self.publish(("listed", session_id, group_id, self._places))
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
                self.started.add(fact.group_id)
                if fact.group_id not in self.decided:  # (decided before a restart)
                    self.publish(("started", fact.group_id))
            timing = self.timing.get(fact.session_id)
            if timing is None:
                self.timing[fact.session_id] = [now, now, 1.0]
            else:
                timing[1] = now
                timing[2] += 1
            if trainable:
                self.trainable.add(fact.session_id)
            if fact.terminal:  # (pacing: a finished session is never taken for gone)
                self.publish(("finished", fact.session_id))
            if self._capped(fact) and fact.session_id not in self.without_result:
                self.without_result.add(fact.session_id)
                doomed.add(fact.group_id)
        return doomed

    def settle(self, group_id: str, outcome: str) -> float:
        """The group was decided (``served``, or dropped with reason ``outcome``): its sessions'
        generation figures go to that outcome and are forgotten. Returns its generation seconds."""
        seconds = 0.0
        rows = 0
        sessions = self.group_sessions.pop(group_id, set())
        for session_id in sessions:
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
        self.publish(("decided", group_id, outcome == "served"))
        target = self.served if outcome == "served" else self.discarded[outcome]
        target.add(len(sessions), rows, seconds)
        return seconds

    def seconds_of(self, group_id: str) -> float:
        """What generating the group has cost so far: its sessions' generation seconds."""
        timing = self.timing
        return sum(
            t[1] - t[0]
            for t in (timing.get(s) for s in self.sessions_of(group_id))
            if t is not None
        )

    def has_row(self, session_id: str) -> bool:
        """The session wrote a row of any kind (known until its group is decided)."""
        return session_id in self.timing

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
