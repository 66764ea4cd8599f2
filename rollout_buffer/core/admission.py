"""How many more groups may start now (issue 23): the admission budget, and which groups the
pacing gate has admitted.

AReaL's rule is the starting point: the trainer takes B groups a step and accepts a group whose
weight version is at most S behind its own, so at most (S + 1) x B groups may be in progress
(running, pending, ready or built) without producing a group the trainer will throw away:

    budget = (S + 1) x B - groups in progress - the trainer's surplus

The trainer's surplus is what it has taken beyond what its steps consumed: the upstream client's
``{}`` polls take every ready group, and keeps the ones it did not train on, and those go stale
in its hands. Each step consumes B groups; the steps are counted both as the weight versions the
job advanced and as the trainer's bursts of polls (a gap longer than the idle gap ends one), and
the larger count is taken (the versions of the rows lag behind the trainer's). The surplus is the
groups served minus B x the steps completed: the batch the trainer is training on counts, since a
group that starts now can only be trained after it.

S and B are settings; where one is not set it is learned from what the buffer observes (S from the
staleness policy, B from the groups the trainer takes between its idle gaps) and, until then, a
default. Every input says where it came from.

Admission is per group: once a group is admitted, none of its sessions is ever held, or it could
never complete. The gate asks :meth:`Admission.ask` at each session's first model call.

Owns: the admitted groups, the trainer's bursts, and the budget's arithmetic, behind one small
lock. It must not do I/O, nor read the accumulator itself: the caller passes the groups in
progress and the current version.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_STALENESS = 1
DEFAULT_BATCH_GROUPS = 8
BURSTS_KEPT = 5  # B is the median of the groups taken in the last few bursts


@dataclass(frozen=True)
class Input:
    """One input of the budget and where it came from (setting, learned or default)."""

    value: int
    source: str

    def as_dict(self) -> dict[str, object]:
        return {"value": self.value, "source": self.source}


class Admission:
    """The admission budget and the admitted groups of the active job."""

    def __init__(
        self,
        *,
        staleness: int | None,
        batch_groups: int | None,
        policy_staleness: int | None = None,
        idle_gap_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._lock = threading.Lock()
        self.clock = clock
        self.idle_gap_s = idle_gap_s
        if staleness is not None:
            self.staleness = Input(staleness, "setting ROLLOUT_BUFFER_PACING_STALENESS")
        elif policy_staleness is not None:
            self.staleness = Input(policy_staleness, "learned from ROLLOUT_BUFFER_MAX_OFF_POLICY")
        else:
            self.staleness = Input(DEFAULT_STALENESS, "default")
        self._batch_setting = batch_groups
        self._bursts: deque[int] = deque(maxlen=BURSTS_KEPT)
        self._bursts_ended = 0
        self._burst = 0  # groups taken in the burst under way
        self._last_take: float | None = None
        self.admitted: set[str] = set()  # groups the gate let start
        self.served = 0  # groups the trainer took (polls)
        self.completion_rate: float | None = None  # of the groups that started, reaching K
        self.first_version: int | None = None  # the job's current version when first seen
        self.held = 0  # first calls the gate holds now
        self.admitted_total = 0
        self.held_total = 0

    # -- the trainer's demand ---------------------------------------------------------------------
    def took(self, groups: int) -> None:
        """A poll took ``groups`` groups: a poll after an idle gap starts a new burst."""
        now = self.clock()
        with self._lock:
            if self._last_take is not None and now - self._last_take > self.idle_gap_s:
                if self._burst:
                    self._bursts.append(self._burst)
                    self._bursts_ended += 1
                self._burst = 0
            if groups:
                self._burst += groups
                self._last_take = now
                self.served += groups

    @property
    def batch_groups(self) -> Input:
        if self._batch_setting is not None:
            return Input(self._batch_setting, "setting ROLLOUT_BUFFER_PACING_BATCH_GROUPS")
        with self._lock:
            bursts = list(self._bursts)
        if bursts:
            return Input(
                max(1, int(statistics.median(bursts))),
                f"learned: median groups taken between the trainer's idle gaps ({len(bursts)} "
                "bursts)",
            )
        return Input(DEFAULT_BATCH_GROUPS, "default (no burst of the trainer seen yet)")

    # -- the budget ------------------------------------------------------------------------------
    def capacity(self) -> int:
        """(S + 1) x B: the groups that may be in progress at once (more when some of the groups
        that start never complete: a crashed session)."""
        return self._stretch((self.staleness.value + 1) * self.batch_groups.value)

    def _stretch(self, capacity: int) -> int:
        rate = self.completion_rate
        if rate is None or rate >= 1.0:
            return capacity
        return math.ceil(capacity / max(rate, 0.5))

    def surplus(self, current_version: int | None) -> int:
        """Groups the trainer holds beyond what its steps consumed (estimated from versions)."""
        with self._lock:
            return self._surplus_locked(current_version)

    def _surplus_locked(self, current_version: int | None) -> int:
        steps = self._bursts_ended
        if current_version is not None:
            if self.first_version is None or current_version < self.first_version:
                self.first_version = current_version
            steps = max(steps, current_version - self.first_version)
        return max(0, self.served - self._batch_locked() * steps)

    def report(self, in_progress: dict[str, int], current_version: int | None) -> dict[str, object]:
        """``GET /admission``: the budget, its inputs with where each came from, and why."""
        surplus = self.surplus(current_version)
        total = sum(v for k, v in in_progress.items() if k != "stalled") + surplus
        staleness, batch = self.staleness, self.batch_groups
        capacity = self._stretch((staleness.value + 1) * batch.value)
        budget = max(0, capacity - total)
        if budget:
            why = (
                f"{total} groups in progress of the {capacity} = (S {staleness.value} + 1) x "
                f"B {batch.value} the trainer can take within the staleness bound: {budget} more "
                "may start"
            )
        else:
            why = (
                f"{total} groups in progress fill the {capacity} = (S {staleness.value} + 1) x "
                f"B {batch.value} the trainer can take within the staleness bound: a new group "
                "would be generated only to be thrown away, so none may start until the trainer "
                "takes some"
            )
        with self._lock:
            held, admitted = self.held, len(self.admitted)
        return {
            "budget": budget,
            "capacity": capacity,
            "inputs": {
                "staleness": staleness.as_dict(),
                "batch_groups": batch.as_dict(),
                "in_progress": {"value": total - surplus, "source": "observed", **in_progress},
                "completion_rate": {
                    "value": self.completion_rate,
                    "source": "learned: the share of started groups that reached K (capacity is "
                    "divided by it, at most doubled); null until 20 groups ended",
                },
                "trainer_surplus": {
                    "value": surplus,
                    "source": "estimated: groups served minus B per step (weight versions "
                    "advanced, or the trainer's bursts of polls)",
                },
            },
            "current_weight_version": current_version,
            "why": why,
            "gate": {
                "admitted_groups": admitted,
                "held_calls": held,
                "admitted_total": self.admitted_total,
                "held_total": self.held_total,
            },
        }

    # -- the gate --------------------------------------------------------------------------------
    def ask(
        self,
        group_id: str | None,
        in_progress: int,
        *,
        started: bool = False,
        current_version: int | None = None,
    ) -> bool:
        """A session of ``group_id`` makes its first model call: may it go now? An admitted
        group always may, and so does one that had started already (another session of it wrote
        a row: holding this one would keep the group from completing); another is admitted while
        the budget lasts. A session whose group is not known (not in job_environments) is never
        held: it cannot be paced by group."""
        with self._lock:
            if group_id is None or group_id in self.admitted:
                return True
            if started:
                self.admitted.add(group_id)
                return True
            surplus = self._surplus_locked(current_version)
            if self.capacity_locked() - in_progress - surplus > 0:
                self.admitted.add(group_id)
                self.admitted_total += 1
                return True
            return False

    def admit(self, group_id: str | None) -> None:
        """Admit a group whatever the budget (one of its sessions is running already)."""
        if group_id is not None:
            with self._lock:
                self.admitted.add(group_id)

    def capacity_locked(self) -> int:
        """(S + 1) x B, with the lock held."""
        return self._stretch((self.staleness.value + 1) * self._batch_locked())

    def _batch_locked(self) -> int:
        """B, with the lock held (without taking it again)."""
        if self._batch_setting is not None:
            return self._batch_setting
        if self._bursts:
            return max(1, int(statistics.median(self._bursts)))
        return DEFAULT_BATCH_GROUPS

    def holding(self, delta: int) -> None:
        """The gate holds one more (+1) or one fewer (-1) first call."""
        with self._lock:
            self.held += delta
            if delta > 0:
                self.held_total += 1

    def forget(self, group_ids: set[str]) -> None:
        """Groups decided (served or dropped): no longer in progress."""
        if group_ids:
            with self._lock:
                self.admitted -= group_ids
