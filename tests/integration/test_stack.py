"""The real stack's parts as they are (issue 22): an LLM proxy without the clear endpoint, a
launcher that exits at once, the upstream client's ``rollout_group_key``; through the Flask test
client, on both backends."""

from __future__ import annotations

from typing import Any

from fakes.fake_proxy import FakeProxy
from support import Writer, wait_until


def test_a_proxy_without_the_clear_endpoint_shows_in_health_and_stats(
    db_url: str, writer: Writer, harness_factory: Any
) -> None:
    with FakeProxy(status=404) as proxy:
        h = harness_factory(
            db_url, proxy_host="127.0.0.1", proxy_port=proxy.port, proxy_read_timeout_s=2.0
        )
        h.start(k=2, job="job1")
        writer.group("g1", 2, complete=1)  # never completes: dropped when the job changes
        h.settle()
        h.start(k=2, job="job2")  # job1's pending group is dropped as job_ended: 2 sessions
        assert wait_until(
            lambda: (
                h.client.get("/health").get_json()["proxy_notifications"].get("dropped_sessions")
                == 2
            )
        )
        health = h.client.get("/health")
        assert health.status_code == 200 and health.get_json()["status"] == "healthy"
        assert health.get_json()["proxy_notifications"]["clear_endpoint"] == "absent"
        stats = h.stats()["proxy_notifications"]
        assert stats["clear_endpoint"] == "absent" and stats["sessions"] == 0
        assert len(proxy.calls) == 1


def keys_of(doc: dict[str, Any]) -> dict[str, set[str]]:
    """Each served group's rollout_group_keys, by instance_id."""
    out: dict[str, set[str]] = {}
    for item in doc["data"]["data"]:
        out.setdefault(item["instance_id"], set()).add(item["extra_info"].get("rollout_group_key"))
    return out


def test_every_item_carries_its_rollout_group_key_through_replay_and_redelivery(
    writer: Writer, harness: Any
) -> None:
    """The newer upstream client groups by extra_info.rollout_group_key ("<instance_id>:<n>");
    without it, it guesses. The key of a group is the same when its batch is replayed (a lost
    response) and when it is delivered again after a trainer crash."""
    harness.start(k=2)
    for gid in ("g1", "g2", "g3"):
        writer.group(gid, 2, steps=3)
    first = harness.poll(max_groups=2, request_id="r1")
    assert keys_of(first) == {"g1": {"g1:0"}, "g2": {"g2:0"}}
    assert len(first["data"]["data"]) == 2 * 2 * 3, "every item carries it"
    assert keys_of(harness.poll(max_groups=2, request_id="r1")) == keys_of(first)  # a replay
    harness.start(k=2, skip_instance_ids=["g1"])  # the checkpoint holds g1: g2 comes again
    again = harness.poll(max_groups=5)
    assert keys_of(again) == {"g2": {"g2:0"}, "g3": {"g3:0"}}
    assert all(
        item["extra_info"].get("redelivered")
        for item in again["data"]["data"]
        if item["instance_id"] == "g2"
    )
