"""Hostile weight versions (issue 20, item 2), through the Flask test client on SQLite and
Postgres: no single row, session or group moves the job's current version, the trainer's reported
version is never overridden by row data, and a group with a version that cannot be true is dropped
as ``implausible_version`` (counted, its sessions cleared at the proxy), never served."""

from __future__ import annotations

from typing import Any

import pytest
from fakes.fake_proxy import FakeProxy
from support import Harness, assert_balanced, wait_until

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
    assert s["groups"]["dropped"] == {"implausible_version": 3}
    assert_balanced(s)
    assert proxy.wait_for(
        lambda p: cleared(p, "implausible_version") == {"timestamp", "negative", "far-ahead"}
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
