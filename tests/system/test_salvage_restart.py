"""Salvage across a kill -9 of a real gunicorn (issue 38): a group salvaged but not yet served is
salvaged again by the restarted service and served once; once served, it stays served (its late
terminal row is a late row of a served group), its salvage counts survive, and the accounting
balances. Both backends."""

from __future__ import annotations

import sys
from pathlib import Path

import requests
from servers import Server, kill9
from support import Writer, groups_of, wait_until

FAKE_LAUNCHER = Path(__file__).resolve().parent.parent / "fakes" / "fake_launcher.py"


def test_a_salvaged_group_is_served_once_across_kill_9(db_url: str, tmp_path: Path) -> None:
    cmd = f"{sys.executable} {FAKE_LAUNCHER} --mode hang --max-steps 3"
    srv = Server(
        db_url,
        tmp_path / "srv",
        launcher="auto",
        env={"ROLLOUT_BUFFER_LAUNCHER_CMD": cmd, "ROLLOUT_BUFFER_SALVAGE": "truncate"},
    )
    w = Writer(db_url)
    srv.start()

    def stats() -> dict:
        return requests.get(srv.url + "/stats", timeout=10).json()

    def poll(**body: str) -> dict:
        return requests.post(srv.url + "/get_rollout_data", json=body, timeout=30).json()

    try:
        r = requests.post(
            srv.url + "/start_rollout",
            json={"num_repeat_per_sample": 2, "job_session": "job1"},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        w.schedule("g", ["ok", "capped"])
        w.step("g", "ok", 1, trainable=False)
        w.step("g", "ok", 2, completed=True, step_reward=1.0)
        capped = w.session("g", "capped", 3, trainable=False, complete=False)
        assert wait_until(lambda: stats().get("groups", {}).get("ready") == 1, 20), stats()
        kill9(srv)  # salvaged, not served: the restarted service decides it again
        srv.start()
        assert wait_until(lambda: stats().get("groups", {}).get("ready") == 1, 20), stats()
        doc = poll(request_id="r-1")
        items = groups_of(doc)["g"]
        truncated = [i for i in items if i["extra_info"].get("salvaged")]
        assert [i["extra_info"]["step_pk"] for i in truncated] == [capped[-1]]
        assert truncated[0]["extra_info"]["salvaged"] == "step_cap"
        served = stats()
        assert served["salvaged"]["groups"] == {"step_cap": 1}
        assert served["accounting_balanced"], served["rows"]

        kill9(srv)  # served: it stays served, with its counts
        srv.start()
        w.step("g", "capped", 4, completed=True, step_reward=1.0)  # its own terminal row, late
        assert wait_until(
            lambda: (
                stats().get("rows", {}).get("dropped", {}).get("late_rows_from_served_groups") == 1
            ),
            20,
        ), stats()
        after = stats()
        assert after["salvaged"]["sessions"] == {"step_cap": 1}
        assert after["salvaged"]["groups"] == {"step_cap": 1}
        assert after["groups"]["served"] == 1
        assert after["rows"]["served"] == served["rows"]["served"] == 2
        assert after["accounting_balanced"], after["rows"]
        # the trainer lost the answer: its retry gets the salvaged group as first sent
        again = poll(request_id="r-1")
        assert again["data"]["meta_info"]["replayed"] is True
        assert again["data"]["data"] == doc["data"]["data"]
        assert not poll()["success"]
    finally:
        w.close()
        srv.stop()
