"""The accumulator alone (unit tier): grouping, accounting, hostile rows, TTL order. No I/O: a fake
clock, rows as tuples (step_pk, session_id, group_id, completed). The cost of a row and of a poll,
and the randomized runs, are in the slow tier (tests/scale)."""

from __future__ import annotations

from rollout_buffer.core.accumulator import Accumulator
from rollout_buffer.core.group import ReadyQueue
from rollout_buffer.core.model import Decisions, Policy, Row, Served


def test_accumulator_counts_balance_through_every_path():
    clock = [0.0]
    accumulator = Accumulator("j", 2, clock=lambda: clock[0])
    rows = [
        (1, "a", "g1", 0),
        (2, "a", "g1", 1),
        (3, "b", "g1", 1),
        (4, "c", "g2", 0),
        (5, "x", None, 1),
    ]
    dec = accumulator.ingest(rows)
    assert dec.newly_ready == 1 and [r.reason for r in dec.rows] == ["missing_group_id"]
    takes = accumulator.take_ready(None)
    assert [t.group_id for t in takes] == ["g1"]
    accumulator.ingest([(6, "a", "g1", 0)])  # arrives while the group is being served
    late = accumulator.commit(Decisions(served=[Served(t, "b1") for t in takes]))
    assert [(r.step_pk, r.reason) for r in late.rows] == [(6, "late_rows_from_served_groups")]
    clock[0] = 100.0
    expired = accumulator.expire(10.0)
    assert [d.group_id for d in expired.drops] == ["g2"] and expired.drops[0].clear_sessions == [
        "c"
    ]
    accumulator.ingest([(7, "c", "g2", 1)])
    s = accumulator.stats()["rows"]
    assert s == {
        "read": 7,
        "served": 3,
        "dropped": {
            "late_rows_from_served_groups": 1,
            "incomplete_group_ttl": 1,
            "late_rows_from_dropped_groups": 1,
        },
        "dropped_total": 3,
        "rejected": {"missing_group_id": 1},
        "rejected_total": 1,
        "pending": 0,
    }


def test_ttl_is_measured_from_the_last_ingested_row():
    clock = [0.0]
    accumulator = Accumulator("j", 2, clock=lambda: clock[0])
    accumulator.ingest([(1, "a", "g", 0)])
    clock[0] = 8.0
    accumulator.ingest([(2, "b", "g", 0)])
    clock[0] = 12.0
    assert not accumulator.expire(10.0).drops  # idle for 4 s only
    clock[0] = 18.5
    assert [d.reason for d in accumulator.expire(10.0).drops] == ["incomplete_group_ttl"]


def test_a_non_text_session_id_is_rejected_and_its_group_dropped():
    accumulator = Accumulator("j", 2)
    plan = accumulator.ingest(
        [(1, "a", "g1", 1), (2, b"blob-session", "g1", 1), (3, "c", "g2", 1), (4, "d", "g2", 1)]
    )
    assert [(r.step_pk, r.reason, r.session_id) for r in plan.rows] == [
        (2, "invalid_session_id", None)
    ]
    assert [(d.group_id, d.reason, d.clear_sessions) for d in plan.drops] == [
        ("g1", "malformed_row", ["a"])
    ]
    assert plan.newly_ready == 1  # g2 is not blocked
    assert [t.group_id for t in accumulator.take_ready(None)] == ["g2"]
    # a later row of the tainted group is a late row of a dropped group, never a new group
    late = accumulator.ingest([(5, "e", "g1", 1)])
    assert [r.reason for r in late.rows] == ["late_rows_from_dropped_groups"]


def test_a_non_text_session_id_for_a_group_not_seen_yet_drops_it_when_it_appears():
    accumulator = Accumulator("j", 1)
    plan = accumulator.ingest([(1, None, "g1", 1)])
    assert [r.reason for r in plan.rows] == ["invalid_session_id"] and not plan.drops
    plan = accumulator.ingest([(2, "a", "g1", 1)])
    assert [d.group_id for d in plan.drops] == ["g1"] and plan.newly_ready == 0
    assert accumulator.stats()["rows"]["read"] == 2 and not accumulator.ready


def test_raising_k_keeps_the_ttl_whatever_the_queue_order():
    clock = [0.0]
    accumulator = Accumulator("j", 2, clock=lambda: clock[0])
    accumulator.ingest([(1, "a", "old", 1), (2, "b", "old", 1)])  # ready at t=0 with K=2
    for t in range(1, 60):
        clock[0] = float(t)
        accumulator.ingest([(100 + t, f"s{t}", f"busy{t}", 0)])  # newer activity, pending
    clock[0] = 65.0
    accumulator.set_k(3)  # "old" goes back to pending, idle since t=0
    clock[0] = 70.0
    out = accumulator.expire(60.0)
    # idle 70 s with a TTL of 60 s: dropped at the first check, behind the younger groups; ready
    # once under K=2, it is never served short of the K in force (issue 35, item 1)
    assert (out.drops[0].group_id, out.drops[0].reason) == ("old", "incomplete_group_ttl")
    assert "old" not in accumulator.ready and out.newly_ready == 0


def test_raising_k_serves_a_group_short_of_it_only_as_a_partial_group():
    clock = [0.0]
    policy = Policy(min_group_size=2)
    accumulator = Accumulator("j", 2, clock=lambda: clock[0], policy=policy)
    accumulator.ingest([(1, "a", "old", 1), (2, "b", "old", 1)])
    accumulator.set_k(3)
    clock[0] = 70.0
    out = accumulator.expire(60.0)
    assert out.drops == [] and out.newly_ready == 1
    (take,) = accumulator.take_ready(None)
    assert take.group_id == "old" and take.partial


def test_raising_k_makes_ready_groups_pending_again():
    accumulator = Accumulator("j", 2)
    accumulator.ingest([(1, "a", "g", 1), (2, "b", "g", 1)])
    assert list(accumulator.ready) == ["g"]
    accumulator.set_k(3)
    assert not accumulator.ready and accumulator.stats()["groups"]["pending"] == 1
    accumulator.ingest([(3, "c", "g", 1)])
    assert list(accumulator.ready) == ["g"]


def test_ready_staleness_counts_the_served_sessions_versions_known_at_ingest():
    """A group keeps one version while every row has it, per session once they differ: a session
    it drops (over-sampling) or a row whose version is unknown at ingest (None) never counts."""
    accumulator = Accumulator("j", 2, policy=Policy(max_off_policy=1, oversample=1))
    accumulator.set_versions(
        trainer=5
    )  # one row's version never moves the current version on its own
    dec = accumulator.ingest(
        [
            Row(
                1, "c", "mixed", 0, 1, 0.0, 1
            ),  # c: version 1, its group chooses a and b before it completes
            Row(2, "a", "mixed", 0, 1, 0.0, 5),
            Row(3, "a", "mixed", 1, 2, 0.2, 4),  # a's min: 4
            Row(4, "b", "mixed", 0, 1, 0.0, None),  # unknown at ingest (a long env_state)
            Row(5, "b", "mixed", 1, 2, 0.8, 5),
            Row(6, "x", "uniform", 1, 1, 0.1, 5),
            Row(7, "y", "uniform", 1, 1, 0.9, 5),
            Row(8, "p", "unknown", 1, 1, 0.1, None),
            Row(9, "q", "unknown", 1, 1, 0.9, None),
            Row(10, "s", "old", 1, 1, 0.1, 3),
            Row(11, "t", "old", 1, 1, 0.9, 3),
            Row(12, "m", "hidden", 0, 1, 0.0, 2),  # dropped as oversampled: the only version known
            Row(13, "n", "hidden", 1, 1, 0.1, None),
            Row(14, "o", "hidden", 1, 1, 0.9, None),
        ]
    )
    assert accumulator.current_version == 5
    assert [(d.group_id, d.reason) for d in dec.drops] == [("old", "stale")]  # 5 - 3 > 1
    assert [r.step_pk for r in dec.rows] == [
        1,
        12,
    ]  # dropped as oversampled: their versions do not count
    assert [t.group_id for t in accumulator.take_ready(None)] == [
        "mixed",
        "uniform",
        "unknown",
        "hidden",
    ]
    assert accumulator.stats()["groups"]["dropped"] == {"stale": 1}


def test_the_version_order_follows_each_groups_current_place_and_forgets_those_that_left():
    """A group sent back to pending (K raised) and ready again takes its new place, never its old
    one; the entries of groups that left the queue (dropped while ready) do not pile up."""
    accumulator = Accumulator("j", 2, policy=Policy(serve_order="newest_version"))
    accumulator.ingest(
        [
            Row(1, "a1", "A", 1, 1, 0.1, 5),
            Row(2, "a2", "A", 1, 1, 0.9, 5),
            Row(3, "b1", "B", 1, 1, 0.1, 3),
            Row(4, "b2", "B", 1, 1, 0.9, 3),
        ]
    )
    accumulator.set_k(3)
    accumulator.ingest(
        [Row(5, "a3", "A", 1, 1, 0.5, 1), Row(6, "b3", "B", 1, 1, 0.5, 3)]
    )  # A's min is now 1
    assert [t.group_id for t in accumulator.take_ready(None)] == ["B", "A"]
    accumulator.ingest(
        [
            Row(10 + 2 * i + j, f"t{i}-{j}", f"T{i}", 1, 1, 0.1 * j, 1)
            for i in range(1000)
            for j in range(3)
        ]
    )
    accumulator.ingest(
        [Row(10_000 + i, f"t{i}-0", None, 0, 2, 0.0, 1) for i in range(990)]
    )  # their groups: malformed
    accumulator.ingest(
        [Row(20_000 + j, f"u-{j}", "U", 1, 1, 0.1 * j, 0) for j in range(3)]
    )  # the next ready group
    assert len(accumulator.ready) == 11 and len(accumulator.ready._heap) <= 2 * 11 + 65
    assert [t.group_id for t in accumulator.take_ready(None)] == [
        f"T{i}" for i in range(990, 1000)
    ] + ["U"]


def test_a_group_given_back_by_a_poll_is_cut_to_its_first_k_sessions():
    """Over-sampling: a group ready short of K whose other sessions complete while a poll holds it,
    and that the poll gives back (byte budget), is served with its first K, never K + N."""
    clock = [0.0]
    accumulator = Accumulator(
        "j", 3, clock=lambda: clock[0], policy=Policy(oversample=2, min_group_size=2)
    )
    accumulator.ingest([Row(i + 1, f"s{i}", "g", 0, 1, 0.0, 0) for i in range(5)])
    accumulator.ingest([Row(10, "s0", "g", 1, 2, 0.1, 0), Row(11, "s1", "g", 1, 2, 0.2, 0)])
    clock[0] = 100.0
    assert not accumulator.expire(10.0).drops and len(accumulator.ready) == 1  # ready short of K
    takes = accumulator.take_ready(None)
    late = accumulator.ingest([Row(12 + i, f"s{i}", "g", 1, 2, 0.1 * i, 0) for i in (2, 3, 4)])
    assert not late.rows  # taken: its rows wait for the poll's outcome
    given_back = accumulator.release(takes)
    assert sorted((r.session_id, r.step_pk) for r in given_back.rows) == [
        ("s3", 4),
        ("s3", 15),
        ("s4", 5),
        ("s4", 16),
    ]
    [t] = accumulator.take_ready(None)
    assert sorted(t.completed) == ["s0", "s1", "s2"] and not t.incomplete and not t.partial
    s = accumulator.stats()["rows"]
    assert s["read"] == s["served"] + s["dropped_total"] + s["rejected_total"] + s["pending"]


def test_with_over_sampling_a_served_groups_late_rows_are_oversampled_whenever_they_come():
    """A row of a partial group's incomplete session counts as oversampled whether it comes while a
    poll builds the group or after it was served: one reason for one kind of row."""
    clock = [0.0]
    accumulator = Accumulator(
        "j", 3, clock=lambda: clock[0], policy=Policy(oversample=1, min_group_size=2)
    )
    accumulator.ingest(
        [
            Row(1, "a", "g", 1, 1, 0.1, 0),
            Row(2, "b", "g", 1, 1, 0.9, 0),
            Row(3, "c", "g", 0, 1, 0.0, 0),
        ]
    )
    clock[0] = 100.0
    accumulator.expire(10.0)
    takes = accumulator.take_ready(None)
    accumulator.ingest([Row(4, "c", "g", 0, 2, 0.0, 0)])  # while the poll builds it
    late = accumulator.commit(Decisions(served=[Served(t, "b1") for t in takes]))
    after = accumulator.ingest([Row(5, "c", "g", 1, 3, 0.5, 0)])
    assert [(r.step_pk, r.reason) for r in late.rows + after.rows] == [
        (4, "oversampled"),
        (5, "oversampled"),
    ]
    assert accumulator.stats()["rows"]["dropped"] == {
        "incomplete_session_in_served_group": 1,
        "oversampled": 2,
    }


def test_the_version_order_holds_after_its_heap_is_swept():
    """Groups leave the ready queue (dropped, taken) faster than new ones come: the heap of the
    version order is swept, and what is popped next must still be the smallest version."""
    import random

    from rollout_buffer.core.group import Group

    rng = random.Random(7)
    q = ReadyQueue("oldest_version")
    for i in range(300):
        g = Group(f"g{i}", 0.0)
        g.min_wv = rng.randint(0, 1000)
        q.push(g)
    for gid in rng.sample(list(q), 250):  # dropped while ready: their entries are garbage now
        del q[gid]
    for i in range(300, 400):  # every push may sweep
        g = Group(f"g{i}", 0.0)
        g.min_wv = rng.randint(0, 1000)
        q.push(g)
    popped = [q.pop_next().min_wv for _ in range(len(q))]
    assert popped == sorted(popped)
