"""Group figures: what the served and the dropped groups looked like (issue 10, drop bias).

Owns: the running sums per outcome (served, or dropped with its reason) of groups, sessions, steps
and terminal rewards, from which /stats and /metrics show the mean steps per session and the mean
terminal reward (so an operator sees when a policy or the TTL keeps removing long or hard episodes),
and the per-group ``meta_info.group_stats`` of a served batch. Pure values: no I/O, no lock (the
accumulator's lock guards a job's :class:`Figures`); it must not decide or drop anything."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

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
