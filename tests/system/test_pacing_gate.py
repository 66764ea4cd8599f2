"""Pacing with the gate against real processes (issue 23): a real gunicorn whose launcher is the
simulator making its model calls through the gate to a real HTTP server standing in for the LLM
proxy. A kill -9 of the service with pacing on loses no session and no row, and running sessions
resume within 30 s of the service being back (their client's longest backoff)."""

from __future__ import annotations

import collections
import time
from pathlib import Path
from typing import Any

import pytest
import requests
from fakes.fake_llm import FakeLLM
from servers import Server, complete_groups, kill9
from support import wait_until

from rollout_buffer.tools.runner import free_port

K = 2
GROUPS = 8


def poll(url: str) -> dict[str, list[dict[str, Any]]]:
    doc = requests.post(url + "/get_rollout_data", json={}, timeout=60).json()
    got: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    if doc.get("success"):
        for item in doc["data"]["data"]:
            got[item["instance_id"]].append(item)
    return got


@pytest.mark.slow
def test_kill_9_with_pacing_on_loses_nothing_and_sessions_resume(
    lite_url: str, tmp_path: Path
) -> None:
    with FakeLLM(version=3) as llm:
        gate_port = free_port()
        env = {
            "ROLLOUT_BUFFER_PACING": "gate",
            "ROLLOUT_BUFFER_GATE_PORT": str(gate_port),
            "ROLLOUT_BUFFER_PACING_STALENESS": "0",
            "ROLLOUT_BUFFER_PACING_BATCH_GROUPS": "2",
            "LLM_PROXY_HOST": "127.0.0.1",
            "LLM_PROXY_PORT": str(llm.port),
            "ROLLOUT_BUFFER_SIMULATE_ARGS": f"--groups {GROUPS} --pace 0.01 --fail-rate 0 "
            "--cap-rate 0 --truncate-rate 0 --max-steps 3 --flush-interval 0.2 --seed 3",
        }
        srv = Server(lite_url, tmp_path / "srv", launcher="simulate", env=env)
        srv.start()
        try:
            r = requests.post(
                srv.url + "/start_rollout",
                json={"num_repeat_per_sample": K, "job_session": "paced"},
                timeout=60,
            )
            assert r.status_code == 200, r.text
            # the budget of (0 + 1) x 2 groups is spent: later groups' first calls are held
            wait_until(
                lambda: requests.get(srv.url + "/admission", timeout=10).json()["gate"][
                    "held_calls"
                ],
                20,
                "first calls held by the gate",
            )
            received: dict[str, list[dict[str, Any]]] = {}
            wait_until(lambda: received.update(poll(srv.url)) or len(received) >= 2, 30)

            kill9(srv)  # held and running calls lose their connection: the launcher retries
            down_at = time.monotonic()
            calls_before = len(llm.calls)
            srv.start()
            back_at = time.monotonic()
            wait_until(lambda: len(llm.calls) > calls_before, 45, "a model call after the restart")
            resumed_after = llm.calls[calls_before]["arrived"] - back_at
            assert resumed_after <= 30.0, f"sessions resumed {resumed_after:.1f} s after restart"
            assert back_at - down_at < 30

            def drained() -> bool:
                for gid, items in poll(srv.url).items():
                    assert gid not in received, f"group {gid} served twice"
                    received[gid] = items
                stats = requests.get(srv.url + "/stats", timeout=10).json()
                return bool(stats["launcher"].get("finished")) and len(received) == GROUPS

            wait_until(drained, 120, f"all {GROUPS} groups served")
        finally:
            srv.stop()
        # nothing lost: every session wrote every row, every group whole, once
        assert set(received) == set(complete_groups(lite_url, "paced", k=K))
        assert all(len(items) == K for items in received.values())
        versions = {i["extra_info"]["weight_version"] for g in received.values() for i in g}
        assert versions == {3}, "the version the proxy stamped, through the gate"
