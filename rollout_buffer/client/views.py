"""What a trainer reads from a served batch: the batch, its groups, each group's sessions.

A ``/get_rollout_data`` answer is a flat list of items (one per trainable step row, sorted by
session and step) plus the batch's ``meta_info``. These views regroup it the way every trainer
did by hand: items by group (``instance_id``), a group's items by session, a session's steps in
order with its terminal reward and whether it was cut. Nothing is copied or changed: ``items``
are the served dicts, ``meta_info`` the served document.

Owns: :class:`Batch`, :class:`Group`, :class:`Session` and :func:`groups_of`. No I/O.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


def _extra(item: dict[str, Any]) -> dict[str, Any]:
    extra = item.get("extra_info")
    return extra if isinstance(extra, dict) else {}


def _step_order(item: dict[str, Any]) -> tuple[int, int]:
    """(step_id, step_pk) of an item; 0 where the server (the original one) sent none."""
    extra = _extra(item)
    steps, pk = extra.get("steps"), extra.get("step_pk")
    return (
        steps if isinstance(steps, int) else 0,
        pk if isinstance(pk, int) else 0,
    )


@dataclass(frozen=True)
class Session:
    """One session (one of the K rollouts of a prompt) of a served group.

    ``steps`` are its items in step order (one item under ``--message-cut 0``: the terminal
    step). ``reward`` is its terminal reward, the reward every item of the session carries
    (SPEC section 3). ``truncated`` says its last step was cut (a step or length cap,
    ``finish_reason`` "length"): its reward is then the environment's, not an answer's.
    """

    session_id: str
    steps: list[dict[str, Any]]
    reward: float | None
    truncated: bool

    @classmethod
    def of(cls, session_id: str, items: list[dict[str, Any]]) -> Session:
        steps = sorted(items, key=_step_order)  # stable: the served order breaks ties
        last = steps[-1]
        extra = _extra(last)
        reward = extra.get("terminal_reward", last.get("reward"))
        truncated = extra.get("truncated")
        if not isinstance(truncated, bool):
            truncated = extra.get("finish_reason") == "length"
        return cls(session_id, steps, reward, truncated)


@dataclass(frozen=True, eq=False)
class Group:
    """One served group: the K sessions of one prompt.

    ``items`` are the served item dicts, in the served order; ``meta_info`` is the whole
    ``meta_info`` of the batch that carried it (``batch_id``, ``finished_groups``,
    ``group_stats``, ``filtered``, ...). For callers written for the tuples ``iter_groups``
    used to yield, a Group unpacks as ``(group_id, items)``.
    """

    group_id: str
    items: list[dict[str, Any]]
    meta_info: dict[str, Any] = field(default_factory=dict, repr=False)

    def __iter__(self) -> Iterator[Any]:
        return iter((self.group_id, self.items))

    @property
    def rollout_group_key(self) -> str | None:
        """``extra_info.rollout_group_key`` (``"<group_id>:<n>"``), or None from a server that
        does not send it."""
        for item in self.items:
            key = _extra(item).get("rollout_group_key")
            if key is not None:
                return str(key)
        return None

    @property
    def redelivered(self) -> bool:
        """Served again after a trainer restarted from a checkpoint that did not hold it."""
        return any(_extra(item).get("redelivered") is True for item in self.items)

    @functools.cached_property
    def sessions(self) -> list[Session]:
        """Its sessions in the served order (by session id), each with its steps in order."""
        by_session: dict[str, list[dict[str, Any]]] = {}
        for item in self.items:
            extra = _extra(item)
            session_id = extra.get("session_id", extra.get("env_id"))
            by_session.setdefault(str(session_id), []).append(item)
        return [Session.of(sid, items) for sid, items in by_session.items()]


@dataclass(frozen=True, eq=False)
class Batch:
    """One ``/get_rollout_data`` answer: its groups, and its ``meta_info`` as served."""

    groups: list[Group]
    meta_info: dict[str, Any]

    @classmethod
    def of(cls, doc: dict[str, Any]) -> Batch:
        """The batch of an answer (no groups when ``success`` is false)."""
        data = doc.get("data")
        meta = data.get("meta_info") if isinstance(data, dict) else None
        meta = meta if isinstance(meta, dict) else {}
        if not doc.get("success"):
            return cls([], meta)
        return cls([Group(gid, items, meta) for gid, items in groups_of(doc)], meta)

    @property
    def batch_id(self) -> str | None:
        return self.meta_info.get("batch_id")

    @property
    def items(self) -> list[dict[str, Any]]:
        """Every item of the batch, in the served order."""
        return [item for group in self.groups for item in group.items]


def groups_of(doc: dict[str, Any]) -> list[tuple[str, list[dict[str, Any]]]]:
    """The items of a /get_rollout_data answer grouped by instance_id, in order of first
    appearance."""
    data = doc.get("data") or {}
    items = data.get("data") if isinstance(data, dict) else None
    out: dict[str, list[dict[str, Any]]] = {}
    for item in items or []:
        gid = item.get("instance_id")
        if gid is None:
            gid = _extra(item).get("group_id")
        out.setdefault(str(gid), []).append(item)
    return list(out.items())
