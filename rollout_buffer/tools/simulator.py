"""The simulated launcher's engine: plans the groups and sessions of a job and writes their rows
the way the real launcher does (see simulate.py for the command line and what is written).

It only INSERTs into the launcher's tables, retrying a write that fails on a locked or lost
database, and stops cleanly on SIGTERM/SIGINT between two rows.

Owns: planning a job's groups and sessions, pacing and retrying writes, and the run's summary. It
must not UPDATE or DELETE a row, nor read the buffer's tables.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import uuid
from collections import deque
from datetime import datetime, timezone
from typing import Any

from rollout_buffer.core.errors import IntegrityError, StorageError
from rollout_buffer.storage import db as dbmod
from rollout_buffer.storage import launcher_writes
from rollout_buffer.tools.workload import LLM_MODEL, SYSTEM_PROMPTS, Group, Session, Text

WEIGHT_VERSION_EVERY = 50  # weight_version = rows written // this
WRITE_ATTEMPTS = 6  # tries per write on StorageError (database locked, connection lost)
SLEEP_SLICE_S = 0.05  # granularity of the --pace sleep, so SIGTERM is seen promptly


class Stop(Exception):
    """A termination signal arrived."""


class Simulator:
    def __init__(self, args: argparse.Namespace, url: str) -> None:
        self.args = args
        self.url = url
        self.rng = random.Random(args.seed)
        self.text = Text(self.rng)
        self.db: dbmod.Database | None = None
        self.stop_signal: int | None = None
        self.rows = 0
        self.completed_sessions = 0
        self.failed_sessions = 0
        self.truncated_sessions = 0
        self.sessions_started = 0
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
        return launcher_writes.tables_exist(db)

    def ensure_tables(self) -> None:
        db = self.connect()
        if self.tables_exist(db):
            return

        def failed(exc: StorageError) -> None:  # another creator raced us: fine if the tables exist
            print(f"simulate: creating launcher tables: {exc}", file=sys.stderr, flush=True)

        launcher_writes.create_tables(db, failed)
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
                natural = rng.randint(1, a.max_steps)
                if rng.random() < a.fail_rate:
                    s.completes = False
                    s.rows_planned = rng.randint(0, natural - 1)
                elif rng.random() < a.truncate_rate:
                    s.truncated = True
                    s.rows_planned = a.max_steps
                else:
                    s.rows_planned = natural
                gr.sessions.append(s)
            self.groups.append(gr)

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
            launcher_writes.insert_sessions(db, rows)

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
            if s.truncated:
                self.truncated_sessions += 1
        else:
            self.failed_sessions += 1
        s.history = []

    def write_step(self, s: Session) -> None:
        a, rng, gr = self.args, self.rng, s.group
        s.step += 1
        last = s.step == s.rows_planned and s.completes
        response = (
            f"Thought: step {s.step}. "
            + self.text.words(rng.uniform(40, 160))
            + f"\nAction: act_{s.step}"
        )
        if last:
            step_reward = s.terminal_reward
        else:
            step_reward = 0.0 if rng.random() < 0.85 else round(rng.uniform(0.0, 0.05), 4)
        cum = s.cum_reward + step_reward
        env_state = json.dumps({"weight_version": self.rows // WEIGHT_VERSION_EVERY})
        messages = json.dumps(s.history, ensure_ascii=False)
        flag = 1 if last else 0

        def insert(db: dbmod.Database) -> None:
            # a fresh timestamp per attempt: (session_id, step_id, created_at) is unique
            row = (
                s.session_id,
                s.step,
                gr.env_name,
                LLM_MODEL,
                gr.group_id,
                a.job_id,
                messages,
                response,
                step_reward,
                cum,
                env_state,
                flag,
                1 if (last and s.truncated) else 0,
                flag,
                1,
                self.now(),
            )
            launcher_writes.insert_step(db, row)

        self.write(insert, f"inserting step {s.step} of session {s.session_id}")
        s.cum_reward = cum
        self.rows += 1
        s.history.append({"role": "assistant", "content": response})
        s.history.append(
            {"role": "user", "content": "Observation: " + self.text.words(rng.uniform(40, 200))}
        )

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
        done = self.completed_sessions + self.failed_sessions
        return (
            f"simulate: job {self.args.job_id}: {self.rows} rows, sessions {done}/{total} done "
            f"({self.completed_sessions} completed, {self.failed_sessions} failed), "
            f"{rate:.0f} rows/s, weight_version {self.rows // WEIGHT_VERSION_EVERY}"
        )

    def run(self) -> None:
        a, rng = self.args, self.rng
        self.check_stop()
        self.ensure_tables()
        self.check_stop()
        self.plan()
        self.write_environments()
        if not a.quiet:
            print(
                f"simulate: job {a.job_id}: {a.groups} groups x K={a.rl_group_size}, "
                f"max {a.max_steps} steps, pool {a.pool_size}, pace {a.pace}s -> "
                f"{self.connect().safe_url}",
                flush=True,
            )
        queue = deque(s for gr in self.groups for s in gr.sessions)
        active: list[Session] = []

        def fill() -> None:
            while queue and len(active) < a.pool_size:
                s = queue.popleft()
                self.start(s)
                if s.rows_planned == 0:  # crashed before its first step
                    self.finish(s)
                else:
                    active.append(s)

        fill()
        first = True
        while active:
            self.check_stop()
            if a.pace > 0 and not first:
                self.pause(a.pace)
            first = False
            j = rng.randrange(len(active))
            s = active[j]
            self.write_step(s)
            if s.step >= s.rows_planned:
                active[j] = active[-1]
                active.pop()
                self.finish(s)
                fill()
            self.progress()

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
            "complete_groups": sum(1 for gr in self.groups if gr.completed == a.rl_group_size),
            "max_weight_version": max(self.rows - 1, 0) // WEIGHT_VERSION_EVERY,
            "rl_epoch": a.rl_epoch,
            "seed": a.seed,
            "interrupted": interrupted,
            "elapsed_s": round(elapsed, 3),
            "rows_per_s": round(self.rows / max(elapsed, 1e-9), 1),
        }
