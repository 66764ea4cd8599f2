"""The active job's queue of served groups to deliver again after a trainer restarted from a
checkpoint, and its figures (the rule that fills it is :mod:`rollout_buffer.serving.redelivery`).

Owns: the in-memory queue behind its own small lock. It must not do I/O: the store records the
queue before it changes here.
"""

from __future__ import annotations

import collections
import threading

from rollout_buffer.core.model import Decisions


class Redeliveries:
    """The active job's served groups waiting to be delivered again, in order, and their figures."""

    def __init__(
        self, queued: list[str] | None = None, totals: dict[str, int] | None = None
    ) -> None:
        self._lock = threading.Lock()
        self._queue: collections.deque[str] = collections.deque(queued or ())
        self.taken: set[str] = set()  # popped by a poll that has not recorded nor given them back
        self.totals = {
            "requested": 0,
            "delivered": 0,
            "cancelled": 0,
            "failed": 0,
            **(totals or {}),
        }

    def __len__(self) -> int:
        return len(self._queue)

    def replace(self, queue: list[str], cancelled: int) -> None:
        """The queue as the store recorded it for a new skip list."""
        with self._lock:
            self._queue = collections.deque(queue)
            self.totals["requested"] += len(queue)
            self.totals["cancelled"] += cancelled

    def pop(self, n: int) -> list[str]:
        with self._lock:
            out = [self._queue.popleft() for _ in range(min(n, len(self._queue)))]
            self.taken.update(out)
            return out

    def put_front(self, group_ids: list[str]) -> None:
        """Give popped groups back, first again and in their order (a poll failed or ran out of
        budget)."""
        with self._lock:
            self._queue.extendleft(reversed([g for g in group_ids if g not in self._queue]))
            self.taken.difference_update(group_ids)

    def remove(self, group_ids: list[str]) -> None:
        with self._lock:
            gone = set(group_ids)
            self._queue = collections.deque(g for g in self._queue if g not in gone)
            self.taken -= gone

    def settled(self, plan: Decisions) -> None:
        """A recorded plan delivered some groups again, or found that it could not."""
        with self._lock:
            for gid, why in plan.redelivered.items():
                self.totals["delivered" if why is None else "failed"] += 1
                self.taken.discard(gid)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"queued": len(self._queue), **self.totals}
