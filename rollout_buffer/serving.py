"""Serving a poll: plan, record, apply, send; replay a request_id; reconcile an uncertain COMMIT.

Owns: ``POST /get_rollout_data`` from the taking of ready groups to the bytes of the answer. A
poll takes ready groups a few at a time (so it costs what it serves, never the size of the
backlog), builds them into one buffer within the byte budget, and makes ONE plan of it (served
groups, malformed drops and their rejected rows, the batch). The store records the plan in one
transaction before the first byte is sent; then the same plan is applied to the accumulator and
handed to the outbox. A replay rebuilds a recorded batch from the immutable rows with the same
seed, outside the serve lock and bounded in number. It must not ingest or decide anything else.
"""
from __future__ import annotations

import collections
import json
import logging
import secrets
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from . import queries as q
from .config import Config
from .connections import LazyPair, Pair
from .db import Database
from .errors import ApiError, IntegrityError, StorageError
from .history import History
from .items import COMPLETED, MESSAGES, RESPONSE, SID, GroupItems, Malformed, build_group, response_chunks
from .jobs import JobState, Jobs
from .loop import Health, Loop
from .model import GROUP_TOO_LARGE, MALFORMED, REJECTED, Batch, Decisions, Drop, RowEvent, Served, Take
from .notifications import Outbox

logger = logging.getLogger(__name__)

FETCH_CHUNK = 900  # pks per body query (SQLite's default variable limit is far above)
TAKE_STEP = 64  # groups taken from the ready queue at a time
POLL_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0)
SERVE_LOCK_WAIT_S = 8.0  # a poll behind a stuck one answers 503 rather than hang
MAX_REPLAYS = 2  # distinct batches rebuilt and held at once (each up to the response budget)
REPLAY_WAIT_S = 30.0
MAX_KNOWN_IDS = 10000


class PollStats:
    """Poll counts and a latency histogram, for /stats and /metrics."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0
        self.with_data = 0
        self.seconds = 0.0
        self.buckets: collections.Counter = collections.Counter()

    def observe(self, seconds: float, with_data: bool) -> None:
        with self._lock:
            self.count += 1
            self.with_data += with_data
            self.seconds += seconds
            self.buckets[next((b for b in POLL_BUCKETS if seconds <= b), float("inf"))] += 1

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"count": self.count, "with_data": self.with_data, "seconds_total": round(self.seconds, 6),
                    "buckets": {b: self.buckets.get(b, 0) for b in (*POLL_BUCKETS, float("inf"))}}


@dataclass(frozen=True)
class Uncertain:
    """A serving plan whose COMMIT reported an error: it may or may not have been recorded."""

    job_id: str
    plan: Decisions
    takes: list[Take]


class RequestIds:
    """The request_ids of the active job that may be bound to a recorded batch.

    Lets an empty poll with a fresh request_id (BufferClient always sends one) answer from memory:
    only an id in this set, or any id before the set is loaded for the job, needs the store.
    Loaded once per job from the batches inside the replay window, then kept in step by serving.
    """

    def __init__(self, config: Config) -> None:
        self.config = config
        self._job: str | None = None
        # request_id -> when this process recorded its batch (monotonic), None if loaded from the store
        self._ids: dict[str, float | None] = {}

    def may_be_bound(self, job_id: str, request_id: str) -> bool:
        return self._job != job_id or request_id in self._ids

    def load(self, store: Any, job_id: str) -> None:
        """(Serve lock held.) Load the job's recent request_ids, once per job."""
        if self._job != job_id:
            since = time.time() - self.config.replay_retention_s
            self._ids = dict.fromkeys(store.recent_request_ids(job_id, since))
            self._job = job_id

    def add(self, job_id: str, request_id: str) -> None:
        if self._job == job_id:
            self._ids[request_id] = time.monotonic()
            if len(self._ids) > 4 * MAX_KNOWN_IDS:  # ids past the replay window are forgotten
                horizon = time.monotonic() - self.config.replay_retention_s
                self._ids = {k: v for k, v in self._ids.items() if v is None or v >= horizon}

    def age(self, request_id: str, recorded_at: float) -> float:
        """Seconds since the batch was recorded: on the monotonic clock when this process recorded
        it (a wall-clock step cannot shift the replay window), else by the stored wall time."""
        mono = self._ids.get(request_id)
        return time.monotonic() - mono if mono is not None else time.time() - recorded_at


class _Replay:
    """One batch being replayed: built once, shared by every concurrent retry of its request_id."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.chunks: list[Any] = []
        self.error: BaseException | None = None
        self.refs = 0


class Body(list):
    """The chunks of a /get_rollout_data body (sent one after the other, never joined), how many
    groups it carries, and what to run once it has been sent (or abandoned)."""

    def __init__(self, chunks: list[Any], groups: int = 0, on_close: Callable[[], None] | None = None) -> None:
        super().__init__(chunks)
        self.groups = groups
        self._on_close = on_close

    def close(self) -> None:
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()


def empty_body(meta_extra: dict[str, Any]) -> Body:
    return Body(response_chunks([], bytearray(), meta_extra))


def json_len(value: str) -> int:
    """Bytes of a string as meta_info encodes it (ASCII-escaped JSON), not its length in characters."""
    return len(json.dumps(value))


def fetch_rows(src: Database, pks: list[int]) -> dict[int, tuple]:
    """The body columns (queries.BODY_COLUMNS) of the given rows, by pk."""
    out: dict[int, tuple] = {}
    for i in range(0, len(pks), FETCH_CHUNK):
        chunk = pks[i:i + FETCH_CHUNK]
        for r in src.rows(q.fetch_bodies(len(chunk), src.backend), q.fetch_bodies_params(chunk, src.backend),
                          binary=True):
            out[r[0]] = r
    return out


def fetch_takes(src: Database, takes: list[Take], cap: int) -> tuple[dict[int, tuple], set[str]]:
    """The body rows of the served sessions of ``takes``, and the groups whose rows alone exceed
    ``cap`` bytes (stopped as soon as they do, so one huge group never holds more than the cap)."""
    owner = {pk: t.group_id for t in takes for pk in t.served_pks}
    pks = list(owner)
    sizes: dict[str, int] = {}
    too_large: set[str] = set()
    out: dict[int, tuple] = {}
    for i in range(0, len(pks), FETCH_CHUNK):
        chunk = [pk for pk in pks[i:i + FETCH_CHUNK] if owner[pk] not in too_large]
        if not chunk:
            continue
        for r in src.rows(q.fetch_bodies(len(chunk), src.backend), q.fetch_bodies_params(chunk, src.backend),
                          binary=True):
            gid = owner[r[0]]
            size = sizes[gid] = sizes.get(gid, 0) + len(r[MESSAGES] or b"") + len(r[RESPONSE] or "")
            if size > cap:
                too_large.add(gid)
            out[r[0]] = r
        if too_large:
            for pk in [pk for pk in out if owner[pk] in too_large]:
                del out[pk]
    return out, too_large


def take_from_rows(group_id: str, pks: list[int], rows: dict[int, tuple]) -> Take:
    """Rebuild a served group's Take from its recorded pks: sessions with a completed row are complete."""
    done = {r[SID] for r in rows.values() if r[COMPLETED]}
    completed: dict[str, list[int]] = {}
    incomplete: dict[str, list[int]] = {}
    for pk in pks:
        r = rows.get(pk)
        if r is not None:
            (completed if r[SID] in done else incomplete).setdefault(r[SID], []).append(pk)
    return Take(group_id, {s: tuple(p) for s, p in completed.items()}, {s: tuple(p) for s, p in incomplete.items()})


class Serving:
    """Answers polls for the active job."""

    def __init__(self, config: Config, *, jobs: Jobs, outbox: Outbox, loop: Loop, health: Health,
                 serve_lock: threading.Lock, history: History | None = None) -> None:
        self.config = config
        self.history = history or History()  # the status page's last batches and serve rate
        self.jobs = jobs
        self.outbox = outbox
        self.loop = loop
        self.health = health
        self.serve_lock = serve_lock
        self.stats = PollStats()
        self._uncertain: Uncertain | None = None
        self._rids = RequestIds(config)
        self._replay_lock = threading.Lock()
        self._replaying: dict[str, _Replay] = {}  # batch_id -> its rebuilt body while it is being sent

    def get_rollout_data(self, conns: LazyPair, *, max_groups: int | None, request_id: str | None) -> Body:
        """Serve ready groups (or replay the batch bound to request_id); the caller sends the body
        and then calls its close()."""
        started = time.perf_counter()
        body = None
        try:
            body = self._poll(conns, max_groups, request_id)
            return body
        finally:
            self.stats.observe(time.perf_counter() - started, bool(body is not None and body.groups))

    def _poll(self, conns: LazyPair, max_groups: int | None, request_id: str | None) -> Body:
        if not self.loop.bootstrapped.is_set():
            # Until the active job is resumed from the database, "no data" would be a lie: a trainer
            # would drop its request_id and the batch bound to it (already marked served) would be lost.
            self.loop.nudge()
            if not self.loop.bootstrapped.wait(2.0):
                raise ApiError(503, "the service is still loading its state from the database: "
                               f"{self.health.last_error or 'starting'}", retry_after=1)
        js = self.jobs.current
        if js is None:
            return empty_body({})
        problem = self.health.problem()
        if problem:
            raise ApiError(503, f"the database is unreachable: {problem}", retry_after=3)
        # (with an id: a poll in flight may be binding this very id, so it is waited for)
        if not js.acc.ready and (request_id is None or not js.acc.taken
                                 and not self._rids.may_be_bound(js.job_id, request_id)):
            # nothing to serve and nothing to replay: answered from memory, no database touched
            self.loop.nudge()
            return empty_body({"job_session": js.job_id})
        if not self.serve_lock.acquire(timeout=SERVE_LOCK_WAIT_S):
            raise ApiError(503, "another poll has been holding the serving lock for over "
                           f"{SERVE_LOCK_WAIT_S:.0f} s (the database may be stuck); retry", retry_after=2)
        replay = None
        try:
            js = self.jobs.current
            assert js is not None
            pair = conns.get()
            if self._uncertain is not None:
                self._reconcile(pair, js)
            if request_id is not None:
                self._rids.load(pair.store, js.job_id)
                replay = pair.store.batch_for_request(js.job_id, request_id)
            if replay is None:
                return self._serve(pair, js, max_groups, request_id)
        except IntegrityError as exc:
            logger.error("serving hit a conflicting decision: %s", exc)
            raise ApiError(503, "another instance decided some of these groups meanwhile; they were "
                           "settled from its record. Retry.", retry_after=1) from exc
        except StorageError as exc:
            logger.error("serving failed: %s", exc)
            raise ApiError(503, f"the database is unreachable: {exc}", retry_after=3) from exc
        finally:
            self.serve_lock.release()
        return self._replay(conns.get(), js, *replay)

    # -- serve -------------------------------------------------------------------------------------
    def _serve(self, pair: Pair, js: JobState, max_groups: int | None, request_id: str | None) -> Body:
        started = time.perf_counter()
        seed = secrets.token_bytes(16)
        budget = self.config.max_response_bytes
        buf = bytearray()
        built: list[tuple[Take, GroupItems]] = []
        malformed: list[tuple[Take, dict[int, str]]] = []
        meta_size = 1024 + 2 * json_len(request_id or "")
        leftover: list[Take] = []
        taken: list[Take] = []
        try:
            full = False
            while not full and (max_groups is None or len(built) < max_groups):
                want = TAKE_STEP if max_groups is None else min(TAKE_STEP, max_groups - len(built))
                takes = js.acc.take_ready(want)
                if not takes:
                    break
                taken.extend(takes)
                rows, too_large = fetch_takes(pair.src, takes, self.config.max_group_bytes)
                for i, t in enumerate(takes):
                    if t.group_id in too_large:
                        malformed.append((t, {}))
                        continue
                    try:
                        g = build_group(t, rows, seed, js.job_id, buf)
                    except Malformed as exc:
                        malformed.append((t, exc.bad))
                        continue
                    # the body is buf plus a head and a meta_info tail that lists the group ids
                    meta_size += json_len(t.group_id) + 1
                    if built and len(buf) + meta_size > budget:
                        del buf[g.start:]  # does not fit: it stays ready for the next poll
                        leftover = takes[i:]
                        full = True
                        break
                    built.append((t, g))
        except BaseException:
            js.acc.release(taken)
            raise
        self._release(pair, js, leftover)
        plan = self._plan(js.job_id, seed, request_id, built, malformed)
        chunks: list[Any] = []
        if built:
            assert plan.batch is not None
            chunks = response_chunks([g for _, g in built], buf, {
                "job_session": js.job_id, "batch_id": plan.batch.batch_id, "request_id": request_id,
                "replayed": False, "groups": len(built)})
            plan = Decisions(drops=plan.drops, rows=plan.rows, served=plan.served,
                             batch=Batch(**{**plan.batch.__dict__, "n_bytes": sum(map(len, chunks))}))
        self._record(pair, js, plan, [t for t, _ in built] + [t for t, _ in malformed])
        if leftover:
            self.loop.nudge()
        if not built:
            return empty_body({"job_session": js.job_id})
        logger.debug("served %d groups (%d bytes) of job %s; %d left ready", len(built), len(buf), js.job_id,
                     len(leftover))
        assert plan.batch is not None
        entry = self.history.batch(plan.batch.batch_id, groups=len(built), items=plan.batch.n_items,
                                   n_bytes=plan.batch.n_bytes, build_s=time.perf_counter() - started)
        return Body(chunks, len(built), on_close=lambda: self.history.sent(entry))

    @staticmethod
    def _plan(job_id: str, seed: bytes, request_id: str | None, built: list[tuple[Take, GroupItems]],
              malformed: list[tuple[Take, dict[int, str]]]) -> Decisions:
        """The one decision of a poll: its batch, served groups, malformed groups and their bad rows."""
        plan = Decisions()
        if built:
            batch_id = uuid.uuid4().hex
            plan.batch = Batch(batch_id, job_id, request_id, seed, [t.group_id for t, _ in built],
                               sum(g.n_items for _, g in built), 0)
            plan.served = [Served(t, batch_id) for t, _ in built]
        for t, bad in malformed:
            reason = MALFORMED if bad else GROUP_TOO_LARGE
            plan.drops.append(Drop(t.group_id, reason, [pk for pk in t.all_pks if pk not in bad], t.sessions))
            plan.rows.extend(RowEvent(pk, REJECTED, why, t.group_id, None) for pk, why in bad.items())
            if bad:
                logger.warning("group %s of job %s dropped: malformed rows %s", t.group_id, job_id, bad)
            else:
                logger.warning("group %s of job %s dropped: its rows exceed ROLLOUT_BUFFER_MAX_GROUP_BYTES", t.group_id,
                               job_id)
        return plan

    def _record(self, pair: Pair, js: JobState, plan: Decisions, done: list[Take]) -> None:
        """Record the plan, then apply it to memory and hand it to the outbox."""
        if not done:
            return
        if plan.batch is not None and plan.batch.request_id is not None:
            self._rids.add(js.job_id, plan.batch.request_id)  # before the COMMIT: a retry must look
        try:
            pair.store.record(js.job_id, plan)
        except IntegrityError:
            self._settle_conflict(pair, js, done)
            raise
        except BaseException:
            # the COMMIT may have happened: the next poll checks before serving anything
            self._uncertain = Uncertain(js.job_id, plan, done)
            js.acc.release(done)
            raise
        self._apply(pair, js, plan)

    def _apply(self, pair: Pair, js: JobState, plan: Decisions) -> None:
        late = js.acc.commit(plan)
        self.outbox.act_quietly(pair.store, js.job_id, late)  # rows that arrived while the groups were built
        self.outbox.notify(js.job_id, plan)

    def _release(self, pair: Pair, js: JobState, takes: list[Take]) -> None:
        """Give taken groups back to the ready queue (and record any that had to be dropped instead)."""
        if takes:
            self.outbox.act_quietly(pair.store, js.job_id, js.acc.release(takes))

    def _settle_conflict(self, pair: Pair, js: JobState, takes: list[Take]) -> None:
        """A decision of another instance is already stored for some of these groups: take its word
        for them (never serve them again) and give the others back."""
        decided = {}
        for t in takes:
            d = pair.store.group_decision(js.job_id, t.group_id)
            if d is not None:
                decided[t.group_id] = d
        js.acc.release([t for t in takes if t.group_id not in decided])
        late = js.acc.settle_decided([t for t in takes if t.group_id in decided], decided)
        self.outbox.act_quietly(pair.store, js.job_id, late)
        logger.warning("%d groups of job %s were already decided by another instance; settled from its record",
                       len(decided), js.job_id)

    def _reconcile(self, pair: Pair, js: JobState) -> None:
        """After a serving COMMIT whose outcome is unknown: if it did happen, settle its groups now
        (a client that retries its request_id gets that batch replayed); never serve them again."""
        u, self._uncertain = self._uncertain, None
        assert u is not None
        if u.job_id != js.job_id:
            return
        if u.plan.batch is not None:
            committed = pair.store.batch_exists(u.plan.batch.batch_id)
        else:
            committed = pair.store.group_decision(js.job_id, u.plan.drops[0].group_id) is not None
        if committed:
            logger.warning("a serving commit of job %s reported an error but happened (%d groups); settling "
                           "its groups", js.job_id, len(u.plan.served) + len(u.plan.drops))
            js.acc.retake(u.takes)
            self._apply(pair, js, u.plan)

    # -- replay --------------------------------------------------------------------------------
    def _replay(self, pair: Pair, js: JobState, batch: Batch, recorded_at: float) -> Body:
        age = self._rids.age(batch.request_id or "", recorded_at)
        if age > self.config.replay_retention_s:
            raise ApiError(410, f"request_id {batch.request_id!r} was answered {age:.0f} s ago, beyond the "
                           f"replay window of {self.config.replay_retention_s:.0f} s; its batch cannot be sent "
                           "again. Use a fresh request_id for new data.", batch_id=batch.batch_id)
        with self._replay_lock:
            r = self._replaying.get(batch.batch_id)
            builder = r is None
            if builder:
                if len(self._replaying) >= MAX_REPLAYS:
                    raise ApiError(429, f"{MAX_REPLAYS} batches are being replayed already; retry this "
                                   "request_id shortly", retry_after=2)
                r = self._replaying[batch.batch_id] = _Replay()
            r.refs += 1
        if builder:
            try:
                r.chunks = self._rebuild(pair, js, batch)
            except BaseException as exc:
                r.error = exc
            r.done.set()
        elif not r.done.wait(REPLAY_WAIT_S):
            self._unref(batch.batch_id, r)
            raise ApiError(503, "the batch of this request_id is still being rebuilt; retry", retry_after=2)
        if r.error is not None:
            self._unref(batch.batch_id, r)
            if isinstance(r.error, StorageError):
                raise ApiError(503, f"the database is unreachable: {r.error}", retry_after=3) from r.error
            raise r.error
        logger.info("replayed batch %s for request_id %s", batch.batch_id, batch.request_id)
        # one rebuilt copy per batch, shared by concurrent retries and held until the last is sent
        return Body(r.chunks, len(batch.group_ids), on_close=lambda: self._unref(batch.batch_id, r))

    def _unref(self, batch_id: str, r: "_Replay") -> None:
        with self._replay_lock:
            r.refs -= 1
            if r.refs == 0 and self._replaying.get(batch_id) is r:
                del self._replaying[batch_id]

    def _rebuild(self, pair: Pair, js: JobState, batch: Batch) -> list[Any]:
        """The body of a recorded batch, from the immutable rows with the batch's seed (same uids)."""
        groups: list[GroupItems] = []
        buf = bytearray()
        for gid in batch.group_ids:
            pks = pair.store.group_pks(js.job_id, gid)
            rows = fetch_rows(pair.src, pks)
            try:
                groups.append(build_group(take_from_rows(gid, pks, rows), rows, batch.seed, js.job_id, buf))
            except Malformed as exc:  # pragma: no cover - rows are immutable
                raise ApiError(500, f"batch {batch.batch_id} cannot be rebuilt: {exc}") from exc
        return response_chunks(groups, buf, {"job_session": js.job_id, "batch_id": batch.batch_id,
                                             "request_id": batch.request_id, "replayed": True, "groups": len(groups)})

