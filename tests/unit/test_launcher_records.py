"""The launcher as the store records it (launcher.launcher, launcher.supervisor): no process is
started or signalled."""

from __future__ import annotations

import os

import pytest

from rollout_buffer.core.model import LauncherState
from rollout_buffer.launcher import procfs
from rollout_buffer.launcher.launcher import recorded, state_to_record
from rollout_buffer.launcher.supervisor import still_running

IDLE = {"running": False, "will_restart": False, "stopped_by": None}


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        ({**IDLE, "running": True}, LauncherState.RUNNING),
        ({**IDLE, "will_restart": True}, LauncherState.RESTART_PENDING),
        ({**IDLE, "stopped_by": "shutdown"}, LauncherState.STOPPED_SHUTDOWN),
        ({**IDLE, "stopped_by": "requested"}, LauncherState.STOPPED_REQUESTED),
        (IDLE, LauncherState.EXITED),
    ],
)
def test_the_state_recorded_for_what_the_supervisor_reports(state, expected):
    assert state_to_record(state) is expected


def test_a_job_row_gives_the_recorded_launcher_in_the_state_asked():
    row = {"launcher_pid": 7, "launcher_pgid": 7, "launcher_start_ticks": 99, "launcher_host": "h"}
    record = recorded(row, LauncherState.EXITED)
    assert (record.pid, record.pgid, record.start_ticks, record.state, record.host) == (
        7,
        7,
        99,
        LauncherState.EXITED,
        "h",
    )


def test_only_the_very_process_recorded_still_runs():
    me = procfs.stat(os.getpid())
    assert me is not None
    assert still_running(me.pid, me.pgrp, me.start_ticks)
    assert still_running(me.pid, me.pgrp, None)  # recorded before start times were
    assert not still_running(me.pid, me.pgrp, me.start_ticks + 1)  # the pid was reused since
    assert not still_running(me.pid, me.pgrp + 1, me.start_ticks)  # another group
