"""The ready queue of one job: its ready groups in the serve order (ROLLOUT_BUFFER_SERVE_ORDER).

Owns: which ready group a poll takes next: first ready first, or by the min weight_version of the
sessions it serves (oldest or newest first, ties by readiness), and a group a poll gave back at its
old place. A dict of the ready groups by group_id (in readiness order) and, for a version order, a
heap of (key, seq, group_id): an entry is used only while it is its group's current key in the
dict, and entries of groups that left the queue are swept once they outnumber the live ones. No
I/O and no lock (the accumulator's lock guards it); it must not decide anything about a group.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict

from rollout_buffer.core.group import Group

SIGNS = {"ready": 0, "oldest_version": 1, "newest_version": -1}


class ReadyQueue(OrderedDict[str, Group]):
    """group_id -> ready Group, popped in the serve order with :meth:`pop_next`."""

    def __init__(self, serve_order: str = "ready") -> None:
        super().__init__()
        self._sign = SIGNS[serve_order]
        self._heap: list[tuple[int, int, str]] = []
        self._seq = itertools.count()

    def push(self, g: Group) -> None:
        """A group became ready: last in readiness, at its place in the version order."""
        if self._sign:
            self._sweep()
            g.order_key = (
                self._sign * (g.min_wv or 0),
                next(self._seq),
                g.group_id,
            )  # unknown: as 0
            heapq.heappush(self._heap, g.order_key)
        self[g.group_id] = g

    def put_front(self, g: Group) -> None:
        """A group a poll gave back: first again, at its old place in the version order."""
        if self._sign and g.order_key is not None:
            self._sweep()
            heapq.heappush(self._heap, g.order_key)
        self[g.group_id] = g
        self.move_to_end(g.group_id, last=False)

    def pop_next(self) -> Group:
        """(Not empty.) The next group in the serve order, removed."""
        if not self._sign:
            return self.popitem(last=False)[1]
        while True:
            key = heapq.heappop(self._heap)
            g = self.get(key[2])
            if g is not None and g.order_key == key:
                del self[key[2]]
                return g

    def _sweep(self) -> None:
        """Drop the entries of groups that left the queue (dropped, taken again, back to
        pending)."""
        if len(self._heap) > 2 * len(self) + 64:
            self._heap = [g.order_key for g in self.values() if g.order_key is not None]
            heapq.heapify(self._heap)
