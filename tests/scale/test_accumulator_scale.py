"""The accumulator at scale (the slow tier, which CI runs): tens of thousands of rows to show that
a row and a poll cost no scan of the backlog, and four hundred randomized runs of every policy that
keep the per-row invariants. The unit tier keeps the accumulator's behaviour; these are its costs
and its randomized proof."""

from __future__ import annotations

from collections import OrderedDict

import pytest

from rollout_buffer.core.accumulator import Accumulator
from rollout_buffer.core.group import ReadyQueue
from rollout_buffer.core.model import Decisions, Policy, Row, Served

pytestmark = pytest.mark.slow


class CountingDict(OrderedDict):
    """A dict that counts how often it is iterated (a scan of all undecided groups shows up
    here)."""

    scans = 0

    def values(self):
        CountingDict.scans += 1
        return super().values()

    def items(self):
        CountingDict.scans += 1
        return super().items()

    def __iter__(self):
        CountingDict.scans += 1
        return super().__iter__()


def test_rows_without_group_id_cost_no_scan_of_the_undecided_groups():
    accumulator = Accumulator("j", 2)
    accumulator.ingest([(i + 1, f"s{i}", f"g{i}", 0) for i in range(10_000)])
    accumulator.pending = CountingDict(accumulator.pending)
    accumulator.ready = CountingDict(accumulator.ready)
    accumulator.taken = CountingDict(accumulator.taken)
    CountingDict.scans = 0
    # 10,000 rows without a group: 5,000 of sessions that have a group (which is dropped), 5,000
    # unknown
    rows = [(20_000 + i, f"s{i}" if i % 2 else f"x{i}", None, 1) for i in range(10_000)]
    plan = accumulator.ingest(rows)
    assert CountingDict.scans == 0
    assert len(plan.rows) == 10_000 and len(plan.drops) == 5_000
    assert all(d.reason == "malformed_row" for d in plan.drops)


def test_a_poll_costs_what_it_serves_not_the_backlog():
    accumulator = Accumulator("j", 1)
    accumulator.ingest([(i + 1, f"s{i}", f"g{i}", 1) for i in range(50_000)])

    class CountingReady(CountingDict, ReadyQueue):
        pass

    ready = CountingReady()
    ready.update(accumulator.ready)
    accumulator.ready = ready
    CountingDict.scans = 0
    takes = accumulator.take_ready(10)
    assert len(takes) == 10
    accumulator.release(takes[8:])
    assert CountingDict.scans == 0
    assert list(accumulator.ready)[:2] == [
        t.group_id for t in takes[8:]
    ]  # back at the front, in order


class _RandomRun:
    """One randomized run of every policy path (ingest in any order, TTL, take, release, commit, K
    changed) against per-row invariants: every row accounted once, the identity after every step,
    no session served twice or half or after it was dropped as oversampled, no more than K."""

    def __init__(self, seed: int) -> None:
        import random

        self.seed = seed
        self.rng = rng = random.Random(seed)
        self.k = rng.randint(1, 4)
        self.pol = Policy(
            max_off_policy=rng.choice([None, 1, 3]),
            drop_zero_variance=rng.random() < 0.3,
            oversample=rng.choice([0, 1, 2]),
            min_group_size=rng.choice([None, 1, 2]),
            serve_order=rng.choice(["ready", "oldest_version", "newest_version"]),
        )
        self.clock = [0.0]
        self.accumulator = Accumulator("j", self.k, clock=lambda: self.clock[0], policy=self.pol)
        self.groups = [f"g{i}" for i in range(rng.randint(1, 6))]
        self.sessions: dict[str, list] = {}  # sid -> [group, steps written, completed]
        self.session_pks: dict[str, list[int]] = {}
        self.accounted: dict[int, str] = {}
        self.served: dict[str, list[int]] = {}
        self.oversampled: set[str] = set()
        self.taken: list = []
        self.pk = 0

    def run(self) -> None:
        rng, accumulator = self.rng, self.accumulator
        for _ in range(rng.randint(20, 200)):
            op = rng.random()
            if op < 0.6:
                self.account(accumulator.ingest(self.new_rows()))
            elif op < 0.7:
                self.clock[0] += rng.choice([1, 50])
                self.account(accumulator.expire(30))
            elif op < 0.8:
                self.taken += [
                    (t, self.k) for t in accumulator.take_ready(rng.choice([None, 1, 2]))
                ]
            elif op < 0.9 and self.taken:
                if not self.serve_some():
                    continue
            elif op < 0.93:
                self.k = rng.randint(1, 4)
                self.account(accumulator.set_k(self.k)[1])
            self.check_step()
        for sid, pks in self.served.items():
            assert sorted(pks) == [p for p in self.session_pks[sid] if p <= max(pks)], (
                self.seed,
                "half session",
                sid,
            )

    def account(self, plan: Decisions) -> None:
        for d in plan.drops:
            for p in d.pks:
                assert p not in self.accounted, (self.seed, p)
                self.accounted[p] = d.reason
        for r in plan.rows:
            assert r.step_pk not in self.accounted, (self.seed, r)
            self.accounted[r.step_pk] = r.reason
            if r.reason == "oversampled" and r.session_id not in self.served:
                self.oversampled.add(r.session_id)

    def new_rows(self) -> list[Row]:
        """A few rows of new or running sessions (rarely one after a session completed)."""
        rng, sessions = self.rng, self.sessions
        rows = []
        for _ in range(rng.randint(1, 5)):
            sid = (
                rng.choice(list(sessions))
                if sessions and rng.random() < 0.7
                else f"s{len(sessions)}"
            )
            gid, n, done = sessions.setdefault(sid, [rng.choice(self.groups), 0, False])
            if done and rng.random() < 0.8:
                continue
            self.pk, comp = self.pk + 1, rng.random() < 0.35
            sessions[sid] = [gid, n + 1, done or comp]
            rows.append(
                Row(
                    self.pk,
                    sid,
                    gid,
                    int(comp),
                    n + 1,
                    rng.choice([0.0, 0.5, 1.0]),
                    rng.choice([0, 1, 3, None]),
                )
            )
            self.session_pks.setdefault(sid, []).append(self.pk)
        return rows

    def serve_some(self) -> bool:
        """Release or commit some taken groups; False when they were released."""
        rng, seed = self.rng, self.seed
        rng.shuffle(self.taken)
        n = rng.randint(1, len(self.taken))
        batch, self.taken = self.taken[:n], self.taken[n:]
        if rng.random() < 0.3:
            self.account(self.accumulator.release([t for t, _ in batch]))
            return False
        for t, k_then in batch:
            assert self.pol.oversample == 0 or len(t.completed) <= k_then, (seed, "more than K", t)
            for sid, pks in t.completed.items():
                assert sid not in self.served and sid not in self.oversampled, (seed, sid)
                self.served[sid] = list(pks)
            for p in t.served_pks + t.incomplete_pks:
                assert p not in self.accounted, (seed, p)
                self.accounted[p] = "served"
        self.account(self.accumulator.commit(Decisions(served=[Served(t, "b") for t, _ in batch])))
        return True

    def check_step(self) -> None:
        """The accounting identity, the low-water mark and the oldest group after a step."""
        accumulator, seed, pk = self.accumulator, self.seed, self.pk
        s = accumulator.stats()["rows"]
        assert s["read"] == s["served"] + s["dropped_total"] + s["rejected_total"] + s["pending"], (
            seed,
            s,
        )
        undecided = [
            g
            for d in (accumulator.pending, accumulator.ready, accumulator.taken)
            for g in d.values()
        ]
        low = min((g.min_pk for g in undecided if g.min_pk is not None), default=None)
        assert accumulator.low_water(pk) == (pk + 1 if low is None else low), (seed, "low water")
        first = min((g.first_seen for g in undecided), default=None)
        assert (accumulator.undecided.oldest().first_seen if undecided else None) == first, (
            seed,
            "oldest",
        )


def test_randomized_runs_of_every_policy_keep_the_per_row_invariants():
    for seed in range(400):
        _RandomRun(seed).run()
