"""A job's accounting (SPEC §3): what became of every row and group it read, kept across restarts.

Owns: the counters of the identity ``read = served + dropped (by reason) + rejected (by reason)
+ pending``, counted in distinct step_pks, the group counts by outcome, the group figures
(:mod:`~rollout_buffer.core.figures`) and the groups dropped since the last served batch
(``meta_info.filtered``). Pure values: no I/O and no lock of its own (the accumulator's lock
guards it); it decides nothing, and it must not be changed but under the accumulator's lock.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from rollout_buffer.core.figures import SERVED_KEY, Figures
from rollout_buffer.core.model import INCOMPLETE_IN_SERVED
from rollout_buffer.core.salvage import Tally


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
