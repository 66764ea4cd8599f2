"""A simulated AIEvoBox launcher: writes ``session_steps`` / ``job_environments`` rows as the real one does.

Run it as ``python -m rollout_buffer.simulate --db-path URL --job-id JOB [options]``. The buffer
service starts it in place of the real launcher when no ``AIEVOBOX_ROOT`` is configured, so it
accepts the original launcher's command line: the flags that matter here are read, every other
one (``--mode``, ``--llm-base-url``, ``--no-rebuild-table``, ...) is accepted and ignored.

What it writes (SPEC §1-§2), INSERT only, never UPDATE or DELETE:

* ``--groups`` prompt groups of ``--rl-group-size`` (K) sessions each. ``group_id`` is
  ``uuid5(NAMESPACE_OID, f"{env_name}:{task_idx}")`` with ``task_idx = g + (rl_epoch - 1) * groups``:
  unique within a job, the same across jobs of one epoch, as the launcher derives it.
* One ``job_environments`` row per scheduled session (``env_id`` = ``session_id``, a uuid4),
  all written at start.
* A pool of ``--pool-size`` running sessions takes sessions in group order; each row goes to a
  randomly chosen running session, so rows of different sessions and groups interleave.
* One ``session_steps`` row per step, each its own (autocommitted) transaction: ``messages`` is
  the prompt history without this step's answer ([system, user(task)], then alternating
  assistant/user turns), ``response`` this step's answer, ``reward`` the running sum of
  ``step_reward`` (0 or a small shaping reward, and the session's terminal reward on its last
  row), ``env_state`` ``{"weight_version": rows_written // 50}``.
* A session that completes writes ``is_terminal = is_session_completed = 1`` on its last row
  only. ``--truncate-rate`` of the sessions run to the ``--max-steps`` cap and end truncated
  (``is_truncated = 1`` on that last row); ``--fail-rate`` of them crash after 0..n-1 rows and
  never write a completed row (they are not retried, as with the real launcher).
* ``created_at`` is tz-aware: ISO text ``2026-12-02 13:35:10.889937+00:00`` on SQLite, a
  ``datetime`` with UTC tzinfo on Postgres (TIMESTAMPTZ).

The launcher's tables are created if missing (the real launcher runs with ``--no-rebuild-table``,
but a default setup starts from an empty database); a concurrent creator is tolerated.

Output: progress lines on stdout unless ``--quiet``, then always a last line
``SIMULATE {json}`` (groups, k, sessions, rows, completed_sessions, failed_sessions,
truncated_sessions, complete_groups = groups whose K sessions all completed, interrupted, ...).

Exit status: 0 when every session ran; 143 after SIGTERM (130 after SIGINT): the simulator
finishes the row it is writing (never a half-written session row), stops at once (a ``--pace``
sleep is interrupted), prints the summary with ``"interrupted": true`` and exits. 1 when the
database cannot be written (after retries), 2 for bad arguments.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
import uuid
from collections import deque
from datetime import datetime, timezone
from typing import Any, Sequence

from . import db as dbmod
from .errors import IntegrityError, RolloutBufferError, StorageError
from .queries import INSERT_ENV, INSERT_STEP, LAUNCHER_DDL
from .workload import LLM_MODEL, SYSTEM_PROMPTS, Group, Session, Text

WEIGHT_VERSION_EVERY = 50      # weight_version = rows written // this
WRITE_ATTEMPTS = 6             # tries per write on StorageError (database locked, connection lost)
SLEEP_SLICE_S = 0.05           # granularity of the --pace sleep, so SIGTERM is seen promptly



def _bounded(kind: type, lo: float, hi: float | None = None) -> Any:
    """An argparse type: a number of ``kind`` within [lo, hi]."""
    def parse(text: str) -> Any:
        value = kind(text)
        if not (value >= lo and (hi is None or value <= hi)):
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'} "
                                             f">= {lo:g}{'' if hi is None else f' and <= {hi:g}'}, got {text!r}")
        return value
    return parse


_nonneg_int, _pos_int = _bounded(int, 0), _bounded(int, 1)
_rate, _nonneg_float = _bounded(float, 0.0, 1.0), _bounded(float, 0.0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m rollout_buffer.simulate",
        description="Simulated AIEvoBox launcher: writes launcher rows (one per step) into "
                    "session_steps and job_environments. Unknown launcher flags are ignored.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False)  # an unknown launcher flag must never be taken for a prefix of ours
    g = p.add_argument_group("the original launcher's flags")
    g.add_argument("--db-path", required=True,
                   help="database URL: sqlite:///abs/path, sqlite://rel/path or postgresql://... "
                        "(a bare file path is taken as SQLite)")
    g.add_argument("--storage-type", choices=("sqlite", "postgres", "postgresql"), default=None,
                   help="backend; must agree with --db-path (the URL decides)")
    g.add_argument("--job-id", required=True, help="job_id of every row")
    g.add_argument("--rl-group-size", type=_pos_int, default=8, help="sessions per group (K)")
    g.add_argument("--max-steps", type=_pos_int, default=6,
                   help="step cap: sessions have 1..max-steps steps (random per session)")
    g.add_argument("--pool-size", type=_pos_int, default=16, help="concurrently running sessions")
    g.add_argument("--rl-epoch", type=int, default=1,
                   help="epoch: shifts the task index (and so the group ids) by (epoch-1)*groups")
    s = p.add_argument_group("simulator knobs")
    s.add_argument("--groups", type=_pos_int, default=32, help="prompt groups G")
    s.add_argument("--fail-rate", type=_rate, default=0.05,
                   help="fraction of sessions that crash after 0..n-1 rows, never completing")
    s.add_argument("--truncate-rate", type=_rate, default=0.1,
                   help="fraction of sessions that hit the step cap and end truncated")
    s.add_argument("--pace", type=_nonneg_float, default=0.02,
                   help="seconds to sleep between rows (0 = as fast as possible)")
    s.add_argument("--prompt-bytes", type=_pos_int, default=600,
                   help="approximate size of the first user prompt")
    s.add_argument("--seed", type=int, default=None,
                   help="random seed for the run's shape (session ids are always fresh uuid4s)")
    s.add_argument("--quiet", action="store_true", help="print only the final SIMULATE line")
    s.add_argument("--from-export", metavar="FILE", default=None,
                   help="write the records of a `rollout-buffer export` file (JSONL, .gz or plain) back as this "
                        "job's rows, at --pace, instead of simulating (see rollout_buffer.from_export)")
    return p


def normalise_url(db_path: str, storage_type: str | None) -> str:
    """The database URL; a bare path becomes ``sqlite:///abs/path``."""
    if db_path.startswith(("sqlite://", "postgresql://", "postgres://")):
        kind = "sqlite" if db_path.startswith("sqlite://") else "postgres"
        if storage_type and storage_type.replace("postgresql", "postgres") != kind:
            print(f"simulate: warning: --storage-type {storage_type} disagrees with --db-path "
                  f"({kind}); using {kind}", file=sys.stderr, flush=True)  # never the URL: it may hold a password
        return db_path
    if storage_type in ("postgres", "postgresql"):
        raise SystemExit(f"simulate: --db-path {dbmod.redact(db_path)!r} is not a postgresql:// URL "
                         "but --storage-type is postgres")
    return "sqlite://" + os.path.abspath(db_path)


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
                if attempt == WRITE_ATTEMPTS:
                    raise
                print(f"simulate: {what} failed (attempt {attempt}/{WRITE_ATTEMPTS}), retrying in "
                      f"{delay:.2f}s: {exc}", file=sys.stderr, flush=True)
                if self.db is not None and self.db.backend == "postgres" and getattr(self.db, "broken", False):
                    self.reset_connection()
                time.sleep(delay)
                delay = min(delay * 2, 1.0)

    def tables_exist(self, db: dbmod.Database) -> bool:
        try:
            db.rows("SELECT 1 FROM session_steps WHERE 1 = 0")
            db.rows("SELECT 1 FROM job_environments WHERE 1 = 0")
            return True
        except StorageError:
            return False

    def ensure_tables(self) -> None:
        db = self.connect()
        if self.tables_exist(db):
            return
        for stmt in LAUNCHER_DDL[db.backend]:
            try:
                db.execute(stmt)
            except StorageError as exc:  # another creator raced us: fine if the tables exist now
                print(f"simulate: creating launcher tables: {exc}", file=sys.stderr, flush=True)
        if not self.tables_exist(db):
            time.sleep(0.2)
            if not self.tables_exist(db):
                raise StorageError(f"launcher tables are missing in {db.safe_url} and could not be created")

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
            params = json.dumps({"task_idx": gr.task_idx, "env_num": a.rl_group_size,
                                 "max_steps": a.max_steps, "split": "train", "simulated": True})
            for s in gr.sessions:
                rows.append((a.job_id, s.session_id, gr.env_name, params,
                             f"aievobox/{gr.env_name}:latest", gr.group_id, 0, 0, created))

        def insert(db: dbmod.Database) -> None:
            with db.transaction():
                db.executemany(INSERT_ENV, rows)
        self.write(insert, "inserting job_environments")

    # -- running ----------------------------------------------------------------------------
    def start(self, s: Session) -> None:
        self.sessions_started += 1
        gr = s.group
        s.history = [{"role": "system", "content": SYSTEM_PROMPTS[gr.env_name]},
                     {"role": "user", "content": gr.task}]

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
        response = (f"Thought: step {s.step}. " + self.text.words(rng.uniform(40, 160))
                    + f"\nAction: act_{s.step}")
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
            row = (s.session_id, s.step, gr.env_name, LLM_MODEL, gr.group_id, a.job_id, messages,
                   response, step_reward, cum, env_state, flag, 1 if (last and s.truncated) else 0,
                   flag, 1, self.now())
            db.execute(INSERT_STEP, row)
        self.write(insert, f"inserting step {s.step} of session {s.session_id}")
        s.cum_reward = cum
        self.rows += 1
        s.history.append({"role": "assistant", "content": response})
        s.history.append({"role": "user", "content": "Observation: " + self.text.words(rng.uniform(40, 200))})

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
        return (f"simulate: job {self.args.job_id}: {self.rows} rows, sessions {done}/{total} done "
                f"({self.completed_sessions} completed, {self.failed_sessions} failed), "
                f"{rate:.0f} rows/s, weight_version {self.rows // WEIGHT_VERSION_EVERY}")

    def run(self) -> None:
        a, rng = self.args, self.rng
        self.check_stop()
        self.ensure_tables()
        self.check_stop()
        self.plan()
        self.write_environments()
        if not a.quiet:
            print(f"simulate: job {a.job_id}: {a.groups} groups x K={a.rl_group_size}, max {a.max_steps} "
                  f"steps, pool {a.pool_size}, pace {a.pace}s -> {self.connect().safe_url}",
                  flush=True)
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    try:
        url = normalise_url(args.db_path, args.storage_type)
    except SystemExit as exc:
        print(exc, file=sys.stderr, flush=True)
        return 2
    if args.from_export is not None:
        from .from_export import ExportReplayer  # it builds on Simulator: imported here, not at the top

        sim: Simulator = ExportReplayer(args, url)
    else:
        sim = Simulator(args, url)
    previous = {sig: signal.signal(sig, sim.on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    if unknown and not args.quiet:
        print(f"simulate: ignoring launcher arguments {unknown}", flush=True)
    code = 0
    interrupted = False
    try:
        sim.run()
    except Stop:
        interrupted = True
        code = 128 + int(sim.stop_signal or signal.SIGTERM)
        if not args.quiet:
            print(f"simulate: stopping on signal {sim.stop_signal}", flush=True)
    except RolloutBufferError as exc:
        print(f"simulate: error: {exc}", file=sys.stderr, flush=True)
        code = 1
    except OSError as exc:  # --from-export FILE cannot be read
        print(f"simulate: error: {exc}", file=sys.stderr, flush=True)
        code = 2
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sim.reset_connection()
    if code != 1:
        sim.progress(force=True)
    out = sim.summary(interrupted)
    out["exit_code"] = code
    print("SIMULATE " + json.dumps(out, sort_keys=True), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
