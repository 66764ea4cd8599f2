"""Salvage with two instances on one Postgres (issue 38): the owner salvages a group and is killed
(-9) before any poll; the standby takes the job over, salvages it again from the rows and serves it
once, with the accounting balanced. Real gunicorn servers, a real launcher subprocess (a fake one
that gets --max-steps 3)."""

from __future__ import annotations

import sys
from pathlib import Path

import requests
from servers import Server, free_port, kill9
from support import Writer, groups_of, make_launcher_db, wait_until

FAKE_LAUNCHER = Path(__file__).resolve().parent.parent / "fakes" / "fake_launcher.py"
LAUNCHER_CMD = f"{sys.executable} {FAKE_LAUNCHER} --mode hang --max-steps 3"
LEASE_S = 3.0


def instance(url: str, tmp_path: Path, name: str) -> Server:
    port = free_port()
    env = {
        "ROLLOUT_BUFFER_ADVERTISE_URL": f"http://127.0.0.1:{port}",
        "ROLLOUT_BUFFER_LEASE_SECONDS": str(LEASE_S),
        "ROLLOUT_BUFFER_NAME": "salvage",
        "ROLLOUT_BUFFER_HOST_ID": f"host-{name}",
        "ROLLOUT_BUFFER_LAUNCHER_CMD": LAUNCHER_CMD,
        "ROLLOUT_BUFFER_SALVAGE": "truncate",
    }
    return Server(url, tmp_path / name, port=port, env=env, name=name, launcher="auto")


def get(srv: Server, path: str) -> dict:
    try:
        return requests.get(srv.url + path, timeout=5).json()
    except (requests.RequestException, ValueError):
        return {}


def test_a_salvaged_group_survives_its_owner_and_is_served_once_by_the_standby(
    tmp_path: Path, pg_url: str
) -> None:
    make_launcher_db(pg_url)
    a, b = instance(pg_url, tmp_path, "a"), instance(pg_url, tmp_path, "b")
    w = Writer(pg_url)
    try:
        a.start()
        assert wait_until(lambda: get(a, "/health").get("role") == "owner", 15)
        b.start()
        assert wait_until(lambda: get(b, "/health").get("role") == "standby", 15)
        r = requests.post(
            a.url + "/start_rollout",
            json={"num_repeat_per_sample": 2, "job_session": "job1"},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        w.schedule("g", ["ok", "capped"])
        w.step("g", "ok", 1, trainable=False)
        w.step("g", "ok", 2, completed=True, step_reward=1.0)
        capped = w.session("g", "capped", 3, trainable=False, complete=False)
        assert wait_until(lambda: get(a, "/stats").get("groups", {}).get("ready") == 1, 20)
        kill9(a)  # salvaged, not served
        assert wait_until(lambda: get(b, "/health").get("role") == "owner", LEASE_S + 15)
        assert wait_until(lambda: get(b, "/stats").get("groups", {}).get("ready") == 1, 20)
        doc = requests.post(b.url + "/get_rollout_data", json={}, timeout=30).json()
        items = groups_of(doc)["g"]
        (item,) = [i for i in items if i["extra_info"]["session_id"] == "capped"]
        assert item["extra_info"]["step_pk"] == capped[-1]
        assert item["extra_info"]["salvaged"] == "step_cap"
        stats = get(b, "/stats")
        assert stats["salvaged"]["groups"] == {"step_cap": 1}
        assert stats["groups"]["served"] == 1 and stats["accounting_balanced"], stats["rows"]
        assert not requests.post(b.url + "/get_rollout_data", json={}, timeout=30).json()["success"]
    finally:
        w.close()
        for srv in (a, b):
            if srv.proc is not None:
                srv.stop()
