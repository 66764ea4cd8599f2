"""Run ``rollout-buffer serve`` as a subprocess: the one runner the demo and the tests share.

Owns: a clean environment (no service setting leaks in from the caller's), a free port, the
subprocess in its own session (so its whole process group can be signalled), waiting for
``GET /health``, stopping (a signal, a wait, then SIGKILL of what is left) and reading its log.
It must not know about pytest or about what the caller does with the server.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

SCRUB_PREFIXES = ("AIEVOBOX_", "AIEVOBOC_", "ROLLOUT_BUFFER_", "LLM_PROXY_")
SCRUB_NAMES = (
    "STORAGE_TYPE",
    "BUFFER_SERVER_PORT",
    "WEB_CONCURRENCY",
    "GUNICORN_CMD_ARGS",
    "RL_MODEL",
    "RL_EPOCH",
    "LLM_TEMPERATURE",
)
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def clean_env(
    settings: Mapping[str, str], *, package_parent: str = PACKAGE_PARENT
) -> dict[str, str]:
    """os.environ without any service setting, plus ``settings``, with the package importable."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(SCRUB_PREFIXES) and k not in SCRUB_NAMES
    }
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (package_parent, os.environ.get("PYTHONPATH")) if p
    )
    env.update(settings)
    return env


def log_tail(path: str | os.PathLike, lines: int = 60) -> str:
    """The last lines of a log file (at most its last MiB; '' when it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - (1 << 20)))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def serve_argv(port: int, host: str = "127.0.0.1") -> list[str]:
    """The command that runs the service under gunicorn."""
    return [sys.executable, "-m", "rollout_buffer", "serve", "--host", host, "--port", str(port)]


class ServerProcess:
    """One server subprocess (gunicorn master and worker) in its own process group."""

    def __init__(
        self,
        port: int,
        env: Mapping[str, str],
        log_path: str | os.PathLike,
        *,
        cwd: str | os.PathLike | None = None,
        argv: Sequence[str] | None = None,
    ) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.env = dict(env)
        self.log_path = log_path
        self.cwd = cwd
        self.argv = list(argv or serve_argv(port))
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def spawn(self, note: str = "") -> None:
        """Start the process, appending its output to the log."""
        assert self.proc is None, "already started"
        with open(self.log_path, "ab") as log:
            log.write(f"--- start{note}: {self.argv}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.argv,
                cwd=self.cwd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_healthy(self, timeout: float) -> str | None:
        """None once GET /health answers 200, else why it did not within ``timeout``."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        last = "no answer yet"
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                return f"the server exited with code {code}"
            status, text = self._health()
            if status == 200:
                return None
            last = text if status is None else f"HTTP {status}: {text[:200]}"
            time.sleep(0.05)
        return f"GET /health not ready after {timeout:g} s ({last})"

    def _health(self) -> tuple[int | None, str]:
        """One GET /health on a connection of its own, closed before it returns: a connection
        left open (to a garbage collector) would make a stopping server keep it a while."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
        try:
            conn.request("GET", "/health")
            answer = conn.getresponse()
            return answer.status, answer.read().decode("utf-8", "replace")
        except (OSError, http.client.HTTPException) as exc:
            return None, type(exc).__name__
        finally:
            conn.close()

    def stop(self, sig: int = signal.SIGTERM, wait_s: float = 15.0) -> int | None:
        """Signal the process group (SIGTERM by default), wait, then SIGKILL what is left. Returns
        the exit code (None if it could not be had)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(wait_s)
        with contextlib.suppress(ProcessLookupError, PermissionError):  # a stuck worker or launcher
            os.killpg(proc.pid, signal.SIGKILL)
        try:
            return proc.wait(5)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL cannot be ignored
            return None
