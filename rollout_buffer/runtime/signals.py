"""The signals between the service's threads: the loop's wake, its first bootstrap, ready groups,
rows read.

Built first, before the parts that signal each other, so no part needs a part built after it: the
lease (a role change), serving and the API (a nudge, a wait for the bootstrap) and the loop (ready
groups) all get the one :class:`Signals`. A long-poll waits on :class:`ReadySignal` holding no
lock of the service and burning no CPU.

Owns: the events and the condition, and what wakes a waiting poll. It must not decide anything.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol


class Host(Protocol):
    """What serves the app (a gunicorn worker): ``alive`` turns False when it is asked to stop."""

    alive: bool


class ReadySignal:
    """Wakes long-polls: the loop notifies it when groups become ready; stop and shutdown interrupt
    it.

    A waiting poll sleeps on this condition in short slices, so a host shutting down (SIGTERM:
    gunicorn's worker is no longer ``alive``) ends it promptly."""

    SLICE_S = 0.25

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._interrupts = 0
        self.closed = False
        self._host: Host | None = None

    def follow(self, host: Host) -> None:
        """Answer waiting polls once ``host`` is no longer alive (its signal handler only flips
        that flag: nothing here runs in it)."""
        self._host = host

    def host_stopping(self) -> bool:
        """The host asked this worker to stop (SIGTERM)."""
        return self._host is not None and not self._host.alive

    def notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def interrupt(self, close: bool = False) -> None:
        """Answer every waiting poll now (``/stop_rollout``, a role change, shutdown)."""
        with self._cond:
            self._interrupts += 1
            self.closed = self.closed or close
            self._cond.notify_all()

    def wait(
        self, ready: Callable[[], bool], timeout: float, stop: threading.Event | None = None
    ) -> None:
        """Return once ``ready()``, after ``timeout``, on an interrupt, when the host stops, or
        when ``stop`` is set."""
        deadline = time.monotonic() + timeout
        with self._cond:
            seen = self._interrupts
            while (
                not ready()
                and not self.closed
                and seen == self._interrupts
                and not self.host_stopping()
                and not (stop is not None and stop.is_set())
            ):
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._cond.wait(min(left, self.SLICE_S))


class Signals:
    """The loop's wake and bootstrap events and the ready signal, shared by the service's parts."""

    def __init__(self) -> None:
        self.wake = threading.Event()  # the loop's: set to run a tick now
        self.bootstrapped = threading.Event()  # the loop loaded the active job from the database
        self.ready = ReadySignal()
        self._on_change: list[Callable[[tuple[Any, ...]], None]] = []

    def on_change(self, listener: Callable[[tuple[Any, ...]], None]) -> None:
        """Call ``listener`` with each change of the active job (``Accumulator.publish``: under the
        accumulator's lock, so it must only note it) and each poll's arrival (``(None, "poll",
        min_groups, current_weight_version)``)."""
        self._on_change.append(listener)

    def changed(self, event: tuple[Any, ...]) -> None:
        for listener in self._on_change:
            listener(event)

    def nudge(self) -> None:
        """Ask the loop for a tick now."""
        self.wake.set()

    def role_changed(self) -> None:
        """(The lease's thread.) The loop follows the new role now, and waiting polls answer from
        it."""
        self.wake.set()
        self.ready.interrupt()
