"""The admission budget's arithmetic (issue 23), driven directly: the trainer's steps seen from
the proxy's version stamps and from its full batches, its surplus counted only while it is still
fresh, and which quiet sessions are taken for dead."""

from __future__ import annotations

import math

from rollout_buffer.core.admission import Admission, spares_for
from rollout_buffer.core.census import Census
from rollout_buffer.core.liveness import Liveness

B = 8


def admission(staleness: int = 1) -> Admission:
    clock = [0.0]
    return Admission(staleness=staleness, batch_groups=B, idle_gap_s=5.0, clock=lambda: clock[0])


def budget(a: Admission, in_progress: int = 0, version: int | None = None) -> int:
    return int(
        a.report({"running": in_progress, "stalled": 0}, version)["budget"]  # type: ignore[call-overload]
    )


def test_at_the_start_s_plus_one_batches_may_start() -> None:
    assert budget(admission()) == 2 * B
    assert budget(admission(staleness=0)) == B


def test_the_batch_in_training_claims_its_place_until_the_step_ends() -> None:
    """The trainer takes exactly B (version 0) and trains: a group that starts now is for its next
    step, so only B more may be in progress. When the proxy stamps version 1 (the step ended),
    the batch is consumed and (S + 1) x B may be again."""
    a = admission()
    a.saw_version(0)
    a.took(B, [0] * B)
    assert budget(a) == B
    a.saw_version(1)
    assert budget(a) == 2 * B


def test_a_surplus_that_its_next_step_cannot_take_is_not_counted() -> None:
    """The trainer took 11 groups of version 0 and trains on 8: the 3 it holds are fresh for
    its next step (version 1 accepts 0 with S 1); once it trains step 1, they would be too old for
    step 2, so they no longer claim a place and new groups replace them."""
    a = admission()
    a.saw_version(0)
    a.took(11, [0] * 11)
    report = a.report({"running": 0}, None)
    assert report["budget"] == 2 * B - B - 3
    a.saw_version(1)
    a.took(5, [1] * 5)  # the next step: 3 held + 5 new = a batch, trained on at version 1
    surplus = a.report({"running": 0}, None)["inputs"]["trainer_surplus"]  # type: ignore[index]
    assert surplus["training"] == B and surplus["going_stale"] == 0
    a.took(2, [0, 0])  # two more of version 0: held beyond the batch, too old for step 2
    surplus = a.report({"running": 0}, None)["inputs"]["trainer_surplus"]  # type: ignore[index]
    assert surplus["going_stale"] == 2 and surplus["fresh"] == 0
    assert budget(a) == B


def test_versions_of_two_sources_count_steps_from_their_own_start() -> None:
    """The rows' current version is unknown (None) at first and the proxy stamps 7: seven steps
    have not passed. Steps count from each source's first version."""
    a = admission()
    a.saw_version(7)
    a.took(B, [7] * B)
    assert budget(a) == B  # still training on that batch
    assert budget(a, version=3) == B  # the job's version, first seen: no step from it either
    a.saw_version(8)
    assert budget(a, version=3) == 2 * B


def test_a_wrong_version_cannot_lift_the_budget_above_capacity_less_in_progress() -> None:
    a = admission()
    a.took(B, [0] * B)
    a.saw_version(0)
    a.saw_version(10**9)
    assert budget(a, in_progress=5) == 2 * B - 5


def test_a_session_with_a_call_in_flight_is_alive_however_long_the_call() -> None:
    life = Liveness()
    for i in range(30):  # live sessions: 0.1 s between a call's answer and the next call
        life.call_started(f"s{i}", 0.0)
        life.call_ended(f"s{i}", 1.0)
        life.call_started(f"s{i}", 1.1)
    quiet = life.quiet_after()
    assert quiet is not None and quiet >= 1.0
    assert not life.dead("s0", 1000.0, quiet)  # its second call is still in flight
    life.call_ended("s0", 1000.0)
    assert not life.dead("s0", 1000.0 + quiet / 2, quiet)
    assert life.dead("s0", 1000.0 + quiet + 0.1, quiet)
    assert not life.dead("never-called", 2000.0, quiet)  # waits for a place in the pool


def test_a_session_whose_call_its_client_retries_is_alive_for_its_longest_backoff() -> None:
    """A call answered 5xx or 429, or not at all, is retried after a backoff of up to 30 s plus
    20 % (SPEC §5): its session is quiet meanwhile, but alive; past that it is dead. The backoff
    is not an environment's step: the threshold is not learned from it."""
    from rollout_buffer.core.liveness import RETRY_QUIET_S

    life = Liveness()
    for i in range(30):
        life.call_started(f"s{i}", 0.0)
        life.call_ended(f"s{i}", 1.0)
        life.call_started(f"s{i}", 1.1)
    quiet = life.quiet_after()
    assert quiet is not None and quiet < 2.0
    life.call_ended("s0", 10.0, retried=True)
    assert not life.dead("s0", 10.0 + 30.0, quiet)
    assert life.dead("s0", 10.0 + RETRY_QUIET_S + 0.1, quiet)
    life.call_started("s0", 40.0)  # its retry, after a 30 s backoff
    assert life.quiet_after() == quiet
    life.call_ended("s0", 41.0)  # answered: the usual threshold again
    assert life.dead("s0", 41.0 + quiet + 0.1, quiet)


def test_rows_arriving_late_after_a_sessions_last_call_raise_the_quiet_threshold() -> None:
    """A session that just finished is quiet while its terminal row is on its way (the launcher
    flushes every few seconds): it must not be taken for dead meanwhile."""
    life = Liveness()
    for i in range(30):
        life.call_started(f"s{i}", 0.0)
        life.call_ended(f"s{i}", 0.5)
        life.call_started(f"s{i}", 0.6)
        life.call_ended(f"s{i}", 1.0)
        life.row(f"s{i}", 5.0)  # its rows arrive 4 s after its last call
    quiet = life.quiet_after()
    assert quiet is not None and quiet >= 8.0


def test_one_dead_session_loses_a_group_of_k_but_not_an_oversampled_one() -> None:
    census = Census(max_steps=10)
    census.schedule([("a", "g"), ("b", "g"), ("c", "h"), ("d", "h"), ("e", "h")])
    for i in range(30):
        census.sign(f"x{i}", 0.0)
        census.answered(f"x{i}", 0.1)
        census.sign(f"x{i}", 0.2)
    for session in "abcde":
        census.sign(session, 0.0)
        census.answered(session, 0.5)
    census.sign("b", 0.6)  # b makes its next call: alive
    quiet = census.silent_after()
    assert quiet is not None
    later = 0.5 + quiet + 1.0
    assert census.lost("g", set(), 2, later, quiet)  # a is dead: g (K 2, two sessions) is lost
    assert not census.lost("g", {"a"}, 2, later, quiet)  # unless a completed (its row came)
    assert census.lost("h", {"e"}, 2, later, quiet)  # c and d dead: one of three left for K 2
    census.sign("d", later)  # d alive after all, c dead: two of three can still complete
    assert not census.lost("h", {"e"}, 2, later + 0.1, quiet)


def test_the_gate_reads_the_proxys_version_stamp_across_chunks_and_only_from_a_2xx() -> None:
    from rollout_buffer.runtime.gate import VersionStamp

    answer = b'HTTP/1.1 200 OK\r\n\r\n{"choices": [], "metadata": {"weight_version": 12345}}'
    for cut in range(1, len(answer)):  # wherever the chunks break, the stamp is read whole
        stamp = VersionStamp()
        stamp.feed(answer[:cut])
        stamp.feed(answer[cut:])
        assert stamp.version == 12345, cut
    refused = VersionStamp()
    refused.feed(b'HTTP/1.1 429 Too Many\r\n\r\n{"metadata": {"weight_version": 99}}')
    assert refused.version is None
    odd = VersionStamp()
    odd.feed(b'HTTP/1.1 200 OK\r\n\r\n{"metadata": {"weight_version": 1.5}}')
    assert odd.version is None


def test_a_session_the_launcher_passed_over_before_its_first_call_is_dead() -> None:
    """The launcher starts sessions in job_environments order: a session that never reached the
    gate while one listed after it did, longer ago than live sessions stay quiet, failed at its
    start. One held at the gate is not dead: its group is not admitted."""
    census = Census(max_steps=10)
    census.schedule([("a", "g"), ("b", "g"), ("c", "h"), ("d", "h")])
    for i in range(30):
        census.sign(f"x{i}", 0.0)
        census.answered(f"x{i}", 0.1)
        census.sign(f"x{i}", 0.2)
    quiet = census.silent_after()
    assert quiet is not None
    census.arrived("a", 1.0)
    census.sign("a", 1.0)  # a runs; b (listed next) never calls: it failed at its start
    census.arrived("c", 1.0)  # c is held at the gate (h not admitted)
    assert not census.lost("g", set(), 2, 1.0 + quiet / 2, quiet)  # too soon to tell
    assert census.lost("g", set(), 2, 1.0 + quiet + 0.5, quiet)
    assert not census.lost("h", set(), 2, 1.0 + quiet + 0.5, quiet)  # d after c: not passed


def test_a_poll_after_an_idle_gap_is_from_the_trainers_next_version() -> None:
    """The trainer comes back after a training step before any answer carries the new version:
    the groups it holds that the new version's staleness bound rejects are not counted."""
    clock = [0.0]
    a = Admission(staleness=1, batch_groups=B, idle_gap_s=5.0, clock=lambda: clock[0])
    a.saw_version(0)
    a.took(10, [0] * 10)  # a batch of 8 to train on, 2 held
    clock[0] = 8.0
    a.saw_version(1)
    a.took(8, [1] * 8)  # step 1: trains 2 of version 0 and 6 of version 1, holds 2 of version 1
    clock[0] = 16.0  # step 2 (version 2) polls before the proxy stamps 2: version 0 is too old
    a.took(1, [0])
    surplus = a.report({"running": 0}, None)["inputs"]["trainer_surplus"]  # type: ignore[index]
    assert surplus["training"] == 0 and surplus["fresh"] == 2, surplus


def test_a_trainer_that_polls_without_pause_is_not_taken_for_one_that_never_trains() -> None:
    """A trainer that polls all the time (no idle gap) with versions that do not move (a proxy
    that stamps none, or a constant one): its steps showed only as full batches less the one it
    trains on, so after its first batch the budget stayed spent for good (the kill -9 test's
    drain, polling every 20 ms, waited for ever). It polls only while it collects: a poll that
    begins after a batch formed says it is done with that batch."""
    clock = [0.0]
    a = Admission(staleness=0, batch_groups=2, idle_gap_s=10.0, clock=lambda: clock[0])
    for _step in range(5):
        clock[0] += 0.1
        a.took(2, [3, 3])  # a full batch: it trains on it
        assert budget(a) == 0  # a group that starts now is for its next step
        clock[0] += 0.1
        a.took(0)  # it polls again: it collects its next batch
        assert budget(a) == 2


def test_a_launcher_out_of_order_turns_the_passed_over_rule_off() -> None:
    """A session taken for passed over that arrives after all: the launcher does not start
    sessions in job_environments order, and the rule would take its queued sessions for dead
    (the budget would then admit group after group)."""
    census = Census(max_steps=10)
    census.schedule([("a", "g"), ("b", "g"), ("c", "h"), ("d", "h"), ("e", "i"), ("f", "i")])
    for i in range(30):
        census.sign(f"x{i}", 0.0)
        census.answered(f"x{i}", 0.1)
        census.sign(f"x{i}", 0.2)
    quiet = census.silent_after()
    assert quiet is not None
    census.arrived("c", 1.0)
    census.sign("c", 1.0)
    later = 1.0 + quiet + 0.5
    assert census.lost("g", set(), 2, later, quiet)  # a and b passed over by c
    census.arrived("a", later)  # a arrives after all: out of order
    census.sign("a", later)
    assert not census.lost("g", set(), 2, later + 0.1, quiet)  # a runs; b may be queued
    census.arrived("f", later + 0.1)
    assert not census.lost("i", set(), 2, later + 10 * quiet, quiet)  # e queued, not dead


def live_sessions(life: Liveness, gap_s: float = 0.05) -> None:
    """Thirty sessions that made two calls, ``gap_s`` apart (their environment's step)."""
    for i in range(30):
        life.call_started(f"x{i}", 0.0)
        life.call_ended(f"x{i}", 0.5)
        life.call_started(f"x{i}", 0.5 + gap_s)


def test_a_session_whose_last_row_came_and_was_not_its_last_is_dead_sooner() -> None:
    """A crash looks like a finish at the gate (no next call) until the rows say which: the row of
    its last call, not terminal, says it owes the environment's next call, so it is dead once it
    has been quiet longer than sessions are between calls, not after the rows' lag too (the
    launcher flushes every few seconds: that lag is what a finish needs)."""
    from rollout_buffer.core.liveness import MIN_OWED_S

    life = Liveness()
    live_sessions(life)
    for i in range(30):
        life.call_ended(f"x{i}", 1.0)
        life.row(f"x{i}", 4.5, 2, terminal=True)  # rows arrive 3.5 s after the call (a flush)
    quiet = life.quiet_after()
    assert quiet is not None and quiet >= 7.0 and life.owed_after_s == MIN_OWED_S
    for session in ("crashed", "finished", "flushing"):
        life.call_started(session, 10.0)
        life.call_ended(session, 10.5)
        life.call_started(session, 10.55)
        life.call_ended(session, 11.0)
    life.row("crashed", 11.2, 1)
    life.row("crashed", 11.3, 2)  # the row of its last (second) call: not terminal
    life.row("finished", 11.3, 1)
    life.row("finished", 11.3, 2, terminal=True)
    life.row("flushing", 11.3, 1)  # the row of its last call is still on its way
    soon = 11.0 + MIN_OWED_S + 0.1
    assert life.dead("crashed", soon, quiet)
    assert not life.dead("finished", soon, quiet)
    assert not life.dead("flushing", soon, quiet)
    assert life.dead("flushing", 11.0 + quiet + 0.1, quiet)  # the usual threshold still holds
    life.call_started("crashed", soon + 0.1)  # it calls after all: alive while its call runs
    assert not life.dead("crashed", soon + 0.2, quiet)


def test_a_retried_call_or_a_session_seen_mid_way_does_not_make_a_session_owe_a_call() -> None:
    """A call its client retries has no row: the row of the call before it is not the row of
    its last call. A session the service saw only mid-way (counted False: it restarted under it)
    has rows of calls the gate never saw: its steps are not compared with its calls."""
    from rollout_buffer.core.liveness import MIN_OWED_S

    life = Liveness()
    live_sessions(life)
    assert life.quiet_after() is not None
    life.call_started("retrying", 10.0)
    life.call_ended("retrying", 10.5)  # step 1, answered
    life.call_started("retrying", 10.55)
    life.call_ended("retrying", 11.0, retried=True)  # step 2: a 503, its client backs off
    life.row("retrying", 11.2, 1)
    life.call_started("resumed", 10.0, counted=False)
    life.call_ended("resumed", 11.0)
    life.row("resumed", 11.2, 7)  # its seventh step: the gate saw only one call
    later = 11.0 + MIN_OWED_S + 0.2
    quiet = life.quiet_after()
    assert quiet is not None and later < 11.0 + quiet
    assert not life.dead("retrying", later, quiet)
    assert not life.dead("resumed", later, quiet)


def test_a_row_of_a_step_beyond_the_sessions_calls_turns_the_rule_off_for_it() -> None:
    """Rows that are not one per model call (a launcher that writes a row of its own, or a wrong
    step_id): a session with more steps than calls would look as if it owed a call whenever it is
    quiet, a finished one too before its terminal row arrives. Its steps are no longer compared
    with its calls: only the usual quiet threshold takes it for dead."""
    from rollout_buffer.core.liveness import MIN_OWED_S

    life = Liveness()
    live_sessions(life)
    quiet = life.quiet_after()
    assert quiet is not None
    life.call_started("extra", 10.0)
    life.row("extra", 10.1, 1)  # a row before its first call was answered
    life.call_ended("extra", 10.5)
    life.row("extra", 10.6, 2)
    assert not life.dead("extra", 10.5 + MIN_OWED_S + 0.1, quiet)
    assert life.dead("extra", 10.5 + quiet + 0.1, quiet)
    life.call_started("wrong", 10.0)
    life.call_ended("wrong", 10.5)
    life.row("wrong", 10.6, 10**9)  # a hostile step_id
    assert not life.dead("wrong", 10.5 + MIN_OWED_S + 0.1, quiet)


def test_spares_hedge_frequent_losses_only_within_the_waste_bound() -> None:
    """The spares a step: none until the share of groups lost is known, none where groups are
    rarely lost, one where about one group in five is (the pacing bench: 5% of sessions crash,
    K 4), more for a larger B, never more than B, and none when the bound is 0. The number
    expected to go unused is within the bound each time."""
    assert spares_for(B, None, 0.05) == 0
    assert spares_for(B, 0.0, 0.05) == 0
    assert spares_for(B, 0.02, 0.05) == 0
    assert spares_for(B, 0.185, 0.05) == 1
    assert spares_for(B, 0.185, 0.0) == 0
    assert spares_for(64, 0.185, 0.05) > spares_for(B, 0.185, 0.05)
    assert spares_for(B, 1.0, 0.05) == B
    for share in (0.01, 0.1, 0.185, 0.3, 0.5, 0.9):
        for batch in (1, 8, 64, 200):
            h = spares_for(batch, share, 0.05)
            assert 0 <= h <= batch
            # used up by the first losses: h - L of them go unused, L ~ Binomial(B + h, share)
            n = batch + h
            unused = sum(
                (h - lost) * math.comb(n, lost) * share**lost * (1 - share) ** (n - lost)
                for lost in range(h)
            )
            assert unused <= 0.05 * batch + 1e-9, (batch, share, h, unused)
            if h < batch:  # and one more would go over it
                n += 1
                more = sum(
                    (h + 1 - lost) * math.comb(n, lost) * share**lost * (1 - share) ** (n - lost)
                    for lost in range(h + 1)
                )
                assert more > 0.05 * batch, (batch, share, h, more)


def test_a_spare_is_admitted_with_each_batch_and_the_steps_first_loss_uses_it_up() -> None:
    """One group in five is lost: when the trainer takes its batch, B + 1 may start for its next
    step. The first group lost in that step uses the spare up (its replacement comes from the
    budget as ever: the lost group left the groups in progress); the next batch brings a new
    spare. /admission says so."""
    a = admission(staleness=0)
    a.lost_share = 0.2
    a.saw_version(0)
    assert budget(a) == B + 1  # no batch taken yet: the job's start is a step too
    a.took(B, [0] * B)  # the trainer trains on that batch; the next step's groups may start
    a.saw_version(1)
    assert budget(a) == B + 1
    spare = a.report({"running": 0}, None)["inputs"]["spare"]  # type: ignore[index]
    assert spare["value"] == 1 and spare["per_step"] == 1 and spare["lost_this_step"] == 0
    assert a.ask("g-spare", B) is True  # B in progress: the spare starts
    assert a.ask("g-over", B + 1) is False
    a.lost_groups += 1  # one of them loses a session: it leaves the groups in progress
    assert budget(a, in_progress=B) == 0  # the spare stands in for it: no replacement
    a.lost_groups += 1  # a second loss in the step: its replacement may start
    assert budget(a, in_progress=B - 1) == 1
    spare = a.report({"running": 0}, None)["inputs"]["spare"]  # type: ignore[index]
    assert spare["value"] == 0 and spare["lost_this_step"] == 2
    a.took(B, [1] * B)  # the next batch: a new spare for the step after
    a.saw_version(2)
    assert budget(a) == B + 1


def test_no_spare_where_groups_are_rarely_lost_or_the_bound_is_zero() -> None:
    a = admission(staleness=0)
    a.lost_share = 0.01
    assert budget(a) == B
    clock = [0.0]
    none = Admission(
        staleness=0, batch_groups=B, idle_gap_s=5.0, spare_waste=0.0, clock=lambda: clock[0]
    )
    none.lost_share = 0.5
    assert budget(none) == B
