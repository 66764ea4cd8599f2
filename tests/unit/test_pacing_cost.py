"""The cost of a held call's question to the budget (issue 23): it must not grow with the groups
the job has already decided (the gate asks again for every held call when rows arrive, and
every 0.25 s)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from rollout_buffer.core.accumulator import Accumulator
from rollout_buffer.core.config import Config
from rollout_buffer.runtime.pacing import Pacing


def paced(accumulator: Accumulator) -> Pacing:
    """The pacing of a job on ``accumulator``: a budget of one group, (S 0 + 1) x B 1."""
    config = Config.from_env({}, pacing_staleness=0, pacing_batch_groups=1)
    return Pacing(
        config, SimpleNamespace(current=SimpleNamespace(job_id="j", accumulator=accumulator))
    )


def serve_ready(accumulator: Accumulator) -> None:
    """A poll takes every ready group and commits it as served."""
    takes = accumulator.take_ready(None)
    accumulator.commit(
        SimpleNamespace(
            served=[SimpleNamespace(group_id=t.group_id, take=t, rewards=()) for t in takes],
            drops=[],
            rows=[],
            batch=None,
        )
    )


def test_may_start_does_not_grow_with_the_groups_the_job_decided() -> None:
    accumulator = Accumulator("j", 1, max_steps=10)
    pacing = paced(accumulator)
    n = 10_000
    accumulator.observe([(f"s{i}", f"g{i}") for i in range(n + 2)], [])
    # a long job: each group admitted by the gate, then served
    for i in range(n):
        assert pacing.may_start(f"s{i}")
        accumulator.ingest([(i + 1, f"s{i}", f"g{i}", 1)])
        serve_ready(accumulator)
    assert pacing.may_start(f"s{n}")  # one group in progress: the budget of one is spent
    started = time.perf_counter()
    for _ in range(200):
        pacing.rows_read()  # rows arrived: the budget is worked out again (no standing refusal)
        assert not pacing.may_start(f"s{n + 1}")
    elapsed = time.perf_counter() - started
    assert elapsed < 0.1, f"200 questions of a held call took {elapsed:.3f} s"
    assert pacing.admission.report({}, None)["gate"]["admitted_groups"] < 100


def test_may_start_does_not_grow_with_a_hundred_thousand_decided_groups() -> None:
    """The groups in progress were found with a set difference against every decided group
    (`set - dict.keys()` walks the keys): 11 ms a question at 100k decided groups, under the
    accumulator's lock, for every first call and every held call's round (a job's 100k
    sessions took six minutes of questions alone)."""
    accumulator = Accumulator("j", 1, max_steps=10)
    pacing = paced(accumulator)
    n, step = 100_000, 2_000
    accumulator.observe([(f"s{i}", f"g{i}") for i in range(n + 2)], [])
    for lo in range(0, n, step):  # admitted by the gate, completed and served, a poll at a time
        for i in range(lo, lo + step):
            pacing.admission.admit(f"g{i}")
        accumulator.ingest([(i + 1, f"s{i}", f"g{i}", 1) for i in range(lo, lo + step)])
        serve_ready(accumulator)
    assert len(accumulator.decided) == n
    assert pacing.may_start(f"s{n}")  # one group in progress: the budget of one is spent
    started = time.perf_counter()
    for _ in range(200):
        pacing.rows_read()  # rows arrived: the budget is worked out again (no standing refusal)
        assert not pacing.may_start(f"s{n + 1}")
    elapsed = time.perf_counter() - started
    assert elapsed < 0.1, f"200 questions of a held call took {elapsed:.3f} s"


def zombies(groups: int, k: int = 8) -> tuple[Accumulator, Pacing, list[float]]:
    """A job whose ``groups`` groups all died before any trainable row (a broken task: every
    session crashes mid-way): admitted, each session made two calls, then nothing, while live
    sessions made calls a millisecond apart. No TTL
    decides them (only pending groups expire) and nothing else does until the job ends."""
    clock = [0.0]
    accumulator = Accumulator("j", k, max_steps=10, clock=lambda: clock[0])
    pacing = paced(accumulator)
    listed = [(f"z{g}-{i}", f"zg{g}") for g in range(groups) for i in range(k)]
    accumulator.observe(listed + [(f"h{i}", f"hg{i}") for i in range(3)], [])
    for g in range(groups):
        pacing.admission.admit(f"zg{g}")
        for i in range(k):
            session = f"z{g}-{i}"
            accumulator.first_call(session)
            for _ in range(2):
                accumulator.sign(session)
                clock[0] += 0.001
                accumulator.answered(session)
    for _ in range(200):  # the live sessions' steps: what a session's quiet is measured against
        accumulator.sign("live")
        clock[0] += 0.001
        accumulator.answered("live")
    clock[0] += 3600.0  # an hour later
    return accumulator, pacing, clock


def test_a_held_calls_question_does_not_grow_with_groups_that_died_long_ago() -> None:
    """Every question re-examined every session of every group that died before a trainable
    row: 16 ms a question at 1,000 such groups of 8 (a broken task a hundred, over a long job),
    under the accumulator's lock, for every round of held calls and at every poll."""
    accumulator, pacing, _clock = zombies(1000)
    assert pacing.may_start("h0")  # the budget of one is spent
    started = time.perf_counter()
    for _ in range(200):
        pacing.rows_read()  # rows arrived: the budget is worked out again (no standing refusal)
        assert not pacing.may_start("h1")
    elapsed = time.perf_counter() - started
    assert elapsed < 0.2, f"200 questions of a held call took {elapsed:.3f} s"
    progress = accumulator.progress(pacing.admission.admitted)
    assert progress["stalled"] == 1000 and progress["running"] == 1


def test_a_group_that_died_long_ago_runs_again_at_its_next_call() -> None:
    """Set aside, not decided: a session of it that calls again (its environment was only slow)
    makes it a group in progress again, and its group's place counts again."""
    accumulator, pacing, clock = zombies(3, k=2)
    assert accumulator.progress(pacing.admission.admitted)["stalled"] == 3
    accumulator.sign("z1-0")  # its sessions call again: in flight, alive
    accumulator.sign("z1-1")
    progress = accumulator.progress(pacing.admission.admitted)
    assert progress["running"] == 1 and progress["stalled"] == 2
    accumulator.answered("z1-0")
    accumulator.answered("z1-1")
    clock[0] += 5.0  # then quiet for longer than live sessions are: lost again
    assert accumulator.progress(pacing.admission.admitted)["stalled"] == 3
    clock[0] += 3600.0
    assert accumulator.progress(pacing.admission.admitted)["stalled"] == 3
    accumulator.sign("z2-0")  # a sign of one session is enough to look at the group again
    progress = accumulator.progress(pacing.admission.admitted)
    assert progress["stalled"] == 3  # z2-1 has been dead for an hour: still lost


def test_a_group_taken_for_stalled_that_completes_after_all_is_no_failure() -> None:
    """A pending group idle past the stall threshold is counted as stalled while the budget is
    worked out; if its last session completes after all, it reached K: the completion rate (which
    stretches the capacity, up to twice) must not count it as a group that failed."""
    clock = [0.0]
    accumulator = Accumulator("j", 2, clock=lambda: clock[0], max_steps=10)
    pk = 0

    def row(sid: str, gid: str) -> tuple:
        nonlocal pk
        pk += 1
        return (pk, sid, gid, 1)

    for i in range(50):  # groups whose second session comes 0.1 s after the first
        accumulator.ingest([row(f"q{i}a", f"q{i}")])
        clock[0] += 0.1
        accumulator.ingest([row(f"q{i}b", f"q{i}")])
    for i in range(5):  # slow second sessions: idle 5 s, taken for stalled, then complete
        accumulator.ingest([row(f"s{i}a", f"s{i}")])
        clock[0] += 5.0
        assert accumulator.progress(set())["stalled"] == 1
        accumulator.ingest([row(f"s{i}b", f"s{i}")])
    assert accumulator.completion_rate() == 1.0


def test_a_held_calls_question_sorts_the_call_gaps_once_not_once_per_pending_group() -> None:
    """progress() asks every pending group whether its sessions have gone quiet for good; the
    threshold sorts the last 200 quiet spans between calls: once per question (a held call asks
    several times a second), not once per pending group (0.8 ms a question at 128)."""
    accumulator = Accumulator("j", 8, max_steps=10)
    groups = 64
    accumulator.observe([(f"s{g}-{i}", f"g{g}") for g in range(groups) for i in range(8)], [])
    for g in range(groups):
        for i in range(8):
            accumulator.first_call(f"s{g}-{i}")
            accumulator.sign(f"s{g}-{i}")
            accumulator.answered(f"s{g}-{i}")
            accumulator.sign(f"s{g}-{i}")  # its second call: a gap between calls
        accumulator.ingest([(g + 1, f"s{g}-0", f"g{g}", 1)])  # one session completed: pending
    assert len(accumulator.pending) == groups and accumulator.census.silent_after() is not None
    calls = 0
    real = accumulator.census.silent_after

    def counted() -> float | None:
        nonlocal calls
        calls += 1
        return real()

    accumulator.census.silent_after = counted  # type: ignore[method-assign]
    accumulator.progress(set())
    assert calls == 1


def test_the_gate_raises_a_low_descriptor_limit() -> None:
    """A soft limit of 1024 let the gate carry only ~400 calls (one descriptor a held call, two
    an in-flight one): the rest were answered 502 and the launcher backed off."""
    import subprocess
    import sys

    code = (
        "import resource\n"
        "from rollout_buffer.runtime.gate import Gate\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
        "g = Gate(host='127.0.0.1', port=0, upstream='http://127.0.0.1:9', may_start=bool)\n"
        "g.start()\n"
        "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard)\n"
        "g.close()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    soft, hard = (int(v) for v in out.stdout.split())
    assert soft >= min(hard, 4096), out.stdout


def test_a_standing_refusal_never_holds_an_admitted_group_nor_outlives_a_poll() -> None:
    """A refusal for want of budget stands a moment for the other held calls (a round of hundreds
    works the budget out once), but never for a session of a group already admitted, and not
    past the trainer's next poll: the place it frees goes at once."""
    accumulator = Accumulator("j", 2, max_steps=10)
    pacing = paced(accumulator)
    accumulator.observe([("a0", "g0"), ("a1", "g0"), ("b0", "g1"), ("b1", "g1")], [])
    assert pacing.may_start("a0")  # g0 takes the budget of one
    assert not pacing.may_start("b0")  # g1 waits: the refusal stands for a moment
    assert pacing.may_start("a1")  # g0's other session is never held
    accumulator.ingest([(1, "a0", "g0", 1), (2, "a1", "g0", 1)])
    serve_ready(accumulator)
    pacing.took(1, [None])  # the trainer takes g0 and trains on it...
    assert not pacing.may_start("b0")  # (a group that starts now is for its next step)
    pacing.took(0, [])  # ...and polls again: it is done with g0, and g1 goes now
    assert pacing.may_start("b0")


def test_groups_whose_sessions_all_died_before_twenty_gaps_do_not_hold_the_budget_for_good() -> (
    None
):
    """The first admitted groups' sessions each made one call and died (a broken task at the head
    of the list): no gap between calls was ever seen, and none will be while every other first
    call is held, so nothing was taken for dead (the threshold is learned from twenty gaps) and
    a group with no trainable row has no TTL: the held calls were never released. Before the
    threshold is learned, a session quiet for longer than its client's longest backoff is
    dead."""
    from rollout_buffer.core.census import RESUMED_QUIET_S

    clock = [0.0]
    accumulator = Accumulator("j", 2, max_steps=10, clock=lambda: clock[0])
    pacing = paced(accumulator)
    accumulator.observe([("a1", "g1"), ("a2", "g1"), ("b1", "g2"), ("b2", "g2")], [])
    for session in ("a1", "a2"):
        assert pacing.may_start(session)
        accumulator.sign(session)
        clock[0] += 0.5
        accumulator.answered(session)
    assert not pacing.may_start("b1")  # g1 takes the budget of one
    clock[0] += 10.0
    pacing.rows_read()
    assert not pacing.may_start("b1")  # a long step: not dead yet
    clock[0] += RESUMED_QUIET_S
    pacing.rows_read()
    assert pacing.may_start("b1"), accumulator.progress(pacing.admission.admitted)


def test_a_refusal_worked_out_before_rows_arrived_does_not_stand_after_them() -> None:
    """The gate's thread works the budget out while the loop's thread reads rows that free it (a
    session ended at the step cap: its group can never complete) and says so (rows_read: held
    calls ask again now). The refusal, worked out from the figures before those rows, stood
    REFUSAL_STANDS_S after them: the held calls the rows' poke asked were refused unasked."""
    from rollout_buffer.core.census import StepFact

    accumulator = Accumulator("j", 2, max_steps=3)
    pacing = paced(accumulator)
    accumulator.observe([("a1", "g1"), ("a2", "g1"), ("b1", "g2"), ("c1", "g3")], [])
    assert pacing.may_start("a1")  # g1 takes the budget of one
    progress = accumulator.progress

    def rows_arrive_meanwhile(admitted: set[str]) -> dict[str, int]:
        figures = progress(admitted)
        accumulator.observe([], [StepFact("a2", "g1", 3, False)])  # a2 hit the step cap
        pacing.rows_read()
        return figures

    accumulator.progress = rows_arrive_meanwhile  # type: ignore[method-assign]
    assert not pacing.may_start("b1")  # worked out before the rows
    accumulator.progress = progress  # type: ignore[method-assign]
    assert pacing.may_start("c1"), "refused by a refusal older than the rows that freed the budget"


def test_a_held_call_of_a_session_not_listed_yet_does_not_work_the_budget_out() -> None:
    """A session job_environments has not listed waits for the census to read it, asked at every
    round like any held call; each question worked out the groups in progress, though the
    answer does not depend on them: 0.3 s a round for 500 such calls next to 200 groups of 8, on
    the gate's event loop (every call it forwards waited) and under the accumulator's lock."""
    accumulator = Accumulator("j", 8, max_steps=10)
    config = Config.from_env({}, pacing_staleness=1, pacing_batch_groups=100)
    reader = SimpleNamespace(no_schedule=False)  # job_environments is read
    job = SimpleNamespace(job_id="j", accumulator=accumulator, census=reader)
    pacing = Pacing(config, SimpleNamespace(current=job))
    accumulator.observe([(f"s{g}-{i}", f"g{g}") for g in range(200) for i in range(8)], [])
    for g in range(200):
        assert pacing.may_start(f"s{g}-0")
        for i in range(8):
            accumulator.sign(f"s{g}-{i}")
            accumulator.answered(f"s{g}-{i}")
    for _ in range(25):
        for i in range(8):
            accumulator.sign(f"live{i}")
            accumulator.answered(f"live{i}")
    started = time.perf_counter()
    for i in range(500):
        assert not pacing.may_start(f"unlisted{i}")  # it waits for the census to list it
    elapsed = time.perf_counter() - started
    assert elapsed < 0.05, f"a round of 500 held calls of unlisted sessions took {elapsed:.3f} s"


def test_the_spares_come_from_the_groups_the_accumulator_saw_lost() -> None:
    """Twenty groups died (every group is lost so far): the budget's spare comes from the share
    of groups lost and the losses seen since the trainer took its last batch, both from the
    accumulator. Before the trainer took a batch, those twenty losses used the step's spare up;
    once it takes one (and trains on it: its place is claimed), the next step has its spare, and
    one group may start where none could without it. With the bound at 0 there is none."""
    for waste, admitted in ((0.03, True), (0.0, False)):
        _accumulator, pacing, _clock = zombies(20)
        pacing.admission.spare_waste = waste
        spare = pacing.report()["inputs"]["spare"]
        assert spare["lost_this_step"] == 20 and spare["value"] == 0
        assert spare["per_step"] == (1 if waste else 0)
        pacing.admission.took(1, [None])  # the trainer's batch of one (B 1): it trains on it
        assert pacing.may_start("h0") is admitted
        assert pacing.report()["inputs"]["spare"]["lost_this_step"] == 0
        pacing.rows_read()  # no standing refusal
        assert not pacing.may_start("h1")


def test_a_group_lost_before_the_batch_that_completes_after_it_frees_no_second_spare() -> None:
    """The losses of a step were the groups taken for lost now less those when the trainer took
    its last batch: a group taken for lost before the batch that completes after it (it was only
    slow) lowered the count, and the step's next loss then used no spare. Its replacement started
    and the spare stood as well: one group more than the step's spares, for each such group. A
    group taken for lost stays counted: the spare its loss used stands in for its replacement, and
    it completes in the spare's place."""
    clock = [0.0]
    accumulator = Accumulator("j", 2, clock=lambda: clock[0], max_steps=10)
    pacing = paced(accumulator)
    pacing.admission.spare_waste = 1.0  # a spare a step (B 1) wherever a group is lost
    pk = 0

    def row(sid: str, gid: str) -> None:
        nonlocal pk
        pk += 1
        accumulator.ingest([(pk, sid, gid, 1)])

    for i in range(30):  # groups whose second session comes 0.1 s after the first
        row(f"q{i}a", f"q{i}")
        clock[0] += 0.1
        row(f"q{i}b", f"q{i}")
        serve_ready(accumulator)
    row("slow-a", "slow")
    clock[0] += 5.0  # idle far longer than groups take: taken for lost
    spare = pacing.report()["inputs"]["spare"]
    assert spare["per_step"] == 1 and spare["lost_this_step"] == 1
    pacing.admission.took(1, [None])  # the trainer's batch: the next step has its spare
    assert pacing.report()["inputs"]["spare"]["value"] == 1
    row("slow-b", "slow")  # the slow group completes after all
    row("dead-a", "dead")  # a group of this step loses a session
    clock[0] += 5.0
    spare = pacing.report()["inputs"]["spare"]
    assert spare["lost_this_step"] == 1 and spare["value"] == 0


def test_a_bad_start_weighs_on_the_spares_only_until_two_hundred_groups_ended_since() -> None:
    """Twenty groups died at the job's start (the proxy was down, or the launcher wrote made-up
    groups): every group ended so far was lost, and a step's spares are B. The share that sizes
    them is of the last 200 groups ended: once 200 more have completed it is 0 (over the whole
    job it would still be one in eleven: at a large B, spares for thousands of groups)."""
    accumulator, pacing, _clock = zombies(20, k=1)
    spare = pacing.report()["inputs"]["spare"]
    assert spare["lost_share"] == 1.0 and spare["per_step"] == 1  # B 1
    accumulator.observe([(f"s{i}", f"g{i}") for i in range(200)], [])
    for i in range(200):
        accumulator.ingest([(i + 1, f"s{i}", f"g{i}", 1)])
    doc = pacing.report()
    assert doc["inputs"]["completion_rate"]["value"] == 200 / 220
    assert doc["inputs"]["spare"]["lost_share"] == 0.0
    assert doc["inputs"]["spare"]["per_step"] == 0
