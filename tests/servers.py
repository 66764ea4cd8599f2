"""Real rollout-buffer servers for tests: ``python -m rollout_buffer serve`` (gunicorn) as a
subprocess.

:func:`serve` is a context manager: it picks a free port (or takes one, to restart a server on the
same port), starts the server in its own session with a scrubbed environment, polls ``/health``
until it answers (``pytest.fail`` with the log tail when it does not), and on exit stops the whole
process group: SIGTERM, wait, SIGKILL. :class:`Server` can also be stopped and started by hand.

    with serve(db_url, tmp_path) as srv:
        requests.get(srv.url + "/health")

:func:`kill9` takes a server down as a crash does. :class:`Trainer` polls a real server over HTTP
as a retry-safe trainer does (one request_id per logical poll, reused for its retries) and keeps
what it got; :func:`assert_exactly_once` and :func:`assert_stats_balance` check it against the
database. Nothing here mocks the service.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import requests
import urllib3
from support import groups_of, wait_until

from rollout_buffer.launcher import procfs
from rollout_buffer.storage.db import connect
from rollout_buffer.tools.runner import ServerProcess, clean_env, free_port, log_tail

ROOT = Path(__file__).resolve().parent.parent
__all__ = [
    "ROOT",
    "Server",
    "Trainer",
    "assert_exactly_once",
    "assert_stats_balance",
    "complete_groups",
    "free_port",
    "init_db",
    "kill9",
    "log_tail",
    "serve",
    "server_env",
    "trainable_rows",
    "uids",
]


def server_env(
    db_url: str,
    run_dir: str | os.PathLike,
    *,
    launcher: str = "none",
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """os.environ without any service setting, plus the database, log dir, launcher and
    ``extra``."""
    env = clean_env(
        {
            "AIEVOBOX_DB_URL": db_url,
            "AIEVOBOX_RUN_DIR": str(run_dir),
            "ROLLOUT_BUFFER_LAUNCHER": launcher,
            "ROLLOUT_BUFFER_STOP_GRACE_SECONDS": "5",
            "ROLLOUT_BUFFER_INGEST_INTERVAL_SECONDS": "0.05",
        },
        package_parent=str(ROOT),
    )
    env.update(extra or {})
    return env


class Server:
    """One ``rollout-buffer serve`` subprocess (gunicorn master + worker) in its own process
    group."""

    def __init__(
        self,
        db_url: str,
        workdir: str | os.PathLike,
        *,
        port: int | None = None,
        launcher: str = "none",
        env: Mapping[str, str] | None = None,
        name: str = "server",
    ) -> None:
        self.db_url = db_url
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.launcher = launcher
        self.extra_env = dict(env or {})
        self.name = name
        self.log_path = self.workdir / f"{name}.log"
        self.starts = 0
        self._process: ServerProcess | None = None

    @property
    def proc(self) -> subprocess.Popen | None:
        """The master process while it runs (None once stopped)."""
        return None if self._process is None else self._process.proc

    def start(self, timeout: float = 30.0) -> Server:
        """Start the server and wait until GET /health answers 200 (pytest.fail otherwise)."""
        assert self._process is None, "already started"
        env = server_env(
            self.db_url, self.workdir / "logs", launcher=self.launcher, extra=self.extra_env
        )
        self.starts += 1
        self._process = ServerProcess(self.port, env, self.log_path, cwd=self.workdir)
        self._process.spawn(f" #{self.starts}")
        problem = self._process.wait_healthy(timeout)
        if problem is not None:
            self.stop()
            pytest.fail(
                f"rollout-buffer server did not start on {self.url}: {problem}\n"
                f"--- {self.log_path} ---\n{log_tail(self.log_path)}"
            )
        return self

    def wait_healthy(self, timeout: float) -> str | None:
        """None once GET /health answers 200, else why it did not within ``timeout``."""
        assert self._process is not None
        return self._process.wait_healthy(timeout)

    def stop(self, sig: int = signal.SIGTERM, wait_s: float = 15.0) -> int | None:
        """Signal the process group (SIGTERM by default), wait, then SIGKILL what is left."""
        process, self._process = self._process, None
        if process is None:
            return None
        close_idle_connections_of_closed_sessions(self.port)
        return process.stop(sig, wait_s)

    def log(self) -> str:
        """The whole server log."""
        return log_tail(self.log_path, lines=10**6)


def close_idle_connections_of_closed_sessions(port: int) -> None:
    """Close the idle connections to ``port`` that no open requests session can use again.

    A stopping server keeps an idle kept-alive connection up to 2 s (gunicorn's
    STOP_KEEPALIVE_LINGER). urllib3 (2.8 here) does not close a pool when its session closes:
    the pool, and its idle connection, live on as long as any answer refers to it, so a test that
    keeps the answer of a one-off ``requests.post`` made every stop wait those 2 s. A pool that no
    live pool manager holds is never used again, so closing it changes nothing a client does; the
    pools of open sessions (a Trainer's) are left as they are.
    """
    gc.collect()
    objects = gc.get_objects()
    held = {
        id(manager.pools.get(key))
        for manager in objects
        if isinstance(manager, urllib3.PoolManager)
        for key in manager.pools.keys()  # noqa: SIM118 (its __iter__ refuses to iterate)
    }
    for pool in objects:
        if (
            isinstance(pool, urllib3.HTTPConnectionPool)
            and pool.port == port
            and id(pool) not in held
        ):
            pool.close()


@contextlib.contextmanager
def serve(db_url: str, workdir: str | os.PathLike, **kw) -> Iterator[Server]:
    """A started :class:`Server`, always stopped on exit (see the module docstring)."""
    srv = Server(db_url, workdir, **kw)
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()


def init_db(db_url: str) -> None:
    """Create the launcher's (and the buffer's) tables: ``python -m rollout_buffer init-db``."""
    subprocess.run(
        [sys.executable, "-m", "rollout_buffer", "init-db", "--db", db_url],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=60,
    )


def kill9(srv: Server) -> None:
    """kill -9 the whole process group (gunicorn master and worker) and wait until it is gone."""
    assert srv.proc is not None
    pgid = srv.proc.pid
    srv.stop(signal.SIGKILL)
    wait_until(lambda: not procfs.group_members(pgid), 5, "every server process gone")


# -- a trainer over HTTP, and what it must have received
# -----------------------------------------------------


def complete_groups(url: str, job: str, k: int = 4) -> dict[str, int]:
    """{group_id: rows of its completed sessions} for every group with k completed sessions."""
    db = connect(url)
    try:
        rows = db.rows(
            "SELECT group_id, session_id, is_session_completed FROM session_steps "
            "WHERE job_id = ? AND is_trainable = 1",
            (job,),
        )
    finally:
        db.close()
    done = {(g, s) for g, s, c in rows if c}
    per_group: dict[str, int] = {}
    sessions: dict[str, set[str]] = {}
    for g, s, _c in rows:
        if (g, s) in done:
            per_group[g] = per_group.get(g, 0) + 1
            sessions.setdefault(g, set()).add(s)
    return {g: n for g, n in per_group.items() if len(sessions[g]) >= k}


def trainable_rows(url: str, job: str) -> int:
    db = connect(url)
    try:
        return int(
            db.scalar(
                "SELECT COUNT(*) FROM session_steps WHERE job_id = ? AND is_trainable = 1", (job,)
            )
        )
    finally:
        db.close()


class Trainer:
    """An HTTP trainer: one fresh request_id per logical poll, reused only for its retries.

    It keeps every group it was given with the items, and checks that a replay is identical to
    what it already has.
    """

    def __init__(self, srv: Server) -> None:
        self.srv = srv
        self.session = requests.Session()
        self.served: dict[str, list[list[dict]]] = {}
        self.by_request: dict[str, dict] = {}
        self.retries = 0
        self.statuses: list[int] = []

    def post(self, body: dict[str, Any]) -> requests.Response:
        return self.session.post(self.srv.url + "/get_rollout_data", json=body, timeout=60)

    def poll(
        self, max_groups: int | None = None, request_id: str | None = None, retry_for: float = 30.0
    ) -> dict:
        """One logical poll; retried with the same request_id on 503 and connection errors."""
        rid = request_id or uuid.uuid4().hex
        body: dict[str, Any] = {"request_id": rid}
        if max_groups is not None:
            body["max_groups"] = max_groups
        deadline = time.monotonic() + retry_for
        while True:
            try:
                r = self.post(body)
                self.statuses.append(r.status_code)
                if r.status_code == 200:
                    doc = r.json()
                    break
                assert r.status_code == 503, r.text
                err = r.json()
                assert err["ok"] is False and err["status"] == 503 and err["error"], err
            except requests.ConnectionError:
                self.session.close()
                self.session = requests.Session()
            assert time.monotonic() < deadline, f"poll {rid} kept failing for {retry_for:g} s"
            self.retries += 1
            time.sleep(0.1)
        self.record(rid, doc)
        return doc

    def record(self, rid: str, doc: dict) -> None:
        if not doc["success"]:
            assert rid not in self.by_request, "an id bound to a batch answered empty"
            return
        meta = doc["data"]["meta_info"]
        assert meta["request_id"] == rid
        if rid in self.by_request:  # we had it already: the replay must be identical
            assert meta["replayed"] is True
            assert uids(doc) == uids(self.by_request[rid])
            return
        self.by_request[rid] = doc
        for gid, items in groups_of(doc).items():
            self.served.setdefault(gid, []).append(items)

    def drain(
        self,
        want: set[str],
        max_groups: int | None = None,
        timeout: float = 30.0,
        pause: float = 0.0,
    ) -> None:
        """Poll until every group of ``want`` arrived, then once more (nothing else may come)."""
        deadline = time.monotonic() + timeout
        while not want <= set(self.served):
            assert time.monotonic() < deadline, f"never served: {sorted(want - set(self.served))}"
            if not self.poll(max_groups)["success"]:
                time.sleep(0.05)
            elif pause:
                time.sleep(pause)
        # every row written has been read (so nothing else can become ready), then nothing more
        # comes
        wait_until(
            lambda: self.stats().get("lag_rows") == 0, 10, "the service caught up with the rows"
        )
        assert self.poll()["success"] is False, "served more than expected"

    def stats(self) -> dict:
        r = self.session.get(self.srv.url + "/stats", timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    def start_rollout(self, job: str = "job1", k: int = 4) -> dict:
        r = self.session.post(
            self.srv.url + "/start_rollout",
            json={"num_repeat_per_sample": k, "job_session": job},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        return r.json()


def uids(doc: dict) -> list[str]:
    return [i["uid"] for i in doc["data"]["data"]]


def assert_exactly_once(trainer: Trainer, expected: dict[str, int]) -> None:
    """Every expected group delivered once, whole; nothing else; no row twice."""
    twice = {g: len(v) for g, v in trainer.served.items() if len(v) != 1}
    assert not twice, f"groups served more than once: {twice}"
    assert set(trainer.served) == set(expected), (
        f"missing {sorted(set(expected) - set(trainer.served))}, extra "
        f"{sorted(set(trainer.served) - set(expected))}"
    )
    sizes = {g: len(v[0]) for g, v in trainer.served.items()}
    assert sizes == expected
    pks = [i["extra_info"]["step_pk"] for v in trainer.served.values() for i in v[0]]
    assert len(pks) == len(set(pks)), "a row was served twice"
    all_uids = [u for doc in trainer.by_request.values() for u in uids(doc)]
    assert len(all_uids) == len(set(all_uids))


def assert_stats_balance(trainer: Trainer, db_url: str, job: str = "job1") -> dict:
    """/stats identity holds and every trainable row of the job was read exactly once."""
    total = trainable_rows(db_url, job)

    def settled() -> dict | None:
        s = trainer.stats()
        return s if s["job_session"] == job and s["rows"]["read"] >= total else None

    s = wait_until(settled, 15, "every row read")
    r = s["rows"]
    assert r["read"] == total, (r, total)
    assert r["read"] == r["served"] + r["dropped_total"] + r["rejected_total"] + r["pending"], r
    assert s["accounting_balanced"] is True
    return s
