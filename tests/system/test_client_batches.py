"""The trainer's views through a real gunicorn server: ``get_batch`` and ``iter_groups`` with
``min_groups``, the batch's ``meta_info`` reaching the caller, a group's sessions (steps in order,
terminal reward, truncation), and ``resume`` after a trainer crash (a real trainer process
killed -9 after a batch was served to it and before it read it).

The launcher is ``none``: the test writes the launcher's rows itself (``Writer``), so it decides
when a group completes, and a poll that must wait is seen waiting in ``/stats`` before the group
it waits for is completed.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from servers import ROOT, serve
from support import Writer, make_launcher_db, wait_until
from test_client import EMPTY, Scripted, batch

from rollout_buffer.client import Batch, BufferClient, Group

JOB = "views-job"
K = 3


def ready(client: BufferClient, n: int) -> bool:
    return client.stats()["groups"]["ready"] == n


def waiting(client: BufferClient) -> bool:
    return client.stats()["polls"]["waiting"] == 1


def in_thread(target: Any) -> tuple[threading.Thread, list[Any]]:
    """Run ``target`` in a thread; its result (or exception) lands in the list."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(target())
        except BaseException as exc:  # handed to the test thread, which checks it
            out.append(exc)

    thread = threading.Thread(target=run, name="trainer-poll")
    thread.start()
    return thread, out


def test_get_batch_waits_for_min_groups_and_hands_over_meta_info_as_served(
    sqlite_url: str, tmp_path: Path
) -> None:
    make_launcher_db(sqlite_url)
    writer = Writer(sqlite_url, job=JOB)
    writer.group("a", K)
    writer.group("b", K, complete=K - 1)  # one session still running
    with serve(sqlite_url, tmp_path) as srv, BufferClient(srv.url, backoff_s=0.1) as client:
        client.start_rollout(num_repeat_per_sample=K, job_session=JOB)
        wait_until(lambda: ready(client, 1), 30, "group a ready")
        thread, out = in_thread(lambda: client.get_batch(min_groups=2, timeout=60))
        wait_until(lambda: waiting(client), 30, "the poll waits for a second group")
        assert not out, "get_batch answered with fewer than min_groups groups"
        sessions = writer.session("b", "b-last", 2, reward=1.0)
        assert sessions
        thread.join(60)
        writer.close()
        (batch,) = out
        assert isinstance(batch, Batch), batch
        assert [g.group_id for g in batch.groups] == ["a", "b"]
        meta = batch.meta_info
        assert meta["finished_groups"] == ["a", "b"] and meta["job_session"] == JOB
        assert batch.batch_id == meta["batch_id"] and len(meta["batch_id"]) == 32
        assert len(meta["group_stats"]) == 2 and meta["filtered"] == {}
        assert meta["total_samples"] == len(batch.items) == 2 * K * 2  # K sessions of 2 steps
        assert all(g.meta_info is meta for g in batch.groups)
        with pytest.raises(TimeoutError, match=r"no group was ready within 0\.5 s"):
            client.get_batch(timeout=0.5)


def test_iter_groups_min_groups_wakes_once_for_the_batch_and_groups_carry_meta_info(
    sqlite_url: str, tmp_path: Path
) -> None:
    make_launcher_db(sqlite_url)
    writer = Writer(sqlite_url, job=JOB)
    writer.group("a", K)
    with serve(sqlite_url, tmp_path) as srv, BufferClient(srv.url, backoff_s=0.1) as client:
        client.start_rollout(num_repeat_per_sample=K, job_session=JOB)
        wait_until(lambda: ready(client, 1), 30, "group a ready")
        thread, out = in_thread(
            lambda: list(client.iter_groups(2, min_groups=2, wait_s=30, timeout=60))
        )
        wait_until(lambda: waiting(client), 30, "the poll waits for the second group")
        writer.group("b", K)
        thread.join(60)
        writer.close()
        (groups,) = out
        assert [type(g) for g in groups] == [Group, Group], groups
        assert groups[0].meta_info is groups[1].meta_info  # one poll served both
        assert groups[0].meta_info["finished_groups"] == ["a", "b"]
        assert client.stats()["polls"]["with_data"] == 1
        # callers written for the (group_id, items) tuples of old still unpack them
        for group in groups:
            gid, items = group
            assert gid == group.group_id and items is group.items


def test_a_groups_sessions_have_their_steps_in_order_terminal_reward_and_truncation(
    sqlite_url: str, tmp_path: Path
) -> None:
    make_launcher_db(sqlite_url)
    writer = Writer(sqlite_url, job=JOB)
    # written interleaved and out of step order, as concurrent sessions flush
    writer.step("g", "s1", 2)
    writer.step("g", "s2", 1)
    writer.step("g", "s1", 1)
    writer.step("g", "s3", 1, completed=True, step_reward=0.25)
    writer.step("g", "s2", 2, completed=True, truncated=True, step_reward=0.0)  # length cap
    writer.step("g", "s1", 3, completed=True, step_reward=1.0)
    writer.close()
    with serve(sqlite_url, tmp_path) as srv, BufferClient(srv.url, backoff_s=0.1) as client:
        client.start_rollout(num_repeat_per_sample=K, job_session=JOB)
        (group,) = client.get_batch(min_groups=1, timeout=30).groups
    assert group.group_id == "g" and len(group.items) == 6
    assert group.rollout_group_key is None or group.rollout_group_key.startswith("g:")
    by_id = {s.session_id: s for s in group.sessions}
    assert list(by_id) == ["s1", "s2", "s3"]
    assert [[st["extra_info"]["steps"] for st in s.steps] for s in group.sessions] == [
        [1, 2, 3],
        [1, 2],
        [1],
    ]
    assert (by_id["s1"].reward, by_id["s1"].truncated) == (1.0, False)
    assert (by_id["s2"].reward, by_id["s2"].truncated) == (0.0, True)
    assert (by_id["s3"].reward, by_id["s3"].truncated) == (0.25, False)
    for session in group.sessions:  # every item of a session carries its terminal reward
        assert {step["reward"] for step in session.steps} == {session.reward}


def test_resume_after_a_trainer_crash_serves_again_what_the_checkpoint_lacks(
    db_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    make_launcher_db(db_url)
    writer = Writer(db_url, job=JOB)
    for name in ("g1", "g2", "g3", "g4"):
        writer.group(name, K)
    with serve(db_url, tmp_path) as srv:
        with BufferClient(srv.url, backoff_s=0.1) as trainer:
            trainer.start_rollout(num_repeat_per_sample=K, job_session=JOB)
            wait_until(lambda: ready(trainer, 4), 30, "four groups ready")
            checkpoint = trainer.get_batch(max_groups=2, timeout=30).meta_info["finished_groups"]
            lost = trainer.get_batch(max_groups=2, timeout=30).meta_info["finished_groups"]
        # the trainer died before its next checkpoint; a new process restarts from the last one
        writer.group("g5", K)
        writer.close()
        caplog.set_level(logging.INFO, logger="rollout_buffer.client")
        with BufferClient(srv.url, backoff_s=0.1) as trainer:
            answer = trainer.resume(checkpoint, num_repeat_per_sample=K, job_session=JOB)
            assert answer["redelivery"]["queued"] == 2 and answer["redelivery"]["groups"] == lost
            lines = [r.getMessage() for r in caplog.records if r.name == "rollout_buffer.client"]
            assert lines == [
                f"resume: job {JOB}: the checkpoint holds 2 groups; 2 served groups it lacks are "
                f"delivered again first: {', '.join(lost)}"
            ]
            # a retry of the call (its answer lost) queues the same groups, not twice as many
            retried = trainer.resume(checkpoint, num_repeat_per_sample=K, job_session=JOB)
            assert retried["redelivery"]["groups"] == lost
            again = list(trainer.iter_groups(3, timeout=30))
            assert trainer.get_rollout_data()["success"] is False
        assert [g.group_id for g in again] == [*lost, "g5"]
        assert [g.redelivered for g in again] == [True, True, False]
        assert again[0].meta_info["redelivered"] == lost


def test_resume_that_redelivers_nothing_says_why(sqlite_url: str, tmp_path: Path, caplog) -> None:
    make_launcher_db(sqlite_url)
    with serve(sqlite_url, tmp_path) as srv, BufferClient(srv.url, backoff_s=0.1) as trainer:
        trainer.start_rollout(num_repeat_per_sample=K, job_session=JOB)
        caplog.set_level(logging.INFO, logger="rollout_buffer.client")
        answer = trainer.resume([], num_repeat_per_sample=K, job_session=JOB)
        assert "redelivery" not in answer
        (line,) = [r.getMessage() for r in caplog.records if r.name == "rollout_buffer.client"]
        assert "nothing is delivered again (the checkpoint holds no group)" in line


TRAINER = """
import json, sys
from rollout_buffer.client import BufferClient
client = BufferClient(sys.argv[1], backoff_s=0.1)
first = client.get_batch(max_groups=2, timeout=60)
print(json.dumps(first.meta_info["finished_groups"]), flush=True)  # its checkpoint
client.get_batch(min_groups=2, max_groups=2, timeout=60)
print("received the second batch", flush=True)
"""


def test_a_trainer_killed_before_it_read_a_served_batch_gets_it_again_on_resume(
    sqlite_url: str, tmp_path: Path
) -> None:
    make_launcher_db(sqlite_url)
    writer = Writer(sqlite_url, job=JOB)
    for name in ("g1", "g2", "g3"):
        writer.group(name, K)
    writer.group("g4", K, complete=K - 1)
    with serve(sqlite_url, tmp_path) as srv, BufferClient(srv.url, backoff_s=0.1) as client:
        client.start_rollout(num_repeat_per_sample=K, job_session=JOB)
        wait_until(lambda: ready(client, 3), 30, "three groups ready")
        trainer = subprocess.Popen(
            [sys.executable, "-c", TRAINER, srv.url],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert trainer.stdout is not None
            checkpoint = json.loads(trainer.stdout.readline())
            assert checkpoint == ["g1", "g2"]
            wait_until(lambda: waiting(client), 30, "the trainer's second poll waits")
            os.kill(trainer.pid, signal.SIGSTOP)  # it cannot read what is served now
            writer.session("g4", "g4-last", 2)
            wait_until(
                lambda: client.stats()["groups"]["served"] == 4, 30, "the batch served to it"
            )
            trainer.kill()  # kill -9 before it ever read the batch
            assert trainer.wait(30) == -signal.SIGKILL
            assert "received" not in trainer.stdout.read()
        finally:
            if trainer.poll() is None:
                trainer.kill()
                trainer.wait(30)
            if trainer.stdout is not None:
                trainer.stdout.close()
        writer.close()
        answer = client.resume(checkpoint, num_repeat_per_sample=K, job_session=JOB)
        assert answer["redelivery"]["groups"] == ["g3", "g4"]
        again = list(client.iter_groups(2, timeout=30))
        assert [(g.group_id, g.redelivered) for g in again] == [("g3", True), ("g4", True)]
        assert all(len(g.sessions) == K for g in again)


def test_iter_groups_never_waits_for_more_groups_than_it_still_wants() -> None:
    with (
        Scripted([batch("a"), batch("b", "c")], EMPTY) as srv,
        BufferClient(srv.url) as client,
    ):
        got = [g.group_id for g in client.iter_groups(3, min_groups=5, wait_s=1, timeout=10)]
        assert got == ["a", "b", "c"]
        assert [(b["max_groups"], b["min_groups"]) for b in srv.bodies] == [(3, 3), (2, 2)]
        srv.script.append(batch("d"))
        groups = client.iter_groups(max_groups=0, min_groups=2, wait_s=1, timeout=10)
        assert next(groups).group_id == "d"
        groups.close()
        assert (srv.bodies[-1]["max_groups"], srv.bodies[-1]["min_groups"]) == (0, 2)  # no cap
