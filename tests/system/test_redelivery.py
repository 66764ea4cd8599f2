"""Redelivery after a trainer crash (``skip_instance_ids`` on a /start_rollout that begins no new
job): through the Flask test client and a real gunicorn killed -9, on both backends, with a real
launcher process for the upstream client's "already running" call."""

from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path

import requests
from servers import Server, kill9
from support import assert_balanced, wait_until

from rollout_buffer.storage.db import connect

FAKE_LAUNCHER = Path(__file__).parent.parent / "fakes" / "fake_launcher.py"


def finished(doc: dict) -> list[str]:
    return doc["data"]["meta_info"]["finished_groups"]


def by_step(doc: dict, redelivered: bool = False) -> dict[int, dict]:
    """A response's items by step_pk, without what differs between two deliveries (uid, the
    flag)."""
    out = {}
    for item in doc["data"]["data"]:
        extra = dict(item["extra_info"])
        assert extra.pop("redelivered", False) is redelivered, item["extra_info"]
        out[extra["step_pk"]] = {**item, "uid": None, "extra_info": extra}
    return out


def serve_ten_batches(harness, writer, k: int = 2) -> list[dict]:
    """20 groups, then 10 polls of 2 groups each: the batches a trainer trained on."""
    harness.start(k=k)
    for i in range(20):
        writer.group(f"g{i:02d}", k, steps=2)
    docs = [harness.poll(max_groups=2) for _ in range(10)]
    assert all(len(finished(d)) == 2 for d in docs)
    assert len({g for d in docs for g in finished(d)}) == 20
    return docs


def test_a_checkpoint_of_six_batches_of_ten_gets_batches_seven_to_ten_again_and_nothing_else(
    harness, writer
):
    docs = serve_ten_batches(harness, writer)
    checkpoint = [g for d in docs[:6] for g in finished(d)]
    lost = [g for d in docs[6:] for g in finished(d)]
    writer.group("new1", 2, steps=2)
    writer.group("new2", 2, steps=2)
    harness.settle()
    r = harness.start(k=2, restart_training=False, skip_instance_ids=checkpoint)
    assert r["redelivery"] == {
        "queued": 8,
        "cancelled": 0,
        "skip_instance_ids": 12,
        "groups": lost,
    }

    again = harness.poll(
        max_groups=8
    )  # ahead of the two new ready groups, in the order first served
    meta = again["data"]["meta_info"]
    assert finished(again) == lost and meta["redelivered"] == lost and meta["replayed"] is False
    first = {}
    for d in docs[6:]:
        first.update(by_step(d))
    assert by_step(again, redelivered=True) == first  # the same items, rebuilt from the rows
    old_uids = {i["uid"] for d in docs for i in d["data"]["data"]}
    new_uids = {i["uid"] for i in again["data"]["data"]}
    assert len(new_uids) == len(again["data"]["data"]) and not new_uids & old_uids  # new uids

    fresh = harness.poll()
    assert (
        sorted(finished(fresh)) == ["new1", "new2"]
        and fresh["data"]["meta_info"]["redelivered"] == []
    )
    by_step(fresh, redelivered=False)
    assert harness.poll()["success"] is False  # nothing of batches 1-6, nothing twice

    s = harness.stats()
    assert s["redelivery"] == {
        "queued": 0,
        "requested": 8,
        "delivered": 8,
        "cancelled": 0,
        "failed": 0,
    }
    assert s["groups"]["served"] == 22  # a redelivery is not a second decision
    assert_balanced(s)
    metrics = harness.client.get("/metrics").get_data(as_text=True).splitlines()
    assert 'rollout_buffer_redeliveries_total{job_session="job1",outcome="delivered"} 8' in metrics
    assert 'rollout_buffer_redelivery_queued{job_session="job1"} 0' in metrics


def test_a_redelivered_batch_replays_identically_for_its_request_id(harness, writer):
    docs = serve_ten_batches(harness, writer)
    harness.start(k=2, restart_training=False, skip_instance_ids=finished(docs[0]))
    rid = uuid.uuid4().hex
    again = harness.poll(max_groups=3, request_id=rid)
    retry = harness.poll(max_groups=3, request_id=rid)
    assert retry["data"]["meta_info"]["replayed"] is True
    assert retry["data"]["data"] == again["data"]["data"]  # same uids, same redelivered flags
    assert (
        retry["data"]["meta_info"]["redelivered"]
        == finished(again)
        == finished(docs[1]) + finished(docs[2])[:1]
    )


def test_an_empty_list_a_missing_field_and_a_new_job_change_nothing(harness, writer):
    docs = serve_ten_batches(harness, writer)
    for body in ({"skip_instance_ids": []}, {}, {"skip_instance_ids": None}):
        r = harness.start(k=2, restart_training=False, **body)
        assert "redelivery" not in r
        assert harness.poll()["success"] is False
    # the same job restarted (restart_training: a new start of the job), and another job
    for job, restart in (("job1", True), ("job2", False)):
        r = harness.start(
            k=2, job=job, restart_training=restart, skip_instance_ids=finished(docs[0])
        )
        assert "redelivery" not in r and r["message"] == "Rollout started"
        assert harness.poll()["success"] is False
    assert harness.stats()["redelivery"]["requested"] == 0


def test_bad_skip_lists_are_refused_with_a_clear_error(harness, writer):
    harness.start(k=2)
    for bad in ("g1", {"g": 1}, [1.5], [None], ["g", ["h"]]):
        r = harness.client.post(
            "/start_rollout",
            json={"num_repeat_per_sample": 2, "job_session": "job1", "skip_instance_ids": bad},
        )
        assert r.status_code == 400, bad
        assert (
            r.get_json()["field"] == "skip_instance_ids"
            and "list of group ids" in r.get_json()["error"]
        )


def test_a_second_crash_requeues_and_a_later_checkpoint_cancels(harness, writer):
    docs = serve_ten_batches(harness, writer)
    all_groups = [g for d in docs for g in finished(d)]
    harness.start(k=2, restart_training=False, skip_instance_ids=all_groups[:16])  # 4 groups queued
    got = harness.poll(max_groups=2)
    assert finished(got) == all_groups[16:18]
    # the trainer crashed again: its checkpoint holds the first 17 groups now
    r = harness.start(k=2, restart_training=False, skip_instance_ids=all_groups[:17])
    assert r["redelivery"] == {
        "queued": 3,
        "cancelled": 0,
        "skip_instance_ids": 17,
        "groups": all_groups[17:],
    }
    # and once more before polling: its checkpoint holds 18 (one queued group is cancelled)
    r = harness.start(k=2, restart_training=False, skip_instance_ids=all_groups[:18])
    assert r["redelivery"] == {
        "queued": 2,
        "cancelled": 1,
        "skip_instance_ids": 18,
        "groups": all_groups[18:],
    }
    assert finished(harness.poll()) == all_groups[18:]
    assert harness.poll()["success"] is False
    s = harness.stats()["redelivery"]
    assert s == {"queued": 0, "requested": 4 + 3 + 2, "delivered": 4, "cancelled": 1, "failed": 0}


def test_a_group_whose_rows_are_gone_is_accounted_as_failed_never_served_short(
    harness, writer, db_url
):
    docs = serve_ten_batches(harness, writer)
    lost = finished(docs[9])
    db = connect(db_url)
    try:  # the launcher's retention deleted a row of the first lost group
        pk = by_step(docs[9]).popitem()[0]
        db.execute("DELETE FROM session_steps WHERE id = ?", (pk,))
    finally:
        db.close()
    gone = next(
        i["instance_id"] for i in docs[9]["data"]["data"] if i["extra_info"]["step_pk"] == pk
    )
    harness.start(
        k=2, restart_training=False, skip_instance_ids=[g for d in docs[:9] for g in finished(d)]
    )
    doc = harness.poll()
    assert finished(doc) == [g for g in lost if g != gone]
    assert harness.poll()["success"] is False
    s = harness.stats()["redelivery"]
    assert s["failed"] == 1 and s["delivered"] == 1 and s["queued"] == 0


def test_the_upstream_clients_exact_payload_to_an_already_running_launcher(
    db_url, writer, harness_factory, tmp_path
):
    h = harness_factory(
        db_url,
        launcher_cmd=(sys.executable, str(FAKE_LAUNCHER), "--mode", "hang"),
        stop_grace_s=2.0,
    )
    docs = serve_ten_batches(h, writer)
    assert h.service.supervisor.state()["running"]
    metadata = {
        "0": finished(docs[0]) + finished(docs[1]),
        "1": finished(docs[2]),
    }  # data_buffer.get_metadata()
    # what slime's generate_rollout sends, field for field (restart_training defaults to True)
    payload = {
        "num_process": "100",
        "num_epoch": "3",
        "remote_engine_url": "http://10.0.0.1:30000",
        "remote_buffer_url": "http://10.0.0.2:8889",
        "task_type": "swe",
        "input_file": "/data/prompts.jsonl",
        "num_repeat_per_sample": 2,
        "max_tokens": 8192,
        "sampling_params": {"max_tokens": 8192, "temperature": 1.0, "top_p": 1.0},
        "tokenizer_path": "/ckpt/hf",
        "skip_instance_ids": [g for sub in metadata.values() for g in sub],
        "restart_training": True,
    }
    r = h.client.post("/start_rollout", json=payload)
    assert r.status_code == 200, r.get_json()
    body = r.get_json()
    assert body["message"] == "AIEvoBox is already running" and body["job_session"] == "job1"
    assert body["redelivery"]["queued"] == 14
    got = []
    while True:  # the upstream client's poll: an empty body
        doc = h.poll()
        if not doc["success"]:
            break
        got += finished(doc)
    assert got == [g for d in docs[3:] for g in finished(d)]


def test_redelivery_survives_kill_9_of_the_service(db_url, writer, tmp_path):
    srv = Server(db_url, tmp_path / "srv").start()
    s = requests.Session()

    def post(path: str, body: dict) -> dict:
        r = s.post(srv.url + path, json=body, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    def poll(**body) -> dict:
        for _ in range(300):
            r = s.post(srv.url + "/get_rollout_data", json=body, timeout=30)
            if r.status_code == 200 and (r.json()["success"] or not body.get("expect")):
                return r.json()
            assert r.status_code in (200, 503), r.text
            time.sleep(0.05)
        raise AssertionError("no data")

    try:
        post("/start_rollout", {"num_repeat_per_sample": 2, "job_session": "job1"})
        for i in range(12):
            writer.group(f"g{i:02d}", 2, steps=2)
        wait_until(
            lambda: s.get(srv.url + "/stats", timeout=30).json()["groups"]["ready"] == 12,
            15,
            "12 ready",
        )
        batches = [finished(poll(max_groups=2, expect=True)) for _ in range(6)]
        assert all(len(b) == 2 for b in batches)
        lost = [g for b in batches[3:] for g in b]
        r = post(
            "/start_rollout",
            {
                "num_repeat_per_sample": 2,
                "job_session": "job1",
                "restart_training": False,
                "skip_instance_ids": [g for b in batches[:3] for g in b],
            },
        )
        assert r["redelivery"]["queued"] == 6
        kill9(srv)  # the queue was recorded before the answer
        srv.start()
        first = poll(max_groups=2, expect=True)
        assert finished(first) == lost[:2] and first["data"]["meta_info"]["redelivered"] == lost[:2]
        kill9(srv)  # the first two were recorded as delivered before they were sent
        srv.start()
        rest = poll(expect=True)
        assert finished(rest) == lost[2:]
        assert all(i["extra_info"]["redelivered"] is True for i in rest["data"]["data"])
        assert poll()["success"] is False
        stats = s.get(srv.url + "/stats", timeout=30).json()
        assert stats["redelivery"] == {
            "queued": 0,
            "requested": 6,
            "delivered": 6,
            "cancelled": 0,
            "failed": 0,
        }
        assert_balanced(stats)
    finally:
        srv.stop()
