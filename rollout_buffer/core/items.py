"""Turn database rows into the trainer's items, as JSON text, without re-encoding histories.

A stored ``messages`` column is validated once (``json.loads`` that refuses NaN/Infinity and
anything but a list) and then spliced into the output as it is: the assistant turn is appended
inside the stored list's closing bracket. Everything else of the item is small and encoded
with ``json.dumps``. A row that cannot become an item raises :class:`Malformed` with its reason;
the caller drops the whole group (a group with a hole must never reach the trainer).

uids are uuid4-shaped values derived from a per-batch random seed and the row's step_pk, so a
replayed batch carries the very same uids.

Owns: building item JSON and deriving uids; checking each value is
:mod:`~rollout_buffer.core.values`'. It must not do I/O or decide: rows come in, bytes or
:class:`Malformed` come out.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from rollout_buffer.core.logconfig import EventLog
from rollout_buffer.core.model import BadText, Take
from rollout_buffer.core.salvage import finish_reason, last_item_extra, truncated_terminals
from rollout_buffer.core.values import (
    History,
    Malformed,
    as_bytes,
    cached_weight_version,
    epoch,
    finite,
)

logger = logging.getLogger(__name__)
_events = EventLog(logger)  # a launcher that writes every step twice must not write a line per row

# Column positions of queries.BODY_COLUMNS.
(
    PK,
    SID,
    STEP,
    GID,
    MESSAGES,
    RESPONSE,
    STEP_REWARD,
    ENV_STATE,
    TRUNCATED,
    COMPLETED,
    CREATED,
    JOB,
    TRAINABLE,
) = range(13)

dumps_compact = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode
_dumps_text = json.JSONEncoder(ensure_ascii=False, allow_nan=False).encode


_VARIANT = "89ab89ab89ab89ab"


def uid(seed: bytes, pk: int) -> str:
    """A uuid4-shaped uid (version 4, RFC 4122 variant), fixed by (batch seed, step_pk)."""
    h = hashlib.blake2b(pk.to_bytes(8, "big", signed=True), key=seed, digest_size=16).hexdigest()
    return f"{h[:8]}-{h[8:12]}-4{h[13:16]}-{_VARIANT[int(h[16], 16)]}{h[17:20]}-{h[20:32]}"


class GroupItems:
    """Where one group's items sit in the response buffer, plus what meta_info needs.

    All groups of a response are appended to one bytearray (several times faster than joining many
    fragments into a large body, and no copy at the end); items are separated by commas.
    """

    __slots__ = (
        "first_ts",
        "group_id",
        "n_items",
        "rewards",
        "session_rewards",
        "start",
        "weight_versions",
    )

    def __init__(self, group_id: str, start: int) -> None:
        self.group_id = group_id
        self.start = start
        self.n_items = 0
        self.rewards: list[float] = []
        self.weight_versions: list[int] = []
        self.session_rewards: list[float] = []  # each served session's terminal reward, once
        self.first_ts: float | None = None  # created_at of its earliest served row (epoch seconds)


_ITEM_TAIL = (
    '%s{"role":"assistant","content":%s}],"reward":%r,"extra_info":{"timestamp":%r,"steps":%d,'
    '"finish_reason":"%s","session_id":%s,"env_id":%s,"group_id":%s,"rollout_group_key":%s,'
    '"weight_version":%d,'
    '"truncated":%s,"step_pk":%d,"is_session_completed":%s,"step_reward":%r,"terminal_reward":%r%s}}'
)


def rollout_group_key(group_id: str, seq: int = 0) -> str:
    """``"<group_id>:<n>"``, what the upstream client (Safactory ``feature/os``) groups by: n counts
    the groups of that id decided in the job, from 0. A group id is decided at most once per job
    (its decision is the tombstone that turns later rows into late rows, SPEC §3), so n is 0 and the
    key is the same whenever the group's items are built again (a replay, a redelivery)."""
    return f"{group_id}:{seq}"


# Extra keys of extra_info (JSON text that follows the last key): a group served short at the TTL,
# a served group delivered again after the trainer restarted from a checkpoint (redelivery.py).
PARTIAL_FLAG = ',"partial_group":true'
REDELIVERED_FLAG = ',"redelivered":true'


def item_flags(partial: bool, redelivered: bool) -> str:
    """The extra_info keys a group's items carry (build_group's ``flags``)."""
    return (PARTIAL_FLAG if partial else "") + (REDELIVERED_FLAG if redelivered else "")


def _validated(
    take: Take, rows: Mapping[int, Sequence[Any]], job_id: str
) -> tuple[list[tuple[Any, ...]], dict[str, tuple[int, int, float]]]:
    """The group's rows in item order, each with what its item needs, and each session's terminal
    (step_id, step_pk, step_reward); raises Malformed naming every row that cannot become an item
    (validated apart from the formatting: nothing is appended unless every row is good)."""
    bad: dict[int, str] = {}
    ordered = []
    salvage = take.salvage
    last_rows = set(salvage.last_rows.values()) if salvage is not None else ()
    for sid, pks in take.served.items():
        for pk in pks:
            row = rows.get(pk)
            if row is None:
                bad[pk] = "row_vanished"
                continue
            try:
                step_id = int(row[STEP])
            except (TypeError, ValueError):
                bad[pk] = "invalid_step_id"
                continue
            ordered.append((sid, step_id, pk, row))
    ordered.sort(key=lambda p: (p[0], p[1], p[2]))
    prepared = []
    terminal: dict[str, tuple[int, int, float]] = {}
    history: History | None = None
    prev_sid = None
    for sid, step_id, pk, row in ordered:
        if sid != prev_sid:
            prev_sid, history = sid, History()
        assert history is not None
        try:
            if any(
                isinstance(row[c], BadText) for c in (SID, GID, RESPONSE, ENV_STATE, CREATED, JOB)
            ):
                raise Malformed("invalid_utf8_text")
            if not isinstance(
                row[RESPONSE], (str, type(None))
            ):  # a BLOB or a number where text belongs
                raise Malformed("response_not_text")
            if (
                str(row[GID]) != take.group_id
                or row[JOB] != job_id
                or not (row[TRAINABLE] or pk in last_rows)  # (a truncated session's last row)
            ):
                raise Malformed("row_changed")
            text = as_bytes(row[MESSAGES])
            end, empty = history.check(text)
            version = cached_weight_version(row[ENV_STATE])
            step_reward = finite(row[STEP_REWARD], "non_finite_step_reward")
            ts = epoch(row[CREATED])
        except Malformed as exc:
            bad[pk] = exc.reason
            history = History()  # the next row is validated in full
            continue
        completed = bool(row[COMPLETED])
        if completed:
            key = (step_id, pk, step_reward)
            if sid not in terminal or key[:2] > terminal[sid][:2]:
                terminal[sid] = key
        prepared.append(
            (sid, step_id, pk, text, end, empty, row, version, step_reward, ts, completed)
        )
    if bad:
        raise Malformed(next(iter(bad.values())), bad)
    if salvage is not None:
        terminal.update(truncated_terminals(salvage, prepared))
    return prepared, terminal


def build_group(
    take: Take,
    rows: Mapping[int, Sequence[Any]],
    seed: bytes,
    job_id: str,
    buf: bytearray,
    flags: str = "",
) -> GroupItems:
    """Append the items of one served group to ``buf``, sorted by (session_id, step_id, step_pk);
    ``flags`` (e.g. PARTIAL_FLAG) is appended to every item's extra_info.

    Raises Malformed whose ``bad`` maps every row that cannot become an item to its reason; then
    nothing was appended.
    """
    prepared, terminal = _validated(take, rows, job_id)
    salvage = take.salvage
    out = GroupItems(take.group_id, len(buf))
    gid_json = dumps_compact(take.group_id)
    key_json = dumps_compact(rollout_group_key(take.group_id))
    gid_bytes = gid_json.encode()
    seen_steps: set[tuple[str, int]] = set()
    prev_sid = None
    sid_json = ""
    for sid, step_id, pk, text, end, empty, row, version, step_reward, ts, completed in prepared:
        if (sid, step_id) in seen_steps:
            _events.event(
                "duplicate step",
                logging.WARNING,
                "group %s session %s has two rows for step %s (step_pk %s); serving both",
                take.group_id,
                sid,
                step_id,
                pk,
            )
        seen_steps.add((sid, step_id))
        if sid != prev_sid:
            prev_sid = sid
            sid_json = dumps_compact(sid)
        reward = terminal[sid][2]
        response = row[RESPONSE]
        if not isinstance(response, str):
            response = "" if response is None else str(response)
        truncated = bool(row[TRUNCATED])
        finish = "length" if truncated else "stop"
        extra = flags
        if salvage is not None and sid in salvage.sessions and terminal[sid][:2] == (step_id, pk):
            reason = salvage.sessions[sid]  # a truncated session's last item
            truncated, finish = True, finish_reason(reason)
            extra = flags + last_item_extra(reason)
        # the item, formatted directly (the same text json.dumps would give, much faster)
        buf += b',{"uid":"' if buf else b'{"uid":"'
        buf += uid(seed, pk).encode()
        buf += b'","instance_id":'
        buf += gid_bytes
        buf += b',"messages":'
        buf += memoryview(text)[:end]
        buf += (
            _ITEM_TAIL
            % (
                "" if empty else ",",
                _dumps_text(response),
                reward,
                ts,
                step_id,
                finish,
                sid_json,
                sid_json,
                gid_json,
                key_json,
                version,
                "true" if truncated else "false",
                pk,
                "true" if completed else "false",
                step_reward,
                reward,
                extra,
            )
        ).encode()
        out.rewards.append(reward)
        out.weight_versions.append(version)
        if out.first_ts is None or ts < out.first_ts:
            out.first_ts = ts
    out.session_rewards = [terminal[sid][2] for sid in sorted(terminal)]
    out.n_items = len(prepared)
    return out
