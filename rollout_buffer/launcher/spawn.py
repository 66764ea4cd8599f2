"""Making a launcher process from its spec: the checks before, the log it writes to, the spawn.

Owns: :class:`LaunchSpec`, what may be shown of its argv, the preflight checks (argv, cwd,
executable, log directory, free space) and the spawn itself (its own session, so its own process
group; stdout and stderr appended to its log). It must not watch, restart or stop the process:
:class:`~rollout_buffer.launcher.supervisor.Supervisor` does.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass

from rollout_buffer.core.errors import RolloutBufferError
from rollout_buffer.core.redact import redact
from rollout_buffer.launcher import processes

LOG_MIN_FREE_BYTES = 1 << 20  # less free space in the launcher log directory refuses a start
START_MARK = "--- "  # begins the line written to the log before each start (then its time, argv)


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
    return [redact(str(a)) for a in argv]


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
        disk = os.statvfs(log_dir)
    except OSError as exc:
        raise LauncherError(
            f"cannot create the launcher log directory for {spec.log_path!r}: {exc}"
        ) from exc
    if disk.f_bavail * disk.f_frsize < LOG_MIN_FREE_BYTES:  # its output would fail, and it with it
        raise LauncherError(
            f"the launcher log directory {log_dir!r} has {disk.f_bavail * disk.f_frsize} bytes "
            "free (the disk is full); free some space and start again"
        )


def spawn(spec: LaunchSpec) -> subprocess.Popen[bytes]:
    """Start the launcher described by ``spec`` in a session of its own (so a process group of its
    own), its stdout and stderr appended to its log after a line naming its argv (redacted).
    Raises LauncherError with the reason when it cannot be started."""
    preflight(spec)
    try:
        processes.rotate_log(spec.log_path)
        # unbuffered: a full disk fails here, not at close; closed below once the child has its
        # own copy (a with block would close it before the child is spawned from it)
        log = open(spec.log_path, "ab", buffering=0)  # noqa: SIM115 (see above)
        try:
            started = time.strftime("%Y-%m-%d %H:%M:%S")
            log.write(f"{START_MARK}{started} starting launcher: {shown(spec.argv)}\n".encode())
        except OSError:
            log.close()
            raise
    except OSError as exc:
        raise LauncherError(f"cannot write the launcher log {spec.log_path!r}: {exc}") from exc
    try:
        proc = subprocess.Popen(
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
    finally:
        # The child holds its own copy of the descriptor.
        log.close()
    return proc
