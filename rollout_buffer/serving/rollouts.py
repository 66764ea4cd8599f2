"""``/start_rollout`` and ``/stop_rollout``: selecting the job, its launcher, and redelivery.

Owns: the answers of both calls. ``start`` waits (bounded) for the loop's bootstrap, takes the
start lock, then the tick and serve locks to swap the job (settling an uncertain poll and the
prebuilt draft first), starts the job's launcher, and queues served groups again when a call that
begins no new job brings a checkpoint's skip list; then, holding no lock, it waits out the launch
grace for a launcher that fails at once, and answers its failure instead. ``stop`` takes no lock
of the service and no database: a stuck database or a /start_rollout in progress must not keep a
launcher running past its grace. It must not serve a poll or ingest a row.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from rollout_buffer.core.config import Config
from rollout_buffer.core.errors import (
    Conflict,
    JobOwned,
    LeaseLost,
    OperationFailed,
    StorageError,
    Unavailable,
)
from rollout_buffer.launcher.launcher import Launcher
from rollout_buffer.launcher.supervisor import Supervisor
from rollout_buffer.runtime.jobs import Jobs
from rollout_buffer.runtime.lease import Lease
from rollout_buffer.runtime.locks import LOCK_WAIT_S, Locks
from rollout_buffer.runtime.loop import Health
from rollout_buffer.runtime.signals import Signals
from rollout_buffer.serving.poll import Serving
from rollout_buffer.serving.redelivery import redeliver
from rollout_buffer.storage.store import LazyPair

logger = logging.getLogger(__name__)


class Rollouts:
    """Answers /start_rollout and /stop_rollout."""

    def __init__(
        self,
        config: Config,
        *,
        jobs: Jobs,
        launcher: Launcher,
        supervisor: Supervisor,
        lease: Lease,
        locks: Locks,
        signals: Signals,
        serving: Serving,
        health: Health,
    ) -> None:
        self.config = config
        self.jobs = jobs
        self.launcher = launcher
        self.supervisor = supervisor
        self.lease = lease
        self.locks = locks
        self.signals = signals
        self.serving = serving
        self.health = health

    def start(
        self,
        conns: LazyPair,
        *,
        k: int,
        restart_training: bool,
        job_session: str | None,
        skip: list[str] | None = None,
    ) -> dict[str, Any]:
        """Select the job, start its launcher (or redeliver: see _redeliver). Returns the answer's
        body; a refusal is a RequestError (Conflict, Unavailable, OperationFailed)."""
        self.lease.check(10.0)  # LeaseLost on a standby: answered with 307 (app.standby_answer)
        if not self.signals.bootstrapped.is_set():
            # Before the active job is resumed and its launcher adopted, "not running" would be a
            # lie.
            self.signals.nudge()
            if not self.signals.bootstrapped.wait(10.0):
                raise Unavailable(
                    "the service is still loading its state from the database: "
                    f"{self.health.last_error or 'still starting'}",
                    retry_after=2,
                )
        with self.locks.starting():
            body = self._start(conns, k, restart_training, job_session, skip or [])
        if body.get("message") == "Rollout started" and body.get("pid") is not None:
            self._said_if_it_exits_at_once(body)  # (no lock held while it waits)
        return body

    def _said_if_it_exits_at_once(self, body: dict[str, Any]) -> None:
        """A launcher that fails within the launch grace makes /start_rollout an error (500: the
        client does not retry it) naming its exit code and showing its log's last lines; "Rollout
        started" sent a trainer polling forever. With a restart due (on-failure), the answer stays
        200, with a warning and the same details (``launcher_exit``)."""
        early = self.launcher.early_exit(body["pid"])
        if early is None:
            return
        job_id = body["job_session"]
        said = (
            f"the launcher exited with code {early['exit_code']} within "
            f"{self.config.launch_grace_s:g} s of its start"
        )
        logger.error("%s (job %s, log: %s)", said, job_id, early["log_path"])
        if early["will_restart"]:
            body["warning"] = f"{said}; the restart policy starts it again (see launcher_exit)"
            body["launcher_exit"] = early
            return
        raise OperationFailed(
            f"{said}; see log_tail and hints. Job {job_id!r} stays selected: POST /start_rollout "
            "again starts a new launcher for it",
            job_session=job_id,
            pid=body["pid"],
            **early,
        )

    def _start(
        self,
        conns: LazyPair,
        k: int,
        restart_training: bool,
        job_session: str | None,
        skip: list[str],
    ) -> dict[str, Any]:
        job_state = self.jobs.current
        pid = self.launcher.running_pid()  # here, or on another host
        if pid is not None:
            if job_state is not None and job_session not in (None, job_state.job_id):
                raise Conflict(
                    f"the launcher of job {job_state.job_id!r} is still running (pid "
                    f"{pid}); POST /stop_rollout first or name that job",
                    job_session=job_state.job_id,
                    pid=pid,
                )
            return {
                "message": "AIEvoBox is already running",
                "pid": pid,
                "job_session": job_state.job_id if job_state else None,
                **self._redeliver(conns, job_state, skip),
            }
        if job_session is not None and (job_state is None or job_state.job_id != job_session):
            self._check_owned(conns, job_session)  # before anything of this buffer changes
        same = (
            job_state is not None and job_state.job_id == job_session and not restart_training
        )  # no new job: redeliver
        job_id = job_session or uuid.uuid4().hex
        if self.launcher.managed:
            self.launcher.preflight(job_id, k)
        pair = conns.get()
        with self.locks.ticking(timeout=LOCK_WAIT_S), self.locks.serving():
            try:
                self.serving.settle(
                    pair, self.jobs.current
                )  # its prebuilt draft's groups go back first
                job_state = self.jobs.select(pair.source, pair.store, job_id, k, restart_training)
            except JobOwned as exc:  # selected by another buffer since _check_owned
                raise Conflict(str(exc), buffer=exc.buffer, job_session=job_id) from exc
            except StorageError as exc:
                raise (
                    exc
                    if isinstance(exc, LeaseLost)
                    else Unavailable(f"the database is unreachable: {exc}", retry_after=3)
                ) from exc
            if self.launcher.managed:
                # Until its own launcher runs, the finished one the loop sees is not this job's:
                # no launcher_exited drop for it (reset once the launcher is spawned).
                job_state.no_launcher_drop()
        self.signals.nudge()
        pid = self.launcher.start_for(
            pair.store, job_state
        )  # (None when it runs elsewhere: LAUNCHER=none)
        logger.info(
            "rollout started: job %s, K=%s, restart_training=%s, launcher pid %s",
            job_id,
            k,
            restart_training,
            pid,
        )
        return {
            "message": "Rollout started",
            "pid": pid,
            "job_session": job_id,
            "k": k,
            "restart_training": restart_training,
            "floor_pk": job_state.floor_pk,
            "launcher": self.config.launcher_kind,
            **(self._redeliver(conns, job_state, skip) if same else {}),
        }

    def _check_owned(self, conns: LazyPair, job_id: str) -> None:
        """A Conflict (409) naming the buffer when another buffer on this state database owns the
        job."""
        try:
            buffer = conns.get().store.job_buffer(job_id)
        except StorageError as exc:
            raise Unavailable(f"the database is unreachable: {exc}", retry_after=3) from exc
        if buffer is not None and buffer != self.config.buffer_name:
            raise Conflict(str(JobOwned(job_id, buffer)), buffer=buffer, job_session=job_id)

    def _redeliver(self, conns: LazyPair, job_state: Any, skip: list[str]) -> dict[str, Any]:
        """A call that began no new job, with a checkpoint's skip list: queue served groups
        again."""
        if job_state is None or not skip:
            return {}
        return redeliver(
            conns.get(),
            job_state,
            skip,
            self.locks,
            self.serving.settle,
            self.signals.ready.notify,
        )

    def stop(self) -> dict[str, Any]:
        """Stop the launcher (idempotent); the job stays selected and ready groups stay servable.

        Takes no service lock and no database (the supervisor's lock makes it safe): a stuck
        database or a /start_rollout in progress must not keep the launcher running past its
        grace."""
        self.lease.check(2.0, sure=False)
        before = self.supervisor.state()
        self.signals.ready.interrupt()  # waiting polls answer now, with whatever is ready
        self.supervisor.stop("requested")
        self.signals.nudge()
        job_state = self.jobs.current
        message = "Launcher stopped" if before["running"] else "No launcher running"
        if self.launcher.stop_elsewhere():  # (recorded by the loop: no database here)
            message = (
                "Launcher on another host recorded as stopped: an instance on its host stops it"
            )
        return {
            "message": message,
            "job_session": job_state.job_id if job_state else None,
            "launcher": self.launcher.summary(),
        }
