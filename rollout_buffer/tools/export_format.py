"""The export's record format (README "Export format"): how one launcher row becomes a step and a
group's rows become sessions, and reading an export file back.

Owns: the record's version, the JSON encoding of row values (numbers that are not finite and text
that is not UTF-8 are kept as text, never lost), and :func:`read_export`. Streaming the records out
of the databases is :mod:`rollout_buffer.tools.export`'s.
"""

from __future__ import annotations

import collections
import gzip
import json
import math
import zlib
from collections.abc import Iterator, Sequence
from datetime import datetime
from typing import Any

from rollout_buffer.core.errors import RolloutBufferError
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

FORMAT_VERSION = 1
# Positions of queries.EXPORT_EXTRA_COLUMNS after BODY_COLUMNS.
ENV_NAME, LLM_MODEL, CUM_REWARD, TERMINAL = range(len(q.BODY_COLUMNS), len(q.BODY_COLUMNS) + 4)


class ExportError(RolloutBufferError):
    """The export cannot be made (no such job, unreadable database)."""


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


def read_export(path: str) -> Iterator[dict[str, Any]]:
    """The records of an export file, one at a time (plain or gzip, told by its first bytes). A file
    that is not an export (a line that is no JSON object, a truncated or corrupt gzip, bytes that
    are not UTF-8) raises ExportError naming the line."""
    with open(path, "rb") as probe:
        gz = probe.read(2) == b"\x1f\x8b"
    opener = gzip.open if gz else open
    n = 0
    try:
        with opener(path, "rt", encoding="utf-8") as file:
            for n, line in enumerate(file, 1):
                if line.strip():
                    try:
                        record = json.loads(line)
                    except ValueError as exc:
                        raise ExportError(f"{path}:{n}: not a JSON record ({exc})") from None
                    if not isinstance(record, dict) or not isinstance(
                        record.get("sessions", []), list
                    ):
                        raise ExportError(
                            f"{path}:{n}: not an export record (a JSON object with its sessions)"
                        )
                    yield record
    except (EOFError, gzip.BadGzipFile, UnicodeDecodeError, zlib.error) as exc:
        raise ExportError(
            f"{path}: unreadable after line {n} ({type(exc).__name__}: {exc}); "
            "a truncated or corrupt file?"
        ) from None
