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

A session whose row of its last answered call has reached the buffer, and is not terminal, owes
the environment's next call: it is taken for dead once it has been quiet for longer than live
sessions are between calls alone (the row says it did not finish). With the launcher's rows
flushed every few seconds, that tells a crash from a finish as soon as the crashed session's last
row arrives, instead of a flush interval or more after it. The step of a row (``step_id``, 1-based,
one per model call: SPEC §2) is compared with the calls the gate saw answered; a session the
service saw only mid-way (it restarted under it), or with a row of a step beyond its calls (rows
that are not one per call, or a wrong ``step_id``), is not judged so.

A call in flight, however long (a model call may take fifteen minutes), keeps its session alive.
So does a call that ended in a way the launcher's client retries (no answer, a 5xx or a 429: the
proxy restarting, or reloading its weights): the client backs off up to 30 s plus 20 % before its
next try (SPEC §5), so its session is not taken for dead before that has passed, and that backoff
is not one of the quiet spans the threshold is learned from.
The threshold is the larger of four times the median and twice the 95th percentile of the recent
quiet spans of either kind, and at least a second (for a session that owes a call: of the gaps
between calls only, and at least half a second); until twenty gaps were seen, the census takes
a session quiet for longer than its client's longest backoff for dead (the first admitted groups
may all die before twenty gaps, and then none would ever be seen while every other call is held).

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
MIN_OWED_S = 0.5  # the least quiet after which a session that owes a call is taken for dead
# the launcher's LLM client backs off at most 30 s, plus up to 20 % jitter (SPEC §5)
RETRY_QUIET_S = 36.0


class Calls:
    """One running session as the gate and the rows show it."""

    __slots__ = ("answered", "backoff_s", "counted", "finished", "in_flight", "last_end", "step")

    def __init__(self, now: float, counted: bool) -> None:
        self.in_flight = 1
        self.last_end = now  # when its last call ended (or its first began)
        self.backoff_s = 0.0  # how long it may stay quiet whatever the threshold (a retry's)
        self.answered = 0  # calls answered in a way its client does not retry
        self.step = 0  # the largest step of its rows that reached the buffer
        self.finished = False  # a terminal row of it reached the buffer
        self.counted = counted  # its calls were all seen at the gate (not resumed mid-way)

    def owes_a_call(self) -> bool:
        """Its row of its last answered call arrived, and was not its last: its environment's
        next call is due."""
        return (
            self.counted
            and not self.finished
            and self.in_flight <= 0
            and self.answered > 0
            and self.step >= self.answered
        )


class Liveness:
    """Calls in flight and quiet spans of the running sessions (see the module docstring)."""

    def __init__(self) -> None:
        self.calls: dict[str, Calls] = {}
        self.gaps: deque[float] = deque(maxlen=SPANS_KEPT)  # a call's end to the next one's start
        self.lags: deque[float] = deque(maxlen=SPANS_KEPT)  # a call's end to a row of the session
        # how long a session that owes a call may stay quiet: set with :meth:`quiet_after`
        self.owed_after_s = float("inf")
        self.arrived: set[str] = set()  # sessions whose first call reached the gate (held or not)
        self.first_seen: float | None = None  # when the gate saw its first call (held or not)
        # first calls of the last few seconds, (when, the session's place in job_environments),
        # and the largest place among the older ones: the launcher has passed every session
        # listed before it
        self._arrivals: deque[tuple[float, int]] = deque()
        self._passed = -1
        self.in_order = True  # False once a session arrived after being passed over

    def call_started(self, session_id: str, now: float, counted: bool = True) -> None:
        """A call of the session reached the gate (``counted``: the gate saw all its calls; False
        for a session that ran before the service did)."""
        if self.first_seen is None:
            self.first_seen = now
        entry = self.calls.get(session_id)
        if entry is None:
            self.calls[session_id] = Calls(now, counted)
            return
        if entry.in_flight <= 0 and not entry.backoff_s:
            # (a retry after a backoff: not an environment's step)
            self.gaps.append(max(0.0, now - entry.last_end))
        entry.in_flight += 1

    def call_ended(self, session_id: str, now: float, retried: bool = False) -> None:
        """A call of the session ended; ``retried``: so that its client retries it after a
        backoff (no answer, a 5xx or a 429)."""
        entry = self.calls.get(session_id)
        if entry is not None:
            entry.in_flight = max(0, entry.in_flight - 1)
            entry.last_end = now
            entry.backoff_s = RETRY_QUIET_S if retried else 0.0
            if not retried:
                entry.answered += 1

    def row(
        self, session_id: str, now: float, step: int | None = None, terminal: bool = False
    ) -> None:
        """A row of the session (its ``step``, 1-based) reached the buffer: how long after its
        call ended, and whether the session owes another call."""
        entry = self.calls.get(session_id)
        if entry is not None:
            if entry.in_flight <= 0:
                self.lags.append(max(0.0, now - entry.last_end))
            if terminal:
                entry.finished = True
            elif isinstance(step, int) and step > entry.step:
                entry.step = step
                if step > entry.answered:
                    # a row of a step whose model call the gate did not see answered: this
                    # launcher's rows are not one per call (or the row is wrong), and its steps
                    # cannot tell that it owes a call
                    entry.counted = False

    def quiet_after(self) -> float | None:
        """Seconds of quiet after which a session with no call in flight is taken for dead; None
        until enough gaps were seen (then nothing is). Sets :attr:`owed_after_s` too."""
        if len(self.gaps) < MIN_GAPS:
            self.owed_after_s = float("inf")
            return None
        threshold = MIN_QUIET_S
        for spans in (self.gaps, self.lags):
            if spans:
                spread = _spread(spans)
                if spans is self.gaps:
                    self.owed_after_s = max(MIN_OWED_S, spread)
                threshold = max(threshold, spread)
        return threshold

    def arrive(self, session_id: str, place: int | None, now: float) -> None:
        """The session's first call reached the gate; ``place``: its place in job_environments
        (None: not listed)."""
        if self.first_seen is None:
            self.first_seen = now
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
        than its client's longest backoff when its last call is to be retried; or, when it owes
        a call, for longer than :attr:`owed_after_s`. A session never
        seen at the gate is not dead: it has not started (it waits for a place in the launcher's
        pool), or pacing is off."""
        entry = self.calls.get(session_id)
        if entry is None or entry.in_flight > 0:
            return False
        quiet = now - entry.last_end
        if entry.owes_a_call() and quiet > max(self.owed_after_s, entry.backoff_s):
            return True
        return quiet > max(quiet_s, entry.backoff_s)

    def forget(self, sessions: Iterable[str]) -> None:
        """Sessions of a decided group."""
        for session_id in sessions:
            self.calls.pop(session_id, None)
            self.arrived.discard(session_id)


def _spread(spans: Iterable[float]) -> float:
    """The larger of four times the median and twice the 95th percentile."""
    ordered = sorted(spans)
    median = ordered[len(ordered) // 2]
    p95 = ordered[int(0.95 * (len(ordered) - 1))]
    return max(4.0 * median, 2.0 * p95)
