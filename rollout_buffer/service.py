"""The service: a facade that builds the parts, runs their lifecycle and answers the API's calls.

The parts, each in its own module: the runtime and its workers (``runtime.threads``: the ingest
loop, the prebuilt draft's builder, the proxy notifier), the lock owner (``runtime.locks``, which
documents and checks the lock order), the signals between threads (``runtime.signals``), serving
(``serving``), the active job (``jobs``), the durable state (``store``), recording and notifying
(``notifications``), the launcher (``launcher``), ownership of the job (``lease``; a standby's
answer is app.py's), ``/start_rollout`` and ``/stop_rollout`` (``serving.rollouts``), and pacing
(the ``rollout_buffer.pacing`` package, built only with ``ROLLOUT_BUFFER_PACING=gate``: this is the
one module that imports it). Only what is left here is the wiring, ``/health`` and ``/stats``.

The wiring has no lambda and no part built after the one that needs it: the locks, the signals
and the runtime come first, then the parts, each with keyword-only arguments.

Owns: the wiring, the lifecycle (start, stop) and the answers above. It must not grow rooms of its
own: a new concern gets its own module, and ``Service`` stays at most 250 lines.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from rollout_buffer import pacing
from rollout_buffer.core.config import Config
from rollout_buffer.core.errors import ClosedError, StorageError
from rollout_buffer.core.history import History
from rollout_buffer.core.items import Body
from rollout_buffer.core.model import PollRequest
from rollout_buffer.core.redact import redact
from rollout_buffer.launcher.launcher import Launcher, launch_spec
from rollout_buffer.launcher.supervisor import LaunchSpec, Supervisor
from rollout_buffer.runtime.jobs import Jobs, JobState
from rollout_buffer.runtime.lease import OWNER, Lease
from rollout_buffer.runtime.locks import Locks
from rollout_buffer.runtime.loop import Health, Loop
from rollout_buffer.runtime.notifications import Outbox
from rollout_buffer.runtime.proxy import ProxyNotifier
from rollout_buffer.runtime.signals import Host, Signals
from rollout_buffer.runtime.threads import Runtime
from rollout_buffer.serving.poll import Serving
from rollout_buffer.serving.rollouts import Rollouts
from rollout_buffer.storage.store import LazyPair

logger = logging.getLogger(__name__)


class Service:
    """The rollout buffer as a plain object with a lifecycle (start/stop are idempotent)."""

    def __init__(self, config: Config, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.locks = Locks()
        self.signals = Signals()
        self.runtime = Runtime()
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
        )
        self.outbox = Outbox(notifier=self.notifier, config=config)
        self.notifier.deliver_to(self.outbox.on_delivered)
        self.jobs = Jobs(config, self.outbox, clock=clock, changes=self.signals.changed)
        self.health_state = Health(config, clock)
        self.instance_id = uuid.uuid4().hex
        self.lease = Lease(config, self.instance_id, on_change=self._lease_changed)
        self.on_refused: Callable[[], None] = lambda: None  # gunicorn_conf: the worker stops
        self.launcher = Launcher(config, self.supervisor, self.instance_id)
        self.history = History()  # recent rates and batches, for the status page
        self.serving = Serving(
            config,
            jobs=self.jobs,
            outbox=self.outbox,
            signals=self.signals,
            health=self.health_state,
            locks=self.locks,
            guard=self.lease,
            history=self.history,
            launcher_status=self.launcher.status,
        )
        self.loop = Loop(
            config,
            jobs=self.jobs,
            outbox=self.outbox,
            launcher=self.launcher,
            health=self.health_state,
            locks=self.locks,
            signals=self.signals,
            on_reset=self.serving.forget,
            clock=clock,
            history=self.history,
            lease=self.lease,
        )
        self.rollouts = Rollouts(
            config,
            jobs=self.jobs,
            launcher=self.launcher,
            supervisor=self.supervisor,
            lease=self.lease,
            locks=self.locks,
            signals=self.signals,
            serving=self.serving,
            health=self.health_state,
        )
        if self.notifier.enabled:
            self.runtime.add(self.notifier)
        if self.lease.enabled:
            self.runtime.add(self.lease)
        self.runtime.add(self.loop)
        if self.serving.prebuilt.enabled:
            self.runtime.add(self.serving.prebuilt)
        self.pacing = None  # built only when on: pacing off has no object, thread or port
        if config.pacing == "gate":
            self.pacing = pacing.build(
                config, owner=self._owns, launcher_url=self.launcher.llm_base_url
            )
            self.launcher.route = self.pacing.route
            self.signals.on_change(self.pacing.publish)
        self._started = False
        self._closed = False

    def _owns(self) -> bool:
        """(The gate's thread.) This instance owns the job: only then does the gate listen."""
        return self.lease.role == OWNER and not self._closed

    def _lease_changed(self) -> None:
        """(The lease's thread.) On a role change the loop follows it now and a waiting poll answers
        from the new role; an unnamed instance refused next to a live owner stops."""
        self.signals.role_changed()
        if self.lease.refused:
            self.on_refused()

    @property
    def current(self) -> JobState | None:
        """The active job, if any."""
        return self.jobs.current

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self, *, host: Host | None = None) -> None:
        """Start the lease and the runtime's workers; idempotent. Touches the DB only in the
        threads. With ``host`` (a gunicorn worker), waiting polls answer once it stops being
        alive."""
        if self._closed:
            raise ClosedError("service was stopped; build a new one")
        if self._started:
            return
        self._started = True
        if host is not None:
            self.signals.ready.follow(host)
        if self.pacing is not None:
            self.pacing.start()  # it listens once this instance owns the job
        self.loop.mark_started()
        self.runtime.start()
        logger.info("rollout-buffer service started (db %s)", redact(self.config.db_url))

    def stop(self, timeout: float = 10.0, *, keep_launcher: bool = False) -> None:
        """Stop the loop, the launcher (TERM, grace, KILL) and the notifier; idempotent. With
        ``keep_launcher`` (the worker crashed) the launcher runs on, for the next worker to
        adopt."""
        if self._closed:
            return
        self._closed = True
        self.lease.leaving()  # a standby that stops takes nothing over, and is no longer one
        self.signals.ready.interrupt(close=True)
        self.runtime.stop_worker(self.serving.prebuilt, 5.0)
        if self.pacing is not None:
            self.pacing.close()  # held and forwarded calls end: the launcher's client retries
        self.runtime.stop_worker(self.loop, timeout)
        job_state = self.jobs.current
        if self.supervisor.state()["running"]:
            # (the database is opened only when the launcher's fate needs it)
            with self.connection() as conns:
                self.launcher.stop_for_shutdown(
                    conns,
                    job_state.job_id if job_state else None,
                    self.lease.standby_hosts,
                    keep_launcher,
                )
        # a crashed worker's successor here sees its pid gone
        self.runtime.stop_worker(self.lease, 10.0)
        self.lease.give_up(release=not keep_launcher)
        self.runtime.stop(5.0)  # the notifier last: what the stop recorded is sent first
        if self.notifier.enabled:
            self.notifier.log_stopped()
        logger.info("rollout-buffer service stopped")

    def wait_ready(self, timeout: float = 30.0) -> bool:
        """Block until the first successful bootstrap (tests, CLI)."""
        return self.signals.bootstrapped.wait(timeout)

    def nudge(self) -> None:
        """Ask the background thread to run a tick now."""
        self.signals.nudge()

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
        # the poll's arrival, not its end, tells pacing that the trainer is back (what it serves,
        # pacing learns with each group's decision)
        self.signals.changed((None, "poll", poll.min_groups, poll.current_weight_version))
        return self.serving.get_rollout_data(conns, poll)

    def admission(self) -> dict[str, Any]:
        """``GET /admission``: how many more groups may start now, and why."""
        return {"pacing": "off"} if self.pacing is None else self.pacing.report()

    def start_rollout(
        self,
        conns: LazyPair,
        *,
        k: int,
        restart_training: bool,
        job_session: str | None,
        skip: list[str] | None = None,
    ) -> dict[str, Any]:
        """Select the job, start its launcher (or redeliver). Returns the answer's body; a refusal
        is a RequestError (Conflict, Unavailable, OperationFailed)."""
        return self.rollouts.start(
            conns, k=k, restart_training=restart_training, job_session=job_session, skip=skip
        )

    def stop_rollout(self) -> dict[str, Any]:
        """Stop the launcher (idempotent); the job stays selected and ready groups stay
        servable."""
        return self.rollouts.stop()

    # -- introspection -----------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        """What GET /health reports (no database access)."""
        job_state = self.jobs.current
        problem = self.health_state.problem() or (self.loop.stuck() if self._started else None)
        return {
            "status": "healthy" if problem is None and self.lease.problem is None else "degraded",
            # role, instance, owner (its URL, never a secret), lease_problem
            **self.lease.describe(),
            "last_tick_age_s": round(self.loop.tick_age(), 3),
            "aievobox_running": bool(self.supervisor.state()["running"]),
            "data_manager_initialized": job_state is not None,
            "job_session": job_state.job_id if job_state else None,
            "database": "ok" if problem is None else problem,
            "launcher": self.launcher.summary(),
            # running, restarting, exited (with its exit code), stopped...: health stays 200 when
            # it has exited, as the service itself works; a trainer reads it here and in meta_info
            "launcher_state": self.launcher.status(),
            "proxy_notifications": self.notifier.pending(),
        }

    def stats(self, conns: LazyPair | None = None) -> dict[str, Any]:
        """Per-job accounting and gauges for GET /stats."""
        job_state = self.jobs.current
        problem = self.health_state.problem()
        polls = self.serving.stats.snapshot()
        out: dict[str, Any] = {
            "job_session": job_state.job_id if job_state else None,
            "launcher": self.launcher.summary(),
            "proxy_notifications": self.notifier.pending(),
            "database": "ok" if problem is None else problem,
            "polls": {
                k: polls[k] for k in ("count", "with_data", "replayed", "seconds_total", "waiting")
            },
            "prebuilt": self.serving.prebuilt.stats(),
            "lease": self.lease.stats(),
        }
        source = None  # only the lag needs the database: with it down, the rest is still answered
        if job_state is not None and conns is not None and problem is None:
            with contextlib.suppress(StorageError):
                source = conns.get().source
        if job_state is not None:
            out.update(job_state.stats(source, self.serving.prebuilt.held(job_state)))
        return out
