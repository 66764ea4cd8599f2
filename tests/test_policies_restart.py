"""The training-data policies hold across a kill -9 of a real gunicorn (issue 10, "Restarts"), on
SQLite and Postgres: their decisions are tombstones like the others, the job's current version
comes back from the stored trainer and row versions (rows below the low-water mark are never read
again), the over-sampled sessions' later rows stay dropped, the figures and ``filtered`` survive."""
from __future__ import annotations

import signal
from typing import Any

import pytest
import requests

from fakes.fake_proxy import FakeProxy
from rollout_buffer.db import connect
from rollout_buffer import procfs
from servers import Server
from support import Writer, assert_balanced, wait_until

pytestmark = pytest.mark.slow


def stats(srv: Server) -> dict:
    r = requests.get(srv.url + "/stats", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def poll(srv: Server, **body: Any) -> dict:
    r = requests.post(srv.url + "/get_rollout_data", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def stored_versions(url: str) -> tuple:
    db = connect(url)
    try:
        return tuple(db.rows("SELECT trainer_version, rows_version FROM rollout_buffer_jobs WHERE job_id = 'J'")[0])
    finally:
        db.close()


def test_policies_hold_after_kill_9_and_restart(db_url, tmp_path):
    with FakeProxy() as proxy:
        env = {"ROLLOUT_BUFFER_MAX_OFF_POLICY": "1", "ROLLOUT_BUFFER_OVERSAMPLE": "1",
               "ROLLOUT_BUFFER_DROP_ZERO_VARIANCE": "1", "LLM_PROXY_HOST": "127.0.0.1",
               "LLM_PROXY_PORT": str(proxy.port)}
        srv = Server(db_url, tmp_path / "srv", env=env)
        w = Writer(db_url, job="J")
        try:
            srv.start()
            r = requests.post(srv.url + "/start_rollout", json={"num_repeat_per_sample": 2, "job_session": "J"},
                              timeout=30)
            assert r.status_code == 200, r.text
            w.step("new", "new-extra", 1, env_state={"weight_version": 5})  # a third session: over-sampled
            w.session("new", "new-a", 2, reward=0.25, env_state={"weight_version": 5})
            w.session("new", "new-b", 2, reward=0.75, env_state={"weight_version": 5})
            w.group("stale", 2, env_state={"weight_version": 3})   # 5 - 3 > 1
            for s in ("a", "b"):
                w.session("flat", f"flat-{s}", 2, reward=0.5, env_state={"weight_version": 5})
            wait_until(lambda: stats(srv)["groups"]["dropped"] == {"stale": 1, "zero_variance": 1}, 15,
                       lambda: f"the drops (stats {stats(srv)['groups']})")
            doc = poll(srv, current_weight_version=5)
            assert [s["group_id"] for s in doc["data"]["meta_info"]["group_stats"]] == ["new"]
            assert doc["data"]["meta_info"]["filtered"] == {"stale": 1, "zero_variance": 1}
            wait_until(lambda: stored_versions(db_url) == (5, 5), 10, "the versions saved with the cursor")
            before = stats(srv)

            pgid = srv.proc.pid
            srv.stop(signal.SIGKILL)
            wait_until(lambda: not procfs.group_members(pgid), 5, "every server process gone")
            w.step("new", "new-extra", 2, env_state={"weight_version": 5})  # later row of an over-sampled session
            w.group("old", 2, env_state={"weight_version": 3})  # stale only if the current version came back
            w.group("after", 2, env_state={"weight_version": 5})
            srv.start()

            wait_until(lambda: stats(srv).get("groups", {}).get("ready") == 1, 15, lambda: f"after ready ({stats(srv)})")
            s = stats(srv)
            assert s["versions"] == {"current": 5, "trainer": 5, "rows": 5}
            assert s["groups"]["dropped"] == {"stale": 2, "zero_variance": 1}
            assert s["rows"]["dropped"]["oversampled"] == before["rows"]["dropped"]["oversampled"] + 1
            assert s["figures"]["dropped"]["zero_variance"] == before["figures"]["dropped"]["zero_variance"]
            assert s["figures"]["served"] == before["figures"]["served"]
            doc = poll(srv)
            assert [x["group_id"] for x in doc["data"]["meta_info"]["group_stats"]] == ["after"]
            assert doc["data"]["meta_info"]["filtered"] == {"stale": 1}  # "old", dropped since the last batch
            assert poll(srv)["success"] is False
            assert_balanced(stats(srv))
            assert proxy.wait_for(lambda p: {b["reason"] for b in p.calls} >= {"stale", "zero_variance",
                                                                                 "oversampled"})
            assert {g for b in proxy.calls if b["reason"] == "stale" for g in b["group_ids"]} == {"stale", "old"}
        finally:
            srv.stop()
            w.close()
