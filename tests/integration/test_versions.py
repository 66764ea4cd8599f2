"""Hostile weight versions (issue 20, item 2), through the Flask test client on SQLite and
Postgres: no single row, session or group moves the job's current version, the trainer's reported
version is never overridden by row data, and a group with a version that cannot be true is dropped
as ``implausible_version`` (counted, its sessions cleared at the proxy), never served."""

from __future__ import annotations

from typing import Any

import pytest
from fakes.fake_proxy import FakeProxy
from support import Harness, assert_balanced, groups_of, wait_until

from rollout_buffer.storage.db import connect

TIMESTAMP = 1_700_000_000_000  # a millisecond timestamp a buggy environment wrote as its version


def version(v: int) -> dict:
    return {"weight_version": v}


@pytest.fixture
def proxy(fake_proxy: FakeProxy) -> FakeProxy:
    return fake_proxy


@pytest.fixture
def make(proxied: Any) -> Any:
    return proxied


def served(h: Harness, **body: Any) -> list[str]:
    doc = h.poll(**body)
    if not doc["success"]:
        return []
    return [s["group_id"] for s in doc["data"]["meta_info"]["group_stats"]]


def cleared(proxy: FakeProxy, reason: str) -> set[str]:
    return {g for b in proxy.calls if b["reason"] == reason for g in b["group_ids"]}


def test_a_poisoned_first_row_does_not_make_later_groups_stale_with_empty_polls(
    make, writer, proxy
):
    h = make(max_off_policy=2)
    h.start(k=2)
    # the job's first row: one session of a group that never completes, with a timestamp version
    writer.step("poisoned", "poisoned-a", 1, env_state=version(TIMESTAMP))
    for g in ("g1", "g2", "g3"):
        writer.group(g, 2, env_state=version(1))
    # once g1 and g2 agree on 1, a whole group with the timestamp cannot be true
    writer.group("all-poisoned", 2, env_state=version(TIMESTAMP))
    assert served(h) == ["g1", "g2", "g3"]
    s = h.stats()
    assert s["versions"]["current"] == 1
    assert s["groups"]["dropped"] == {"implausible_version": 1}
    assert_balanced(s)
    assert proxy.wait_for(lambda p: cleared(p, "implausible_version") == {"all-poisoned"})
    writer.group("g4", 2, env_state=version(2))
    assert served(h) == ["g4"]


def test_the_trainers_version_is_never_overridden_by_row_data(make, writer, proxy):
    h = make(max_off_policy=2)
    h.start(k=2)
    assert served(h, current_weight_version=3) == []
    writer.step("poisoned", "poisoned-a", 1, env_state=version(TIMESTAMP))  # incomplete group
    writer.group("timestamp", 2, env_state=version(TIMESTAMP))
    writer.group("negative", 2, env_state=version(-5))
    writer.group("far-ahead", 2, env_state=version(3 + 1001))  # beyond MAX_VERSION_JUMP (1000)
    writer.group("fresh", 2, env_state=version(3))
    writer.group("fresh2", 2, env_state=version(3))
    writer.group("newer", 2, env_state=version(9))  # plausible, but the trainer said 3
    assert served(h, current_weight_version=3) == ["fresh", "fresh2", "newer"]
    s = h.stats()
    assert s["versions"]["current"] == 3 and s["versions"]["trainer"] == 3
    # the incomplete "poisoned" too: a refused version is accounted at ingest (issue 35, item 2)
    assert s["groups"]["dropped"] == {"implausible_version": 4}
    assert_balanced(s)
    assert proxy.wait_for(
        lambda p: (
            cleared(p, "implausible_version") == {"poisoned", "timestamp", "negative", "far-ahead"}
        )
    )
    writer.group("later", 2, env_state=version(2))  # 3 - 2 <= 2: the rows' 9 does not make it stale
    assert served(h, current_weight_version=3) == ["later"]


def stored_rows_version(url: str) -> int | None:
    db = connect(url)
    try:
        return db.scalar("SELECT rows_version FROM rollout_buffer_jobs WHERE job_id = 'job1'")
    finally:
        db.close()


def test_a_poisoned_version_is_never_saved_with_the_cursor(db_url, harness_factory, writer):
    h = harness_factory(db_url, max_off_policy=2)
    h.start(k=2)
    writer.step("poisoned", "poisoned-a", 1, env_state=version(TIMESTAMP))
    writer.group("g1", 2, env_state=version(1))
    writer.group("g2", 2, env_state=version(1))
    assert served(h) == ["g1", "g2"]
    wait_until(lambda: stored_rows_version(db_url) == 1, 10, "the cursor saved with version 1")
    h.stop()
    again = harness_factory(db_url, max_off_policy=2)
    again.start(k=2)
    writer.group("g3", 2, env_state=version(1))
    assert served(again) == ["g3"]
    assert again.stats()["versions"]["current"] == 1


# -- a bogus version accounted at ingest (issue 35, item 2) ----------------------------------------


def metrics(h: Harness) -> str:
    r = h.client.get("/metrics")
    assert r.status_code == 200
    return r.get_data(as_text=True)


def versions_served(doc: dict) -> set[int]:
    return (
        {i["extra_info"]["weight_version"] for i in doc["data"]["data"]}
        if doc["success"]
        else set()
    )


def test_a_bogus_version_in_a_group_that_never_completes_is_accounted_at_ingest(
    make, writer, proxy
):
    """Groups at version 10 are served; then one row of a group that never completes carries a
    millisecond timestamp. Its group is dropped as implausible_version within 10 s, counted in
    /stats and /metrics, its sessions cleared; later groups are served, never stale for it."""
    h = make(max_off_policy=4)
    h.start(k=2)
    writer.group("g1", 2, env_state=version(10))
    writer.group("g2", 2, env_state=version(10))
    assert served(h) == ["g1", "g2"]
    writer.session("never", "never-a", 2, env_state=version(10))  # one session completes
    writer.session("never", "never-b", 1, complete=False, env_state=version(TIMESTAMP))
    wait_until(
        lambda: h.stats()["groups"]["dropped"] == {"implausible_version": 1},
        10,
        lambda: f"the bogus row accounted ({h.stats()['groups']})",
    )
    assert (
        'rollout_buffer_groups_dropped_total{job_session="job1",reason="implausible_version"} 1'
        in metrics(h)
    )
    assert proxy.wait_for(lambda p: cleared(p, "implausible_version") == {"never"})
    assert {s for b in proxy.calls for s in b["session_ids"]} == {"never-a", "never-b"}
    s = h.stats()
    assert s["groups"]["pending"] == 0 and s["rows"]["dropped"] == {"implausible_version": 3}
    assert s["versions"]["current"] == 10
    assert_balanced(s)
    # its later rows are late rows of a dropped group; later groups are served, never stale
    writer.step("never", "never-a", 3, env_state=version(TIMESTAMP))
    writer.group("g3", 2, env_state=version(11))
    doc = h.poll()
    assert list(groups_of(doc)) == ["g3"] and versions_served(doc) == {11}
    s = h.stats()
    assert s["rows"]["dropped"]["late_rows_from_dropped_groups"] == 1
    assert s["groups"]["dropped"] == {"implausible_version": 1}
    assert_balanced(s)


def test_a_bogus_version_in_a_ready_group_drops_it_before_it_is_served(make, writer, proxy):
    h = make(max_off_policy=4)
    h.start(k=2)
    assert served(h, current_weight_version=10) == []
    sessions = writer.group("ready", 2, env_state=version(10))
    h.settle()
    assert h.stats()["groups"]["ready"] == 1
    writer.step("ready", sessions[0], 3, env_state=version(TIMESTAMP))  # a row after completing
    # accounted at ingest, with no poll to build the group
    wait_until(lambda: h.stats()["groups"]["dropped"] == {"implausible_version": 1}, 10, "a drop")
    assert h.poll()["success"] is False
    s = h.stats()
    assert s["groups"]["ready"] == 0 and s["groups"]["served"] == 0
    assert_balanced(s)
    assert proxy.wait_for(lambda p: cleared(p, "implausible_version") == {"ready"})


def test_without_a_staleness_bound_a_bogus_version_changes_nothing(make, writer, proxy):
    """The original serves such rows, and so do we when no staleness bound is set."""
    h = make()
    h.start(k=2)
    writer.group("g1", 2, env_state=version(10))
    writer.group("g2", 2, env_state=version(10))
    assert served(h, current_weight_version=10) == ["g1", "g2"]
    writer.session("late", "late-a", 1, env_state=version(TIMESTAMP))
    h.settle()
    s = h.stats()
    assert s["groups"]["dropped"] == {} and s["groups"]["pending"] == 1
    writer.session("late", "late-b", 1, env_state=version(10))
    doc = h.poll()
    assert list(groups_of(doc)) == ["late"] and versions_served(doc) == {10, TIMESTAMP}
    assert proxy.calls == []


def test_a_bogus_version_for_a_group_in_the_prebuilt_draft_drops_it_without_a_poll(
    make, writer, proxy
):
    h = make(max_off_policy=4)
    h.start(k=2)
    assert served(h, current_weight_version=10) == []
    doomed = writer.group("doomed", 2, env_state=version(10))
    writer.group("fine", 2, env_state=version(10))
    wait_until(
        lambda: (h.stats()["prebuilt"]["draft"] or {}).get("groups") == 2, 10, "the draft built"
    )
    writer.step("doomed", doomed[1], 3, env_state=version(TIMESTAMP))
    wait_until(
        lambda: h.stats()["groups"]["dropped"] == {"implausible_version": 1},
        10,
        lambda: f"the drop, with no poll ({h.stats()['prebuilt']})",
    )
    assert proxy.wait_for(lambda p: cleared(p, "implausible_version") == {"doomed"})
    doc = h.poll()
    assert list(groups_of(doc)) == ["fine"] and versions_served(doc) == {10}
    s = h.stats()
    assert s["groups"]["served"] == 1 and s["prebuilt"]["discards"] >= 1
    assert_balanced(s)
