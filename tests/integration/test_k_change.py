"""Changing K on the running job (issue 35, item 1: a group is served only with at least the K in
force when it is served), through the service and the Flask test client on SQLite and Postgres,
with a real HTTP server standing in for the proxy: K raised or lowered while groups are in the
draft built before the poll, and a served group delivered again after K was raised."""

from __future__ import annotations

from typing import Any

from support import Harness, assert_balanced, groups_of, wait_until


def draft_groups(h: Harness) -> int:
    return (h.stats()["prebuilt"]["draft"] or {}).get("groups", 0)


def sessions(doc: dict) -> dict[str, int]:
    return {
        g: len({i["extra_info"]["session_id"] for i in items})
        for g, items in groups_of(doc).items()
    }


def test_k_raised_while_groups_are_in_the_prebuilt_draft_never_serves_them_short(
    proxied: Any, fake_proxy: Any, writer
):
    h = proxied(ttl_s=1.0)
    h.start(k=2)
    writer.group("built", 2)
    wait_until(lambda: draft_groups(h) == 1, 10, "the draft built")
    h.start(k=3)  # the draft goes back, and the group with it
    assert h.stats()["prebuilt"]["draft"] is None
    assert h.poll()["success"] is False
    wait_until(lambda: h.stats()["groups"]["dropped"] == {"incomplete_group_ttl": 1}, 10, "TTL")
    assert h.poll()["success"] is False and h.stats()["groups"]["served"] == 0
    assert fake_proxy.wait_for(
        lambda p: any(
            b["group_ids"] == ["built"] and b["reason"] == "incomplete_group_ttl" for b in p.calls
        )
    )
    assert_balanced(h.stats())


def test_k_lowered_while_groups_are_built_serves_them_whole(proxied: Any, writer):
    h = proxied()
    h.start(k=3)
    writer.group("three", 3)
    wait_until(lambda: draft_groups(h) == 1, 10, "the draft built")
    writer.group("two", 2)  # pending under K = 3
    h.settle()
    h.start(k=2)
    doc = h.poll()
    assert sessions(doc) == {"three": 3, "two": 2}
    assert doc["data"]["meta_info"]["partial_groups"] == []
    assert_balanced(h.stats())


def test_a_served_group_is_not_delivered_again_short_of_a_raised_k(proxied: Any, writer):
    """A trainer restarted with a larger K asks for what its checkpoint lacks: a group served under
    the smaller K is short of the K in force, and is not delivered again (its redelivery fails,
    counted), unless partial groups are on."""
    h = proxied()
    h.start(k=2)
    writer.group("g1", 2)
    assert list(groups_of(h.poll())) == ["g1"]
    r = h.start(k=3, restart_training=False, skip_instance_ids=["not-g1"])
    assert r["redelivery"]["queued"] == 1
    assert h.poll()["success"] is False
    s = h.stats()
    assert s["redelivery"]["failed"] == 1 and s["redelivery"]["delivered"] == 0
    writer.group("g2", 3)
    assert sessions(h.poll()) == {"g2": 3}


def test_with_partial_groups_on_a_served_group_is_delivered_again_as_partial(proxied: Any, writer):
    h = proxied(min_group_size=2)
    h.start(k=2)
    writer.group("g1", 2)
    assert list(groups_of(h.poll())) == ["g1"]
    h.start(k=3, restart_training=False, skip_instance_ids=["not-g1"])
    doc = h.poll()
    assert sessions(doc) == {"g1": 2}
    assert doc["data"]["meta_info"]["partial_groups"] == ["g1"]
    assert doc["data"]["meta_info"]["redelivered"] == ["g1"]
    assert h.stats()["redelivery"]["delivered"] == 1
