"""The real gunicorn deployment (STYLE.md §10): one worker enforced, hooks fire, SIGTERM stops the
launcher.

Every test runs a real ``gunicorn`` (or ``python -m rollout_buffer serve``) subprocess in its own
session on a free port, against a real SQLite file, and talks to it over HTTP.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import requests
from servers import ROOT, free_port, log_tail, server_env
from support import Writer, make_launcher_db, wait_until

from rollout_buffer.launcher import procfs
from rollout_buffer.tools.runner import ServerProcess

pytestmark = pytest.mark.slow

FAKE_LAUNCHER = ROOT / "tests" / "fakes" / "fake_launcher.py"


def gunicorn_argv(*args: str) -> list[str]:
    """The ``gunicorn`` console script of this interpreter (``python -m gunicorn`` if there is
    none)."""
    script = Path(sys.executable).with_name("gunicorn")
    if script.exists():
        return [str(script), *args]
    return [sys.executable, "-m", "gunicorn", *args]


def env_for(db_url: str, tmp_path: Path, port: int, **extra: str) -> dict[str, str]:
    """A scrubbed environment for a server on 127.0.0.1:port (no port or host flags needed)."""
    return server_env(
        db_url,
        tmp_path / "logs",
        launcher=extra.pop("launcher", "none"),
        extra={"BUFFER_SERVER_PORT": str(port), "ROLLOUT_BUFFER_HOST": "127.0.0.1", **extra},
    )


group_members = procfs.group_members
children_of = procfs.children


class Proc:
    """A server subprocess in its own session (rollout_buffer.tools.runner, as every real-server
    test and the demo use), with pytest's failure on a server that does not come up."""

    def __init__(
        self, argv: Sequence[str], cwd: Path, env: dict[str, str], port: int, log: Path
    ) -> None:
        self.argv = list(argv)
        self.log = log
        self._process = ServerProcess(port, env, log, cwd=cwd, argv=argv)
        self.url = self._process.url
        self._process.spawn()
        self.proc = self._process.proc

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_healthy(self, timeout: float = 30.0) -> None:
        problem = self._process.wait_healthy(timeout)
        if problem is not None:
            self.stop()
            pytest.fail(
                f"{self.argv} did not serve /health on {self.url}: {problem}\n--- {self.log} ---\n"
                f"{log_tail(self.log)}"
            )

    def stop(self) -> None:
        self._process.stop(wait_s=20)


@contextlib.contextmanager
def running(
    argv: Sequence[str], cwd: Path, env: dict[str, str], port: int, log: Path
) -> Iterator[Proc]:
    p = Proc(argv, cwd, env, port, log)
    try:
        p.wait_healthy()
        yield p
    finally:
        p.stop()


def start_rollout(url: str, k: int, job: str) -> dict:
    r = requests.post(
        url + "/start_rollout", json={"num_repeat_per_sample": k, "job_session": job}, timeout=30
    )
    assert r.status_code == 200, r.text
    return r.json()


def poll_groups(url: str, want: set[str], timeout: float = 20.0, **body) -> dict[str, list[dict]]:
    """Poll until every group of ``want`` was served; return all items by group (each group
    once)."""
    got: dict[str, list[dict]] = {}
    deadline = time.monotonic() + timeout
    while not want <= set(got):
        assert time.monotonic() < deadline, f"groups not served in time: {sorted(want - set(got))}"
        r = requests.post(url + "/get_rollout_data", json=body, timeout=30)
        assert r.status_code == 200, r.text
        doc = r.json()
        if not doc["success"]:
            time.sleep(0.05)
            continue
        batch: dict[str, list[dict]] = {}
        for item in doc["data"]["data"]:
            batch.setdefault(item["instance_id"], []).append(item)
        assert not set(batch) & set(got), f"served twice: {sorted(set(batch) & set(got))}"
        got.update(batch)
    return got


def assert_serves_a_poll(url: str, db_url: str) -> None:
    start_rollout(url, 2, "job1")
    w = Writer(db_url)
    try:
        w.group("g1", 2, steps=3)
    finally:
        w.close()
    got = poll_groups(url, {"g1"})
    assert len(got["g1"]) == 6
    assert {i["extra_info"]["session_id"] for i in got["g1"]} and all(
        len(i["uid"]) == 36 for i in got["g1"]
    )


# -- how operators start it
# --------------------------------------------------------------------------------


def test_plain_gunicorn_from_the_repository_root_serves(tmp_path):
    # No flags at all: gunicorn reads ./gunicorn.conf.py from the repository root.
    db_url = "sqlite://" + str(tmp_path / "launcher.db")
    make_launcher_db(db_url)
    port = free_port()
    env = env_for(db_url, tmp_path, port)
    with running(gunicorn_argv("wsgi:app"), ROOT, env, port, tmp_path / "gunicorn.log") as srv:
        health = requests.get(srv.url + "/health", timeout=5).json()
        assert health["status"] == "healthy" and health["aievobox_running"] is False
        assert_serves_a_poll(srv.url, db_url)
        # exactly one worker, started by the post_worker_init hook (the service answered above)
        assert len(children_of(srv.pid)) == 1, children_of(srv.pid)
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(30) == 0
    text = (tmp_path / "gunicorn.log").read_text()
    assert "Using worker: rollout_buffer.web.gunicorn_worker.HeadFirstWorker" in text
    assert "rollout-buffer service started" in text and "rollout-buffer service stopped" in text


def test_a_running_server_opens_no_control_socket(tmp_path):
    # gunicorn 27 opens $XDG_RUNTIME_DIR/gunicorn.ctl (else ~/.gunicorn/gunicorn.ctl) by default:
    # one path shared by every gunicorn of the user, through which the worker count can change.
    db_url = "sqlite://" + str(tmp_path / "launcher.db")
    make_launcher_db(db_url)
    home, runtime = tmp_path / "home", tmp_path / "runtime"
    home.mkdir()
    runtime.mkdir()
    port = free_port()
    env = {**env_for(db_url, tmp_path, port), "HOME": str(home), "XDG_RUNTIME_DIR": str(runtime)}
    for argv, cwd in (
        (gunicorn_argv("wsgi:app"), ROOT),
        ([sys.executable, "-m", "rollout_buffer", "serve"], tmp_path),
    ):
        with running(argv, cwd, env, port, tmp_path / "gunicorn.log") as srv:
            assert_serves_a_poll(srv.url, db_url)
            created = sorted(str(p) for p in (*home.rglob("*"), *runtime.rglob("*")))
            assert created == [], f"{argv} created {created}"
        db_url = "sqlite://" + str(tmp_path / "launcher2.db")
        make_launcher_db(db_url)
        env["AIEVOBOX_DB_URL"] = db_url


@pytest.mark.parametrize("how", ["gunicorn", "serve"])
def test_a_removed_setting_is_warned_of_once_and_ignored(tmp_path, how):
    # the master reads the settings, then its worker, and `serve` before both: one warning
    db_url = "sqlite://" + str(tmp_path / "launcher.db")
    make_launcher_db(db_url)
    port = free_port()
    env = env_for(db_url, tmp_path, port, ROLLOUT_BUFFER_MAX_GROUP_BYTES="2048")
    argv, cwd = (
        (gunicorn_argv("wsgi:app"), ROOT)
        if how == "gunicorn"
        else ([sys.executable, "-m", "rollout_buffer", "serve"], tmp_path)
    )
    log = tmp_path / "server.log"
    with running(argv, cwd, env, port, log) as srv:
        assert_serves_a_poll(srv.url, db_url)
    warnings = [line for line in log.read_text().splitlines() if "no longer read" in line]
    assert len(warnings) == 1, warnings
    assert "ROLLOUT_BUFFER_MAX_GROUP_BYTES" in warnings[0]
    assert "the constant MAX_GROUP_BYTES" in warnings[0]


def test_listening_beyond_loopback_without_a_token_is_warned_of(tmp_path):
    db_url = "sqlite://" + str(tmp_path / "launcher.db")
    make_launcher_db(db_url)
    port = free_port()
    for host, warned in (("127.0.0.1", False), ("0.0.0.0", True)):
        env = env_for(db_url, tmp_path, port, ROLLOUT_BUFFER_HOST=host)
        log = tmp_path / f"server-{host}.log"
        with running(gunicorn_argv("wsgi:app"), ROOT, env, port, log):
            pass
        text = log.read_text()
        assert ("without ROLLOUT_BUFFER_TOKEN" in text) is warned, text
        assert (f"rollout-buffer listens on {host}:{port}" in text) is warned


def test_with_one_thread_a_long_poll_answers_at_once_and_health_still_answers(tmp_path):
    # long-polls may hold half of the threads: with one thread, none waits
    db_url = "sqlite://" + str(tmp_path / "launcher.db")
    make_launcher_db(db_url)
    port = free_port()
    env = env_for(db_url, tmp_path, port, ROLLOUT_BUFFER_THREADS="1")
    with running(gunicorn_argv("wsgi:app"), ROOT, env, port, tmp_path / "g.log") as srv:
        start_rollout(srv.url, 2, "job1")
        t0 = time.monotonic()
        r = requests.post(srv.url + "/get_rollout_data", json={"wait_s": 20}, timeout=30)
        assert r.status_code == 200 and r.json()["success"] is False, r.text
        assert time.monotonic() - t0 < 5.0  # answered at once, not after wait_s
        assert requests.get(srv.url + "/health", timeout=5).status_code == 200


def test_rollout_buffer_serve_runs_gunicorn_with_our_settings(tmp_path):
    db_url = "sqlite://" + str(tmp_path / "launcher.db")
    make_launcher_db(db_url)
    port = free_port()
    env = env_for(db_url, tmp_path, port)
    workdir = tmp_path / "elsewhere"  # not the repository root: no ./gunicorn.conf.py to lean on
    workdir.mkdir()
    argv = [sys.executable, "-m", "rollout_buffer", "serve"]
    with running(argv, workdir, env, port, tmp_path / "serve.log") as srv:
        assert_serves_a_poll(srv.url, db_url)
        assert len(children_of(srv.pid)) == 1
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(30) == 0
    assert (
        "Using worker: rollout_buffer.web.gunicorn_worker.HeadFirstWorker"
        in (tmp_path / "serve.log").read_text()
    )


# -- refusing settings that would split the state
# -----------------------------------------------------------


@pytest.mark.parametrize(
    "how,extra_env,args,expect",
    [
        ("WEB_CONCURRENCY", {"WEB_CONCURRENCY": "2"}, [], "WEB_CONCURRENCY=2"),
        ("GUNICORN_CMD_ARGS", {"GUNICORN_CMD_ARGS": "--workers 2"}, [], "workers=2"),
        ("-w", {}, ["-w", "2"], "workers=2"),
        ("--preload", {}, ["--preload"], "preload"),
        ("serve+WEB_CONCURRENCY", {"WEB_CONCURRENCY": "3"}, None, "WEB_CONCURRENCY=3"),
    ],
)
def test_more_than_one_worker_or_preload_is_refused(tmp_path, how, extra_env, args, expect):
    db_url = "sqlite://" + str(tmp_path / "launcher.db")
    make_launcher_db(db_url)
    port = free_port()
    env = env_for(db_url, tmp_path, port, **extra_env)
    if args is None:
        argv, cwd = [sys.executable, "-m", "rollout_buffer", "serve"], tmp_path
    else:
        argv, cwd = gunicorn_argv(*args, "wsgi:app"), ROOT
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{how}: the server was not refused; it kept running:\n{out.decode()[-3000:]}")
    text = out.decode(errors="replace")
    assert proc.returncode != 0, text
    assert "exactly 1" in text and expect in text, text
    assert "Booting worker" not in text, text
    with pytest.raises(requests.ConnectionError):
        requests.get(f"http://127.0.0.1:{port}/health", timeout=2)


# -- shutdown
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["hang", "ignore-term", "spawn-child"])
def test_sigterm_to_the_master_stops_the_launcher_group_and_exits_0(tmp_path, mode):
    db_url = "sqlite://" + str(tmp_path / "launcher.db")
    make_launcher_db(db_url)
    port = free_port()
    marker = tmp_path / "launcher.starts"
    child_pid_file = tmp_path / "grandchild.pid"
    cmd = shlex.join(
        [
            sys.executable,
            str(FAKE_LAUNCHER),
            "--mode",
            mode,
            "--marker",
            str(marker),
            "--child-pid-file",
            str(child_pid_file),
        ]
    )
    env = env_for(
        db_url,
        tmp_path,
        port,
        ROLLOUT_BUFFER_LAUNCHER_CMD=cmd,
        ROLLOUT_BUFFER_STOP_GRACE_SECONDS="1",
    )
    log = tmp_path / "gunicorn.log"
    with running(gunicorn_argv("wsgi:app"), ROOT, env, port, log) as srv:
        body = start_rollout(srv.url, 4, "job1")
        pid = body["pid"]
        assert isinstance(pid, int) and pid > 0, body
        # the fake marks its start after installing its TERM handling
        wait_until(
            lambda: marker.exists() and marker.read_text().strip() == str(pid),
            10,
            lambda: f"launcher start\n--- {log} ---\n{log_tail(log)}",
        )
        if mode == "spawn-child":
            wait_until(
                child_pid_file.exists,
                10,
                lambda: f"grandchild start\n--- {log} ---\n{log_tail(log)}",
            )
        health = requests.get(srv.url + "/health", timeout=5).json()
        assert health["aievobox_running"] is True and health["launcher"]["pid"] == pid
        st = procfs.stat(pid)
        assert st is not None
        pgid = st.pgrp
        assert pgid == pid, "the launcher leads its own process group"
        assert pgid != os.getpgid(srv.pid), "the launcher is not in gunicorn's group"
        members = group_members(pgid)
        assert pid in members and (mode != "spawn-child" or len(members) == 2), members

        started = time.monotonic()
        os.kill(srv.pid, signal.SIGTERM)  # the master only, as an operator or systemd would
        code = srv.proc.wait(30)
        elapsed = time.monotonic() - started
    assert code == 0, log_tail(log)
    assert elapsed < 15, f"shutdown took {elapsed:.1f} s"
    wait_until(lambda: not group_members(pgid), 5, f"launcher group {pgid} gone")
    text = log.read_text()
    assert "rollout-buffer service stopped" in text, text[-3000:]


def test_a_worker_that_crashes_leaves_the_launcher_to_the_next_worker(tmp_path):
    """gunicorn aborts a worker that stops answering it (its timeout); the worker's exit used to
    stop the launcher as a shutdown would, while a kill -9 of the worker left it running."""
    db_url = "sqlite://" + str(tmp_path / "launcher.db")
    make_launcher_db(db_url)
    port = free_port()
    cmd = shlex.join([sys.executable, str(FAKE_LAUNCHER), "--mode", "hang"])
    env = env_for(db_url, tmp_path, port, ROLLOUT_BUFFER_LAUNCHER_CMD=cmd)
    log = tmp_path / "gunicorn.log"
    with running(gunicorn_argv("wsgi:app"), ROOT, env, port, log) as srv:
        pid = start_rollout(srv.url, 2, "job1")["pid"]
        worker = [p for p in group_members(srv.pid) if p != srv.pid]
        assert len(worker) == 1, worker
        os.kill(worker[0], signal.SIGABRT)  # what gunicorn sends a worker past its timeout

        def adopted() -> bool:
            with contextlib.suppress(requests.RequestException):
                launcher = requests.get(srv.url + "/health", timeout=5).json()["launcher"]
                return launcher["pid"] == pid and launcher["running"] and launcher["adopted"]
            return False

        wait_until(
            adopted,
            20,
            lambda: f"the next worker adopted the launcher\n--- {log} ---\n{log_tail(log)}",
        )
        st = procfs.stat(pid)
        assert st is not None and st.alive, "the launcher was stopped with the crashed worker"
        os.kill(srv.pid, signal.SIGTERM)  # a real shutdown still stops it
        assert srv.proc.wait(30) == 0, log_tail(log)
    wait_until(lambda: not group_members(pid), 10, "the launcher stopped at shutdown")


# -- serving over real HTTP while an external writer adds rows
# ------------------------------------------------


def test_serves_groups_across_http_while_an_external_writer_writes(tmp_path):
    db_url = "sqlite://" + str(tmp_path / "launcher.db")
    make_launcher_db(db_url)
    port = free_port()
    env = env_for(db_url, tmp_path, port)
    k, n_groups = 3, 24
    with running(gunicorn_argv("wsgi:app"), ROOT, env, port, tmp_path / "gunicorn.log") as srv:
        start_rollout(srv.url, k, "job1")
        errors: list[BaseException] = []

        def write() -> None:
            w = Writer(db_url)
            try:
                for i in range(n_groups):
                    w.group(f"g{i:02d}", k, steps=2 + i % 3)
                    if i % 8 == 0:  # never completes: must never be served
                        w.group(f"partial{i:02d}", k, steps=1, complete=k - 1)
                    time.sleep(0.02)
            except BaseException as exc:
                errors.append(exc)
            finally:
                w.close()

        t = threading.Thread(target=write, name="external-writer")
        t.start()
        try:
            want = {f"g{i:02d}" for i in range(n_groups)}
            got = poll_groups(srv.url, want, timeout=60, max_groups=4, request_id=None)
        finally:
            t.join(30)
        assert not errors, errors
        assert set(got) == want, sorted(set(got) - want)
        for gid, items in got.items():
            steps = 2 + int(gid[1:]) % 3
            assert len(items) == k * steps, (gid, len(items))
            assert len({i["extra_info"]["session_id"] for i in items}) == k
        pks = [i["extra_info"]["step_pk"] for items in got.values() for i in items]
        assert len(pks) == len(set(pks))
        r = requests.post(
            srv.url + "/get_rollout_data", json={"request_id": uuid.uuid4().hex}, timeout=30
        )
        assert r.status_code == 200 and r.json()["success"] is False
        stats = requests.get(srv.url + "/stats", timeout=10).json()
        rows = stats["rows"]
        assert (
            rows["read"]
            == rows["served"] + rows["dropped_total"] + rows["rejected_total"] + rows["pending"]
        )
        assert stats["groups"]["served"] == n_groups
