"""Issue 14, the service-level scenarios, through the real parts (Flask test client, real gunicorn,
real SQLite files and Postgres, real launcher processes):

- 7: an empty poll with a fresh request_id touches no database (and a bound id still replays);
- 8: the response byte budget counts encoded bytes (non-ASCII group ids);
- 13: durable state retention (batches, ended jobs) and the indexes startup scans need;
- 15: replays are bounded in memory (one shared copy) and in number (429 + Retry-After);
- 16: a backlog drain without max_groups costs what each poll serves;
- 17: an instance never kills a launcher another instance on the host has adopted (or, with the
  lease, that the standby on its host takes over);
- 18: a /start_rollout right after a restart waits for the resume, then says "already running";
  and a bootstrap retried after it adopted the launcher keeps it (found while testing 17/18).

Only observable conditions are waited for. The database counting of scenario 7 patches the
database classes and every module that imported ``connect``, so it does not depend on which
module of the service opens connections.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shlex
import signal
import socket
import sqlite3
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from servers import Server
from support import Harness, Writer, groups_of, make_launcher_db, wait_until

from rollout_buffer.core.accumulator import Accumulator
from rollout_buffer.core.config import Config
from rollout_buffer.launcher import procfs
from rollout_buffer.storage import db as db_mod

FAKE_LAUNCHER = Path(__file__).resolve().parent.parent / "fakes" / "fake_launcher.py"
BACKGROUND = "rollout-buffer-"  # the loop and lease threads: their statements are not a poll's


# -- helpers ---------------------------------------------------------------------------------------
class DbTouches:
    """Connections opened and statements run by request threads (the loop and lease threads are not
    counted)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.connects = 0
        self.statements = 0
        real_connect = db_mod.connect

        def connect(*a: Any, **kw: Any) -> Any:
            if not threading.current_thread().name.startswith(BACKGROUND):
                self.connects += 1
            return real_connect(*a, **kw)

        for name, mod in list(sys.modules.items()):
            if name.startswith("rollout_buffer") and getattr(mod, "connect", None) is real_connect:
                monkeypatch.setattr(mod, "connect", connect)
        for cls in (db_mod.SqliteDatabase, db_mod.PostgresDatabase):

            def counted(obj: Any, *a: Any, _run: Any = cls._run, **kw: Any) -> Any:
                if not threading.current_thread().name.startswith(BACKGROUND):
                    self.statements += 1
                return _run(obj, *a, **kw)

            monkeypatch.setattr(cls, "_run", counted)

    def reset(self) -> None:
        self.connects = self.statements = 0

    @property
    def touched(self) -> tuple[int, int]:
        return self.connects, self.statements


def uids(doc: dict) -> list[str]:
    return sorted(item["uid"] for item in doc["data"]["data"])


def one_row_group(w: Writer, gid: str, k: int, content: str) -> None:
    """K completed one-step sessions with short session ids and one user message of ``content``."""
    for i in range(k):
        w.step(
            gid,
            f"s{i}-{uuid.uuid4().hex[:12]}",
            1,
            completed=True,
            step_reward=0.5,
            messages=[{"role": "user", "content": content}],
            response="a",
        )


def worker_pid(master: int) -> int:
    """The gunicorn worker: the master's child (there is no launcher in that test)."""

    def find() -> int | None:
        kids = procfs.children(master)
        return kids[0] if len(kids) == 1 else None

    return wait_until(find, 10, "the gunicorn worker")


def vm_rss(pid: int) -> int:
    """Resident set size in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def start_rollout(url: str, job: str, k: int, timeout: float = 30) -> requests.Response:
    return requests.post(
        url + "/start_rollout",
        json={"num_repeat_per_sample": k, "job_session": job},
        timeout=timeout,
    )


def poll_count(url: str) -> int:
    return requests.get(url + "/stats", timeout=10).json()["polls"]["count"]


def stats(url: str) -> dict:
    return requests.get(url + "/stats", timeout=10).json()


def poll_until_data(url: str, request_id: str, groups: int) -> bytes:
    """Poll with request_id until a batch with ``groups`` groups is bound to it; its raw body."""

    def attempt() -> bytes | None:
        r = requests.post(url + "/get_rollout_data", json={"request_id": request_id}, timeout=60)
        assert r.status_code == 200, r.text[:300]
        doc = r.json()
        if not doc["success"]:
            return None
        assert len(groups_of(doc)) == groups, "a batch was bound to part of the groups"
        return r.content

    return wait_until(attempt, 30, f"a batch for request_id {request_id}")


def slow_reader(port: int, request_id: str) -> socket.socket:
    """Send a replay request and never read the answer (a tiny receive buffer, so the server
    blocks)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
    s.connect(("127.0.0.1", port))
    body = json.dumps({"request_id": request_id}).encode()
    s.sendall(
        b"POST /get_rollout_data HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    return s


def fake_launcher_cmd(marker: Path) -> str:
    return shlex.join(
        [sys.executable, str(FAKE_LAUNCHER), "--mode", "hang", "--marker", str(marker)]
    )


class TwoInstances:
    """Two servers (``first``, ``second``) on one database and run dir whose launcher is a
    long-lived fake; ``start_launcher`` starts one through /start_rollout."""

    def __init__(self, url: str, tmp_path: Path) -> None:
        make_launcher_db(url)
        self.marker = tmp_path / "launcher.starts"
        env = {
            "ROLLOUT_BUFFER_LAUNCHER_CMD": fake_launcher_cmd(self.marker),
            "ROLLOUT_BUFFER_STOP_GRACE_SECONDS": "1",
            "ROLLOUT_BUFFER_NAME": "pair",  # one buffer: the second is the first one's standby
        }
        self.first = Server(url, tmp_path, launcher="auto", env=env, name="first")
        self.second = Server(url, tmp_path, launcher="auto", env=env, name="second")
        self.pids: list[int] = []

    def start_launcher(self, srv: Server, job: str = "job1", k: int = 2) -> int:
        """Start ``srv`` and its launcher for ``job``; the launcher's pid once it runs."""
        srv.start()
        r = start_rollout(srv.url, job, k)
        assert r.status_code == 200, r.text
        pid = r.json()["pid"]
        self.pids.append(pid)
        wait_until(
            lambda: self.marker.exists() and str(pid) in self.marker.read_text().split(),
            10,
            "launcher start",
        )
        return pid

    def starts(self) -> list[str]:
        """The pids of every launcher start, in order."""
        return self.marker.read_text().split()

    def close(self) -> None:
        """Stop both servers, then kill any launcher still alive (each leads its own group)."""
        self.first.stop()
        self.second.stop()
        for pid in self.pids:
            if procfs.alive(pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)


@contextlib.contextmanager
def two_instances(url: str, tmp_path: Path) -> Iterator[TwoInstances]:
    two = TwoInstances(url, tmp_path)
    try:
        yield two
    finally:
        two.close()


# -- 7: an empty poll with a fresh request_id
# ---------------------------------------------------------------
def test_empty_polls_with_fresh_request_ids_touch_no_database_and_bound_ids_still_replay(
    db_url, writer, harness_factory, monkeypatch
):
    h = harness_factory(db_url)
    h.start(k=2)
    writer.group("g1", 2)
    bound = h.poll(request_id="rid-bound")
    assert len(groups_of(bound)) == 1
    touches = DbTouches(monkeypatch)

    def empty_polls(harness: Any, prefix: str, n: int) -> None:
        for i in range(n):
            r = harness.client.post("/get_rollout_data", json={"request_id": f"{prefix}-{i}"})
            assert r.status_code == 200 and r.get_json()["success"] is False, r.get_data(
                as_text=True
            )[:300]

    empty_polls(h, "fresh", 30)
    assert touches.touched == (0, 0), "empty polls with fresh request_ids touched the database"

    h.stop()
    h2 = harness_factory(db_url)  # a restart: the job is resumed from the database
    touches.reset()
    empty_polls(h2, "first", 1)
    assert touches.connects <= 1, (
        "the first poll after a restart may load the job's request_ids, once"
    )
    touches.reset()
    empty_polls(h2, "after", 30)
    assert touches.touched == (0, 0), (
        "empty polls with fresh request_ids touched the database after a restart"
    )

    r = h2.client.post("/get_rollout_data", json={"request_id": "rid-bound"})
    assert r.status_code == 200
    replay = r.get_json()
    assert replay["data"]["meta_info"]["replayed"] is True
    assert uids(replay) == uids(bound), (
        "a bound request_id must replay the very same batch after a restart"
    )


# -- 8: the byte budget with non-ASCII group ids
# --------------------------------------------------------------
@pytest.mark.parametrize("char,n", [("\u4e2d", 1500), ("\U0001f600", 500)], ids=["cjk", "emoji"])
def test_response_byte_budget_holds_with_non_ascii_group_ids(lite_url, harness_factory, char, n):
    budget = 64 * 1024
    h = harness_factory(lite_url, max_response_bytes=budget)
    h.start(k=1)
    w = Writer(lite_url)
    # ids long enough that several groups fill a response (their escaped form in meta_info is 6
    # bytes a CJK character and 12 an emoji, their UTF-8 in the items 3 and 4)
    gids = [f"{i:03d}" + char * n for i in range(40)]
    for gid in gids:
        one_row_group(w, gid, 1, "t")
    w.close()
    h.settle()
    assert h.stats()["groups"]["ready"] == len(gids)
    served: set[str] = set()
    for _ in range(len(gids)):
        r = h.client.post("/get_rollout_data", json={})
        assert r.status_code == 200
        body = r.get_data()
        got = groups_of(json.loads(body))
        if not got:
            break
        assert len(body) <= budget or len(got) == 1, (
            f"{len(body)} bytes for {len(got)} groups: the budget of {budget} was exceeded "
            f"({len(body) / budget:.2f}x)"
        )
        served |= set(got)
    assert served == set(gids)


# -- 16: a backlog drain without max_groups
# ---------------------------------------------------------------
def test_backlog_drain_without_max_groups_takes_what_it_serves(
    lite_url, harness_factory, monkeypatch
):
    n_groups = 5000
    w = Writer(lite_url)
    h = harness_factory(lite_url, max_response_bytes=100_000, prebuild=False)  # the poll's own path
    h.start(k=1)
    with w.db.transaction():
        for g in range(n_groups):
            one_row_group(w, f"b{g:05d}", 1, "x" * 1500)  # ~1.7 KB a group: ~50 fit the budget
    w.close()
    h.settle()
    assert h.stats()["groups"]["ready"] == n_groups

    moved = {"taken": 0, "released": 0}
    real_take, real_release = Accumulator.take_ready, Accumulator.release

    def take_ready(self: Accumulator, *a: Any, **kw: Any) -> Any:
        out = real_take(self, *a, **kw)
        moved["taken"] += len(out)
        return out

    def release(self: Accumulator, takes: Any, *a: Any, **kw: Any) -> Any:
        moved["released"] += len(takes)
        return real_release(self, takes, *a, **kw)

    monkeypatch.setattr(Accumulator, "take_ready", take_ready)
    monkeypatch.setattr(Accumulator, "release", release)
    left = n_groups
    for _ in range(5):
        moved.update(taken=0, released=0)
        r = h.client.post("/get_rollout_data", json={})
        assert r.status_code == 200
        served = len(groups_of(r.get_json()))
        assert 10 <= served <= 200, served
        # what a poll moves in and out of the ready queue is bounded by what it serves (plus one
        # small step), never by the backlog
        assert moved["taken"] - served == moved["released"], moved
        assert moved["taken"] <= served + 128, (
            f"a poll serving {served} groups took {moved['taken']} of {left}"
        )
        left -= served
    assert h.stats()["groups"]["ready"] == left


# -- 13: retention and indexes
# ------------------------------------------------------------------------------
def _fast_housekeeping(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the retention pass every 0.2 s instead of every 30 s (when the tree has that loop)."""
    try:
        loop = importlib.import_module("rollout_buffer.runtime.loop")
    except ImportError:
        return  # a tree without a housekeeping loop: the waits below fail, as they should
    monkeypatch.setattr(loop, "HOUSEKEEPING_S", 0.2)


def count(url: str, sql: str, params: tuple = ()) -> int:
    db = db_mod.connect(url)
    try:
        return int(db.scalar(sql, params) or 0)
    finally:
        db.close()


def test_batches_past_twice_the_replay_window_are_deleted_in_the_background(
    db_url, writer, harness_factory, monkeypatch
):
    _fast_housekeeping(monkeypatch)
    h = harness_factory(db_url, replay_retention_s=1.0)
    h.start(k=2)
    for i in range(3):
        writer.group(f"g{i}", 2)
        assert len(groups_of(h.poll(request_id=f"r{i}"))) == 1
    batches = "SELECT COUNT(*) FROM rollout_buffer_batches"
    assert count(db_url, batches) >= 1
    wait_until(lambda: count(db_url, batches) == 0, 15, "old batches deleted")
    writer.group("fresh", 2)
    assert len(groups_of(h.poll(request_id="r-fresh"))) == 1
    assert count(db_url, batches) == 1, "a batch inside its replay window must be kept"


def first_served_second_written(
    url: str, harness_factory: Any, **overrides: Any
) -> tuple[Harness, Writer, dict]:
    """A service whose group "first" was served to request_id r1, with group "second" written."""
    h = harness_factory(url, **overrides)
    h.start(k=2)
    writer = Writer(url)
    writer.group("first", 2)
    first = h.poll(request_id="r1")
    assert list(groups_of(first)) == ["first"]
    writer.group("second", 2)
    return h, writer, first


def test_a_wall_clock_step_forward_neither_expires_nor_deletes_a_fresh_batch(
    lite_url, harness_factory, monkeypatch
):
    """Also suspected in issue 14: a forward step of the wall clock turned a retry into a 410. And
    with housekeeping, the step deleted the batch of a poll answered a second ago: its retry then
    got new groups under the same request_id, and the first batch's groups were lost."""
    monkeypatch.setattr(
        importlib.import_module("rollout_buffer.runtime.loop"), "HOUSEKEEPING_S", 0.0
    )  # every tick
    h, writer, first = first_served_second_written(
        lite_url, harness_factory, replay_retention_s=60.0
    )
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 3600.0)  # NTP steps the clock an hour ahead
    assert h.service.sync() and h.service.sync()  # housekeeping has run with the stepped clock
    assert count(lite_url, "SELECT COUNT(*) FROM rollout_buffer_batches") == 1, (
        "the fresh batch was deleted"
    )
    again = h.poll(request_id="r1")  # the retry of r1, a second later
    assert again["data"]["meta_info"]["replayed"] is True and list(groups_of(again)) == ["first"]
    assert [i["uid"] for i in again["data"]["data"]] == [i["uid"] for i in first["data"]["data"]]
    assert list(groups_of(h.poll(request_id="r2"))) == ["second"]
    writer.close()


def test_an_ended_job_is_purged_and_selecting_it_again_serves_only_new_groups(
    lite_url, harness_factory, monkeypatch, tmp_path
):
    _fast_housekeeping(monkeypatch)
    config = Config.from_env(
        {"ROLLOUT_BUFFER_JOB_RETENTION_SECONDS": "1"},
        db_url=lite_url,
        launcher="none",
        run_dir=str(tmp_path / "logs"),
        ingest_interval_s=0.02,
    )
    h = Harness(config)
    try:
        wa = Writer(lite_url, job="jobA")
        h.start(k=2, job="jobA")
        wa.group("a-served", 2)
        assert len(groups_of(h.poll(request_id="ra"))) == 1
        wa.step(None, "orphan-session", 1)  # a row without group_id: accounted one by one
        wa.group("a-pending", 2, complete=1)  # dropped as job_ended when jobB is selected
        h.settle()
        kept = {
            t: count(
                lite_url, f"SELECT COUNT(*) FROM rollout_buffer_{t} WHERE job_id = ?", ("jobA",)
            )
            for t in ("groups", "rows", "batches")
        }
        assert all(kept.values()), kept
        h.start(k=2, job="jobB")  # jobA ends

        def purged() -> bool:
            return (
                count(
                    lite_url,
                    "SELECT COUNT(*) FROM rollout_buffer_jobs WHERE job_id = ? AND purged_at IS "
                    "NOT "
                    "NULL",
                    ("jobA",),
                )
                == 1
            )

        wait_until(purged, 15, "jobA marked purged")
        left = {
            t: count(
                lite_url, f"SELECT COUNT(*) FROM rollout_buffer_{t} WHERE job_id = ?", ("jobA",)
            )
            for t in ("groups", "rows", "batches")
        }
        assert left == {"groups": 0, "rows": 0, "batches": 0}, left

        h.start(k=2, job="jobA")  # selected again: its old rows are not new groups
        h.settle()
        doc = h.poll()
        assert not groups_of(doc), (
            f"old groups of a purged job were served again: {sorted(groups_of(doc))}"
        )
        wa.group("a-new", 2)
        assert set(groups_of(h.poll())) == {"a-new"}
        wa.close()
    finally:
        h.stop()


def test_indexes_for_the_startup_scans_exist(db_url, harness):
    harness.start(k=2)
    db = db_mod.connect(db_url)
    try:
        if db.backend == "sqlite":
            rows = db.rows(
                "SELECT tbl_name, sql FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL"
            )
        else:
            rows = db.rows(
                "SELECT tablename, indexdef FROM pg_indexes WHERE schemaname = current_schema()"
            )
    finally:
        db.close()
    for table in ("rollout_buffer_groups", "rollout_buffer_rows"):
        assert any(t == table and "notified" in sql for t, sql in rows), (
            f"no index on {table}.notified: {rows}"
        )
    assert any(t == "rollout_buffer_batches" and "created_at" in sql for t, sql in rows), rows


# -- 15: replays are bounded
# ------------------------------------------------------------------------------
def test_replays_share_one_copy_and_are_bounded_in_number(tmp_path):
    url = "sqlite://" + str(tmp_path / "launcher.db")
    make_launcher_db(url)
    srv = Server(url, tmp_path, name="replay")
    socks: list[socket.socket] = []
    try:
        srv.start()
        assert start_rollout(srv.url, "job1", 2).status_code == 200
        w = Writer(url)
        for name, n_groups, size in (("X", 8, 2_000_000), ("Y", 6, 1_000_000), ("Z", 1, 100)):
            with w.db.transaction():
                for g in range(n_groups):
                    one_row_group(w, f"{name}{g}", 2, "x" * size)
            body = poll_until_data(srv.url, name, n_groups)
            if name == "X":
                batch_bytes = len(body)
        w.close()
        assert batch_bytes > 30_000_000

        worker = worker_pid(srv.proc.pid)
        rss_before = vm_rss(worker)
        polls = poll_count(srv.url)
        socks += [slow_reader(srv.port, "X") for _ in range(8)]
        wait_until(lambda: poll_count(srv.url) >= polls + 8, 60, "8 replays of X answered")
        grown = vm_rss(worker) - rss_before
        assert grown < 4 * batch_bytes, (
            f"8 stalled replays of one {batch_bytes / 2**20:.0f} MiB batch grew the worker by "
            f"{grown / 2**20:.0f} MiB"
        )

        socks.append(slow_reader(srv.port, "Y"))
        wait_until(lambda: poll_count(srv.url) >= polls + 9, 60, "the replay of Y answered")
        r = requests.post(srv.url + "/get_rollout_data", json={"request_id": "Z"}, timeout=30)
        assert r.status_code == 429, (r.status_code, r.text[:300])
        assert int(r.headers["Retry-After"]) > 0
        assert "error" in r.json() or "message" in r.json()

        for s in socks:
            s.close()
        socks.clear()

        def replayed_z() -> bool:
            r = requests.post(srv.url + "/get_rollout_data", json={"request_id": "Z"}, timeout=30)
            return r.status_code == 200 and r.json()["data"]["meta_info"]["replayed"] is True

        wait_until(replayed_z, 20, "Z replayed once the stalled replays are gone")
    finally:
        for s in socks:
            s.close()
        srv.stop()


# -- 17: two instances on one host
# ----------------------------------------------------------------------------
def test_an_instance_that_stops_leaves_the_launcher_another_instance_adopted(tmp_path):
    """With the lease (issue 12) the second instance waits as a standby; the first, stopped, hands
    the launcher over to it (a standby on its own host) instead of killing it, and the second adopts
    it."""
    url = "sqlite://" + str(tmp_path / "launcher.db")
    with two_instances(url, tmp_path) as two:
        first, second = two.first, two.second
        pid = two.start_launcher(first)
        w = Writer(url)
        w.group("pending", 2, complete=1)
        wait_until(
            lambda: stats(first.url)["groups"]["pending"] == 1, 10, "first instance reads the group"
        )

        second.start()
        health = lambda: requests.get(second.url + "/health", timeout=5).json()  # noqa: E731
        wait_until(
            lambda: health()["role"] == "standby", 10, "the second instance waits as a standby"
        )
        assert not health()["launcher"]["adopted"] and not health()["aievobox_running"]

        first.stop(signal.SIGTERM)
        assert procfs.alive(pid), (
            "the stopping instance killed the launcher the standby on its host takes over"
        )
        wait_until(
            lambda: health()["role"] == "owner" and health()["launcher"]["adopted"],
            10,
            "the second instance takes the job and the launcher over",
        )
        assert health()["launcher"]["pid"] == pid
        wait_until(
            lambda: stats(second.url)["groups"]["pending"] == 1,
            10,
            "second instance reads the group",
        )

        served_after(second, w)
        w.close()
        s = stats(second.url)
        assert s["groups"]["dropped"].get("launcher_exited", 0) == 0, s["groups"]
        assert s["groups"]["pending"] == 1, s["groups"]
        assert procfs.alive(pid)
        health = requests.get(second.url + "/health", timeout=5).json()
        assert health["aievobox_running"] is True and health["launcher"]["pid"] == pid, health


def served_after(srv: Server, w: Writer) -> None:
    """Two more groups written and served: the server has ticked (and checked its launcher)
    since."""
    for name in ("after1", "after2"):
        w.group(name, 2)
        wait_until(
            lambda name=name: (
                name
                in groups_of(
                    requests.post(srv.url + "/get_rollout_data", json={}, timeout=30).json()
                )
            ),
            20,
            f"{name} served",
        )


# -- 18: /start_rollout just after a restart
# -------------------------------------------------------------------
def test_start_rollout_right_after_a_restart_waits_for_the_resume(tmp_path):
    path = tmp_path / "launcher.db"
    url = "sqlite://" + str(path)
    lock = None
    with two_instances(url, tmp_path) as two:
        try:
            pid = two.start_launcher(two.first)
            two.first.stop(
                signal.SIGKILL
            )  # a crash: the launcher (its own process group) keeps running
            assert procfs.alive(pid)

            # Another connection holds SQLite's lock (exclusive: in WAL mode a plain write lock
            # would
            # not block the resume's reads): the restarted service cannot resume the job yet.
            lock = sqlite3.connect(str(path), isolation_level=None, timeout=10)
            lock.execute("PRAGMA locking_mode=EXCLUSIVE")
            lock.execute("BEGIN EXCLUSIVE")
            two.second.start()
            answer: dict[str, Any] = {}
            done = threading.Event()

            def call() -> None:
                try:
                    answer["r"] = start_rollout(two.second.url, "job1", 2, timeout=60)
                finally:
                    done.set()

            threading.Thread(target=call, daemon=True).start()
            assert not done.wait(2.0), f"answered before the job was resumed: {answer['r'].text}"
            lock.rollback()
            lock.close()  # an exclusive-mode connection releases its lock only when closed
            lock = None
            assert done.wait(30), "/start_rollout did not answer after the resume"
            r = answer["r"]
            deadline = time.monotonic() + 30
            while r.status_code == 503 and time.monotonic() < deadline:
                assert int(r.headers["Retry-After"]) > 0
                time.sleep(int(r.headers["Retry-After"]))  # as a client honouring Retry-After does
                r = start_rollout(two.second.url, "job1", 2)
            assert r.status_code == 200, (r.status_code, r.text)
            body = r.json()
            assert (
                "already running" in body["message"]
                and body["pid"] == pid
                and body["job_session"] == "job1"
            ), body
            assert two.starts() == [str(pid)], "a second launcher was started"
            assert procfs.alive(pid)
        finally:
            if lock is not None:
                lock.close()


def test_a_bootstrap_retried_after_the_adoption_keeps_the_adopted_launcher(pg_url, tmp_path):
    """The first bootstrap adopts the launcher, then fails recording it (its backend is killed while
    it waits on a row lock); the retried bootstrap must not take its own adoption for a dead
    launcher."""
    import psycopg

    with (
        two_instances(pg_url, tmp_path) as two,
        psycopg.connect(pg_url, autocommit=True) as holder,
        psycopg.connect(pg_url, autocommit=True) as monitor,
    ):
        pid = two.start_launcher(two.first)
        w = Writer(pg_url)
        w.group("pending", 2, complete=1)
        wait_until(lambda: stats(two.first.url)["groups"]["pending"] == 1, 10, "the group read")
        two.first.stop(signal.SIGKILL)
        assert procfs.alive(pid)

        holder.execute("BEGIN")
        holder.execute("SELECT * FROM rollout_buffer_jobs WHERE job_id = 'job1' FOR UPDATE")
        two.second.start()

        def blocked_update() -> int | None:
            # (not from the holder: a transaction sees pg_stat_activity as of its first look)
            row = monitor.execute(
                "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE "
                "'UPDATE rollout_buffer_jobs SET launcher_pid%'"
            ).fetchone()
            return row[0] if row else None

        backend = wait_until(blocked_update, 15, "the bootstrap recording the adopted launcher")
        monitor.execute("SELECT pg_terminate_backend(%s)", (backend,))
        holder.execute("ROLLBACK")

        served_after(two.second, w)
        w.close()
        state = monitor.execute(
            "SELECT launcher_state FROM rollout_buffer_jobs WHERE job_id = 'job1'"
        ).fetchone()
        assert state[0] == "running", f"the running launcher was recorded as {state[0]!r}"
        assert "is gone" not in two.second.log()
        s = stats(two.second.url)
        assert s["groups"]["dropped"].get("launcher_exited", 0) == 0, s["groups"]
        assert s["groups"]["pending"] == 1, s["groups"]
        assert procfs.alive(pid)


def test_a_replay_being_rebuilt_never_holds_up_fresh_polls(lite_url, harness_factory, monkeypatch):
    """Also suspected in issue 14: a client replaying one request_id in a loop rebuilt up to 256 MiB
    each time under the serving lock. A rebuild is held in the middle here: a fresh poll must not
    wait for it, and the replay is the same batch once it is let go."""
    replay_mod = importlib.import_module("rollout_buffer.serving.replay")
    h, w, first = first_served_second_written(lite_url, harness_factory)
    h.settle()

    entered, release = threading.Event(), threading.Event()
    real_fetch = replay_mod.fetch_rows

    def held_fetch(*a: Any, **kw: Any) -> Any:
        entered.set()
        assert release.wait(30)
        return real_fetch(*a, **kw)

    monkeypatch.setattr(replay_mod, "fetch_rows", held_fetch)
    answers: list[Any] = []
    th = threading.Thread(
        target=lambda: answers.append(h.client.post("/get_rollout_data", json={"request_id": "r1"}))
    )
    th.start()
    try:
        assert entered.wait(10), "the replay did not start rebuilding"
        started = time.monotonic()
        fresh = h.client.post("/get_rollout_data", json={"request_id": "r2"})
        assert fresh.status_code == 200 and list(groups_of(fresh.get_json())) == ["second"]
        assert time.monotonic() - started < 2.0, "a fresh poll waited for a replay being rebuilt"
    finally:
        release.set()
        th.join(30)
    assert answers and answers[0].status_code == 200
    assert answers[0].get_json()["data"]["data"] == first["data"]["data"]
    w.close()
