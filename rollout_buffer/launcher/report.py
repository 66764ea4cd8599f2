"""What the service says about its launcher: its state in a word, how it ended, its log's last
lines, and the settings the upstream launcher is known to refuse.

A launcher that exits within its first seconds turns /start_rollout into an error carrying
:func:`early_exit`'s answer; one that ends later is shown by :func:`status` in every poll's
``meta_info.launcher`` and in /health, so a trainer that polls forever is told why nothing comes.

Owns: reading the tail of the launcher's log (bounded, passwords redacted, control characters
escaped), the compact state, and the hints. It must not start, wait for or stop the process (the
supervisor does), nor touch the store.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Sequence
from typing import Any

from rollout_buffer.core.redact import redact
from rollout_buffer.launcher.spawn import START_MARK

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
