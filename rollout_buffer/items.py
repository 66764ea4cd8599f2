"""Turn database rows into the trainer's items, as JSON text, without re-encoding histories.

A stored ``messages`` column is validated once (``json.loads`` that refuses NaN/Infinity and
anything but a list) and then spliced into the output as it is: the assistant turn is appended
inside the stored list's closing bracket. Everything else of the item is small and encoded
with ``json.dumps``. A row that cannot become an item raises :class:`Malformed` with its reason;
the caller drops the whole group (a group with a hole must never reach the trainer).

uids are uuid4-shaped values derived from a per-batch random seed and the row's step_pk, so a
replayed batch carries the very same uids.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
from datetime import datetime, timezone
from typing import Any, Iterable, Sequence

from .accumulator import Take

logger = logging.getLogger(__name__)

# Column positions of queries.BODY_COLUMNS.
PK, SID, STEP, GID, MESSAGES, RESPONSE, STEP_REWARD, ENV_STATE, TRUNCATED, COMPLETED, CREATED, JOB, TRAINABLE = range(13)

_dumps_compact = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode
_dumps_text = json.JSONEncoder(ensure_ascii=False, allow_nan=False).encode


class Malformed(Exception):
    """A row that cannot be turned into an item."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _no_constants(name: str) -> Any:
    raise ValueError(f"non-finite number {name}")


# One decoder for every row: json.loads(..., parse_constant=...) would build a new one per call.
_decode = json.JSONDecoder(parse_constant=_no_constants).decode


def weight_version(env_state: Any) -> int:
    """The policy version of env_state: 0 when absent or unusable, never an exception for that."""
    if env_state is None:
        return 0
    if isinstance(env_state, str):
        try:
            env_state = _decode(env_state)
        except ValueError:
            raise Malformed("invalid_json_env_state") from None
    if env_state is None:
        return 0
    if not isinstance(env_state, dict):
        raise Malformed("env_state_not_an_object")
    wv = env_state.get("weight_version")
    if isinstance(wv, bool) or wv is None:
        return 0
    if isinstance(wv, (int, float)):
        return int(wv) if math.isfinite(wv) else 0
    if isinstance(wv, str):
        try:
            return int(float(wv.strip()))
        except (ValueError, OverflowError):
            return 0
    return 0


def epoch(created_at: Any) -> float:
    """created_at as epoch seconds; naive values are UTC."""
    if isinstance(created_at, datetime):
        d = created_at
    else:
        if isinstance(created_at, bytes):
            created_at = created_at.decode()
        try:
            d = datetime.fromisoformat(str(created_at).strip())
        except ValueError:
            raise Malformed("invalid_created_at") from None
    if d.tzinfo is None:
        d = d.replace(tzinfo=timezone.utc)
    return d.timestamp()


def finite(x: Any, reason: str) -> float:
    """A finite float or Malformed(reason)."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        raise Malformed(reason) from None
    if not math.isfinite(v):
        raise Malformed(reason)
    return v


_VARIANT = "89ab89ab89ab89ab"


def uid(seed: bytes, pk: int) -> str:
    """A uuid4-shaped uid (version 4, RFC 4122 variant), fixed by (batch seed, step_pk)."""
    h = hashlib.blake2b(pk.to_bytes(8, "big", signed=True), key=seed, digest_size=16).hexdigest()
    return f"{h[:8]}-{h[8:12]}-4{h[13:16]}-{_VARIANT[int(h[16], 16)]}{h[17:20]}-{h[20:32]}"


class GroupItems:
    """One group's items as a flat list of UTF-8 fragments, plus what meta_info needs.

    Every item starts with ``,{"uid":`` (response_body drops the very first comma), so the
    fragments of all groups are joined once, with no per-item copy of the stored history.
    """

    __slots__ = ("group_id", "parts", "n_items", "n_bytes", "rewards", "weight_versions")

    def __init__(self, group_id: str) -> None:
        self.group_id = group_id
        self.parts: list[Any] = []
        self.n_items = 0
        self.n_bytes = 0
        self.rewards: list[float] = []
        self.weight_versions: list[int] = []


def _as_bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise Malformed("messages_not_text")


def build_group(take: Take, rows: dict[int, Sequence[Any]], seed: bytes, job_id: str) -> GroupItems:
    """Items of one served group, sorted by (session_id, step_id, step_pk).

    Raises Malformed with ``.bad`` = {step_pk: reason} for every row that cannot become an item.
    """
    bad: dict[int, str] = {}
    prepared = []
    terminal: dict[str, tuple[int, int, float]] = {}
    for sid, pks in take.completed.items():
        for pk in pks:
            row = rows.get(pk)
            try:
                if row is None:
                    raise Malformed("row_vanished")
                if str(row[GID]) != take.group_id or row[JOB] != job_id or not row[TRAINABLE]:
                    raise Malformed("row_changed")
                text = _as_bytes(row[MESSAGES])
                try:
                    value = _decode(text.decode("utf-8"))
                except ValueError:  # UnicodeDecodeError is one too
                    raise Malformed("invalid_json_messages") from None
                if not isinstance(value, list):
                    raise Malformed("messages_not_a_list")
                wv = weight_version(row[ENV_STATE])
                step_reward = finite(row[STEP_REWARD], "non_finite_step_reward")
                ts = epoch(row[CREATED])
                step_id = int(row[STEP])
            except Malformed as exc:
                bad[pk] = exc.reason
                continue
            completed = bool(row[COMPLETED])
            if completed:
                key = (step_id, pk, step_reward)
                if sid not in terminal or key[:2] > terminal[sid][:2]:
                    terminal[sid] = key
            prepared.append((sid, step_id, pk, text, not value, row, wv, step_reward, ts, completed))
    if bad:
        err = Malformed(next(iter(bad.values())))
        err.bad = bad  # type: ignore[attr-defined]
        raise err
    prepared.sort(key=lambda p: (p[0], p[1], p[2]))
    out = GroupItems(take.group_id)
    parts = out.parts
    gid_json = _dumps_compact(take.group_id).encode()
    seen_steps: set[tuple[str, int]] = set()
    prev_sid = None
    sid_json = b""
    n_bytes = 0
    for sid, step_id, pk, text, empty, row, wv, step_reward, ts, completed in prepared:
        if (sid, step_id) in seen_steps:
            logger.warning("group %s session %s has two rows for step %s (step_pk %s); serving both",
                           take.group_id, sid, step_id, pk)
        seen_steps.add((sid, step_id))
        if sid != prev_sid:
            prev_sid = sid
            sid_json = _dumps_compact(sid).encode()
        reward = terminal[sid][2]
        end = len(text.rstrip()) - 1  # the stored list's closing bracket
        response = row[RESPONSE]
        if not isinstance(response, str):
            response = "" if response is None else str(response)
        truncated = bool(row[TRUNCATED])
        r = repr(reward).encode()
        # the item, formatted directly (the same text json.dumps would give, much faster)
        head = b"".join((
            b',{"uid":"', uid(seed, pk).encode(), b'","instance_id":', gid_json, b',"messages":'))
        tail = b"".join((
            b'' if empty else b',', b'{"role":"assistant","content":', _dumps_text(response).encode(),
            b'}],"reward":', r, b',"extra_info":{"timestamp":', repr(ts).encode(), b',"steps":',
            str(step_id).encode(), b',"finish_reason":', b'"length"' if truncated else b'"stop"',
            b',"session_id":', sid_json, b',"env_id":', sid_json, b',"group_id":', gid_json,
            b',"weight_version":', str(wv).encode(), b',"truncated":', b"true" if truncated else b"false",
            b',"step_pk":', str(pk).encode(), b',"is_session_completed":', b"true" if completed else b"false",
            b',"step_reward":', repr(step_reward).encode(), b',"terminal_reward":', r, b"}}"))
        parts.append(head)
        parts.append(memoryview(text)[:end])
        parts.append(tail)
        n_bytes += len(head) + end + len(tail)
        out.rewards.append(reward)
        out.weight_versions.append(wv)
    out.n_items = len(prepared)
    out.n_bytes = n_bytes
    return out


def response_body(groups: Iterable[GroupItems], meta_extra: dict[str, Any]) -> bytes:
    """The /get_rollout_data JSON body for the given groups (success when there is an item)."""
    parts: list[Any] = []
    rewards: list[float] = []
    wvs: list[int] = []
    gids: list[str] = []
    for g in groups:
        parts.extend(g.parts)
        rewards.extend(g.rewards)
        wvs.extend(g.weight_versions)
        gids.append(g.group_id)
    n = len(rewards)
    meta = {
        "total_samples": n,
        "avg_reward": sum(rewards) / n if n else 0.0,
        "finished_groups": sorted(gids),
        "avg_weight_version": sum(wvs) / n if n else 0.0,
        "max_weight_version": max(wvs) if wvs else 0,
    }
    meta.update(meta_extra)
    message = f"Successfully read {n} items" if n else "No data available to read"
    head = '{"success":%s,"message":%s,"data":{"data":[' % ("true" if n else "false", _dumps_compact(message))
    if parts:
        parts[0] = parts[0][1:]  # the first item has no comma before it
    parts.insert(0, head.encode())
    parts.append(('],"meta_info":%s}}' % _dumps_compact(meta)).encode())
    return b"".join(parts)
