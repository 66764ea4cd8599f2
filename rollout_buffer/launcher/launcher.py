"""The launcher of the active job: its identity in the store, and what the service says of it.

Owns: starting, adopting and stopping it through the
:class:`~rollout_buffer.launcher.supervisor.Supervisor` (its argv is
:mod:`~rollout_buffer.launcher.command`'s), and recording each change of its state, with its host,
with the job. Across owners (issue 12): a launcher is adopted only on its own host; one on another
host is watched through what an instance there reports (``elsewhere``); a new owner relaunches one
that is gone (``relaunch_for``); a standby stops a launcher on its host that the owner, elsewhere,
cannot supervise, and reports it.

What it says: its state in a word (:func:`status`, in every poll's ``meta_info.launcher`` and in
/health, so a trainer that polls forever is told why nothing comes); for a launcher that exits in
its first seconds, the error of /start_rollout (its log's last lines, bounded, passwords redacted,
control characters escaped, and the settings the upstream launcher is known to refuse).

It must not touch groups: what a finished launcher means for them (``launcher_exited`` drops) is
the loop's decision.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import re
import subprocess
from collections.abc import Callable, Sequence
from typing import Any

from rollout_buffer.core.config import Config
from rollout_buffer.core.errors import OperationFailed, StorageError
from rollout_buffer.core.model import LauncherState
from rollout_buffer.core.redact import redact
from rollout_buffer.launcher import procfs
from rollout_buffer.launcher.command import ModelRoute, launch_spec, llm_base_url
from rollout_buffer.launcher.supervisor import (
    START_MARK,
    LauncherError,
    Supervisor,
    preflight,
    shown,
    still_running,
    terminate_group,
)
from rollout_buffer.storage.store import LauncherRecord, Store

logger = logging.getLogger(__name__)

SUMMARY_KEYS = (
    "running",
    "pid",
    "exit_code",
    "restarts",
    "restart_policy",
    "stopped_by",
    "adopted",
    "will_restart",
    "finished",
    "started_at",
    "exited_at",
    "log_path",
)


class Launcher:
    """The active job's launcher process and its durable record."""

    def __init__(
        self, config: Config, supervisor: Supervisor, instance_id: str, host_id: str | None = None
    ) -> None:
        self.config = config
        self.supervisor = supervisor
        self.instance_id = instance_id  # recorded as the launcher's owner
        self.host_id = host_id or config.host_id or procfs.host_id()
        # the job's launcher, recorded running on another host
        self.elsewhere: LauncherRecord | None = None
        self.ended_elsewhere = False  # ... and since reported gone or recorded stopped
        # a job whose launcher was lost with its owner: start a fresh one
        self.relaunch_for: str | None = None
        self._stop_due = False  # /stop_rollout of a launcher elsewhere, not recorded yet
        # our children another owner took over (reaped)
        self._released: list[subprocess.Popen[bytes]] = []
        # where its model calls go: the LLM proxy, unless the composition root routes them
        # (pacing: through the gate); raises OperationFailed when no launcher may start now
        self.route: Callable[[], ModelRoute] = ModelRoute
        self._url: tuple[int, str | None] = (0, None)  # (pid, its --llm-base-url)

    @property
    def managed(self) -> bool:
        """False with ROLLOUT_BUFFER_LAUNCHER=none: the launcher runs elsewhere."""
        return self.config.launcher_kind != "none"

    def summary(self) -> dict[str, Any]:
        """What /health and /stats show of it (``elsewhere``: one on another host, not supervised
        here)."""
        state = self.supervisor.state()
        out = {key: state.get(key) for key in SUMMARY_KEYS}
        out["host"] = self.host_id if state.get("pid") else None
        remote = self.elsewhere
        out["elsewhere"] = (
            None
            if remote is None
            else {
                "host": remote.host,
                "pid": remote.pid,
                "state": "ended"
                if self.ended_elsewhere
                else "unknown: it runs on another host; an instance there reports it, or stops it "
                "when it is not the owner's",
            }
        )
        return out

    def status(self) -> dict[str, Any]:
        """The launcher in a word (:func:`status`): every poll's meta_info and /health."""
        elsewhere = None
        if self.elsewhere is not None:
            elsewhere = "exited" if self.ended_elsewhere else "running_elsewhere"
        return status(self.supervisor.state(), managed=self.managed, elsewhere=elsewhere)

    def early_exit(self, pid: int) -> dict[str, Any] | None:
        """Wait up to LAUNCH_GRACE_S (no lock held) for the launcher just started to
        fail. If it exited nonzero (or was killed): its exit code, its log's last lines, what its
        flags say, and whether the restart policy starts it again. An exit 0 is a launcher that
        had little to do: no failure."""
        exited, code = self.supervisor.wait_exit(pid, self.config.launch_grace_s)
        state = self.supervisor.state()
        if not exited or code == 0 or state["stopped_by"]:  # (a /stop_rollout, a shutdown)
            return None
        argv = state["argv"] or []
        return {
            "exit_code": code,
            "log_tail": log_tail(state["log_path"]),
            "log_path": state["log_path"],
            "argv": argv,
            "hints": hints(self.config.launcher_kind, argv),
            "will_restart": state["will_restart"],
        }

    def llm_base_url(self) -> str | None:
        """The ``--llm-base-url`` of the launcher running here, spawned or adopted (from /proc:
        an adopted one was started by another instance), or None."""
        state = self.supervisor.state()
        pid = state["pid"] if state["running"] else None
        if pid is None:
            return None
        if self._url[0] != pid:
            self._url = (pid, llm_base_url(procfs.cmdline(pid)))
        return self._url[1]

    def running_pid(self) -> int | None:
        """The pid of the job's launcher while it runs here, or may still run on another host."""
        state = self.supervisor.state()
        if state["running"]:
            return int(state["pid"])
        return self.elsewhere.pid if self.elsewhere is not None and self.runs_elsewhere() else None

    def runs_elsewhere(self) -> bool:
        """A launcher of the job may still run on another host (so /start_rollout must not start
        one)."""
        return self.elsewhere is not None and not self.ended_elsewhere

    def record(self, store: Store, job_id: str, state: LauncherState) -> None:
        """Store the current process identity with the job, in the given state."""
        current = self.supervisor.state()
        store.save_launcher(
            job_id,
            LauncherRecord(
                current["pid"], current["pgid"], current["start_ticks"], state, self.host_id
            ),
            self.instance_id,
        )

    def preflight(self, job_id: str, k: int) -> None:
        """A 500 now, before the job is switched, for a launcher that surely cannot start: the
        active job and its pending and ready groups must not be given up for it."""
        spec = launch_spec(self.config, job_id, k, self.route())
        try:
            preflight(spec)
        except LauncherError as exc:
            logger.error("cannot start the launcher for job %s: %s", job_id, redact(str(exc)))
            raise OperationFailed(
                f"the launcher could not be started: {redact(str(exc))}; the active job is "
                "unchanged",
                job_session=job_id,
                argv=shown(spec.argv),
            ) from exc

    def start(self, store: Store, job_id: str, k: int) -> int:
        """Spawn the job's launcher and record it; a failure is a 500 that says why."""
        spec = launch_spec(self.config, job_id, k, self.route())
        try:
            pid = self.supervisor.start(spec)
        except LauncherError as exc:
            logger.error("cannot start the launcher for job %s: %s", job_id, redact(str(exc)))
            raise OperationFailed(
                f"the launcher could not be started: {redact(str(exc))}",
                job_session=job_id,
                argv=shown(spec.argv),
            ) from exc
        try:
            self.record(store, job_id, LauncherState.RUNNING)
        except StorageError:
            # LeaseLost above all: not ours to run, and unrecorded it would be lost
            self.supervisor.stop("requested")
            raise
        self.elsewhere, self.ended_elsewhere, self.relaunch_for, self._stop_due = (
            None,
            False,
            None,
            False,
        )
        return pid

    def want_relaunch(self, job_id: str) -> None:
        """The job's launcher was stopped for this owner (handed over): a fresh one is due here once
        its incomplete groups are dropped."""
        self.relaunch_for = job_id

    def cancel_relaunch(self) -> None:
        """A fresh launcher could not be started: not retried (the error was logged)."""
        self.relaunch_for = None

    def start_for(self, store: Store, job_state: Any) -> int | None:
        """/start_rollout and a relaunch: start the job's launcher (none with LAUNCHER=none); the
        loop's view of the previous one's end (``job_state``: the JobState) starts over with it."""
        if not self.managed:
            return None
        pid = self.start(store, job_state.job_id, job_state.k)
        job_state.launcher_started()
        return pid

    def resume_restart(self, store: Store, job_id: str, k: int, row: dict[str, Any]) -> bool:
        """After a restart: a launcher whose on-failure restart was pending when the service went
        down is started now (the backoff had begun; the restart count starts again)."""
        if (
            LauncherState.parse(row.get("launcher_state")) is not LauncherState.RESTART_PENDING
            or not self.managed
        ):
            return False
        if self.config.restart_policy != "on-failure":
            return False
        logger.warning(
            "the launcher of job %s was due for an on-failure restart when the service stopped; "
            "starting it now",
            job_id,
        )
        try:
            self.start(store, job_id, k)
        except OperationFailed as exc:
            logger.error("could not restart the launcher of job %s: %s", job_id, exc.message)
            self.record(store, job_id, LauncherState.EXITED)
            return False
        return True

    def adopt(self, store: Store, job_id: str, row: dict[str, Any]) -> bool | None:
        """After a restart: adopt the job's recorded launcher if it still runs.

        Returns True (adopted), False (it ended while the service was down: recorded as exited, and
        a fresh one is due: ``relaunch_for``), or None (nothing was running here; one recorded on
        another host is watched instead: ``elsewhere``)."""
        state = LauncherState.parse(row.get("launcher_state"))
        if not row.get("launcher_pid") or state is not LauncherState.RUNNING:
            return None
        host = row.get("launcher_host")
        if host is not None and host != self.host_id:
            self.elsewhere = recorded(row, LauncherState.RUNNING)
            self.ended_elsewhere = False
            logger.warning(
                "the launcher of job %s (pid %s) runs on host %s, not here: it is left alone, its "
                "rows are served, and a fresh one starts here once an instance on that host "
                "reports it gone",
                job_id,
                row["launcher_pid"],
                host,
            )
            return None
        current = self.supervisor.state()
        if current["running"] and current["pid"] == int(row["launcher_pid"]):
            # A bootstrap retried after it had adopted this very process but failed to record it:
            # the supervisor's refusal to adopt twice must not be taken for a launcher that is gone.
            self.record(store, job_id, LauncherState.RUNNING)
            return True
        adopted = False
        with contextlib.suppress(LauncherError):
            adopted = self.supervisor.adopt(
                int(row["launcher_pid"]),
                int(row["launcher_pgid"]),
                row["launcher_start_ticks"],
                None,
            )
        if not adopted:
            logger.warning(
                "launcher pid %s of job %s is gone: it ended while the service was down",
                row["launcher_pid"],
                job_id,
            )
            store.save_launcher(
                job_id, recorded(row, LauncherState.EXITED), row.get("launcher_owner")
            )
            if self.managed:
                self.relaunch_for = job_id
        else:
            # ours now: the previous owner must not stop it
            self.record(store, job_id, LauncherState.RUNNING)
        return adopted

    def check_elsewhere(self, store: Store, job_id: str, reports: list[str | None]) -> None:
        """(Owner) The launcher on another host is gone once an instance there reports it so:
        recorded as exited, and a fresh one is due here (``relaunch_for``)."""
        remote = self.elsewhere
        if (
            remote is None
            or self.ended_elsewhere
            or f"{remote.pid}:{remote.start_ticks}:gone" not in reports
        ):
            return
        store.save_launcher(
            job_id,
            dataclasses.replace(remote, state=LauncherState.EXITED),
            None,
        )
        self.ended_elsewhere = True
        self.relaunch_for = job_id if self.managed else None
        logger.warning(
            "the launcher of job %s (pid %s on host %s) is gone, as an instance there reports: its "
            "incomplete groups are dropped and a fresh launcher starts here",
            job_id,
            remote.pid,
            remote.host,
        )

    def stop_elsewhere(self) -> bool:
        """(Owner, /stop_rollout) A launcher on another host cannot be signalled from here: it
        counts as stopped now, the loop records it so (``check``), and an instance on its host stops
        it (``watch_here``). True if there was one. No database here: a stuck one must not hold it
        up."""
        if not self.runs_elsewhere():
            return False
        self.ended_elsewhere, self.relaunch_for, self._stop_due = True, None, True
        return True

    def let_go(self) -> None:
        """This instance lost the job: forget the launcher without signalling it (a new owner on
        this host adopts it; for one elsewhere, ``watch_here`` stops it) and whatever was due for
        it."""
        proc = self.supervisor.release()
        if proc is not None:
            self._released.append(proc)
        self.elsewhere, self.ended_elsewhere, self.relaunch_for, self._stop_due = (
            None,
            False,
            None,
            False,
        )

    def watch_here(self, row: dict[str, Any] | None, owner_host: str | None) -> str | None:
        """(Not the owner) The job's launcher, if it is recorded on this host: stopped when nobody
        can supervise it (the owner is on another host, or it is recorded as not running yet runs),
        and reported as ``pid:start_ticks:alive|gone`` for the owner."""
        self._released = [p for p in self._released if p.poll() is None]  # reap what has ended
        if row is None or not row.get("launcher_pid") or row.get("launcher_host") != self.host_id:
            return None
        pid, pgid, ticks = (
            int(row["launcher_pid"]),
            int(row["launcher_pgid"]),
            row["launcher_start_ticks"],
        )
        alive = still_running(pid, pgid, ticks)
        running = LauncherState.parse(row.get("launcher_state")) is LauncherState.RUNNING
        if alive and (not running or owner_host not in (None, self.host_id)):
            logger.warning(
                "stopping launcher pid %s of job %s on this host: %s",
                pid,
                row["job_id"],
                "the owner is on another host and cannot supervise it"
                if running
                else f"it is recorded as {row.get('launcher_state')} yet runs",
            )
            proc = next((p for p in self._released if p.pid == pid), None)
            terminate_group(proc, pid, pgid, ticks, self.config.stop_grace_s)
            alive = False
        return f"{pid}:{ticks}:{'alive' if alive else 'gone'}"

    def owned_elsewhere(self, store: Store, job_id: str) -> bool:
        """True when another instance has adopted this job's launcher since we started or adopted
        it."""
        owner = store.launcher_owner(job_id)
        return owner is not None and owner != self.instance_id

    def check(self, store: Store, job_id: str) -> None:
        """Act on the supervisor's events (exits, restarts): record each new state; and a stop of a
        launcher on another host (/stop_rollout), until it is recorded."""
        remote = self.elsewhere
        if self._stop_due and remote is not None:
            store.save_launcher(
                job_id,
                dataclasses.replace(remote, state=LauncherState.STOPPED_REQUESTED),
                None,
            )
            self._stop_due = False
        for event in self.supervisor.poll():
            kind = event.get("event")
            state = self.supervisor.state()
            if kind in ("exited", "restarted", "gave_up"):
                self.record(store, job_id, state_to_record(state))
            if (
                kind == "exited"
                and event.get("exit_code") not in (0, None)
                and not event.get("stopped_by")
            ):
                logger.error(
                    "launcher of job %s exited with code %s (log: %s)",
                    job_id,
                    event.get("exit_code"),
                    state.get("log_path"),
                )

    def stop_for_shutdown(
        self,
        conns: Any,
        job_id: str | None,
        standbys: Callable[[Any], set[str]],
        keep: bool = False,
    ) -> None:
        """The service shuts down: stop the launcher (TERM, grace, KILL) and record it, unless the
        worker is going down unasked (``keep``: the next worker adopts it), another instance has
        adopted it meanwhile, or a standby on this host will (a rolling update): then it is not ours
        to kill. Stopped for a standby on another host (``standbys(conns)``: their hosts), it is
        recorded as handed over: that one starts a fresh launcher."""
        pid = self.supervisor.state()["pid"]
        if keep:
            logger.warning(
                "the worker is going down unasked: launcher pid %s is left running for the next "
                "worker to adopt",
                pid,
            )
            return
        store, elsewhere = None, False
        with contextlib.suppress(StorageError):
            store = conns.get().store
            elsewhere = job_id is not None and self.owned_elsewhere(store, job_id)
        standby_hosts = standbys(conns)
        if elsewhere or self.host_id in standby_hosts:
            logger.warning(
                "not stopping launcher pid %s of job %s: %s",
                pid,
                job_id,
                "another instance adopted it"
                if elsewhere
                else "the standby on this host takes the job and the launcher over",
            )
            return
        self.supervisor.stop("shutdown")
        if job_id is not None and store is not None:
            with contextlib.suppress(StorageError):
                self.record(
                    store,
                    job_id,
                    LauncherState.HANDED_OVER if standby_hosts else LauncherState.STOPPED_SHUTDOWN,
                )

    def finished(self) -> bool:
        """The launcher has ended and will not be restarted (a shutdown of ours does not count),
        here or on another host."""
        state = self.supervisor.state()
        return bool(
            self.managed
            and (self.ended_elsewhere or (state["finished"] and state["stopped_by"] != "shutdown"))
        )


# -- the job row's launcher ------------------------------------------------------------------------


def recorded(row: dict[str, Any], state: LauncherState) -> LauncherRecord:
    """The launcher recorded in a job row (pid, group, start time, host), in ``state``."""
    return LauncherRecord(
        row["launcher_pid"],
        row["launcher_pgid"],
        row["launcher_start_ticks"],
        state,
        row.get("launcher_host"),
    )


def state_to_record(state: dict[str, Any]) -> LauncherState:
    """What to record after the supervisor reports an exit, a restart or that it gave up."""
    if state["running"]:
        return LauncherState.RUNNING
    if state["will_restart"]:
        return LauncherState.RESTART_PENDING
    if state["stopped_by"] == "shutdown":
        return LauncherState.STOPPED_SHUTDOWN
    if state["stopped_by"]:
        return LauncherState.STOPPED_REQUESTED
    return LauncherState.EXITED


# -- what the service says of it -------------------------------------------------------------------

TAIL_LINES = 20
TAIL_BYTES = 64 * 1024  # what is read from the end of the log for its last lines
LINE_CHARS = 500  # a longer line is cut: a launcher may print a whole prompt on one line
#: The storage types the upstream launcher accepts (SPEC §6): SQLite, or its proprietary gateway.
UPSTREAM_STORAGE_TYPES = ("sqlite", "cloud")
# C0 (but tab), DEL, C1, and the bidirectional overrides that make a line read otherwise
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def escaped(line: str) -> str:
    """A log line safe to show: control characters (a terminal's escapes too) as ``\\xNN`` (or
    ``\\uNNNN``)."""
    return _CONTROL.sub(lambda m: ascii(m.group())[1:-1], line)


def log_tail(path: str | None, lines: int = TAIL_LINES) -> list[str]:
    """The last ``lines`` lines the launcher wrote since its last start, redacted and escaped; []
    when the log cannot be read (its absence is not the error being reported)."""
    if not path:
        return []
    try:
        with open(path, "rb") as log:
            log.seek(0, os.SEEK_END)
            size = log.tell()
            log.seek(max(0, size - TAIL_BYTES))
            data = log.read()
    except OSError:
        return []
    text = data.decode("utf-8", errors="replace").splitlines()
    if size > TAIL_BYTES and text:
        text = text[1:]  # the first line read is most likely cut
    for i in range(len(text) - 1, -1, -1):  # what this start wrote: from its marker line on
        if text[i].startswith(START_MARK):
            text = text[i:]
            break
    return [redact(escaped(line))[:LINE_CHARS] for line in text[-lines:]]


def hints(kind: str, argv: Sequence[str]) -> list[str]:
    """What the launcher's own flags say about why it could not run, for the upstream launcher
    (``aievobox``, or a command that passes its flags)."""
    if kind not in ("aievobox", "command"):
        return []
    flags = dict(itertools.pairwise(argv))  # a flag's value follows it (the last one wins)
    out = []
    storage = flags.get("--storage-type")
    if storage is not None and storage not in UPSTREAM_STORAGE_TYPES:
        out.append(
            f"--storage-type {storage}: the upstream launcher accepts only sqlite or cloud (its "
            "gateway) and exits 2 on anything else; it writes no Postgres. Give it a SQLite "
            "AIEVOBOX_DB_URL; Postgres serves the service's own state "
            "(ROLLOUT_BUFFER_STATE_DB_URL) and writers that write Postgres"
        )
    if flags.get("--env-transport") == "http":
        out.append(
            "--env-transport http: the launcher serves environments through an HTTP server that "
            "needs Ray; without Ray, set AIEVOBOX_ENV_TRANSPORT=inproc (environments run in the "
            "launcher's process and need nothing more)"
        )
    return out


def status(state: dict[str, Any], *, managed: bool, elsewhere: str | None) -> dict[str, Any]:
    """The launcher in a word, for every poll's meta_info and /health: ``running``, ``restarting``,
    ``exited`` (by itself: with its exit code, None when unknown), ``stopped`` (asked to, or the
    service shut down), ``not_started``, ``unmanaged`` (it runs elsewhere: LAUNCHER=none), or,
    for one on another host, ``running_elsewhere``/``exited``."""
    if not managed:
        return {"state": "unmanaged"}
    if elsewhere is not None:
        return {"state": elsewhere, "exit_code": None}
    out: dict[str, Any] = {"pid": state.get("pid"), "exit_code": state.get("exit_code")}
    if state.get("running"):
        out["state"] = "running"
    elif state.get("will_restart"):
        out["state"] = "restarting"
    elif state.get("pid") is None:
        out["state"] = "not_started"
    elif state.get("stopped_by"):
        out["state"], out["stopped_by"] = "stopped", state["stopped_by"]
    else:
        out["state"] = "exited"
        out["exited_at"] = state.get("exited_at")
        out["log_path"] = state.get("log_path")
    return out
