"""One launcher row as an export step, and a group's rows as its sessions (the export format's
inner records; ``rollout_buffer.tools.export`` streams the groups).

Owns: how each column of a row is written (numbers that are not finite as their text, bytes
decoded with replacement, the stored history as a JSON list when it is one, else as its raw text),
and the order of sessions and steps. Pure values: no I/O.
"""

from __future__ import annotations

import collections
import json
import math
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from rollout_buffer.core.items import (
    COMPLETED,
    CREATED,
    ENV_STATE,
    MESSAGES,
    RESPONSE,
    SID,
    STEP,
    STEP_REWARD,
    TRUNCATED,
    Malformed,
    epoch,
    weight_version,
)
from rollout_buffer.storage import queries as q

# Positions of queries.EXPORT_EXTRA_COLUMNS after BODY_COLUMNS.
ENV_NAME, LLM_MODEL, CUM_REWARD, TERMINAL = range(len(q.BODY_COLUMNS), len(q.BODY_COLUMNS) + 4)


def json_number(value: Any) -> Any:
    """A JSON number, or the text of a value that is not a finite one ('nan', 'inf', ...)."""
    if value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value)
    if not math.isfinite(number):
        return str(number)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else number


def text_of(value: Any) -> str | None:
    """A stored value as text (bytes decoded with replacement, timestamps in ISO form)."""
    if value is None:
        return None
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8", "replace")
    if isinstance(value, datetime):
        return value.isoformat(sep=" ")
    return str(value)


def _messages(raw: Any) -> dict[str, Any]:
    """{"messages": list} when the stored history is a JSON list, else {"messages": None,
    "messages_text": raw}."""
    text = text_of(raw)
    if text is None:
        return {"messages": None, "messages_text": None}
    try:
        value = json.loads(text, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
        if isinstance(value, list):
            return {"messages": value}
    except (ValueError, RecursionError):
        pass
    return {"messages": None, "messages_text": text}


def _weight_version(env_state: Any) -> int | None:
    try:
        return weight_version(env_state)
    except Malformed:
        return None


def step_record(row: Sequence[Any], outcome: str, reason: str | None) -> dict[str, Any]:
    """One launcher row as an export step."""
    try:
        timestamp: float | None = epoch(row[CREATED])
    except Malformed:
        timestamp = None
    out: dict[str, Any] = {"step_pk": int(row[0]), "step_id": json_number(row[STEP])}
    out.update(_messages(row[MESSAGES]))
    out.update(
        {
            "response": text_of(row[RESPONSE]),
            "step_reward": json_number(row[STEP_REWARD]),
            "reward": json_number(row[CUM_REWARD]),
            "weight_version": _weight_version(row[ENV_STATE]),
            "env_state": text_of(row[ENV_STATE]),
            "truncated": bool(row[TRUNCATED]),
            "terminal": bool(row[TERMINAL]),
            "completed": bool(row[COMPLETED]),
            "created_at": text_of(row[CREATED]),
            "timestamp": timestamp,
            "env_name": text_of(row[ENV_NAME]),
            "llm_model": text_of(row[LLM_MODEL]),
            "outcome": outcome,
            "reason": reason,
        }
    )
    return out


def _step_order(row: tuple) -> tuple:
    try:
        return (0, int(row[STEP]), int(row[0]))
    except (TypeError, ValueError):
        return (1, 0, int(row[0]))


def sessions_of(
    rows: dict[int, tuple], outcomes: dict[int, tuple[str, str | None]]
) -> list[dict[str, Any]]:
    """The sessions of some rows, sorted by session_id, their steps by (step_id, step_pk), each with
    its terminal reward: the step_reward of its last completed row (None when it never
    completed)."""
    by_session: dict[str, list[tuple]] = collections.defaultdict(list)
    for row in rows.values():
        by_session[text_of(row[SID]) or ""].append(row)
    out = []
    for session_id in sorted(by_session):
        steps = sorted(by_session[session_id], key=_step_order)
        done = [row for row in steps if row[COMPLETED]]
        out.append(
            {
                "session_id": session_id,
                "completed": bool(done),
                "terminal_reward": json_number(done[-1][STEP_REWARD]) if done else None,
                "steps": [step_record(row, *outcomes[int(row[0])]) for row in steps],
            }
        )
    return out
