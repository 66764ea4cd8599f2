"""Delivering served groups again after the trainer restarted from a checkpoint (issue 11).

The upstream trainer calls ``/start_rollout`` once per process, with ``skip_instance_ids``: the
groups its checkpoint holds. When that call does not begin a new job (the launcher is "already
running", or it names the active job with ``restart_training: false``) and the list is not
empty, every group of the active job that was served and is not in the list is queued again,
ahead of new groups: the trainer crashed after they were served and before a checkpoint held
them. A queued group is rebuilt from its immutable rows (as a replay is, with the poll's new
seed: new uids) and its items carry ``extra_info.redelivered: true``.

Owns: the active job's queue (:class:`Redeliveries`), the rule that fills it (:func:`redeliver`),
and turning a queued group back into a Take for a poll (:func:`take`). The queue is recorded
(store, fenced by the lease) before memory changes and loaded with the job after a restart. A
redelivered group keeps its decision (served); only its redelivery is settled, in the same
transaction as the batch that carries it. It must not touch an undecided group, and a
redelivered group never passes through the accumulator's ready queue.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from rollout_buffer.core.errors import Invalid, LeaseLost, StorageError, Unavailable
from rollout_buffer.core.model import Decisions, Take
from rollout_buffer.runtime.locks import Locks
from rollout_buffer.storage.launcher_tables import fetch_rows, recorded_salvage, take_from_rows
from rollout_buffer.storage.store import Pair

logger = logging.getLogger(__name__)

ROWS_MISSING = "rows_missing"  # a row of the group is gone from session_steps: it cannot be rebuilt
# it has fewer sessions than the K in force (K raised since it was served), and partial groups are
# off: the trainer asked for K sessions a group (issue 35)
SHORT_OF_K = "short_of_k"


def take(pair: Pair, job_state: Any, want: int) -> list[Take]:
    """A poll's next groups: queued redeliveries first (rebuilt from their rows), then ready
    ones."""
    out: list[Take] = []
    popped = job_state.redeliveries.pop(want) if len(job_state.redeliveries) else []
    try:
        for gid in popped:
            t = _take_again(pair, job_state, gid)
            if t is not None:
                out.append(t)
    except BaseException:
        job_state.redeliveries.put_front(popped)
        raise
    if len(out) < want:
        out += job_state.accumulator.take_ready(want - len(out))
    return out


def _take_again(pair: Pair, job_state: Any, gid: str) -> Take | None:
    """A served group as a Take again, from the pks its decision recorded; None (recorded as failed)
    when one of its rows is gone: a group is never delivered again with fewer items than it had;
    nor with fewer sessions than the K in force, but as a partial group when those are on."""
    pks = pair.store.group_pks(job_state.job_id, gid)
    rows = fetch_rows(pair.source, pks)
    t = take_from_rows(gid, pks, rows, recorded_salvage(pair.store, job_state.job_id, gid))
    k, accumulator = job_state.accumulator.k, job_state.accumulator
    if not (pks and len(rows) == len(pks) and t.completed):
        reason = ROWS_MISSING
        why = f"{len(pks) - len(rows)} of its {len(pks)} rows are gone"
    elif not accumulator.policy.serves(k, len(t.completed)):
        reason = SHORT_OF_K
        why = f"it has {len(t.completed)} sessions, and K is {k} now"
    else:
        return Take(
            gid,
            t.completed,
            {},
            partial=len(t.completed) < k,
            redelivered=True,
            salvage=t.salvage,
        )
    plan = Decisions(redelivered={gid: reason})
    pair.store.record(job_state.job_id, plan)
    job_state.redeliveries.settled(plan)
    logger.error("group %s of job %s cannot be delivered again: %s", gid, job_state.job_id, why)
    return None


def release(job_state: Any, takes: list[Take]) -> Decisions:
    """Give a poll's takes back: redeliveries to the front of their queue, the others to the
    accumulator."""
    job_state.redeliveries.put_front([t.group_id for t in takes if t.redelivered])
    return job_state.accumulator.release([t for t in takes if not t.redelivered])


def retake(job_state: Any, takes: list[Take]) -> None:
    """Takes of a COMMIT that did happen after all: they leave their queues again."""
    job_state.redeliveries.remove([t.group_id for t in takes if t.redelivered])
    job_state.accumulator.retake([t for t in takes if not t.redelivered])


def parse_skip(value: Any) -> list[str] | None:
    """``skip_instance_ids`` of a /start_rollout body: a list of group ids (text or integers)."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) or type(v) is int for v in value):
        raise Invalid(
            "skip_instance_ids must be a list of group ids (strings or integers): "
            f"got {type(value).__name__}",
            field="skip_instance_ids",
        )
    return [str(v) for v in value]


def redeliver(
    pair: Pair,
    job_state: Any,
    skip: list[str],
    locks: Locks,
    settle: Callable[[Pair, Any], None],
    on_queued: Callable[[], None],
) -> dict[str, Any]:
    """Queue again every served group of the active job that ``skip`` does not name; returns the
    /start_rollout answer's ``redelivery``. Holds the serve lock: no poll is building meanwhile
    (``settle`` first settles a poll whose COMMIT is uncertain, so the store is the whole truth)."""
    with locks.serving():
        try:
            settle(pair, job_state)
            queue, cancelled = pair.store.queue_redeliveries(job_state.job_id, set(skip))
        except LeaseLost:
            raise
        except StorageError as exc:
            raise Unavailable(
                f"the database is unreachable: {exc}; the groups to deliver again were not "
                "recorded, retry",
                retry_after=3,
            ) from exc
        job_state.redeliveries.replace(queue, cancelled)
    on_queued()
    if queue:
        logger.warning(
            "the trainer restarted from a checkpoint holding %d groups: %d served groups of job %s "
            "are queued to be delivered again",
            len(set(skip)),
            len(queue),
            job_state.job_id,
        )
    return {
        "redelivery": {
            "queued": len(queue),
            "cancelled": cancelled,
            "skip_instance_ids": len(skip),
            "groups": queue,  # named, so the trainer can log what it will be given again
        }
    }
