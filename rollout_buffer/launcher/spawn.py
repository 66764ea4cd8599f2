"""Turning a launch spec into a running process: the checks before, the log it appends to, and
``Popen`` in a session of its own.

Owns: :class:`LaunchSpec`, :class:`LauncherError`, :func:`preflight` (what would surely make a start
fail, said before anything changes), :func:`spawn` and :func:`shown` (an argv as logs may show it).
It must not track the process once started: that is the supervisor's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import BinaryIO

from rollout_buffer.core.errors import RolloutBufferError
from rollout_buffer.core.redact import redact
from rollout_buffer.launcher import processes

LOG_MIN_FREE_BYTES = 1 << 20  # less free space in the launcher log directory refuses a start


class LauncherError(RolloutBufferError):
    """The launcher could not be started."""


@dataclass(frozen=True)
class LaunchSpec:
    """How to run the launcher: an argv list (never a shell string), its cwd, environment
    (``None`` inherits ours) and the file its stdout and stderr are appended to."""

    argv: tuple[str, ...]
    cwd: str | None
    env: dict[str, str] | None
    log_path: str


def shown(argv: Sequence[str]) -> list[str]:
    """An argv as it may be shown in logs and answers: database URLs without their password (the
    process itself gets the real one)."""
    return [redact(str(arg)) for arg in argv]


def preflight(spec: LaunchSpec) -> None:
    """Raise LauncherError for what would surely make the spawn fail (no argv, a missing cwd or
    executable, a log directory that cannot be made), before anything else changes."""
    if not spec.argv:
        raise LauncherError("launcher argv is empty")
    if spec.cwd is not None and not os.path.isdir(spec.cwd):
        raise LauncherError(f"launcher cwd {spec.cwd!r} does not exist or is not a directory")
    exe = spec.argv[0]
    path = (spec.env or os.environ).get("PATH")
    found = (
        shutil.which(exe, path=path)
        if os.sep not in exe
        else (exe if os.access(os.path.join(spec.cwd or "", exe), os.X_OK) else None)
    )
    if found is None:
        raise LauncherError(
            f"cannot start launcher: executable {exe!r} not found or not executable"
        )
    log_dir = os.path.dirname(spec.log_path) or "."
    try:
        os.makedirs(log_dir, exist_ok=True)
        filesystem = os.statvfs(log_dir)
    except OSError as exc:
        raise LauncherError(
            f"cannot create the launcher log directory for {spec.log_path!r}: {exc}"
        ) from exc
    free = filesystem.f_bavail * filesystem.f_frsize
    if free < LOG_MIN_FREE_BYTES:  # its output would fail, and it with it
        raise LauncherError(
            f"the launcher log directory {log_dir!r} has {free} bytes "
            "free (the disk is full); free some space and start again"
        )


def spawn(spec: LaunchSpec) -> subprocess.Popen[bytes]:
    """Start the process for ``spec`` in its own session, its output appended to its log (rotated
    first); LauncherError says why it could not start."""
    preflight(spec)
    header = f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} starting launcher: {shown(spec.argv)}\n"
    try:
        processes.rotate_log(spec.log_path)
        # unbuffered: a full disk fails at the header's write, not at close
        with open(spec.log_path, "ab", buffering=0) as log:
            log.write(header.encode())
            # the child holds its own copy of the descriptor: ours is closed on leaving
            return _popen(spec, log)
    except OSError as exc:
        raise LauncherError(f"cannot write the launcher log {spec.log_path!r}: {exc}") from exc


def _popen(spec: LaunchSpec, log: BinaryIO) -> subprocess.Popen[bytes]:
    try:
        return subprocess.Popen(
            list(spec.argv),
            cwd=spec.cwd,
            env=spec.env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )
    except FileNotFoundError as exc:
        raise LauncherError(
            f"cannot start launcher: executable {spec.argv[0]!r} not found ({exc})"
        ) from exc
    except PermissionError as exc:
        raise LauncherError(
            f"cannot start launcher: permission denied for {spec.argv[0]!r} "
            f"(is it executable?) ({exc})"
        ) from exc
    except OSError as exc:
        raise LauncherError(f"cannot start launcher {spec.argv[0]!r}: {exc}") from exc
