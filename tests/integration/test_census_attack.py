"""Attacks on the census (issue 22)."""

from __future__ import annotations

from typing import Any

import pytest
from fakes.fake_proxy import FakeProxy
from support import Writer, assert_balanced, groups_of, wait_until
from test_census import MAX_STEPS, cleared, schedule, start


@pytest.fixture
def proxy() -> Any:
    with FakeProxy() as p:
        yield p


def test_oversampled_group_with_one_capped_session_is_not_dropped_while_k_can_complete(
    harness_factory: Any, db_url: str, writer: Writer, proxy: FakeProxy
) -> None:
    # K 3 + 1 over-sampled: 4 sessions; one capped, 3 may still complete
    h = start(harness_factory, db_url, proxy, oversample=1)
    # message-cut > 0: every step trainable; the capped one ends at step 3 without a terminal row
    writer.session("g", "g-capped", MAX_STEPS, complete=False)
    writer.session("g", "g-1", 2)
    h.settle()
    assert h.stats()["groups"].get("dropped", {}) == {}
    writer.session("g", "g-2", 2)
    writer.session("g", "g-3", 2)
    doc = h.poll()
    assert set(groups_of(doc)) == {"g"}
    assert_balanced(h.stats())


def test_an_oversampled_group_is_dropped_once_fewer_than_k_can_complete(
    harness_factory: Any, db_url: str, writer: Writer, proxy: FakeProxy
) -> None:
    h = start(harness_factory, db_url, proxy, oversample=1)
    writer.session("g", "g-capped-1", MAX_STEPS, complete=False)
    writer.session("g", "g-1", 2)
    h.settle()
    assert h.stats()["groups"].get("dropped", {}) == {}
    writer.session("g", "g-capped-2", MAX_STEPS, complete=False)
    h.settle()
    assert h.stats()["groups"]["dropped"] == {"session_without_result": 1}
    assert_balanced(h.stats())


def test_a_non_trainable_row_with_a_step_id_that_is_not_a_number_costs_the_census_nothing(
    harness_factory: Any, lite_url: str, proxy: FakeProxy
) -> None:
    """SQLite only: an INT column holds text only there."""
    db_url = lite_url
    writer = Writer(db_url)
    h = start(harness_factory, db_url, proxy)
    doomed = ["d-1", "d-2", "d-capped"]
    schedule(writer, "doomed", doomed)
    # a hostile row first, in the same census batch as the capped session's rows
    writer.db.execute(
        "INSERT INTO session_steps (session_id, step_id, env_name, llm_model, group_id, job_id,"
        " messages, response, is_trainable, created_at) VALUES ('h-1', 'abc', 'env', 'm', 'other',"
        " 'job1', '[]', 'r', 0, '2026-01-01 00:00:00')"
    )
    writer.session("doomed", "d-capped", MAX_STEPS, trainable=False, complete=False)
    h.settle()
    h.settle()
    stats = h.stats()
    assert stats["groups"].get("dropped") == {"session_without_result": 1}, stats["groups"]
    assert stats["sessions"]["ended_without_result"] == 1
    writer.close()


def test_the_rows_group_wins_over_a_job_environments_row_that_names_another(
    harness_factory: Any, db_url: str, writer: Writer, proxy: FakeProxy
) -> None:
    """job_environments lists session x under group "a", but its rows name "b": the rows are what
    is grouped, so x's cap dooms "b" (not a wait for the TTL), and dropping "a" must not clear x
    at the proxy while it runs in "b"."""
    h = start(harness_factory, db_url, proxy)
    schedule(writer, "a", ["a-1", "a-2", "x"])
    schedule(writer, "b", ["b-1", "b-2"])
    writer.session("b", "x", MAX_STEPS, trainable=False, complete=False)
    writer.step("b", "b-1", 1, completed=True)
    h.settle()
    h.settle()
    stats = h.stats()
    assert stats["groups"].get("dropped") == {"session_without_result": 1}, stats["groups"]
    # "a" (a-1, a-2 and no x) drops at its own cap: x is not among its sessions
    writer.session("a", "a-1", MAX_STEPS, trainable=False, complete=False)
    h.settle()
    assert wait_until(lambda: "a" in cleared(proxy, "session_without_result"), 10)
    assert "x" not in cleared(proxy, "session_without_result")["a"]


def test_with_a_minimum_group_size_a_capped_session_does_not_drop_a_group_that_can_reach_it(
    harness_factory: Any, db_url: str, writer: Writer, proxy: FakeProxy
) -> None:
    """ROLLOUT_BUFFER_MIN_GROUP_SIZE 2 of K 3: a group with one capped session can still be
    served short (at the TTL, or when the launcher exits); it must not be dropped at once."""
    h = start(harness_factory, db_url, proxy, min_group_size=2, ttl_s=1.0)
    schedule(writer, "g", ["g-capped", "g-1", "g-2"])
    writer.session("g", "g-capped", MAX_STEPS, trainable=False, complete=False)
    writer.step("g", "g-1", 1, completed=True, step_reward=0.2)
    h.settle()
    assert h.stats()["groups"].get("dropped", {}) == {}
    writer.step("g", "g-2", 1, completed=True, step_reward=0.4)
    assert wait_until(lambda: groups_of(h.poll()).get("g"), 10)
    assert_balanced(h.stats())
