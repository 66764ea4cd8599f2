"""Every session of the job, including those that never write a trainable row (issue 22).

Under the original's ``--message-cut 0`` only a session's terminal row is trainable. A session
that reaches ``--max-steps`` without its environment ending it, or that fails for good, writes no
terminal row, so the trainable rows alone never show it: its group waited for the TTL, and only
the sessions that finished were cleared at the proxy. The launcher lists every session and its
group in ``job_environments`` when it starts, and writes every step, trainable or not; the census
learns the sessions from both (never reading a message) and says which groups can no longer
reach K.

Owns: the job's sessions by group, the sessions seen with a trainable row, and the sessions that
ended without a result. It must not do I/O nor decide: the accumulator drops the groups it names,
under the accumulator's lock (the census has no lock of its own).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import NamedTuple

# A group one of whose sessions ended without a result, so that it can never reach K.
SESSION_WITHOUT_RESULT = "session_without_result"


class StepFact(NamedTuple):
    """The metadata of one launcher row that the census needs (never its messages)."""

    session_id: str
    group_id: str
    step_id: int | None
    terminal: bool


class Census:
    """The sessions of one job and how they ended (see the module docstring)."""

    def __init__(self, max_steps: int | None) -> None:
        self.max_steps = max_steps
        self.group_sessions: defaultdict[str, set[str]] = defaultdict(set)
        self.session_group: dict[str, str] = {}
        self.scheduled: set[str] = set()  # listed in job_environments
        self.trainable: set[str] = set()  # wrote at least one trainable row
        self.without_result: set[str] = set()  # ended without a terminal row

    def schedule(self, sessions: Iterable[tuple[str, str]]) -> None:
        """Sessions listed in ``job_environments``: (session_id, group_id)."""
        for session_id, group_id in sessions:
            if _text(session_id) and _text(group_id):
                self.scheduled.add(session_id)
                self._know(session_id, group_id)

    def observe(self, facts: Iterable[StepFact], *, trainable: bool) -> set[str]:
        """Rows of the job (trainable or not); the groups that just got a session without a
        result."""
        doomed: set[str] = set()
        for fact in facts:
            if not (_text(fact.session_id) and _text(fact.group_id)):
                continue  # the accumulator rejects such rows; the census cannot place them
            self._know(fact.session_id, fact.group_id)
            if trainable:
                self.trainable.add(fact.session_id)
            if self._capped(fact) and fact.session_id not in self.without_result:
                self.without_result.add(fact.session_id)
                doomed.add(fact.group_id)
        return doomed

    def sessions_of(self, group_id: str) -> set[str]:
        """Every session the census knows for the group."""
        return self.group_sessions.get(group_id, set())

    def cannot_complete(self, group_id: str, k: int) -> bool:
        """Fewer than K of the group's sessions can still end with a result."""
        sessions = self.group_sessions.get(group_id)
        if not sessions:
            return False
        failed = len(sessions & self.without_result)
        return failed > 0 and max(len(sessions), k) - failed < k

    def stats(self) -> dict[str, int]:
        """Counts for /stats, the page and the export."""
        known = len(self.session_group)
        return {
            "known": known,
            "scheduled": len(self.scheduled),
            "with_trainable_row": len(self.trainable),
            "without_trainable_row": known - len(self.trainable),
            "ended_without_result": len(self.without_result),
        }

    def _know(self, session_id: str, group_id: str) -> None:
        if session_id not in self.session_group:
            self.session_group[session_id] = group_id
            self.group_sessions[group_id].add(session_id)

    def _capped(self, fact: StepFact) -> bool:
        """A row at the step cap that is not terminal: its session ended without a result."""
        return (
            not fact.terminal
            and self.max_steps is not None
            and fact.step_id is not None
            and fact.step_id >= self.max_steps
        )


def _text(value: object) -> bool:
    return isinstance(value, str) and bool(value)
