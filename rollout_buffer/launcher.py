"""The launcher of the active job: its argv from configuration, and its identity in the store.

Owns: building the command (SPEC §5: an argv list from configuration plus the validated job id
and K, never a shell string), starting, adopting and stopping it through the
:class:`~rollout_buffer.supervisor.Supervisor`, and recording each change of its state with the
job. It must not touch groups: what a finished launcher means for them (``launcher_exited``
drops) is the loop's decision.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Any

from .config import Config
from .db import redact
from .errors import ApiError, StorageError
from .model import LauncherState
from .store import LauncherRecord, Store
from .supervisor import LaunchSpec, LauncherError, Supervisor, shown

logger = logging.getLogger(__name__)

LAUNCHER_ENV_DROP = ("ROLLOUT_BUFFER_TOKEN",)
SUMMARY_KEYS = ("running", "pid", "exit_code", "restarts", "restart_policy", "stopped_by", "adopted",
                "will_restart", "finished", "started_at", "exited_at", "log_path")


def launch_spec(config: Config, job_id: str, k: int) -> LaunchSpec:
    """The launcher command for a job, from configuration only (argv list, never a shell).

    With over-sampling the launcher runs K + N sessions per group (its --rl-group-size and
    ``{k}``); the buffer serves the first K of each group to complete."""
    c = config
    k += c.oversample
    # the service's own secrets stay with the service: the launcher needs none of them
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV_DROP}
    env["PYTHONUNBUFFERED"] = "1"
    log_path = os.path.join(c.run_dir, f"launcher-{job_id}.log")
    kind = c.launcher_kind
    if kind == "command":
        subs = {"job_id": job_id, "k": str(k), "db_url": c.db_url, "storage_type": c.storage_type}
        argv = [a.format(**subs) for a in (c.launcher_cmd or ())]  # templates are validated by Config
        if "--job-id" not in argv:
            argv += ["--job-id", job_id]
        if "--rl-group-size" not in argv:
            argv += ["--rl-group-size", str(k)]
        return LaunchSpec(tuple(argv), c.aievobox_root or None, env, log_path)
    if kind == "simulate":
        argv = [sys.executable, "-m", "rollout_buffer.simulate", "--db-path", c.db_url, "--storage-type",
                c.storage_type, "--job-id", job_id, "--rl-group-size", str(k), "--pool-size",
                str(c.pool_size), "--rl-epoch", str(c.rl_epoch)]
        argv += list(c.simulate_args or ())
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (os.path.dirname(os.path.dirname(os.path.abspath(__file__))), env.get("PYTHONPATH")) if p)
        return LaunchSpec(tuple(argv), None, env, log_path)
    root = c.aievobox_root or "."
    if c.env_config:
        env_args = ["--env-config", c.env_config]
    elif c.env_root:
        env_args = ["--env-root", c.env_root]
    else:
        raise ApiError(500, "the AIEvoBox launcher needs AIEVOBOX_ENV_CONFIG or AIEVOBOX_ENV_ROOT; neither is set")
    proxy = f"http://{c.proxy_host}:{c.proxy_port}/v1" if c.proxy_host else "http://127.0.0.1:8000/v1"
    argv = ["python3", os.path.join(root, "launcher.py"), "--mode", c.aievobox_mode, "--db-path", c.db_url,
            "--storage-type", c.storage_type, *env_args, "--llm-base-url", proxy, "--llm-model",
            c.rl_model, "--llm-temperature", str(c.llm_temperature), "--max-steps", str(c.max_steps),
            "--message-cut", str(c.message_cut), "--pool-size", str(c.pool_size), "--multiplier",
            str(c.multiplier), "--job-id", job_id, "--no-rebuild-table", "--rl-use-session-suffix-url",
            "--rl-group-size", str(k), "--rl-epoch", str(c.rl_epoch), "--env-transport", c.env_transport,
            "--env-http-timeout-s", "600"]
    return LaunchSpec(tuple(argv), root, env, log_path)


class Launcher:
    """The active job's launcher process and its durable record."""

    def __init__(self, config: Config, supervisor: Supervisor, instance_id: str) -> None:
        self.config = config
        self.supervisor = supervisor
        self.instance_id = instance_id  # recorded as the launcher's owner

    @property
    def managed(self) -> bool:
        """False with ROLLOUT_BUFFER_LAUNCHER=none: the launcher runs elsewhere."""
        return self.config.launcher_kind != "none"

    def state(self) -> dict[str, Any]:
        return self.supervisor.state()

    def summary(self) -> dict[str, Any]:
        """What /health and /stats show of it."""
        state = self.supervisor.state()
        return {k: state.get(k) for k in SUMMARY_KEYS}

    def record(self, store: Store, job_id: str, state: LauncherState) -> None:
        """Store the current process identity with the job, in the given state."""
        s = self.supervisor.state()
        store.save_launcher(job_id, LauncherRecord(s["pid"], s["pgid"], s["start_ticks"], state), self.instance_id)

    def preflight(self, job_id: str, k: int) -> None:
        """A 500 now, before the job is switched, for a launcher that surely cannot start: the active
        job and its pending and ready groups must not be given up for it."""
        spec = launch_spec(self.config, job_id, k)
        try:
            self.supervisor.preflight(spec)
        except LauncherError as exc:
            logger.error("cannot start the launcher for job %s: %s", job_id, redact(str(exc)))
            raise ApiError(500, f"the launcher could not be started: {redact(str(exc))}; the active job is "
                           "unchanged", job_session=job_id, argv=shown(spec.argv)) from exc

    def start(self, store: Store, job_id: str, k: int) -> int:
        """Spawn the job's launcher and record it; a failure is a 500 that says why."""
        spec = launch_spec(self.config, job_id, k)
        try:
            pid = self.supervisor.start(spec)
        except LauncherError as exc:
            logger.error("cannot start the launcher for job %s: %s", job_id, redact(str(exc)))
            raise ApiError(500, f"the launcher could not be started: {redact(str(exc))}", job_session=job_id,
                           argv=shown(spec.argv)) from exc
        self.record(store, job_id, LauncherState.RUNNING)
        return pid

    def resume_restart(self, store: Store, job_id: str, k: int, row: dict[str, Any]) -> bool:
        """After a restart: a launcher whose on-failure restart was pending when the service went
        down is started now (the backoff had begun; the restart count starts again)."""
        if LauncherState.parse(row.get("launcher_state")) is not LauncherState.RESTART_PENDING or not self.managed:
            return False
        if self.config.restart_policy != "on-failure":
            return False
        logger.warning("the launcher of job %s was due for an on-failure restart when the service stopped; "
                       "starting it now", job_id)
        try:
            self.start(store, job_id, k)
        except ApiError as exc:
            logger.error("could not restart the launcher of job %s: %s", job_id, exc.message)
            self.record(store, job_id, LauncherState.EXITED)
            return False
        return True

    def adopt(self, store: Store, job_id: str, row: dict[str, Any]) -> bool | None:
        """After a restart: adopt the job's recorded launcher if it still runs.

        Returns True (adopted), False (it ended while the service was down: recorded as exited),
        or None (nothing was running)."""
        state = LauncherState.parse(row.get("launcher_state"))
        if not row.get("launcher_pid") or state is not LauncherState.RUNNING:
            return None
        current = self.supervisor.state()
        if current["running"] and current["pid"] == int(row["launcher_pid"]):
            # A bootstrap retried after it had adopted this very process but failed to record it:
            # the supervisor's refusal to adopt twice must not be taken for a launcher that is gone.
            self.record(store, job_id, LauncherState.RUNNING)
            return True
        adopted = False
        with contextlib.suppress(LauncherError):
            adopted = self.supervisor.adopt(int(row["launcher_pid"]), int(row["launcher_pgid"]),
                                            row["launcher_start_ticks"], None)
        if not adopted:
            logger.warning("launcher pid %s of job %s is gone: it ended while the service was down",
                           row["launcher_pid"], job_id)
            store.save_launcher(job_id, LauncherRecord(row["launcher_pid"], row["launcher_pgid"],
                                                       row["launcher_start_ticks"], LauncherState.EXITED),
                                row.get("launcher_owner"))
        else:
            self.record(store, job_id, LauncherState.RUNNING)  # ours now: the previous owner must not stop it
        return adopted

    def owned_elsewhere(self, store: Store, job_id: str) -> bool:
        """True when another instance has adopted this job's launcher since we started or adopted it."""
        owner = store.launcher_owner(job_id)
        return owner is not None and owner != self.instance_id

    def check(self, store: Store, job_id: str) -> None:
        """Act on the supervisor's events (exits, restarts): record each new state."""
        for ev in self.supervisor.poll():
            kind = ev.get("event")
            state = self.supervisor.state()
            if kind in ("exited", "restarted", "gave_up"):
                if state["running"]:
                    label = LauncherState.RUNNING
                elif state["will_restart"]:
                    label = LauncherState.RESTART_PENDING
                elif state["stopped_by"] == "shutdown":
                    label = LauncherState.STOPPED_SHUTDOWN
                elif state["stopped_by"]:
                    label = LauncherState.STOPPED_REQUESTED
                else:
                    label = LauncherState.EXITED
                self.record(store, job_id, label)
            if kind == "exited" and ev.get("exit_code") not in (0, None) and not ev.get("stopped_by"):
                logger.error("launcher of job %s exited with code %s (log: %s)", job_id, ev.get("exit_code"),
                             state.get("log_path"))

    def stop_for_shutdown(self, conns: Any, job_id: str | None) -> None:
        """The service shuts down: stop the launcher (TERM, grace, KILL) and record it, unless
        another instance has adopted it meanwhile (a rolling update): then it is not ours to kill."""
        store, elsewhere = None, False
        with contextlib.suppress(StorageError):
            store = conns.get().store
            elsewhere = job_id is not None and self.owned_elsewhere(store, job_id)
        if elsewhere:
            logger.warning("not stopping launcher pid %s of job %s: another instance adopted it",
                           self.supervisor.state()["pid"], job_id)
            return
        self.supervisor.stop("shutdown")
        if job_id is not None and store is not None:
            with contextlib.suppress(StorageError):
                self.record(store, job_id, LauncherState.STOPPED_SHUTDOWN)

    def finished(self) -> bool:
        """The launcher has ended and will not be restarted (a shutdown of ours does not count)."""
        state = self.supervisor.state()
        return bool(self.managed and state["finished"] and state["stopped_by"] != "shutdown")

    def stop(self, reason: str) -> dict[str, Any] | None:
        return self.supervisor.stop(reason)
