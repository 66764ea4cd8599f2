"""Two buffers on one state database (ROLLOUT_BUFFER_NAME, issue 20) through the Flask test client,
on SQLite and Postgres: a /start_rollout for a job that the other buffer owns is a 409 naming that
buffer, and it changes nothing on either side."""

from __future__ import annotations

from support import Writer


def test_a_job_of_another_buffer_is_a_409_that_changes_nothing(db_url, harness_factory):
    alpha = harness_factory(db_url, buffer_name="alpha")
    beta = harness_factory(db_url, buffer_name="beta")
    alpha.start(k=2, job="job-a")
    beta.start(k=2, job="job-b")
    writer = Writer(db_url, job="job-b")
    try:
        writer.group("b-pending", 2, steps=1, complete=1)
    finally:
        writer.close()
    beta.settle()
    assert beta.stats()["groups"]["pending"] == 1

    r = beta.client.post(
        "/start_rollout", json={"num_repeat_per_sample": 2, "job_session": "job-a"}
    )
    assert r.status_code == 409, r.get_json()
    body = r.get_json()
    assert body["ok"] is False and body["status"] == 409 and body["buffer"] == "alpha"
    assert "'alpha'" in body["error"] and "job-a" in body["error"]
    beta.settle()
    assert beta.service.health()["job_session"] == "job-b"
    assert beta.stats()["groups"]["pending"] == 1 and beta.stats()["groups"]["dropped_total"] == 0
    assert alpha.service.health()["job_session"] == "job-a"
    assert alpha.service.health()["buffer"] == "alpha" and alpha.service.health()["role"] == "owner"
    # and the other way round
    r = alpha.client.post(
        "/start_rollout", json={"num_repeat_per_sample": 2, "job_session": "job-b"}
    )
    assert r.status_code == 409 and r.get_json()["buffer"] == "beta"
