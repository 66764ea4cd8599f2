"""The values every other module shares: rows, taken groups, decisions, reasons, launcher states.

A *decision* is a value computed once (by the accumulator, or by serving for a built batch),
written in one transaction by the store, then applied to memory and handed to the notifier:
the same object at every step, so nothing is derived twice. This module imports nothing of the
package and does no I/O.

Owns: the value types and the reason and state names. It must not import anything of the package or
do I/O.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, NamedTuple

# Group statuses in rollout_buffer_groups.
SERVED = "served"
DROPPED = "dropped"

# Row outcomes in rollout_buffer_rows.
REJECTED = "rejected"
ROW_DROPPED = "dropped"

# Reasons (SPEC §3).
TTL = "incomplete_group_ttl"
LAUNCHER_EXITED = "launcher_exited"
RESTART_TRAINING = "restart_training"
JOB_ENDED = "job_ended"
MALFORMED = "malformed_row"
INCOMPLETE_IN_SERVED = "incomplete_session_in_served_group"
LATE_DROPPED = "late_rows_from_dropped_groups"
LATE_SERVED = "late_rows_from_served_groups"
MISSING_GROUP = "missing_group_id"
INVALID_GROUP = "invalid_utf8_group_id"
INVALID_SESSION = "invalid_session_id"
BUILD_FAILED = "build_failed"  # a row's build raised an unexpected error repeatedly
GROUP_TOO_LARGE = "group_too_large"  # its rows alone exceed MAX_GROUP_BYTES (core/config.py)
# Training-data policies (issue 10): groups the trainer would throw away, dropped at the source.
STALE = "stale"  # current version - min weight_version > max_off_policy
ZERO_VARIANCE = "zero_variance"  # its sessions' terminal rewards are all equal (within epsilon)
IMPLAUSIBLE_VERSION = "implausible_version"  # a row version that cannot be true (core.versions)
OVERSAMPLED = "oversampled"  # rows of a session beyond the first K completed of its group
# Recorded as the reason of a group served short of K (ROLLOUT_BUFFER_MIN_GROUP_SIZE).
PARTIAL = "partial"
# Salvage (issue 38): a session that ended without a result because it reached --max-steps.
STEP_CAP = "step_cap"


class BadText(str):
    """A TEXT value that was not valid UTF-8 in the database, decoded with replacement characters.

    SQLite stores whatever bytes a writer gives it; decoding strictly would make every read that
    touches such a row fail (one bad row would stop ingest or serving for good). The row is kept
    and marked instead, so the caller can reject it with a reason."""


class Row(NamedTuple):
    """The metadata of one ingested row (bodies stay in the database until served).

    ``step_id``, ``reward`` (step_reward) and ``weight_version`` (0 when absent) feed the
    policies and the group figures; None where the row's value is unusable (its build rejects
    it)."""

    step_pk: int
    session_id: str
    group_id: str | None
    completed: int
    step_id: int | None = None
    reward: float | None = None
    weight_version: int | None = 0


@dataclass(frozen=True)
class Policy:
    """The training-data policies of a job (issue 10); every one is off by default."""

    max_off_policy: int | None = None  # stale when current - min weight_version > this
    drop_zero_variance: bool = False
    zero_variance_epsilon: float = 1e-6
    oversample: int = 0  # extra sessions per group; the first K completed are served
    min_group_size: int | None = None  # at the TTL, serve a group with at least this many completed
    serve_order: str = "ready"  # ready | oldest_version | newest_version
    max_version_jump: int | None = 1000  # a version this far above the current one is implausible
    salvage: str = "off"  # off | truncate (issue 38): serve a group whose sessions ended short
    salvage_reward: float = 0.0  # the terminal reward of a truncated session's items
    message_cut: int = 0  # the launcher's --message-cut: <= 0, a truncated session's last row

    def stale(self, current: int, min_wv: int, max_off_policy: int | None = None) -> bool:
        """The upstream client's rule: current - min(weight_version of the items) >
        max_off_policy."""
        bound = self.max_off_policy if max_off_policy is None else max_off_policy
        return bound is not None and current - min_wv > bound

    def serves(self, k: int, sessions: int) -> bool:
        """Whether a group with this many completed sessions may be served under ``k``: at least
        K, or (partial groups on) at least the minimum group size."""
        least = self.min_group_size
        return sessions >= k or (least is not None and least < k and sessions >= least)

    def zero_variance(self, rewards: list[float] | tuple[float, ...]) -> bool:
        """The sessions' terminal rewards have max - min <= epsilon (when the filter is on)."""
        return (
            self.drop_zero_variance
            and bool(rewards)
            and max(rewards) - min(rewards) <= self.zero_variance_epsilon
        )


class LauncherState(str, enum.Enum):
    """What rollout_buffer_jobs.launcher_state holds."""

    RUNNING = "running"
    RESTART_PENDING = "restart_pending"  # exited; the on-failure policy restarts it after a backoff
    EXITED = "exited"
    STOPPED_REQUESTED = "stopped:requested"
    STOPPED_SHUTDOWN = "stopped:shutdown"
    # stopped at shutdown for a standby on another host: it starts a fresh one
    HANDED_OVER = "stopped:handover"

    @classmethod
    def parse(cls, text: str | None) -> LauncherState | None:
        """The stored text as a state; unknown or legacy texts that start with 'exited' are
        EXITED."""
        if text is None:
            return None
        try:
            return cls(text)
        except ValueError:
            return cls.EXITED if text.startswith(("exited", "gave_up")) else None

    @property
    def finished(self) -> bool:
        """The launcher ended on its own or by request: its incomplete groups can never complete."""
        return self in (LauncherState.EXITED, LauncherState.STOPPED_REQUESTED)


@dataclass(frozen=True)
class PollRequest:
    """A validated ``POST /get_rollout_data`` body."""

    max_groups: int | None = None
    request_id: str | None = None
    wait_s: float = 0.0
    min_groups: int | None = None  # None: the body has no such key (a long-poll waits for 1)
    max_off_policy: int | None = None  # overrides ROLLOUT_BUFFER_MAX_OFF_POLICY for this poll
    current_weight_version: int | None = (
        None  # the trainer's version (the job keeps the last one sent)
    )


@dataclass(frozen=True)
class Salvage:
    """The truncated sessions of a salvaged group (issue 38, :mod:`~rollout_buffer.core.salvage`).

    ``sessions`` maps each truncated session to its reason (``step_cap``, ``launcher_exited``,
    ``incomplete_group_ttl``), ``reason`` is what decided the group, ``reward`` the terminal reward
    of every item of a truncated session. ``last_row``: at --message-cut <= 0 a truncated session
    is served from its last row, trainable or not; ``last_rows`` holds their pks once read (by
    session id, when the group is built)."""

    sessions: dict[str, str]
    reason: str
    reward: float = 0.0
    last_row: bool = True
    last_rows: dict[str, int] = field(default_factory=dict)
    generation_s: float = 0.0  # what generating the group cost (its sessions' seconds), when taken
    max_steps: int | None = None  # the launcher's --max-steps (recorded: its items are rebuilt)


@dataclass(frozen=True)
class Take:
    """A ready group handed to a poll: the pks of its completed and incomplete sessions.

    ``rewards`` are the completed sessions' terminal rewards as ingested (for the figures of a
    group refused at serving), ``partial`` marks a group served short at the TTL
    (``ROLLOUT_BUFFER_MIN_GROUP_SIZE``), ``ready_at`` is when it became ready (monotonic),
    ``min_wv`` the min weight_version of its completed sessions' rows known at ingest (None: none
    known, or no policy needed them)."""

    group_id: str
    completed: dict[str, tuple[int, ...]]
    incomplete: dict[str, tuple[int, ...]]
    rewards: tuple[float, ...] = ()
    partial: bool = False
    ready_at: float | None = None
    min_wv: int | None = None
    redelivered: bool = (
        False  # a served group delivered again (redelivery.py): no decision of its own
    )
    salvage: Salvage | None = None  # its truncated sessions, when salvaged (issue 38)

    @property
    def served(self) -> dict[str, tuple[int, ...]]:
        """The rows a served group delivers, by session: its completed sessions' and, when
        salvaged, its truncated sessions' (with their last rows at --message-cut <= 0)."""
        s = self.salvage
        if s is None or not s.last_rows:
            return self.completed
        out = dict(self.completed)
        for sid, pk in s.last_rows.items():
            pks = out.get(sid, ())
            if pk not in pks:
                out[sid] = (*pks, pk)
        return out

    @property
    def served_pks(self) -> list[int]:
        """The rows a served group delivers (see :attr:`served`)."""
        return [pk for pks in self.served.values() for pk in pks]

    @property
    def extra_pks(self) -> int:
        """Served rows that ingest never read: truncated sessions' last rows that are not
        trainable (they count as read when served)."""
        s = self.salvage
        if s is None:
            return 0
        return sum(1 for sid, pk in s.last_rows.items() if pk not in self.completed.get(sid, ()))

    @property
    def incomplete_pks(self) -> list[int]:
        """The rows of its incomplete sessions (dropped when the group is served)."""
        return sorted(pk for pks in self.incomplete.values() for pk in pks)

    @property
    def all_pks(self) -> list[int]:
        return sorted(
            pk for d in (self.served, self.incomplete) for pks in d.values() for pk in pks
        )

    @property
    def sessions(self) -> list[str]:
        return sorted(set(self.completed) | set(self.incomplete))


@dataclass(frozen=True)
class Drop:
    """A group decided as dropped: its tombstone, the rows it accounts, the sessions to clear, and
    the terminal rewards of its completed sessions (its figures: steps per session, mean reward)."""

    group_id: str
    reason: str
    pks: list[int]
    clear_sessions: list[str]
    rewards: tuple[float, ...] = ()


@dataclass(frozen=True)
class Served:
    """A group decided as served in batch ``batch_id``; its incomplete sessions are cleared."""

    take: Take
    batch_id: str
    rewards: tuple[float, ...] = ()  # its sessions' terminal rewards, as served

    @property
    def group_id(self) -> str:
        return self.take.group_id


@dataclass(frozen=True)
class RowEvent:
    """A row accounted one by one: rejected (with a reason), or a late row of a decided group."""

    step_pk: int
    outcome: str  # REJECTED | ROW_DROPPED
    reason: str
    group_id: str | None
    session_id: str | None


@dataclass(frozen=True)
class Batch:
    """A delivered batch: what replay needs to rebuild it byte for byte."""

    batch_id: str
    job_id: str
    request_id: str | None
    seed: bytes
    group_ids: list[str]
    n_items: int
    n_bytes: int
    meta: dict[str, Any] | None = (
        None  # meta_info keys that cannot be derived from the rows (sent again on replay)
    )


@dataclass
class Decisions:
    """One plan: what a step decided, for the store to record and then memory and the notifier to
    apply."""

    drops: list[Drop] = field(default_factory=list)
    rows: list[RowEvent] = field(default_factory=list)
    served: list[Served] = field(default_factory=list)
    batch: Batch | None = None
    newly_ready: int = 0
    # served groups delivered again: group_id -> None (in ``batch``) or why it could not be
    redelivered: dict[str, str | None] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.drops or self.rows or self.served or self.batch or self.redelivered)

    def extend(self, other: Decisions) -> None:
        """Merge another plan into this one (a batch is never merged)."""
        assert other.batch is None
        self.drops.extend(other.drops)
        self.rows.extend(other.rows)
        self.served.extend(other.served)
        self.newly_ready += other.newly_ready


class GroupKey(NamedTuple):
    """Outbox key of a decided group whose sessions the proxy must clear."""

    job_id: str
    group_id: str


class RowKey(NamedTuple):
    """Outbox key of a late or rejected row whose session the proxy must clear."""

    job_id: str
    step_pk: int


NotifyKey = GroupKey | RowKey
