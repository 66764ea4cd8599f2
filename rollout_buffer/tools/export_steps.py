"""One launcher row as an export step, and a group's rows as its sessions (the export format's
inner records; ``rollout_buffer.tools.export`` streams the groups).

Owns: how each column of a row is written (numbers that are not finite as their text, bytes
decoded with replacement, the stored history as a JSON list when it is one and can be written
again, else as its raw text with a note), and the order of sessions and steps. Pure values: no I/O.
"""

from __future__ import annotations

import collections
import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
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
from rollout_buffer.storage import launcher_sql

# Positions of launcher_sql.EXPORT_EXTRA_COLUMNS after BODY_COLUMNS.
ENV_NAME, LLM_MODEL, CUM_REWARD, TERMINAL = range(
    len(launcher_sql.BODY_COLUMNS), len(launcher_sql.BODY_COLUMNS) + 4
)
# text held at a time when a record is streamed (a row larger than this is held alone)
STREAM_BYTES = 1024 * 1024
# a history nested deeper is exported as its raw text (chat messages nest a handful of levels)
MAX_NESTING = 500


def json_number(v: Any) -> Any:
    """A JSON number, or the text of a value that is not a finite one ('nan', 'inf', ...)."""
    if v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return str(v)
    if not math.isfinite(f):
        return str(f)
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else f


def text_of(v: Any) -> str | None:
    if v is None:
        return None
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v).decode("utf-8", "replace")
    if isinstance(v, datetime):
        return v.isoformat(sep=" ")
    return str(v)


def _messages(raw: Any) -> dict[str, Any]:
    """{"messages": list} when the stored history is a JSON list that can be written again, else
    {"messages": None, "messages_text": raw} (with ``messages_note`` saying why when it parsed)."""
    text = text_of(raw)
    if text is None:
        return {"messages": None, "messages_text": None}
    try:
        value = json.loads(text, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    except (TypeError, ValueError):
        return {"messages": None, "messages_text": text}
    except RecursionError:
        note = "nested too deep to decode: kept as its raw text"
        return {"messages": None, "messages_text": text, "messages_note": note}
    if not isinstance(value, list):
        return {"messages": None, "messages_text": text}
    why = _not_reencodable(value)
    if why is not None:
        return {"messages": None, "messages_text": text, "messages_note": why}
    return {"messages": value}


def _depth(value: Any) -> int:
    """How deeply lists and objects nest in a decoded JSON value (without recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (list, dict)):
            deepest = max(deepest, d)
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def _not_reencodable(value: list) -> str | None:
    """Why a decoded history cannot go into a record as JSON, or None. The record nests it a few
    levels deeper, and the encoder recurses: a history nested about a thousand deep parses but
    cannot be written again (RecursionError), and an escaped lone surrogate cannot be UTF-8."""
    depth = _depth(value)
    if depth > MAX_NESTING:
        return f"nested {depth} levels deep (more than {MAX_NESTING}): kept as its raw text"
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except (ValueError, UnicodeEncodeError, RecursionError) as exc:
        return f"cannot be written again as JSON ({type(exc).__name__}): kept as its raw text"
    return None


def _weight_version(env_state: Any) -> int | None:
    try:
        return weight_version(env_state)
    except Malformed:
        return None


def step_record(row: Sequence[Any], outcome: str, reason: str | None) -> dict[str, Any]:
    """One launcher row as an export step."""
    try:
        ts: float | None = epoch(row[CREATED])
    except Malformed:
        ts = None
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
            "timestamp": ts,
            "env_name": text_of(row[ENV_NAME]),
            "llm_model": text_of(row[LLM_MODEL]),
            "outcome": outcome,
            "reason": reason,
        }
    )
    return out


def _order(r: Sequence[Any]) -> tuple:
    try:
        return (0, int(r[STEP]), int(r[0]))
    except (TypeError, ValueError):
        return (1, 0, int(r[0]))


def session_plan(rows: Mapping[int, Sequence[Any]]) -> list[tuple[str, bool, Any, list[int]]]:
    """The sessions of some rows (their texts are not needed): (session_id, completed, terminal
    reward, its step pks in order), sorted by session_id, steps by (step_id, step_pk). The
    terminal reward is the step_reward of its last completed row (None when it never
    completed)."""
    by_session: dict[str, list[Sequence[Any]]] = collections.defaultdict(list)
    for r in rows.values():
        by_session[text_of(r[SID]) or ""].append(r)
    out = []
    for sid in sorted(by_session):
        steps = sorted(by_session[sid], key=_order)
        done = [r for r in steps if r[COMPLETED]]
        terminal = json_number(done[-1][STEP_REWARD]) if done else None
        out.append((sid, bool(done), terminal, [int(r[0]) for r in steps]))
    return out


def sessions_of(
    rows: dict[int, tuple], outcomes: dict[int, tuple[str, str | None]]
) -> list[dict[str, Any]]:
    """The sessions of some rows as export records (see session_plan)."""
    return [
        {
            "session_id": sid,
            "completed": completed,
            "terminal_reward": terminal,
            "steps": [step_record(rows[pk], *outcomes[pk]) for pk in pks],
        }
        for sid, completed, terminal, pks in session_plan(rows)
    ]


def streamed_sessions(
    plan: list[tuple[str, bool, Any, list[int]]],
    sizes: dict[int, int],
    fetch: Callable[[list[int]], dict[int, tuple]],
    outcomes: dict[int, tuple[str, str | None]],
) -> Iterator[str]:
    """The JSON text of ``sessions_of``'s list, in pieces: rows are fetched (``fetch``) a few at a
    time, up to STREAM_BYTES of text (or one row), so a group of any size is written in the memory
    of a few rows. A row gone since it was planned is left out (its pk is then missing)."""
    yield "["
    for i, (sid, completed, terminal, pks) in enumerate(plan):
        head = {"session_id": sid, "completed": completed, "terminal_reward": terminal, "steps": []}
        yield (", " if i else "") + json.dumps(head, ensure_ascii=False)[:-2]
        first, chunk, held = True, [], 0
        for n, pk in enumerate(pks):
            chunk.append(pk)
            held += sizes.get(pk, 0)
            if held < STREAM_BYTES and n + 1 < len(pks):
                continue
            rows = fetch(chunk)
            for p in chunk:
                if p in rows:
                    step = json.dumps(step_record(rows[p], *outcomes[p]), ensure_ascii=False)
                    yield ("" if first else ", ") + step
                    first = False
            chunk, held = [], 0
            del rows
        yield "]}"
    yield "]"
