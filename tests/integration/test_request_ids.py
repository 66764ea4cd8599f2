"""Polls with and without a request_id (issue 35, item 3), through the service and the Flask test
client on SQLite and Postgres: a poll without one stays at-most-once, as in the original; a kept
batch answers its request_id however many clients resume it, and each such answer counts in
/stats ``polls.replayed``; a request_id bound to a batch of an earlier job is refused with a JSON
error naming that job, never answered with the active job's groups."""

from __future__ import annotations

from support import assert_balanced, groups_of


def uids(doc: dict) -> list[str]:
    return [i["uid"] for i in doc["data"]["data"]]


def test_a_poll_without_request_id_is_never_delivered_again(harness, writer):
    harness.start(k=2)
    writer.group("g1", 2)
    assert list(groups_of(harness.poll())) == ["g1"]  # its answer lost on the way: at-most-once
    assert harness.poll()["success"] is False
    writer.group("g2", 2)
    assert list(groups_of(harness.poll())) == ["g2"]
    s = harness.stats()
    assert s["polls"]["replayed"] == 0 and s["groups"]["served"] == 2
    assert_balanced(s)


def test_two_clients_resuming_one_request_id_get_the_same_batch_and_nothing_else(harness, writer):
    harness.start(k=2)
    writer.group("g1", 2)
    first = harness.poll(request_id="R")
    writer.group("g2", 2)
    harness.settle()
    again = [harness.poll(request_id="R", max_groups=5) for _ in range(2)]
    for doc in again:
        assert doc["data"]["meta_info"]["replayed"] is True and uids(doc) == uids(first)
    s = harness.stats()
    assert s["polls"]["replayed"] == 2 and s["groups"]["ready"] == 1  # g2 stays for a new poll
    r = harness.client.get("/metrics")
    assert "rollout_buffer_polls_replayed_total 2" in r.get_data(as_text=True)
    assert list(groups_of(harness.poll(request_id="S"))) == ["g2"]


def test_a_request_id_of_an_earlier_job_is_refused_not_answered_with_this_jobs_groups(
    db_url, harness, writer
):
    harness.start(k=2, job="A")
    writer.group("a1", 2, job="A")
    assert list(groups_of(harness.poll(request_id="R"))) == ["a1"]
    harness.start(k=2, job="B")  # the trainer switched jobs; a client resumes R
    for ready in (False, True):  # with nothing to serve, and with a group ready
        if ready:
            writer.group("b1", 2, job="B")
            harness.settle()
        r = harness.client.post("/get_rollout_data", json={"request_id": "R"})
        assert r.status_code == 409, r.get_data(as_text=True)[:300]
        body = r.get_json()
        assert body["success"] is False and "'A'" in body["error"] and "R" in body["error"]
    assert harness.stats()["groups"]["ready"] == 1  # b1 was not taken
    assert list(groups_of(harness.poll(request_id="S"))) == ["b1"]
