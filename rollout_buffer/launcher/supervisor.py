"""The launcher process: made from its spec, watched, restarted by policy, stopped with its group.

The supervisor owns no thread. The service's background loop calls :meth:`Supervisor.poll` every
few hundred milliseconds; API threads call :meth:`Supervisor.start` and :meth:`Supervisor.stop`.
Internal state sits behind one lock whose critical sections only read or mutate fields (and spawn,
which is fast); waiting for a process to die happens outside it.

The launcher runs in its own session (so its own process group), its stdout and stderr appended to
its log. :meth:`Supervisor.stop` sends TERM to the group, waits a grace period, KILLs what is left
and waits until no member is left; a pid reused since is never mistaken for the launcher. The log
is rotated under the running writer.

Owns: :class:`LaunchSpec`, the checks before a start (argv, cwd, executable, log directory, free
space), the spawn, watching, restarting, stopping and adopting the process, and its log. It must
not know about jobs, groups or the buffer's tables (launcher.py records its identity).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rollout_buffer.core.errors import RolloutBufferError
from rollout_buffer.core.redact import redact
from rollout_buffer.launcher import procfs

logger = logging.getLogger(__name__)

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
        rotate_log(spec.log_path)
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


STOP_POLL_S = 0.05  # how often a stop looks at the group while it waits
KILL_WAIT_S = 5.0  # after SIGKILL (only processes in uninterruptible sleep outlive it)


def same_process(stat: procfs.ProcStat | None, pgid: int, ticks: Any) -> bool:
    """``stat`` is the recorded process, running: not a zombie, in its group ``pgid``, and started
    at ``ticks`` when they are known (a pid reused since is not it)."""
    return bool(
        stat is not None
        and stat.alive
        and stat.pgrp == pgid
        and (ticks is None or stat.start_ticks == int(ticks))
    )


def still_running(pid: int, pgid: int, ticks: Any) -> bool:
    """The recorded launcher process still runs on this host (see :func:`same_process`)."""
    return same_process(procfs.stat(pid), pgid, ticks)


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


class Supervisor:
    """Runs at most one launcher process, watches it and stops it.

    ``restart_policy`` is ``"never"`` or ``"on-failure"``; with the latter a launcher that
    exits nonzero (or is killed by a signal) is restarted up to ``max_restarts`` times, the
    n-th restart after ``backoff_s * 2**(n-1)`` seconds (at most ``backoff_max_s``) measured
    on ``clock``. A launcher that exits 0, one that was stopped, and an adopted one whose exit
    code is unknown are never restarted.
    """

    def __init__(
        self,
        *,
        restart_policy: str = "never",
        max_restarts: int = 3,
        backoff_s: float = 1.0,
        backoff_max_s: float = 60.0,
        stop_grace_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.restart_policy = restart_policy
        self.max_restarts = max_restarts
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.stop_grace_s = stop_grace_s
        self._clock = clock

        self._lock = threading.Lock()
        # Signalled when a stop() finishes, so a concurrent stop() can wait for it.
        self._stopped_cond = threading.Condition(self._lock)
        self._spec: LaunchSpec | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._ever_started = False
        self._running = False
        self._stopping = False
        self._adopted = False
        self._pid: int | None = None
        self._pgid: int | None = None
        self._start_ticks: int | None = None
        self._started_at: float | None = None
        self._exit_code: int | None = None
        self._exited_at: float | None = None
        self._stopped_by: str | None = None
        self._restarts = 0
        self._restart_at: float | None = None
        self._events: list[dict[str, Any]] = []
        self._log_checked_at = float("-inf")

    # -- public API -------------------------------------------------------------------

    def start(self, spec: LaunchSpec) -> int:
        """Spawn the launcher described by ``spec`` and return its pid.

        Resets the restart counter. Raises :class:`LauncherError` if a launcher is already
        running (or being stopped) or if it cannot be spawned.
        """
        with self._lock:
            if self._running or self._stopping:
                raise LauncherError(
                    f"a launcher is already running (pid {self._pid}); stop it first"
                )
            pid = self._spawn(spec)
            self._spec = spec
            self._restarts = 0
            self._restart_at = None
            self._stopped_by = None
        logger.info("launcher started: pid %s, argv %s", pid, shown(spec.argv))
        return pid

    def adopt(self, pid: int, pgid: int, start_ticks: int | None, spec: LaunchSpec | None) -> bool:
        """Watch a still-running launcher that a previous incarnation of the service started.

        It is adopted only if ``pid`` is alive, not a zombie, in process group ``pgid`` and,
        when ``start_ticks`` is given, started at that time (so a reused pid is not taken
        for it). Returns False, adopting nothing, otherwise. It is not our child, so its exit
        code is unknown (None) when it ends. Raises :class:`LauncherError` if a launcher is
        already running.
        """
        stat = procfs.stat(pid)
        with self._lock:
            if self._running or self._stopping:
                raise LauncherError(
                    f"a launcher is already running (pid {self._pid}); cannot adopt pid {pid}"
                )
            if stat is None or not same_process(stat, pgid, start_ticks):
                logger.info(
                    "not adopting launcher pid %s (pgid %s): not alive or not the same process",
                    pid,
                    pgid,
                )
                return False
            self._proc = None
            self._adopted = True
            self._ever_started = True
            self._running = True
            self._pid = pid
            self._pgid = pgid
            self._start_ticks = stat.start_ticks
            self._started_at = procfs.ticks_to_epoch(stat.start_ticks)
            self._exit_code = None
            self._exited_at = None
            self._stopped_by = None
            self._spec = spec
            self._restarts = 0
            self._restart_at = None
        logger.info("adopted running launcher pid %s (pgid %s)", pid, pgid)
        return True

    def poll(self) -> list[dict[str, Any]]:
        """Inspect the launcher, restart it if one is due, and return the events since the
        last call (``exited``, ``restarted``, ``restart_failed``, ``gave_up``).

        Never sleeps: a restart is scheduled and carried out by a later call once its
        backoff deadline has passed.
        """
        orphan_pgid: int | None = None
        with self._lock:
            # While stop() is in progress it owns the process, including reaping it.
            if self._running and not self._stopping:
                exited, code = self._check_exit()
                if exited:
                    orphan_pgid = self._pgid
                    self._on_exit(code)
            if (
                self._restart_at is not None
                and not self._running
                and self._clock() >= self._restart_at
            ):
                self._restart()
            events, self._events = self._events, []
        if orphan_pgid is not None:
            self._kill_orphans(orphan_pgid)
        spec = self._spec
        if spec is not None and self._clock() - self._log_checked_at >= LOG_CHECK_EVERY_S:
            self._log_checked_at = self._clock()
            rotate_log(spec.log_path)
        for event in events:
            logger.info("launcher event: %s", event)
        return events

    def wait_exit(self, pid: int, timeout: float) -> tuple[bool, int | None]:
        """Wait up to ``timeout`` seconds (holding no lock) for the launcher ``pid`` we started to
        exit; ``(exited, exit_code)``. An exit is recorded (and the restart policy applied) here as
        :meth:`poll` would, so the state says so at once; its events still go to the next poll."""
        with self._lock:
            proc = self._proc if self._pid == pid else None
        if proc is None:  # not our child (adopted), or replaced: nothing of it to wait on
            return False, None
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False, None
        orphan_pgid = None
        with self._lock:
            if self._running and not self._stopping and self._proc is proc:
                orphan_pgid = self._pgid
                self._on_exit(code)
        if orphan_pgid is not None:
            self._kill_orphans(orphan_pgid)
        return True, code

    def stop(self, reason: str = "requested") -> dict[str, Any] | None:
        """Stop the launcher and its whole process group; idempotent.

        Sends SIGTERM to the group, waits up to ``stop_grace_s``, then SIGKILLs whatever is
        left and waits (a few seconds at most) until no process of the group remains. Cancels
        any scheduled restart. Returns the final state, or None if nothing was ever started.
        """
        with self._lock:
            if self._stopping:
                # Another thread is stopping it: wait for that to finish.
                self._stopped_cond.wait_for(
                    lambda: not self._stopping,
                    timeout=self.stop_grace_s + KILL_WAIT_S + 5,
                )
                return self._state_locked()
            if not self._ever_started:
                return None
            if not self._running:
                if self._restart_at is not None:
                    self._restart_at = None
                    self._stopped_by = reason
                return self._state_locked()
            self._stopping = True
            self._stopped_by = reason
            self._restart_at = None
            proc, pid, pgid = self._proc, self._pid, self._pgid
            start_ticks = self._start_ticks
        assert pid is not None and pgid is not None
        code: int | None = None
        try:
            code = terminate_group(proc, pid, pgid, start_ticks, self.stop_grace_s)
        finally:
            with self._lock:
                self._running = False
                self._stopping = False
                self._proc = None
                self._exit_code = code
                self._exited_at = time.time()
                self._events.append(
                    {
                        "event": "exited",
                        "pid": pid,
                        "exit_code": code,
                        "will_restart": False,
                        "stopped_by": reason,
                    }
                )
                self._stopped_cond.notify_all()
                state = self._state_locked()
        logger.info("launcher pid %s stopped (%s), exit code %s", pid, reason, code)
        return state

    def state(self) -> dict[str, Any]:
        """Return a JSON-serialisable snapshot of the launcher's state."""
        with self._lock:
            return self._state_locked()

    def release(self) -> subprocess.Popen[bytes] | None:
        """Forget the launcher unsignalled (another instance takes it over); our child's Popen, to
        reap."""
        with self._lock:
            proc, self._proc = self._proc, None
            self._running, self._ever_started, self._restart_at = False, False, None
            return proc

    # -- internals (callers hold the lock unless noted) --------------------------------

    def _spawn(self, spec: LaunchSpec) -> int:
        """Start the process for ``spec`` and record it as running; return its pid."""
        proc = spawn(spec)
        self._proc = proc
        self._adopted = False
        self._ever_started = True
        self._running = True
        self._pid = proc.pid
        self._pgid = proc.pid  # start_new_session: the child leads its own group
        self._start_ticks = procfs.start_ticks(proc.pid)
        self._started_at = time.time()
        self._exit_code = None
        self._exited_at = None
        return proc.pid

    def _check_exit(self) -> tuple[bool, int | None]:
        """Return ``(exited, exit_code)`` for the running launcher, reaping our own child."""
        if self._proc is not None:
            code = self._proc.poll()
            return code is not None, code
        assert self._pid is not None and self._pgid is not None
        return not still_running(self._pid, self._pgid, self._start_ticks), None

    def _on_exit(self, code: int | None) -> None:
        """Record that the launcher exited by itself and apply the restart policy."""
        self._running = False
        self._proc = None
        self._exit_code = code
        self._exited_at = time.time()
        # An unknown exit code (adopted launcher) is not restarted: it may have finished
        # its work, and running it again would duplicate the job.
        failed = code is not None and code != 0
        will_restart = False
        if self.restart_policy == "on-failure" and failed and self._spec is not None:
            will_restart = self._schedule_restart()
        self._events.append(
            {
                "event": "exited",
                "pid": self._pid,
                "exit_code": code,
                "will_restart": will_restart,
                "stopped_by": None,
            }
        )
        if self.restart_policy == "on-failure" and failed and not will_restart:
            self._events.append(
                {
                    "event": "gave_up",
                    "pid": self._pid,
                    "exit_code": code,
                    "restarts": self._restarts,
                }
            )

    def _schedule_restart(self) -> bool:
        """Schedule the next restart attempt; return False if none is left."""
        if self._restarts >= self.max_restarts:
            self._restart_at = None
            return False
        delay = min(self.backoff_s * 2**self._restarts, self.backoff_max_s)
        self._restart_at = self._clock() + delay
        return True

    def _restart(self) -> None:
        """Carry out a scheduled restart (its deadline has passed)."""
        assert self._spec is not None
        self._restart_at = None
        self._restarts += 1
        try:
            pid = self._spawn(self._spec)
        except LauncherError as exc:
            self._events.append(
                {"event": "restart_failed", "error": str(exc), "attempt": self._restarts}
            )
            if not self._schedule_restart():
                self._events.append(
                    {
                        "event": "gave_up",
                        "pid": self._pid,
                        "exit_code": self._exit_code,
                        "restarts": self._restarts,
                    }
                )
            return
        self._events.append({"event": "restarted", "pid": pid, "attempt": self._restarts})

    def _kill_orphans(self, pgid: int) -> None:
        """KILL what the exited launcher left in its group (called without the lock).

        Its workers would otherwise keep running unwatched, next to a restarted launcher.
        """
        members = procfs.group_members(pgid)
        if members:
            logger.warning(
                "launcher group %s left %d process(es) behind %s; killing them",
                pgid,
                len(members),
                members,
            )
            killpg(pgid, signal.SIGKILL)

    def _state_locked(self) -> dict[str, Any]:
        will_restart = self._restart_at is not None
        return {
            "running": self._running,
            "pid": self._pid,
            "pgid": self._pgid,
            "start_ticks": self._start_ticks,
            "started_at": self._started_at,
            "exit_code": self._exit_code,
            "exited_at": self._exited_at,
            "restarts": self._restarts,
            "restart_policy": self.restart_policy,
            "stopped_by": self._stopped_by,
            "adopted": self._adopted,
            "will_restart": will_restart,
            "finished": (
                self._ever_started and not self._running and not self._stopping and not will_restart
            ),
            "argv": shown(self._spec.argv) if self._spec is not None else None,
            "log_path": self._spec.log_path if self._spec is not None else None,
        }
