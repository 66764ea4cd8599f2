"""The job's launcher as the store records it: its identity read from a job row, whether that very
process still runs on this host, and the state to record for what the supervisor reports.

Owns: these readings (procfs is read; nothing is signalled, nothing is written). launcher.py acts on
them and records them.
"""

from __future__ import annotations

from typing import Any

from rollout_buffer.core.model import LauncherState
from rollout_buffer.launcher import procfs
from rollout_buffer.storage.store import LauncherRecord


def recorded(row: dict[str, Any], state: LauncherState) -> LauncherRecord:
    """The launcher recorded in a job row (pid, group, start time, host), in ``state``."""
    return LauncherRecord(
        row["launcher_pid"],
        row["launcher_pgid"],
        row["launcher_start_ticks"],
        state,
        row.get("launcher_host"),
    )


def still_running(pid: int, pgid: int, ticks: Any) -> bool:
    """The recorded process runs (not a zombie) in its group, started when it was recorded: a pid
    reused since is not it."""
    process = procfs.stat(pid)
    return bool(
        process
        and process.alive
        and process.pgrp == pgid
        and (ticks is None or process.start_ticks == int(ticks))
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
