"""Settling what a poll could not finish by itself: a COMMIT whose outcome is unknown (did the
batch get recorded?), and groups another instance decided meanwhile.

Owns: reading the store to find out what happened. It must not serve: the poll applies what this
finds (:class:`rollout_buffer.serving.poll.Serving`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from rollout_buffer.core.model import Decisions, Take
from rollout_buffer.runtime.jobs import JobState
from rollout_buffer.runtime.notifications import Outbox
from rollout_buffer.serving import redelivery
from rollout_buffer.storage.store import Pair

logger = logging.getLogger("rollout_buffer.serving.poll")


@dataclass(frozen=True)
class Uncertain:
    """A serving plan whose COMMIT reported an error: it may or may not have been recorded."""

    job_id: str
    plan: Decisions
    takes: list[Take]


def committed(pair: Pair, job_state: JobState, uncertain: Uncertain) -> bool:
    """Whether the uncertain plan was recorded after all: its batch, else its first drop, else
    (only redeliveries that failed) a group that left the stored redelivery queue."""
    plan = uncertain.plan
    if plan.batch is not None:
        return pair.store.batch_exists(plan.batch.batch_id)
    if plan.drops:
        return pair.store.group_decision(job_state.job_id, plan.drops[0].group_id) is not None
    queued = set(pair.store.redelivery_queue(job_state.job_id))
    return any(gid not in queued for gid in plan.redelivered)


def settle_conflict(pair: Pair, job_state: JobState, takes: list[Take], outbox: Outbox) -> None:
    """A decision of another instance is already stored for some of these groups: take its word
    for them (never serve them again) and give the others back."""
    redelivery.release(
        job_state, [t for t in takes if t.redelivered]
    )  # they stay served: queued again
    decided, takes = {}, [t for t in takes if not t.redelivered]
    for t in takes:
        d = pair.store.group_decision(job_state.job_id, t.group_id)
        if d is not None:
            decided[t.group_id] = d
    job_state.accumulator.release([t for t in takes if t.group_id not in decided])
    late = job_state.accumulator.settle_decided(
        [t for t in takes if t.group_id in decided], decided
    )
    outbox.act_quietly(pair.store, job_state.job_id, late)
    logger.warning(
        "%d groups of job %s were already decided by another instance; settled from its record",
        len(decided),
        job_state.job_id,
    )
