"""Hostile rows for the seeded fault soak (issue 20): what they look like, and what must happen to
them. Used by faultlib.py (the CI fault test and tests/bench/fault_soak.py).

- ``timestamp_version`` and ``negative_version``: one row of a complete group carries a weight
  version that cannot be true (a millisecond timestamp, a negative number). The soak's trainer
  reports its version (``TRAINER_VERSION``) and the service runs with ``MAX_OFF_POLICY``, so such a
  group must be dropped as ``implausible_version``, and no other group may go stale for it.
- ``control_group_id``: a group_id with a newline, a forged log line, a carriage return and a
  terminal escape. It is an ordinary group and must be served as one.
- ``control_text``: control characters and Unicode line separators in messages and the response.
  Served as written.

At the end no line of the service's log (file and console) may begin with the forged line.
"""

from __future__ import annotations

import json
import random
from typing import Any

TIMESTAMP = 1_700_000_000_000  # what a buggy environment wrote as its weight version
TRAINER_VERSION = 9  # the soak's rows have versions 0..9: the trainer reports the newest
MAX_OFF_POLICY = 9  # with TRAINER_VERSION, no plausible row of the soak is stale
MAX_VERSION_JUMP = 1000  # the service's default
FORGED_LINE = "2026-03-01 12:00:00,000 [ERROR] rollout_buffer.lease: FORGED"
KINDS = ("timestamp_version", "negative_version", "control_group_id", "control_text")
SERVICE_ENV = {"ROLLOUT_BUFFER_MAX_OFF_POLICY": str(MAX_OFF_POLICY)}


def spoil(rng: random.Random, sessions: list[list[dict[str, Any]]], kind: str) -> None:
    """Make a complete, well-formed group's rows hostile in the way ``kind`` names."""
    if kind in ("timestamp_version", "negative_version"):
        version = TIMESTAMP if kind == "timestamp_version" else -rng.randint(1, 5)
        row = rng.choice(sessions[0])
        row["env_state"] = json.dumps({"weight_version": version})
    elif kind == "control_group_id":
        gid = f"{sessions[0][0]['group_id']}\n{FORGED_LINE}\r\x1b[2K\t"
        for session in sessions:
            for row in session:
                row["group_id"] = gid
    elif kind == "control_text":
        row = rng.choice(sessions[0])
        history = json.loads(row["messages"])
        history[-1]["content"] += f"\n{FORGED_LINE}\r\x1b[31m\u2028\x7f"
        row["messages"] = json.dumps(history, ensure_ascii=rng.random() < 0.5)
        row["response"] += "\r\n\x1b[0m\u2029end"
    else:  # pragma: no cover
        raise ValueError(kind)


def version_of(env_state: Any) -> int | None:
    """A row's weight version as the soak wrote it (None: no usable one)."""
    if not env_state:
        return None
    try:
        version = json.loads(env_state).get("weight_version")
    except (ValueError, RecursionError, AttributeError):
        return None
    return version if isinstance(version, int) and not isinstance(version, bool) else None


def implausible(env_states: list[Any]) -> bool:
    """A row version the service must never accept with the trainer at TRAINER_VERSION."""
    versions = [v for v in map(version_of, env_states) if v is not None]
    return any(v < 0 or v > TRAINER_VERSION + MAX_VERSION_JUMP for v in versions)


def forged_lines(log: str) -> list[str]:
    """Lines of a log that a group_id or a row's text forged."""
    return [line for line in log.splitlines() if line.startswith(FORGED_LINE)]
