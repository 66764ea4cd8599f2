"""The supervisor against real launcher processes (tests/fakes/fake_launcher.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support import wait_until

from rollout_buffer.launcher import procfs
from rollout_buffer.launcher.supervisor import (
    LauncherError,
    LaunchSpec,
    Supervisor,
)

FAKE_LAUNCHER = Path(__file__).parent.parent / "fakes" / "fake_launcher.py"


class FakeClock:
    """A monotonic clock that only moves when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


pid_alive = procfs.alive


def poll_until(sup: Supervisor, event: str, timeout: float = 5.0) -> list[dict[str, Any]]:
    """Poll until an event named ``event`` shows up; return every event seen."""
    seen: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while not any(e["event"] == event for e in seen):
        if time.monotonic() > deadline:
            pytest.fail(f"no {event!r} event within {timeout}s; saw {seen}")
        seen.extend(sup.poll())
        time.sleep(0.02)
    return seen


def count_lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.fixture
def spec(tmp_path: Path) -> Callable[..., LaunchSpec]:
    def make(*args: str, cwd: Path | None = None) -> LaunchSpec:
        return LaunchSpec(
            # The real launcher's arguments, which the fake must ignore.
            argv=(
                sys.executable,
                str(FAKE_LAUNCHER),
                "--job-id",
                "job-1",
                "--rl-group-size",
                "8",
                "--db-path",
                "sqlite:///x.db",
                *args,
            ),
            cwd=str(cwd or tmp_path),
            env=None,
            log_path=str(tmp_path / "logs" / "launcher.log"),
        )

    return make


@pytest.fixture
def make_supervisor() -> Iterator[Callable[..., Supervisor]]:
    created: list[Supervisor] = []

    def make(**kwargs: Any) -> Supervisor:
        kwargs.setdefault("stop_grace_s", 2.0)
        sup = Supervisor(**kwargs)
        created.append(sup)
        return sup

    yield make
    for sup in created:
        sup.stop("shutdown")


@pytest.fixture
def hanging_launcher(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A fake launcher that a test starts itself (outside any supervisor, in its own session), once
    it runs; killed with its group at teardown."""
    marker = tmp_path / "starts"
    proc = subprocess.Popen(
        [sys.executable, str(FAKE_LAUNCHER), "--mode", "hang", "--marker", str(marker)],
        start_new_session=True,
    )
    try:
        wait_until(marker.exists)
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)


def test_exit0_is_reported_and_finished(make_supervisor, spec, tmp_path):
    sup = make_supervisor(restart_policy="on-failure")
    pid = sup.start(spec("--mode", "exit0"))
    events = poll_until(sup, "exited")
    assert events == [
        {"event": "exited", "pid": pid, "exit_code": 0, "will_restart": False, "stopped_by": None}
    ]
    state = sup.state()
    assert state["running"] is False
    assert state["exit_code"] == 0
    assert state["finished"] is True
    assert state["restarts"] == 0
    assert sup.poll() == []
    log = (tmp_path / "logs" / "launcher.log").read_text()
    assert f"fake launcher pid {pid} mode exit0" in log


def test_exit1_with_never_policy_is_not_restarted(make_supervisor, spec):
    sup = make_supervisor(restart_policy="never")
    sup.start(spec("--mode", "exit1"))
    events = poll_until(sup, "exited")
    assert [e["event"] for e in events] == ["exited"]
    assert events[0]["exit_code"] == 1 and events[0]["will_restart"] is False
    state = sup.state()
    assert state["exit_code"] == 1
    assert state["finished"] is True
    assert state["will_restart"] is False


def test_on_failure_restarts_with_backoff_then_gives_up(make_supervisor, spec, tmp_path):
    clock = FakeClock()
    marker = tmp_path / "starts"
    sup = make_supervisor(restart_policy="on-failure", max_restarts=2, backoff_s=0.1, clock=clock)
    sup.start(spec("--mode", "exit1", "--marker", str(marker)))

    events = poll_until(sup, "exited")
    assert events[-1]["will_restart"] is True and events[-1]["exit_code"] == 1
    state = sup.state()
    assert state["will_restart"] is True and state["finished"] is False
    # First restart after 0.1 s of (fake) time, not before.
    clock.advance(0.05)
    assert sup.poll() == []
    clock.advance(0.06)
    restarted = sup.poll()
    assert [(e["event"], e["attempt"]) for e in restarted] == [("restarted", 1)]

    events = poll_until(sup, "exited")
    assert events[-1]["will_restart"] is True
    # Second restart after 0.2 s (doubled).
    clock.advance(0.15)
    assert sup.poll() == []
    clock.advance(0.06)
    assert [(e["event"], e["attempt"]) for e in sup.poll()] == [("restarted", 2)]

    events = poll_until(sup, "gave_up")
    assert [e["event"] for e in events] == ["exited", "gave_up"]
    assert events[0]["will_restart"] is False
    clock.advance(100)
    assert sup.poll() == []
    wait_until(lambda: count_lines(marker) == 3)
    state = sup.state()
    assert state["restarts"] == 2
    assert state["finished"] is True and state["running"] is False


def test_failed_restart_is_reported(make_supervisor, spec, tmp_path):
    clock = FakeClock()
    workdir = tmp_path / "work"
    workdir.mkdir()
    sup = make_supervisor(restart_policy="on-failure", max_restarts=1, backoff_s=0.1, clock=clock)
    sup.start(spec("--mode", "exit1", cwd=workdir))
    poll_until(sup, "exited")
    workdir.rmdir()
    clock.advance(1)
    events = sup.poll()
    assert [e["event"] for e in events] == ["restart_failed", "gave_up"]
    assert "work" in events[0]["error"]
    assert sup.state()["finished"] is True


def test_stop_cancels_a_scheduled_restart(make_supervisor, spec, tmp_path):
    clock = FakeClock()
    marker = tmp_path / "starts"
    sup = make_supervisor(restart_policy="on-failure", backoff_s=0.1, clock=clock)
    sup.start(spec("--mode", "exit1", "--marker", str(marker)))
    poll_until(sup, "exited")
    state = sup.stop()
    assert state["stopped_by"] == "requested"
    assert state["will_restart"] is False and state["finished"] is True
    clock.advance(10)
    assert sup.poll() == []
    assert count_lines(marker) == 1


def test_stop_terminates_a_hanging_launcher(make_supervisor, spec, tmp_path):
    marker = tmp_path / "starts"
    sup = make_supervisor(restart_policy="on-failure")
    pid = sup.start(spec("--mode", "hang", "--marker", str(marker)))
    wait_until(marker.exists)
    assert sup.poll() == []
    assert sup.state()["running"] is True
    started = time.monotonic()
    state = sup.stop()
    assert time.monotonic() - started < 1.5
    assert state["exit_code"] == -signal.SIGTERM
    assert state["running"] is False
    assert state["stopped_by"] == "requested"
    assert state["finished"] is True and state["will_restart"] is False
    assert not pid_alive(pid)
    assert sup.poll() == [
        {
            "event": "exited",
            "pid": pid,
            "exit_code": -15,
            "will_restart": False,
            "stopped_by": "requested",
        }
    ]


def test_stop_kills_a_launcher_that_ignores_term(make_supervisor, spec, tmp_path):
    marker = tmp_path / "starts"
    sup = make_supervisor(stop_grace_s=0.5)
    pid = sup.start(spec("--mode", "ignore-term", "--marker", str(marker)))
    wait_until(marker.exists)
    state = sup.stop("shutdown")
    assert state["exit_code"] == -signal.SIGKILL
    assert state["stopped_by"] == "shutdown"
    assert procfs.group_members(pid) == []


def test_stop_kills_the_whole_process_group(make_supervisor, spec, tmp_path):
    child_file = tmp_path / "child.pid"
    sup = make_supervisor(stop_grace_s=0.5)
    pid = sup.start(spec("--mode", "spawn-child", "--child-pid-file", str(child_file)))
    wait_until(child_file.exists)
    grandchild = int(child_file.read_text())
    assert pid_alive(grandchild)
    assert sorted(procfs.group_members(pid)) == sorted([pid, grandchild])
    state = sup.stop()
    assert state["exit_code"] == -signal.SIGKILL
    assert not pid_alive(grandchild)
    assert procfs.group_members(pid) == []


def test_orphans_of_an_exited_launcher_are_killed(make_supervisor, spec, tmp_path):
    child_file = tmp_path / "child.pid"
    sup = make_supervisor()
    pid = sup.start(
        spec("--mode", "spawn-child", "--sleep", "0.3", "--child-pid-file", str(child_file))
    )
    events = poll_until(sup, "exited")
    assert events[-1]["exit_code"] == 3
    grandchild = int(child_file.read_text())
    wait_until(lambda: not pid_alive(grandchild))
    assert procfs.group_members(pid) == []


def test_stop_is_idempotent(make_supervisor, spec):
    sup = make_supervisor()
    assert sup.stop() is None
    sup.start(spec("--mode", "hang"))
    first = sup.stop("requested")
    second = sup.stop("again")
    assert second == first
    assert second["stopped_by"] == "requested"
    sup.stop("shutdown")
    assert sup.state() == first
    assert [e["event"] for e in sup.poll()] == ["exited"]


def test_start_of_missing_executable_raises(make_supervisor, tmp_path):
    sup = make_supervisor()
    missing = str(tmp_path / "no-such-launcher")
    bad = LaunchSpec(
        argv=(missing, "--job-id", "x"), cwd=None, env=None, log_path=str(tmp_path / "launcher.log")
    )
    with pytest.raises(LauncherError, match=r"no-such-launcher.*not found"):
        sup.start(bad)
    assert sup.state()["running"] is False
    assert sup.stop() is None


def test_start_with_missing_cwd_raises(make_supervisor, spec, tmp_path):
    sup = make_supervisor()
    with pytest.raises(LauncherError, match=r"cwd .*nowhere.* does not exist"):
        sup.start(spec("--mode", "exit0", cwd=tmp_path / "nowhere"))


def test_start_while_running_raises(make_supervisor, spec):
    sup = make_supervisor()
    pid = sup.start(spec("--mode", "hang"))
    with pytest.raises(LauncherError, match="already running"):
        sup.start(spec("--mode", "hang"))
    assert sup.state()["pid"] == pid
    sup.stop()
    # Once stopped, a new launcher may start.
    new_pid = sup.start(spec("--mode", "exit0"))
    assert new_pid != pid
    state = sup.state()
    assert state["stopped_by"] is None and state["restarts"] == 0


def test_adopt_watches_a_launcher_we_did_not_spawn(make_supervisor, hanging_launcher):
    proc = hanging_launcher
    ticks = procfs.start_ticks(proc.pid)
    assert ticks is not None

    sup = make_supervisor(restart_policy="on-failure")
    assert sup.adopt(proc.pid, proc.pid, ticks + 1, None) is False  # pid reused: refuse
    assert sup.adopt(proc.pid, proc.pid + 1, ticks, None) is False  # wrong group: refuse
    assert sup.adopt(proc.pid, proc.pid, ticks, None) is True
    assert sup.poll() == []
    state = sup.state()
    assert state["running"] is True and state["adopted"] is True
    assert state["pid"] == proc.pid and state["start_ticks"] == ticks

    proc.kill()
    proc.wait()
    events = poll_until(sup, "exited")
    assert events == [
        {
            "event": "exited",
            "pid": proc.pid,
            "exit_code": None,
            "will_restart": False,
            "stopped_by": None,
        }
    ]
    state = sup.state()
    assert state["running"] is False and state["finished"] is True
    assert state["exit_code"] is None


def test_stop_of_an_adopted_launcher(make_supervisor, hanging_launcher):
    proc = hanging_launcher
    sup = make_supervisor()
    assert sup.adopt(proc.pid, proc.pid, procfs.start_ticks(proc.pid), None) is True
    state = sup.stop()
    assert state["exit_code"] is None and state["stopped_by"] == "requested"
    assert proc.wait(timeout=5) == -signal.SIGTERM


def test_adopt_of_a_dead_pid_returns_false(make_supervisor):
    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    proc.wait()
    sup = make_supervisor()
    assert sup.adopt(proc.pid, proc.pid, None, None) is False
    state = sup.state()
    assert state["running"] is False and state["adopted"] is False
    assert state["finished"] is False
    assert sup.stop() is None


def test_state_is_json_serialisable(make_supervisor, spec):
    sup = make_supervisor()
    before = sup.state()
    json.dumps(before)
    assert before["pid"] is None and before["finished"] is False
    sup.start(spec("--mode", "hang"))
    running = json.loads(json.dumps(sup.state()))
    assert running["running"] is True
    assert running["argv"][1] == str(FAKE_LAUNCHER)
    assert running["log_path"].endswith("launcher.log")
    assert isinstance(running["started_at"], float)
    assert running["start_ticks"] == procfs.start_ticks(running["pid"])
    json.dumps(sup.stop())


def test_a_launcher_log_is_rotated_while_the_launcher_appends_to_it(tmp_path):
    from rollout_buffer.launcher.supervisor import rotate_log

    log = tmp_path / "launcher-j.log"
    with open(log, "ab") as out:  # the child keeps its own copy of the O_APPEND descriptor
        writer = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys, time\n"
                "for i in range(400):\n    print('x' * 99, flush=True); time.sleep(0.001)\n",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    rotations = 0
    try:
        while writer.poll() is None:
            rotations += rotate_log(str(log), max_bytes=10_000, keep=2)
    finally:
        writer.wait(30)
    assert rotations >= 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "launcher-j.log",
        "launcher-j.log.1",
        "launcher-j.log.2",
    ]
    assert (
        log.stat().st_size <= 10_000 + 100 * 50
    )  # truncated in place: the writer went on at the new end
    assert (
        (tmp_path / "launcher-j.log.1").read_bytes().startswith(b"x" * 99)
    )  # whole lines, no hole of zeros
