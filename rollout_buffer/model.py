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
from typing import NamedTuple, Union

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
GROUP_TOO_LARGE = "group_too_large"  # its rows alone exceed ROLLOUT_BUFFER_MAX_GROUP_BYTES


class BadText(str):
    """A TEXT value that was not valid UTF-8 in the database, decoded with replacement characters.

    SQLite stores whatever bytes a writer gives it; decoding strictly would make every read that
    touches such a row fail (one bad row would stop ingest or serving for good). The row is kept
    and marked instead, so the caller can reject it with a reason."""


class Row(NamedTuple):
    """The metadata of one ingested row (bodies stay in the database until served)."""

    step_pk: int
    session_id: str
    group_id: str | None
    completed: int


class LauncherState(str, enum.Enum):
    """What rollout_buffer_jobs.launcher_state holds."""

    RUNNING = "running"
    RESTART_PENDING = "restart_pending"  # exited; the on-failure policy restarts it after a backoff
    EXITED = "exited"
    STOPPED_REQUESTED = "stopped:requested"
    STOPPED_SHUTDOWN = "stopped:shutdown"

    @classmethod
    def parse(cls, text: str | None) -> "LauncherState | None":
        """The stored text as a state; unknown or legacy texts that start with 'exited' are EXITED."""
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
class Take:
    """A ready group handed to a poll: the pks of its completed and incomplete sessions."""

    group_id: str
    completed: dict[str, tuple[int, ...]]
    incomplete: dict[str, tuple[int, ...]]

    @property
    def served_pks(self) -> list[int]:
        """The rows a served group delivers (its completed sessions')."""
        return [pk for pks in self.completed.values() for pk in pks]

    @property
    def incomplete_pks(self) -> list[int]:
        """The rows of its incomplete sessions (dropped when the group is served)."""
        return sorted(pk for pks in self.incomplete.values() for pk in pks)

    @property
    def all_pks(self) -> list[int]:
        return sorted(pk for d in (self.completed, self.incomplete) for pks in d.values() for pk in pks)

    @property
    def sessions(self) -> list[str]:
        return sorted(set(self.completed) | set(self.incomplete))


@dataclass(frozen=True)
class Drop:
    """A group decided as dropped: its tombstone, the rows it accounts, the sessions to clear."""

    group_id: str
    reason: str
    pks: list[int]
    clear_sessions: list[str]


@dataclass(frozen=True)
class Served:
    """A group decided as served in batch ``batch_id``; its incomplete sessions are cleared."""

    take: Take
    batch_id: str

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


@dataclass
class Decisions:
    """One plan: what a step decided, for the store to record and then memory and the notifier to apply."""

    drops: list[Drop] = field(default_factory=list)
    rows: list[RowEvent] = field(default_factory=list)
    served: list[Served] = field(default_factory=list)
    batch: Batch | None = None
    newly_ready: int = 0

    def __bool__(self) -> bool:
        return bool(self.drops or self.rows or self.served or self.batch)

    def extend(self, other: "Decisions") -> None:
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


NotifyKey = Union[GroupKey, RowKey]
