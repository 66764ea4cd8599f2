"""The signals between threads (unit tier): a waiting poll answers when groups are ready, on an
interrupt, when its host stops (SIGTERM turns gunicorn's worker.alive False) and when its own stop
event is set; a role change nudges the loop and wakes the polls. No thread, no sleep: each wait
ends at once or is bounded by a test-sized timeout that the assertions prove was not reached."""

from __future__ import annotations

import threading
import time

from rollout_buffer.runtime.signals import ReadySignal, Signals

LONG_S = 30.0  # a wait that would fail the test's time bound if it ran out


class Host:
    alive = True


def waited(signal: ReadySignal, ready=lambda: False, stop: threading.Event | None = None) -> float:
    started = time.monotonic()
    signal.wait(ready, LONG_S, stop)
    return time.monotonic() - started


def test_a_wait_ends_at_once_when_groups_are_ready_or_the_signal_is_closed() -> None:
    signal = ReadySignal()
    assert waited(signal, ready=lambda: True) < 1.0
    signal.interrupt(close=True)
    assert waited(signal) < 1.0


def test_a_wait_ends_when_the_host_stops_or_its_stop_event_is_set() -> None:
    signal, host = ReadySignal(), Host()
    signal.follow(host)
    host.alive = False  # what gunicorn's SIGTERM handler does, and all it does
    assert signal.host_stopping() and waited(signal) < 1.0
    stop = threading.Event()
    stop.set()
    assert waited(ReadySignal(), stop=stop) < 1.0


def test_a_role_change_nudges_the_loop_and_interrupts_waiting_polls() -> None:
    signals = Signals()
    changed: list[bool] = []

    def ready() -> bool:  # never ready: only the interrupt can end the wait early
        if not changed:
            changed.append(True)
            signals.role_changed()  # (as the lease's thread would, while the poll waits)
        return False

    assert waited(signals.ready, ready=ready) < 1.0
    assert signals.wake.is_set()
