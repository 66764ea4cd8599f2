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
        args, rng = self.args, self.rng
        offset = max(args.rl_epoch - 1, 0) * args.groups
        for index in range(args.groups):
            group = Group(index, offset + index)
            group.task = f"Task {group.task_idx}: " + self.text.words(args.prompt_bytes - 20)
            rewards: set[float] = set()
            while len(rewards) < args.rl_group_size and len(rewards) < 10000:
                rewards.add(round(rng.random(), 4))  # distinct terminal rewards within the group
            reward_list = sorted(rewards)
            rng.shuffle(reward_list)
            if rng.random() < getattr(args, "flat_rate", 0.0):
                # every session of the group ends with the same reward
                reward_list = reward_list[:1]
            for k in range(args.rl_group_size):
                session = Session(group, str(uuid.uuid4()))
                session.terminal_reward = reward_list[k % len(reward_list)]
                natural = rng.randint(1, args.max_steps)
                if rng.random() < args.fail_rate:
                    session.completes = False
                    session.rows_planned = rng.randint(0, natural - 1)
                elif rng.random() < args.truncate_rate:
                    session.truncated = True
                    session.rows_planned = args.max_steps
                else:
                    session.rows_planned = natural
                group.sessions.append(session)
            self.groups.append(group)

    def write_environments(self) -> None:
        args = self.args
        created = self.now()
        rows = []
        for group in self.groups:
            params = json.dumps(
                {
                    "task_idx": group.task_idx,
                    "env_num": args.rl_group_size,
                    "max_steps": args.max_steps,
                    "split": "train",
                    "simulated": True,
                }
            )
            for session in group.sessions:
                rows.append(
                    (
                        args.job_id,
                        session.session_id,
                        group.env_name,
                        params,
                        f"aievobox/{group.env_name}:latest",
                        group.group_id,
                        0,
                        0,
                        created,
                    )
                )

        def insert(db: dbmod.Database) -> None:
            launcher_writes.insert_sessions(db, rows)

        self.write(insert, "inserting job_environments")

    # -- running ----------------------------------------------------------------------------
    def start(self, session: Session) -> None:
        self.sessions_started += 1
        group = session.group
        session.history = [
            {"role": "system", "content": SYSTEM_PROMPTS[group.env_name]},
            {"role": "user", "content": group.task},
        ]

    def finish(self, session: Session) -> None:
        if session.completes:
            self.completed_sessions += 1
            session.group.completed += 1
            if session.truncated:
                self.truncated_sessions += 1
        else:
            self.failed_sessions += 1
        session.history = []

    def write_step(self, session: Session) -> None:
        args, rng, group = self.args, self.rng, session.group
        session.step += 1
        last = session.step == session.rows_planned and session.completes
        response = (
            f"Thought: step {session.step}. "
            + self.text.words(rng.uniform(40, 160))
            + f"\nAction: act_{session.step}"
        )
        if last:
            step_reward = session.terminal_reward
        else:
            step_reward = 0.0 if rng.random() < 0.85 else round(rng.uniform(0.0, 0.05), 4)
        cumulative = session.cum_reward + step_reward
        env_state = json.dumps({"weight_version": self.rows // WEIGHT_VERSION_EVERY})
        messages = json.dumps(session.history, ensure_ascii=False)
        flag = 1 if last else 0

        def insert(db: dbmod.Database) -> None:
            # a fresh timestamp per attempt: (session_id, step_id, created_at) is unique
            row = (
                session.session_id,
                session.step,
                group.env_name,
                LLM_MODEL,
                group.group_id,
                args.job_id,
                messages,
                response,
                step_reward,
                cumulative,
                env_state,
                flag,
                1 if (last and session.truncated) else 0,
                flag,
                1,
                self.now(),
            )
            launcher_writes.insert_step(db, row)

        self.write(insert, f"inserting step {session.step} of session {session.session_id}")
        session.cum_reward = cumulative
        self.rows += 1
        session.history.append({"role": "assistant", "content": response})
        session.history.append(
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
        args, rng = self.args, self.rng
        self.check_stop()
        self.ensure_tables()
        self.check_stop()
        self.plan()
        self.write_environments()
        if not args.quiet:
            print(
                f"simulate: job {args.job_id}: {args.groups} groups x K={args.rl_group_size}, "
                f"max {args.max_steps} steps, pool {args.pool_size}, pace {args.pace}s -> "
                f"{self.connect().safe_url}",
                flush=True,
            )
        queue = deque(session for group in self.groups for session in group.sessions)
        active: list[Session] = []

        def fill() -> None:
            while queue and len(active) < args.pool_size:
                session = queue.popleft()
                self.start(session)
                if session.rows_planned == 0:  # crashed before its first step
                    self.finish(session)
                else:
                    active.append(session)

        fill()
        first = True
        while active:
            self.check_stop()
            if args.pace > 0 and not first:
                self.pause(args.pace)
            first = False
            pick = rng.randrange(len(active))
            session = active[pick]
            self.write_step(session)
            if session.step >= session.rows_planned:
                active[pick] = active[-1]
                active.pop()
                self.finish(session)
                fill()
            self.progress()

    def summary(self, interrupted: bool) -> dict[str, Any]:
        args = self.args
        elapsed = time.monotonic() - self.t0
        return {
            "job_id": args.job_id,
            "groups": len(self.groups),
            "k": args.rl_group_size,
            "sessions": len(self.groups) * args.rl_group_size,
            "sessions_started": self.sessions_started,
            "rows": self.rows,
            "completed_sessions": self.completed_sessions,
            "failed_sessions": self.failed_sessions,
            "truncated_sessions": self.truncated_sessions,
            "complete_groups": sum(
                1 for group in self.groups if group.completed == args.rl_group_size
            ),
            "max_weight_version": max(self.rows - 1, 0) // WEIGHT_VERSION_EVERY,
            "rl_epoch": args.rl_epoch,
            "seed": args.seed,
            "interrupted": interrupted,
            "elapsed_s": round(elapsed, 3),
            "rows_per_s": round(self.rows / max(elapsed, 1e-9), 1),
        }
