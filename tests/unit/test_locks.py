"""The lock owner (unit tier): the order start, tick, serve is checked, a bounded wait answers 503,
a try never waits, and waiting polls are counted. One thread holds a lock while the test thread
tries it: no sleeps."""

from __future__ import annotations

import threading
import time

import pytest

from rollout_buffer.runtime.locks import SERVING, LockBusy, LockOrderError, Locks
from rollout_buffer.web.errors import status_of


def test_taking_the_locks_out_of_order_raises_a_named_error() -> None:
    locks = Locks()
    with locks.serving(), pytest.raises(LockOrderError, match="tick lock while holding the serve"):
        locks.ticking(timeout=1.0).__enter__()
    with locks.ticking(), pytest.raises(LockOrderError, match="start lock while holding the tick"):
        locks.starting().__enter__()
    with locks.serving(), pytest.raises(LockOrderError, match="serve lock while holding the serve"):
        locks.serving().__enter__()  # not reentrant: a second wait would deadlock
    assert locks.holding() == []  # the refused waits took nothing


def test_the_documented_order_and_a_try_out_of_order_are_allowed() -> None:
    locks = Locks()
    with locks.starting(), locks.ticking(timeout=1.0), locks.serving():
        assert locks.holding() == ["start", "tick", "serve"]
    with locks.ticking(), locks.try_starting() as taken:  # the loop's relaunch: never waits
        assert taken and locks.holding() == ["tick", "start"]
    assert locks.holding() == []


def hold(locks: Locks, which: str) -> tuple[threading.Event, threading.Thread]:
    """Hold one lock in another thread until the returned event is set."""
    held, release = threading.Event(), threading.Event()

    def run() -> None:
        with getattr(locks, which)():
            held.set()
            release.wait(10.0)

    thread = threading.Thread(target=run, name=f"holds-{which}", daemon=True)
    thread.start()
    assert held.wait(10.0)
    return release, thread


def test_a_busy_lock_is_a_503_after_the_wait_and_a_try_says_no() -> None:
    locks = Locks()
    release, thread = hold(locks, "serving")
    try:
        with pytest.raises(LockBusy) as busy, locks.serving(timeout=0.01, holder="another poll"):
            pass
        assert status_of(busy.value) == 503 and "another poll has been busy" in busy.value.message
        with locks.try_serving() as taken:
            assert not taken
        assert locks.holding() == []
    finally:
        release.set()
        thread.join(10.0)
    with locks.try_serving() as taken:
        assert taken


class Recording:
    """A lock that says no, and records how many serve waiters the owner counted while asked."""

    def __init__(self, locks: Locks) -> None:
        self.locks = locks
        self.seen: list[tuple[bool, int]] = []

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        self.seen.append((blocking, self.locks.serve_waiters))
        return False


def test_threads_waiting_for_the_serve_lock_are_counted_and_a_try_is_not() -> None:
    locks = Locks()
    recording = Recording(locks)
    locks._locks[SERVING] = recording  # type: ignore[assignment]  # a lock that records
    with pytest.raises(LockBusy), locks.serving(timeout=0.01):
        pass
    with locks.try_serving() as taken:
        assert not taken
    assert recording.seen == [(True, 1), (False, 0)]
    assert locks.serve_waiters == 0  # a refused wait leaves the count


def test_the_loop_yields_to_a_poll_that_holds_the_serve_lock_for_a_bounded_time() -> None:
    locks = Locks()
    held, release = threading.Event(), threading.Event()

    def poll() -> None:
        with locks.serving():
            held.set()
            release.wait(5.0)

    thread = threading.Thread(target=poll)
    thread.start()
    held.wait(5.0)
    with locks.ticking():  # the loop holds the tick lock while it ingests: the order allows it
        started = time.monotonic()
        locks.yield_to_polls(0.2)  # the poll holds the serve lock: the loop waits for it
        waited = time.monotonic() - started
        release.set()
        thread.join(5.0)
        started = time.monotonic()
        locks.yield_to_polls(0.2)  # no poll: no wait
        free = time.monotonic() - started
    assert 0.15 <= waited < 1.0 and free < 0.05
    assert locks.holding() == []
