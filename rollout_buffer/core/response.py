"""The /get_rollout_data body around the items: its envelope, its meta_info figures, and its bytes.

The items are JSON text already (:func:`~rollout_buffer.core.items.build_group` appends them to one
buffer); this module wraps them in ``{"success", "message", "data": {"data": [...], "meta_info"}}``
without copying the buffer, and hands the body to the WSGI server in slices.

Owns: the body's chunks and their close hook, the meta_info figures every answer carries, and the
slicing. It must not build items or do I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from rollout_buffer.core.items import GroupItems, dumps_compact


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
