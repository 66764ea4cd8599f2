"""Responses built before the poll (prebuilt.py): through the Flask test client on both backends and
a real gunicorn killed -9. Each test waits until /stats shows the draft the background thread built,
so what it checks is the claimed draft, not a poll that happened to build on its own path."""

from __future__ import annotations

import threading
import time
import uuid

from servers import (
    Server,
    Trainer,
    assert_exactly_once,
    assert_stats_balance,
    complete_groups,
    kill9,
)
from support import assert_balanced, groups_of, wait_until

from rollout_buffer.storage.db import connect


def draft_of(h) -> dict | None:
    return h.stats()["prebuilt"]["draft"]


def with_a_draft(h, writer, groups: int, max_groups: int, **poll) -> None:
    """``groups`` ready groups, one poll of ``max_groups`` (the trainer's shape), then wait until
    the background thread has built the next ``max_groups`` into a draft."""
    h.start(k=2)
    env = {"env_state": poll.pop("env_state")} if "env_state" in poll else {}
    for i in range(groups):
        writer.group(f"g{i}", 2, steps=2, **env)
    h.settle()
    assert len(groups_of(h.poll(max_groups=max_groups, **poll))) == max_groups
    wait_until(
        lambda: (draft_of(h) or {}).get("groups") == max_groups,
        10,
        f"a draft of {max_groups} groups",
    )


def one_group_drafted(h, writer) -> tuple[dict[str, list[str]], str]:
    """Three groups, one served (max_groups=1), one built into the draft: (their sessions, the
    drafted one)."""
    h.start(k=2)
    sessions = {f"g{i}": writer.group(f"g{i}", 2, steps=2) for i in range(3)}
    h.settle()
    assert len(groups_of(h.poll(max_groups=1))) == 1
    wait_until(lambda: (draft_of(h) or {}).get("groups") == 1, 10, "a draft of one group")
    return sessions, next(g for g in ("g1", "g2") if h.service.current.accumulator.taken.get(g))


def stale_env(v: int) -> dict:
    return {"weight_version": v}


def test_a_prebuilt_response_is_what_an_unbuilt_poll_would_serve(harness, writer):
    harness.start(k=2)
    for i in range(6):
        writer.group(f"g{i}", 2, steps=3)
    harness.settle()
    assert sorted(groups_of(harness.poll(max_groups=2))) == [
        "g0",
        "g1",
    ]  # the trainer's shape: 2 groups
    wait_until(
        lambda: (draft_of(harness) or {}).get("groups") == 2, 10, "a draft of the next 2 groups"
    )
    before = harness.stats()["prebuilt"]
    rid = uuid.uuid4().hex
    doc = harness.poll(max_groups=2, request_id=rid)
    after = harness.stats()["prebuilt"]
    assert after["claims"] == before["claims"] + 1 and after["discards"] == before["discards"]
    assert [s["group_id"] for s in doc["data"]["meta_info"]["group_stats"]] == [
        "g2",
        "g3",
    ]  # the serve order
    # the replay rebuilds the batch from the rows with the recorded seed: byte for byte what a poll
    # that built it on its own path would have sent
    again = harness.poll(max_groups=2, request_id=rid)
    assert again["data"]["meta_info"]["replayed"] is True
    assert again["data"]["data"] == doc["data"]["data"]
    meta = dict(doc["data"]["meta_info"], replayed=True)
    assert {k: v for k, v in again["data"]["meta_info"].items()} == meta
    assert harness.poll(max_groups=2)["data"]["meta_info"]["finished_groups"] == ["g4", "g5"]
    assert harness.poll()["success"] is False
    s = harness.stats()
    assert s["groups"]["served"] == 6 and s["groups"]["in_flight"] == 0
    assert_balanced(s)


def test_a_prebuilt_group_reports_its_wait_and_age_until_it_is_served(harness, writer):
    """A group's figures are measured when it is served, whichever path built it: a group that
    waited in the draft reports that wait, not the few milliseconds before its build."""
    started = time.monotonic()
    with_a_draft(harness, writer, 3, 1)
    time.sleep(0.5)  # the group waits in the draft: wait_s and age_s must include this
    before = harness.stats()["prebuilt"]["claims"]
    doc = harness.poll(max_groups=1)
    waited = time.monotonic() - started  # since before its rows were written
    assert harness.stats()["prebuilt"]["claims"] == before + 1  # served from the draft
    [st] = doc["data"]["meta_info"]["group_stats"]
    assert waited >= st["age_s"] >= st["wait_s"] >= 0.5, (
        st
    )  # its rows were written before it was ready


def test_a_draft_of_another_shape_is_discarded_and_its_groups_served_once(harness, writer):
    with_a_draft(harness, writer, 8, 2)
    discards = harness.stats()["prebuilt"]["discards"]
    doc = harness.poll(max_groups=3)  # another shape: the draft's groups go back first, in order
    assert harness.stats()["prebuilt"]["discards"] == discards + 1
    assert [s["group_id"] for s in doc["data"]["meta_info"]["group_stats"]] == ["g2", "g3", "g4"]
    rest = harness.poll(max_groups=10)
    assert sorted(groups_of(rest)) == ["g5", "g6", "g7"]
    assert harness.poll()["success"] is False
    assert_balanced(harness.stats())


def test_a_group_that_goes_stale_while_in_the_draft_is_dropped_not_served(
    db_url, harness_factory, writer
):
    h = harness_factory(db_url, max_off_policy=2)
    with_a_draft(h, writer, 4, 1, current_weight_version=5, env_state=stale_env(5))
    # the trainer moved to version 9: every waiting group is now 4 versions old (> 2)
    doc = h.poll(max_groups=1, current_weight_version=9)
    assert doc["success"] is False
    s = h.stats()
    assert s["groups"]["dropped"] == {"stale": 3} and s["groups"]["served"] == 1
    assert s["prebuilt"]["discards"] >= 1 and s["prebuilt"]["draft"] is None
    assert_balanced(s)


def test_a_group_tainted_while_in_the_draft_is_dropped_as_malformed_as_a_ready_one_would_be(
    harness, writer
):
    sessions, drafted = one_group_drafted(harness, writer)
    writer.step(None, sessions[drafted][0], 3)  # a row of one of its sessions, without group_id
    harness.settle()
    doc = harness.poll(max_groups=1)
    assert drafted not in groups_of(doc)
    s = harness.stats()
    assert s["groups"]["dropped"] == {"malformed_row": 1} and s["rows"]["rejected"] == {
        "missing_group_id": 1
    }
    assert_balanced(s)


def test_a_served_session_that_grew_while_in_the_draft_is_served_as_an_unbuilt_poll_would(
    harness, writer
):
    sessions, drafted = one_group_drafted(harness, writer)
    sid = sessions[drafted][0]
    writer.step(
        drafted, sid, 3, completed=True, step_reward=0.9
    )  # its session goes on and ends again
    harness.settle()
    items = groups_of(harness.poll(max_groups=1))[drafted]
    mine = [i for i in items if i["extra_info"]["session_id"] == sid]
    assert [i["extra_info"]["steps"] for i in mine] == [1, 2, 3] and {
        i["reward"] for i in mine
    } == {0.9}
    assert_balanced(harness.stats())


def test_a_new_job_drops_the_drafts_groups_as_job_ended_never_loses_them(harness, writer, db_url):
    with_a_draft(harness, writer, 3, 1)
    harness.start(k=2, job="job2")
    assert draft_of(harness) is None
    db = connect(db_url)
    try:
        decided = dict(
            db.rows(
                "SELECT group_id, COALESCE(reason, status) FROM rollout_buffer_groups "
                "WHERE job_id = 'job1'"
            )
        )
    finally:
        db.close()
    assert decided == {"g0": "served", "g1": "job_ended", "g2": "job_ended"}


def test_prebuild_off_builds_nothing_ahead(db_url, harness_factory, writer):
    h = harness_factory(db_url, prebuild=False)
    h.start(k=2)
    for i in range(4):
        writer.group(f"g{i}", 2, steps=2)
    h.settle()
    h.poll(max_groups=1)
    assert h.service.sync() and h.service.sync()
    s = h.stats()["prebuilt"]
    assert s == {"enabled": False, "draft": None, "builds": 0, "claims": 0, "discards": 0}
    assert s is not None and not [
        t for t in threading.enumerate() if t.name == "rollout-buffer-prebuild"
    ]
    assert h.stats()["groups"]["ready"] == 3


def test_kill_9_between_building_and_sending_loses_nothing(db_url, writer, tmp_path):
    srv = Server(db_url, tmp_path / "srv").start()
    try:
        trainer = Trainer(srv)
        trainer.start_rollout(k=2)
        for i in range(8):
            writer.group(f"g{i}", 2, steps=2)
        first = trainer.poll(max_groups=2, retry_for=30)
        while not first["success"]:
            first = trainer.poll(max_groups=2)
        wait_until(
            lambda: (trainer.stats()["prebuilt"]["draft"] or {}).get("groups") == 2,
            15,
            "a draft of the next 2 groups",
        )
        kill9(srv)  # the draft was built, never claimed: nothing of it was recorded
        srv.start()
        trainer.drain(set(complete_groups(db_url, "job1", k=2)), max_groups=2)
        assert_exactly_once(trainer, complete_groups(db_url, "job1", k=2))
        assert_stats_balance(trainer, db_url)
    finally:
        srv.stop()
