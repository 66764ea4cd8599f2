"""Acting on processes: stopping a launcher's process group, and rotating the log it appends to.

Owns: TERM, a grace period, KILL of a whole group and waiting until no member is left (a pid
reused since is never mistaken for the launcher), and a log rotation that works under a running
writer. procfs.py reads what these act on; the supervisor decides when.

It must not decide when to act or track a launcher's state: that is the supervisor's.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import time

from rollout_buffer.launcher import procfs

logger = logging.getLogger(__name__)

STOP_POLL_S = 0.05  # how often a stop looks at the group while it waits
KILL_WAIT_S = 5.0  # after SIGKILL (only processes in uninterruptible sleep outlive it)


def killpg(pgid: int, sig: int) -> bool:
    """Send ``sig`` to a process group; return False if the group no longer exists."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        logger.error("no permission to send signal %s to launcher process group %s", sig, pgid)
        return False
    return True


def terminate_group(
    proc: subprocess.Popen[bytes] | None,
    pid: int,
    pgid: int,
    start_ticks: int | None,
    grace_s: float,
) -> int | None:
    """TERM the group, wait ``grace_s``, KILL what is left, and wait until it is gone.

    ``proc`` is our child (its exit code is returned) or None for an adopted launcher (None is
    returned: its exit code is unknown)."""

    def leader_gone() -> bool:
        if proc is not None:
            return proc.poll() is not None
        stat = procfs.stat(pid)
        return stat is None or not stat.alive or stat.start_ticks != start_ticks

    def all_gone() -> bool:
        return leader_gone() and not procfs.group_members(pgid)

    if proc is None:
        # Not our child: make sure a reused pid is not mistaken for the launcher. A pid still in
        # use as a pgid is never handed out again, so if the leader's pid now belongs to another
        # process, the original group is gone.
        stat = procfs.stat(pid)
        if stat is not None and stat.start_ticks != start_ticks:
            logger.info("adopted launcher pid %s is gone (pid reused)", pid)
            return None
    if killpg(pgid, signal.SIGTERM):
        deadline = time.monotonic() + grace_s
        while not all_gone() and time.monotonic() < deadline:
            time.sleep(STOP_POLL_S)
    if not all_gone():
        logger.warning(
            "launcher pid %s did not exit within %ss of SIGTERM; sending SIGKILL to group %s",
            pid,
            grace_s,
            pgid,
        )
        killpg(pgid, signal.SIGKILL)
        deadline = time.monotonic() + KILL_WAIT_S
        while not all_gone() and time.monotonic() < deadline:
            time.sleep(STOP_POLL_S)
        if not all_gone():
            logger.error(
                "launcher process group %s still has processes %s after SIGKILL",
                pgid,
                procfs.group_members(pgid),
            )
    return proc.poll() if proc is not None else None


LOG_MAX_BYTES = 64 << 20  # launcher-<job>.log is rotated past this size ...
LOG_KEEP = 3  # ... keeping this many old files (.1 newest)
LOG_CHECK_EVERY_S = 10.0


def rotate_log(path: str, max_bytes: int = LOG_MAX_BYTES, keep: int = LOG_KEEP) -> bool:
    """Rotate a log that a running process appends to: copy it to ``.1`` (shifting older copies)
    and truncate it in place. The process's descriptor is O_APPEND, so it goes on writing at the
    new end; renaming would leave it writing into the rotated file. Returns True if rotated."""
    try:
        if not os.path.exists(path) or os.path.getsize(path) <= max_bytes:
            return False  # (not written yet: nothing to rotate, nothing to warn about)
        for i in range(keep - 1, 0, -1):
            if os.path.exists(f"{path}.{i}"):
                os.replace(f"{path}.{i}", f"{path}.{i + 1}")
        with open(path, "rb") as source, open(f"{path}.1", "wb") as target:
            shutil.copyfileobj(source, target, 1 << 20)
        os.truncate(path, 0)
    except OSError as exc:
        logger.warning("could not rotate %s: %s", path, exc)
        return False
    return True
