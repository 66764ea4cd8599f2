"""A group is served only with at least the K in force when it is served (issue 35, item 1), through
a real gunicorn on SQLite and Postgres, with a real HTTP server standing in for the proxy.

A group that was ready under K = 2 and is not polled before ``/start_rollout`` raises K to 3 waits
for a third session. When none comes, at its TTL it is dropped as ``incomplete_group_ttl`` and its
sessions are cleared at the proxy within TTL + 3 s of its last row, while a younger group keeps
receiving rows. It is never served with 2 sessions (the upstream client asserts
``len(group) == n_samples_per_prompt``). With ``ROLLOUT_BUFFER_MIN_GROUP_SIZE`` it is served
instead, counted as partial in the answer and in ``/stats``."""

from __future__ import annotations

import time
from typing import Any

import pytest
import requests
from fakes.fake_proxy import FakeProxy
from servers import Server, Trainer, kill9
from support import Writer, assert_balanced, wait_until

pytestmark = pytest.mark.slow

TTL_S = 3.0


def sessions_by_group(doc: dict) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for item in doc["data"]["data"] if doc["success"] else []:
        out.setdefault(item["instance_id"], set()).add(item["extra_info"]["session_id"])
    return out


def cleared(proxy: FakeProxy, reason: str) -> set[str]:
    return {s for b in proxy.calls if b["reason"] == reason for s in b["session_ids"]}


def server(db_url: str, tmp_path: Any, proxy: FakeProxy, **extra: str) -> Server:
    env = {
        "AIEVOBOX_BUFFER_INCOMPLETE_GROUP_TTL_SECONDS": str(TTL_S),
        "LLM_PROXY_HOST": "127.0.0.1",
        "LLM_PROXY_PORT": str(proxy.port),
        **extra,
    }
    return Server(db_url, tmp_path / "srv", env=env)


def raise_k(trainer: Trainer, w: Writer) -> tuple[set[str], float]:
    """K = 2, "old" complete and ready, not polled; then K raised to 3 on the same job. Returns
    old's sessions and when its last row was written."""
    trainer.start_rollout("J", k=2)
    old = w.group("old", 2)
    last_row = time.monotonic()
    wait_until(lambda: trainer.stats()["groups"]["ready"] == 1, 15, "'old' ready under K = 2")
    trainer.start_rollout("J", k=3)
    return set(old), last_row


def test_a_group_ready_under_a_smaller_k_is_dropped_at_its_ttl_never_served_short(db_url, tmp_path):
    with FakeProxy() as proxy:
        srv = server(db_url, tmp_path, proxy)
        w = Writer(db_url, job="J")
        try:
            srv.start()
            trainer = Trainer(srv)
            old, last_row = raise_k(trainer, w)
            step, seen_cleared = 0, None
            # polled all along, behind a younger pending group that stays active
            while time.monotonic() < last_row + TTL_S + 10:
                step += 1
                w.step("young", "young-a", step)
                served = sessions_by_group(trainer.poll())
                assert "old" not in served, (
                    f"'old' served with {len(served['old'])} sessions, K = 3"
                )
                if old <= cleared(proxy, "incomplete_group_ttl"):
                    seen_cleared = time.monotonic()
                    break
                time.sleep(0.3)
            assert seen_cleared is not None, f"old's sessions never cleared: {proxy.calls}"
            assert seen_cleared - last_row <= TTL_S + 3, seen_cleared - last_row
            assert cleared(proxy, "incomplete_group_ttl") == old  # the young group is alive
            s = trainer.stats()
            assert s["k"] == 3
            assert s["groups"]["dropped"] == {"incomplete_group_ttl": 1}
            assert s["groups"]["served"] == 0 and s["groups"]["partial"] == 0
            assert s["groups"]["pending"] == 1  # "young"
            assert_balanced(s)
            # a whole group under the new K is served whole
            w.step("young", "young-a", step + 1, completed=True, reward=0.2)
            w.group("young", 2, steps=1)
            wait_until(lambda: trainer.stats()["groups"]["ready"] == 1, 15, "'young' complete")
            doc = trainer.poll()
            assert {g: len(s) for g, s in sessions_by_group(doc).items()} == {"young": 3}
            assert doc["data"]["meta_info"]["partial_groups"] == []
        finally:
            srv.stop()
            w.close()


def test_with_a_minimum_group_size_it_is_served_partial_and_counted(db_url, tmp_path):
    with FakeProxy() as proxy:
        srv = server(db_url, tmp_path, proxy, ROLLOUT_BUFFER_MIN_GROUP_SIZE="2")
        w = Writer(db_url, job="J")
        try:
            srv.start()
            trainer = Trainer(srv)
            old, last_row = raise_k(trainer, w)
            doc: dict = {"success": False}
            step = 0
            while not doc["success"] and time.monotonic() < last_row + TTL_S + 10:
                step += 1
                w.step("young", "young-a", step)
                doc = trainer.poll()
                time.sleep(0.3)
            assert {g: s for g, s in sessions_by_group(doc).items()} == {"old": old}
            assert doc["data"]["meta_info"]["partial_groups"] == ["old"]
            assert all(i["extra_info"]["partial_group"] is True for i in doc["data"]["data"])
            s = trainer.stats()
            assert s["groups"]["served"] == 1 and s["groups"]["partial"] == 1
            assert s["groups"]["dropped"] == {}
            assert_balanced(s)
            metrics = requests.get(srv.url + "/metrics", timeout=30).text
            assert 'rollout_buffer_groups_partial_total{job_session="J"} 1' in metrics
            kill9(srv)  # the count is a decision recorded with the group: it survives a crash
            srv.start()
            s = wait_until(lambda: trainer.stats().get("groups"), 15, "the job loaded again")
            assert s["served"] == 1 and s["partial"] == 1
        finally:
            srv.stop()
            w.close()


def test_after_a_kill_9_a_group_short_of_the_raised_k_is_still_dropped_at_its_ttl(db_url, tmp_path):
    with FakeProxy() as proxy:
        srv = server(db_url, tmp_path, proxy)
        w = Writer(db_url, job="J")
        try:
            srv.start()
            trainer = Trainer(srv)
            old, _ = raise_k(trainer, w)
            kill9(srv)  # K = 3 is recorded; "old" is read again from its rows
            srv.start()
            wait_until(
                lambda: old <= cleared(proxy, "incomplete_group_ttl"),
                TTL_S + 15,
                lambda: f"old's sessions cleared ({proxy.calls})",
            )
            assert trainer.poll()["success"] is False
            s = trainer.stats()
            assert s["k"] == 3 and s["groups"]["served"] == 0
            assert s["groups"]["dropped"] == {"incomplete_group_ttl": 1}
            assert_balanced(s)
        finally:
            srv.stop()
            w.close()
