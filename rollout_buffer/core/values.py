"""Checking the values of a launcher row before it becomes an item, or at ingest.

Owns: :class:`Malformed` and the reasons a row cannot become an item, reading the weight version
out of env_state, created_at as epoch seconds, finite rewards, and validating a session's growing
``messages`` histories once each (a step's list usually extends the previous step's). No I/O and
no decision: a value comes in, a typed value or :class:`Malformed` comes out.
"""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from typing import Any

from rollout_buffer.core.model import BadText


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
