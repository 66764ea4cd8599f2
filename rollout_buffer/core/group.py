"""The undecided prompt groups of a job: one group, the policies' verdict on it once it is ready,
and the orders the accumulator keeps them in.

Owns: the metadata a group holds while undecided (its sessions' row pks, which sessions completed
and with what terminal reward, the weight versions the policies need), the verdict of the
training-data policies on a ready group, the index of every undecided group (the oldest and the
low-water mark), and the ready queue (ROLLOUT_BUFFER_SERVE_ORDER): which ready group a poll takes
next, first ready first or by the min weight_version of the sessions it serves (oldest or newest
first, ties by readiness), and a group a poll gave back at its old place. The ready queue is a dict
of the ready groups by group_id (in readiness order) and, for a version order, a heap of (key, seq,
group_id): an entry is used only while it is its group's current key in the dict, and entries of
groups that left the queue are swept once they outnumber the live ones. No I/O and no lock: the
accumulator's lock guards every group and both orders; it decides nothing about other groups, and
it must not record or act on its verdict."""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Iterable

from rollout_buffer.core.model import STALE, ZERO_VARIANCE, Policy, Salvage


class Group:
    """One prompt group that is not decided yet."""

    __slots__ = (
        "chosen",
        "completed",
        "excluded",
        "first_seen",
        "group_id",
        "last_seen",
        "min_pk",
        "min_wv",
        "n_rows",
        "order_key",
        "partial",
        "ready_at",
        "salvage",
        "sessions",
        "taken",
        "weight_version",
    )

    def __init__(self, group_id: str, now: float) -> None:
        self.group_id = group_id
        self.sessions: dict[str, list[int]] = {}  # session -> its rows' pks (metadata only)
        # sessions that wrote their completed row -> (first completing pk, terminal (step_id, pk),
        # reward)
        self.completed: dict[str, tuple[int, tuple[int, int], float | None]] = {}
        self.n_rows = 0
        self.last_seen = now
        self.first_seen = now
        self.min_pk: int | None = None
        self.taken: dict[str, int] | None = None  # session -> rows handed to the server
        # the weight versions known at ingest, only when a policy needs them: one int while every
        # row
        # read has that version (the common case, and small), else session -> its rows' min version
        self.weight_version: int | dict[str, int] | None = None
        self.chosen: frozenset[str] | None = (
            None  # over-sampling: the K sessions it will serve, once ready
        )
        # over-sampling: sessions dropped as oversampled, for good (a change of K, a restart, a
        # partial
        # group reaching K never lets one back in: its rows already read are accounted as dropped)
        self.excluded: set[str] | None = None
        self.partial = False  # made ready at the TTL short of K (min group size)
        self.salvage: Salvage | None = None  # its truncated sessions, once salvaged (issue 38)
        self.ready_at: float | None = None
        self.min_wv: int | None = (
            None  # min weight_version of its served sessions (known at ingest)
        )
        self.order_key: tuple[int, int, str] | None = None  # its entry in a version serve order

    def session_ids(self) -> list[str]:
        return sorted(self.sessions)

    def all_pks(self) -> list[int]:
        return sorted(pk for pks in self.sessions.values() for pk in pks)

    def rewards(self) -> tuple[float, ...]:
        """The terminal rewards of its completed sessions (those known at ingest)."""
        return tuple(c[2] for c in self.completed.values() if c[2] is not None)

    def exclude(self, sid: str) -> None:
        """Over-sampling: a session whose rows are dropped as oversampled stays out for good."""
        if self.excluded is None:
            self.excluded = {sid}
        else:
            self.excluded.add(sid)

    def add_version(self, sid: str, version: int | None) -> None:
        """The weight version of a row of session ``sid`` just added (None: unknown at ingest)."""
        w = self.weight_version
        if w is None:  # its first row
            self.weight_version = version if version is not None else {}
        elif w.__class__ is int:
            if (
                version != w
            ):  # the first row of another version (or unknown): per session from now on
                d = {s: w for s, pks in self.sessions.items() if s != sid or len(pks) > 1}
                if version is not None and version < d.get(sid, version + 1):
                    d[sid] = version
                self.weight_version = d
        # w is the per-session dict here, but mypy does not narrow on ``w.__class__ is int`` (kept
        # over isinstance on this per-row path): union-attr and index name what it cannot see.
        elif version is not None and version < w.get(sid, version + 1):  # type: ignore[union-attr]
            w[sid] = version  # type: ignore[index]

    def min_version(self, sessions: Iterable[str]) -> int | None:
        """The min weight_version known at ingest of these sessions' rows; None when none is
        known."""
        w = self.weight_version
        if w is None or isinstance(w, int):
            return w
        return min((w[s] for s in sessions if s in w), default=None)

    def refusal(self, policy: Policy, current_version: int) -> str | None:
        """A ready group's verdict: the drop reason of a policy that refuses it, or None.

        Stale: current - min weight_version of the sessions it serves > max_off_policy, over the
        versions known at ingest (a row whose env_state was not read, too long or unreadable, does
        not count: its build judges it; with none known, only the build does). Zero variance: the
        terminal rewards of its completed sessions all within epsilon (only when all are known)."""
        if self.weight_version is not None:
            self.min_wv = self.min_version(
                self.chosen if self.chosen is not None else self.completed
            )
            if self.min_wv is not None and policy.stale(current_version, self.min_wv):
                return STALE
        if (
            policy.drop_zero_variance
            and None not in (c[2] for c in self.completed.values())
            and policy.zero_variance(self.rewards())
        ):
            return ZERO_VARIANCE
        return None

    def choose(self, k: int) -> dict[str, list[int]]:
        """Over-sampling: keep the first k completed sessions (in the order of their completing
        rows' ids) and forget the others for good (``excluded``); returns the sessions removed, with
        their rows' pks."""
        self.chosen = frozenset(sorted(self.completed, key=lambda s: self.completed[s][0])[:k])
        removed = {
            sid: self.sessions.pop(sid)
            for sid in [s for s in self.sessions if s not in self.chosen]
        }
        if removed:
            self.excluded = set(removed) if self.excluded is None else self.excluded | set(removed)
        for sid, pks in removed.items():
            self.completed.pop(sid, None)
            self.n_rows -= len(pks)
        self.min_pk = min((min(pks) for pks in self.sessions.values()), default=None)
        return removed


class Undecided:
    """Every undecided group of a job in creation order (the oldest first) and a lazy heap of their
    smallest pks, so the oldest group and the low-water mark cost O(log n), not a scan of every
    group under the accumulator's lock (a /stats or a cursor save with 200k pending groups)."""

    def __init__(self) -> None:
        self.groups: OrderedDict[str, Group] = OrderedDict()
        self._mins: list[
            tuple[int, str]
        ] = []  # (min_pk, group_id); an entry counts while it is current

    def add(self, g: Group) -> None:
        self.groups[g.group_id] = g

    def remove(self, g: Group) -> None:
        self.groups.pop(g.group_id, None)

    def min_pk_changed(self, g: Group) -> None:
        if g.min_pk is not None:
            if (
                len(self._mins) > 2 * len(self.groups) + 64
            ):  # entries of decided groups or old minima
                self._mins = [
                    (x.min_pk, x.group_id) for x in self.groups.values() if x.min_pk is not None
                ]
                heapq.heapify(self._mins)
            heapq.heappush(self._mins, (g.min_pk, g.group_id))

    def oldest(self) -> Group | None:
        return next(iter(self.groups.values()), None)

    def low_water(self) -> int | None:
        """The smallest pk of an undecided group, or None."""
        while self._mins:
            pk, gid = self._mins[0]
            g = self.groups.get(gid)
            if g is not None and g.min_pk == pk:
                return pk
            heapq.heappop(self._mins)
        return None


SIGNS = {"ready": 0, "oldest_version": 1, "newest_version": -1}


class ReadyQueue(OrderedDict[str, Group]):
    """group_id -> ready Group, popped in the serve order with :meth:`pop_next`."""

    def __init__(self, serve_order: str = "ready") -> None:
        super().__init__()
        self._sign = SIGNS[serve_order]
        self._heap: list[tuple[int, int, str]] = []
        self._seq = itertools.count()

    def push(self, g: Group) -> None:
        """A group became ready: last in readiness, at its place in the version order."""
        if self._sign:
            self._sweep()
            g.order_key = (
                self._sign * (g.min_wv or 0),
                next(self._seq),
                g.group_id,
            )  # unknown: as 0
            heapq.heappush(self._heap, g.order_key)
        self[g.group_id] = g

    def put_front(self, g: Group) -> None:
        """A group a poll gave back: first again, at its old place in the version order."""
        if self._sign and g.order_key is not None:
            self._sweep()
            heapq.heappush(self._heap, g.order_key)
        self[g.group_id] = g
        self.move_to_end(g.group_id, last=False)

    def pop_next(self) -> Group:
        """(Not empty.) The next group in the serve order, removed."""
        if not self._sign:
            return self.popitem(last=False)[1]
        while True:
            key = heapq.heappop(self._heap)
            g = self.get(key[2])
            if g is not None and g.order_key == key:
                del self[key[2]]
                return g

    def _sweep(self) -> None:
        """Drop the entries of groups that left the queue (dropped, taken again, back to
        pending)."""
        if len(self._heap) > 2 * len(self) + 64:
            self._heap = [g.order_key for g in self.values() if g.order_key is not None]
            heapq.heapify(self._heap)
