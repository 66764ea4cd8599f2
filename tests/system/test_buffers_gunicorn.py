"""Buffers on one state database (issue 20, items 1 and 5), with real gunicorn servers on loopback.

- an unnamed instance next to a live owner of the database's unnamed buffer exits non-zero, naming
  the owner and ROLLOUT_BUFFER_NAME; of two unnamed instances started at once exactly one runs; a
  restart after the owner stopped is not refused;
- two buffers with different names on one database are independent: each owns its own job, each
  trainer gets only its job's groups, and a /start_rollout for the other buffer's job is a 409
  naming that buffer that changes nothing;
- SQLite: one database file reached by two paths (a symlink to it, a symlink to its directory, a
  bind mount of its directory in another mount namespace) has one owner.

Every wait is on an observable condition, bounded.
"""

from __future__ import annotations

import contextlib
import shlex
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from servers import Server, free_port, log_tail, server_env
from support import Writer, make_launcher_db, wait_until

from rollout_buffer.client import BufferClient, groups_of
from rollout_buffer.launcher import procfs
from rollout_buffer.tools.runner import ServerProcess, serve_argv

pytestmark = pytest.mark.slow

LEASE_S = 3.0
K = 2
REFUSED_WITHIN_S = 40.0  # an unnamed second instance must have exited by then


def named(url: str, tmp_path: Path, name: str, buffer: str | None) -> Server:
    """A server advertising its own URL with a short lease, in buffer ``buffer`` (None: unnamed)."""
    port = free_port()
    env = {
        "ROLLOUT_BUFFER_ADVERTISE_URL": f"http://127.0.0.1:{port}",
        "ROLLOUT_BUFFER_LEASE_SECONDS": str(LEASE_S),
    }
    if buffer is not None:
        env["ROLLOUT_BUFFER_NAME"] = buffer
    return Server(url, tmp_path / name, port=port, env=env, name=name)


def health(url: str) -> dict[str, Any]:
    try:
        return requests.get(url + "/health", timeout=5).json()
    except (requests.RequestException, ValueError):
        return {}


@contextlib.contextmanager
def stopped_at_end(*servers: Server | ServerProcess) -> Iterator[None]:
    try:
        yield
    finally:
        for srv in servers:
            srv.stop()


def exit_code(process: ServerProcess, within_s: float) -> int | None:
    """The exit code of a server that should exit by itself, or None if it still runs."""
    assert process.proc is not None
    try:
        return process.proc.wait(within_s)
    except subprocess.TimeoutExpired:
        return None


def unnamed_process(url: str, workdir: Path, name: str) -> ServerProcess:
    workdir.mkdir(parents=True, exist_ok=True)
    env = server_env(url, workdir / "logs", extra={"ROLLOUT_BUFFER_LEASE_SECONDS": str(LEASE_S)})
    process = ServerProcess(free_port(), env, workdir / f"{name}.log", cwd=workdir)
    process.spawn()
    return process


# -- an unnamed second instance
# ----------------------------------------------------------------------------
def test_an_unnamed_instance_next_to_a_live_owner_refuses_to_start(db_url, tmp_path):
    """Without ROLLOUT_BUFFER_NAME a second service on the database would silently become the
    first one's standby (and its trainer would get the first job's groups): it must exit non-zero,
    saying who owns the buffer and how to name buffers. Once the owner has stopped, an unnamed
    instance starts again."""
    first = named(db_url, tmp_path, "first", None)
    with stopped_at_end(first):
        first.start()
        BufferClient(first.url).start_rollout(num_repeat_per_sample=K, job_session="job-first")
        owner = health(first.url)
        assert owner["role"] == "owner" and owner.get("buffer", "") == ""
        second = unnamed_process(db_url, tmp_path / "second", "second")
        with stopped_at_end(second):
            code = exit_code(second, REFUSED_WITHIN_S)
            log = log_tail(second.log_path, 200)
        assert code not in (None, 0), f"the second unnamed instance kept running:\n{log[-3000:]}"
        assert "ROLLOUT_BUFFER_NAME" in log and "job-first" in log, log[-3000:]
        assert f"pid {worker_pid(first)}" in log and f"host {owner['host']}" in log, log[-3000:]
        assert health(first.url)["role"] == "owner"  # the owner never noticed

        assert first.stop() == 0  # a graceful stop gives the lease up
        again = unnamed_process(db_url, tmp_path / "again", "again")
        with stopped_at_end(again):
            assert again.wait_healthy(30) is None, log_tail(again.log_path, 50)
            wait_until(lambda: health(again.url).get("role") == "owner", 15, "the restart owns")


def worker_pid(srv: Server) -> int:
    """The gunicorn worker's pid (the one the lease row names)."""
    assert srv.proc is not None
    children = procfs.children(srv.proc.pid)
    assert len(children) == 1, children
    return children[0]


def test_of_two_unnamed_instances_started_at_once_exactly_one_runs(db_url, tmp_path):
    both = [unnamed_process(db_url, tmp_path / n, n) for n in ("one", "two")]
    with stopped_at_end(*both):
        deadline = time.monotonic() + REFUSED_WITHIN_S
        while time.monotonic() < deadline and all(p.proc.poll() is None for p in both):
            time.sleep(0.2)
        exited = [p for p in both if p.proc.poll() is not None]
        assert len(exited) == 1, (
            "both unnamed instances kept running" if not exited else "both exited"
        )
        runs = next(p for p in both if p not in exited)
        assert exited[0].proc.returncode != 0
        assert "ROLLOUT_BUFFER_NAME" in log_tail(exited[0].log_path, 200)
        assert runs.wait_healthy(30) is None
        wait_until(lambda: health(runs.url).get("role") == "owner", 15, "the other one owns")


# -- two named buffers on one database
# ----------------------------------------------------------------------------
def test_two_named_buffers_on_one_database_never_touch_each_others_job(db_url, tmp_path):
    """Each buffer has its own lease, job, cursor and trainer. Neither trainer may receive the other
    job's groups, and a /start_rollout naming the other buffer's job is a 409 that changes
    nothing (its groups stay pending there, nothing is dropped as job_ended)."""
    alpha = named(db_url, tmp_path, "alpha", "alpha")
    beta = named(db_url, tmp_path, "beta", "beta")
    with stopped_at_end(alpha, beta):
        alpha.start()
        beta.start()
        for srv in (alpha, beta):
            wait_until(lambda s=srv: health(s.url).get("role") == "owner", 15, f"{srv.name} owns")
        ta, tb = BufferClient(alpha.url, timeout=30), BufferClient(beta.url, timeout=30)
        ta.start_rollout(num_repeat_per_sample=K, job_session="job-a")
        tb.start_rollout(num_repeat_per_sample=K, job_session="job-b")
        wa, wb = Writer(db_url, job="job-a"), Writer(db_url, job="job-b")
        try:
            for i in range(6):
                wa.group(f"a{i}", K, steps=1)
                wb.group(f"b{i}", K, steps=1)
            wa.group("a-pending", K, steps=1, complete=1)  # stays pending on alpha
        finally:
            wa.close()
            wb.close()
        got: dict[str, set[str]] = {"alpha": set(), "beta": set()}

        def drained() -> bool:
            for name, client in (("alpha", ta), ("beta", tb)):
                doc = client.get_rollout_data()
                got[name] |= (
                    {gid for gid, _items in groups_of(doc)} if doc.get("success") else set()
                )
            return len(got["alpha"]) >= 6 and len(got["beta"]) >= 6

        wait_until(drained, 30, lambda: f"both trainers drained (got {got})")
        assert got == {"alpha": {f"a{i}" for i in range(6)}, "beta": {f"b{i}" for i in range(6)}}

        r = requests.post(
            beta.url + "/start_rollout",
            json={"num_repeat_per_sample": K, "job_session": "job-a"},
            allow_redirects=False,
            timeout=30,
        )
        assert r.status_code == 409, (r.status_code, r.text)
        body = r.json()
        assert body["ok"] is False and body["buffer"] == "alpha" and "'alpha'" in body["error"]
        # (a-pending was written last: alpha may read it after the trainers drained the rest)
        wait_until(
            lambda: requests.get(alpha.url + "/stats", timeout=10).json()["groups"]["pending"] == 1,
            15,
            "a-pending is pending on alpha",
        )
        stats_a = requests.get(alpha.url + "/stats", timeout=10).json()
        stats_b = requests.get(beta.url + "/stats", timeout=10).json()
        assert health(alpha.url)["job_session"] == "job-a"
        assert health(beta.url)["job_session"] == "job-b"
        assert stats_a["groups"]["pending"] == 1 and stats_a["groups"]["dropped_total"] == 0
        assert stats_b["groups"]["served"] == 6 and stats_b["groups"]["dropped_total"] == 0
        assert health(alpha.url)["owner"]["epoch"] == 1 == health(beta.url)["owner"]["epoch"]


# -- SQLite: one file, two paths
# ----------------------------------------------------------------------------
def _bind_mounted(url: str, tmp_path: Path, port: int) -> list[str] | None:
    """An argv that serves the database through a bind mount of its directory in a private mount
    namespace (only that server sees the mount), or None where this user may not mount."""
    data = Path(url[len("sqlite://") :]).parent
    mount = tmp_path / "mounted"
    mount.mkdir()
    probe = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "mount", "--bind", str(data), str(mount)],
        capture_output=True,
    )
    if probe.returncode != 0:
        return None
    serve = " ".join(shlex.quote(a) for a in serve_argv(port))
    script = f"mount --bind {shlex.quote(str(data))} {shlex.quote(str(mount))} && exec {serve}"
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", script]


@pytest.mark.parametrize("path", ["file_symlink", "dir_symlink", "bind_mount"])
def test_one_sqlite_file_reached_by_two_paths_has_one_owner(tmp_path, path):
    data = tmp_path / "data"
    data.mkdir()
    url = "sqlite://" + str(data / "rl.db")
    make_launcher_db(url)
    argv = None
    if path == "file_symlink":
        (tmp_path / "alias.db").symlink_to(data / "rl.db")
        other = "sqlite://" + str(tmp_path / "alias.db")
    elif path == "dir_symlink":
        (tmp_path / "alias").symlink_to(data)
        other = "sqlite://" + str(tmp_path / "alias" / "rl.db")
    else:
        port = free_port()
        argv = _bind_mounted(url, tmp_path, port)
        if argv is None:
            pytest.skip(
                "this user cannot bind-mount in a private mount namespace (unshare -m): "
                "run the tests as root to include this case"
            )
        other = "sqlite://" + str(tmp_path / "mounted" / "rl.db")
    a = named(url, tmp_path, "a", "one")
    env = {"ROLLOUT_BUFFER_LEASE_SECONDS": str(LEASE_S), "ROLLOUT_BUFFER_NAME": "one"}
    b_dir = tmp_path / "b"
    b_dir.mkdir()
    b = ServerProcess(
        port if argv else free_port(),
        server_env(other, b_dir / "logs", extra=env),
        b_dir / "b.log",
        cwd=b_dir,
        argv=argv,
    )
    with stopped_at_end(a, b):
        a.start()
        wait_until(lambda: health(a.url).get("role") == "owner", 15, "a owns the buffer")
        b.spawn()
        assert b.wait_healthy(30) is None, log_tail(b.log_path, 50)
        wait_until(lambda: health(b.url).get("role") in ("owner", "standby"), 15, "b decided")
        # two owners would take the lease from each other every few hundred ms: watch two leases
        end = time.monotonic() + 2 * LEASE_S
        while time.monotonic() < end:
            ha, hb = health(a.url), health(b.url)
            assert (ha["role"], hb["role"]) == ("owner", "standby"), (ha, hb)
            assert ha["owner"]["epoch"] == 1, ha
            time.sleep(0.2)
