"""The client's Batch/Group/Session views of a /get_rollout_data answer (no server needed: they
only regroup the served document)."""

from __future__ import annotations

from typing import Any

from rollout_buffer.client import Batch


def item(group: str, session: str, step: int, **extra: Any) -> dict[str, Any]:
    return {
        "uid": f"{session}-{step}",
        "instance_id": group,
        "messages": [],
        "reward": extra.pop("reward", 0.0),
        "extra_info": {"session_id": session, "steps": step, "step_pk": step, **extra},
    }


def answer(items: list[dict[str, Any]], **meta: Any) -> dict[str, Any]:
    return {
        "success": bool(items),
        "message": "",
        "data": {"data": items, "meta_info": {"total_samples": len(items), **meta}},
    }


def test_rollout_group_key_is_read_when_the_server_sends_it() -> None:
    doc = answer(
        [
            item("7", "s1", 1, rollout_group_key="7:0", reward=1.0, terminal_reward=1.0),
            item("8", "s2", 1, reward=0.0),
        ],
        batch_id="b1",
    )
    first, second = Batch.of(doc).groups
    assert first.rollout_group_key == "7:0" and second.rollout_group_key is None
    assert first.meta_info["batch_id"] == "b1" and Batch.of(doc).batch_id == "b1"


def test_items_of_the_original_server_still_give_sessions() -> None:
    # the original sends env_id, no step ids and no truncated flag: served order, finish_reason
    items = [
        {"instance_id": "g", "reward": 0.5, "extra_info": {"env_id": "e1"}},
        {
            "instance_id": "g",
            "reward": 0.0,
            "extra_info": {"env_id": "e2", "finish_reason": "length"},
        },
    ]
    (group,) = Batch.of(answer(items)).groups
    assert [(s.session_id, s.reward, s.truncated) for s in group.sessions] == [
        ("e1", 0.5, False),
        ("e2", 0.0, True),
    ]


def test_an_empty_answer_is_a_batch_without_groups() -> None:
    doc = {"success": False, "message": "No data available to read"}
    assert Batch.of(doc).groups == [] and Batch.of(doc).meta_info == {}
