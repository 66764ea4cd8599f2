"""The simulated launcher's engine: plans the groups and sessions of a job and writes their rows
the way the real launcher does (see simulate.py for the command line and what is written).

It only INSERTs into the launcher's tables, in batches as the real launcher flushes them,
retrying a write that fails on a locked or lost database, and stops cleanly on SIGTERM/SIGINT
between two rows (flushing what it holds first).

Owns: planning a job's groups and sessions, pacing and retrying writes, and the run's summary. It
must not UPDATE or DELETE a row, nor read the buffer's tables.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
import uuid
from collections import deque
from datetime import datetime, timezone
from typing import Any

from rollout_buffer.core.errors import IntegrityError, StorageError
from rollout_buffer.storage import db as dbmod
from rollout_buffer.storage import launcher_tables
from rollout_buffer.tools.llm_calls import ModelCalls
from rollout_buffer.tools.session_pool import SessionPool, Stop
from rollout_buffer.tools.workload import (
    CAPPED,
    DONE,
    FAILED,
    LENGTH,
    LLM_MODEL,
    SYSTEM_PROMPTS,
    Group,
    Session,
    Text,
)

WRITE_ATTEMPTS = 6  # tries per write on StorageError (database locked, connection lost)
SLEEP_SLICE_S = 0.05  # granularity of the --pace sleep, so SIGTERM is seen promptly


class Simulator:
    def __init__(self, args: argparse.Namespace, url: str) -> None:
        self.args = args
        self.url = url
        self.rng = random.Random(args.seed)
        self.text = Text(self.rng)
        self.db: dbmod.Database | None = None
        self.stop_signal: int | None = None
        self.rows = 0
        self.trainable_rows = 0
        self.completed_sessions = 0
        self.failed_sessions = 0
        self.truncated_sessions = 0
        self.capped_sessions = 0
        self.sessions_started = 0
        self.batch: list[tuple[Any, ...]] = []  # rows written but not flushed yet
        self.flushes = 0
        self.last_flush = time.monotonic()
        self.max_weight_version: int | None = None
        self.model: ModelCalls | None = None  # --llm-calls: a model call before each step
        self.model_failed = 0
        self.lock = threading.Lock()  # the rows held and the counters, shared with session threads
        self.groups: list[Group] = []
        self.t0 = time.monotonic()
        self.last_progress = self.t0

    # -- signals ----------------------------------------------------------------------------
    def on_signal(self, signum: int, _frame: Any) -> None:
        self.stop_signal = signum

    def check_stop(self) -> None:
        if self.stop_signal is not None:
            raise Stop()

    def pause(self, seconds: float) -> None:
        """Sleep, waking every SLEEP_SLICE_S to notice a signal."""
        end = time.monotonic() + seconds
        while True:
            self.check_stop()
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(left, SLEEP_SLICE_S))

    # -- database ---------------------------------------------------------------------------
    def connect(self) -> dbmod.Database:
        if self.db is None:
            self.db = dbmod.connect(self.url)
        return self.db

    def reset_connection(self) -> None:
        if self.db is not None:
            self.db.close()
            self.db = None

    def write(self, fn: Any, what: str) -> None:
        """Run ``fn(db)`` with retries on StorageError (locked database, lost connection)."""
        delay = 0.05
        for attempt in range(1, WRITE_ATTEMPTS + 1):
            try:
                fn(self.connect())
                return
            except IntegrityError:
                raise
            except StorageError as exc:
                if exc.about_data or attempt == WRITE_ATTEMPTS:  # a value refused is refused again
                    raise
                print(
                    f"simulate: {what} failed (attempt {attempt}/{WRITE_ATTEMPTS}), retrying in "
                    f"{delay:.2f}s: {exc}",
                    file=sys.stderr,
                    flush=True,
                )
                if self.db is not None and self.db.broken:
                    self.reset_connection()
                time.sleep(delay)
                delay = min(delay * 2, 1.0)

    def tables_exist(self, db: dbmod.Database) -> bool:
        return launcher_tables.tables_exist(db)

    def ensure_tables(self) -> None:
        db = self.connect()
        if self.tables_exist(db):
            return

        def failed(exc: StorageError) -> None:  # another creator raced us: fine if the tables exist
            print(f"simulate: creating launcher tables: {exc}", file=sys.stderr, flush=True)

        launcher_tables.create_launcher_tables(db, failed)
        if not self.tables_exist(db):
            time.sleep(0.2)
            if not self.tables_exist(db):
                raise StorageError(
                    f"launcher tables are missing in {db.safe_url} and could not be created"
                )

    def now(self) -> Any:
        now = datetime.now(timezone.utc)
        if self.connect().backend == "sqlite":
            return now.strftime("%Y-%m-%d %H:%M:%S.%f+00:00")
        return now

    # -- planning ---------------------------------------------------------------------------
    def plan(self) -> None:
        a, rng = self.args, self.rng
        offset = max(a.rl_epoch - 1, 0) * a.groups
        for g in range(a.groups):
            gr = Group(g, offset + g)
            gr.task = f"Task {gr.task_idx}: " + self.text.words(a.prompt_bytes - 20)
            rewards: set[float] = set()
            while len(rewards) < a.rl_group_size and len(rewards) < 10000:
                rewards.add(round(rng.random(), 4))  # distinct terminal rewards within the group
            reward_list = sorted(rewards)
            rng.shuffle(reward_list)
            if rng.random() < getattr(a, "flat_rate", 0.0):
                reward_list = reward_list[
                    :1
                ]  # every session of the group ends with the same reward
            for k in range(a.rl_group_size):
                s = Session(gr, str(uuid.uuid4()))
                s.terminal_reward = reward_list[k % len(reward_list)]
                self.plan_ending(s)
                gr.sessions.append(s)
            self.groups.append(gr)

    def plan_ending(self, s: Session) -> None:
        """How the session ends and after how many rows (SPEC §2)."""
        a, rng = self.args, self.rng
        draw = rng.random()
        if draw < a.fail_rate:
            s.ending = FAILED  # aborted after 0..max_steps-1 rows
            s.rows_planned = rng.randint(0, a.max_steps - 1)
        elif draw < a.fail_rate + a.cap_rate:
            s.ending = CAPPED  # every step runs, the environment never ends it
            s.rows_planned = a.max_steps
        elif draw < a.fail_rate + a.cap_rate + a.truncate_rate:
            s.ending = LENGTH  # an answer cut by the length limit ends it at any step
            s.rows_planned = rng.randint(1, a.max_steps)
        else:
            s.ending = DONE
            s.rows_planned = rng.randint(min(a.min_steps, a.max_steps), a.max_steps)

    def write_environments(self) -> None:
        a = self.args
        created = self.now()
        rows = []
        for gr in self.groups:
            params = json.dumps(
                {
                    "task_idx": gr.task_idx,
                    "env_num": a.rl_group_size,
                    "max_steps": a.max_steps,
                    "split": "train",
                    "simulated": True,
                }
            )
            for s in gr.sessions:
                rows.append(
                    (
                        a.job_id,
                        s.session_id,
                        gr.env_name,
                        params,
                        f"aievobox/{gr.env_name}:latest",
                        gr.group_id,
                        0,
                        0,
                        created,
                    )
                )

        def insert(db: dbmod.Database) -> None:
            launcher_tables.insert_sessions(db, rows)

        self.write(insert, "inserting job_environments")

    # -- running ----------------------------------------------------------------------------
    def start(self, s: Session) -> None:
        self.sessions_started += 1
        gr = s.group
        s.history = [
            {"role": "system", "content": SYSTEM_PROMPTS[gr.env_name]},
            {"role": "user", "content": gr.task},
        ]

    def finish(self, s: Session) -> None:
        if s.completes:
            self.completed_sessions += 1
            s.group.completed += 1
            if s.ending == LENGTH:
                self.truncated_sessions += 1
        elif s.ending == CAPPED:
            self.capped_sessions += 1
        else:
            self.failed_sessions += 1
        s.history = []

    def weight_version(self) -> int | None:
        """The version the LLM proxy would stamp on an answer now: it advances every
        ``--weight-version-interval`` seconds, as a trainer's would; None when that is 0 (a proxy
        that reports no version: env_state is NULL)."""
        every = self.args.weight_version_interval
        if every <= 0:
            return None
        return int((time.monotonic() - self.t0) / every)

    def prompt(self, s: Session) -> list[dict[str, str]]:
        """The prompt the model saw: the whole history, or with ``--message-cut N`` > 0 the system
        message and the last 2N-1 messages."""
        cut = self.args.message_cut
        if cut <= 0:
            return list(s.history)
        return [s.history[0], *s.history[1:][-(2 * cut - 1) :]]

    def write_step(self, s: Session, answered: int | bool | None = False) -> None:
        """Hold the session's next row for the next flush. ``answered``: the version the model's
        answer carried (with model calls), else the simulated one is used."""
        a, rng, gr = self.args, self.rng, s.group
        s.step += 1
        last = s.step == s.rows_planned
        terminal = last and s.completes
        truncated = terminal and s.ending == LENGTH
        response = (
            f"Thought: step {s.step}. "
            + self.text.words(rng.uniform(40, 160))
            + ("" if truncated else f"\nAction: act_{s.step}")
        )
        if terminal:
            step_reward = 0.0 if truncated else s.terminal_reward
        else:
            step_reward = 0.0 if rng.random() < 0.85 else round(rng.uniform(0.0, 0.05), 4)
        cum = s.cum_reward + step_reward
        version = self.weight_version() if answered is False else answered
        if isinstance(version, bool):
            version = None
        if version is not None:
            self.max_weight_version = version
        trainable = terminal or a.message_cut > 0
        flag = 1 if terminal else 0
        self.batch.append(
            (
                s.session_id,
                s.step,
                gr.env_name,
                LLM_MODEL,
                gr.group_id,
                a.job_id,
                json.dumps(self.prompt(s), ensure_ascii=False),
                response,
                step_reward,
                cum,
                None if version is None else json.dumps({"weight_version": version}),
                flag,
                1 if truncated else 0,
                flag,
                1 if trainable else 0,
            )
        )
        s.cum_reward = cum
        self.rows += 1
        self.trainable_rows += 1 if trainable else 0
        s.history.append({"role": "assistant", "content": response})
        s.history.append(
            {"role": "user", "content": "Observation: " + self.text.words(rng.uniform(40, 200))}
        )

    def maybe_flush(self) -> None:
        """Flush when --flush-rows rows are held or --flush-interval has passed (on a timer, as
        the real launcher: rows are written while every running session waits for the model)."""
        a = self.args
        if (
            len(self.batch) >= a.flush_rows
            or time.monotonic() - self.last_flush >= a.flush_interval
        ):
            self.flush()

    def flush(self) -> None:
        """Write the rows held so far in one transaction, stamped with the flush time (the real
        launcher flushes up to 100 rows, or every 5 s)."""
        with self.lock:  # workers add rows while the main thread flushes
            self.last_flush = time.monotonic()
            batch, self.batch = self.batch, []
        if not batch:
            return

        def insert(db: dbmod.Database) -> None:
            # a fresh timestamp per attempt: (session_id, step_id, created_at) is unique
            created = self.now()
            launcher_tables.insert_steps(db, [(*row, created) for row in batch])

        self.write(insert, f"flushing {len(batch)} rows")
        self.flushes += 1

    def progress(self, force: bool = False) -> None:
        if self.args.quiet:
            return
        now = time.monotonic()
        if not force and now - self.last_progress < 2.0:
            return
        self.last_progress = now
        print(self.progress_line(self.rows / max(now - self.t0, 1e-9)), flush=True)

    def progress_line(self, rate: float) -> str:
        """The text of a progress line (``rate`` in rows/s)."""
        total = len(self.groups) * self.args.rl_group_size
        done = self.completed_sessions + self.capped_sessions + self.failed_sessions
        return (
            f"simulate: job {self.args.job_id}: {self.rows} rows, sessions {done}/{total} done "
            f"({self.completed_sessions} completed, {self.capped_sessions} at the step cap, "
            f"{self.failed_sessions} failed), {rate:.0f} rows/s, "
            f"weight_version {self.max_weight_version}"
        )

    def run(self) -> None:
        a = self.args
        self.check_stop()
        self.ensure_tables()
        self.check_stop()
        self.plan()
        self.write_environments()
        if not a.quiet:
            print(
                f"simulate: job {a.job_id}: {a.groups} groups x K={a.rl_group_size}, max "
                f"{a.max_steps} steps, message-cut {a.message_cut}, pool {a.pool_size}, pace "
                f"{a.pace}s -> {self.connect().safe_url}",
                flush=True,
            )
        if a.llm_calls and a.llm_base_url:
            self.model = ModelCalls(a.llm_base_url, a.llm_model, self.pause)
        pool = SessionPool(self, deque(s for gr in self.groups for s in gr.sessions))
        try:
            if self.model is None:
                pool.run_serial()
            else:
                pool.run_workers()
        finally:
            # a stop between two rows still writes what was held: never a row lost in memory
            self.flush()

    def fail(self, s: Session) -> None:
        """A model call answered a 4xx: the session fails for good (no terminal row)."""
        self.model_failed += 1
        s.ending = FAILED
        self.finish(s)

    def summary(self, interrupted: bool) -> dict[str, Any]:
        a = self.args
        elapsed = time.monotonic() - self.t0
        return {
            "job_id": a.job_id,
            "groups": len(self.groups),
            "k": a.rl_group_size,
            "sessions": len(self.groups) * a.rl_group_size,
            "sessions_started": self.sessions_started,
            "rows": self.rows,
            "completed_sessions": self.completed_sessions,
            "failed_sessions": self.failed_sessions,
            "truncated_sessions": self.truncated_sessions,
            "capped_sessions": self.capped_sessions,
            "trainable_rows": self.trainable_rows,
            "flushes": self.flushes,
            "model_calls_failed": self.model_failed,
            "model_call_retries": 0 if self.model is None else self.model.retries,
            "message_cut": a.message_cut,
            "max_steps": a.max_steps,
            "complete_groups": sum(1 for gr in self.groups if gr.completed == a.rl_group_size),
            # groups one of whose sessions wrote no row at all (it failed at once): salvage
            # (ROLLOUT_BUFFER_SALVAGE) cannot keep them
            "groups_with_silent_session": sum(
                1 for gr in self.groups if any(s.step == 0 for s in gr.sessions)
            ),
            "max_weight_version": self.max_weight_version,
            "rl_epoch": a.rl_epoch,
            "seed": a.seed,
            "interrupted": interrupted,
            "elapsed_s": round(elapsed, 3),
            "rows_per_s": round(self.rows / max(elapsed, 1e-9), 1),
        }
