"""The admission budget of the active job, and which groups may start (issue 34, item 4):

    budget = (S + 1) x B - (groups in progress + groups ready and not yet served
                            + groups the trainer holds)

It learns the job from the accumulator's change feed (sessions listed, groups started, ready and
decided, the newest version of a row) and the trainer from its polls, never from the accumulator
itself: both arrive in an inbox that any thread may append to, and are read here under this
class's own lock.

- S: ``ROLLOUT_BUFFER_PACING_STALENESS``, else ``ROLLOUT_BUFFER_MAX_OFF_POLICY``, else 1.
- B: ``ROLLOUT_BUFFER_PACING_BATCH_GROUPS``, else the ``min_groups`` a poll states, else 8.
- In progress: groups started (admitted here, or with a row) that are neither ready nor decided,
  nor gone. A session is gone when it has no call in flight at the gate and made none for
  ``SESSION_TIMEOUT_SECONDS``; its group then frees its place (the session's next call takes it
  back). A session that wrote its terminal row is finished, never gone. A group none of whose
  sessions called here (it started before this gate, or all that called finished) is gone when
  nothing of it moved for that long. That decides nothing about its data.
- The trainer holds what it was served less B for each step it completed. Its steps are the
  weight versions it advanced: the ``current_weight_version`` its polls send, else the newest
  version of the rows (or of the answers the gate relays, which rows show a flush later), once
  they moved. A trainer that polls lacks groups for its step, so it
  held at most B - 1 when its last poll arrived, plus what it was served since. With no version,
  what it was served since its last poll arrived counts.

Owns: the job's groups as pacing sees them, the trainer's model, and the calls in flight per
group. It must not do I/O nor read the accumulator.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

DEFAULT_STALENESS = 1
DEFAULT_BATCH_GROUPS = 8


@dataclass
class Session:
    """A session that called at the gate, as pacing sees it."""

    since: float  # its last call began or ended
    in_flight: int = 0


@dataclass
class Group:
    """A group as pacing sees it."""

    since: float  # when it started, or a call of it began or ended
    ready: bool = False
    sessions: dict[str, Session] = field(default_factory=dict)  # called here, not finished
    finished: set[str] = field(default_factory=set)  # wrote their terminal row


class Budget:
    """The budget, the admitted groups and the trainer (see the module docstring)."""

    def __init__(
        self,
        *,
        staleness: int | None,
        max_off_policy: int | None,
        batch_groups: int | None,
        session_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.clock = clock
        self.lock = threading.Lock()
        self.inbox: deque[tuple[Any, ...]] = deque()  # appended by any thread
        if staleness is not None:
            self.staleness = (staleness, "setting ROLLOUT_BUFFER_PACING_STALENESS")
        elif max_off_policy is not None:
            self.staleness = (max_off_policy, "setting ROLLOUT_BUFFER_MAX_OFF_POLICY")
        else:
            self.staleness = (DEFAULT_STALENESS, "default")
        self.batch_setting = batch_groups
        self.timeout_s = session_timeout_s
        self.job: str | None = None
        self._new_job(None)

    def _new_job(self, job: str | None) -> None:
        self.job = job
        self.job_since = self.clock()
        self.sessions: dict[str, tuple[str, int]] = {}  # listed: session -> (group, place)
        self.groups: dict[str, Group] = {}  # started and not decided
        self.decided: set[str] = set()
        self.stated_batch: int | None = None  # the min_groups of the trainer's last poll
        self.served = 0
        self.first: dict[str, int] = {}  # version source -> its first version
        self.version: dict[str, int] = {}  # version source -> its newest version
        self.row_version: int | None = None  # the newest a row showed (answers' bound)
        self.last_take = 0  # served since the last poll arrived (counted without versions)

    # -- what it is told (any thread) ------------------------------------------------------------
    def publish(self, event: tuple[Any, ...]) -> None:
        """A change of an accumulator, ``(job, kind, ...)`` (see ``Accumulator.publish``); or a
        poll that arrived, ``(None, "poll", min_groups, current_weight_version)`` (None: the
        body states none)."""
        self.inbox.append(event)

    # -- reading the inbox (lock held) ------------------------------------------------------------
    def read_inbox(self) -> None:
        while self.inbox:
            job, kind, *args = self.inbox.popleft()
            if kind == "job":
                self._new_job(job)
            elif kind == "ended" and job == self.job:
                self._new_job(None)  # its held sessions are no job's now
            elif job is None:
                self._poll(*args)
            elif job == self.job:
                self._change(kind, args)

    def _change(self, kind: str, args: list[Any]) -> None:
        if kind == "listed":
            session, group, place = args
            self.sessions[session] = (group, place)
        elif kind == "started" and args[0] not in self.decided:
            group = self.groups.setdefault(args[0], Group(self.clock()))
            group.ready = False
        elif kind == "ready" and args[0] in self.groups:
            self.groups[args[0]].ready = True
        elif kind == "ready":
            self.groups[args[0]] = Group(self.clock(), ready=True)
        elif kind == "decided":
            self.decided.add(args[0])
            self.groups.pop(args[0], None)
            if args[1]:  # served to the trainer
                self.served += 1
                self.last_take += 1
        elif kind == "finished":
            self._finished(args[0])
        elif kind == "version":
            self.row_version = args[0]
            self._saw_version("rows", args[0])

    def _finished(self, session: str) -> None:
        listed = self.sessions.get(session)
        group = None if listed is None else self.groups.get(listed[0])
        if group is not None:
            group.finished.add(session)
            group.sessions.pop(session, None)

    def _poll(self, min_groups: int | None, version: int | None) -> None:
        """A poll arrived."""
        if min_groups is not None:
            self.stated_batch = min_groups
        if version is not None:
            self._saw_version("poll", version)
        self.last_take = 0

    def _saw_version(self, source: str, version: int) -> None:
        self.first[source] = min(self.first.get(source, version), version)
        self.version[source] = version

    # -- the terms ----------------------------------------------------------------------------
    def batch(self) -> tuple[int, str]:
        if self.batch_setting is not None:
            return self.batch_setting, "setting ROLLOUT_BUFFER_PACING_BATCH_GROUPS"
        if self.stated_batch is not None:
            return self.stated_batch, "the min_groups of the trainer's last poll"
        return DEFAULT_BATCH_GROUPS, "default"

    def steps(self) -> int | None:
        """The trainer's steps completed, from its polls' versions, else from the rows' once they
        moved; None: no version says."""
        for source in ("poll", "rows"):
            if source in self.version:
                steps = self.version[source] - self.first[source]
                if source == "poll" or steps > 0:
                    return steps
        return None

    def _holds(self, steps: int | None) -> int:
        if steps is None:
            return self.last_take
        ceiling = self.ceiling()
        assert ceiling is not None
        return min(max(0, self.served - self.batch()[0] * steps), ceiling)

    def ceiling(self) -> int | None:
        """The kept heuristic (0adf4e4): a trainer that polls lacks groups for its step, so it
        held at most B - 1 when its last poll arrived, plus what it was served since (the rows'
        versions lag behind its steps until rows of the new one arrive). None without versions
        (the last take is then all it holds)."""
        if self.steps() is None:
            return None
        return self.batch()[0] - 1 + self.last_take

    def gone(self, group: Group, now: float) -> bool:
        """A session of the group is gone (no call in flight, none for the timeout), or none of
        its sessions called here and nothing of it moved for the timeout."""
        if group.ready:
            return False
        if not group.sessions:
            return now - group.since > self.timeout_s
        return any(
            not s.in_flight and now - s.since > self.timeout_s for s in group.sessions.values()
        )

    def terms(self) -> dict[str, int]:
        """(Lock held.) The budget's terms."""
        now = self.clock()
        in_progress = ready = 0
        for group in self.groups.values():
            if group.ready:
                ready += 1
            elif not self.gone(group, now):
                in_progress += 1
        return {
            "in_progress": in_progress,
            "ready": ready,
            "trainer_holds": self._holds(self.steps()),
        }

    def capacity(self) -> int:
        return (self.staleness[0] + 1) * self.batch()[0]

    def budget(self) -> int:
        """(Lock held.) (S + 1) x B less the terms."""
        return self.capacity() - sum(self.terms().values())

    # -- the gate's questions (lock held) ----------------------------------------------------------
    def group_of(self, session: str) -> tuple[str, int] | None:
        """The session's group and place in job_environments; None: not listed."""
        return self.sessions.get(session)

    def runs(self, group: str) -> bool:
        """The group started (or was decided): none of its calls is held."""
        return group in self.groups or group in self.decided

    def admit(self, group: str) -> None:
        """The group starts now (its first call goes)."""
        self.groups[group] = Group(self.clock())

    def call(self, group: str, session: str, delta: int) -> None:
        """A call of the group's session began (+1) or ended (-1)."""
        state = self.groups.get(group)
        if state is None:
            return
        now = self.clock()
        state.since = now
        if session in state.finished:
            return
        called = state.sessions.setdefault(session, Session(now))
        called.in_flight = max(0, called.in_flight + delta)
        called.since = now

    def answered(self, group: str, version: int) -> None:
        """The proxy stamped ``version`` on an answer to a call of the group: what its row will
        show once the launcher writes it (every few seconds), so the rows' newest version, seen
        sooner. It counts for a group of this job, once rows showed a version (the accumulator
        vouches that versions are plausible), and at most S + 1 above the newest a row showed:
        holding at most (S + 1) x B groups, the trainer makes at most S + 1 steps that no row
        shows. (Bounded by the rows, not by earlier answers: else answers climbing by S + 1 each
        would ratchet the steps without end.)"""
        if not self.runs(group) or self.row_version is None:
            return
        if self.version["rows"] < version <= self.row_version + self.staleness[0] + 1:
            self._saw_version("rows", version)

    def report(self) -> dict[str, Any]:
        """(Lock held.) ``GET /admission``'s figures of the budget."""
        terms = self.terms()
        batch, source = self.batch()
        steps = self.steps()
        return {
            "job_session": self.job,
            "budget": self.capacity() - sum(terms.values()),
            "capacity": self.capacity(),
            "inputs": {
                "staleness": {"value": self.staleness[0], "source": self.staleness[1]},
                "batch_groups": {"value": batch, "source": source},
            },
            "terms": terms,
            "trainer": {
                "served": self.served,
                "steps": steps,
                "versions": dict(self.version),
                "last_take": self.last_take,
                "ceiling": self.ceiling(),
            },
            "sessions_listed": len(self.sessions),
            "gone_groups": sum(1 for g in self.groups.values() if self.gone(g, self.clock())),
        }
