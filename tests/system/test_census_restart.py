"""The census across a kill -9 of a real gunicorn (issue 22): a group dropped as
session_without_result stays dropped, once, and the accounting balances."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import requests
from servers import Server, kill9
from support import Writer, now_text, wait_until

from rollout_buffer.storage import launcher_sql as q

FAKE_LAUNCHER = Path(__file__).resolve().parent.parent / "fakes" / "fake_launcher.py"


def test_a_session_without_result_drop_survives_a_kill_9(lite_url: str, tmp_path: Path) -> None:
    cmd = f"{sys.executable} {FAKE_LAUNCHER} --mode hang --max-steps 3"
    srv = Server(
        lite_url, tmp_path / "srv", launcher="auto", env={"ROLLOUT_BUFFER_LAUNCHER_CMD": cmd}
    )
    w = Writer(lite_url)
    srv.start()
    try:
        r = requests.post(
            srv.url + "/start_rollout",
            json={"num_repeat_per_sample": 2, "job_session": "job1"},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        for gid, sids in (("silent", ["s1", "s2"]), ("half", ["h1", "h2"])):
            for sid in sids:
                w.db.execute(
                    q.INSERT_ENV, ("job1", sid, "env", json.dumps({}), None, gid, 0, 0, now_text())
                )
        # "silent": both sessions capped, no trainable row; "half": one capped, one completed
        for sid in ("s1", "s2", "h1"):
            w.session(
                "silent" if sid[0] == "s" else "half", sid, 3, trainable=False, complete=False
            )
        w.step("half", "h2", 1, completed=True, step_reward=0.5)

        def stats() -> dict:
            return requests.get(srv.url + "/stats", timeout=10).json()

        assert wait_until(
            lambda: stats()["groups"].get("dropped", {}).get("session_without_result") == 2, 20
        ), stats()
        before = stats()
        assert before["accounting_balanced"], before["rows"]
        kill9(srv)
        srv.start()
        # a late trainable row of each dropped group after the restart
        w.step("silent", "s1", 4, completed=True)
        w.step("half", "h1", 4, completed=True)
        assert wait_until(
            # (until the restarted service has loaded the job, /stats has no rows)
            lambda: (
                stats().get("rows", {}).get("dropped", {}).get("late_rows_from_dropped_groups", 0)
                >= 2
            ),
            20,
        ), stats()
        after = stats()
        assert after["groups"]["dropped"] == before["groups"]["dropped"], after["groups"]
        assert after["accounting_balanced"], after["rows"]
        # the census reads the job's sessions again after the restart, beside the rows: the late
        # rows can be counted before it has read job_environments
        wait_until(
            lambda: stats()["sessions"]["ended_without_result"] == 3,
            20,
            lambda: f"the census after the restart: {stats()['sessions']}",
        )
        doc = requests.post(srv.url + "/get_rollout_data", json={}, timeout=30).json()
        assert not doc["success"]
    finally:
        w.close()
        srv.stop()
