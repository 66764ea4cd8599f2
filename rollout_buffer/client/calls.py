"""The buffer's endpoints as steps (see :mod:`rollout_buffer.client.transport`), written once
for both clients: each function here is a method of :class:`~rollout_buffer.client.BufferClient`
and, as a coroutine, of :class:`~rollout_buffer.client.AsyncBufferClient`.

Delivery contract (SPEC section 4): every logical ``get_rollout_data`` call carries one fresh
``request_id`` (a uuid4 hex, never a counter) that is reused only for that call's retries, so a
response lost in transit is replayed (``meta_info.replayed: true``) rather than lost. A poll given
up on (the retry window passed, or the call was cancelled) raises with its ``request_id``, and
the client's next poll resumes that id by itself: a batch the service served meanwhile is
replayed to it, not lost (issue 35).

Owns: the request bodies, the long-poll loop (:func:`get_batch`, :func:`iter_groups`) and the
restart call after a trainer crash (:func:`resume`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from rollout_buffer.client.transport import (
    BufferError,
    BufferUnavailable,
    Connection,
    Emit,
    Sleep,
    Steps,
    call,
    logger,
)
from rollout_buffer.client.views import Batch

LONG_POLL_MAX_S = 60.0  # the longest wait_s the server accepts (a longer one is a 400)
NAMED_IN_LOG = 50  # group ids a log line names before it says how many more

Version = int | Callable[[], int | None] | None


def health(conn: Connection) -> Steps[dict[str, Any]]:
    """GET /health (no token needed)."""
    return (yield from call(conn, "GET", "/health"))


def stats(conn: Connection) -> Steps[dict[str, Any]]:
    """GET /stats: per-job accounting, groups, cursor, lag, launcher state."""
    return (yield from call(conn, "GET", "/stats"))


def start_rollout(
    conn: Connection,
    num_repeat_per_sample: int = 16,
    job_session: str | None = None,
    restart_training: bool = False,
    **extra: Any,
) -> Steps[dict[str, Any]]:
    """POST /start_rollout: select the job (K sessions per group) and start its launcher.

    Without ``job_session`` the server picks a new job, so a retry after the request may have
    been processed could select yet another one: only failures that surely did not reach the
    server (and 503) are retried then. With ``job_session`` the call is idempotent and every
    transient failure is retried. An HTTP 500 (e.g. the launcher could not be started) is
    raised as :class:`BufferError` without retrying.
    """
    body: dict[str, Any] = dict(extra)
    body["num_repeat_per_sample"] = num_repeat_per_sample
    body["restart_training"] = restart_training
    if job_session is not None:
        body["job_session"] = job_session
    return (
        yield from call(
            conn,
            "POST",
            "/start_rollout",
            body,
            retry_if_sent=job_session is not None,
            retry_500=False,
        )
    )


def stop_rollout(conn: Connection) -> Steps[dict[str, Any]]:
    """POST /stop_rollout: stop the launcher (idempotent); ready groups stay servable."""
    return (yield from call(conn, "POST", "/stop_rollout", {}))


def get_rollout_data(
    conn: Connection,
    max_groups: int | None = None,
    request_id: str | None = None,
    *,
    wait_s: float = 0.0,
    min_groups: int | None = None,
    current_weight_version: int | None = None,
    max_off_policy: int | None = None,
) -> Steps[dict[str, Any]]:
    """POST /get_rollout_data; returns the raw response document.

    One logical call = one request_id (a fresh uuid4 hex unless given), reused for every retry,
    so a response lost in transit is replayed rather than lost. A poll given up on raises
    :class:`BufferUnavailable` with its ``request_id``; the next poll of this client resumes it
    by itself, another client with ``request_id=``. ``success`` is false (with
    "No data available to read") when no group is ready. With ``wait_s`` the server holds the
    poll until ``min_groups`` (default 1) groups are ready or ``wait_s`` has passed (long-poll).
    ``current_weight_version`` tells the service the trainer's version (the job keeps the last
    one sent) and ``max_off_policy`` overrides its staleness bound for this poll: groups with
    current - min(weight_version) > max_off_policy are dropped as ``stale``, never served.
    """
    body: dict[str, Any] = {}
    if max_groups is not None:
        body["max_groups"] = max_groups
    if current_weight_version is not None:
        body["current_weight_version"] = current_weight_version
    if max_off_policy is not None:
        body["max_off_policy"] = max_off_policy
    if wait_s:
        body["wait_s"] = wait_s
        if min_groups is not None:
            body["min_groups"] = min_groups
    rid, resumed = conn.request_id(request_id)
    try:
        doc = yield from _poll(conn, body, rid, wait_s)
    except BufferError as exc:
        # resumed by itself, and the service says it cannot answer it (its batch is past the
        # replay window, or of another job): that poll is over; this call polls anew
        if not resumed or exc.status not in (409, 410):
            raise
        logger.warning("request_id %s cannot be resumed (%s); polling anew", rid, exc.message)
        doc = yield from _poll(conn, body, conn.request_id(None)[0], wait_s)
    _warn_launcher_exited(conn, doc)
    return doc


def _poll(
    conn: Connection, body: dict[str, Any], rid: str | None, wait_s: float
) -> Steps[dict[str, Any]]:
    """One poll with its retries; a poll given up on is kept for the client's next poll."""
    if rid is not None:
        body = {**body, "request_id": rid}
    try:
        return (yield from call(conn, "POST", "/get_rollout_data", body, wait_s=wait_s))
    except BufferUnavailable as exc:
        if rid is None:
            raise
        conn.given_up(rid)
        raise BufferUnavailable(
            f"{exc.message}; request_id {rid}: its batch, if one was served, comes with this "
            f"client's next poll, or with get_batch(request_id={rid!r}) from another",
            status=exc.status,
            request_id=rid,
        ) from None
    except BufferError as exc:  # answered (a 4xx): nothing to resume
        exc.request_id = rid
        raise
    except BaseException:  # cancelled or interrupted: the service may have served it meanwhile
        if rid is not None:
            conn.given_up(rid)
        raise


def _warn_launcher_exited(conn: Connection, doc: dict[str, Any]) -> None:
    """Once per launcher: the server says it has exited, so no new group will come."""
    data = doc.get("data")
    meta = data.get("meta_info") if isinstance(data, dict) else None
    launcher = meta.get("launcher") if isinstance(meta, dict) else None
    if not isinstance(meta, dict) or not isinstance(launcher, dict):
        return
    seen = (meta.get("job_session"), launcher.get("pid"))
    if launcher.get("state") == "exited" and seen != conn.exited_launcher:
        conn.exited_launcher = seen
        logger.warning(
            "the launcher of job %s exited with code %s: no new groups will come until a "
            "/start_rollout starts another (its log: %s on the server)",
            seen[0],
            launcher.get("exit_code"),
            launcher.get("log_path"),
            extra={
                "launcher_exited": True
            },  # a record others can tell apart (the demo's own words)
        )


def _next_batch(
    conn: Connection,
    deadline: float | None,
    *,
    max_groups: int | None,
    min_groups: int | None,
    wait_s: float,
    poll_interval: float,
    current_weight_version: Version,
    max_off_policy: int | None,
    request_id: str | None = None,
) -> Steps[Batch | None]:
    """Poll (at least once) until an answer holds groups; None once ``deadline`` has passed.
    ``request_id`` is the first poll's (the others get fresh ones)."""
    while True:
        wait = wait_s if deadline is None else min(wait_s, max(0.0, deadline - time.monotonic()))
        asked = time.monotonic()
        version = (
            current_weight_version() if callable(current_weight_version) else current_weight_version
        )
        doc = yield from get_rollout_data(
            conn,
            max_groups=max_groups,
            request_id=request_id,
            wait_s=wait,
            min_groups=min_groups,
            current_weight_version=version,
            max_off_policy=max_off_policy,
        )
        request_id = None  # answered: bound to its batch, or to nothing
        batch = Batch.of(doc)
        if batch.groups:
            return batch
        if deadline is not None and time.monotonic() >= deadline:
            return None
        # an empty answer well before wait_s: no long-poll there (the original server, or every
        # waiting slot taken), so pause as the original client does instead of spinning
        if time.monotonic() - asked < wait / 2 or wait <= 0:
            pause = poll_interval
            if deadline is not None:
                pause = min(pause, max(0.0, deadline - time.monotonic()))
            yield Sleep(pause)


def get_batch(
    conn: Connection,
    min_groups: int = 1,
    max_groups: int | None = None,
    timeout: float | None = None,
    *,
    poll_interval: float = 3.0,
    current_weight_version: Version = None,
    max_off_policy: int | None = None,
    request_id: str | None = None,
) -> Steps[Batch]:
    """The next batch the server serves, once ``min_groups`` groups are ready: a
    :class:`Batch` with its ``groups`` (at most ``max_groups``) and ``meta_info`` as served.

    ``request_id`` resumes a poll given up on (``BufferUnavailable.request_id``, from this or
    another client): its batch comes again, as it was served, whatever the other arguments say.
    Without it, the poll this client last gave up on is resumed by itself.

    It long-polls (the server holds a poll at most 60 s, and then serves what is ready, so a
    batch can hold fewer than ``min_groups`` groups when they come slower than that) and raises
    TimeoutError when ``timeout`` seconds pass with no group (never when None).
    ``current_weight_version`` and ``max_off_policy`` are sent as by :func:`get_rollout_data`.
    """
    if min_groups < 1 or (max_groups is not None and 0 < max_groups < min_groups):
        raise ValueError(
            f"min_groups={min_groups!r}, max_groups={max_groups!r}: expected "
            "1 <= min_groups <= max_groups"
        )
    deadline = None if timeout is None else time.monotonic() + timeout
    batch = yield from _next_batch(
        conn,
        deadline,
        max_groups=max_groups,
        min_groups=min_groups,
        wait_s=LONG_POLL_MAX_S,
        poll_interval=poll_interval,
        current_weight_version=current_weight_version,
        max_off_policy=max_off_policy,
        request_id=request_id,
    )
    if batch is None:
        raise TimeoutError(f"get_batch: no group was ready within {timeout:g} s")
    return batch


def iter_groups(
    conn: Connection,
    n: int | None = None,
    *,
    max_groups: int | None = None,
    min_groups: int | None = None,
    poll_interval: float = 3.0,
    timeout: float | None = None,
    wait_s: float = 30.0,
    current_weight_version: Version = None,
    max_off_policy: int | None = None,
) -> Steps[None]:
    """Yield complete groups as :class:`Group` views in the order served (each unpacks as the
    ``(group_id, items)`` of old, and carries its batch's ``meta_info``).

    Its first poll may resume a poll this client gave up on: that batch is yielded whole, even
    past ``n`` (its groups were served to this trainer).

    Each poll long-polls up to ``wait_s`` (0 for the original server, which does not know it)
    until ``min_groups`` groups are ready (default 1; never more than the groups still wanted);
    after an empty answer without long-poll it sleeps ``poll_interval``. Stops after ``n``
    groups (never when None); raises TimeoutError when ``timeout`` seconds pass first. Each poll
    asks for at most the groups still wanted, so no group is taken from the server and not
    yielded; groups of a response the caller stops consuming midway are, however, marked served
    on the server. A group id is never yielded twice (a duplicate is logged and skipped).
    ``current_weight_version`` (a number, or a callable asked before every poll, as the
    trainer's version moves while it iterates) and ``max_off_policy`` are sent with every poll.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    seen: set[str] = set()
    yielded = 0
    while n is None or yielded < n:
        want = max_groups
        if n is not None:
            left = n - yielded
            want = left if want is None or want <= 0 else min(want, left)
        # never wait for more groups than are still wanted (max_groups <= 0 is no cap)
        least = min_groups if min_groups is None or not want or want < 0 else min(min_groups, want)
        batch = None
        if deadline is None or time.monotonic() < deadline:
            batch = yield from _next_batch(
                conn,
                deadline,
                max_groups=want,
                min_groups=least,
                wait_s=wait_s,
                poll_interval=poll_interval,
                current_weight_version=current_weight_version,
                max_off_policy=max_off_policy,
            )
        if batch is None:
            raise TimeoutError(
                f"iter_groups: {yielded} of {n if n is not None else 'unbounded'} groups "
                f"after {timeout:g} s"
            )
        # a batch resumed after a poll given up on was asked for by that poll, maybe with more
        # groups: it is yielded whole, as the service counted every group of it as served
        whole = batch.meta_info.get("replayed") is True
        if whole and n is not None and yielded + len(batch.groups) > n:
            logger.warning(
                "request_id %s: the resumed batch holds %d groups, %d more than still wanted; "
                "all are yielded, as they were served",
                batch.meta_info.get("request_id"),
                len(batch.groups),
                yielded + len(batch.groups) - n,
            )
        for i, group in enumerate(batch.groups):
            if group.group_id in seen:
                logger.error(
                    "group %s was served twice; skipping the duplicate (%d items)",
                    group.group_id,
                    len(group.items),
                )
                continue
            if n is not None and yielded >= n and not whole:
                logger.warning(
                    "the server sent %d groups more than asked for; they are not yielded: %s",
                    len(batch.groups) - i,
                    [g.group_id for g in batch.groups[i:]],
                )
                break
            seen.add(group.group_id)
            yielded += 1
            yield Emit(group)


def _named(ids: list[str]) -> str:
    shown = ", ".join(ids[:NAMED_IN_LOG])
    return shown + (f" and {len(ids) - NAMED_IN_LOG} more" if len(ids) > NAMED_IN_LOG else "")


def resume(
    conn: Connection,
    trained_group_ids: Iterable[str],
    num_repeat_per_sample: int = 16,
    job_session: str | None = None,
    **extra: Any,
) -> Steps[dict[str, Any]]:
    """The restart call after a trainer crash: ``/start_rollout`` with ``skip_instance_ids`` =
    the groups the checkpoint holds (``meta_info.finished_groups`` of the batches it trained
    on). Every group of the active job that was served and is not in the list is served again,
    ahead of new groups (README, "Redelivery after a trainer crash"); returns the answer and
    logs one line naming the groups delivered again.

    Name the job in ``job_session``: without it a stopped launcher means a new job, and a new
    job redelivers nothing. An empty list redelivers nothing either (the server's rule).
    """
    if isinstance(trained_group_ids, (str, bytes)):  # its characters are not group ids
        raise TypeError(
            f"trained_group_ids={trained_group_ids!r}: expected a list of group ids, not one string"
        )
    ids = list(dict.fromkeys(str(g) for g in trained_group_ids))
    answer = yield from start_rollout(
        conn,
        num_repeat_per_sample,
        job_session=job_session,
        restart_training=False,
        skip_instance_ids=ids,
        **extra,
    )
    job = answer.get("job_session")
    redelivery = answer.get("redelivery")
    if not isinstance(redelivery, dict):
        logger.warning(
            "resume: job %s (%s): nothing is delivered again (%s)",
            job,
            answer.get("message"),
            "the checkpoint holds no group"
            if not ids
            else "the call began a new job, or the server does not redeliver",
        )
        return answer
    again = redelivery.get("groups")
    logger.warning(
        "resume: job %s: the checkpoint holds %d groups; %s served groups it lacks are delivered "
        "again first%s",
        job,
        len(ids),
        redelivery.get("queued"),
        f": {_named([str(g) for g in again])}" if isinstance(again, list) and again else "",
    )
    return answer
