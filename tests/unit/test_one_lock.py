"""The accumulator's one lock and its snapshot (issue 36): ingest and TTL cleanup hold the lock in
bounded pieces, so a poll waits behind one piece, never behind a whole batch; readers read an
immutable snapshot, swapped under the lock after each change at a cost that does not grow with the
job."""

from __future__ import annotations

import threading
from collections import OrderedDict

from rollout_buffer.core.accumulator import PIECE, Accumulator
from rollout_buffer.core.model import Decisions, Served


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
    between: list[tuple[int, bool]] = []  # what the loop runs between pieces (it lets polls run)
    plan = accumulator.ingest(
        rows, lambda: between.append((accumulator.counts.rows_read, lock.inner.locked()))
    )
    assert PIECE == 200
    assert len(lock.holds) == 100 and max(r for r, _ in lock.holds) == 200
    assert between == [(n, False) for n in range(200, 20_000, 200)]  # never under the lock
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


def test_dropping_every_group_holds_the_lock_200_groups_at_a_time() -> None:
    accumulator = Accumulator("j", 2)
    accumulator.ingest([(i + 1, f"s{i}", f"g{i}", 0) for i in range(700)])  # pending
    accumulator.ingest([(1_000 + i, f"r{i}", f"r{i // 2}", 1) for i in range(600)])  # 300 ready
    accumulator.census.schedule([(f"never{i}", f"t{i}") for i in range(450)])  # no row yet
    lock = accumulator.lock = RecordingLock(accumulator)  # type: ignore[assignment]
    plan = accumulator.drop_all("job_ended", include_ready=True)
    assert len(plan.drops) == 700 + 300 + 450
    assert not accumulator.pending and not accumulator.ready
    assert max(d for _, d in lock.holds) == 200
    assert accumulator.stats()["groups"]["dropped"] == {"job_ended": 1_450}


def test_readers_read_the_snapshot_never_the_lock() -> None:
    accumulator = Accumulator("j", 2)
    accumulator.ingest([(1, "a", "g", 1), (2, "b", "g", 1)])
    answers: list[dict] = []
    with accumulator.lock:  # a writer holds the lock: /stats still answers, from the snapshot
        reader = threading.Thread(target=lambda: answers.append(accumulator.stats()))
        reader.start()
        reader.join(5.0)
    assert answers and answers[0]["groups"]["ready"] == 1 and answers[0]["rows"]["read"] == 2


def test_the_snapshot_is_swapped_by_each_change_before_the_lock_is_released() -> None:
    accumulator = Accumulator("j", 2)
    accumulator.ingest([(1, "a", "g", 1), (2, "b", "g", 1)])
    before = accumulator.snapshot
    seen: list[int] = []
    real = accumulator._snapshot

    def swapped_while_held():  # the new snapshot is made with the lock still held
        seen.append(accumulator.lock.locked())
        return real()

    accumulator._snapshot = swapped_while_held  # type: ignore[method-assign]
    (take,) = accumulator.take_ready(None)
    accumulator.commit(Decisions(served=[Served(take, "b1")]))
    assert seen == [True, True]
    after = accumulator.stats()
    assert after["groups"]["served"] == 1 and after["rows"]["served"] == 2
    # the old snapshot never changed, and what a reader is handed is its own copy
    assert before.stats(0.0)["groups"]["served"] == 0 and before.ready == 1
    after["rows"]["served"] = 99
    assert accumulator.stats()["rows"]["served"] == 2


class CountingDict(OrderedDict):
    """A dict that counts how often it is iterated."""

    scans = 0

    def __iter__(self):
        CountingDict.scans += 1
        return super().__iter__()

    def values(self):
        CountingDict.scans += 1
        return super().values()

    def items(self):
        CountingDict.scans += 1
        return super().items()


def test_publishing_the_snapshot_costs_no_scan_of_the_job() -> None:
    accumulator = Accumulator("j", 2)
    accumulator.ingest([(i + 1, f"s{i}", f"g{i}", 0) for i in range(5_000)])
    accumulator.pending = CountingDict(accumulator.pending)
    accumulator.census.session_group = CountingDict(accumulator.census.session_group)
    CountingDict.scans = 0
    accumulator.set_versions(trainer=3)  # a change: the snapshot is swapped
    assert accumulator.stats()["versions"]["trainer"] == 3
    assert accumulator.stats()["groups"]["pending"] == 5_000 and CountingDict.scans == 0


class ServingBetweenPieces:
    """The accumulator's lock; after the first hold ends, a poll takes and serves what is ready,
    as one may between two pieces of a batch."""

    def __init__(self, accumulator: Accumulator) -> None:
        self.inner = threading.Lock()
        self.accumulator = accumulator
        self.served: list[str] = []
        self.late: Decisions | None = None

    def __enter__(self) -> ServingBetweenPieces:
        self.inner.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.inner.release()
        if self.late is None:
            self.late = Decisions()  # once: the poll's own changes take this lock too
            takes = self.accumulator.take_ready(None)
            self.served = [t.group_id for t in takes]
            self.late = self.accumulator.commit(Decisions(served=[Served(t, "b") for t in takes]))


def test_a_poll_between_two_pieces_serves_what_is_ready_and_the_rest_are_late_rows() -> None:
    accumulator = Accumulator("j", 2)
    lock = accumulator.lock = ServingBetweenPieces(accumulator)  # type: ignore[assignment]
    # g0 completes in the first piece; its third session's row comes in the second piece
    rows = [(1, "a", "g0", 1), (2, "b", "g0", 1)]
    rows += [(3 + i, f"s{i}", f"p{i}", 0) for i in range(PIECE - 2)]
    rows += [(1_000, "c", "g0", 1), (1_001, "d", "g1", 1), (1_002, "e", "g1", 1)]
    plan = accumulator.ingest(rows)
    assert lock.served == ["g0"]
    assert [(r.step_pk, r.reason) for r in plan.rows] == [(1_000, "late_rows_from_served_groups")]
    assert list(accumulator.ready) == ["g1"]
    s = accumulator.stats()["rows"]
    assert s["read"] == len(rows) == s["served"] + s["dropped_total"] + s["pending"]
