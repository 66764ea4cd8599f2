"""Salvage (issue 38): a group that loses a session still reaches the trainer, truncated.

With ``ROLLOUT_BUFFER_SALVAGE=truncate``, a session of a group that wrote at least one row but will
never write a result is *truncated* once a sound signal says it ended:

- ``step_cap``: its last row reached ``--max-steps`` without ending it (the census sees that row);
- ``launcher_exited`` and ``incomplete_group_ttl``: at the moment the group would be dropped for
  that reason.

No other signal: a session waiting on a slow model call or environment step is never taken for
ended. A group whose completed and truncated sessions are at least K is then served with them; a
group with a session that has no row at all cannot be salvaged and is dropped as before.

Owns: which sessions of a group are truncated and why (:func:`truncation`), which sessions a taken
salvaged group serves (:func:`served_sessions`), the ``extra_info`` of a truncated session's last
item, the counts (:class:`Tally`) and the text that records them with the served group (so they
survive a restart). Pure: no I/O and no lock; the accumulator's lock guards every caller.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Container
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rollout_buffer.core.model import (
    LATE_SERVED,
    LAUNCHER_EXITED,
    REJECTED,
    STEP_CAP,
    TTL,
    RowEvent,
    Salvage,
    Take,
)

if TYPE_CHECKING:
    from rollout_buffer.core.census import Census
    from rollout_buffer.core.group import Group

TRUNCATE = "truncate"
REASONS = (STEP_CAP, LAUNCHER_EXITED, TTL)
# The reason a served salvaged group is recorded with (record_reason):
# "salvaged:<reason>:<r>=<n>,...:<generation seconds>:<reward>:<max steps>:<last row 0|1>".
RECORD_PREFIX = "salvaged:"


def truncation(
    group: Group | None,
    group_id: str,
    census: Census,
    k: int,
    reason: str,
    *,
    ended_only: bool = False,
) -> dict[str, str] | None:
    """The sessions of a group to truncate, each with its reason, or None when it cannot be
    salvaged.

    Its sessions are those ``job_environments`` lists for it and those its rows show (the census
    knows both), less those over-sampling excluded. A session with no row at all makes the group
    unsalvageable; so do fewer than K completed and truncated sessions. A session that reached the
    step cap is truncated as ``step_cap``, the others with ``reason``. ``ended_only`` (the step
    cap, before any drop would be due): every unfinished session must have reached the step cap.
    """
    completed: Any = group.completed if group is not None else {}
    sessions = set(census.sessions_of(group_id))
    if group is not None:
        sessions.update(group.sessions)
        if group.excluded:
            sessions -= group.excluded
    capped = census.without_result
    truncated: dict[str, str] = {}
    for sid in sorted(sessions):
        if sid in completed:
            continue
        if not census.has_row(sid) and (group is None or sid not in group.sessions):
            return None  # listed, never wrote a row: nothing to serve for it
        if sid in capped:
            truncated[sid] = STEP_CAP
        elif ended_only:
            return None  # still running, as far as any sound signal says
        else:
            truncated[sid] = reason
    if not truncated or len(completed) + len(truncated) < k:
        return None
    return truncated


def trimmed(salvage: Salvage | None, completed: Any) -> Salvage | None:
    """A group's salvage less the sessions that completed since (their terminal row came while it
    waited to be served); None when none is left truncated."""
    if salvage is None:
        return None
    sessions = {s: r for s, r in salvage.sessions.items() if s not in completed}
    if len(sessions) == len(salvage.sessions):
        return salvage
    if not sessions:
        return None
    return dataclasses.replace(salvage, sessions=sessions)


def fill_order(sessions: dict[str, str]) -> list[str]:
    """Truncated sessions in the order they fill a group up to K: those that ran to the step cap
    first, then by session id (the same order rebuilds a served group, :meth:`Recorded.take`)."""
    return sorted(sessions, key=lambda sid: (sessions[sid] != STEP_CAP, sid))


def served_sessions(
    group: Group, k: int
) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]], Salvage | None]:
    """A group taken by a poll: its served sessions' pks (completed, and truncated when salvaged:
    those without a trainable row with none), its other sessions' pks, and its salvage.

    A salvaged group is served with K sessions (``k``, the K in force): its completed ones, then
    truncated ones (:func:`fill_order`) up to K. The truncated sessions beyond K (over-sampling, a
    lowered K) are its other sessions: never served, and cleared at the proxy with the group."""
    salvage = trimmed(group.salvage, group.completed)
    surplus: list[str] = []
    if salvage is not None:
        order = fill_order(salvage.sessions)
        room = max(k - len(group.completed), 0)
        surplus = order[room:]
        if surplus:
            kept = {sid: salvage.sessions[sid] for sid in order[:room]}
            salvage = dataclasses.replace(salvage, sessions=kept) if kept else None
    completed: dict[str, tuple[int, ...]] = {}
    incomplete: dict[str, tuple[int, ...]] = {}
    truncated = salvage.sessions if salvage is not None else {}
    for sid, pks in group.sessions.items():
        served = sid in group.completed or sid in truncated
        (completed if served else incomplete)[sid] = tuple(pks)
    for sid in truncated:
        completed.setdefault(sid, ())
    for sid in surplus:
        incomplete.setdefault(sid, ())  # (no trainable row: still cleared at the proxy)
    return completed, incomplete, salvage


def unread(group: Group, group_id: str, pks: list[int], rows: list[RowEvent]) -> int:
    """The rows a decision of a salvaged group accounts (``pks``, and its rows rejected among
    ``rows``) that ingest never read: its truncated sessions' last rows, read when it was built.
    They count as read then, so the accounting balances."""
    read = {pk for spks in group.sessions.values() for pk in spks}
    accounted = set(pks)
    accounted.update(r.step_pk for r in rows if r.group_id == group_id and r.outcome == REJECTED)
    return len(accounted - read)


def late_reason(default: str, session_id: str, truncated: Container[str]) -> str:
    """What a late row of a served group counts as: ``default``, but for a session it served
    truncated, ``late_rows_from_served_groups`` (item 4), also where over-sampling counts the
    others' as oversampled (a served session writes nothing after its completed row; a truncated
    one may still write its terminal row)."""
    return LATE_SERVED if session_id in truncated else default


def served_count(group: Group) -> int:
    """The sessions a ready group would serve: its completed ones and, salvaged, its truncated
    ones (the K in force applies to both)."""
    salvage = trimmed(group.salvage, group.completed)
    return len(group.completed) + (len(salvage.sessions) if salvage is not None else 0)


def finish_reason(reason: str) -> str:
    """A truncated session's last item's ``finish_reason``: the step cap is a length limit."""
    return "length" if reason == STEP_CAP else "abort"


def last_item_extra(reason: str) -> str:
    """The ``extra_info`` keys (JSON text) a truncated session's last item adds."""
    return f',"salvaged":"{reason}"'


def truncated_terminals(
    salvage: Salvage, prepared: list[tuple[Any, ...]]
) -> dict[str, tuple[int, int, float]] | None:
    """Each truncated session's terminal (step_id, step_pk, reward) for its items: its last row's,
    with the salvage reward. ``prepared``: a group's validated rows, (session, step_id, pk, ...).
    None when a truncated session has no row to serve (its last row vanished): the group would
    have a hole."""
    out: dict[str, tuple[int, int, float]] = {}
    for sid in salvage.sessions:
        last = max(((p[1], p[2]) for p in prepared if p[0] == sid), default=None)
        if last is None:
            return None
        out[sid] = (last[0], last[1], salvage.reward)
    return out


@dataclass(frozen=True)
class Recorded:
    """A served salvaged group's record, to build its items again (a replayed batch, a
    redelivery, the export), with the settings it was served under. Each truncated session's
    reason is ``step_cap`` when its last row reached the step cap, else the group's (as when it
    was served)."""

    reason: str
    sessions: dict[str, int]  # truncated sessions by reason
    generation_s: float
    reward: float
    max_steps: int | None
    last_row: bool

    @classmethod
    def of(cls, text: str | None) -> Recorded | None:
        """The record of a salvaged group (its recorded reason, :func:`record_reason`), or None
        for any other group; raises ValueError for a salvage record it cannot read."""
        if not text or not text.startswith(RECORD_PREFIX):
            return None
        reason, sessions, seconds, reward, max_steps, last_row = text[len(RECORD_PREFIX) :].split(
            ":"
        )
        counts = {r: int(n) for r, n in (p.split("=") for p in sessions.split(",") if p)}
        steps = int(max_steps) if max_steps else None
        return cls(reason, counts, float(seconds), float(reward), steps, last_row == "1")

    def take(self, t: Take, rows_of: dict[str, list[tuple[int, int, bool]]]) -> Take:
        """``t`` (rebuilt from the recorded rows) with its sessions without a completed row as the
        truncated ones; ``rows_of``: their rows as (step_id, pk, trainable)."""
        completed = dict(t.completed)
        incomplete: dict[str, tuple[int, ...]] = {}
        reasons: dict[str, str] = {}
        for sid, rows in rows_of.items():
            step = max(rows)[0]
            capped = self.max_steps is not None and step >= self.max_steps
            reasons[sid] = STEP_CAP if capped else self.reason
        # the truncated sessions it was served with (those beyond K were not): as many as
        # recorded, in the order that filled it
        kept = fill_order(reasons)[: sum(self.sessions.values())]
        sessions = {sid: reasons[sid] for sid in kept}
        last_rows: dict[str, int] = {}
        for sid, rows in rows_of.items():
            if sid not in sessions:
                incomplete[sid] = tuple(p for _, p, _ in sorted(rows))
                continue
            pk = max(rows)[1]
            if self.last_row:
                completed[sid] = tuple(p for _, p, trainable in sorted(rows) if trainable)
                last_rows[sid] = pk
            else:
                completed[sid] = tuple(p for _, p, _ in sorted(rows))
        salvage = Salvage(
            sessions, self.reason, self.reward, self.last_row, last_rows, max_steps=self.max_steps
        )
        return dataclasses.replace(t, completed=completed, incomplete=incomplete, salvage=salvage)


def record_reason(salvage: Salvage) -> str:
    """The reason a served salvaged group is recorded with: what rebuilding its items needs (the
    settings it was served under) and its counts, restored at a restart."""
    counts = Counter(salvage.sessions.values())
    sessions = ",".join(f"{r}={counts[r]}" for r in sorted(counts))
    return (
        f"{RECORD_PREFIX}{salvage.reason}:{sessions}:{salvage.generation_s:.3f}:"
        f"{salvage.reward!r}:{salvage.max_steps or ''}:{int(salvage.last_row)}"
    )


class Tally:
    """The job's salvaged sessions and groups by reason, and the generation seconds they kept."""

    def __init__(self) -> None:
        self.sessions: Counter[str] = Counter()
        self.groups: Counter[str] = Counter()
        self.generation_s = 0.0
        # the sessions served truncated (since the start: their late rows, see late_reason)
        self.truncated: set[str] = set()

    def served(self, salvage: Salvage) -> None:
        """A salvaged group was served."""
        self.groups[salvage.reason] += 1
        self.sessions.update(salvage.sessions.values())
        self.truncated.update(salvage.sessions)
        self.generation_s += salvage.generation_s

    def load(self, text: str | None, n_groups: int) -> bool:
        """Count ``n_groups`` served groups recorded with this reason; False when it is not a
        salvaged group's (an unreadable one counts as a group of an unknown reason)."""
        try:
            record = Recorded.of(text)
        except ValueError:
            self.groups["unknown"] += n_groups
            return True
        if record is None:
            return False
        self.groups[record.reason] += n_groups
        for r, n in record.sessions.items():
            self.sessions[r] += n * n_groups
        self.generation_s += record.generation_s * n_groups
        return True

    def view(self) -> dict[str, Any]:
        """``/stats`` ``salvaged``."""
        return {
            "sessions": dict(self.sessions),
            "groups": dict(self.groups),
            "generation_seconds_kept": round(self.generation_s, 3),
        }
