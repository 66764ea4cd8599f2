"""A poll's one decision: its batch, the groups it serves, the groups it refuses and their rows.

Owns: turning what a draft built and refused into one :class:`~rollout_buffer.core.model.Decisions`
(a refused group is dropped with its malformed rows rejected; a refused redelivery only fails its
redelivery; the batch's metadata). Pure but for one rate-limited log line; it must not record or
apply the plan: serving does both, in that order.
"""

from __future__ import annotations

import collections
import logging
import uuid

from rollout_buffer.core.items import GroupItems
from rollout_buffer.core.logconfig import EventLog
from rollout_buffer.core.model import REJECTED, Batch, Decisions, Drop, RowEvent, Served, Take
from rollout_buffer.runtime.jobs import JobState


def plan_poll(
    job_state: JobState,
    seed: bytes,
    request_id: str | None,
    built: list[tuple[Take, GroupItems]],
    refused: list[tuple[Take, str, dict[int, str]]],
    stats: dict[str, dict],
    events: EventLog,
) -> Decisions:
    """The one decision of a poll: its batch, served groups, refused groups and their bad
    rows."""
    plan, job_id = Decisions(), job_state.job_id
    for t, reason, bad in refused:
        if t.redelivered:  # it stays served: only its redelivery fails
            plan.redelivered[t.group_id] = reason
            continue
        plan.drops.append(
            Drop(
                t.group_id,
                reason,
                [pk for pk in t.all_pks if pk not in bad],
                t.sessions,
                t.rewards,
            )
        )
        plan.rows.extend(RowEvent(pk, REJECTED, why, t.group_id, None) for pk, why in bad.items())
        events.event(
            f"group refused when served ({reason})",
            logging.WARNING,
            "group %s of job %s dropped (%s)%s",
            t.group_id,
            job_id,
            reason,
            f": malformed rows {bad}" if bad else "",
        )
    if built:
        batch_id = uuid.uuid4().hex
        filtered = collections.Counter(job_state.accumulator.filtered_since_batch())
        filtered.update(d.reason for d in plan.drops)
        meta = {
            "group_stats": [stats[t.group_id] for t, _ in built],
            "filtered": dict(filtered),
            "partial_groups": sorted(t.group_id for t, _ in built if t.partial),
            "redelivered": [t.group_id for t, _ in built if t.redelivered],
        }
        plan.batch = Batch(
            batch_id,
            job_id,
            request_id,
            seed,
            [t.group_id for t, _ in built],
            sum(g.n_items for _, g in built),
            0,
            meta,
        )
        plan.served = [
            Served(t, batch_id, tuple(g.session_rewards)) for t, g in built if not t.redelivered
        ]
        plan.redelivered.update((t.group_id, None) for t, _ in built if t.redelivered)
    return plan
