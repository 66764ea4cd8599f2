"""Replaying a request_id: the ids that may be bound to a batch, and rebuilding a batch.

Owns: which request_ids of the active job may be bound (so an empty poll with a fresh id needs no
database), the replay window (on the monotonic clock for batches this process recorded), and the
rebuilding of a recorded batch from the immutable rows with its seed: one shared copy per batch
however many retries ask at once, at most MAX_REPLAYS batches held, 429 beyond. It runs outside
the serve lock and decides nothing.

It must not take the serve lock, and it decides nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from rollout_buffer.core.config import Config
from rollout_buffer.core.errors import (
    Expired,
    OperationFailed,
    Overloaded,
    StorageError,
    Unavailable,
)
from rollout_buffer.core.items import (
    Body,
    GroupItems,
    Malformed,
    build_group,
    item_flags,
    response_chunks,
)
from rollout_buffer.core.model import Batch
from rollout_buffer.runtime.jobs import JobState
from rollout_buffer.storage.launcher_tables import fetch_rows, recorded_salvage, take_from_rows
from rollout_buffer.storage.store import Pair, steady_wall

logger = logging.getLogger(__name__)

MAX_REPLAYS = 2  # distinct batches rebuilt and held at once (each up to the response budget)
REPLAY_WAIT_S = 30.0
MAX_KNOWN_IDS = 10000


class RequestIds:
    """The request_ids of the active job that may be bound to a recorded batch.

    Lets an empty poll with a fresh request_id (BufferClient always sends one) answer from memory:
    only an id in this set, or any id before the set is loaded for the job, needs the store.
    Loaded once per job from the batches inside the replay window, then kept in step by serving.
    """

    def __init__(self, config: Config) -> None:
        self.config = config
        self._job: str | None = None
        # request_id -> when this process recorded its batch (monotonic), None if loaded from the
        # store
        self._ids: dict[str, float | None] = {}
        # request_ids bound to batches of the buffer's other jobs, within the window: a trainer
        # resuming one after a job switch is told so, never answered with this job's groups
        self._elsewhere: set[str] = set()

    def loaded(self, job_id: str) -> bool:
        return self._job == job_id

    def forget(self) -> None:
        """Another instance may have bound ids since: load them again when next needed."""
        self._job, self._ids, self._elsewhere = None, {}, set()

    def may_be_bound(self, job_id: str, request_id: str) -> bool:
        """Whether the store must be asked: the id may be bound here, or to another job."""
        return self._job != job_id or request_id in self._ids or request_id in self._elsewhere

    def elsewhere(self, request_id: str) -> bool:
        """The id was bound to a batch of another of the buffer's jobs (ask the store which)."""
        return request_id in self._elsewhere

    def load(self, store: Any, job_id: str) -> None:
        """(Serve lock held.) Load the recent request_ids of the job and of the buffer's other
        jobs, once per job."""
        if self._job != job_id:
            since = steady_wall() - self.config.replay_retention_s
            self._ids = dict.fromkeys(store.recent_request_ids(job_id, since))
            self._elsewhere = set(store.recent_request_ids_elsewhere(job_id, since))
            self._job = job_id

    def add(self, job_id: str, request_id: str) -> None:
        if self._job == job_id:
            self._ids[request_id] = time.monotonic()
            if len(self._ids) > 4 * MAX_KNOWN_IDS:  # ids past the replay window are forgotten
                horizon = time.monotonic() - self.config.replay_retention_s
                self._ids = {k: v for k, v in self._ids.items() if v is None or v >= horizon}

    def age(self, request_id: str, recorded_at: float) -> float:
        """Seconds since the batch was recorded: on the monotonic clock when this process recorded
        it (a wall-clock step cannot shift the replay window), else by the stored wall time (never
        aged by a forward step while this process runs)."""
        mono = self._ids.get(request_id)
        return time.monotonic() - mono if mono is not None else steady_wall() - recorded_at


class _Replay:
    """One batch being replayed: built once, shared by every concurrent retry of its request_id."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.chunks: list[Any] = []
        self.error: BaseException | None = None
        self.refs = 0


class Replayer:
    """Rebuilds recorded batches for retried request_ids, bounded in memory and in number."""

    def __init__(self, config: Config, rids: RequestIds) -> None:
        self.config = config
        self._rids = rids
        self._replay_lock = threading.Lock()
        self._replaying: dict[
            str, _Replay
        ] = {}  # batch_id -> its rebuilt body while it is being sent

    def replay(
        self,
        pair: Pair,
        job_state: JobState,
        batch: Batch,
        recorded_at: float,
        live: dict[str, Any] | None = None,
    ) -> Body:
        """The body of a recorded batch again (same items, same uids), or 410/429/503."""
        age = self._rids.age(batch.request_id or "", recorded_at)
        if age > self.config.replay_retention_s:
            raise Expired(
                f"request_id {batch.request_id!r} was answered {age:.0f} s ago, beyond the "
                f"replay window of {self.config.replay_retention_s:.0f} s; its batch cannot be "
                "sent again. Use a fresh request_id for new data.",
                batch_id=batch.batch_id,
            )
        with self._replay_lock:
            existing = self._replaying.get(batch.batch_id)
            builder = existing is None
            if existing is None:
                if len(self._replaying) >= MAX_REPLAYS:
                    raise Overloaded(
                        f"{MAX_REPLAYS} batches are being replayed already; retry this "
                        "request_id shortly",
                        retry_after=2,
                    )
                existing = self._replaying[batch.batch_id] = _Replay()
            r = existing
            r.refs += 1
        if builder:
            try:
                r.chunks = self._rebuild(pair, job_state, batch, live)
            except BaseException as exc:
                r.error = exc
            r.done.set()
        elif not r.done.wait(REPLAY_WAIT_S):
            self._unref(batch.batch_id, r)
            raise Unavailable(
                "the batch of this request_id is still being rebuilt; retry", retry_after=2
            )
        if r.error is not None:
            self._unref(batch.batch_id, r)
            if isinstance(r.error, StorageError):
                raise Unavailable(
                    f"the database is unreachable: {r.error}", retry_after=3
                ) from r.error
            raise r.error
        logger.info("replayed batch %s for request_id %s", batch.batch_id, batch.request_id)
        # one rebuilt copy per batch, shared by concurrent retries and held until the last is sent
        return Body(
            r.chunks,
            len(batch.group_ids),
            on_close=lambda: self._unref(batch.batch_id, r),
            replayed=True,
        )

    def _unref(self, batch_id: str, r: _Replay) -> None:
        with self._replay_lock:
            r.refs -= 1
            if r.refs == 0 and self._replaying.get(batch_id) is r:
                del self._replaying[batch_id]

    def _rebuild(
        self, pair: Pair, job_state: JobState, batch: Batch, live: dict[str, Any] | None
    ) -> list[Any]:
        """The body of a recorded batch, from the immutable rows with the batch's seed (same
        uids)."""
        groups: list[GroupItems] = []
        buf = bytearray()
        meta = batch.meta or {}
        partial = set(meta.get("partial_groups") or ())
        again = set(meta.get("redelivered") or ())
        for gid in batch.group_ids:
            pks = pair.store.group_pks(job_state.job_id, gid)
            rows = fetch_rows(pair.source, pks)
            salvaged = recorded_salvage(pair.store, job_state.job_id, gid)
            if len(rows) < len(pks):  # pruned from session_steps: never a group short of a row
                raise Expired(
                    f"the batch of request_id {batch.request_id!r} cannot be sent again whole: "
                    f"{len(pks) - len(rows)} of the {len(pks)} rows of one of its groups are no "
                    "longer in session_steps (was the launcher's table pruned?). Use a fresh "
                    "request_id for new data.",
                    batch_id=batch.batch_id,
                )
            try:
                groups.append(
                    build_group(
                        take_from_rows(gid, pks, rows, salvaged),
                        rows,
                        batch.seed,
                        job_state.job_id,
                        buf,
                        item_flags(gid in partial, gid in again),
                    )
                )
            except Malformed as exc:  # pragma: no cover - rows are immutable
                raise OperationFailed(f"batch {batch.batch_id} cannot be rebuilt: {exc}") from exc
        # the figures, filtered and partial groups are sent as recorded (the rows cannot give them
        # again)
        return response_chunks(
            groups,
            buf,
            {
                "job_session": job_state.job_id,
                **(live or {}),  # what is said of the job now (its launcher), as in any answer
                "batch_id": batch.batch_id,
                "request_id": batch.request_id,
                "replayed": True,
                "groups": len(groups),
                **meta,
            },
        )
