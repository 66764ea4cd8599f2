"""A launcher row's values checked, its items built as JSON text, and the /get_rollout_data body
around them.

Values: :class:`Malformed` and the reasons a row cannot become an item, the weight version out of
env_state, created_at as epoch seconds, finite rewards, and a session's growing ``messages``
histories validated once each (a step's list usually extends the previous step's).

Items: a stored ``messages`` column is validated once (``json.loads`` that refuses NaN/Infinity and
anything but a list) and then spliced into the output as it is: the assistant turn is appended
inside the stored list's closing bracket. Everything else of the item is small and encoded with
``json.dumps``. A row that cannot become an item raises :class:`Malformed` with its reason; the
caller drops the whole group (a group with a hole must never reach the trainer). uids are
uuid4-shaped values derived from a per-batch random seed and the row's step_pk, so a replayed batch
carries the very same uids.

The body: the items (:func:`build_group` appends them to one buffer) are wrapped in ``{"success",
"message", "data": {"data": [...], "meta_info"}}`` without copying the buffer, with the meta_info
figures every answer carries, and handed to the WSGI server in slices.

Owns: checking values, building item JSON and deriving uids, the body's chunks and their close
hook. It must not do I/O or decide: rows come in, bytes or :class:`Malformed` come out.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

from rollout_buffer.core.logconfig import EventLog
from rollout_buffer.core.model import BadText, Salvage, Take
from rollout_buffer.core.salvage import finish_reason, last_item_extra, truncated_terminals


class Malformed(Exception):
    """A row that cannot be turned into an item; ``bad`` maps each such row's step_pk to its reason
    (build_group fills it for the whole group)."""

    def __init__(self, reason: str, bad: dict[int, str] | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.bad: dict[int, str] = dict(bad or {})


def _no_constants(name: str) -> Any:
    raise ValueError(f"non-finite number {name}")


# One decoder for every row: json.loads(..., parse_constant=...) would build a new one per call.
_decode = json.JSONDecoder(parse_constant=_no_constants).decode


_MAX_VERSION = 2**53


def weight_version(env_state: Any) -> int:
    """The policy version of env_state: 0 when absent or unusable, never an exception for that."""
    if env_state is None:
        return 0
    if isinstance(env_state, str):
        try:
            env_state = _decode(env_state)
        except ValueError:
            raise Malformed("invalid_json_env_state") from None
        except RecursionError:  # valid JSON nested deeper than the decoder's stack
            raise Malformed("json_too_deep_env_state") from None
    if env_state is None:
        return 0
    if not isinstance(env_state, dict):
        raise Malformed("env_state_not_an_object")
    version = env_state.get("weight_version")
    if isinstance(version, bool) or version is None:
        return 0
    if isinstance(version, str):
        try:
            version = float(version.strip())
        except ValueError:
            return 0
    if isinstance(version, int) and abs(version) <= _MAX_VERSION:
        return version
    if isinstance(version, float) and math.isfinite(version) and abs(version) <= _MAX_VERSION:
        return int(version)
    return 0  # absent or unusable (not a number, or beyond what an average over items can hold)


def epoch(created_at: Any) -> float:
    """created_at as epoch seconds; naive values are UTC."""
    if isinstance(created_at, datetime):
        d = created_at
    else:
        try:
            if isinstance(created_at, bytes):
                created_at = created_at.decode()
            d = datetime.fromisoformat(str(created_at).strip())
        except ValueError:  # UnicodeDecodeError is one too
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


def as_bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise Malformed("messages_not_text")


# JSON's whitespace only: bytes.strip() would also drop \x0b and \x0c, which JSON forbids.
_JSON_WS = b" \t\n\r"


class History:
    """Validates a session's growing histories: each step's list usually extends the previous
    one."""

    __slots__ = ("empty", "prefix")

    def __init__(self) -> None:
        self.prefix: memoryview | None = None  # the previous valid list without its closing bracket
        self.empty = True

    def check(self, text: bytes) -> tuple[int, bool]:
        """Validate ``text`` as a JSON list; returns (position of its closing bracket, is empty).

        When ``text`` starts with the previous (valid) list minus its closing bracket, only the new
        tail is parsed: prefix + tail is a valid list exactly when ``[`` + the tail's elements is a
        non-empty valid list (or the tail is just the bracket). Otherwise the whole text is parsed.
        """
        end = len(text.rstrip(_JSON_WS)) - 1
        prev = self.prefix
        if prev is not None and text.startswith(prev):
            tail = text[len(prev) :].strip(_JSON_WS)
            if tail == b"]":
                ok = True
            elif self.empty:
                ok = self._list(b"[" + tail) is not None and tail.endswith(b"]")
            else:
                items = self._list(b"[" + tail[1:]) if tail[:1] == b"," else None
                ok = bool(items)
            if ok:
                self.prefix = memoryview(text)[:end]
                self.empty = self.empty and tail == b"]"
                return end, self.empty
        value = self._list(text)
        if value is None:
            raise Malformed("messages_not_a_list")
        self.prefix = memoryview(text)[:end]
        self.empty = not value
        return end, self.empty

    @staticmethod
    def _list(text: bytes) -> list[Any] | None:
        try:
            value = _decode(text.decode("utf-8"))
        except ValueError:  # UnicodeDecodeError is one too
            raise Malformed("invalid_json_messages") from None
        except RecursionError:  # valid JSON nested deeper than the decoder's stack
            raise Malformed("json_too_deep_messages") from None
        return value if isinstance(value, list) else None


# env_state texts repeat a lot ({"weight_version": 3}): parse each distinct short one once.
_WV_CACHE: dict[str, int] = {}


def cached_weight_version(env_state: Any) -> int:
    """weight_version() with a cache of short env_state texts (raises Malformed as it does)."""
    version = _WV_CACHE.get(env_state) if isinstance(env_state, str) else None
    if version is None:
        version = weight_version(env_state)
        if isinstance(env_state, str) and len(env_state) < 256:
            if len(_WV_CACHE) > 4096:
                _WV_CACHE.clear()
            _WV_CACHE[env_state] = version
    return version


def ingest_fields(
    step_id: Any, step_reward: Any, env_state: Any
) -> tuple[int | None, float | None, int | None]:
    """A row's (step_id, terminal-reward candidate, weight_version) at ingest, each None when the
    value is unusable: ingest never rejects a row, its build does (with the reason). The version is
    None (unknown until the build) also for an env_state too long to read at ingest ('')."""
    try:
        sid = int(step_id) if not isinstance(step_id, (bytes, BadText)) else None
    except (TypeError, ValueError):
        sid = None
    try:
        reward: float | None = finite(step_reward, "")
    except Malformed:
        reward = None
    try:
        version: int | None = (
            cached_weight_version(env_state)
            if not isinstance(env_state, (bytes, BadText))
            else None
        )
    except Malformed:
        version = None
    return sid, reward, version


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
        terminal.update(_truncated_terminals(salvage, prepared))
    return prepared, terminal


def _truncated_terminals(
    salvage: Salvage, prepared: list[tuple[Any, ...]]
) -> dict[str, tuple[int, int, float]]:
    """A salvaged group's truncated sessions' terminals, as
    :func:`~rollout_buffer.core.salvage.truncated_terminals` finds them; raises Malformed when one
    has no row to serve (its last row vanished: the group would have a hole)."""
    terminals = truncated_terminals(salvage, prepared)
    if terminals is None:
        raise Malformed("row_vanished")
    return terminals


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


class Body(list[Any]):
    """The chunks of a /get_rollout_data body (sent one after the other, never joined), how many
    groups it carries, and what to run once it has been sent (or abandoned)."""

    def __init__(
        self,
        chunks: list[Any],
        groups: int = 0,
        on_close: Callable[[], None] | None = None,
        *,
        replayed: bool = False,
    ) -> None:
        super().__init__(chunks)
        self.groups = groups
        self.replayed = replayed  # a batch served before, sent again to a retrying trainer
        self._on_close = on_close

    def close(self) -> None:
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()


NO_JOB = {
    "reason": "no_job",
    "hint": "no job has been started: POST /start_rollout starts one, with its launcher",
}


def empty_body(meta_extra: dict[str, Any], said: dict[str, str] | None = None) -> Body:
    """A body with no item ("No data available to read"); ``said`` adds keys after the message
    (why there is nothing, e.g. :data:`NO_JOB`)."""
    return Body(response_chunks([], bytearray(), meta_extra, said))


def _mean(values: list[float] | list[int]) -> float:
    """The mean of finite numbers, never overflowing to inf (the body must stay valid JSON)."""
    if not values:
        return 0.0
    n = len(values)
    mean = math.fsum(v / n for v in values)
    return max(-_FLOAT_MAX, min(_FLOAT_MAX, mean))


_FLOAT_MAX = 1.7976931348623157e308


def response_chunks(
    groups: Sequence[GroupItems],
    buf: bytearray,
    meta_extra: dict[str, Any],
    said: dict[str, str] | None = None,
) -> list[Any]:
    """The /get_rollout_data JSON body as bytes-like chunks (success when there is an item);
    ``said``'s keys follow the message."""
    rewards: list[float] = []
    wvs: list[int] = []
    for g in groups:
        rewards.extend(g.rewards)
        wvs.extend(g.weight_versions)
    n = len(rewards)
    meta = {
        "total_samples": n,
        "avg_reward": _mean(rewards),
        "finished_groups": sorted(g.group_id for g in groups),
        "avg_weight_version": _mean(wvs),
        "max_weight_version": max(wvs) if wvs else 0,
    }
    meta.update(meta_extra)
    message = f"Successfully read {n} items" if n else "No data available to read"
    success = "true" if n else "false"
    more = "".join(f"{dumps_compact(k)}:{dumps_compact(v)}," for k, v in (said or {}).items())
    head = f'{{"success":{success},"message":{dumps_compact(message)},{more}"data":{{"data":['
    tail = f'],"meta_info":{dumps_compact(meta)}}}}}'
    return [head.encode(), buf, tail.encode()] if buf else [head.encode(), tail.encode()]


SEND_SLICE = 4 << 20


def iter_bytes(chunks: Sequence[Any]) -> Iterator[bytes]:
    """Yield the chunks as bytes (WSGI servers take only bytes), large buffers in 4 MiB slices: far
    cheaper than one copy of a whole 256 MiB body, and the slices are freed as they are sent."""
    for c in chunks:
        if isinstance(c, bytes):
            yield c
        else:
            view = memoryview(c)
            for i in range(0, len(view), SEND_SLICE):
                yield bytes(view[i : i + SEND_SLICE])
