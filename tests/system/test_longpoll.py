"""Long-poll (``wait_s``, ``min_groups``): through the Flask test client on both backends, and a
real gunicorn for SIGTERM. A waiting poll runs in its own thread; what it waits for is written by
the test while it waits, so each answer's timing is caused, not guessed."""

from __future__ import annotations

import signal
import threading
import time

import requests
from servers import Server
from support import groups_of, wait_until


class Waiting:
    """A poll sent in a thread; ``result()`` joins it."""

    def __init__(self, harness, **body) -> None:
        self.doc: dict | None = None
        self.status: int | None = None
        self.seconds = 0.0
        self._t = threading.Thread(target=self._run, args=(harness, body), daemon=True)
        self._t.start()

    def _run(self, harness, body) -> None:
        t0 = time.monotonic()
        r = harness.client.post("/get_rollout_data", json=body)
        self.seconds = time.monotonic() - t0
        self.status, self.doc = r.status_code, r.get_json()

    def result(self, timeout: float = 30.0) -> dict:
        self._t.join(timeout)
        assert not self._t.is_alive(), "the poll never answered"
        assert self.status == 200, self.doc
        assert self.doc is not None
        return self.doc


def waiting_count(harness) -> int:
    return harness.stats()["polls"]["waiting"]


def test_long_poll_answers_when_the_first_group_is_ready(harness, writer):
    harness.start(k=2)
    p = Waiting(harness, wait_s=30)
    wait_until(lambda: waiting_count(harness) == 1, what="the poll is waiting")
    assert p.doc is None
    writer.group("g1", 2, steps=2)
    doc = p.result()
    assert list(groups_of(doc)) == ["g1"]
    assert p.seconds < 10  # answered by the group, far before wait_s


def test_long_poll_answers_empty_after_wait_s(harness):
    harness.start(k=2)
    t0 = time.monotonic()
    doc = harness.poll(wait_s=0.5)
    took = time.monotonic() - t0
    assert doc["success"] is False and doc["message"] == "No data available to read"
    assert took >= 0.5


def test_min_groups_holds_the_answer_until_that_many_are_ready(harness, writer):
    harness.start(k=2)
    p = Waiting(harness, wait_s=30, min_groups=3)
    wait_until(lambda: waiting_count(harness) == 1, what="the poll is waiting")
    writer.group("g1", 2, steps=1)
    writer.group("g2", 2, steps=1)
    assert harness.service.sync()
    assert wait_until(lambda: harness.stats()["groups"]["ready"] == 2, what="two ready")
    assert harness.service.sync() and p.doc is None  # two ready, ticks ran: still waiting
    writer.group("g3", 2, steps=1)
    assert sorted(groups_of(p.result())) == ["g1", "g2", "g3"]


def test_the_cap_on_waiting_polls_answers_the_others_at_once(db_url, harness_factory):
    h = harness_factory(db_url, max_waiting_polls=2)
    h.start(k=2)
    waiting = [Waiting(h, wait_s=30), Waiting(h, wait_s=30)]
    wait_until(lambda: waiting_count(h) == 2, what="two polls waiting")
    t0 = time.monotonic()
    doc = h.poll(wait_s=30)
    assert doc["success"] is False and time.monotonic() - t0 < 5  # over the cap: answered at once
    assert waiting_count(h) == 2
    h.client.post("/stop_rollout", json={})  # answers the waiting ones at once
    for p in waiting:
        assert p.result(10)["success"] is False


def test_a_request_id_replays_during_and_after_a_wait(harness, writer):
    harness.start(k=2)
    p = Waiting(harness, wait_s=30, request_id="rid-1")
    wait_until(lambda: waiting_count(harness) == 1, what="the poll is waiting")
    writer.group("g1", 2, steps=2)
    first = p.result()
    assert list(groups_of(first)) == ["g1"]
    again = harness.poll(
        wait_s=30, request_id="rid-1"
    )  # a retry: replayed at once, never waited for
    assert again["data"]["meta_info"]["replayed"] is True
    assert [i["uid"] for i in again["data"]["data"]] == [i["uid"] for i in first["data"]["data"]]


def test_bad_wait_s_and_min_groups_are_400(harness):
    harness.start(k=2)
    for body in (
        {"wait_s": -1},
        {"wait_s": 61},
        {"wait_s": True},
        {"wait_s": "5"},
        {"min_groups": 0},
        {"min_groups": 1.5},
        {"min_groups": "2"},
    ):
        r = harness.client.post("/get_rollout_data", json=body)
        assert r.status_code == 400, body
        err = r.get_json()
        assert err["success"] is False and next(iter(body)) in err["error"], err


def test_sigterm_answers_a_waiting_poll_at_once(lite_url, tmp_path):
    srv = Server(lite_url, tmp_path / "srv")
    srv.start()
    try:
        r = requests.post(
            srv.url + "/start_rollout",
            json={"num_repeat_per_sample": 2, "job_session": "j"},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        out: dict = {}

        def wait() -> None:
            t0 = time.monotonic()
            resp = requests.post(srv.url + "/get_rollout_data", json={"wait_s": 60}, timeout=90)
            out["status"], out["doc"], out["seconds"] = (
                resp.status_code,
                resp.json(),
                time.monotonic() - t0,
            )

        t = threading.Thread(target=wait, daemon=True)
        t.start()
        wait_until(
            lambda: requests.get(srv.url + "/stats", timeout=5).json()["polls"]["waiting"] == 1,
            what="the poll is waiting in the server",
        )
        assert srv.proc is not None
        t_term = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        t.join(30)
        assert not t.is_alive(), "the waiting poll was not answered on SIGTERM"
        assert out["status"] == 200 and out["doc"]["success"] is False
        assert time.monotonic() - t_term < 10  # not the 60 s wait, nor gunicorn's graceful timeout
    finally:
        srv.stop()
