"""The values the buffer's tables hold, as the store reads and writes them.

Owns: the one builder of a ``rollout_buffer_groups`` row (a served or dropped group's record), what
loading a job gives back (:class:`JobTotals`), the launcher identity stored with a job, an
unconfirmed decision for the proxy, and the steady wall clock records are aged by. No I/O: the
store runs the statements.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from rollout_buffer.core.figures import finite_sum
from rollout_buffer.core.model import (
    DROPPED,
    PARTIAL,
    SERVED,
    Drop,
    LauncherState,
    NotifyKey,
    Served,
)
from rollout_buffer.core.salvage import record_reason

_WALL0, _MONO0 = time.time(), time.monotonic()


def steady_wall() -> float:
    """Epoch seconds for ageing what was recorded (batches, ended jobs), never ahead of this
    process's monotonic clock: a wall clock stepped forward (NTP, a resumed VM) would otherwise age
    everything at once, and housekeeping would delete the batch of a poll answered a second ago (its
    retry would then get new groups, and the first batch's groups would be lost)."""
    return min(time.time(), _WALL0 + time.monotonic() - _MONO0)


@dataclass
class JobTotals:
    """A job's durable decisions and counters, to load into a fresh accumulator."""

    decided: dict[str, str] = field(default_factory=dict)
    served_rows: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    rejected: Counter[str] = field(default_factory=Counter)
    groups_served: int = 0
    groups_partial: int = 0  # served short of K (recorded with the reason ``partial``)
    groups_dropped: Counter[str] = field(default_factory=Counter)
    # (outcome: "served" or a drop reason, groups, sessions, steps, reward_sum, sessions with a
    # reward)
    figures: list[tuple[str, int, int, int, float, int]] = field(default_factory=list)
    filtered: dict[str, int] = field(
        default_factory=dict
    )  # groups dropped since the last served one
    salvaged: list[tuple[str, int]] = field(
        default_factory=list
    )  # (recorded reason, groups) of served salvaged groups (core.salvage.record_reason)

    @property
    def accounted_rows(self) -> int:
        return self.served_rows + sum(self.dropped.values()) + sum(self.rejected.values())


@dataclass(frozen=True)
class LauncherRecord:
    """The launcher identity stored with a job (adopted after a crash only if it still matches)."""

    pid: int | None
    pgid: int | None
    start_ticks: int | None
    state: LauncherState
    host: str | None = None  # adopted only on this host (procfs.host_id)


@dataclass(frozen=True)
class Unnotified:
    """A recorded decision whose sessions the proxy has not confirmed clearing."""

    reason: str
    sessions: list[str]
    group_ids: list[str]
    key: NotifyKey


def group_record(job_id: str, d: Served | Drop, now: float) -> tuple[Any, ...]:
    """The one builder of a rollout_buffer_groups row (q.INSERT_GROUP's columns)."""
    figures = finite_sum(d.rewards)
    if isinstance(d, Served):
        t = d.take
        inc = t.incomplete_pks
        pks = sorted(t.served_pks + inc)
        clear = sorted(t.incomplete)
        return (
            job_id,
            t.group_id,
            SERVED,
            PARTIAL if t.partial else record_reason(t.salvage) if t.salvage else None,
            d.batch_id,
            len(t.served_pks),
            len(inc),
            ",".join(map(str, pks)),
            json.dumps(clear),
            0 if clear else 1,
            now,
            len(t.completed),
            *figures,
        )
    return (
        job_id,
        d.group_id,
        DROPPED,
        d.reason,
        None,
        0,
        len(d.pks),
        ",".join(map(str, d.pks)),
        json.dumps(d.clear_sessions),
        0 if d.clear_sessions else 1,
        now,
        len(d.clear_sessions),
        *figures,
    )
