"""One prompt group that is not decided yet, and the policies' verdict on it once it is ready.

Owns: the metadata a group holds while undecided (its sessions' row pks, which sessions
completed and with what terminal reward, the weight versions the policies need) and the verdict
of the training-data policies on a ready group. No I/O and no lock: the accumulator's lock
guards every group; it decides nothing about other groups, and it must not record or act on its verdict.
"""
from __future__ import annotations

from .model import STALE, ZERO_VARIANCE, Policy


class Group:
    """One prompt group that is not decided yet."""

    __slots__ = ("group_id", "sessions", "completed", "n_rows", "last_seen", "first_seen", "min_pk",
                 "taken", "wv", "chosen", "partial", "ready_at", "min_wv", "order_key")

    def __init__(self, group_id: str, now: float) -> None:
        self.group_id = group_id
        self.sessions: dict[str, list[int]] = {}  # session -> its rows' pks (metadata only)
        # sessions that wrote their completed row -> (first completing pk, terminal (step_id, pk), reward)
        self.completed: dict[str, tuple[int, tuple[int, int], float | None]] = {}
        self.n_rows = 0
        self.last_seen = now
        self.first_seen = now
        self.min_pk: int | None = None
        self.taken: dict[str, int] | None = None  # session -> rows handed to the server
        self.wv: dict[str, int] | None = None     # session -> min weight_version (only when a policy needs it)
        self.chosen: frozenset[str] | None = None  # over-sampling: the K sessions it will serve, once ready
        self.partial = False                       # made ready at the TTL short of K (min group size)
        self.ready_at: float | None = None
        self.min_wv = 0                            # min weight_version of its served sessions, once ready
        self.order_key: tuple[int, int, str] | None = None  # its entry in a version serve order

    def session_ids(self) -> list[str]:
        return sorted(self.sessions)

    def all_pks(self) -> list[int]:
        return sorted(pk for pks in self.sessions.values() for pk in pks)

    def rewards(self) -> tuple[float, ...]:
        """The terminal rewards of its completed sessions (those known at ingest)."""
        return tuple(c[2] for c in self.completed.values() if c[2] is not None)

    def refusal(self, policy: Policy, current_version: int) -> str | None:
        """A ready group's verdict: the drop reason of a policy that refuses it, or None.

        Stale: current - min weight_version of the sessions it serves > max_off_policy (rows whose
        env_state could not be read do not count; the build rejects them). Zero variance: the
        terminal rewards of its completed sessions all within epsilon (only when all are known)."""
        if self.wv is not None:
            sessions = self.chosen if self.chosen is not None else self.completed
            self.min_wv = min((self.wv[s] for s in sessions if s in self.wv), default=0)
            if policy.stale(current_version, self.min_wv):
                return STALE
        if policy.drop_zero_variance and None not in (c[2] for c in self.completed.values()) \
                and policy.zero_variance(self.rewards()):
            return ZERO_VARIANCE
        return None

    def choose(self, k: int) -> dict[str, list[int]]:
        """Over-sampling: keep the first k completed sessions (in the order of their completing rows'
        ids) and forget the others; returns the sessions removed, with their rows' pks."""
        self.chosen = frozenset(sorted(self.completed, key=lambda s: self.completed[s][0])[:k])
        removed = {sid: self.sessions.pop(sid) for sid in [s for s in self.sessions if s not in self.chosen]}
        for sid, pks in removed.items():
            self.completed.pop(sid, None)
            self.n_rows -= len(pks)
        self.min_pk = min((min(pks) for pks in self.sessions.values()), default=None)
        return removed
