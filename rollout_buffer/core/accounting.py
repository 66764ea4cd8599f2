"""A job's accounting (SPEC §3): what became of every row and group it read, kept across restarts,
and what the served and the dropped groups looked like (issue 10, drop bias).

Owns: the counters of the identity ``read = served + dropped (by reason) + rejected (by reason)
+ pending``, counted in distinct step_pks, the group counts by outcome, the groups dropped since the
last served batch (``meta_info.filtered``), and the group figures: the running sums per outcome
(served, or dropped with its reason) of groups, sessions, steps and terminal rewards, from which
/stats and /metrics show the mean steps per session and the mean terminal reward (so an operator
sees when a policy or the TTL keeps removing long or hard episodes), and the per-group
``meta_info.group_stats`` of a served batch. Pure values: no I/O and no lock of its own (the
accumulator's lock guards a job's :class:`Counts`); it decides and drops nothing, and it must not
be changed but under the accumulator's lock.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from rollout_buffer.core.model import INCOMPLETE_IN_SERVED
from rollout_buffer.core.salvage import Tally

SERVED_KEY = "served"
_FLOAT_MAX = 1.7976931348623157e308


def finite_sum(values: Iterable[float]) -> tuple[float, int]:
    """The sum of the finite values (clamped to the float range, never inf) and how many there
    were."""
    finite = [v for v in values if math.isfinite(v)]
    try:
        total = math.fsum(finite)
    except OverflowError:  # rewards near the float limit
        total = sum(finite)
    return max(-_FLOAT_MAX, min(_FLOAT_MAX, total)), len(finite)


@dataclass
class Sums:
    """Sums over the groups of one outcome."""

    groups: int = 0
    sessions: int = 0
    steps: int = 0
    reward_sum: float = 0.0
    rewarded: int = (
        0  # sessions with a terminal reward (a dropped group's incomplete ones have none)
    )

    def view(self) -> dict[str, Any]:
        mean = self.reward_sum / self.rewarded if self.rewarded else None
        return {
            "groups": self.groups,
            "steps_per_session": round(self.steps / self.sessions, 4) if self.sessions else None,
            # None also when the sum overflowed (rewards near the float limit): never inf in JSON
            "terminal_reward_mean": round(mean, 6)
            if mean is not None and math.isfinite(mean)
            else None,
        }


class Figures:
    """Per outcome: ``served`` or a drop reason."""

    def __init__(self) -> None:
        self.by: dict[str, Sums] = {}

    def add(
        self, key: str, sessions: int, steps: int, rewards: Iterable[float], groups: int = 1
    ) -> None:
        s = self.by.get(key)
        if s is None:
            s = self.by[key] = Sums()
        total, n = finite_sum(rewards)
        s.groups += groups
        s.sessions += sessions
        s.steps += steps
        s.reward_sum += total
        s.rewarded += n

    def load(
        self, key: str, groups: int, sessions: int, steps: int, reward_sum: float, rewarded: int
    ) -> None:
        """Sums recorded before a restart (records.JobTotals)."""
        s = self.by.setdefault(key, Sums())
        s.groups += groups
        s.sessions += sessions
        s.steps += steps
        s.reward_sum += reward_sum
        s.rewarded += rewarded

    def view(self) -> dict[str, Any]:
        """{"served": {...}, "dropped": {reason: {...}}} for /stats."""
        served = self.by.get(SERVED_KEY, Sums())
        return {
            "served": served.view(),
            "dropped": {k: v.view() for k, v in sorted(self.by.items()) if k != SERVED_KEY},
        }


def _stats(values: list[float]) -> tuple[float, float, float, float]:
    """Mean, population std, min, max; computed on scaled values so that huge finite rewards never
    overflow to inf (meta_info must stay valid JSON)."""
    n = len(values)
    scale = max(abs(v) for v in values) or 1.0
    scaled = [v / scale for v in values]
    mean = math.fsum(scaled) / n
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in scaled) / n)

    def clamp(x: float) -> float:
        return max(-_FLOAT_MAX, min(_FLOAT_MAX, x * scale))

    return clamp(mean), clamp(std), min(values), max(values)


def group_stats(
    group_id: str,
    session_rewards: list[float],
    n_items: int,
    weight_versions: list[int],
    wait_s: float | None,
    age_s: float | None,
) -> dict[str, Any]:
    """One object of ``meta_info.group_stats``: rewards over sessions (each session's terminal
    reward once), versions over items, steps per session, wait (ready -> served) and age (first
    row -> served)."""
    mean, std, lo, hi = _stats(session_rewards) if session_rewards else (0.0, 0.0, 0.0, 0.0)
    n = len(session_rewards)
    return {
        "group_id": group_id,
        "sessions": n,
        "items": n_items,
        "reward_mean": mean,
        "reward_std": std,
        "reward_min": lo,
        "reward_max": hi,
        "weight_version_min": min(weight_versions) if weight_versions else 0,
        "weight_version_max": max(weight_versions) if weight_versions else 0,
        "steps_mean": n_items / n if n else 0.0,
        "wait_s": None if wait_s is None else round(max(0.0, wait_s), 3),
        "age_s": None if age_s is None else round(max(0.0, age_s), 3),
    }


class Counts:
    """One job's counters."""

    def __init__(self) -> None:
        self.rows_read = 0
        self.pending_rows = 0
        self.served_rows = 0
        self.dropped: Counter[str] = Counter()  # rows, by reason
        self.rejected: Counter[str] = Counter()  # rows, by reason
        self.groups_served = 0
        self.groups_partial = 0  # served short of K (ROLLOUT_BUFFER_MIN_GROUP_SIZE), also in served
        self.groups_dropped: Counter[str] = Counter()
        self.figures = Figures()
        self.filtered: Counter[str] = (
            Counter()
        )  # groups dropped since the last served batch, by reason
        self.salvaged = Tally()  # served groups with truncated sessions (issue 38)

    def load(self, totals: Any) -> None:
        """A job's durable totals (a :class:`~rollout_buffer.storage.store.JobTotals`), before any
        row is ingested again: the row and group counters, the figures and ``filtered``."""
        self.rows_read = totals.accounted_rows
        self.served_rows = totals.served_rows
        self.dropped.update(totals.dropped)
        self.rejected.update(totals.rejected)
        self.groups_served = totals.groups_served
        self.groups_partial = totals.groups_partial
        self.groups_dropped.update(totals.groups_dropped)
        for fig in totals.figures:
            self.figures.load(*fig)
        self.filtered.update(totals.filtered)
        for reason, n_groups in totals.salvaged:
            self.salvaged.load(reason, n_groups)

    def group_dropped(
        self, reason: str, rows: int, sessions: int, rewards: Iterable[float]
    ) -> None:
        """A group was dropped with ``rows`` rows accounted to it."""
        self.dropped[reason] += rows
        self.groups_dropped[reason] += 1
        self.figures.add(reason, sessions, rows, rewards)
        self.filtered[reason] += 1

    def group_served(
        self,
        rows: int,
        incomplete_rows: int,
        sessions: int,
        rewards: Iterable[float],
        partial: bool = False,
    ) -> None:
        """A group was served (its incomplete sessions' rows are dropped with it); ``partial``:
        short of K."""
        self.groups_served += 1
        self.groups_partial += partial
        self.served_rows += rows
        if incomplete_rows:
            self.dropped[INCOMPLETE_IN_SERVED] += incomplete_rows
        self.figures.add(SERVED_KEY, sessions, rows, rewards)

    def batch_reported(self, filtered: dict[str, int] | None) -> None:
        """A served batch reported these drops in its meta_info: they are no longer "since"."""
        if filtered:
            self.filtered -= Counter(filtered)

    def view(self) -> dict[str, Any]:
        """The row and group counters for /stats (the accumulator adds its gauges)."""
        return {
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
                "served": self.groups_served,
                "partial": self.groups_partial,
                "dropped": dict(self.groups_dropped),
                "dropped_total": sum(self.groups_dropped.values()),
            },
            "figures": self.figures.view(),
        }
