"""Reading processes from Linux's /proc: the one parser of ``/proc/<pid>/stat``.

Owns: a process's state, parent, process group and start time, and the processes of a group
or of a parent. The supervisor uses it to tell a launcher from a reused pid and to find what is
left of its process group, the lease to name this host (``host_id``); the tests and benchmarks
use it to watch real processes.

It must not act on a process (no signal, no wait): it only reads.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from typing import NamedTuple


class ProcStat(NamedTuple):
    """The fields of /proc/<pid>/stat that matter here."""

    pid: int
    state: str  # field 3: R, S, D, Z (zombie), X (dead), ...
    ppid: int  # field 4
    pgrp: int  # field 5
    start_ticks: int  # field 22: start time in clock ticks since boot (pid + this = one process)

    @property
    def alive(self) -> bool:
        """Running or sleeping: neither a zombie nor dead."""
        return self.state not in ("Z", "X")


def stat(pid: int) -> ProcStat | None:
    """The process's stat, or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode("ascii", "replace")
    except OSError:
        return None
    # comm (field 2) may contain spaces and parentheses: split after the last ')'.
    rest = data[data.rfind(")") + 2 :].split()
    try:
        return ProcStat(pid, rest[0], int(rest[1]), int(rest[2]), int(rest[19]))
    except (IndexError, ValueError):
        return None


def alive(pid: int) -> bool:
    """True if the process exists and is not a zombie."""
    process = stat(pid)
    return process is not None and process.alive


def live() -> Iterator[ProcStat]:
    """Every live (non-zombie) process."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return
    for entry in entries:
        if entry.isdigit():
            process = stat(int(entry))
            if process is not None and process.alive:
                yield process


def group_members(pgid: int) -> list[int]:
    """The pids of live processes whose process group is ``pgid``."""
    return [process.pid for process in live() if process.pgrp == pgid]


def children(ppid: int) -> list[int]:
    """The pids of live processes whose parent is ``ppid``."""
    return [process.pid for process in live() if process.ppid == ppid]


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None if it is gone."""
    process = stat(pid)
    return process.start_ticks if process else None


def ticks_to_epoch(ticks: int) -> float | None:
    """A start time in ticks since boot as epoch seconds."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            for line in f:
                if line.startswith("btime "):
                    return int(line.split()[1]) + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        pass
    return None


def host_id() -> str:
    """This host as far as pids go: hostname, boot id and pid namespace. Two instances see each
    other's processes (and may adopt a launcher) only when these are equal; a container on the
    same machine has its own pid namespace, a rebooted machine a new boot id."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()[:8]
    except OSError:
        boot = "noboot"
    try:
        namespace = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        namespace = "nons"
    return f"{socket.gethostname()}/{boot}/{namespace}"


def cmdline(pid: int) -> list[str]:
    """The process's argv ([] when it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [arg.decode("utf-8", "replace") for arg in f.read().split(b"\0") if arg]
    except OSError:
        return []
