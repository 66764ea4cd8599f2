"""Helpers shared by the tests (imported as ``from support import ...``; fixtures are in
conftest.py).

Postgres (``postgresql://root@127.0.0.1:5432/test`` unless ``ROLLOUT_BUFFER_TEST_PG`` names
another) is probed once with a 2 s timeout. When no server answers, Postgres tests skip with a
reason naming the DSN -- except when ``CI`` is set, where they fail: CI must run them. Each
Postgres test gets a fresh schema, selected through the URL's ``options=-csearch_path``.
"""

from __future__ import annotations

import contextlib
import json
import os
import pty
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from typing import Any

import pytest

from rollout_buffer.core.config import Config
from rollout_buffer.storage import launcher_sql
from rollout_buffer.storage.db import connect
from rollout_buffer.storage.launcher_tables import create_launcher_tables
from rollout_buffer.web.app import create_app

PG_DSN = os.environ.get("ROLLOUT_BUFFER_TEST_PG", "postgresql://root@127.0.0.1:5432/test")


_pg_state: dict[str, Any] = {}


def pg_available() -> str | None:
    """None when Postgres answers, else the reason."""
    if "error" not in _pg_state:
        try:
            import psycopg

            with psycopg.connect(PG_DSN, connect_timeout=2) as conn:
                conn.execute("SELECT 1")
            _pg_state["error"] = None
        except Exception as exc:
            _pg_state["error"] = f"{type(exc).__name__}: {exc}"
    return _pg_state["error"]


def require_pg() -> None:
    err = pg_available()
    if err is not None:
        msg = (
            f"Postgres at {PG_DSN} does not answer ({err}); start one there (apt-get install "
            "postgresql), or name another with ROLLOUT_BUFFER_TEST_PG"
        )
        if os.environ.get("CI"):
            pytest.fail(msg + "; CI must run the Postgres tests")
        pytest.skip(msg)


@contextlib.contextmanager
def fresh_pg_schema() -> Iterator[str]:
    """A new schema on the Postgres server (dropped on exit), as a URL whose search_path selects
    it."""
    import psycopg

    schema = "rbt_" + uuid.uuid4().hex[:16]
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    sep = "&" if "?" in PG_DSN else "?"
    try:
        yield f"{PG_DSN}{sep}options=-csearch_path%3D{schema}"
    finally:
        with psycopg.connect(PG_DSN, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


def make_launcher_db(url: str) -> None:
    """Create the launcher's tables, as the launcher itself would."""
    db = connect(url)
    try:
        create_launcher_tables(db)
    finally:
        db.close()


def now_text(offset_s: float = 0.0) -> str:
    """created_at as the launcher writes it: tz-aware ISO text."""
    return datetime.fromtimestamp(time.time() + offset_s, timezone.utc).strftime(
        "%Y-%m-%d %H:%M:%S.%f+00:00"
    )


class Writer:
    """Inserts rows into session_steps exactly as the launcher does (INSERT only)."""

    def __init__(self, url: str, job: str = "job1") -> None:
        self.url = url
        self.job = job
        self.db = connect(url)

    def step(
        self,
        group: str | None,
        session: str,
        step_id: int,
        *,
        completed: bool = False,
        step_reward: float = 0.0,
        truncated: bool = False,
        trainable: bool = True,
        messages: Any = None,
        response: str | None = None,
        env_state: Any = "default",
        job: str | None = None,
        created_at: str | None = None,
        reward: float = 0.0,
    ) -> int:
        if messages is None:
            messages = [
                {"role": "system", "content": "sys"},
                {"role": "user", "content": f"task {group}"},
            ]
            for i in range(1, step_id):
                messages += [
                    {"role": "assistant", "content": f"a{i}"},
                    {"role": "user", "content": f"o{i}"},
                ]
        if not isinstance(messages, str):
            messages = json.dumps(messages, ensure_ascii=False)
        if env_state == "default":
            env_state = json.dumps({"weight_version": step_id})
        elif env_state is not None and not isinstance(env_state, str):
            env_state = json.dumps(env_state)
        row = (
            session,
            step_id,
            "env",
            "model",
            group,
            job or self.job,
            messages,
            response if response is not None else f"answer {session[:6]} {step_id}",
            step_reward,
            reward,
            env_state,
            1 if completed else 0,
            1 if truncated else 0,
            1 if completed else 0,
            1 if trainable else 0,
            created_at or now_text(),
        )
        self.db.execute(launcher_sql.INSERT_STEP, row)
        return int(self.db.scalar("SELECT MAX(id) FROM session_steps"))

    def schedule(self, group: str, sessions: list[str], job: str | None = None) -> None:
        """job_environments rows, as the launcher writes them when it starts."""
        for sid in sessions:
            self.db.execute(
                launcher_sql.INSERT_ENV,
                (
                    job or self.job,
                    sid,
                    "env",
                    json.dumps({"task": group}),
                    None,
                    group,
                    0,
                    0,
                    now_text(),
                ),
            )

    def session(
        self,
        group: str,
        session: str,
        steps: int,
        *,
        reward: float = 0.5,
        complete: bool = True,
        **kw: Any,
    ) -> list[int]:
        """All rows of one session; the last one completed with the terminal reward."""
        pks = []
        for s in range(1, steps + 1):
            last = s == steps
            pks.append(
                self.step(
                    group,
                    session,
                    s,
                    completed=last and complete,
                    step_reward=reward if (last and complete) else 0.0,
                    **kw,
                )
            )
        return pks

    def group(
        self, group: str, k: int, steps: int = 2, *, complete: int | None = None, **kw: Any
    ) -> list[str]:
        """K sessions of a group, `complete` of them (default all) completing."""
        sessions = [f"{group}-s{i}-{uuid.uuid4().hex[:8]}" for i in range(k)]
        n_complete = k if complete is None else complete
        for i, sid in enumerate(sessions):
            self.session(
                group, sid, steps, reward=round(0.1 * (i + 1), 3), complete=i < n_complete, **kw
            )
        return sessions

    def close(self) -> None:
        self.db.close()


def make_config(db_url: str, tmp_path, **overrides: Any) -> Config:
    """A test Config: no launcher, logs in tmp_path, fast ingest."""
    base: dict[str, Any] = dict(
        db_url=db_url, launcher="none", run_dir=str(tmp_path / "logs"), ingest_interval_s=0.02
    )
    base.update(overrides)
    return Config.from_env({}, **base)


class Harness:
    """A started service with its Flask test client."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.app = create_app(config)
        self.service = self.app.extensions["rollout_buffer"]
        self.client = self.app.test_client()
        self.service.start()
        assert self.service.wait_ready(15), "service did not bootstrap"

    def start(self, k: int = 4, job: str = "job1", **kw: Any) -> dict:
        body = {"num_repeat_per_sample": k, "job_session": job}
        body.update(kw)
        r = self.client.post("/start_rollout", json=body)
        assert r.status_code == 200, r.get_json()
        return r.get_json()

    def settle(self) -> None:
        """Run ingest ticks until the reader has caught up with what is written now."""
        assert self.service.sync(10), "the background thread did not tick"

    def poll(self, **body: Any) -> dict:
        self.settle()
        r = self.client.post("/get_rollout_data", json=body)
        assert r.status_code == 200, r.get_data(as_text=True)[:500]
        return r.get_json()

    def stats(self) -> dict:
        r = self.client.get("/stats")
        assert r.status_code == 200
        return r.get_json()

    def stop(self) -> None:
        self.service.stop()


def groups_of(doc: dict) -> dict[str, list[dict]]:
    """Items of a /get_rollout_data response by instance_id."""
    out: dict[str, list[dict]] = {}
    for item in doc["data"]["data"]:
        out.setdefault(item["instance_id"], []).append(item)
    return out


def assert_balanced(stats: dict) -> None:
    r = stats["rows"]
    assert r["read"] == r["served"] + r["dropped_total"] + r["rejected_total"] + r["pending"], r


def wait_until(
    predicate: Callable[[], Any], timeout: float = 5.0, what: str | Callable[[], str] = "condition"
) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            what = what() if callable(what) else what
            pytest.fail(f"{what} not reached within {timeout} s (last value {value!r})")
        time.sleep(0.02)


def run_module(module: str, *argv: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """``python -m module argv...`` from the repository root, its output captured as text."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run(
        [sys.executable, "-m", module, *argv],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_on_a_terminal(
    argv: list[str], cwd: Any, stream: str = "stdout", timeout: float = 60.0
) -> tuple[int, str, str]:
    """Run ``argv`` with its ``stream`` ("stdout" or "stderr") on a pseudo-terminal and the other
    one on a pipe: (exit status, what the terminal got, what the pipe got)."""
    other = "stderr" if stream == "stdout" else "stdout"
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(argv, cwd=cwd, **{stream: slave, other: subprocess.PIPE})
        os.close(slave)
        got = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the terminal closed: the process has exited
                break
            if not chunk:
                break
            got += chunk
        piped = proc.communicate(timeout=timeout)[0 if other == "stdout" else 1]
    finally:
        os.close(master)
    return proc.returncode, got.decode("utf-8", "replace"), piped.decode("utf-8", "replace")


CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


def browser_missing() -> str | None:
    """Why the browser tests cannot run here, with the line that installs what is missing, or
    None. Under CI=true the caller fails instead of skipping (.ci/run installs them)."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[test]')"
    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.access(path, os.X_OK):
            return f"{path} is missing (apt-get install chromium chromium-driver)"
    return None


def require_browser() -> None:
    """Skip with the install line when the browser cannot be had; fail under CI=true."""
    why = browser_missing()
    if why is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"the browser tests must run in CI: {why}")
    pytest.skip(why)


# The owner's cursor save, past the fence, waiting for a job row that a test holds (Postgres).
WAITING_SAVE = (
    "SELECT pid FROM pg_stat_activity WHERE query LIKE 'UPDATE rollout_buffer_jobs SET cursor_pk%' "
    "AND wait_event_type = 'Lock'"
)


@contextlib.contextmanager
def paused_in_fence(
    url: str,
    job: str,
    pgid: int,
    timeout: float = 5.0,
    poke: Callable[[], object] = lambda: None,
) -> Iterator[bool]:
    """Postgres: SIGSTOP the process group ``pgid`` (a service that owns ``job``) inside a fenced
    transaction. The job's row is held until the owner's next cursor save (rows must be arriving:
    ``poke`` runs once the row is held) has passed the fence and waits for it; the owner is paused
    then and the row released, so its save goes on (or times out) in a transaction it cannot end,
    holding the lease row's KEY SHARE lock. Yields whether it was caught in time (if not, nothing
    is paused); SIGCONT on exit."""
    import psycopg

    with psycopg.connect(url) as holder, psycopg.connect(url, autocommit=True) as watcher:
        holder.execute("SELECT 1 FROM rollout_buffer_jobs WHERE job_id = %s FOR UPDATE", (job,))
        poke()
        deadline = time.monotonic() + timeout
        while not (caught := bool(watcher.execute(WAITING_SAVE).fetchone())):
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        if caught:
            os.killpg(pgid, signal.SIGSTOP)
        holder.rollback()
    try:
        yield caught
    finally:
        if caught:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGCONT)
