"""The lock owner: the start, tick and serve locks, their order, and the one bounded wait.

Lock order, outermost first; a thread never waits for an earlier lock while holding a later one:

1. ``starting``: one /start_rollout at a time;
2. ``ticking``: one background tick, or a job swap;
3. ``serving``: one poll serving (or a redelivery, or the prebuilt draft's build);
4. below these, the accumulator's lock (trivial critical sections, no I/O), then the leaves: the
   outbox's lock, the notifier's lock, the supervisor's lock.

The lease's thread takes none of these (others only read its fields; a role change nudges the
loop and wakes waiting polls through ``runtime.signals``), and a waiting long-poll holds none.

Waiting for a lock out of this order raises :class:`LockOrderError` at once, in the thread that
tried (a would-be deadlock becomes an error that a test sees). Trying one without waiting is
always allowed: it cannot deadlock (the loop relaunches a launcher under the tick lock only if the
start lock is free). A request thread waits at most ``LOCK_WAIT_S``: a stuck database makes a 503
(:class:`LockBusy`), never a hang.

Owns: the three locks, their order, and the count of polls waiting to serve (the prebuilt draft's
builder starts nothing while one waits). It must not know what the locks protect.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from rollout_buffer.core.errors import RolloutBufferError, Unavailable

LOCK_WAIT_S = 8.0  # the longest a request waits for the loop, a poll or a /start_rollout

STARTING, TICKING, SERVING = 1, 2, 3
NAMES = {STARTING: "start", TICKING: "tick", SERVING: "serve"}


class LockOrderError(RolloutBufferError):
    """A thread waited for a lock while holding a later one in the lock order (see locks.py)."""


class LockBusy(Unavailable):
    """A lock was not free within the wait: the request is refused (a 503) and may be retried."""

    def __init__(self, holder: str, wait_s: float) -> None:
        super().__init__(
            f"{holder} has been busy for over {wait_s:.0f} s (the database may be stuck); retry",
            retry_after=2,
        )


class Locks:
    """The start, tick and serve locks, taken only through these named context managers."""

    def __init__(self) -> None:
        self._locks = {level: threading.Lock() for level in NAMES}
        self._held = threading.local()  # per thread: the levels it holds, in the order taken
        self._count = threading.Lock()
        self._serve_waiters = 0

    # -- waiting (bounded) ---------------------------------------------------------------------
    def starting(
        self, *, timeout: float = LOCK_WAIT_S, holder: str = "another /start_rollout"
    ) -> contextlib.AbstractContextManager[None]:
        """Hold the start lock; :class:`LockBusy` after ``timeout``."""
        return self._bounded(STARTING, timeout, holder)

    def ticking(
        self, *, timeout: float | None = None, holder: str = "the background loop"
    ) -> contextlib.AbstractContextManager[None]:
        """Hold the tick lock (``timeout`` None: the loop's own tick, which waits as long as a job
        swap takes); :class:`LockBusy` after ``timeout``."""
        return self._bounded(TICKING, timeout, holder)

    def serving(
        self, *, timeout: float = LOCK_WAIT_S, holder: str = "a poll"
    ) -> contextlib.AbstractContextManager[None]:
        """Hold the serve lock; :class:`LockBusy` after ``timeout``."""
        return self._bounded(SERVING, timeout, holder)

    @contextlib.contextmanager
    def _bounded(self, level: int, timeout: float | None, holder: str) -> Iterator[None]:
        with self._attempt(level, timeout) as taken:
            if not taken:
                assert timeout is not None
                raise LockBusy(holder, timeout)
            yield

    # -- trying (an answer, never an error) ----------------------------------------------------
    def try_starting(self) -> contextlib.AbstractContextManager[bool]:
        """The start lock if it is free now (yields whether it was taken; never waits)."""
        return self._attempt(STARTING, 0.0)

    def try_serving(self, timeout: float = 0.0) -> contextlib.AbstractContextManager[bool]:
        """The serve lock if it is free within ``timeout`` (yields whether it was taken)."""
        return self._attempt(SERVING, timeout)

    def yield_to_polls(self, wait_s: float = 0.02) -> None:
        """Between two pieces of background work: let a poll that holds or waits for the serve
        lock run, up to ``wait_s``. Under the interpreter lock, a poll running beside a busy loop
        waits for the interpreter at each database call; here the loop waits, and does not run."""
        with self.try_serving(wait_s):
            pass

    @property
    def serve_waiters(self) -> int:
        """Threads waiting for the serve lock now (the prebuilt draft's builder yields to them)."""
        return self._serve_waiters

    def holding(self) -> list[str]:
        """The locks this thread holds, outermost first."""
        return [NAMES[level] for level in self._stack()]

    # -- the one place a lock is taken -----------------------------------------------------------
    def _stack(self) -> list[int]:
        stack: list[int] | None = getattr(self._held, "levels", None)
        if stack is None:
            stack = self._held.levels = []
        return stack

    @contextlib.contextmanager
    def _attempt(self, level: int, timeout: float | None) -> Iterator[bool]:
        stack = self._stack()
        waits = timeout is None or timeout > 0
        if waits and stack and max(stack) >= level:
            raise LockOrderError(
                f"waited for the {NAMES[level]} lock while holding the {NAMES[max(stack)]} lock: "
                "the order is start, tick, serve (rollout_buffer/runtime/locks.py)"
            )
        lock = self._locks[level]
        if level == SERVING and waits:
            with self._count:
                self._serve_waiters += 1
        try:
            if timeout is None:
                taken = lock.acquire()
            else:
                taken = lock.acquire(timeout=timeout) if timeout > 0 else lock.acquire(False)
        finally:
            if level == SERVING and waits:
                with self._count:
                    self._serve_waiters -= 1
        if not taken:
            yield False
            return
        stack.append(level)
        try:
            yield True
        finally:
            stack.remove(level)
            lock.release()
