"""The service: a facade that builds the parts, runs their lifecycle and answers the API's calls.

The parts, each in its own module: the background loop (``loop``), serving (``serving``), the active
job (``jobs``), the durable state (``store``), recording and notifying (``notifications``), the
launcher (``launcher``), ownership of the job (``lease``; a standby's answer is app.py's). Only what
is left here is the wiring, ``/start_rollout``, ``/stop_rollout``, ``/health``, ``/stats``.

Lock order, outermost first; a thread never takes an earlier lock while holding a later one:
1. ``start_lock``: one /start_rollout at a time (the loop, to relaunch, only ``blocking=False``);
2. ``tick_lock``: one loop tick, or a job swap;
3. ``serve_lock``: one poll serving (the loop takes it with ``blocking=False`` to save the cursor,
   and with a bounded wait to drop the job's state when the lease is lost);
4. the accumulator's lock (trivial critical sections, no I/O);
5. the outbox's lock, the notifier's lock, the supervisor's lock (leaves).
The lease's thread takes none of these (others only read its fields; its ``on_change`` nudges
the loop and wakes waiting polls). Waits on 1-3 from a request thread are bounded: a stuck
database makes a 503, never a hang.

Owns: the wiring, the lifecycle (start, stop), the answers above and the lock order above. It must
not grow rooms of its own: a new concern gets its own module, and ``Service`` stays at most 250
lines.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from rollout_buffer.core.body import Body
from rollout_buffer.core.config import Config
from rollout_buffer.core.errors import ApiError, ClosedError, LeaseLost, StorageError, bounded
from rollout_buffer.core.history import History
from rollout_buffer.core.model import PollRequest
from rollout_buffer.core.redact import redact
from rollout_buffer.launcher.launcher import Launcher, launch_spec
from rollout_buffer.launcher.supervisor import LaunchSpec, Supervisor
from rollout_buffer.runtime.jobs import Jobs
from rollout_buffer.runtime.lease import Lease
from rollout_buffer.runtime.loop import Health, Loop
from rollout_buffer.runtime.notifications import Outbox
from rollout_buffer.runtime.proxy import ProxyNotifier
from rollout_buffer.serving.poll import Serving
from rollout_buffer.serving.redelivery import redeliver
from rollout_buffer.storage.connections import LazyPair, state_connection

logger = logging.getLogger(__name__)

LOCK_WAIT_S = 8.0  # longest a request waits for the loop or a poll before answering 503


class Service:
    """The rollout buffer as a plain object with a lifecycle (start/stop are idempotent)."""

    def __init__(self, config: Config, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self._start_lock, self._tick_lock, self._serve_lock = (
            threading.Lock(),
            threading.Lock(),
            threading.Lock(),
        )
        self.supervisor = Supervisor(
            restart_policy=config.restart_policy,
            max_restarts=config.restart_max,
            backoff_s=config.restart_backoff_s,
            stop_grace_s=config.stop_grace_s,
        )
        self.notifier = ProxyNotifier(
            base_url=config.proxy_url,
            connect_timeout=config.proxy_connect_timeout_s,
            read_timeout=config.proxy_read_timeout_s,
            on_delivered=lambda *a: self.outbox.on_delivered(*a),
        )
        self.outbox = Outbox(self.notifier, lambda: state_connection(config))
        self.jobs = Jobs(config, self.outbox, clock=clock)
        self.health_state = Health(config, clock)
        self.instance_id = uuid.uuid4().hex
        # on a role change, the loop follows it now and a waiting poll answers from the new role
        self.lease = Lease(
            config,
            self.instance_id,
            on_change=lambda: [self.loop.nudge(), self.loop.ready_signal.interrupt()],
        )
        self.launcher = Launcher(config, self.supervisor, self.instance_id)
        self.history = History()  # recent rates and batches, for the status page
        self.loop = Loop(
            config,
            jobs=self.jobs,
            outbox=self.outbox,
            launcher=self.launcher,
            health=self.health_state,
            tick_lock=self._tick_lock,
            serve_lock=self._serve_lock,
            clock=clock,
            history=self.history,
            lease=self.lease,
            on_reset=lambda: self.serving.forget(),
            start_lock=self._start_lock,
        )
        self.serving = Serving(
            config,
            jobs=self.jobs,
            outbox=self.outbox,
            loop=self.loop,
            health=self.health_state,
            serve_lock=self._serve_lock,
            history=self.history,
            connection=self.connection,
        )
        self.serving.guard = lambda: self.lease.check(2.0)
        self._started = False
        self._closed = False

    current = property(lambda self: self.jobs.current, doc="The active job (a JobState), if any.")

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the background thread and the notifier; idempotent. Touches the DB in the
        thread."""
        if self._closed:
            raise ClosedError("service was stopped; build a new one")
        if self._started:
            return
        self._started = True
        self.notifier.start()
        self.lease.start()
        self.loop.start()
        self.serving.prebuilt.start()
        logger.info("rollout-buffer service started (db %s)", redact(self.config.db_url))

    def stop(self, timeout: float = 10.0, *, keep_launcher: bool = False) -> None:
        """Stop the loop, the launcher (TERM, grace, KILL) and the notifier; idempotent. With
        ``keep_launcher`` (the worker crashed) the launcher runs on, for the next worker to
        adopt."""
        if self._closed:
            return
        self._closed = True
        self.lease.leaving()  # a standby that stops takes nothing over, and is no longer one
        self.loop.ready_signal.interrupt(close=True)
        self.serving.prebuilt.stop()
        self.loop.stop(timeout)
        js = self.jobs.current
        if self.supervisor.state()["running"]:
            with (
                self.connection() as conns
            ):  # (opened only when the launcher's fate needs the database)
                self.launcher.stop_for_shutdown(
                    conns, js.job_id if js else None, self.lease.standby_hosts, keep_launcher
                )
        self.lease.stop(
            release=not keep_launcher
        )  # a crashed worker's successor here sees its pid gone
        self.notifier.stop()
        logger.info("rollout-buffer service stopped")

    def wait_ready(self, timeout: float = 30.0) -> bool:
        """Block until the first successful bootstrap (tests, CLI)."""
        return self.loop.bootstrapped.wait(timeout)

    def nudge(self) -> None:
        """Ask the background thread to run a tick now."""
        self.loop.nudge()

    def sync(self, timeout: float = 10.0) -> bool:
        """Wait until a full background tick has run after this call (tests, CLI)."""
        return not self._closed and self.loop.sync(timeout)

    def connection(self) -> LazyPair:
        """Lazily opened connections for one request (closed by the API at teardown)."""
        return LazyPair(self.config, self.lease.fence)

    def launch_spec(self, job_id: str, k: int) -> LaunchSpec:
        """The launcher command for a job (see launcher.launch_spec)."""
        return launch_spec(self.config, job_id, k)

    # -- the API's calls -----------------------------------------------------------------------
    def get_rollout_data(self, conns: LazyPair, poll: PollRequest) -> Body:
        """Serve ready groups (or replay the batch bound to request_id), long-polling up to
        wait_s."""
        return self.serving.get_rollout_data(conns, poll)

    def start_rollout(
        self,
        conns: LazyPair,
        *,
        k: int,
        restart_training: bool,
        job_session: str | None,
        skip: list[str] | None = None,
    ) -> tuple[int, dict[str, Any]]:
        """Select the job, start its launcher (or redeliver: see _redeliver). Returns (status,
        body)."""
        self.lease.check(10.0)  # LeaseLost on a standby: answered with 307 (app.standby_answer)
        if not self.loop.bootstrapped.is_set():
            # Before the active job is resumed and its launcher adopted, "not running" would be a
            # lie.
            self.nudge()
            if not self.loop.bootstrapped.wait(10.0):
                raise ApiError(
                    503,
                    "the service is still loading its state from the database: "
                    f"{self.health_state.last_error or 'still starting'}",
                    retry_after=2,
                )
        with bounded(self._start_lock, "another /start_rollout", LOCK_WAIT_S):
            return self._start_rollout(conns, k, restart_training, job_session, skip or [])

    def _start_rollout(
        self,
        conns: LazyPair,
        k: int,
        restart_training: bool,
        job_session: str | None,
        skip: list[str],
    ) -> tuple[int, dict[str, Any]]:
        js = self.jobs.current
        pid = self.launcher.running_pid()  # here, or on another host
        if pid is not None:
            if js is not None and job_session not in (None, js.job_id):
                raise ApiError(
                    409,
                    f"the launcher of job {js.job_id!r} is still running (pid "
                    f"{pid}); POST /stop_rollout first or name that job",
                    job_session=js.job_id,
                    pid=pid,
                )
            return 200, {
                "message": "AIEvoBox is already running",
                "pid": pid,
                "job_session": js.job_id if js else None,
                **self._redeliver(conns, js, skip),
            }
        same = (
            js is not None and js.job_id == job_session and not restart_training
        )  # no new job: redeliver
        job_id = job_session or uuid.uuid4().hex
        if self.launcher.managed:
            self.launcher.preflight(job_id, k)
        pair = conns.get()
        with (
            bounded(self._tick_lock, "the background loop", LOCK_WAIT_S),
            bounded(self._serve_lock, "a poll", LOCK_WAIT_S),
        ):
            try:
                self.serving.settle(
                    pair, self.jobs.current
                )  # its prebuilt draft's groups go back first
                js = self.jobs.select(pair.src, pair.store, job_id, k, restart_training)
            except StorageError as exc:
                raise (
                    exc
                    if isinstance(exc, LeaseLost)
                    else ApiError(503, f"the database is unreachable: {exc}", retry_after=3)
                ) from exc
            if self.launcher.managed:
                # Until its own launcher runs, the finished one the loop sees is not this job's:
                # no launcher_exited drop for it (reset once the launcher is spawned).
                js.launcher_drop_done = True
        self.nudge()
        pid = self.launcher.start_for(
            pair.store, js
        )  # (None when it runs elsewhere: LAUNCHER=none)
        logger.info(
            "rollout started: job %s, K=%s, restart_training=%s, launcher pid %s",
            job_id,
            k,
            restart_training,
            pid,
        )
        return 200, {
            "message": "Rollout started",
            "pid": pid,
            "job_session": job_id,
            "k": k,
            "restart_training": restart_training,
            "floor_pk": js.floor_pk,
            "launcher": self.config.launcher_kind,
            **(self._redeliver(conns, js, skip) if same else {}),
        }

    def _redeliver(self, conns: LazyPair, js: Any, skip: list[str]) -> dict[str, Any]:
        """A call that began no new job, with a checkpoint's skip list: queue served groups
        again."""
        if js is None or not skip:
            return {}
        return redeliver(
            conns.get(),
            js,
            skip,
            self._serve_lock,
            self.serving.settle,
            self.loop.ready_signal.notify,
        )

    def stop_rollout(self) -> dict[str, Any]:
        """Stop the launcher (idempotent); the job stays selected and ready groups stay servable.

        Takes no service lock and no database (the supervisor's lock makes it safe): a stuck
        database or a /start_rollout in progress must not keep the launcher running past its
        grace."""
        self.lease.check(2.0, sure=False)
        before = self.supervisor.state()
        self.loop.ready_signal.interrupt()  # waiting polls answer now, with whatever is ready
        self.supervisor.stop("requested")
        self.nudge()
        js = self.jobs.current
        message = "Launcher stopped" if before["running"] else "No launcher running"
        if self.launcher.stop_elsewhere():  # (recorded by the loop: no database here)
            message = (
                "Launcher on another host recorded as stopped: an instance on its host stops it"
            )
        return {
            "message": message,
            "job_session": js.job_id if js else None,
            "launcher": self.launcher.summary(),
        }

    # -- introspection -----------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        """What GET /health reports (no database access)."""
        js = self.jobs.current
        problem = self.health_state.problem() or (self.loop.stuck() if self._started else None)
        return {
            "status": "healthy" if problem is None and self.lease.problem is None else "degraded",
            # role, instance, owner (its URL, never a secret), lease_problem
            **self.lease.describe(),
            "last_tick_age_s": round(self.loop.tick_age(), 3),
            "aievobox_running": bool(self.supervisor.state()["running"]),
            "data_manager_initialized": js is not None,
            "job_session": js.job_id if js else None,
            "database": "ok" if problem is None else problem,
            "launcher": self.launcher.summary(),
            "proxy_notifications": self.notifier.pending(),
        }

    def stats(self, conns: LazyPair | None = None) -> dict[str, Any]:
        """Per-job accounting and gauges for GET /stats."""
        js = self.jobs.current
        problem = self.health_state.problem()
        polls = self.serving.stats.snapshot()
        out: dict[str, Any] = {
            "job_session": js.job_id if js else None,
            "launcher": self.launcher.summary(),
            "proxy_notifications": self.notifier.pending(),
            "database": "ok" if problem is None else problem,
            "polls": {
                **{k: polls[k] for k in ("count", "with_data", "seconds_total")},
                "waiting": self.serving.waiting_polls,
            },
            "prebuilt": self.serving.prebuilt.stats(),
            "lease": self.lease.stats(),
        }
        src = None  # only the lag needs the database: with it down, the rest is still answered
        if js is not None and conns is not None and problem is None:
            with contextlib.suppress(StorageError):
                src = conns.get().src
        if js is not None:
            out.update(js.stats(src, self.serving.prebuilt.held(js)))
        return out
