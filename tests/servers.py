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
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Mapping

import pytest
import requests

ROOT = Path(__file__).resolve().parent.parent
SCRUB_PREFIXES = ("AIEVOBOX_", "AIEVOBOC_", "ROLLOUT_BUFFER_", "LLM_PROXY_")
SCRUB_NAMES = ("STORAGE_TYPE", "BUFFER_SERVER_PORT", "WEB_CONCURRENCY", "GUNICORN_CMD_ARGS", "RL_MODEL",
               "RL_EPOCH", "LLM_TEMPERATURE")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_env(db_url: str, run_dir: str | os.PathLike, *, launcher: str = "none",
               extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """os.environ without any service setting, plus the database, log dir, launcher and ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(SCRUB_PREFIXES) and k not in SCRUB_NAMES}
    env.update({
        "AIEVOBOX_DB_URL": db_url,
        "AIEVOBOX_RUN_DIR": str(run_dir),
        "ROLLOUT_BUFFER_LAUNCHER": launcher,
        "ROLLOUT_BUFFER_STOP_GRACE_SECONDS": "5",
        "ROLLOUT_BUFFER_GRACEFUL_TIMEOUT_SECONDS": "20",
        "ROLLOUT_BUFFER_INGEST_INTERVAL_SECONDS": "0.05",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    })
    env.update(extra or {})
    return env


def log_tail(path: str | os.PathLike, lines: int = 60) -> str:
    """The last lines of a log file ('' when missing)."""
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def live_processes() -> list[tuple[int, int, int]]:
    """(pid, ppid, pgrp) of every live (non-zombie) process."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                data = f.read()
        except OSError:
            continue
        fields = data[data.rfind(")") + 2:].split()
        if fields[0] not in "ZX":
            out.append((int(entry), int(fields[1]), int(fields[2])))
    return out


def group_members(pgid: int) -> list[int]:
    """Live processes in process group ``pgid``."""
    return [pid for pid, _ppid, pgrp in live_processes() if pgrp == pgid]


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
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self, timeout: float = 30.0) -> "Server":
        """Start the server and wait until GET /health answers 200 (pytest.fail otherwise)."""
        assert self.proc is None, "already started"
        env = server_env(self.db_url, self.workdir / "logs", launcher=self.launcher, extra=self.extra_env)
        argv = [sys.executable, "-m", "rollout_buffer", "serve", "--host", "127.0.0.1", "--port", str(self.port)]
        self.starts += 1
        with open(self.log_path, "ab") as log:
            log.write(f"--- start #{self.starts}: {argv}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(argv, cwd=self.workdir, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        problem = self.wait_healthy(timeout)
        if problem is not None:
            self.stop()
            pytest.fail(f"rollout-buffer server did not start on {self.url}: {problem}\n"
                        f"--- {self.log_path} ---\n{log_tail(self.log_path)}")
        return self

    def wait_healthy(self, timeout: float) -> str | None:
        """None once GET /health answers 200, else why it did not within ``timeout``."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        last = "no answer"
        with requests.Session() as s:
            while time.monotonic() < deadline:
                code = self.proc.poll()
                if code is not None:
                    return f"the server exited with code {code}"
                try:
                    r = s.get(self.url + "/health", timeout=(1, 2))
                    if r.status_code == 200:
                        return None
                    last = f"HTTP {r.status_code} {r.text[:200]}"
                except requests.RequestException as exc:
                    last = type(exc).__name__
                time.sleep(0.05)
        return f"/health not ready after {timeout:g} s ({last})"

    def stop(self, sig: int = signal.SIGTERM, wait_s: float = 15.0) -> int | None:
        """Signal the process group (SIGTERM by default), wait, then SIGKILL what is left."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        try:
            return proc.wait(5)
        except subprocess.TimeoutExpired:  # pragma: no cover
            return None

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
