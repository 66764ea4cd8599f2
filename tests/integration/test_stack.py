"""The real stack's parts as they are (issue 22): an LLM proxy without the clear endpoint, a
launcher that exits at once, the upstream client's ``rollout_group_key``; through the Flask test
client, on both backends."""

from __future__ import annotations

import shutil
import sys
import threading
from pathlib import Path
from typing import Any

from fakes.fake_proxy import FakeProxy
from support import Writer, wait_until

FAKES = Path(__file__).parent.parent / "fakes"


def launcher_of(doc: dict[str, Any]) -> dict[str, Any]:
    """What a poll's meta_info says of the launcher."""
    return dict(doc["data"]["meta_info"].get("launcher") or {})


def upstream_root(tmp_path: Path) -> str:
    """An AIEVOBOX_ROOT whose launcher.py checks its flags as the upstream one does."""
    root = tmp_path / "aievobox"
    root.mkdir()
    shutil.copy(FAKES / "upstream_launcher.py", root / "launcher.py")
    return str(root)


def test_a_launcher_that_exits_at_once_makes_start_rollout_an_error_with_its_code_and_log(
    db_url: str, tmp_path: Path, harness_factory: Any
) -> None:
    """The upstream launcher, started as the service starts it: on Postgres it gets --storage-type
    postgres and exits 2 (it writes no Postgres); on SQLite the default http transport needs Ray and
    it exits 1. Both were answered 200 "Rollout started", and the trainer polled forever."""
    postgres = db_url.startswith("postgresql")
    if postgres:
        db_url += "&password=hunter2"  # trust auth ignores it; no answer may show it
    h = harness_factory(
        db_url,
        launcher="auto",
        aievobox_root=upstream_root(tmp_path),
        env_config="envs.yaml",
    )
    r = h.client.post("/start_rollout", json={"num_repeat_per_sample": 2, "job_session": "j1"})
    body = r.get_json()
    assert r.status_code == 500, body
    assert body["ok"] is False and body["job_session"] == "j1"
    assert body["exit_code"] == (2 if postgres else 1) and "exited with code" in body["error"]
    tail = "\n".join(body["log_tail"])
    assert len(body["log_tail"]) <= 20 and "launcher.py" in tail
    if postgres:
        assert "invalid choice: 'postgres'" in tail
        assert any("--storage-type postgres" in hint for hint in body["hints"])
    else:
        assert "No module named 'ray'" in tail
        assert any("AIEVOBOX_ENV_TRANSPORT=inproc" in hint for hint in body["hints"])
        assert "\\x1b[31mcolour" in tail, "control characters are shown escaped"
    assert "\x1b" not in tail
    assert "hunter2" not in r.get_data(as_text=True)
    health = h.client.get("/health").get_json()
    assert health["launcher_state"]["state"] == "exited" and not health["aievobox_running"]
    again = h.client.post("/start_rollout", json={"num_repeat_per_sample": 2, "job_session": "j1"})
    assert again.status_code == 500 and again.get_json()["pid"] != body["pid"], "a new launcher"


def test_a_launcher_the_policy_restarts_is_started_with_a_warning(
    lite_url: str, tmp_path: Path, harness_factory: Any
) -> None:
    """With ROLLOUT_BUFFER_RESTART_POLICY=on-failure the operator asked for restarts: the answer
    stays 200, and says what happened."""
    h = harness_factory(
        lite_url,
        launcher="auto",
        aievobox_root=upstream_root(tmp_path),
        env_config="envs.yaml",
        restart_policy="on-failure",
        restart_backoff_s=30.0,
    )
    body = h.start(k=2)
    assert "exited with code 1" in body.get("warning", "")
    assert body["launcher_exit"]["exit_code"] == 1 and body["launcher_exit"]["will_restart"]
    assert h.client.get("/health").get_json()["launcher_state"]["state"] == "restarting"


def test_a_launcher_that_dies_later_is_shown_in_every_poll_and_in_health(
    db_url: str, writer: Writer, tmp_path: Path, harness_factory: Any
) -> None:
    # it exits 1 after 3.5 s, past the default 3 s launch grace: /start_rollout says it started
    fake = [sys.executable, str(FAKES / "fake_launcher.py"), "--mode", "exit1", "--sleep", "3.5"]
    h = harness_factory(db_url, launcher="auto", launcher_cmd=fake)
    assert h.start(k=2)["message"] == "Rollout started"
    writer.group("g1", 2)
    served = h.poll()
    assert served["success"] and launcher_of(served).get("state") == "running"
    # nothing more comes: each empty answer says why, not only /stats
    assert wait_until(lambda: launcher_of(h.poll()).get("state") == "exited", timeout=10)
    assert launcher_of(h.poll())["exit_code"] == 1
    health = h.client.get("/health")
    assert health.status_code == 200, "the service works; the launcher's end is a fact to show"
    assert health.get_json()["launcher_state"] == {
        **health.get_json()["launcher_state"],
        "state": "exited",
        "exit_code": 1,
    }


def test_a_proxy_without_the_clear_endpoint_shows_in_health_and_stats(
    db_url: str, writer: Writer, harness_factory: Any
) -> None:
    with FakeProxy(status=404) as proxy:
        h = harness_factory(
            db_url, proxy_host="127.0.0.1", proxy_port=proxy.port, proxy_read_timeout_s=2.0
        )
        h.start(k=2, job="job1")
        writer.group("g1", 2, complete=1)  # never completes: dropped when the job changes
        h.settle()
        h.start(k=2, job="job2")  # job1's pending group is dropped as job_ended: 2 sessions
        assert wait_until(
            lambda: (
                h.client.get("/health").get_json()["proxy_notifications"].get("dropped_sessions")
                == 2
            )
        )
        health = h.client.get("/health")
        assert health.status_code == 200 and health.get_json()["status"] == "healthy"
        assert health.get_json()["proxy_notifications"]["clear_endpoint"] == "absent"
        stats = h.stats()["proxy_notifications"]
        assert stats["clear_endpoint"] == "absent" and stats["sessions"] == 0
        assert len(proxy.calls) == 1


def keys_of(doc: dict[str, Any]) -> dict[str, set[str]]:
    """Each served group's rollout_group_keys, by instance_id."""
    out: dict[str, set[str]] = {}
    for item in doc["data"]["data"]:
        out.setdefault(item["instance_id"], set()).add(item["extra_info"].get("rollout_group_key"))
    return out


def test_every_item_carries_its_rollout_group_key_through_replay_and_redelivery(
    writer: Writer, harness: Any
) -> None:
    """The newer upstream client groups by extra_info.rollout_group_key ("<instance_id>:<n>");
    without it, it guesses. The key of a group is the same when its batch is replayed (a lost
    response) and when it is delivered again after a trainer crash."""
    harness.start(k=2)
    for gid in ("g1", "g2", "g3"):
        writer.group(gid, 2, steps=3)
    first = harness.poll(max_groups=2, request_id="r1")
    assert keys_of(first) == {"g1": {"g1:0"}, "g2": {"g2:0"}}
    assert len(first["data"]["data"]) == 2 * 2 * 3, "every item carries it"
    assert keys_of(harness.poll(max_groups=2, request_id="r1")) == keys_of(first)  # a replay
    harness.start(k=2, skip_instance_ids=["g1"])  # the checkpoint holds g1: g2 comes again
    again = harness.poll(max_groups=5)
    assert keys_of(again) == {"g2": {"g2:0"}, "g3": {"g3:0"}}
    assert all(
        item["extra_info"].get("redelivered")
        for item in again["data"]["data"]
        if item["instance_id"] == "g2"
    )


def test_a_launcher_stopped_during_the_launch_grace_is_no_failure_to_start(
    lite_url: str, tmp_path: Path, harness_factory: Any
) -> None:
    """/stop_rollout (or a shutdown) while /start_rollout waits out the grace: the launcher ends by
    a signal, which is what was asked, not a launcher that could not run."""
    fake = [sys.executable, str(FAKES / "fake_launcher.py"), "--mode", "hang"]
    h = harness_factory(lite_url, launcher="auto", launcher_cmd=fake, launch_grace_s=30.0)
    answers: list[Any] = []
    starter = threading.Thread(
        target=lambda: answers.append(
            h.client.post("/start_rollout", json={"num_repeat_per_sample": 2})
        )
    )
    starter.start()
    assert wait_until(lambda: h.service.supervisor.state()["running"])
    assert h.client.post("/stop_rollout", json={}).status_code == 200
    starter.join(20)
    assert answers and answers[0].status_code == 200, answers[0].get_json()
    assert answers[0].get_json()["message"] == "Rollout started"
