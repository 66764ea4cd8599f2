"""Pacing the producers (issue 23): the admission budget of the active job, and the gate that
enforces it on the launcher when ``ROLLOUT_BUFFER_PACING=gate``.

The budget is always computed and published (``GET /admission``), pacing on or off. With the gate
on, the service hands the launcher the gate's URL as ``--llm-base-url`` and
``AIEVOBOX_LLM_MAX_CONCURRENCY=0`` (see :mod:`rollout_buffer.launcher.launcher`), and the gate
asks :meth:`Pacing.may_start` at each session's first model call.

What the operator gives up with the gate on: sessions of groups not admitted wait at their first
model call (their environment was reset 0.1-5 s before, and stays so); a launcher configured with
its own LLM concurrency limit loses it; model calls take one more local hop.

Owns: the :class:`~rollout_buffer.core.admission.Admission` of the active job (a new one for each
job) and the gate's lifecycle. It must not decide groups: it reads the accumulator's figures.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from rollout_buffer.core.accumulator import Accumulator
from rollout_buffer.core.admission import Admission
from rollout_buffer.core.config import Config
from rollout_buffer.core.errors import ConfigError
from rollout_buffer.runtime.gate import Gate
from rollout_buffer.runtime.jobs import Jobs
from rollout_buffer.runtime.signals import Signals

logger = logging.getLogger(__name__)

# A first call of a session that job_environments has not shown yet waits this long for the
# census to read it (the launcher lists its sessions when it starts, before any call); after
# that the session is let through unpaced rather than held for good.
UNKNOWN_SESSION_WAIT_S = 10.0
# A refusal for want of budget stands this long for the other held calls, unless the trainer
# polls or rows arrive meanwhile: the gate asks again for every held call several times a second,
# and working out the groups in progress costs about a quarter of a millisecond at a hundred
# groups of eight, under the accumulator's lock. A call of an admitted or started group is never
# refused for it.
REFUSAL_STANDS_S = 0.1


class Pacing:
    """The admission budget, and the gate when pacing is on."""

    def __init__(self, config: Config, jobs: Jobs, signals: Signals | None = None) -> None:
        self.config = config
        self.jobs = jobs
        self._lock = threading.Lock()
        self._refused_until = float("-inf")  # (monotonic) see REFUSAL_STANDS_S
        # bumped by each event that may free the budget (a poll, rows): a refusal worked out from
        # the figures before one must not stand after it
        self._moves = 0
        self._job: str | None = None
        self._admission = self._new_admission()
        self._unknown_since: dict[str, float] = {}
        self.gate: Gate | None = None
        if config.pacing == "gate":
            assert config.proxy_url is not None  # Config refuses gate pacing without a proxy
            self.gate = Gate(
                host="127.0.0.1",
                port=config.gate_port or config.port + 1,
                upstream=config.proxy_url,
                may_start=self.may_start,
                running=self.running,
                seen=self.seen,
                answered=self.answered,
                on_hold=lambda: self.admission.holding(),
                on_version=lambda version: self.admission.saw_version(version),
                place=self.place,
            )
            if signals is not None:  # a crashed session shows in its last row: ask again then
                signals.on_rows(self.rows_read)

    def _new_admission(self) -> Admission:
        c = self.config
        return Admission(
            staleness=c.pacing_staleness,
            batch_groups=c.pacing_batch_groups,
            policy_staleness=c.policy.max_off_policy,
            idle_gap_s=c.pacing_idle_gap_s,
            spare_waste=c.pacing_spare_waste,
        )

    @property
    def admission(self) -> Admission:
        """The active job's admission (a new job starts a new one)."""
        job_state = self.jobs.current
        job = None if job_state is None else job_state.job_id
        with self._lock:
            if job != self._job:
                self._job = job
                self._admission = self._new_admission()
            return self._admission

    def start(self) -> None:
        if self.gate is not None:
            try:
                self.gate.start()
            except OSError as exc:  # the port is taken: say which setting chose it
                raise ConfigError(
                    f"the pacing gate cannot listen on 127.0.0.1:{self.gate.port} ({exc}); set "
                    "ROLLOUT_BUFFER_GATE_PORT to a free port (default: BUFFER_SERVER_PORT + 1)"
                ) from exc
            logger.info("pacing gate on 127.0.0.1:%d, forwarding to the LLM proxy", self.gate.port)

    def close(self) -> None:
        if self.gate is not None:
            self.gate.close()

    def took(self, groups: int, versions: list[int | None], began: float | None = None) -> None:
        """A poll that began at ``began`` (monotonic) served ``groups`` groups (of these weight
        versions): the trainer's demand (B is learned from it), and held first calls ask
        again."""
        self.admission.took(groups, versions, began=began)
        self._moves += 1
        self._refused_until = float("-inf")
        if self.gate is not None:
            self.gate.poke()

    def rows_read(self) -> None:
        """(The loop's thread.) Rows of the active job arrived: a session may have shown that it
        crashed (its last row, not terminal, and no next call), so held calls ask again now."""
        self._moves += 1
        self._refused_until = float("-inf")
        if self.gate is not None:
            self.gate.poke()

    def may_start(self, session_id: str) -> bool:
        """The gate asks at a session's first model call. No active job: never held."""
        job_state = self.jobs.current
        if job_state is None:
            return True
        job_state.accumulator.arrived(session_id)  # (once: a held call asks again and again)
        moves = self._moves
        admission = self.admission
        group, started = job_state.accumulator.group_of(session_id)
        if (
            time.monotonic() < self._refused_until
            and not started
            and group is not None
            and group not in admission.admitted
        ):
            return False  # the budget was spent a moment ago (REFUSAL_STANDS_S)
        # before the budget is worked out: a session not listed is not paced by it (and it is
        # asked at every round while it waits for the census)
        if (
            group is None and not job_state.census.no_schedule
        ):  # (a writer without the list: no wait)
            since = self._unknown_since.setdefault(session_id, time.monotonic())
            if time.monotonic() - since < UNKNOWN_SESSION_WAIT_S:
                return False  # the census reads job_environments at the next tick
            logger.warning(
                "session %r is not in job_environments: its calls are not paced", session_id
            )
        self._unknown_since.pop(session_id, None)
        admission.prune(
            job_state.accumulator.decided
        )  # decided groups are not in progress: asked as started
        # counted before this call marks its group started: a group never waits for itself
        progress = job_state.accumulator.progress(admission.admitted)
        see_ends(admission, job_state.accumulator)
        in_progress = sum(v for k, v in progress.items() if k != "stalled")
        version = job_state.accumulator.known_version
        if not admission.ask(group, in_progress, started=started, current_version=version):
            self._refused_until = time.monotonic() + REFUSAL_STANDS_S
            if moves != self._moves:  # a poll or rows came meanwhile: the budget may be free now
                self._refused_until = float("-inf")
            return False
        job_state.accumulator.first_call(session_id)  # through the gate: the session's first sign
        return True

    def place(self, session_id: str) -> int | None:
        """The session's place in job_environments (the launcher starts sessions in that order):
        held calls go in it."""
        job_state = self.jobs.current
        return None if job_state is None else job_state.accumulator.place_of(session_id)

    def seen(self, session_id: str) -> None:
        """A model call of the session went through the gate."""
        job_state = self.jobs.current
        if job_state is not None:
            job_state.accumulator.sign(session_id)

    def answered(self, session_id: str, retried: bool = False) -> None:
        """A model call of the session came back through the gate (``retried``: so that its
        client retries it after a backoff)."""
        job_state = self.jobs.current
        if job_state is not None:
            job_state.accumulator.answered(session_id, retried)

    def running(self, session_id: str) -> None:
        """A session seen mid-way (the service restarted under it): its group is admitted."""
        job_state = self.jobs.current
        if job_state is None:
            return
        group, _started = job_state.accumulator.group_of(session_id)
        self.admission.admit(group)
        job_state.accumulator.first_call(session_id, resumed=True)

    def report(self) -> dict[str, Any]:
        """``GET /admission``."""
        job_state = self.jobs.current
        admission = self.admission
        if job_state is None:
            progress = {"running": 0, "pending": 0, "ready": 0, "built": 0, "stalled": 0}
            version = None
        else:
            progress = job_state.accumulator.progress(admission.admitted)
            see_ends(admission, job_state.accumulator)
            version = job_state.accumulator.known_version
        doc = admission.report(progress, version)
        quiet = None if job_state is None else job_state.accumulator.dead_after()
        inputs = doc["inputs"]
        if isinstance(inputs, dict):  # how long a session stays quiet before it is taken for dead
            inputs["in_progress"]["session_dead_after_s"] = (
                None if quiet is None else round(quiet, 2)
            )
        doc["pacing"] = self.config.pacing
        doc["job_session"] = None if job_state is None else job_state.job_id
        gate = doc["gate"]
        if self.gate is not None and isinstance(gate, dict):
            gate.update(self.gate.stats())
        return doc


def see_ends(admission: Admission, accumulator: Accumulator) -> None:
    """Tell the budget how the job's groups ended (its completion rate, and the losses its spares
    are sized and used up by)."""
    rate, lost, lost_share = accumulator.ends()
    admission.completion_rate, admission.lost_groups, admission.lost_share = rate, lost, lost_share
