"""Real rollout-buffer servers for tests: ``python -m rollout_buffer serve`` (gunicorn) as a subprocess.

:func:`serve` is a context manager: it picks a free port (or takes one, to restart a server on the
same port), starts the server in its own session with a scrubbed environment, polls ``/health``
until it answers (``pytest.fail`` with the log tail when it does not), and on exit stops the whole
process group: SIGTERM, wait, SIGKILL. :class:`Server` can also be stopped and started by hand.

    with serve(db_url, tmp_path) as srv:
        requests.get(srv.url + "/health")

Only stdlib, requests and pytest; nothing here mocks the service.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator, Mapping

import pytest

from rollout_buffer.runner import ServerProcess, clean_env, free_port, log_tail

ROOT = Path(__file__).resolve().parent.parent
__all__ = ["ROOT", "Server", "free_port", "init_db", "log_tail", "serve", "server_env"]


def server_env(db_url: str, run_dir: str | os.PathLike, *, launcher: str = "none",
               extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """os.environ without any service setting, plus the database, log dir, launcher and ``extra``."""
    env = clean_env({
        "AIEVOBOX_DB_URL": db_url,
        "AIEVOBOX_RUN_DIR": str(run_dir),
        "ROLLOUT_BUFFER_LAUNCHER": launcher,
        "ROLLOUT_BUFFER_STOP_GRACE_SECONDS": "5",
        "ROLLOUT_BUFFER_GRACEFUL_TIMEOUT_SECONDS": "20",
        "ROLLOUT_BUFFER_INGEST_INTERVAL_SECONDS": "0.05",
    }, package_parent=str(ROOT))
    env.update(extra or {})
    return env


class Server:
    """One ``rollout-buffer serve`` subprocess (gunicorn master + worker) in its own process group."""

    def __init__(self, db_url: str, workdir: str | os.PathLike, *, port: int | None = None,
                 launcher: str = "none", env: Mapping[str, str] | None = None, name: str = "server") -> None:
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

    def start(self, timeout: float = 30.0) -> "Server":
        """Start the server and wait until GET /health answers 200 (pytest.fail otherwise)."""
        assert self._process is None, "already started"
        env = server_env(self.db_url, self.workdir / "logs", launcher=self.launcher, extra=self.extra_env)
        self.starts += 1
        self._process = ServerProcess(self.port, env, self.log_path, cwd=self.workdir)
        self._process.spawn(f" #{self.starts}")
        problem = self._process.wait_healthy(timeout)
        if problem is not None:
            self.stop()
            pytest.fail(f"rollout-buffer server did not start on {self.url}: {problem}\n"
                        f"--- {self.log_path} ---\n{log_tail(self.log_path)}")
        return self

    def wait_healthy(self, timeout: float) -> str | None:
        """None once GET /health answers 200, else why it did not within ``timeout``."""
        assert self._process is not None
        return self._process.wait_healthy(timeout)

    def stop(self, sig: int = signal.SIGTERM, wait_s: float = 15.0) -> int | None:
        """Signal the process group (SIGTERM by default), wait, then SIGKILL what is left."""
        process, self._process = self._process, None
        return None if process is None else process.stop(sig, wait_s)

    def log(self) -> str:
        """The whole server log."""
        return log_tail(self.log_path, lines=10**6)


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
    subprocess.run([sys.executable, "-m", "rollout_buffer", "init-db", "--db", db_url], cwd=ROOT, check=True,
                   capture_output=True, timeout=60)
