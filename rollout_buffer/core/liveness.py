"""Which started sessions are alive, from their model calls through the pacing gate (issue 23).

A session that fails for good (its environment crashed, its client gave up) writes no terminal
row and makes no more model calls; until its group is known to be unable to reach K, that group
holds a place in the admission budget that a group able to complete could use. The gate sees
every call of every session, so a session is taken for dead when it has no call in flight and has
been quiet for longer than live sessions are:

- between the end of one of their calls and the start of the next (their environment's step), and
- between the end of a call and the row of that step reaching the buffer (the launcher flushes its
  rows every few seconds: a session that just finished is quiet while its terminal row is on its
  way, and must not be taken for dead meanwhile).

A call in flight, however long (a model call may take fifteen minutes), keeps its session alive.
So does a call that ended in a way the launcher's client retries (no answer, a 5xx or a 429: the
proxy restarting, or reloading its weights): the client backs off up to 30 s plus 20 % before its
next try (SPEC §5), so its session is not taken for dead before that has passed, and that backoff
is not one of the quiet spans the threshold is learned from.
The threshold is the larger of four times the median and twice the 95th percentile of the recent
quiet spans of either kind, and at least a second; nothing is dead until twenty gaps were seen.

A session that failed before its first model call never shows at the gate. The launcher starts
its sessions in the order of ``job_environments``, so one that has not arrived at the gate (its
first call, held or not) while a session listed after it arrived longer than that threshold ago
was passed over: it failed at its start.

Owns: each running session's calls in flight and when it last went quiet, and the recent spans. It
must not decide groups: the accumulator asks, under its lock (this class has no lock of its own).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

SPANS_KEPT = 200  # recent quiet spans of each kind the threshold is taken from
MIN_GAPS = 20  # gaps between calls seen before any session is taken for dead
MIN_QUIET_S = 1.0
# the launcher's LLM client backs off at most 30 s, plus up to 20 % jitter (SPEC §5)
RETRY_QUIET_S = 36.0


class Liveness:
    """Calls in flight and quiet spans of the running sessions (see the module docstring)."""

    def __init__(self) -> None:
        # session -> [calls in flight, when its last call ended (or its first began), how long
        # it may stay quiet whatever the threshold (its client backs off: RETRY_QUIET_S, else 0)]
        self.calls: dict[str, list[float]] = {}
        self.gaps: deque[float] = deque(maxlen=SPANS_KEPT)  # a call's end to the next one's start
        self.lags: deque[float] = deque(maxlen=SPANS_KEPT)  # a call's end to a row of the session
        self.arrived: set[str] = set()  # sessions whose first call reached the gate (held or not)
        # first calls of the last few seconds, (when, the session's place in job_environments),
        # and the largest place among the older ones: the launcher has passed every session
        # listed before it
        self._arrivals: deque[tuple[float, int]] = deque()
        self._passed = -1
        self.in_order = True  # False once a session arrived after being passed over

    def call_started(self, session_id: str, now: float) -> None:
        entry = self.calls.get(session_id)
        if entry is None:
            self.calls[session_id] = [1.0, now, 0.0]
            return
        if entry[0] <= 0 and not entry[2]:  # (a retry after a backoff: not an environment's step)
            self.gaps.append(max(0.0, now - entry[1]))
        entry[0] += 1

    def call_ended(self, session_id: str, now: float, retried: bool = False) -> None:
        """A call of the session ended; ``retried``: so that its client retries it after a
        backoff (no answer, a 5xx or a 429)."""
        entry = self.calls.get(session_id)
        if entry is not None:
            entry[0] = max(0.0, entry[0] - 1)
            entry[1] = now
            entry[2] = RETRY_QUIET_S if retried else 0.0

    def row(self, session_id: str, now: float) -> None:
        """A row of the session reached the buffer: how long after its call ended."""
        entry = self.calls.get(session_id)
        if entry is not None and entry[0] <= 0:
            self.lags.append(max(0.0, now - entry[1]))

    def quiet_after(self) -> float | None:
        """Seconds of quiet after which a session with no call in flight is taken for dead; None
        until enough gaps were seen (then nothing is)."""
        if len(self.gaps) < MIN_GAPS:
            return None
        threshold = MIN_QUIET_S
        for spans in (self.gaps, self.lags):
            if spans:
                ordered = sorted(spans)
                median = ordered[len(ordered) // 2]
                p95 = ordered[int(0.95 * (len(ordered) - 1))]
                threshold = max(threshold, 4.0 * median, 2.0 * p95)
        return threshold

    def arrive(self, session_id: str, place: int | None, now: float) -> None:
        """The session's first call reached the gate; ``place``: its place in job_environments
        (None: not listed)."""
        if session_id not in self.arrived:
            self.arrived.add(session_id)
            if place is not None:
                if place < self._passed:
                    # it was taken for dead: the launcher does not start sessions in the order
                    # of job_environments, and the rule would take queued sessions for dead
                    self.in_order = False
                self._arrivals.append((now, place))

    def passed(self, place: int, now: float, quiet_s: float) -> bool:
        """A session listed at ``place`` that has not arrived: did the launcher start one listed
        after it longer than ``quiet_s`` ago?"""
        horizon = now - quiet_s
        while self._arrivals and self._arrivals[0][0] <= horizon:
            self._passed = max(self._passed, self._arrivals.popleft()[1])
        return self.in_order and self._passed > place

    def dead(self, session_id: str, now: float, quiet_s: float) -> bool:
        """No call in flight, and quiet for longer than ``quiet_s`` (:meth:`quiet_after`), or
        than its client's longest backoff when its last call is to be retried. A session never
        seen at the gate is not dead: it has not started (it waits for a place in the launcher's
        pool), or pacing is off."""
        entry = self.calls.get(session_id)
        return entry is not None and entry[0] <= 0 and now - entry[1] > max(quiet_s, entry[2])

    def forget(self, sessions: Iterable[str]) -> None:
        """Sessions of a decided group."""
        for session_id in sessions:
            self.calls.pop(session_id, None)
            self.arrived.discard(session_id)
