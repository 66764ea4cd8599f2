"""One response being built: groups taken a few at a time, fetched and built into one buffer.

Owns: :class:`Draft` (its seed, buffer, built and refused groups, what must go back to the queues)
and the rules of building it: the byte budget (items, head and meta_info), the per-group byte
cap, the policies' second look at a built group (staleness, zero variance), and a poison pill
retried a bounded number of times. A poll builds a draft and records it at once; the prebuilder
(prebuilt.py) builds one before the poll, which claims it. Either way the groups of a draft are
*taken* (one copy in flight) and nothing of it is decided until serving records its plan. It must
not record anything, and it never sends bytes.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollout_buffer.core.accounting import group_stats
from rollout_buffer.core.errors import StorageError
from rollout_buffer.core.items import GroupItems, Malformed, build_group, item_flags
from rollout_buffer.core.model import (
    BUILD_FAILED,
    GROUP_TOO_LARGE,
    MALFORMED,
    STALE,
    ZERO_VARIANCE,
    Policy,
    Take,
)
from rollout_buffer.serving import redelivery
from rollout_buffer.storage.launcher_tables import FETCH_CHUNK, fetch_takes, with_last_rows
from rollout_buffer.storage.store import Pair

TAKE_STEP = 64  # groups taken from the queues at a time
# what a group's wait_s and age_s may take in meta_info once served: they are measured when the
# poll serves it, after its size was counted (any age up to about 3,000 years fits)
WIDEST_SECONDS = 99_999_999_999.999


@dataclass(frozen=True)
class Shape:
    """What a poll asks for that changes its answer (a draft serves only a poll of its shape)."""

    max_groups: int | None = None
    max_off_policy: int | None = None


def json_len(value: str) -> int:
    """Bytes of a string as meta_info encodes it (ASCII-escaped JSON), not its length in
    characters."""
    return len(json.dumps(value))


def group_stats_of(t: Take, g: GroupItems, now: float) -> dict[str, Any]:
    """meta_info.group_stats of a group served at ``now``: wait since ready (``now`` on the
    accumulator's monotonic clock), age since its first served row was written (wall clock)."""
    wait = None if t.ready_at is None else now - t.ready_at
    age = None if g.first_ts is None else time.time() - g.first_ts
    return group_stats(t.group_id, g.session_rewards, g.n_items, g.weight_versions, wait, age)


class Draft:
    """A response under construction for one job and one shape."""

    def __init__(self, job_id: str, shape: Shape, budget: int) -> None:
        self.job_id, self.shape, self.budget = job_id, shape, budget
        self.seed = secrets.token_bytes(16)
        self.buf = bytearray()
        self.built: list[tuple[Take, GroupItems]] = []
        self.refused: list[
            tuple[Take, str, dict[int, str]]
        ] = []  # dropped instead: (take, reason, bad rows)
        self.stats: dict[str, dict] = {}  # group_id -> its meta_info.group_stats entry
        self.sizes: dict[str, int] = {}  # group_id -> what it adds to meta_info
        self.meta_size = 1024  # the head and meta_info; grows with each built group
        self.spent = 0  # bytes built and refused (a poll builds about a budget, whatever it keeps)
        self.full = False
        self.leftover: list[Take] = []  # taken but not built (the budget): back to the queue
        self.retry: list[Take] = []  # failed for an unexpected reason: back to the queue
        self.taken: list[Take] = []  # every take this draft holds (released whole on a failure)
        self.built_s = 0.0

    @property
    def done(self) -> list[Take]:
        """The takes its plan decides (built and refused)."""
        return [t for t, _ in self.built] + [t for t, _, _ in self.refused]

    def room(self) -> bool:
        return not self.full and (
            self.shape.max_groups is None or len(self.built) < self.shape.max_groups
        )

    def give_back(self) -> list[Take]:
        """The takes that must go back to their queues now (leftover and retry); the draft drops
        them."""
        back, self.leftover, self.retry = self.leftover + self.retry, [], []
        gone = {t.group_id for t in back}
        self.taken = [t for t in self.taken if t.group_id not in gone]
        return back

    def still_holds(self, accumulator: Any, policy: Policy) -> bool:
        """At the claim: its verdicts still hold at the job's version now (a version that moved
        since the draft was built can make a built group stale, or a refused one fresh), and no
        built group was tainted meanwhile; its takes are refreshed (accumulator.recheck). False:
        discard it."""
        bound, current = self.shape.max_off_policy, accumulator.current_version
        built = []
        for t, g in self.built:
            if not t.redelivered:
                fresh = accumulator.recheck(t)
                if fresh is None:
                    return False
                t = fresh
            if not t.redelivered and policy.stale(
                current, min(g.weight_versions, default=0), bound
            ):
                return False
            built.append((t, g))
        self.built = built
        return all(
            policy.stale(current, t.min_wv, bound)
            for t, reason, _ in self.refused
            if reason == STALE and t.min_wv is not None
        )

    def stamp(self, now: float) -> None:
        """Measure the built groups' wait_s and age_s as they are served (``now`` on the
        accumulator's monotonic clock): the same figures whether the draft was built by this poll
        or before it."""
        for t, g in self.built:
            self.stats[t.group_id] = group_stats_of(t, g, now)

    def fit_request_id(self, request_id: str | None) -> None:
        """A poll's request_id is written twice in meta_info: groups that no longer fit come off the
        end."""
        self.meta_size += 2 * json_len(request_id or "")
        while len(self.built) > 1 and self.spent + len(self.buf) + self.meta_size > self.budget:
            t, g = self.built.pop()
            del self.buf[g.start :]
            self.stats.pop(t.group_id)
            self.meta_size -= self.sizes.pop(t.group_id)
            self.leftover.insert(0, t)
            self.full = True

    def build(
        self,
        pair: Pair,
        job_state: Any,
        policy: Policy,
        cap: int,
        failed: Callable[[Take, Exception], bool],
    ) -> None:
        """Take and build groups until the draft is full or nothing is left to take. ``failed``
        counts an unexpected build failure of a group (True: drop it). Raises what the database
        raised; the caller then releases ``taken``."""
        started = time.perf_counter()
        current = job_state.accumulator.current_version
        while self.room():
            want = (
                TAKE_STEP
                if self.shape.max_groups is None
                else min(TAKE_STEP, self.shape.max_groups - len(self.built))
            )
            takes = redelivery.take(pair, job_state, want)
            if not takes:
                break
            self.taken.extend(takes)  # before anything that can raise: released whole then
            takes = with_last_rows(pair.source, self.job_id, takes)
            self.taken[-len(takes) :] = takes
            fresh = []
            for t in takes:  # stale by the versions read at ingest: dropped without reading a row
                if t.min_wv is not None and policy.stale(
                    current, t.min_wv, self.shape.max_off_policy
                ):
                    self.refused.append((t, STALE, {}))
                else:
                    fresh.append(t)
            # bodies are read a few hundred rows at a time (FETCH_CHUNK), as they are built, so a
            # draft holds the rows of a few groups, not of every group it takes
            i = 0
            while i < len(fresh) and not self.full:
                j, n = i, 0
                while j < len(fresh) and (j == i or n + len(fresh[j].served_pks) <= FETCH_CHUNK):
                    n += len(fresh[j].served_pks)
                    j += 1
                rows, too_large, unreadable = fetch_narrowed(pair, fresh[i:j], cap)
                for t in fresh[i:j]:
                    i += 1
                    current = self._add(
                        t, rows, too_large, unreadable, job_state, policy, current, failed
                    )
                    if self.full:
                        self.leftover += fresh[i:]
                        break
                del rows
        self.built_s += time.perf_counter() - started

    def _add(
        self,
        t: Take,
        rows: dict[int, tuple],
        too_large: set[str],
        unreadable: dict[str, Exception],
        job_state: Any,
        policy: Policy,
        current: int,
        failed: Callable[[Take, Exception], bool],
    ) -> int:
        """Build one group into the buffer, or refuse it, or set it aside; returns the current
        version."""
        if t.group_id in too_large:
            self.refused.append((t, GROUP_TOO_LARGE, {}))
            return current
        start = len(self.buf)
        try:
            if t.group_id in unreadable:
                raise unreadable[t.group_id]
            g = build_group(
                t, rows, self.seed, self.job_id, self.buf, item_flags(t.partial, t.redelivered)
            )
        except Malformed as exc:
            self.refused.append((t, MALFORMED, exc.bad))
            return current
        except Exception as exc:
            del self.buf[start:]
            (self.refused.append((t, BUILD_FAILED, {})) if failed(t, exc) else self.retry.append(t))
            return current
        # every version of its rows, also those not read at ingest (a long env_state): one that
        # cannot be true drops it, the others count toward the agreement on the current version
        verdict = (
            None
            if t.redelivered
            else job_state.accumulator.judge_versions(t.group_id, g.weight_versions)
        )
        # only a staleness bound makes a version matter enough to drop a group for it
        judged = policy.max_off_policy is not None or self.shape.max_off_policy is not None
        implausible = verdict if judged else None
        current = job_state.accumulator.current_version
        # again just before it is served: a group can go stale while it waits (a redelivered group
        # keeps its first verdict)
        reason = (
            None
            if t.redelivered
            else implausible
            if implausible is not None
            else STALE
            if policy.stale(current, min(g.weight_versions, default=0), self.shape.max_off_policy)
            else ZERO_VARIANCE
            if policy.zero_variance(g.session_rewards)
            else None
        )
        if reason is not None:
            self.spent += len(self.buf) - start
            del self.buf[start:]
            self.refused.append((t, reason, {}))
            self.full = self.spent + len(self.buf) + self.meta_size > self.budget
            return current
        figures = self.stats[t.group_id] = group_stats_of(t, g, job_state.accumulator.clock())
        # the body is buf plus a head and a meta_info tail that lists the group ids twice
        # (finished_groups, group_stats), its figures and maybe partial_groups and redelivered
        widest = dict(figures, wait_s=WIDEST_SECONDS, age_s=WIDEST_SECONDS)  # stamped when served
        size = 3 * json_len(t.group_id) + len(json.dumps(widest, separators=(",", ":"))) + 3
        if self.built and self.spent + len(self.buf) + self.meta_size + size > self.budget:
            del self.buf[g.start :]  # does not fit: it goes back, first, for the next poll
            self.leftover.append(t)
            self.full = True
            return current
        self.meta_size += size
        self.sizes[t.group_id] = size
        self.built.append((t, g))
        return current


def fetch_narrowed(
    pair: Pair, takes: list[Take], cap: int
) -> tuple[dict[int, tuple], set[str], dict[str, Exception]]:
    """fetch_takes, and when a fetch fails while the database answers: the groups whose own rows
    cannot be read (a value the driver cannot decode), each with its error."""
    try:
        rows, too_large = fetch_takes(pair.source, takes, cap)
        return rows, too_large, {}
    except StorageError as exc:
        # narrow only a failure about a value read; a locked, slow or lost database is a 503
        if not exc.about_data or not pair.source.answers():
            raise
    rows, too_large = {}, set()
    unreadable: dict[str, Exception] = {}
    for t in takes:  # one group at a time, to find the poison
        try:
            r, big = fetch_takes(pair.source, [t], cap)
        except StorageError as exc:
            if not exc.about_data or not pair.source.answers():
                raise
            unreadable[t.group_id] = exc
            continue
        rows.update(r)
        too_large |= big
    return rows, too_large, unreadable
