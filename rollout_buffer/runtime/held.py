"""The pacing gate's held first calls (issue 23), let go in the order the launcher started their
sessions.

A held call keeps its session's place in the launcher's pool. The launcher starts its sessions in
the order of ``job_environments``, a group's sessions one after the other, so a group admitted
ahead of its turn may have sessions not started yet, waiting for a place that the held sessions
of the groups listed before it keep: in the pacing bench such a group finished 3 s late, a poll
cadence lost. So when the budget frees, the held calls are asked in the order of their session's
place in ``job_environments`` (then of arrival): the group the launcher started first goes first.
A first call that comes while calls are held waits its turn too.

One task asks for all of them: when the gate is poked (the trainer polled, rows arrived) and
every :data:`RECHECK_S` (a session that went quiet is taken for dead as time passes, with no event
to say so), at most once every :data:`ROUND_GAP_S`. A held call whose client goes away leaves the
queue.

Owns: the queue of held calls and the task that asks for them. It must not decide admission (it
asks ``may_start``) nor read the budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

# the held calls are asked again at least this often: the budget moves with polls and rows (the
# gate is poked then) and as sessions that went quiet are taken for dead (no event says when)
RECHECK_S = 0.25
# rounds are at least this far apart: a trainer polling back to back pokes the gate at every poll,
# and a round asks every held call (hundreds): one a poll took about a millisecond of each poll
ROUND_GAP_S = 0.02
UNPLACED = float("inf")  # a session job_environments has not listed (yet): after the listed ones


class _Waiting:
    """One held call."""

    __slots__ = ("counted", "go", "place", "seq", "session")

    def __init__(self, session: str, seq: int, go: asyncio.Future[bool]) -> None:
        self.session = session
        self.seq = seq
        self.place: float | None = None  # its session's place in job_environments, once known
        self.go = go
        self.counted = False  # counted as held (it was refused once)

    def order(self) -> tuple[float, int]:
        return (UNPLACED if self.place is None else self.place, self.seq)


class HeldCalls:
    """First calls waiting for their group to be admitted (see the module docstring).
    ``may_start`` and ``place`` are called on the gate's thread and must be quick."""

    def __init__(
        self,
        may_start: Callable[[str], bool],
        place: Callable[[str], int | None],
        on_hold: Callable[[], None],
    ) -> None:
        self.may_start = may_start
        self.place = place
        self.on_hold = on_hold
        self.held = 0  # calls held now (refused at least once)
        self._queue: dict[int, _Waiting] = {}
        self._seq = itertools.count()
        self._wake: asyncio.Event | None = None

    def wake(self) -> None:
        """(The gate's thread.) Ask for the held calls now."""
        if self._wake is not None:
            self._wake.set()

    async def admit(self, session: str, reader: asyncio.StreamReader) -> bool:
        """Wait until the first call of ``session`` may go. False when its client went away
        meanwhile (the launcher's client times a call out and retries it): that call must not
        reach the model when the group is admitted (a duplicate first call, generated for
        nobody), nor stay counted as held."""
        if not self._queue and self.may_start(session):
            return True  # nothing held: no turn to wait for
        loop = asyncio.get_running_loop()
        waiting = _Waiting(session, next(self._seq), loop.create_future())
        if not self._queue:  # it was refused just now
            self._count(waiting)
        self._queue[waiting.seq] = waiting
        self.wake()
        # a client sends nothing after its request: end of stream means it is gone
        gone: asyncio.Future[Any] = asyncio.ensure_future(reader.read(1))
        try:
            while not waiting.go.done():
                await asyncio.wait({waiting.go, gone}, return_when=asyncio.FIRST_COMPLETED)
                if waiting.go.done():
                    break
                if gone.cancelled() or gone.exception() or not gone.result():
                    return False
                # bytes after the request (a pipelining client): not gone; stop watching
                gone = loop.create_future()
            return waiting.go.result()  # (raises what may_start raised for it)
        finally:
            gone.cancel()
            self._queue.pop(waiting.seq, None)
            if waiting.counted:
                self.held -= 1

    async def run(self) -> None:
        """The task that asks for the held calls, in the launcher's order."""
        self._wake = asyncio.Event()
        loop = asyncio.get_running_loop()
        last_round = float("-inf")
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), RECHECK_S)
            wait = last_round + ROUND_GAP_S - loop.time()
            if wait > 0:  # (pokes meanwhile are answered by this round)
                await asyncio.sleep(wait)
            last_round = loop.time()
            self._wake.clear()
            if self._queue:
                try:
                    self._round()
                except Exception:  # a bug; the held calls must still be asked next time
                    logger.exception("asking for the held calls failed")

    def _round(self) -> None:
        for waiting in list(self._queue.values()):
            if waiting.place is None:
                waiting.place = self.place(waiting.session)
        for waiting in sorted(self._queue.values(), key=_Waiting.order):
            if waiting.go.done():
                continue
            try:
                if self.may_start(waiting.session):
                    waiting.go.set_result(True)
                else:
                    self._count(waiting)
            except Exception as exc:  # a bug: that call fails (its client retries), not the rest
                logger.exception("asking whether a held call may go failed")
                waiting.go.set_exception(exc)

    def _count(self, waiting: _Waiting) -> None:
        if not waiting.counted:
            waiting.counted = True
            self.held += 1
            self.on_hold()
