"""The accumulator's one lock (issue 36): ingest and TTL cleanup hold it in bounded pieces, so a
poll waits behind one piece, never behind a whole batch."""

from __future__ import annotations

import threading

from rollout_buffer.core.accumulator import PIECE, Accumulator


class RecordingLock:
    """The accumulator's lock, recording how many rows were read and groups decided in each hold."""

    def __init__(self, accumulator: Accumulator) -> None:
        self.inner = threading.Lock()
        self.accumulator = accumulator
        self.holds: list[tuple[int, int]] = []

    def _work(self) -> tuple[int, int]:
        return self.accumulator.counts.rows_read, len(self.accumulator.decided)

    def __enter__(self) -> RecordingLock:
        self.inner.acquire()
        self.start = self._work()
        return self

    def __exit__(self, *exc: object) -> None:
        rows, decided = self._work()
        self.holds.append((rows - self.start[0], decided - self.start[1]))
        self.inner.release()


def test_a_20000_row_batch_is_ingested_in_pieces_of_at_most_200_rows_per_hold() -> None:
    accumulator = Accumulator("j", 2)
    lock = accumulator.lock = RecordingLock(accumulator)  # type: ignore[assignment]
    rows = [(i + 1, f"s{i}", f"g{i // 2}", 1) for i in range(20_000)]
    plan = accumulator.ingest(rows)
    assert PIECE == 200
    assert len(lock.holds) == 100 and max(r for r, _ in lock.holds) == 200
    # the same result as one batch: every group of two completed sessions is ready, in row order
    assert plan.newly_ready == 10_000 and list(accumulator.ready)[:3] == ["g0", "g1", "g2"]
    assert accumulator.stats()["rows"]["read"] == 20_000


def test_ttl_cleanup_drops_at_most_200_groups_per_hold() -> None:
    clock = [0.0]
    accumulator = Accumulator("j", 2, clock=lambda: clock[0])
    accumulator.ingest([(i + 1, f"s{i}", f"g{i}", 0) for i in range(1_000)])
    clock[0] = 100.0
    accumulator.ingest([(5_000, "late", "young", 0)])  # active now: the TTL keeps it
    lock = accumulator.lock = RecordingLock(accumulator)  # type: ignore[assignment]
    plan = accumulator.expire(60.0)
    assert len(plan.drops) == 1_000 and list(accumulator.pending) == ["young"]
    # five full holds, and a sixth that finds the oldest group alive and stops
    assert [d for _, d in lock.holds] == [200] * 5 + [0]
