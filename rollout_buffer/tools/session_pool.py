"""The simulated launcher's pool of running sessions (``--pool-size``), in one of two shapes.

Without model calls one thread writes a row of a random running session every ``--pace``. With
model calls each running session has a thread of its own, as the launcher's pool workers do: a
pacing gate may hold a session's first call while the others go on, and the main thread starts
sessions, flushes on the timer and watches for a stop.

Owns: which sessions run and the threads that run them. It must not write rows itself: the
simulator holds them and flushes them.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from typing import TYPE_CHECKING

from rollout_buffer.tools.llm_calls import SessionFailed
from rollout_buffer.tools.workload import Session

if TYPE_CHECKING:  # pragma: no cover
    from rollout_buffer.tools.simulator import Simulator

SLEEP_SLICE_S = 0.05  # how often the main thread looks for a stop, a finished session, a flush


class Stop(Exception):
    """A termination signal arrived."""


class SessionPool:
    """The sessions not started yet (in group order) and the running ones."""

    def __init__(self, sim: Simulator, todo: deque[Session]) -> None:
        self.sim = sim
        self.todo = todo
        self.active: list[Session] = []

    def run_serial(self) -> None:
        """No model calls: one thread writes a row of a random running session every --pace."""
        sim = self.sim
        self.fill()
        first = True
        while self.active:
            sim.check_stop()
            if sim.args.pace > 0 and not first:
                sim.pause(sim.args.pace)
            first = False
            self.step_one(sim.rng.randrange(len(self.active)))
            sim.maybe_flush()
            sim.progress()

    def fill(self) -> None:
        """Start sessions while the pool has room."""
        while self.todo and len(self.active) < self.sim.args.pool_size:
            s = self.todo.popleft()
            self.sim.start(s)
            if s.rows_planned == 0:  # failed before its first step
                self.sim.finish(s)
            else:
                self.active.append(s)

    def step_one(self, j: int) -> None:
        """One step of the j-th running session; a session done leaves the pool."""
        s = self.active[j]
        self.sim.write_step(s)
        if s.step >= s.rows_planned:
            self.sim.finish(s)
            self.active[j] = self.active[-1]
            self.active.pop()
            self.fill()

    def run_workers(self) -> None:
        """With model calls: each running session on a thread of its own."""
        sim = self.sim
        running = 0
        done: queue.Queue[Session] = queue.Queue()
        while True:
            while self.todo and running < sim.args.pool_size:
                s = self.todo.popleft()
                with sim.lock:
                    sim.start(s)
                    if s.rows_planned == 0:  # failed before its first step
                        sim.finish(s)
                        continue
                running += 1
                threading.Thread(
                    target=self.session_worker, args=(s, done), name="simulate-session", daemon=True
                ).start()
            if not running and not self.todo:
                return
            sim.check_stop()
            try:
                done.get(timeout=SLEEP_SLICE_S)
                running -= 1
            except queue.Empty:
                pass
            sim.maybe_flush()
            sim.progress()

    def session_worker(self, s: Session, done: queue.Queue[Session]) -> None:
        """One session: for each step, a model call (retried; maybe held), then its row."""
        sim = self.sim
        assert sim.model is not None
        try:
            while s.step < s.rows_planned:
                answered = sim.model.call(s.session_id, s.history)
                with sim.lock:
                    sim.write_step(s, answered)
                if sim.args.pace > 0:
                    sim.pause(sim.args.pace)
            with sim.lock:
                sim.finish(s)
        except SessionFailed:
            with sim.lock:
                sim.fail(s)
        except Stop:
            pass  # the main thread stops too, and flushes what is held
        finally:
            done.put(s)
