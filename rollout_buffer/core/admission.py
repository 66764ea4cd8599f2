"""How many more groups may start now (issue 23): the admission budget, and which groups the
pacing gate has admitted.

AReaL's rule is the starting point: the trainer takes B groups a step and accepts a group whose
weight version is at most S behind its own, so at most (S + 1) x B groups may be in progress
(running, pending, ready or built) without producing a group the trainer will throw away:

    budget = (S + 1) x B + spares left - groups in progress - the trainer's surplus

The trainer's surplus is modelled from what the buffer served it, each group with its weight
version: the upstream client's ``{}`` polls take every ready group and keep the ones it does not
train on yet. It polls only while it collects; once it holds B groups it trains on the oldest B,
and that batch claims its place until the step ends (a group that starts now is for the next
step). The steps it completed are the largest of: the weight versions advanced (the job's, and
the proxy's stamp as the gate reads it, which moves the moment a step ends), its bursts of polls
(an idle gap ends one), and its full batches (a poll after a full batch ends that step). Of the
groups it holds beyond its batch, those too old for its next step claim no place: it will throw
them away, and new groups must replace them.

A group that loses a session (its environment crashed) never completes: the budget admits its
replacement once that is seen, and the trainer waits for it when the loss came late in its step.
Where groups are lost often, a few spare groups a step hedge that: the first losses of a step use
them up, and none is admitted again for them. A spare left unused is thrown away (too old for the
step after), so there are as many as keep the expected number left unused, from the share of the
last groups ended that were lost, within ``ROLLOUT_BUFFER_PACING_SPARE_WASTE`` x B; none where
groups are rarely lost.

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

import functools
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass
from typing import NamedTuple

DEFAULT_STALENESS = 1
DEFAULT_BATCH_GROUPS = 8
UNVERSIONED = 2**62  # a served group without a weight version: never too old
MAX_HELD = 100_000  # groups the model of the trainer's holdings keeps (the youngest)
BURSTS_KEPT = 5  # B is the median of the groups taken in the last few bursts
DEFAULT_SPARE_WASTE = 0.03


class Claims(NamedTuple):
    """The trainer's groups that claim a place in the budget."""

    training: int  # the batch it trains on (a group that starts now is for its next step)
    fresh: int  # held beyond that batch, still fresh at its next step
    going_stale: int  # held beyond that batch, too old for its next step (not counted)

    @property
    def total(self) -> int:
        return self.training + self.fresh


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
        spare_waste: float = DEFAULT_SPARE_WASTE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._lock = threading.Lock()
        self.clock = clock
        self.idle_gap_s = idle_gap_s
        self.spare_waste = spare_waste
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
        self._last_poll: float | None = None  # when the trainer's last poll ended
        self.admitted: set[str] = set()  # groups the gate let start (decided ones: pruned)
        self._pruned_size = 0
        self.served = 0  # groups the trainer took (polls)
        self.completion_rate: float | None = None  # of the groups that started, reaching K
        self.lost_share: float | None = None  # of the groups that ended last, taken for lost
        self.lost_groups = 0  # groups of the job seen lost so far (a session failed for good)
        self._lost_at_batch = 0  # lost_groups when the trainer's last batch formed
        self.first_versions: dict[str, int] = {}  # each version source's first version seen
        # the trainer's holdings as the buffer models them: the versions of the groups it took
        # and has not started training on (sorted; a group without a version: UNVERSIONED)
        self._held: list[int] = []
        self._batches = 0  # batches it started training on
        # it polls only while it collects: a poll that began after a batch formed says it is
        # done with that batch (a trainer that polls without pause has no idle gap)
        self._batch_formed_at: float | None = None
        self._batches_done = 0
        self._last_job_version: int | None = None  # the job's current version last given
        self.proxy_version: int | None = None  # the largest version the proxy stamped (gate)
        self.admitted_total = 0
        self.held_total = 0

    # -- the trainer's demand ---------------------------------------------------------------------
    def took(
        self, groups: int, versions: Iterable[int | None] = (), *, began: float | None = None
    ) -> None:
        """A poll that began at ``began`` (default: now) took ``groups`` groups (``versions``:
        each one's weight version, None when it has none). A poll that began an idle gap after
        the trainer's last poll ended, empty or not, starts a new burst: the trainer trained
        meanwhile. Between the polls that took groups, it may have been polling all along,
        waiting for groups (producers slower than it): those gaps are not steps. A poll that
        began after the trainer's last full batch was taken says it is done with it."""
        now = self.clock()
        with self._lock:
            began = now if began is None else began
            if self._batch_formed_at is not None and began > self._batch_formed_at:
                self._batches_done = self._batches
            if self._last_poll is not None and began - self._last_poll > self.idle_gap_s:
                if self._burst:
                    self._bursts.append(self._burst)
                    self._bursts_ended += 1
                self._burst = 0
            # (two threads' polls overlap: the trainer polled until the later end)
            self._last_poll = now if self._last_poll is None else max(self._last_poll, now)
            if groups:
                self._burst += groups
                self.served += groups
                self._hold(groups, versions, now)

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
        """(S + 1) x B: the groups that may be in progress at once."""
        return (self.staleness.value + 1) * self.batch_groups.value

    def surplus(self, current_version: int | None) -> int:
        """The trainer's groups that still claim a place: its batch in training, and those it
        holds beyond it that will still be fresh at its next step."""
        with self._lock:
            return self._claims_locked(current_version).total

    def _hold(self, groups: int, versions: Iterable[int | None], now: float) -> None:
        """(Lock held.) The trainer took ``groups`` groups: it throws away those too old for the
        step it collects, and once it holds a full batch it trains on the oldest B."""
        batch = self._batch_locked()
        job_version = self._last_job_version
        version = self._version_locked(job_version)
        if version is not None:
            floor = version - self.staleness.value
            self._held = [v for v in self._held if v >= floor]
        taken = [UNVERSIONED if v is None else v for v in versions]
        taken += [UNVERSIONED] * (groups - len(taken))
        self._held = sorted(self._held + taken)[-MAX_HELD:]
        while len(self._held) >= batch and self._batches <= self._steps_locked(job_version, batch):
            del self._held[:batch]
            self._batches += 1
            self._batch_formed_at = now
            self._lost_at_batch = self.lost_groups  # the spares are for the step it collects next

    def _claims_locked(self, current_version: int | None) -> Claims:
        """What the trainer holds, modelled from what it took and the steps it completed. It
        polls only while it collects: once it holds a full batch it trains on the oldest B of
        them, and a group that starts now is for its next step. Of the groups it holds beyond
        that batch, those too old for its next step are not counted (it will throw them
        away)."""
        batch = self._batch_locked()
        version = self._version_locked(current_version)
        self._last_job_version = current_version
        steps = self._steps_locked(current_version, batch)
        training = batch if self._batches > steps else 0
        if version is None:
            return Claims(training, len(self._held), 0)
        floor = version + (1 if training else 0) - self.staleness.value
        fresh = sum(1 for v in self._held if v >= floor)
        return Claims(training, fresh, len(self._held) - fresh)

    def _spares_locked(self) -> tuple[int, int]:
        """(Lock held.) The spare groups of a step, and those left in the one under way: the
        losses seen since the trainer's last batch formed use them up."""
        per_step = spares_for(self._batch_locked(), self.lost_share, self.spare_waste)
        lost = max(0, self.lost_groups - self._lost_at_batch)
        return per_step, max(0, per_step - lost)

    def _version_locked(self, current_version: int | None) -> int | None:
        """The trainer's version as best known: the freshest of the job's and the proxy's stamp,
        and at least the first one plus the trainer's bursts ended (a poll after an idle gap
        comes from its next step, before any answer carries the new version)."""
        known = [v for v in (current_version, self.proxy_version) if v is not None]
        if not known:
            return None
        first = min(self.first_versions.values(), default=min(known))
        return max(*known, first + self._bursts_ended)

    def _steps_locked(self, current_version: int | None, batch: int) -> int:
        """The trainer's training steps completed, the largest of: the weight versions advanced
        since the job's first, by each source (the job's current version from the trainer or the
        rows, and the proxy's stamp as the gate saw it in answers: the freshest, as it moves when
        a step ends); the trainer's bursts of polls ended; and the full batches it took, less the
        one it may be training on unless it polled since."""
        steps = max(self._bursts_ended, self._batches - 1, self._batches_done, 0)
        for source, version in (("job", current_version), ("proxy", self.proxy_version)):
            if version is None:
                continue
            first = self.first_versions.setdefault(source, version)
            if version < first:  # the job's version went back: count from there
                self.first_versions[source] = first = version
            steps = max(steps, version - first)
        return steps

    def saw_version(self, version: int) -> None:
        """The LLM proxy stamped ``version`` on an answer (the gate reads it as it forwards): the
        trainer's steps are seen as they end, not when rows of the new version complete groups.
        A wrong version cannot make the budget exceed the capacity and the step's spares less
        the groups in progress: it only makes the trainer's claims look smaller."""
        if version >= 0:
            with self._lock:
                self.first_versions.setdefault("proxy", version)
                if self.proxy_version is None or version > self.proxy_version:
                    self.proxy_version = version

    def report(self, in_progress: dict[str, int], current_version: int | None) -> dict[str, object]:
        """``GET /admission``: the budget, its inputs with where each came from, and why."""
        with self._lock:
            claims = self._claims_locked(current_version)
            version = self._version_locked(current_version)
            steps = self._steps_locked(current_version, self._batch_locked())
            admitted = len(self.admitted)
            spares, spares_left = self._spares_locked()
            lost_this_step = max(0, self.lost_groups - self._lost_at_batch)
        progress = sum(v for k, v in in_progress.items() if k != "stalled")
        total = progress + claims.total
        staleness, batch = self.staleness, self.batch_groups
        capacity = (staleness.value + 1) * batch.value
        budget = max(0, capacity + spares_left - total)
        if budget:
            why = (
                f"{total} groups in progress or held by the trainer, of the {capacity} = (S "
                f"{staleness.value} + 1) x B {batch.value} it can train on within the staleness "
                f"bound: {budget} more may start"
            )
            if spares_left:
                why += f" (with {spares_left} spare: groups are lost often)"
        else:
            why = (
                f"{total} groups in progress or held by the trainer fill the {capacity} = (S "
                f"{staleness.value} + 1) x B {batch.value} it can train on within the staleness "
                "bound: a new group would be generated only to be thrown away, so none may start "
                "until the trainer takes some"
            )
        return {
            "budget": budget,
            "capacity": capacity,
            "inputs": {
                "staleness": staleness.as_dict(),
                "batch_groups": batch.as_dict(),
                "in_progress": {"value": progress, "source": "observed", **in_progress},
                "trainer_surplus": {
                    "value": claims.total,
                    "training": claims.training,
                    "fresh": claims.fresh,
                    "going_stale": claims.going_stale,
                    "steps_completed": steps,
                    "source": "estimated: the groups served less B per step completed (weight "
                    "versions advanced, the trainer's bursts of polls, or its full batches); the "
                    "batch it trains on, and the groups it holds that its next step can take",
                },
                "spare": {
                    "value": spares_left,
                    "per_step": spares,
                    "lost_this_step": lost_this_step,
                    "lost_share": self.lost_share,
                    "waste_bound": self.spare_waste,
                    "source": "learned: spare groups a step, so that those expected to go unused "
                    "(from lost_share, the share of the last 200 groups ended that were lost; "
                    "null until 20 ended) stay within waste_bound x B; the step's first losses "
                    "use them up (ROLLOUT_BUFFER_PACING_SPARE_WASTE)",
                },
                "completion_rate": {
                    "value": self.completion_rate,
                    "source": "observed: the share of started groups that reached K (not in the "
                    "budget: a group that lost a session leaves the in-progress count as soon as "
                    "that is seen); null until 20 groups ended",
                },
            },
            "current_weight_version": current_version,
            "proxy_weight_version": self.proxy_version,
            "version_for_staleness": version,
            "why": why,
            "gate": {
                "admitted_groups": admitted,
                "held_calls": 0,  # the gate's, when pacing is on (it holds calls of any job)
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
            claims = self._claims_locked(current_version).total
            _spares, spares_left = self._spares_locked()
            if self.capacity_locked() + spares_left - in_progress - claims > 0:
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
        return (self.staleness.value + 1) * self._batch_locked()

    def _batch_locked(self) -> int:
        """B, with the lock held (without taking it again)."""
        if self._batch_setting is not None:
            return self._batch_setting
        if self._bursts:
            return max(1, int(statistics.median(self._bursts)))
        return DEFAULT_BATCH_GROUPS

    def holding(self) -> None:
        """The gate holds a first call of this job."""
        with self._lock:
            self.held_total += 1

    def prune(self, decided: Container[str]) -> None:
        """Forget the admitted groups that have been decided, whenever the admitted set has
        doubled since the last time (amortised O(1) a question): every question of a held call
        costs O(admitted groups), and a long job admits groups by the hundred thousand."""
        with self._lock:
            if len(self.admitted) <= 2 * self._pruned_size + 64:
                return
            self.admitted = {g for g in self.admitted if g not in decided}
            self._pruned_size = len(self.admitted)

    def forget(self, group_ids: set[str]) -> None:
        """Groups decided (served or dropped): no longer in progress."""
        if group_ids:
            with self._lock:
                self.admitted -= group_ids


def spares_for(batch: int, lost_share: float | None, waste: float) -> int:
    """The most spare groups a step (at most ``batch``) for which the number expected to go unused
    is within ``waste`` x ``batch``, when each group is lost with probability ``lost_share`` (None:
    not known yet, no spare). The step's first losses use the spares up, so h of them go unused by
    max(0, h - L), L the losses among the B + h groups: that grows with h, so the largest h is
    found by bisection. The share is rounded to a thousandth: the answer is cached, as every
    question of a held call asks it."""
    if lost_share is None or lost_share <= 0.0 or waste <= 0.0 or batch < 1:
        return 0
    return _spares(batch, round(min(lost_share, 1.0), 3), waste)


@functools.lru_cache(maxsize=256)
def _spares(batch: int, p: float, waste: float) -> int:
    lo, hi = 0, batch  # unused(lo) is within the bound; find the largest such h
    while lo < hi:
        h = (lo + hi + 1) // 2
        if _expected_unused(h, batch + h, p) <= waste * batch:
            lo = h
        else:
            hi = h - 1
    return lo


def _expected_unused(h: int, n: int, p: float) -> float:
    """E[max(0, h - L)], L ~ Binomial(n, p) (in logarithms: n may be large)."""
    if p <= 0.0:
        return float(h)
    if p >= 1.0:
        return 0.0
    log_p, log_q = math.log(p), math.log1p(-p)
    total = 0.0
    for lost in range(min(h, n + 1)):
        log_pmf = (
            math.lgamma(n + 1)
            - math.lgamma(lost + 1)
            - math.lgamma(n - lost + 1)
            + lost * log_p
            + (n - lost) * log_q
        )
        total += (h - lost) * math.exp(log_pmf)
    return total
