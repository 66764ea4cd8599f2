"""Suspicions from reading the code (issue 20, item 8), each proved or refuted through the service
and the Flask test client on SQLite and Postgres."""

from __future__ import annotations

import contextlib

from support import assert_balanced, groups_of, wait_until

from rollout_buffer.storage import db as db_mod
from rollout_buffer.storage.db import connect


def spoil_rows(db_url: str, group_id: str) -> None:
    """What a hostile or buggy launcher can do to rows the buffer already served."""
    db = connect(db_url)
    try:
        db.execute(
            "UPDATE session_steps SET messages = '{not json' WHERE group_id = ?", (group_id,)
        )
    finally:
        db.close()


def prune_row(db_url: str, group_id: str) -> None:
    """A launcher that prunes its table: one row of a served group is gone."""
    db = connect(db_url)
    try:
        pk = db.scalar("SELECT MAX(id) FROM session_steps WHERE group_id = ?", (group_id,))
        db.execute("DELETE FROM session_steps WHERE id = ?", (pk,))
    finally:
        db.close()


def test_an_uncertain_commit_of_only_a_failed_redelivery_is_settled_not_a_500(
    harness, writer, db_url, monkeypatch
):
    """Proved: a poll whose plan holds only a failed redelivery (no batch, no drop) and whose COMMIT
    reports an error left the next poll indexing ``plan.drops[0]`` of an empty list: a 500."""
    harness.start(k=1)
    writer.group("g1", 1, steps=1)
    assert list(groups_of(harness.poll())) == ["g1"]
    r = harness.start(k=1, restart_training=False, skip_instance_ids=["not-g1"])
    assert r["redelivery"]["queued"] == 1
    spoil_rows(db_url, "g1")  # its redelivery is refused when it is built: malformed
    real = db_mod.Database.transaction

    @contextlib.contextmanager
    def commit_then_raise(self):
        with real(self) as db:
            yield db
        raise db_mod.StorageError("connection lost after COMMIT")

    monkeypatch.setattr(db_mod.Database, "transaction", commit_then_raise)
    assert harness.client.post("/get_rollout_data", json={}).status_code == 503
    monkeypatch.setattr(db_mod.Database, "transaction", real)
    r = harness.client.post("/get_rollout_data", json={})
    assert r.status_code == 200, r.get_data(as_text=True)[:300]
    assert r.get_json()["success"] is False  # the failed redelivery is not tried again
    writer.group("g2", 1, steps=1)
    assert list(groups_of(harness.poll())) == ["g2"]
    assert_balanced(harness.stats())


def test_a_replay_never_sends_a_group_short_of_a_pruned_row(harness, writer, db_url):
    """Proved: replaying a request_id rebuilt each group from the rows still in session_steps; a
    pruned row made a short group. The replay now refuses with a JSON error instead."""
    harness.start(k=2)
    writer.group("g1", 2, steps=2)
    first = harness.poll(request_id="R1")
    assert len(groups_of(first)["g1"]) == 4
    prune_row(db_url, "g1")
    r = harness.client.post("/get_rollout_data", json={"request_id": "R1"})
    if r.status_code == 200:  # a replay must be the batch as it was, or nothing
        assert r.get_json()["data"]["data"] == first["data"]["data"]
    assert r.status_code == 410, r.get_data(as_text=True)[:300]
    assert "no longer" in r.get_json()["message"]


def test_raising_k_never_strands_a_ready_group_until_a_silent_ttl_drop(
    db_url, proxied, fake_proxy, writer
):
    """Proved: with over-sampling, a ready group whose extra session was already dropped went back
    to pending when K was raised and, when no other session came, ended as a TTL drop. It stays open
    to new sessions. At its TTL it is dropped as ``incomplete_group_ttl``, never served short of the
    K in force (issue 35, item 1, superseding the partial serve): counted in /stats, and its
    sessions cleared at the proxy, so the drop is not silent."""
    h = proxied(oversample=1, ttl_s=0.5)
    h.start(k=2)
    writer.group("chosen", 3)  # K + 1 sessions completed: the third is dropped as oversampled
    writer.group("open", 2)  # exactly K: nothing dropped
    h.settle()
    s = h.stats()
    assert s["groups"]["ready"] == 2 and s["rows"]["dropped"] == {"oversampled": 2}
    h.start(k=3)  # the same job, a larger K
    writer.step("open", "open-third", 1, completed=True)
    assert list(groups_of(h.poll())) == ["open"]
    wait_until(lambda: h.stats()["groups"]["pending"] == 0, 10, "the TTL of 'chosen'")
    assert h.poll()["success"] is False
    s = h.stats()
    assert s["groups"]["dropped"] == {"incomplete_group_ttl": 1}
    assert s["groups"]["served"] == 1 and s["groups"]["partial"] == 0
    assert_balanced(s)
    assert fake_proxy.wait_for(
        lambda p: any(
            b["reason"] == "incomplete_group_ttl" and b["group_ids"] == ["chosen"] for b in p.calls
        )
    )
