"""Serving a poll: plan, record, apply, send; replay a request_id; reconcile an uncertain COMMIT.

Owns: ``POST /get_rollout_data`` from the draft to the bytes of the answer. A poll claims the draft
built before it (prebuilt.py) or builds one (draft.py: groups taken a few at a time, so it costs
what it serves, never the size of the backlog), and makes ONE plan of it (:func:`plan_poll`: served
groups, redelivered ones, malformed drops and their rejected rows, the batch). The store records the
plan in one transaction before the first byte is sent; then the same plan is applied to the
accumulator and handed to the outbox. What a poll cannot finish by itself is settled from the
store: a COMMIT whose outcome is unknown (:func:`committed`), and groups another instance decided
meanwhile (:func:`settle_conflict`). A replay rebuilds a recorded batch from the immutable rows with
the same seed, outside the serve lock and bounded in number. It must not ingest or decide anything
else."""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol

from rollout_buffer.core.config import Config
from rollout_buffer.core.errors import (
    Conflict,
    IntegrityError,
    LeaseLost,
    StorageError,
    Unavailable,
)
from rollout_buffer.core.history import History, PollStats
from rollout_buffer.core.items import NO_JOB, Body, GroupItems, empty_body, response_chunks
from rollout_buffer.core.logconfig import EventLog
from rollout_buffer.core.model import (
    REJECTED,
    Batch,
    Decisions,
    Drop,
    PollRequest,
    RowEvent,
    Served,
    Take,
)
from rollout_buffer.runtime.jobs import Jobs, JobState
from rollout_buffer.runtime.locks import LOCK_WAIT_S, Locks
from rollout_buffer.runtime.loop import Health
from rollout_buffer.runtime.notifications import Outbox
from rollout_buffer.runtime.signals import Signals
from rollout_buffer.serving import redelivery
from rollout_buffer.serving.draft import Draft, Shape
from rollout_buffer.serving.prebuilt import Prebuilder
from rollout_buffer.serving.replay import Replayer, RequestIds
from rollout_buffer.storage.db import Database
from rollout_buffer.storage.store import LazyPair, Pair

logger = logging.getLogger(__name__)

MAX_BUILD_FAILURES = (
    3  # a group whose build fails unexpectedly this often is dropped (build_failed)
)


class Guard(Protocol):
    """Whether this instance may serve (the lease): ``check`` raises LeaseLost on a standby, and
    ``fence`` is the first statement of a transaction that records a decision."""

    def check(self, wait_s: float, sure: bool = True) -> None: ...

    def fence(self, db: Database) -> None: ...


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


@dataclasses.dataclass(frozen=True)
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


class Serving:
    """Answers polls for the active job."""

    def __init__(
        self,
        config: Config,
        *,
        jobs: Jobs,
        outbox: Outbox,
        signals: Signals,
        health: Health,
        locks: Locks,
        guard: Guard | None = None,
        history: History | None = None,
        launcher_status: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.config = config
        self.history = history or History()  # the status page's last batches and serve rate
        self.jobs = jobs
        self.outbox = outbox
        self.signals = signals
        self.health = health
        self.locks = locks
        self.guard = guard  # None: no lease, this instance always serves
        # the launcher in a word (Launcher.status) in every answer's meta_info: a trainer polling a
        # job whose launcher has exited is told so, not only /stats
        self.launcher_status = launcher_status
        self.stats = PollStats()
        self._uncertain: Uncertain | None = None
        self._rids = RequestIds(config)
        self._failures: dict[tuple[str, str], int] = {}
        self.replayer = Replayer(config, self._rids)
        self.prebuilt = Prebuilder(
            config,
            jobs=jobs,
            signals=signals,
            locks=locks,
            fence=guard.fence if guard is not None else None,
            failed=self._failed,
            release=self._release,
            ready=self._may_prebuild,
        )

    def _may_prebuild(self) -> bool:
        """This instance owns the job, has loaded it, its database answers, and no COMMIT is
        uncertain (the next poll settles it first: its groups must not be built into a draft
        meanwhile)."""
        if (
            not self.signals.bootstrapped.is_set()
            or self.health.problem()
            or self._uncertain is not None
        ):
            return False
        try:
            self._check_guard()
        except Exception:
            return False
        return True

    def _check_guard(self) -> None:
        """Raise LeaseLost when this instance may not serve (a standby)."""
        if self.guard is not None:
            self.guard.check(2.0)

    def get_rollout_data(self, conns: LazyPair, poll: PollRequest) -> Body:
        """Serve ready groups (or replay the batch bound to request_id); the caller sends the body
        and then calls its close(). With ``wait_s`` > 0, first wait (holding no lock) until
        ``min_groups`` groups are ready, or ``wait_s`` has passed, or the service stops."""
        started = time.perf_counter()
        body = None
        try:
            job_state = self.jobs.current
            if job_state is not None and poll.current_weight_version is not None:
                job_state.accumulator.set_versions(
                    trainer=poll.current_weight_version
                )  # saved by the loop with the cursor
            if poll.wait_s > 0:
                self._long_poll(
                    conns,
                    poll.wait_s,
                    min(poll.min_groups or 1, poll.max_groups or poll.min_groups or 1),
                    poll.request_id,
                )
            body = self._poll(conns, poll)
            return body
        finally:
            self.stats.observe(
                time.perf_counter() - started,
                bool(body is not None and body.groups),
                bool(body is not None and body.replayed),
            )

    def _long_poll(
        self, conns: LazyPair, wait_s: float, min_groups: int, request_id: str | None
    ) -> None:
        """Wait for ready groups; at most MAX_WAITING_POLLS wait at once (the others answer now)."""
        if not self.signals.bootstrapped.is_set():
            return  # _poll answers 503 while loading
        job_state = self.jobs.current
        if job_state is None or self.available(job_state) >= min_groups:
            return
        if request_id is not None:
            if not self._rids.loaded(job_state.job_id):
                with self.locks.try_serving(LOCK_WAIT_S) as taken:
                    try:
                        if taken:
                            self._rids.load(conns.get().store, job_state.job_id)
                    except StorageError:
                        return  # _poll answers 503
            if self._rids.may_be_bound(job_state.job_id, request_id):
                return  # possibly a retry of an answered poll: its replay is due at once
        if not self.stats.start_waiting(self.config.max_waiting_polls):
            return
        try:
            self.signals.ready.wait(
                lambda: (
                    self.jobs.current is not job_state or self.available(job_state) >= min_groups
                ),
                wait_s,
            )
        finally:
            self.stats.stop_waiting()

    def available(self, job_state: JobState) -> int:
        """Groups a poll would be given now: queued redeliveries, ready groups and the prebuilt
        draft's."""
        return job_state.ready_count() + self.prebuilt.groups(job_state)

    def forget(self) -> None:
        """This instance lost the job: what it remembered of its polls may be stale once it owns it
        again."""
        self._uncertain = None
        self.prebuilt.forget()  # its groups go with the job's state
        self._failures.clear()
        self._rids.forget()

    def _poll(self, conns: LazyPair, poll: PollRequest) -> Body:
        self._check_guard()
        if not self.signals.bootstrapped.is_set():
            # Until the active job is resumed from the database, "no data" would be a lie: a trainer
            # would drop its request_id and the batch bound to it (already marked served) would be
            # lost.
            self.signals.nudge()
            if not self.signals.bootstrapped.wait(2.0):
                raise Unavailable(
                    "the service is still loading its state from the database: "
                    f"{self.health.last_error or 'starting'}",
                    retry_after=1,
                )
        job_state = self.jobs.current
        if job_state is None:
            return empty_body({}, NO_JOB)
        request_id = poll.request_id
        problem = self.health.problem()
        if problem:
            raise Unavailable(f"the database is unreachable: {problem}", retry_after=3)
        # (with an id: a poll in flight may be binding this very id, so it is waited for)
        if not self.available(job_state) and (
            request_id is None
            or (
                not job_state.in_flight()
                and not self._rids.may_be_bound(job_state.job_id, request_id)
            )
        ):
            # nothing to serve and nothing to replay: answered from memory, no database touched
            self.signals.nudge()
            return empty_body(self._meta(job_state))
        with self.locks.serving(holder="another poll"):
            job_state, body, replay = self._under_serve_lock(conns, poll)
        if body is not None:
            return body
        batch, recorded_at = replay
        return self.replayer.replay(
            conns.get(), job_state, batch, recorded_at, live=self._meta(job_state)
        )

    def _under_serve_lock(self, conns: LazyPair, poll: PollRequest) -> tuple[JobState, Any, Any]:
        """(Serve lock held.) Settle an uncertain COMMIT, then serve (the body), or find the batch
        bound to the request_id (replayed by the caller, outside the lock)."""
        request_id = poll.request_id
        try:
            job_state = self.jobs.current
            assert job_state is not None
            pair = conns.get()
            if self._uncertain is not None:
                self._reconcile(pair, job_state)
            replay = None
            if request_id is not None:
                self._rids.load(pair.store, job_state.job_id)
                replay = pair.store.batch_for_request(job_state.job_id, request_id)
                if replay is None and self._rids.elsewhere(request_id):
                    self._refuse_elsewhere(pair, job_state, request_id)
            if replay is None:
                return job_state, self._serve(pair, job_state, poll), None
            return job_state, None, replay
        except LeaseLost:
            raise  # answered as a standby answers (307 to the owner)
        except IntegrityError as exc:
            logger.error("serving hit a conflicting decision: %s", exc)
            raise Unavailable(
                "another instance decided some of these groups meanwhile; they were "
                "settled from its record. Retry.",
                retry_after=1,
            ) from exc
        except StorageError as exc:
            logger.error("serving failed: %s", exc)
            raise Unavailable(f"the database is unreachable: {exc}", retry_after=3) from exc

    @staticmethod
    def _refuse_elsewhere(pair: Pair, job_state: JobState, request_id: str) -> None:
        """A request_id bound to a batch of another job of this buffer (a trainer resuming it after
        a job switch): a Conflict naming that job. Its batch is never sent for this job, and this
        job's groups are never bound to the id."""
        other = pair.store.batch_elsewhere(job_state.job_id, request_id)
        if other is not None:
            raise Conflict(
                f"request_id {request_id!r} was answered with batch {other[1]} of job "
                f"{other[0]!r}, not of the active job {job_state.job_id!r}: a batch is never "
                "sent for another job. Use a fresh request_id for this job's data.",
                job_session=job_state.job_id,
                batch_job=other[0],
            )

    def _meta(self, job_state: JobState) -> dict[str, Any]:
        """What every answer's meta_info says of the job: its id, its launcher's state."""
        meta: dict[str, Any] = {"job_session": job_state.job_id}
        if self.launcher_status is not None:
            meta["launcher"] = self.launcher_status()
        return meta

    # -- serve -------------------------------------------------------------------------------------
    def _serve(self, pair: Pair, job_state: JobState, poll: PollRequest) -> Body:
        started = time.perf_counter()
        policy, shape, request_id = (
            self.config.policy,
            Shape(poll.max_groups, poll.max_off_policy),
            poll.request_id,
        )
        d, back = self.prebuilt.claim(
            job_state, shape, policy
        )  # built before the poll, if it still fits
        self._release(pair, job_state, back)
        d = d or Draft(job_state.job_id, shape, self.config.max_response_bytes)
        try:
            d.build(
                pair,
                job_state,
                policy,
                self.config.max_group_bytes,
                lambda t, e: self._failed(job_state, t, e),
            )
            d.fit_request_id(request_id)
            d.stamp(job_state.accumulator.clock())
        except BaseException:
            redelivery.release(job_state, d.taken)
            raise
        leftover = d.give_back()
        self._release(pair, job_state, leftover)
        built = d.built
        plan = plan_poll(
            job_state, d.seed, request_id, built, d.refused, d.stats, self.outbox.events
        )
        chunks: list[Any] = []
        if built:
            assert plan.batch is not None and plan.batch.meta is not None
            chunks = response_chunks(
                [g for _, g in built],
                d.buf,
                {
                    **self._meta(job_state),
                    "batch_id": plan.batch.batch_id,
                    "request_id": request_id,
                    "replayed": False,
                    "groups": len(built),
                    **plan.batch.meta,
                },
            )
            plan.batch = dataclasses.replace(plan.batch, n_bytes=sum(map(len, chunks)))
        self._record(pair, job_state, plan, d.done)
        if leftover:
            self.signals.nudge()
        if not built:
            return empty_body(self._meta(job_state))
        logger.debug(
            "served %d groups (%d bytes) of job %s; %d left ready",
            len(built),
            len(d.buf),
            job_state.job_id,
            len(leftover),
        )
        assert plan.batch is not None
        entry = self.history.batch(
            plan.batch.batch_id,
            groups=len(built),
            items=plan.batch.n_items,
            n_bytes=plan.batch.n_bytes,
            build_s=time.perf_counter() - started,
        )
        return Body(
            chunks,
            len(built),
            on_close=lambda: self.history.sent(entry),
        )

    def _failed(self, job_state: JobState, t: Take, exc: Exception) -> bool:
        """Count an unexpected build failure of a group; True once it has failed MAX_BUILD_FAILURES
        times."""
        key = (job_state.job_id, t.group_id)
        n = self._failures[key] = self._failures.get(key, 0) + 1
        logger.error(
            "building group %s of job %s failed (%d of %d tries): %s: %s",
            t.group_id,
            job_state.job_id,
            n,
            MAX_BUILD_FAILURES,
            type(exc).__name__,
            exc,
            exc_info=n == 1,
        )
        if n >= MAX_BUILD_FAILURES:
            del self._failures[key]
            return True
        return False

    def _record(self, pair: Pair, job_state: JobState, plan: Decisions, done: list[Take]) -> None:
        """Record the plan, then apply it to memory and hand it to the outbox."""
        if not done:
            return
        if plan.batch is not None and plan.batch.request_id is not None:
            self._rids.add(
                job_state.job_id, plan.batch.request_id
            )  # before the COMMIT: a retry must look
        try:
            pair.store.record(job_state.job_id, plan)
        except IntegrityError:
            self._settle_conflict(pair, job_state, done)
            raise
        except BaseException:
            # the COMMIT may have happened: the next poll checks before serving anything
            self._uncertain = Uncertain(job_state.job_id, plan, done)
            redelivery.release(job_state, done)
            raise
        self._apply(pair, job_state, plan)

    def _apply(self, pair: Pair, job_state: JobState, plan: Decisions) -> None:
        late = job_state.accumulator.commit(plan)
        job_state.redeliveries.settled(plan)
        self.outbox.act_quietly(
            pair.store, job_state.job_id, late
        )  # rows that arrived while the groups were built
        self.outbox.notify(job_state.job_id, plan)

    def _release(self, pair: Pair, job_state: JobState, takes: list[Take]) -> None:
        """Give taken groups back to the ready queue (and record any that had to be dropped
        instead)."""
        if takes:
            self.outbox.act_quietly(
                pair.store, job_state.job_id, redelivery.release(job_state, takes)
            )

    def _settle_conflict(self, pair: Pair, job_state: JobState, takes: list[Take]) -> None:
        """Another instance decided some of these groups: take its word for them."""
        settle_conflict(pair, job_state, takes, self.outbox)

    def settle(self, pair: Pair, job_state: JobState | None) -> None:
        """(Serve lock held.) Before a decision outside a poll (another job or K, a redelivery):
        settle a poll whose COMMIT's outcome is unknown, and give the prebuilt draft's groups
        back."""
        if self._uncertain is not None and job_state is not None:
            self._reconcile(pair, job_state)
        d = self.prebuilt.discard()
        if d is not None and job_state is not None and d.job_id == job_state.job_id:
            self._release(pair, job_state, d.taken)

    def _reconcile(self, pair: Pair, job_state: JobState) -> None:
        """After a serving COMMIT whose outcome is unknown: if it did happen, settle its groups now
        (a client that retries its request_id gets that batch replayed); never serve them again."""
        u, self._uncertain = self._uncertain, None
        assert u is not None
        if u.job_id == job_state.job_id and committed(pair, job_state, u):
            logger.warning(
                "a serving commit of job %s reported an error but happened (%d groups); settling "
                "its groups",
                job_state.job_id,
                len(u.plan.served) + len(u.plan.drops),
            )
            redelivery.retake(job_state, u.takes)
            self._apply(pair, job_state, u.plan)

    # -- replay --------------------------------------------------------------------------------
