"""The job's current weight version, and which row versions can be true (issue 20, item 2).

Owns: the rule that moves the current version. The trainer's reported version (a poll's
``current_weight_version``, the last one sent) is the current version whenever there is one; row
data never overrides it. Without one, the current version is what complete groups agree on: the
largest version that at least two complete groups of different group ids report (a group reports
the smallest version of the sessions it serves), so no single row, session or group moves it. Once
a current version is known (the trainer reported one, or two groups agreed), a group is
*implausible* when one of its versions is negative or more than ``max_jump`` above the current
version: it is dropped with reason ``implausible_version``, never served and never counted toward
the agreement. Before that, only a negative version is implausible: a job may start at any version
(a trainer resumed from a checkpoint), and nothing can be judged against nothing. With a staleness
bound, the accumulator also asks :meth:`Versions.plausible` of every row as it is read (issue 35):
a group that would never complete is accounted then, not at its TTL.

Pure values with no lock of their own: they are a part of the accumulator's state, and change only
under its one lock (a draft being built judges its groups through the accumulator); no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable

from rollout_buffer.core.model import IMPLAUSIBLE_VERSION

DEFAULT_MAX_JUMP = 1000


class Versions:
    """The trainer's last reported version, the complete groups' agreement, and the plausibility
    rule."""

    def __init__(self, max_jump: int | None = DEFAULT_MAX_JUMP) -> None:
        self.max_jump = max_jump
        self.trainer: int | None = None  # the last current_weight_version a poll sent
        self.rows = 0  # the largest version two complete groups of different ids report
        self.known = False  # a current version was reported, agreed on or restored
        # the two complete groups with the largest versions: group_id -> the version it reports
        self._top: dict[str, int] = {}

    @property
    def current(self) -> int:
        """The trainer's version when it reported one, else the complete groups' agreement."""
        trainer = self.trainer
        return self.rows if trainer is None else trainer

    def report(self, trainer: int) -> None:
        """A poll's current_weight_version: the current version from now on (the last one wins)."""
        self.trainer, self.known = trainer, True

    def restore(self, trainer: int | None, rows: int | None) -> None:
        """The versions saved with the cursor before a restart (the agreement, as it was)."""
        if trainer is not None:
            self.trainer, self.known = trainer, True
        if rows:
            self.rows, self.known = max(self.rows, rows), True

    def plausible(self, version: int) -> bool:
        """False for a version that cannot be true: negative, or (once a current version is known)
        more than max_jump above it."""
        if version < 0:
            return False
        return not self.known or self.max_jump is None or version <= self.current + self.max_jump

    def judge(self, group_id: str, versions: Iterable[int | None]) -> str | None:
        """A complete group's versions (None: unknown): ``implausible_version`` when one cannot be
        true; else None, and its smallest known version counts toward the agreement."""
        known = [v for v in versions if v is not None]
        if not known:
            return None
        if not all(self.plausible(v) for v in known):
            return IMPLAUSIBLE_VERSION
        self._agree(group_id, min(known))
        return None

    def recount(self, served: Iterable[tuple[str, int | None]]) -> None:
        """Rows of served groups read again after a restart, as (group_id, version): each group
        counts toward the agreement again (it may have moved it after the last save)."""
        lowest: dict[str, int] = {}
        for group_id, version in served:
            if version is not None:
                lowest[group_id] = min(version, lowest.get(group_id, version))
        for group_id, version in lowest.items():
            self.judge(group_id, [version])

    def _agree(self, group_id: str, version: int) -> None:
        """Keep the two largest group versions (one per group id); the smaller of the
        two is what two groups agree on."""
        top = self._top
        if version <= top.get(group_id, -1):
            return
        top[group_id] = version
        if len(top) > 2:
            del top[min(top, key=top.__getitem__)]
        if len(top) == 2:
            agreed = min(top.values())
            if agreed > self.rows or not self.known:
                self.rows, self.known = max(self.rows, agreed), True
