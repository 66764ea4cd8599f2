"""The pacing gate (issue 34): the launcher's LLM base URL, which forwards only the launcher's
model calls, and holds a first call while the budget is spent.

It forwards ``POST <base path>/<session_id>/chat/completions`` to the LLM proxy's
``/v1/<session_id>/chat/completions``, for a session the job lists, and answers everything else
itself with a JSON error and a ``reason``. Nothing refused reaches the proxy. One exchange (its
framing, limits and forwarding) is :mod:`~rollout_buffer.pacing.http`'s.

It runs an asyncio loop on a thread of its own in the service's process: a held or forwarded call
costs a coroutine and one or two descriptors, never a request thread. Only the owner listens
(``owner()``); the address is the one in the running launcher's ``--llm-base-url`` (``address()``),
so a standby that adopted a launcher serves the gate that launcher calls.

Owns: the listening socket, the event loop and its thread, the connections, the held calls and
the refusal counts. It must not read the accumulator: it asks :class:`~.budget.Budget`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import resource
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import h11

from rollout_buffer.pacing.budget import Budget
from rollout_buffer.pacing.http import (
    STATUS,
    Address,
    Gone,
    Refused,
    answer,
    forward,
    judge,
    read_body,
    read_head,
)

logger = logging.getLogger(__name__)

NOT_LISTED_WAIT_S = 10.0  # the launcher lists its sessions when it starts, before any call
NO_SESSIONS_S = 60.0  # no session listed this long after the job began: pacing cannot work
ROUND_S = 0.2  # held calls are asked again at least this often (sessions go quiet with time)
KEEP_S = 0.5  # how often the gate checks that it should listen, and where
LOG_EVERY_S = 60.0  # each refusal reason is logged at most this often
RESERVED_FDS = 512  # descriptors left to the web server, the database and the launcher


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int
    stall_s: float
    max_held_bytes: int
    max_hold_s: float


class Waiter:
    __slots__ = ("arrived", "body_bytes", "future", "place", "seq", "session")

    def __init__(self, session: str, seq: int, body_bytes: int, now: float) -> None:
        self.session = session
        self.seq = seq
        self.body_bytes = body_bytes
        self.arrived = now
        self.place: float = float("inf")
        self.future: asyncio.Future[str] = asyncio.get_running_loop().create_future()


class Gate:
    """The gate's server (see the module docstring)."""

    def __init__(
        self,
        budget: Budget,
        limits: Limits,
        *,
        upstream: tuple[str, int],
        address: Callable[[], Address],
        owner: Callable[[], bool],
    ) -> None:
        self.budget = budget
        self.limits = limits
        self.upstream = upstream
        self.address = address
        self.owner = owner
        self.refused: Counter[str] = Counter({reason: 0 for reason in STATUS})
        self.forwarded = 0
        self.upstream_errors = 0
        self.bound: Address | None = None
        self.bind_error: str | None = None
        self.max_connections = max(16, (raise_descriptor_limit() - RESERVED_FDS) // 2)
        self.held: dict[int, Waiter] = {}
        self.held_bytes = 0
        self._seq = itertools.count()
        self._connections: set[asyncio.Task[Any]] = set()
        self._logged: dict[str, float] = {}
        self._since_log: Counter[str] = Counter()
        self._server: asyncio.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._said_unlisted = False
        self._poked = False

    # -- lifecycle (the service's threads) --------------------------------------------------------
    def start(self) -> None:
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(ready,), name="rollout-buffer-gate", daemon=True
        )
        self._thread.start()
        ready.wait(10)

    def close(self, timeout: float = 5.0) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout)

    def poke(self) -> None:
        """(Any thread.) The budget may have moved: held calls are asked again now."""
        loop, wake = self._loop, self._wake
        if self._poked or loop is None or wake is None or loop.is_closed():
            return  # (one wake-up for a burst: a job lists thousands of sessions at once)
        self._poked = True
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(wake.set)

    def url(self) -> str | None:
        """The URL the launcher is handed; None while the gate does not listen."""
        return None if self.bound is None else self.bound.url

    def stats(self) -> dict[str, Any]:
        return {
            "listening": None if self.bound is None else f"{self.bound.bind}:{self.bound.port}",
            "bind_error": self.bind_error,
            "connections": len(self._connections),
            "max_connections": self.max_connections,
            "held_calls": len(self.held),
            "held_bytes": self.held_bytes,
            "forwarded": self.forwarded,
            "upstream_errors": self.upstream_errors,
            "limits": {
                "ROLLOUT_BUFFER_GATE_MAX_BODY_BYTES": self.limits.max_body_bytes,
                "ROLLOUT_BUFFER_GATE_STALL_SECONDS": self.limits.stall_s,
                "ROLLOUT_BUFFER_GATE_MAX_HELD_BYTES": self.limits.max_held_bytes,
                "ROLLOUT_BUFFER_GATE_MAX_HOLD_SECONDS": self.limits.max_hold_s,
            },
        }

    def _run(self, ready: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        self._wake = asyncio.Event()
        tasks = [loop.create_task(self._keep()), loop.create_task(self._pump())]
        ready.set()
        try:
            loop.run_forever()
        finally:
            self._unbind(end_connections=True)
            for task in tasks:
                task.cancel()
            with contextlib.suppress(Exception):
                loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.close()

    # -- listening only as the owner, where the launcher calls ----------------------------------
    async def _keep(self) -> None:
        while True:
            try:
                await self._follow()
            except Exception:  # a bug: the gate must go on following its role
                logger.exception("the pacing gate could not follow its role")
            await asyncio.sleep(KEEP_S)

    async def _follow(self) -> None:
        if not self.owner():
            if self.bound is not None:
                logger.warning("not the owner any more: the pacing gate closes")
                self._unbind(end_connections=True)
            return
        want = self.address()
        if self.bound is not None and want[:2] == self.bound[:2]:
            self.bound = want  # (the launcher adopted may name another path)
            return
        self._unbind(end_connections=False)
        try:
            self._server = await asyncio.start_server(
                self._accepted, want.bind, want.port, reuse_address=True, backlog=1024
            )
        except OSError as exc:
            if self.bind_error is None:
                logger.warning(
                    "the pacing gate cannot listen on %s:%d (%s): retrying until it can; "
                    "ROLLOUT_BUFFER_GATE_PORT chooses the port",
                    want.bind,
                    want.port,
                    exc,
                )
            self.bind_error = str(exc)
            return
        self.bound, self.bind_error = want, None
        logger.info("pacing gate listening on %s:%d", want.bind, want.port)

    def _unbind(self, *, end_connections: bool) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        self.bound = None
        if end_connections:  # held and forwarded calls: their clients retry (SPEC §5)
            for task in list(self._connections):
                task.cancel()

    # -- held calls ---------------------------------------------------------------------------
    async def _pump(self) -> None:
        assert self._wake is not None
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), ROUND_S)
            self._wake.clear()
            self._poked = False
            try:
                self._round()
            except Exception:  # a bug: the held calls must still be asked next time
                logger.exception("asking for the held calls failed")

    def _round(self) -> None:
        now = time.monotonic()
        budget = self.budget
        with budget.lock:
            budget.read_inbox()
            self._say_unlisted(now)
            free = budget.budget()
            for waiter in sorted(self.held.values(), key=lambda w: (w.place, w.seq)):
                verdict = self._verdict(waiter, now, free)
                if verdict == "admitted":
                    free -= 1
                if verdict is not None:
                    self._release(waiter, verdict)

    def _verdict(self, waiter: Waiter, now: float, free: int) -> str | None:
        """(Budget lock held.) What becomes of a held call now: ``go``, ``admitted`` (its group
        starts), a refusal's reason, or None (held on)."""
        listed = self.budget.group_of(waiter.session)
        held_s = now - waiter.arrived
        if listed is None:
            if held_s >= NOT_LISTED_WAIT_S:
                return "not_listed"
            # (a hold limit below 10 s bounds an unlisted session's call too)
            return "max_hold" if held_s >= self.limits.max_hold_s else None
        group, waiter.place = listed[0], listed[1]
        if self.budget.runs(group):
            return "go"
        if held_s >= self.limits.max_hold_s:
            return "max_hold"
        if free > 0:
            self.budget.admit(group)
            return "admitted"
        return None

    def _release(self, waiter: Waiter, verdict: str) -> None:
        self.held.pop(waiter.seq, None)
        self.held_bytes -= waiter.body_bytes
        if not waiter.future.done():
            waiter.future.set_result(verdict)

    def _say_unlisted(self, now: float) -> None:
        budget = self.budget
        if budget.job is not None and not budget.sessions and not self._said_unlisted:
            if now - budget.job_since >= NO_SESSIONS_S:
                self._said_unlisted = True
                logger.warning(
                    "job %r lists no session in job_environments %.0f s after it began: pacing "
                    "cannot work, and the gate refuses every model call (not_listed)",
                    budget.job,
                    NO_SESSIONS_S,
                )
        elif budget.sessions:
            self._said_unlisted = False

    def why(self) -> str:
        """(Budget lock held.) ``no_job``, ``no_sessions_listed``, ``budget_spent`` or
        ``budget_free``."""
        budget = self.budget
        if budget.job is None:
            return "no_job"
        if not budget.sessions and time.monotonic() - budget.job_since >= NO_SESSIONS_S:
            return "no_sessions_listed"
        return "budget_free" if budget.budget() > 0 else "budget_spent"

    # -- one connection -------------------------------------------------------------------------
    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        conn = h11.Connection(h11.SERVER)
        try:
            if len(self._connections) > self.max_connections:
                raise Refused("connections", "the gate has too many connections; retry")
            await self._serve(reader, writer, conn)
        except Refused as refused:
            self._count(refused.reason)
            with contextlib.suppress(Exception):
                await answer(writer, conn, refused)
        except Gone as gone:
            if str(gone) == "stalled":
                self._count("stalled")
        except (ConnectionError, asyncio.CancelledError, h11.ProtocolError):
            pass  # either side went away, or the gate closes: the client retries
        except Exception:  # a bug: this call fails (its client retries), not the gate
            logger.exception("the pacing gate failed a call")
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _serve(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: h11.Connection
    ) -> None:
        limits = self.limits
        request = await read_head(reader, conn, limits.stall_s)
        session = judge(request, self.bound)
        body = await read_body(reader, writer, conn, request, limits.max_body_bytes, limits.stall_s)
        group = await self._admit(session, len(body), reader)
        job = self.budget_call(None, group, session, +1)
        version = None
        try:
            relayed = await forward(self.upstream, request, session, body, reader, writer, conn)
            version = relayed.weight_version
            if relayed.answered:
                self.forwarded += 1
            else:
                self.upstream_errors += 1
        finally:
            self.budget_call(job, group, session, -1, version)

    def budget_call(
        self, job: str | None, group: str, session: str, delta: int, version: int | None = None
    ) -> str | None:
        """A call began (+1, ``job`` None: the job it began in is returned) or ended (-1, in
        ``job``). A call that ends in another job is not that job's: group ids repeat across
        jobs, and its answer's version is the old job's."""
        with self.budget.lock:
            if delta < 0 and self.budget.job != job:
                return None
            self.budget.call(group, session, delta)
            if version is not None:
                self.budget.answered(group, version)
            return self.budget.job

    async def _admit(self, session: str, size: int, reader: asyncio.StreamReader) -> str:
        """Wait until the session's call may go; its group. Raises Refused (not listed, the
        hold's end, the held bytes' cap) or Gone (its client went away: never forwarded)."""
        budget = self.budget
        with budget.lock:
            budget.read_inbox()
            listed = budget.group_of(session)
            if listed is not None and budget.runs(listed[0]):
                return listed[0]
            if listed is not None and not self.held and budget.budget() > 0:
                budget.admit(listed[0])
                return listed[0]
        if self.held_bytes + size > self.limits.max_held_bytes:
            raise Refused("held_bytes", "the gate holds too many bytes of held calls; retry")
        waiter = Waiter(session, next(self._seq), size, time.monotonic())
        self.held[waiter.seq] = waiter
        self.held_bytes += size
        self.poke()
        gone = asyncio.ensure_future(reader.read(1))  # a client sends nothing after its call
        either: set[asyncio.Future[Any]] = {waiter.future, gone}
        try:
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            if not waiter.future.done():
                raise Gone("closed")  # it gave up (it retries): never forwarded
            verdict = waiter.future.result()
        finally:
            gone.cancel()
            if waiter.seq in self.held:
                self._release(waiter, "gone")
        if verdict in ("not_listed", "max_hold"):
            raise Refused(verdict, _HELD_MESSAGES[verdict])
        with budget.lock:
            budget.read_inbox()
            listed = budget.group_of(session)
        if listed is None:  # its job ended since it was let go (GET /admission read the news)
            raise Refused("not_listed", _HELD_MESSAGES["not_listed"])
        return listed[0]

    # -- forwarding ---------------------------------------------------------------------------
    # -- counting refusals ----------------------------------------------------------------------
    def _count(self, reason: str) -> None:
        self.refused[reason] += 1
        self._since_log[reason] += 1
        now = time.monotonic()
        if now - self._logged.get(reason, float("-inf")) >= LOG_EVERY_S:
            self._logged[reason] = now
            logger.warning(
                "pacing gate: refused %d request(s) (%s) since this was last logged",
                self._since_log.pop(reason),
                reason,
            )


_HELD_MESSAGES = {
    "not_listed": "the current job does not list this session in job_environments",
    "max_hold": "held for ROLLOUT_BUFFER_GATE_MAX_HOLD_SECONDS; retry",
}


def raise_descriptor_limit(wanted: int = 65536) -> int:
    """Raise the soft limit on open descriptors towards the hard one (a held call takes one, a
    forwarded call two); the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and target > soft:
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return target
    return soft if soft != resource.RLIM_INFINITY else wanted
