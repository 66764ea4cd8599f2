"""Launcher subprocess supervisor: start, poll, restart with backoff, stop.

The supervisor owns no thread. The service's background loop calls :meth:`Supervisor.poll`
every few hundred milliseconds; API threads call :meth:`Supervisor.start` and
:meth:`Supervisor.stop`. Internal state sits behind one lock whose critical sections only
read or mutate fields (and spawn, which is fast); waiting for a process to die happens
outside it.

The launcher runs in its own session (so its own process group), which lets
:meth:`Supervisor.stop` signal the launcher and everything it forked at once and check that
the whole group is gone.

Owns: the launcher process (``spawn`` makes it from a :class:`LaunchSpec`): watching it, restarting
it by policy, stopping its group, adopting one after a restart. It must not know about jobs, groups
or the buffer's tables (launcher.py records its identity).
"""

from __future__ import annotations

import logging
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

from rollout_buffer.launcher import processes, procfs
from rollout_buffer.launcher.spawn import LauncherError, LaunchSpec, preflight, shown, spawn

logger = logging.getLogger(__name__)

RESTART_POLICIES = ("never", "on-failure")


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
        if restart_policy not in RESTART_POLICIES:
            raise ValueError(
                f"restart_policy must be one of {RESTART_POLICIES}, got {restart_policy!r}"
            )
        if max_restarts < 0 or backoff_s < 0 or backoff_max_s < 0 or stop_grace_s < 0:
            raise ValueError("max_restarts, backoff_s, backoff_max_s and stop_grace_s must be >= 0")
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
            if (
                stat is None
                or not stat.alive
                or stat.pgrp != pgid
                or (start_ticks is not None and stat.start_ticks != start_ticks)
            ):
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
        if spec is not None and self._clock() - self._log_checked_at >= processes.LOG_CHECK_EVERY_S:
            self._log_checked_at = self._clock()
            processes.rotate_log(spec.log_path)
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
                    timeout=self.stop_grace_s + processes.KILL_WAIT_S + 5,
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
            code = self._terminate(proc, pid, pgid, start_ticks)
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

    def close(self) -> None:
        """Stop the launcher for a service shutdown; idempotent."""
        self.stop("shutdown")

    def release(self) -> subprocess.Popen[bytes] | None:
        """Forget the launcher unsignalled (another instance takes it over); our child's Popen, to
        reap."""
        with self._lock:
            proc, self._proc = self._proc, None
            self._running, self._ever_started, self._restart_at = False, False, None
            return proc

    # -- internals (callers hold the lock unless noted) --------------------------------

    #: Raises LauncherError for what would surely make the spawn fail (see spawn.preflight).
    preflight = staticmethod(preflight)

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
        assert self._pid is not None
        stat = procfs.stat(self._pid)
        alive = (
            stat is not None
            and stat.alive
            and stat.pgrp == self._pgid
            and stat.start_ticks == self._start_ticks
        )
        return not alive, None

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
            processes.killpg(pgid, signal.SIGKILL)

    def _terminate(
        self, proc: subprocess.Popen[bytes] | None, pid: int, pgid: int, start_ticks: int | None
    ) -> int | None:
        """TERM, grace, KILL the launcher's group (without the lock); its exit code, None if
        unknown."""
        return processes.terminate_group(proc, pid, pgid, start_ticks, self.stop_grace_s)

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
