"""The training-data policies hold across a kill -9 of a real gunicorn (issue 10, "Restarts"), on
SQLite and Postgres: their decisions are tombstones like the others, the job's current version
comes back from the stored trainer and row versions (rows below the low-water mark are never read
again), the over-sampled sessions' later rows stay dropped, the figures and ``filtered`` survive."""

from __future__ import annotations

import contextlib
import signal
from typing import Any

import pytest
import requests
from fakes.fake_proxy import FakeProxy
from servers import Server
from support import Writer, assert_balanced, make_launcher_db, wait_until

from rollout_buffer.launcher import procfs
from rollout_buffer.storage.db import connect

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
        return tuple(
            db.rows(
                "SELECT trainer_version, rows_version FROM rollout_buffer_jobs WHERE job_id = 'J'"
            )[0]
        )
    finally:
        db.close()


def test_policies_hold_after_kill_9_and_restart(db_url, tmp_path):
    with FakeProxy() as proxy:
        env = {
            "ROLLOUT_BUFFER_MAX_OFF_POLICY": "1",
            "ROLLOUT_BUFFER_OVERSAMPLE": "1",
            "ROLLOUT_BUFFER_DROP_ZERO_VARIANCE": "1",
            "LLM_PROXY_HOST": "127.0.0.1",
            "LLM_PROXY_PORT": str(proxy.port),
        }
        srv = Server(db_url, tmp_path / "srv", env=env)
        w = Writer(db_url, job="J")
        try:
            srv.start()
            r = requests.post(
                srv.url + "/start_rollout",
                json={"num_repeat_per_sample": 2, "job_session": "J"},
                timeout=30,
            )
            assert r.status_code == 200, r.text
            w.step(
                "new", "new-extra", 1, env_state={"weight_version": 5}
            )  # a third session: over-sampled
            w.session("new", "new-a", 2, reward=0.25, env_state={"weight_version": 5})
            w.session("new", "new-b", 2, reward=0.75, env_state={"weight_version": 5})
            for s in ("a", "b"):  # with "new", two complete groups agree on 5
                w.session("flat", f"flat-{s}", 2, reward=0.5, env_state={"weight_version": 5})
            w.group("stale", 2, env_state={"weight_version": 3})  # 5 - 3 > 1
            wait_until(
                lambda: stats(srv)["groups"]["dropped"] == {"stale": 1, "zero_variance": 1},
                15,
                lambda: f"the drops (stats {stats(srv)['groups']})",
            )
            doc = poll(srv, current_weight_version=5)
            assert [s["group_id"] for s in doc["data"]["meta_info"]["group_stats"]] == ["new"]
            assert doc["data"]["meta_info"]["filtered"] == {"stale": 1, "zero_variance": 1}
            wait_until(
                lambda: stored_versions(db_url) == (5, 5), 10, "the versions saved with the cursor"
            )
            before = stats(srv)

            pgid = srv.proc.pid
            srv.stop(signal.SIGKILL)
            wait_until(lambda: not procfs.group_members(pgid), 5, "every server process gone")
            w.step(
                "new", "new-extra", 2, env_state={"weight_version": 5}
            )  # later row of an over-sampled session
            w.group(
                "old", 2, env_state={"weight_version": 3}
            )  # stale only if the current version came back
            w.group("after", 2, env_state={"weight_version": 5})
            srv.start()

            wait_until(
                lambda: stats(srv).get("groups", {}).get("ready") == 1,
                15,
                lambda: f"after ready ({stats(srv)})",
            )
            s = stats(srv)
            assert s["versions"] == {"current": 5, "trainer": 5, "rows": 5}
            assert s["groups"]["dropped"] == {"stale": 2, "zero_variance": 1}
            assert (
                s["rows"]["dropped"]["oversampled"] == before["rows"]["dropped"]["oversampled"] + 1
            )
            assert (
                s["figures"]["dropped"]["zero_variance"]
                == before["figures"]["dropped"]["zero_variance"]
            )
            assert s["figures"]["served"] == before["figures"]["served"]
            doc = poll(srv)
            assert [x["group_id"] for x in doc["data"]["meta_info"]["group_stats"]] == ["after"]
            assert doc["data"]["meta_info"]["filtered"] == {
                "stale": 1
            }  # "old", dropped since the last batch
            assert poll(srv)["success"] is False
            assert_balanced(stats(srv))
            assert proxy.wait_for(
                lambda p: (
                    {b["reason"] for b in p.calls} >= {"stale", "zero_variance", "oversampled"}
                )
            )
            # "old" was dropped after the restart: its call may come after the first ones
            proxy.wait_for(
                lambda p: (
                    "old" in {g for b in p.calls if b["reason"] == "stale" for g in b["group_ids"]}
                )
            )
            assert {g for b in proxy.calls if b["reason"] == "stale" for g in b["group_ids"]} == {
                "stale",
                "old",
            }
        finally:
            srv.stop()
            w.close()


def test_a_session_dropped_as_oversampled_stays_out_after_kill_9(db_url, tmp_path):
    """The sessions a group dropped as oversampled are stored (their rows): after a kill -9 the
    rebuilt group, sent back to pending by a raised K, never takes one back with only its later
    rows."""
    with FakeProxy() as proxy:
        env = {
            "ROLLOUT_BUFFER_OVERSAMPLE": "1",
            "LLM_PROXY_HOST": "127.0.0.1",
            "LLM_PROXY_PORT": str(proxy.port),
        }
        srv = Server(db_url, tmp_path / "srv", env=env)
        w = Writer(db_url, job="J")

        def start(k: int) -> None:
            r = requests.post(
                srv.url + "/start_rollout",
                json={"num_repeat_per_sample": k, "job_session": "J"},
                timeout=30,
            )
            assert r.status_code == 200, r.text

        try:
            srv.start()
            start(2)
            w.step("g", "s2", 1)
            w.session("g", "s0", 2, reward=0.1)
            w.session("g", "s1", 2, reward=0.9)
            wait_until(
                lambda: stats(srv)["rows"]["dropped"].get("oversampled") == 1,
                15,
                "s2 dropped as oversampled",
            )
            start(3)  # K raised: g is pending again, short of one session
            pgid = srv.proc.pid
            srv.stop(signal.SIGKILL)
            wait_until(lambda: not procfs.group_members(pgid), 5, "every server process gone")
            w.step(
                "g", "s2", 2, completed=True, step_reward=0.4
            )  # s2 completes while the service is down
            srv.start()
            wait_until(
                lambda: stats(srv).get("rows", {}).get("dropped", {}).get("oversampled") == 2,
                15,
                lambda: f"s2's later row dropped as oversampled ({stats(srv)})",
            )
            assert stats(srv)["groups"]["ready"] == 0
            w.session("g", "s3", 2, reward=0.5)
            wait_until(lambda: stats(srv)["groups"]["ready"] == 1, 15, "g ready with s3")
            doc = poll(srv)
            steps: dict[str, list[int]] = {}
            for item in doc["data"]["data"]:
                steps.setdefault(item["extra_info"]["session_id"], []).append(
                    item["extra_info"]["steps"]
                )
            assert steps == {"s0": [1, 2], "s1": [1, 2], "s3": [1, 2]}
            assert_balanced(stats(srv))
            assert proxy.wait_for(
                lambda p: (
                    {s for b in p.calls if b["reason"] == "oversampled" for s in b["session_ids"]}
                    == {"s2"}
                )
            )
        finally:
            srv.stop()
            w.close()


def test_postgres_the_first_k_chosen_before_a_kill_9_stay_chosen_when_a_smaller_id_commits_late(
    pg_url, tmp_path
):
    """Over-sampling on Postgres: b's completing row takes a smaller id than c's but commits later,
    so the group chooses a and c. After a kill -9 the rows are read again in id order, b's first:
    the group must keep its choice, never take b back with only its completing row."""
    make_launcher_db(pg_url)
    with FakeProxy() as proxy:
        env = {
            "ROLLOUT_BUFFER_OVERSAMPLE": "1",
            "LLM_PROXY_HOST": "127.0.0.1",
            "LLM_PROXY_PORT": str(proxy.port),
        }
        srv = Server(pg_url, tmp_path / "srv", env=env)
        held, w = Writer(pg_url, job="J"), Writer(pg_url, job="J")
        try:
            srv.start()
            r = requests.post(
                srv.url + "/start_rollout",
                json={"num_repeat_per_sample": 2, "job_session": "J"},
                timeout=30,
            )
            assert r.status_code == 200, r.text
            for s in ("a", "b", "c"):
                w.step("g", s, 1)
            w.step("g", "a", 2, completed=True, step_reward=0.1)
            held.db.execute("BEGIN")
            pk_b = held.step("g", "b", 2, completed=True, step_reward=0.5)  # invisible until COMMIT
            pk_c = w.step("g", "c", 2, completed=True, step_reward=0.9)
            assert pk_b < pk_c
            wait_until(
                lambda: (
                    lambda s: (
                        s["groups"]["ready"] == 1 and s["rows"]["dropped"] == {"oversampled": 1}
                    )
                )(stats(srv)),
                15,
                lambda: f"g ready with a and c, b's first row oversampled ({stats(srv)})",
            )
            pgid = srv.proc.pid
            srv.stop(signal.SIGKILL)
            wait_until(lambda: not procfs.group_members(pgid), 5, "every server process gone")
            held.db.execute("COMMIT")
            srv.start()
            wait_until(
                lambda: stats(srv).get("rows", {}).get("dropped", {}).get("oversampled") == 2,
                20,
                lambda: f"b's completing row {pk_b} read after the restart ({stats(srv)})",
            )
            doc = poll(srv)
            steps: dict[str, list[int]] = {}
            for item in doc["data"]["data"]:
                steps.setdefault(item["extra_info"]["session_id"], []).append(
                    item["extra_info"]["steps"]
                )
            assert steps == {"a": [1, 2], "c": [1, 2]}
            assert_balanced(stats(srv))
            assert proxy.wait_for(
                lambda p: (
                    {s for b in p.calls if b["reason"] == "oversampled" for s in b["session_ids"]}
                    == {"b"}
                )
            )
        finally:
            with contextlib.suppress(Exception):
                held.db.execute("ROLLBACK")
            held.close()
            w.close()
            srv.stop()


def test_postgres_versions_of_rows_accounted_before_a_kill_9_still_count(pg_url, tmp_path):
    """The version complete groups agree on is saved with the cursor, about once a second. Rows
    accounted after the last save (groups served just before a kill -9) are read again after the
    restart but skipped as accounted: their groups must still count, or a group that was stale
    before the crash is served after it. The job's row is locked meanwhile so that no save can
    happen."""
    make_launcher_db(pg_url)
    srv = Server(pg_url, tmp_path / "srv", env={"ROLLOUT_BUFFER_MAX_OFF_POLICY": "1"})
    w, locker = Writer(pg_url, job="J"), Writer(pg_url, job="J")
    try:
        srv.start()
        r = requests.post(
            srv.url + "/start_rollout",
            json={"num_repeat_per_sample": 2, "job_session": "J"},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        w.group("a", 2, env_state={"weight_version": 5})
        w.group("a2", 2, env_state={"weight_version": 5})  # two groups agree on 5
        wait_until(lambda: stats(srv).get("groups", {}).get("ready") == 2, 15, "a, a2 ready")
        assert [s["group_id"] for s in poll(srv)["data"]["meta_info"]["group_stats"]] == [
            "a",
            "a2",
        ]
        wait_until(
            lambda: stored_versions(pg_url) == (None, 5), 10, "the versions saved with the cursor"
        )
        locker.db.execute("BEGIN")
        locker.db.rows("SELECT 1 FROM rollout_buffer_jobs WHERE job_id = 'J' FOR NO KEY UPDATE")
        w.group("new", 2, env_state={"weight_version": 9})
        w.group("new2", 2, env_state={"weight_version": 9})
        wait_until(lambda: stats(srv).get("groups", {}).get("ready") == 2, 15, "new, new2 ready")
        assert [s["group_id"] for s in poll(srv)["data"]["meta_info"]["group_stats"]] == [
            "new",
            "new2",
        ]
        pgid = srv.proc.pid
        srv.stop(signal.SIGKILL)
        wait_until(lambda: not procfs.group_members(pgid), 5, "every server process gone")
        locker.db.execute("ROLLBACK")
        assert stored_versions(pg_url) == (None, 5)  # the save of version 9 never happened
        w.group("old", 2, env_state={"weight_version": 7})  # 9 - 7 > 1: stale
        srv.start()
        wait_until(
            lambda: stats(srv).get("groups", {}).get("dropped_total") == 1,
            15,
            lambda: f"old dropped as stale ({stats(srv)})",
        )
        s = stats(srv)
        assert s["groups"]["dropped"] == {"stale": 1} and s["versions"]["rows"] == 9
        assert poll(srv)["success"] is False
        assert_balanced(stats(srv))
    finally:
        with contextlib.suppress(Exception):
            locker.db.execute("ROLLBACK")
        locker.close()
        w.close()
        srv.stop()
