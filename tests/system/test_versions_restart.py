"""A bogus weight version is accounted at ingest across kill -9 and restarts (issue 35, item 2),
through a real gunicorn on SQLite and Postgres, with a real HTTP server standing in for the proxy.

With ``ROLLOUT_BUFFER_MAX_OFF_POLICY`` set, a row whose version the version rule refuses drops its
group as ``implausible_version`` when it is read, whether the group completes or not: in /stats and
/metrics within 10 s, its sessions cleared. Here the row is written while the service is down
(killed -9), so the restarted service must judge it with the versions it got back; then the
service is killed again, and the drop is neither lost nor counted twice."""

from __future__ import annotations

import time

import pytest
import requests
from fakes.fake_proxy import FakeProxy
from servers import Server, Trainer, kill9
from support import Writer, assert_balanced, wait_until

from rollout_buffer.storage.db import connect

pytestmark = pytest.mark.slow

TIMESTAMP = 1_700_000_000_000  # a millisecond timestamp a buggy environment wrote as its version
V10 = {"weight_version": 10}
DROP_LINE = 'rollout_buffer_groups_dropped_total{job_session="J",reason="implausible_version"} 1'


def stored_rows_version(url: str) -> int | None:
    db = connect(url)
    try:
        return db.scalar("SELECT rows_version FROM rollout_buffer_jobs WHERE job_id = 'J'")
    finally:
        db.close()


def implausible(proxy: FakeProxy) -> set[str]:
    return {
        s for b in proxy.calls if b["reason"] == "implausible_version" for s in b["session_ids"]
    }


def test_a_bogus_version_written_while_the_service_is_down_is_accounted_after_restart(
    db_url, tmp_path
):
    with FakeProxy() as proxy:
        env = {
            "ROLLOUT_BUFFER_MAX_OFF_POLICY": "4",
            "LLM_PROXY_HOST": "127.0.0.1",
            "LLM_PROXY_PORT": str(proxy.port),
        }
        srv = Server(db_url, tmp_path / "srv", env=env)
        w = Writer(db_url, job="J")
        try:
            srv.start()
            trainer = Trainer(srv)
            trainer.start_rollout("J", k=2)
            w.group("g1", 2, env_state=V10)
            w.group("g2", 2, env_state=V10)
            trainer.drain({"g1", "g2"})  # {} polls: the two groups agree on version 10
            wait_until(lambda: stored_rows_version(db_url) == 10, 10, "version 10 saved")

            kill9(srv)
            w.session("never", "never-a", 2, env_state=V10)  # completes
            w.session(
                "never", "never-b", 1, complete=False, env_state={"weight_version": TIMESTAMP}
            )
            srv.start()
            began = time.monotonic()
            wait_until(
                lambda: (
                    trainer.stats().get("groups", {}).get("dropped") == {"implausible_version": 1}
                ),
                10,
                lambda: f"the bogus row accounted after the restart ({trainer.stats()})",
            )
            assert DROP_LINE in requests.get(srv.url + "/metrics", timeout=30).text
            assert time.monotonic() - began <= 10
            assert proxy.wait_for(lambda p: implausible(p) == {"never-a", "never-b"}, 10)

            kill9(srv)  # recorded: neither lost nor counted twice
            w.step("never", "never-b", 2, env_state={"weight_version": TIMESTAMP})
            w.group("g3", 2, env_state=V10)
            srv.start()
            trainer.drain({"g3"})
            s = trainer.stats()
            assert s["groups"]["dropped"] == {"implausible_version": 1}
            assert s["groups"]["served"] == 3 and s["versions"]["current"] == 10
            assert s["rows"]["dropped"]["late_rows_from_dropped_groups"] == 1
            assert_balanced(s)
            versions = {
                i["extra_info"]["weight_version"]
                for batches in trainer.served.values()
                for items in batches
                for i in items
            }
            assert versions == {10}  # no item ever carries the bogus version
        finally:
            srv.stop()
            w.close()
