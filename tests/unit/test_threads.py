"""The runtime (unit tier): a failing tick goes on, a dead thread is restarted, stop joins and
closes on the worker's thread, and a stuck worker is reported, not waited for forever. Real
threads, no sleeps: every wait is on an event the test sets."""

from __future__ import annotations

import logging
import threading

import pytest

from rollout_buffer.runtime import threads
from rollout_buffer.runtime.threads import Runtime, StillRunning

WAIT_S = 5.0  # a bound on each wait, never a pause: the events end them at once


class Died(BaseException):
    """Out of a tick, it ends the worker's thread (what a tick's Exception never does)."""


class Worker:
    """A scripted worker: each tick runs the next step of ``script`` (a callable or None)."""

    def __init__(self, name: str, script: list | None = None) -> None:
        self.name = name
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self.script = list(script or [])
        self.ticks = 0
        self.ticked = threading.Event()
        self.closed_on: list[str] = []
        self.release = threading.Event()  # a tick waits on it when told to block

    def tick(self) -> float:
        self.ticks += 1
        step = self.script.pop(0) if self.script else None
        self.ticked.set()
        if step is not None:
            step(self)
        return 60.0  # only a wake (a test's, or a stop's) ends the wait

    def close(self) -> None:
        self.closed_on.append(threading.current_thread().name)


def fail(worker: Worker) -> None:
    raise RuntimeError("a bug in the worker")


def die(worker: Worker) -> None:
    raise Died()


def block(worker: Worker) -> None:
    worker.release.wait(WAIT_S)


def next_tick(worker: Worker) -> None:
    """Wake the worker and wait for its next tick."""
    worker.ticked.clear()
    worker.wake.set()
    assert worker.ticked.wait(WAIT_S)


@pytest.fixture
def runtime():
    made = Runtime(name="test-runtime")
    yield made
    made.stop(timeout=WAIT_S)


def test_a_failing_tick_is_logged_and_the_worker_goes_on(
    runtime: Runtime, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(threads, "ERROR_WAIT_S", 60.0)  # only the test's wake ends the wait
    worker = Worker("test-failing", [fail])
    runtime.add(worker)
    runtime.start(monitor=False)
    assert worker.ticked.wait(WAIT_S)
    next_tick(worker)
    assert worker.ticks == 2
    assert runtime.alive() == ["test-failing"]
    assert any(
        "test-failing failed a tick" in r.getMessage() and r.exc_info for r in caplog.records
    )


# the worker's thread is meant to die here: its uncaught BaseException is the point of the test
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_thread_is_restarted_by_the_health_check(runtime: Runtime) -> None:
    worker = Worker("test-dying", [die])
    runtime.add(worker)
    runtime.start(monitor=False)
    assert worker.ticked.wait(WAIT_S)
    dead = runtime._threads["test-dying"]
    dead.join(WAIT_S)
    assert not dead.is_alive() and runtime.alive() == []
    assert worker.closed_on == ["test-dying"]  # what its thread opened was closed there
    worker.ticked.clear()
    assert runtime.check() == ["test-dying"]
    assert worker.ticked.wait(WAIT_S) and worker.ticks == 2
    assert runtime.alive() == ["test-dying"] and runtime.restarts == 1
    assert runtime.check() == []  # alive: nothing to restart


def test_stop_wakes_joins_and_closes_on_the_workers_thread(runtime: Runtime) -> None:
    first, second = Worker("test-first"), Worker("test-second")
    runtime.add(first)
    runtime.add(second)
    runtime.start()
    assert first.ticked.wait(WAIT_S) and second.ticked.wait(WAIT_S)
    runtime.stop(timeout=WAIT_S)  # each waits 60 s for its next tick: the stop wakes it
    assert runtime.alive() == []
    assert first.closed_on == ["test-first"] and second.closed_on == ["test-second"]
    assert runtime.check() == []  # a stopped worker is not restarted
    runtime.stop(timeout=WAIT_S)  # idempotent
    assert first.closed_on == ["test-first"]


def test_a_stuck_worker_is_logged_and_cannot_be_started_twice(
    runtime: Runtime, caplog: pytest.LogCaptureFixture
) -> None:
    worker = Worker("test-stuck", [None, block])
    runtime.add(worker)
    runtime.start(monitor=False)
    assert worker.ticked.wait(WAIT_S)
    next_tick(worker)  # now blocked in its tick until release
    with caplog.at_level(logging.ERROR):
        runtime.stop_worker(worker, timeout=0.05)
    assert any("test-stuck still alive" in r.getMessage() for r in caplog.records)
    with pytest.raises(StillRunning):
        runtime.start(monitor=False)
    worker.release.set()
    runtime._threads["test-stuck"].join(WAIT_S)
    runtime.start(monitor=False)  # its old thread ended: a new one starts
    assert runtime.alive() == ["test-stuck"]


def test_start_is_idempotent_and_names_are_unique(runtime: Runtime) -> None:
    worker = Worker("test-once")
    runtime.add(worker)
    with pytest.raises(ValueError, match="test-once"):
        runtime.add(Worker("test-once"))
    runtime.start(monitor=False)
    runtime.start(monitor=False)
    assert [t.name for t in threading.enumerate()].count("test-once") == 1
