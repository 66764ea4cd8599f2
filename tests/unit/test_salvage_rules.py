"""Salvage (issue 38) in the accumulator, without a server: what pacing learns of a group being
salvaged (in progress until served, never a drop), and the record that keeps the counts."""

from __future__ import annotations

import dataclasses

import pytest

from rollout_buffer.core.accumulator import PIECE, Accumulator
from rollout_buffer.core.census import StepFact
from rollout_buffer.core.config import Config
from rollout_buffer.core.errors import ConfigError
from rollout_buffer.core.model import Decisions, Policy, Row, Salvage, Served
from rollout_buffer.core.salvage import Recorded, Tally, record_reason
from rollout_buffer.pacing.budget import Budget


def pacing_and_accumulator(clock: list[float]) -> tuple[Budget, Accumulator]:
    budget = Budget(
        staleness=1,
        max_off_policy=None,
        batch_groups=4,
        session_timeout_s=3600.0,
        clock=lambda: clock[0],
    )
    acc = Accumulator(
        "j",
        2,
        clock=lambda: clock[0],
        policy=Policy(salvage="truncate"),
        max_steps=3,
        changes=budget.publish,
    )
    return budget, acc


def counted(budget: Budget) -> dict[str, int]:
    with budget.lock:
        budget.read_inbox()
        return budget.terms()


def test_pacing_counts_a_group_being_salvaged_until_it_is_served() -> None:
    clock = [0.0]
    budget, acc = pacing_and_accumulator(clock)
    acc.observe([("a", "g"), ("b", "g")], [])
    acc.ingest([Row(1, "a", "g", 1, 2, 1.0, 0)])
    acc.observe([], [StepFact("b", "g", 1, False), StepFact("b", "g", 2, False)])
    assert counted(budget)["in_progress"] == 1  # b still runs: nothing decided
    acc.observe([], [StepFact("b", "g", 3, False)])  # b reached the step cap
    terms = counted(budget)
    assert (terms["in_progress"], terms["ready"]) == (0, 1)  # being salvaged, still counted
    assert "g" not in budget.decided
    (take,) = acc.take_ready(None)
    assert take.salvage is not None and take.salvage.sessions == {"b": "step_cap"}
    assert counted(budget)["ready"] == 1  # taken by a poll: not served yet
    acc.commit(Decisions(served=[Served(take, "batch-1")]))
    assert counted(budget)["ready"] == 0
    assert budget.served == 1 and "g" in budget.decided and budget.groups == {}


def test_pacing_never_sees_a_group_salvaged_at_the_ttl_as_dropped() -> None:
    clock = [0.0]
    budget, acc = pacing_and_accumulator(clock)
    acc.observe([("a", "g"), ("b", "g")], [StepFact("b", "g", 1, False)])
    acc.ingest([Row(1, "a", "g", 1, 2, 1.0, 0)])
    clock[0] = 100.0
    plan = acc.expire(50.0)
    assert not plan.drops and plan.newly_ready == 1
    assert counted(budget)["ready"] == 1 and "g" not in budget.decided


def test_a_listed_session_without_a_row_is_never_salvaged() -> None:
    clock = [0.0]
    _budget, acc = pacing_and_accumulator(clock)
    acc.observe([("a", "g"), ("b", "g")], [])
    acc.ingest([Row(1, "a", "g", 1, 2, 1.0, 0)])
    clock[0] = 100.0
    plan = acc.expire(50.0)
    assert [d.reason for d in plan.drops] == ["incomplete_group_ttl"]
    assert plan.drops[0].clear_sessions == ["a", "b"]
    assert acc.stats()["salvaged"]["groups"] == {}


def test_the_record_keeps_what_rebuilding_and_counting_need() -> None:
    salvage = Salvage(
        {"b": "step_cap", "c": "launcher_exited"},
        "launcher_exited",
        -0.5,
        True,
        generation_s=12.25,
        max_steps=10,
    )
    text = record_reason(salvage)
    record = Recorded.of(text)
    assert record is not None
    assert (record.reason, record.reward, record.max_steps, record.last_row) == (
        "launcher_exited",
        -0.5,
        10,
        True,
    )
    tally = Tally()
    assert tally.load(text, 2) and not tally.load("partial", 1) and not tally.load(None, 1)
    assert tally.view() == {
        "sessions": {"step_cap": 2, "launcher_exited": 2},
        "groups": {"launcher_exited": 2},
        "generation_seconds_kept": 24.5,
    }
    assert tally.load("salvaged:garbled", 1) and tally.groups["unknown"] == 1


def test_the_settings_are_strict_and_off_by_default() -> None:
    assert Config.from_env({}).policy.salvage == "off"
    config = Config.from_env(
        {"ROLLOUT_BUFFER_SALVAGE": "truncate", "ROLLOUT_BUFFER_SALVAGE_REWARD": "-1.5"}
    )
    assert (config.policy.salvage, config.policy.salvage_reward) == ("truncate", -1.5)
    for name, bad in (
        ("ROLLOUT_BUFFER_SALVAGE", "rerun"),
        ("ROLLOUT_BUFFER_SALVAGE_REWARD", "nan"),
    ):
        with pytest.raises(ConfigError, match=name):
            Config.from_env({name: bad})


def test_a_change_of_k_counts_a_salvaged_groups_truncated_sessions() -> None:
    """Lowered: a salvaged group with enough completed and truncated sessions stays ready.
    Raised past them: it waits again, salvaged no more until it ends again."""
    clock = [0.0]
    _budget, acc = pacing_and_accumulator(clock)
    acc.set_k(3)
    acc.observe([("a", "g"), ("b", "g"), ("c", "g")], [])
    acc.ingest([Row(1, "a", "g", 1, 2, 1.0, 0)])
    acc.observe([], [StepFact(s, "g", 3, False) for s in ("b", "c")])
    assert acc.stats()["groups"]["ready"] == 1
    acc.set_k(2)
    assert acc.stats()["groups"]["ready"] == 1  # 1 completed + 2 truncated >= 2
    acc.set_k(4)
    assert acc.stats()["groups"]["pending"] == 1 and acc.stats()["groups"]["ready"] == 0
    acc.set_k(3)
    assert acc.stats()["groups"]["ready"] == 0  # pending: decided again at the TTL
    clock[0] = 100.0
    plan = acc.expire(50.0)
    assert plan.newly_ready == 1 and not plan.drops
    (take,) = acc.take_ready(None)
    assert take.salvage is not None
    assert take.salvage.sessions == {"b": "step_cap", "c": "step_cap"}
    assert take.salvage.reason == "incomplete_group_ttl"


def capped_group(k: int, listed: str) -> Accumulator:
    """Group g of the ``listed`` sessions: a completed, b at the step cap (3), under K ``k``."""
    acc = Accumulator("j", k, policy=Policy(salvage="truncate"), max_steps=3)
    acc.observe([(sid, "g") for sid in listed], [])
    acc.ingest([Row(1, "a", "g", 1, 2, 1.0, 0)])
    acc.observe([], [StepFact("b", "g", 3, False)])  # b reached the step cap
    return acc


def test_a_capped_group_is_salvaged_when_its_last_session_ends_in_any_piece_of_a_batch() -> None:
    """Ingest holds the lock a piece at a time: the piece with the last session's end salvages the
    capped group, whatever the rows before it in the batch."""
    acc = capped_group(3, "abc")
    acc.ingest([Row(2, "c", "g", 0, 1, None, 0)])  # c still runs: g waits for it
    assert acc.snapshot.ready == 0 and acc.capped == {"g"}
    others = [Row(10 + i, f"s{i}", f"other{i}", 0, 1, None, 0) for i in range(PIECE * 2)]
    plan = acc.ingest([*others, Row(9999, "c", "g", 1, 2, 0.5, 0)])  # c completes
    assert plan.newly_ready == 1 and not plan.drops and acc.capped == set()
    (take,) = acc.take_ready(None)
    assert take.group_id == "g" and take.salvage is not None
    assert take.salvage.sessions == {"b": "step_cap"} and set(take.completed) == {"a", "b", "c"}


def test_a_lowered_k_salvages_a_capped_group_whose_sessions_all_ended() -> None:
    """a completed and b capped are 2, short of K 3: g waits (for the TTL). K lowered to 2 is what
    it waited for: salvaged now, not at the TTL or at some later row."""
    acc = capped_group(3, "ab")
    assert acc.snapshot.ready == 0 and acc.capped == {"g"}
    newly_ready, plan = acc.set_k(2)
    assert newly_ready == 1 and not plan.drops and acc.capped == set()
    (take,) = acc.take_ready(None)
    assert take.salvage is not None and take.salvage.sessions == {"b": "step_cap"}


def test_a_capped_group_decided_otherwise_is_forgotten() -> None:
    """A capped group dropped at the TTL (a listed session never wrote a row) leaves nothing."""
    clock = [0.0]
    acc = Accumulator(
        "j", 3, clock=lambda: clock[0], policy=Policy(salvage="truncate"), max_steps=3
    )
    acc.observe([("a", "g"), ("b", "g"), ("c", "g")], [])
    acc.ingest([Row(1, "a", "g", 1, 2, 1.0, 0), Row(2, "b", "g", 0, 3, None, 0)])
    assert acc.capped == {"g"}  # c never wrote a row: g cannot be salvaged yet
    clock[0] = 100.0
    plan = acc.expire(50.0)
    assert [d.reason for d in plan.drops] == ["incomplete_group_ttl"]
    assert acc.capped == set()


def test_a_batch_checks_only_the_waiting_groups_it_can_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Groups with a session at the step cap wait for their other sessions. A batch of rows is
    checked against those whose sessions it completes, not against every waiting group (each
    batch cost a salvage check per waiting group, under the lock: 16 ms a batch with 2,000 of
    them, against 0.6 ms with salvage off). A change of K checks them all once."""
    from rollout_buffer.core import accumulator as accumulator_mod

    checked: list[str] = []
    real = accumulator_mod.truncation

    def counting(g: object, gid: str, *args: object, **kw: object) -> object:
        checked.append(gid)
        return real(g, gid, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(accumulator_mod, "truncation", counting)
    acc = Accumulator("j", 3, policy=Policy(salvage="truncate"), max_steps=3)
    waiting = [f"w{i}" for i in range(200)]
    acc.observe(
        [(f"{gid}-{s}", gid) for gid in waiting for s in ("a", "b", "c")],
        [StepFact(f"{gid}-b", gid, 3, False) for gid in waiting]  # at the cap
        + [StepFact(f"{gid}-c", gid, 1, False) for gid in waiting],  # still running
    )
    assert acc.stats()["groups"]["ready"] == 0 and len(set(checked)) == 200
    checked.clear()
    acc.ingest([Row(10_000 + i, f"o{i}-a", f"o{i}", 0, 1, 0.0, 0) for i in range(100)])
    assert checked == []  # rows of other groups: no waiting group checked
    acc.ingest([Row(1, "w7-a", "w7", 1, 2, 1.0, 0)])  # w7's a completed: c still runs
    assert checked == ["w7"] and acc.stats()["groups"]["ready"] == 0
    checked.clear()
    acc.observe([], [StepFact("w7-c", "w7", 3, False)])  # c at the cap: w7 is salvaged
    assert checked == ["w7"] and acc.stats()["groups"]["ready"] == 1
    # without job_environments: two sessions seen, one completed and one at the cap, short of K
    acc.ingest([Row(2, "x-a", "x", 1, 2, 1.0, 0)])
    acc.observe([], [StepFact("x-b", "x", 3, False)])
    assert acc.stats()["groups"]["ready"] == 1
    checked.clear()
    acc.set_k(2)  # lowered: x has its K now, and both its sessions ended
    assert "x" in checked and acc.stats()["groups"]["ready"] == 2
    (take,) = [t for t in acc.take_ready(None) if t.group_id == "x"]
    assert take.salvage is not None and take.salvage.sessions == {"x-b": "step_cap"}


@pytest.mark.parametrize("status", ["served", "dropped"])
def test_a_salvaged_group_another_instance_decided_is_counted_as_it_recorded(status: str) -> None:
    """A poll took a salvaged group and read its truncated session's last row, but another
    instance had decided the group: its word is taken, the last row counts as read (the
    accounting balances either way), and a group it served salvaged counts as salvaged."""
    clock = [0.0]
    _budget, acc = pacing_and_accumulator(clock)
    acc.observe([("a", "g"), ("b", "g")], [])
    acc.ingest([Row(1, "a", "g", 1, 2, 1.0, 0)])
    acc.observe([], [StepFact("b", "g", 3, False)])
    (take,) = acc.take_ready(None)
    assert take.salvage is not None
    take = dataclasses.replace(take, salvage=dataclasses.replace(take.salvage, last_rows={"b": 7}))
    reason = record_reason(take.salvage) if status == "served" else "malformed_row"
    acc.settle_decided([take], {"g": (status, reason)})
    stats = acc.stats()
    rows = stats["rows"]
    assert rows["read"] == 2
    assert rows["read"] == (
        rows["served"] + rows["dropped_total"] + rows["rejected_total"] + rows["pending"]
    )
    expected = {"step_cap": 1} if status == "served" else {}
    assert stats["salvaged"]["groups"] == expected
