"""The service's background parts built by hand for the unit tier: no threads, no sockets, a fake
clock, real SQLite files in tmp_path. A test drives the loop by calling its ``tick()``."""

from __future__ import annotations

from typing import Any

from support import Writer, make_config, make_launcher_db

from rollout_buffer.core.history import History
from rollout_buffer.launcher.launcher import Launcher
from rollout_buffer.launcher.supervisor import Supervisor
from rollout_buffer.runtime.jobs import Jobs, JobState
from rollout_buffer.runtime.locks import Locks
from rollout_buffer.runtime.loop import Health, Loop
from rollout_buffer.runtime.notifications import Outbox
from rollout_buffer.runtime.proxy import ProxyNotifier
from rollout_buffer.runtime.signals import Signals
from rollout_buffer.storage.store import LazyPair


class Clock:
    """A monotonic clock the test moves (and that moves by ``step`` each time it is read)."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.step = 0.0

    def __call__(self) -> float:
        self.now += self.step
        return self.now


class Parts:
    """The loop and what it needs, wired as Service wires them (lease: none)."""

    def __init__(self, tmp_path: Any, **overrides: Any) -> None:
        url = "sqlite://" + str(tmp_path / "launcher.db")
        make_launcher_db(url)
        self.writer = Writer(url)
        self.config = make_config(url, tmp_path, **overrides)
        self.clock = Clock()
        self.locks, self.signals = Locks(), Signals()
        self.notifier = ProxyNotifier(base_url=None)
        self.outbox = Outbox(notifier=self.notifier, config=self.config)
        self.jobs = Jobs(self.config, self.outbox, clock=self.clock)
        self.health = Health(self.config, self.clock)
        self.launcher = Launcher(
            self.config, Supervisor(restart_policy="never"), "instance-1", host_id="host-1"
        )
        self.resets: list[str] = []
        # what both the loop and serving are built with
        self.shared: dict[str, Any] = dict(
            jobs=self.jobs,
            outbox=self.outbox,
            health=self.health,
            locks=self.locks,
            signals=self.signals,
        )
        self.loop = Loop(
            self.config,
            launcher=self.launcher,
            on_reset=lambda: self.resets.append("reset"),  # a recorder, not wiring
            clock=self.clock,
            history=History(),
            **self.shared,
        )
        self.conns = LazyPair(self.config)  # the test's own, for the store

    def select(self, job_id: str = "job1", k: int = 2) -> JobState:
        """/start_rollout's job swap (under the tick and serve locks, as the service takes them)."""
        pair = self.conns.get()
        with self.locks.ticking(), self.locks.serving():
            return self.jobs.select(pair.source, pair.store, job_id, k, False)

    def tick(self, advance: float = 0.0) -> float:
        self.clock.now += advance
        return self.loop.tick()

    def close(self) -> None:
        self.loop.close()
        self.conns.close()
        self.writer.close()
