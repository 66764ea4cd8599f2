"""Recent activity for the status page: 15 minutes of ingest and serve rates, the last 20 batches.

Owns: the poll counts and latency histogram (:class:`PollStats`, for /stats and /metrics), an
in-memory ring of 10-second buckets (rows ingested, groups and items served) and the
last batches a poll sent (groups, items, bytes, build and send time). The loop records ingest,
serving records each batch; the status page reads a snapshot. Nothing here is durable (a restart
starts an empty history) and nothing does I/O: every critical section is a few additions.

It must not be read for decisions: it is for display only.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

BUCKET_S = 10.0
WINDOW_S = 15 * 60.0
BATCHES_KEPT = 20
POLL_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0)


class _Bucket:
    __slots__ = ("groups", "index", "items", "rows")

    def __init__(self, index: int) -> None:
        self.index = index
        self.rows = 0
        self.groups = 0
        self.items = 0


class History:
    """Per-10-second counters over the last 15 minutes and the last 20 batches (thread-safe)."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._buckets: collections.deque[_Bucket] = collections.deque(
            maxlen=int(WINDOW_S / BUCKET_S)
        )
        self._batches: collections.deque[dict[str, Any]] = collections.deque(maxlen=BATCHES_KEPT)

    def _bucket(self, now: float) -> _Bucket:
        """(Lock held.) The bucket of ``now``, appended when it is a new one."""
        index = int(now // BUCKET_S)
        if not self._buckets or self._buckets[-1].index != index:
            self._buckets.append(_Bucket(index))
        return self._buckets[-1]

    def ingested(self, rows: int) -> None:
        """Rows the loop read (one call per read, never per row)."""
        now = self.clock()
        with self._lock:
            self._bucket(now).rows += rows

    def batch(
        self, batch_id: str, *, groups: int, items: int, n_bytes: int, build_s: float
    ) -> dict[str, Any]:
        """A batch was recorded and is about to be sent; returns its entry for :meth:`sent`."""
        now = self.clock()
        entry = {
            "batch_id": batch_id,
            "at": time.time(),
            "groups": groups,
            "items": items,
            "bytes": n_bytes,
            "build_s": round(build_s, 6),
            "send_s": None,
            "_t": now,
        }
        with self._lock:
            b = self._bucket(now)
            b.groups += groups
            b.items += items
            self._batches.append(entry)
        return entry

    def sent(self, entry: dict[str, Any]) -> None:
        """The batch's response was sent (or abandoned): its send time is now known."""
        took = self.clock() - entry["_t"]
        with self._lock:
            entry["send_s"] = round(took, 6)

    def snapshot(self) -> dict[str, Any]:
        """Rates per bucket, oldest first, over the whole window (empty buckets are zeros), and the
        last batches, newest first."""
        now = self.clock()
        with self._lock:
            by_index = {b.index: (b.rows, b.groups, b.items) for b in self._buckets}
            batches = [{k: v for k, v in e.items() if k != "_t"} for e in reversed(self._batches)]
        last = int(now // BUCKET_S)
        n = int(WINDOW_S / BUCKET_S)
        series: dict[str, list[float]] = {
            "ingest_rows_per_s": [],
            "served_groups_per_s": [],
            "served_items_per_s": [],
        }
        for index in range(last - n + 1, last + 1):
            rows, groups, items = by_index.get(index, (0, 0, 0))
            # the current bucket is partial: its rate is over the seconds it has run
            span = (now - index * BUCKET_S) if index == last else BUCKET_S
            span = max(span, 1.0)
            series["ingest_rows_per_s"].append(round(rows / span, 3))
            series["served_groups_per_s"].append(round(groups / span, 3))
            series["served_items_per_s"].append(round(items / span, 3))
        return {"bucket_s": BUCKET_S, "window_s": WINDOW_S, "rates": series, "batches": batches}


class PollStats:
    """Poll counts, a latency histogram and the polls waiting for data now, for /stats and
    /metrics."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.waiting = 0  # polls waiting for data now (bounded: ROLLOUT_BUFFER_MAX_WAITING_POLLS)
        self.count = 0
        self.with_data = 0
        self.replayed = 0  # answered from a kept batch (a request_id retried or resumed)
        self.seconds = 0.0
        self.buckets: collections.Counter[float] = collections.Counter()

    def start_waiting(self, limit: int) -> bool:
        """A poll starts waiting for data, unless ``limit`` polls wait already (False: answer it
        now)."""
        with self._lock:
            if self.waiting >= limit:
                return False
            self.waiting += 1
            return True

    def stop_waiting(self) -> None:
        with self._lock:
            self.waiting -= 1

    def observe(self, seconds: float, with_data: bool, replayed: bool = False) -> None:
        with self._lock:
            self.count += 1
            self.with_data += with_data
            self.replayed += replayed
            self.seconds += seconds
            self.buckets[next((b for b in POLL_BUCKETS if seconds <= b), float("inf"))] += 1

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "waiting": self.waiting,
                "count": self.count,
                "with_data": self.with_data,
                "replayed": self.replayed,
                "seconds_total": round(self.seconds, 6),
                "buckets": {b: self.buckets.get(b, 0) for b in (*POLL_BUCKETS, float("inf"))},
            }
