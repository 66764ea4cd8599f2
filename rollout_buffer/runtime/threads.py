"""The runtime: every background thread of the service, in one shape (huey's consumer).

A worker is an object with a ``name`` (its thread's name), a ``wake`` event (set to run its next
tick early), a ``stopping`` event (set by the runtime on stop), ``tick()`` (one round of work;
returns the seconds to wait before the next) and ``close()`` (run on the worker's own thread once
it stops: what it opened there, it closes there). The :class:`Runtime` starts one named daemon
thread per worker, catches and logs what a tick raises (the thread goes on after
``ERROR_WAIT_S``), checks the threads' health and restarts a thread that died, and stops them: it
sets the worker's ``stopping`` and ``wake``, joins with a timeout and logs a thread still alive.
Nothing here sleeps: every wait is an ``Event.wait``.

Owns: the threads, their stop event and the health check. It must not know what a worker does.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

from rollout_buffer.core.errors import RolloutBufferError

logger = logging.getLogger(__name__)

ERROR_WAIT_S = 0.5  # after a tick raised: a failing worker must not spin
HEALTH_CHECK_S = 5.0  # how often the runtime's own thread looks for a dead worker thread


class Worker(Protocol):
    """What the runtime runs: one tick at a time, on a thread of its own."""

    name: str
    wake: threading.Event  # set (by anyone) to end the current wait and tick now
    stopping: threading.Event  # set by the runtime on stop: a long tick checks it to end early

    def tick(self) -> float:
        """One round of work; returns the seconds to wait before the next (a ``wake`` cuts it)."""
        ...

    def close(self) -> None:
        """Release what the worker's thread opened (called on that thread as it ends)."""
        ...


class StillRunning(RolloutBufferError):
    """A worker cannot be started: its previous thread is still running (stuck in a tick)."""


class Runtime:
    """Starts, stops, health-checks and restarts the threads of its workers."""

    def __init__(self, name: str = "rollout-buffer-runtime") -> None:
        self.name = name
        self._workers: list[Worker] = []
        self._threads: dict[str, threading.Thread] = {}
        self._lifecycle = threading.Lock()  # serialises start, stop and the restart of a thread
        self._closing = threading.Event()  # ends the health check thread
        self._monitor: threading.Thread | None = None
        self.restarts = 0

    def add(self, worker: Worker) -> None:
        """Run ``worker`` from the next start() on (names are unique: they name the threads)."""
        if any(w.name == worker.name for w in self._workers):
            raise ValueError(f"a worker named {worker.name!r} is already in this runtime")
        self._workers.append(worker)

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self, *, monitor: bool = True) -> None:
        """Start every worker's thread (idempotent); with ``monitor``, also the health check.

        A worker whose previous thread is still alive after a stop raises :class:`StillRunning`."""
        with self._lifecycle:
            for worker in self._workers:
                self._start(worker)
            if monitor and self._monitor is None:
                self._closing.clear()
                self._monitor = threading.Thread(target=self._watch, name=self.name, daemon=True)
                self._monitor.start()

    def _start(self, worker: Worker) -> None:
        thread = self._threads.get(worker.name)
        stopping = worker.stopping
        if thread is not None and thread.is_alive():
            if not stopping.is_set():
                return  # already running
            raise StillRunning(
                f"cannot restart {worker.name!r}: its previous thread is still alive"
            )
        stopping.clear()
        thread = threading.Thread(target=self._run, args=(worker,), name=worker.name, daemon=True)
        self._threads[worker.name] = thread
        thread.start()

    def stop_worker(self, worker: Worker, timeout: float = 10.0) -> None:
        """Stop one worker's thread (idempotent): set its stop event and its wake, join with a
        timeout, and log loudly when the thread is still alive after it."""
        with self._lifecycle:
            self._stop(worker, timeout)

    def _stop(self, worker: Worker, timeout: float) -> None:
        thread = self._threads.get(worker.name)
        worker.stopping.set()
        worker.wake.set()
        if thread is None or thread is threading.current_thread():
            return
        thread.join(timeout)
        if thread.is_alive():
            logger.error(
                "background thread %s still alive %.1f s after stop(); abandoning it (daemon)",
                worker.name,
                timeout,
            )

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the health check, then every worker, the last started first (idempotent)."""
        self._closing.set()
        monitor, self._monitor = self._monitor, None
        if monitor is not None and monitor is not threading.current_thread():
            monitor.join(timeout)
        with self._lifecycle:
            for worker in reversed(self._workers):
                self._stop(worker, timeout)

    def alive(self) -> list[str]:
        """The names of the worker threads that run now."""
        return [name for name, thread in self._threads.items() if thread.is_alive()]

    # -- health --------------------------------------------------------------------------------
    def check(self) -> list[str]:
        """Restart every worker thread that died while it was not asked to stop; returns their
        names. (A tick's exception never ends a thread: only a BaseException out of the worker,
        or an interpreter shutting down, can.)"""
        restarted = []
        with self._lifecycle:
            for worker in self._workers:
                thread = self._threads.get(worker.name)
                if thread is None or thread.is_alive() or worker.stopping.is_set():
                    continue
                logger.error("background thread %s died; restarting it", worker.name)
                self.restarts += 1
                self._start(worker)
                restarted.append(worker.name)
        return restarted

    def _watch(self) -> None:
        while not self._closing.wait(HEALTH_CHECK_S):
            try:
                self.check()
            except Exception:
                logger.exception("the runtime's health check failed")

    # -- one worker's thread -------------------------------------------------------------------
    def _run(self, worker: Worker) -> None:
        stopping = worker.stopping
        try:
            while True:
                # Cleared before the stop check and the tick: a wake set from here on (a stop, a
                # nudge during the tick) ends the next wait at once; none is lost.
                worker.wake.clear()
                if stopping.is_set():
                    break
                try:
                    wait = worker.tick()
                except Exception:  # a worker's bug must not end its thread: log, wait, go on
                    logger.exception("background worker %s failed a tick (going on)", worker.name)
                    wait = ERROR_WAIT_S
                worker.wake.wait(max(0.0, wait))
        finally:
            try:
                worker.close()
            except Exception:
                logger.exception("background worker %s failed to close", worker.name)
