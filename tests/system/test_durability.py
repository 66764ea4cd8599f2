"""Durability and delivery with a real gunicorn and real databases (issue 4).

A crash (``kill -9`` of master and worker) or a lost response loses and duplicates nothing:
every complete group reaches the trainer exactly once across restarts, decided groups stay
decided, and a request_id replays its batch -- also after a crash. Database faults (Postgres
backends terminated, SQLite locked past the busy timeout) give 503s for a while, then the
service recovers by itself.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import threading
import time
import uuid
from pathlib import Path

import pytest
import requests
from servers import (
    Server,
    Trainer,
    assert_exactly_once,
    assert_stats_balance,
    complete_groups,
    kill9,
    log_tail,
    uids,
)
from support import PG_DSN, Writer, groups_of, make_launcher_db, wait_until

from rollout_buffer.launcher import procfs
from rollout_buffer.storage.db import connect

pytestmark = pytest.mark.slow

K = 4


# -- helpers
# ------------------------------------------------------------------------------------------------


def workers_of(master: int) -> list[int]:
    return procfs.children(master)


def kill9_and_restart(srv: Server) -> None:
    """kill -9 the whole process group (gunicorn master and worker), then start again on the same
    DB."""
    assert srv.proc is not None
    assert len(procfs.group_members(srv.proc.pid)) >= 2, "expected a master and a worker"
    kill9(srv)
    srv.start()


def kill9_worker(srv: Server) -> None:
    """kill -9 only the gunicorn worker; the master forks a new one, which starts with empty
    memory."""
    assert srv.proc is not None
    [old] = workers_of(srv.proc.pid)
    os.kill(old, signal.SIGKILL)
    wait_until(lambda: (lambda w: w and old not in w)(workers_of(srv.proc.pid)), 15, "a new worker")
    problem = srv.wait_healthy(30)
    assert problem is None, f"{problem}\n{log_tail(srv.log_path)}"


def recorded_drops(db_url: str) -> dict[str, str]:
    """{group_id: reason} of the groups rollout_buffer_groups holds as dropped."""
    db = connect(db_url)
    try:
        rows = db.rows(
            "SELECT group_id, reason FROM rollout_buffer_groups WHERE status = 'dropped'", ()
        )
    finally:
        db.close()
    return {g: r for g, r in rows}


def new_server(db_url: str, tmp_path: Path, **env: str) -> Server:
    return Server(db_url, tmp_path / "srv", env=env)


# -- crash windows
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "point",
    ["before_any_poll", "between_polls", "twice_between_polls", "half_complete", "worker_only"],
)
def test_kill9_and_restart_serves_every_group_exactly_once(tmp_path, point):
    db_url = "sqlite://" + str(tmp_path / "launcher.db")
    make_launcher_db(db_url)
    w = Writer(db_url)
    for i in range(3):
        w.group(f"inc{i}", K, steps=2, complete=2)  # never completes: never served
    for i in range(30):
        w.group(f"c{i:02d}", K, steps=2 + i % 2)
    half: dict[str, list[str]] = {}
    if point == "half_complete":
        for i in range(5):
            half[f"h{i}"] = w.group(f"h{i}", K, steps=1, complete=2)
    srv = new_server(db_url, tmp_path)
    srv.start()
    try:
        t = Trainer(srv)
        t.start_rollout()
        if point == "before_any_poll":
            wait_until(lambda: t.stats()["groups"]["ready"] == 30, 15, "30 groups ready")
            kill9_and_restart(srv)
        else:
            for _crash in range(2 if point == "twice_between_polls" else 1):
                # the background ingest (or, after a restart, the resume) must have caught up first
                wait_until(
                    lambda: (t.stats().get("groups") or {}).get("ready", 0) >= 10,
                    15,
                    "10 groups ready",
                )
                for _ in range(2):
                    assert t.poll(max_groups=5)["success"] is True
                if point == "worker_only":
                    kill9_worker(srv)
                else:
                    kill9_and_restart(srv)
        served_before = set(t.served)
        if half:
            for gid, sessions in half.items():  # their remaining rows arrive after the restart
                for sid in sessions[2:]:
                    w.step(gid, sid, 2, completed=True, step_reward=0.5)
        # no /start_rollout: the active job resumes by itself
        expected = complete_groups(db_url, "job1")
        assert len(expected) == 30 + len(half)
        t.drain(set(expected), max_groups=7)
        assert_exactly_once(t, expected)
        assert served_before <= set(t.served)
        for gid in half:
            assert len({i["extra_info"]["session_id"] for i in t.served[gid][0]}) == K
        s = assert_stats_balance(t, db_url)
        assert s["groups"]["served"] == len(expected)
        assert s["groups"]["pending"] == 3
    finally:
        w.close()
        srv.stop()


def test_restart_keeps_drops_and_serves_nothing_twice_and_a_new_job_starts_clean(tmp_path):
    db_url = "sqlite://" + str(tmp_path / "launcher.db")
    make_launcher_db(db_url)
    w = Writer(db_url)
    ttl_sessions = w.group("ttl", K, steps=1, complete=2)
    for i in range(6):
        w.group(f"c{i}", K, steps=2)
    for i in range(K):  # a complete group whose first session has a row with broken messages
        sid = f"bad-s{i}-{uuid.uuid4().hex[:8]}"
        w.step("bad", sid, 1, messages="{not json" if i == 0 else None)
        w.step("bad", sid, 2, completed=True, step_reward=0.5)
    srv = new_server(db_url, tmp_path, AIEVOBOX_BUFFER_INCOMPLETE_GROUP_TTL_SECONDS="1")
    srv.start()
    try:
        t = Trainer(srv)
        t.start_rollout()
        expected = {f"c{i}": 2 * K for i in range(6)}
        t.drain(set(expected))
        assert "bad" not in t.served and "ttl" not in t.served

        def both_dropped() -> dict | None:
            s = t.stats()
            d = s["groups"]["dropped"]
            return s if d.get("incomplete_group_ttl") == 1 and d.get("malformed_row") == 1 else None

        before = wait_until(both_dropped, 15, "ttl and malformed drops")
        # /stats counts a drop as it is decided, a moment before the tick records it: the crash
        # comes once both are in the database, which is what a restart promises to keep
        wait_until(
            lambda: (
                recorded_drops(db_url) == {"bad": "malformed_row", "ttl": "incomplete_group_ttl"}
            ),
            15,
            "both drops recorded",
        )
        kill9_and_restart(srv)

        after = wait_until(
            lambda: (s := t.stats())["job_session"] == "job1" and s, 15, "job1 resumed"
        )
        assert after["groups"]["served"] == 6
        assert after["groups"]["dropped"] == before["groups"]["dropped"]
        assert after["rows"]["rejected"] == before["rows"]["rejected"]
        # late rows for the dropped groups, and two new groups
        late = 0
        for sid in ttl_sessions[2:]:
            w.step("ttl", sid, 2, completed=True, step_reward=1.0)
            late += 1
        w.step("bad", "bad-late-" + uuid.uuid4().hex[:8], 1, completed=True)
        late += 1
        for i in range(2):
            w.group(f"n{i}", K, steps=2)
        expected.update({"n0": 2 * K, "n1": 2 * K})
        t.drain(set(expected))
        assert_exactly_once(t, expected)
        s = assert_stats_balance(t, db_url)
        assert s["groups"]["served"] == 8
        assert s["groups"]["dropped"] == {"incomplete_group_ttl": 1, "malformed_row": 1}
        assert s["rows"]["dropped"].get("late_rows_from_dropped_groups") == late, s["rows"]

        # a new job after the restart starts clean
        w2 = Writer(db_url, job="job2")
        try:
            w2.group("c0", 2, steps=1)  # same group id as job1's, different job: a new group
            w2.group("j2", 2, steps=3)
        finally:
            w2.close()
        t.start_rollout("job2", k=2)
        fresh = wait_until(
            lambda: (lambda s: s if s["rows"]["read"] == 2 * 1 + 2 * 3 else None)(t.stats()),
            15,
            "job2 rows read",
        )
        assert fresh["job_session"] == "job2"
        assert fresh["groups"]["served"] == 0 and fresh["groups"]["dropped_total"] == 0
        assert fresh["rows"]["served"] == 0 and fresh["rows"]["dropped_total"] == 0
        t2 = Trainer(srv)
        t2.drain({"c0", "j2"})
        assert_exactly_once(t2, {"c0": 2, "j2": 6})
        assert {d["data"]["meta_info"]["job_session"] for d in t2.by_request.values()} == {"job2"}
        assert_stats_balance(t2, db_url, "job2")
    finally:
        w.close()
        srv.stop()


# -- request_id
# ------------------------------------------------------------------------------------------------


def test_request_id_replays_binds_only_data_serialises_and_survives_kill9(tmp_path):
    db_url = "sqlite://" + str(tmp_path / "launcher.db")
    make_launcher_db(db_url)
    w = Writer(db_url)
    for i in range(12):
        w.group(f"c{i:02d}", K, steps=2)
    srv = new_server(db_url, tmp_path)
    srv.start()
    try:
        t = Trainer(srv)
        t.start_rollout()
        wait_until(lambda: t.stats()["groups"]["ready"] == 12, 15, "12 groups ready")

        # the same id twice: the same batch; a different max_groups on the replay is ignored
        first = t.post({"request_id": "A", "max_groups": 3}).json()
        assert first["success"] is True and first["data"]["meta_info"]["replayed"] is False
        assert len(groups_of(first)) == 3
        again = t.post({"request_id": "A", "max_groups": 7}).json()
        assert again["data"]["meta_info"]["replayed"] is True
        assert uids(again) == uids(first)
        assert again["data"]["data"] == first["data"]["data"]
        assert again["data"]["meta_info"]["batch_id"] == first["data"]["meta_info"]["batch_id"]
        t.record("A", first)

        # concurrent requests with one id: one batch
        n = 6
        barrier = threading.Barrier(n)
        answers: list[dict] = []
        lock = threading.Lock()

        def hit() -> None:
            with requests.Session() as s:
                barrier.wait(10)
                doc = s.post(
                    srv.url + "/get_rollout_data",
                    json={"request_id": "B", "max_groups": 2},
                    timeout=60,
                ).json()
            with lock:
                answers.append(doc)

        threads = [threading.Thread(target=hit, name=f"hit-{i}") for i in range(n)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert len(answers) == n
        assert all(a["success"] for a in answers)
        assert len({tuple(uids(a)) for a in answers}) == 1
        assert sorted(a["data"]["meta_info"]["replayed"] for a in answers) == [False] + [True] * (
            n - 1
        )
        t.record("B", next(a for a in answers if not a["data"]["meta_info"]["replayed"]))

        # drain the rest, then: an empty answer does not bind the id
        t.drain({f"c{i:02d}" for i in range(12)}, max_groups=4)
        empty = t.post({"request_id": "X"}).json()
        assert empty["success"] is False
        w.group("late0", K, steps=2)
        w.group("late1", K, steps=2)
        wait_until(lambda: t.stats()["groups"]["ready"] == 2, 15, "2 new groups ready")
        fresh = t.post({"request_id": "X"}).json()
        assert fresh["success"] is True and fresh["data"]["meta_info"]["replayed"] is False
        assert set(groups_of(fresh)) == {"late0", "late1"}
        t.record("X", fresh)

        # kill -9 after the batch was recorded (the response came back) but the trainer "lost" it
        for i in range(3):
            w.group(f"z{i}", K, steps=2)
        wait_until(lambda: t.stats()["groups"]["ready"] == 3, 15, "3 groups ready")
        lost = t.post({"request_id": "Z", "max_groups": 2}).json()
        assert lost["success"] is True and len(groups_of(lost)) == 2
        kill9_and_restart(srv)
        replay = t.poll(request_id="Z")  # retried while the restarted service loads its state
        assert replay["success"] is True and replay["data"]["meta_info"]["replayed"] is True
        assert uids(replay) == uids(lost)
        assert replay["data"]["data"] == lost["data"]["data"]
        assert replay["data"]["meta_info"]["batch_id"] == lost["data"]["meta_info"]["batch_id"]
        # the replayed groups are not served again to another id; the third one is
        expected = complete_groups(db_url, "job1")
        t.drain(set(expected))
        assert_exactly_once(t, expected)
        assert_stats_balance(t, db_url)
    finally:
        w.close()
        srv.stop()


def test_request_id_past_the_retention_window_is_410_never_a_new_batch(tmp_path):
    db_url = "sqlite://" + str(tmp_path / "launcher.db")
    make_launcher_db(db_url)
    w = Writer(db_url)
    for i in range(4):
        w.group(f"c{i}", K, steps=1)
    srv = new_server(db_url, tmp_path, ROLLOUT_BUFFER_REPLAY_RETENTION_SECONDS="1")
    srv.start()
    try:
        t = Trainer(srv)
        t.start_rollout()
        wait_until(lambda: t.stats()["groups"]["ready"] == 4, 15, "4 groups ready")
        doc = t.poll(max_groups=2, request_id="R")
        assert doc["success"] is True
        time.sleep(1.5)
        r = t.post({"request_id": "R", "max_groups": 2})
        assert r.status_code == 410, r.text
        err = r.json()
        assert err["ok"] is False and err["status"] == 410 and "request_id" in err["error"]
        assert err.get("batch_id") == doc["data"]["meta_info"]["batch_id"]
        assert t.stats()["groups"]["ready"] == 2, "the 410 must not have taken groups"
        t.drain({f"c{i}" for i in range(4)})
        assert_exactly_once(t, {f"c{i}": K for i in range(4)})
    finally:
        w.close()
        srv.stop()


# -- database faults
# -----------------------------------------------------------------------------------------


def test_postgres_backends_terminated_mid_drain_lose_and_duplicate_nothing(tmp_path, pg_url):
    import psycopg

    make_launcher_db(pg_url)
    w = Writer(pg_url)
    for i in range(30):
        w.group(f"c{i:02d}", K, steps=2)
    w.group("inc", K, steps=2, complete=1)
    # libpq tags every server connection with this name: the killer touches nothing else on the
    # server
    app_name = "rbsrv-" + uuid.uuid4().hex[:12]
    srv = new_server(pg_url, tmp_path, PGAPPNAME=app_name)
    srv.start()
    stop = threading.Event()
    killed: list[int] = []
    errors: list[BaseException] = []

    def killer() -> None:
        try:
            with psycopg.connect(PG_DSN, autocommit=True, application_name="rbtest") as conn:
                while not stop.wait(0.3):
                    n = conn.execute(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                        "WHERE application_name = %s AND pid <> pg_backend_pid()",
                        (app_name,),
                    ).fetchone()[0]
                    killed.append(int(n))
        except BaseException as exc:
            errors.append(exc)

    try:
        t = Trainer(srv)
        t.start_rollout()
        wait_until(lambda: t.stats()["groups"]["ready"] == 30, 15, "30 groups ready")
        th = threading.Thread(target=killer, name="pg-killer", daemon=True)
        th.start()
        try:
            expected = complete_groups(pg_url, "job1")
            t.drain(set(expected), max_groups=2, pause=0.15, timeout=60)
        finally:
            stop.set()
            th.join(10)
        assert not errors, errors
        assert sum(killed) >= 3, f"the killer terminated only {killed} backends"
        assert_exactly_once(t, expected)
        assert_stats_balance(t, pg_url)
        h = requests.get(srv.url + "/health", timeout=10).json()
        assert h["status"] == "healthy", h
    finally:
        stop.set()
        w.close()
        srv.stop()


def test_sqlite_locked_past_the_busy_timeout_gives_503_then_recovers(tmp_path):
    db_url = "sqlite://" + str(tmp_path / "launcher.db")
    path = str(tmp_path / "launcher.db")
    make_launcher_db(db_url)
    w = Writer(db_url)
    for i in range(20):
        w.group(f"c{i:02d}", K, steps=2)
    srv = new_server(db_url, tmp_path, ROLLOUT_BUFFER_DB_UNHEALTHY_AFTER_SECONDS="1")
    srv.start()
    locked = threading.Event()
    errors: list[BaseException] = []

    def hold_lock() -> None:
        # a writer that keeps the write lock for ~7 s (the busy timeout is 5 s), writing 3 groups in
        # it
        try:
            wl = Writer(db_url)
            try:
                wl.db.execute("BEGIN IMMEDIATE")
                locked.set()
                for i in range(3):
                    wl.group(f"locked{i}", K, steps=1)
                time.sleep(7)
                wl.db.execute("COMMIT")
            finally:
                wl.close()
        except BaseException as exc:
            errors.append(exc)
            locked.set()

    try:
        t = Trainer(srv)
        t.start_rollout()
        wait_until(lambda: t.stats()["groups"]["ready"] == 20, 15, "20 groups ready")
        for _ in range(2):
            assert t.poll(max_groups=3)["success"] is True
        th = threading.Thread(target=hold_lock, name="sqlite-lock-holder")
        th.start()
        assert locked.wait(10)
        # the rows written inside the lock become visible at its COMMIT and must be served too
        expected = {f"c{i:02d}": 2 * K for i in range(20)} | {f"locked{i}": K for i in range(3)}
        try:
            t.drain(set(expected), max_groups=3, timeout=60)
        finally:
            th.join(30)
        assert not errors, errors
        assert 503 in t.statuses, f"no 503 while the database was locked: {t.statuses}"
        assert complete_groups(db_url, "job1") == expected
        assert_exactly_once(t, expected)
        assert_stats_balance(t, db_url)
        wait_until(
            lambda: requests.get(srv.url + "/health", timeout=10).json()["status"] == "healthy",
            15,
            "healthy again",
        )
        with contextlib.closing(sqlite3.connect(path)) as conn:
            assert (
                conn.execute(
                    "SELECT COUNT(*) FROM rollout_buffer_groups WHERE status = 'served'"
                ).fetchone()[0]
                == 23
            )
    finally:
        w.close()
        srv.stop()


def test_a_poll_before_the_restarted_service_has_loaded_its_state_is_503_not_empty(tmp_path):
    # An empty answer releases a request_id: the trainer would move on with a fresh id and the batch
    # bound to the old one (its groups already marked served) would be lost. Until the service has
    # resumed its job from the database, a poll must say "retry" instead.
    db_url = "sqlite://" + str(tmp_path / "launcher.db")
    path = str(tmp_path / "launcher.db")
    make_launcher_db(db_url)
    w = Writer(db_url)
    for i in range(3):
        w.group(f"c{i}", K, steps=2)
    w.close()
    srv = new_server(db_url, tmp_path)
    srv.start()
    try:
        t = Trainer(srv)
        t.start_rollout()
        wait_until(lambda: t.stats()["groups"]["ready"] == 3, 15, "3 groups ready")
        lost = t.post({"request_id": "Z", "max_groups": 2}).json()
        assert lost["success"] is True
        # kill -9, then keep the database unreadable while the server restarts (WAL + exclusive
        # locking mode)
        assert srv.proc is not None
        pgid = srv.proc.pid
        srv.stop(signal.SIGKILL)
        wait_until(lambda: not procfs.group_members(pgid), 5, "every server process gone")
        holder = sqlite3.connect(path, isolation_level=None)
        try:
            holder.execute("PRAGMA locking_mode=EXCLUSIVE")
            holder.execute("BEGIN EXCLUSIVE")
            holder.execute("COMMIT")  # the exclusive lock stays held in this locking mode
            srv.start()  # /health does not touch the database
            for body in ({"request_id": "Z"}, {}):
                r = t.post(body)
                assert r.status_code == 503, f"{body}: HTTP {r.status_code} {r.text[:300]}"
                err = r.json()
                assert err["ok"] is False and err["status"] == 503, err
        finally:
            holder.close()
        replay = t.poll(request_id="Z")  # retried on 503 until the state is loaded
        assert replay["data"]["meta_info"]["replayed"] is True
        assert uids(replay) == uids(lost)
        t.drain({"c0", "c1", "c2"})
        assert_exactly_once(t, {f"c{i}": 2 * K for i in range(3)})
        assert_stats_balance(t, db_url)
    finally:
        srv.stop()


def test_an_on_failure_restart_pending_at_a_kill9_is_carried_out_after_it(tmp_path):
    """Also suspected in issue 14 (seen once): the launcher exits 3, will_restart is true, the
    service is killed during the backoff, and after the restart nobody relaunches it."""
    import shlex
    import sys

    url = "sqlite://" + str(tmp_path / "launcher.db")
    make_launcher_db(url)
    marker = tmp_path / "launcher.starts"
    fake = Path(__file__).resolve().parent.parent / "fakes" / "fake_launcher.py"
    srv = Server(
        url,
        tmp_path / "srv",
        launcher="auto",
        env={
            "ROLLOUT_BUFFER_LAUNCHER_CMD": shlex.join(
                [sys.executable, str(fake), "--mode", "exit1", "--marker", str(marker)]
            ),
            "ROLLOUT_BUFFER_RESTART_POLICY": "on-failure",
            "ROLLOUT_BUFFER_RESTART_BACKOFF_SECONDS": "600",
        },
    )
    srv.start()
    try:
        r = requests.post(
            srv.url + "/start_rollout",
            json={"num_repeat_per_sample": 2, "job_session": "j"},
            timeout=30,
        )
        assert r.status_code == 200, r.text

        def pending_restart() -> bool:
            launcher = requests.get(srv.url + "/health", timeout=5).json()["launcher"]
            if not (launcher["exit_code"] == 1 and launcher["will_restart"] is True):
                return False
            db = connect(url)  # and recorded: a kill before that is a launcher that ended unseen
            try:
                return (
                    db.scalar("SELECT launcher_state FROM rollout_buffer_jobs WHERE job_id = 'j'")
                    == "restart_pending"
                )
            finally:
                db.close()

        wait_until(
            pending_restart, 15, "the launcher exited and its restart (in 600 s) is recorded"
        )
        assert len(marker.read_text().split()) == 1
        pgid = srv.proc.pid
        srv.stop(signal.SIGKILL)
        wait_until(lambda: not procfs.group_members(pgid), 5, "the killed service gone")
        srv.start()
        wait_until(
            lambda: len(marker.read_text().split()) == 2,
            15,
            lambda: (
                f"the pending restart carried out after the kill -9 ({log_tail(srv.log_path, 20)})"
            ),
        )
    finally:
        srv.stop()
