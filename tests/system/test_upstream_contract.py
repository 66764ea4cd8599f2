"""The upstream trainer client's contract (issue 22), against a real gunicorn and the demo's
simulator with the original's default launcher argv (message-cut 0, max-steps 10, crashes and
step-capped sessions on).

The client is driven as upstream drives it: one ``/start_rollout``, then ``{}`` polls on its
cadence (3 s after an empty answer; shortened here), items grouped by ``instance_id`` and by
``extra_info.rollout_group_key`` (Safactory ``feature/os``), and slime's assertion
``len(group) == n_samples_per_prompt`` on every group. Every complete group the simulator produced
must reach it, whole, once."""

from __future__ import annotations

import collections
import time
from pathlib import Path

import pytest
import requests
from servers import complete_groups, serve

from rollout_buffer.storage.db import connect

K = 4
GROUPS = 12
EMPTY_POLL_SLEEP_S = 0.3  # upstream sleeps 3 s after success=false; the cadence is not the point


def simulator_summary(db_url: str, job: str) -> dict[str, int]:
    """How the simulator's sessions ended, read back from its rows and job_environments."""
    db = connect(db_url)
    try:
        scheduled = db.scalar("SELECT COUNT(*) FROM job_environments WHERE job_id = ?", (job,))
        terminal = db.scalar(
            "SELECT COUNT(*) FROM session_steps WHERE job_id = ? AND is_terminal = 1", (job,)
        )
    finally:
        db.close()
    return {"scheduled": int(scheduled), "terminal": int(terminal)}


@pytest.mark.slow
def test_every_complete_group_reaches_a_client_that_asserts_k_items_per_group(
    lite_url: str, tmp_path: Path
) -> None:
    env = {
        # the original's argv defaults come with the launcher; only the run's size and a seed
        # that leaves some groups incomplete (crashes and step caps on, at their defaults)
        "ROLLOUT_BUFFER_SIMULATE_ARGS": f"--groups {GROUPS} --pace 0.002 --flush-interval 0.5 "
        "--fail-rate 0.1 --cap-rate 0.1 --seed 7",
    }
    with serve(lite_url, tmp_path / "srv", launcher="simulate", env=env) as srv:
        start = requests.post(
            srv.url + "/start_rollout",
            json={"num_repeat_per_sample": K, "job_session": "upstream"},
            timeout=120,
        )
        assert start.status_code == 200, start.text
        by_instance: dict[str, list[dict]] = {}
        by_key: dict[str, list[dict]] = collections.defaultdict(list)

        def drained() -> bool:
            stats = requests.get(srv.url + "/stats", timeout=30).json()
            groups = stats.get("groups") or {}
            return bool((stats.get("launcher") or {}).get("finished")) and not any(
                groups.get(k) for k in ("pending", "ready", "in_flight")
            )

        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            doc = requests.post(srv.url + "/get_rollout_data", json={}, timeout=120).json()
            if not doc.get("success"):
                if drained():
                    break
                time.sleep(EMPTY_POLL_SLEEP_S)
                continue
            items = doc["data"]["data"]
            batch: dict[str, list[dict]] = collections.defaultdict(list)
            for item in items:
                for field in ("uid", "instance_id", "messages", "reward", "extra_info"):
                    assert field in item, f"the upstream client requires {field}"
                batch[item["instance_id"]].append(item)
                by_key[item["extra_info"]["rollout_group_key"]].append(item)
            for instance_id, group in batch.items():
                assert instance_id not in by_instance, f"group {instance_id} served twice"
                # slime's RolloutDataSourceWithBuffer: len(group) == n_samples_per_prompt
                assert len(group) == K, f"group {instance_id}: {len(group)} != {K}"
                assert len({i["extra_info"]["session_id"] for i in group}) == K
                by_instance[instance_id] = group
        else:
            pytest.fail("the simulator's groups did not drain in 90 s")

        expected = complete_groups(lite_url, "upstream", k=K)
        assert set(by_instance) == set(expected), "every complete group, and nothing else"
        assert 0 < len(expected) < GROUPS, "the seed leaves some groups incomplete"
        # grouped by rollout_group_key, the same groups: "<group_id>:<n>", n from 0
        assert sorted(by_key) == sorted(f"{gid}:0" for gid in by_instance)
        assert all(len(g) == K for g in by_key.values())
        summary = simulator_summary(lite_url, "upstream")
        assert summary["scheduled"] == GROUPS * K and summary["terminal"] < GROUPS * K
        # the incomplete groups were dropped with a reason, and every session is accounted for
        stats = requests.get(srv.url + "/stats", timeout=30).json()
        assert sum(stats["groups"]["dropped"].values()) == GROUPS - len(expected)
        assert stats["sessions"]["known"] == GROUPS * K
        assert stats["accounting_balanced"] is True
