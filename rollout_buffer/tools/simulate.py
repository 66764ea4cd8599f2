"""A simulated AIEvoBox launcher: writes ``session_steps`` / ``job_environments`` rows as the real
one does.

Run it as ``python -m rollout_buffer.simulate --db-path URL --job-id JOB [options]``. The buffer
service starts it in place of the real launcher when no ``AIEVOBOX_ROOT`` is configured, so it
accepts the original launcher's command line: the flags that matter here are read, every other
one (``--mode``, ``--llm-base-url``, ``--no-rebuild-table``, ...) is accepted and ignored.

What it writes (SPEC §1-§2), INSERT only, never UPDATE or DELETE:

* ``--groups`` prompt groups of ``--rl-group-size`` (K) sessions each. ``group_id`` is
  ``uuid5(NAMESPACE_OID, f"{env_name}:{task_idx}")`` with
  ``task_idx = g + (rl_epoch - 1) * groups``: unique within a job, the same across jobs of one
  epoch, as the launcher derives it.
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

Owns: the simulator's command line (flags, signals, exit statuses); the engine is simulator.py and
the replay of an export from_export.py. It must not UPDATE or DELETE a row.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from rollout_buffer.core.errors import RolloutBufferError
from rollout_buffer.core.redact import redact
from rollout_buffer.tools.from_export import ExportReplayer
from rollout_buffer.tools.simulator import Simulator, Stop


def _bounded(kind: type, lo: float, hi: float | None = None) -> Any:
    """An argparse type: a number of ``kind`` within [lo, hi]."""

    def parse(text: str) -> Any:
        value = kind(text)
        if not (value >= lo and (hi is None or value <= hi)):
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if kind is int else 'a number'} "
                f">= {lo:g}{'' if hi is None else f' and <= {hi:g}'}, got {text!r}"
            )
        return value

    return parse


_nonneg_int, _pos_int = _bounded(int, 0), _bounded(int, 1)
_rate, _nonneg_float = _bounded(float, 0.0, 1.0), _bounded(float, 0.0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m rollout_buffer.simulate",
        description="Simulated AIEvoBox launcher: writes launcher rows (one per step) into "
        "session_steps and job_environments. Unknown launcher flags are ignored.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )  # an unknown launcher flag must never be taken for a prefix of ours
    original = parser.add_argument_group("the original launcher's flags")
    original.add_argument(
        "--db-path",
        required=True,
        help="database URL: sqlite:///abs/path, sqlite://rel/path or postgresql://... "
        "(a bare file path is taken as SQLite)",
    )
    original.add_argument(
        "--storage-type",
        choices=("sqlite", "postgres", "postgresql"),
        default=None,
        help="backend; must agree with --db-path (the URL decides)",
    )
    original.add_argument("--job-id", required=True, help="job_id of every row")
    original.add_argument(
        "--rl-group-size", type=_pos_int, default=8, help="sessions per group (K)"
    )
    original.add_argument(
        "--max-steps",
        type=_pos_int,
        default=6,
        help="step cap: sessions have 1..max-steps steps (random per session)",
    )
    original.add_argument(
        "--pool-size", type=_pos_int, default=16, help="concurrently running sessions"
    )
    original.add_argument(
        "--rl-epoch",
        type=int,
        default=1,
        help="epoch: shifts the task index (and so the group ids) by (epoch-1)*groups",
    )
    knobs = parser.add_argument_group("simulator knobs")
    knobs.add_argument("--groups", type=_pos_int, default=32, help="prompt groups G")
    knobs.add_argument(
        "--fail-rate",
        type=_rate,
        default=0.05,
        help="fraction of sessions that crash after 0..n-1 rows, never completing",
    )
    knobs.add_argument(
        "--flat-rate",
        type=_rate,
        default=0.0,
        help="fraction of groups whose sessions all end with the same reward (zero variance)",
    )
    knobs.add_argument(
        "--truncate-rate",
        type=_rate,
        default=0.1,
        help="fraction of sessions that hit the step cap and end truncated",
    )
    knobs.add_argument(
        "--pace",
        type=_nonneg_float,
        default=0.02,
        help="seconds to sleep between rows (0 = as fast as possible)",
    )
    knobs.add_argument(
        "--prompt-bytes",
        type=_pos_int,
        default=600,
        help="approximate size of the first user prompt",
    )
    knobs.add_argument(
        "--seed",
        type=int,
        default=None,
        help="random seed for the run's shape (session ids are always fresh uuid4s)",
    )
    knobs.add_argument("--quiet", action="store_true", help="print only the final SIMULATE line")
    knobs.add_argument(
        "--from-export",
        metavar="FILE",
        default=None,
        help="write the records of a `rollout-buffer export` file (JSONL, .gz or plain) back as "
        "this job's rows, at --pace, instead of simulating (see rollout_buffer.tools.from_export)",
    )
    return parser


def normalise_url(db_path: str, storage_type: str | None) -> str:
    """The database URL; a bare path becomes ``sqlite:///abs/path``."""
    if db_path.startswith(("sqlite://", "postgresql://", "postgres://")):
        kind = "sqlite" if db_path.startswith("sqlite://") else "postgres"
        if storage_type and storage_type.replace("postgresql", "postgres") != kind:
            print(
                f"simulate: warning: --storage-type {storage_type} disagrees with --db-path "
                f"({kind}); using {kind}",
                file=sys.stderr,
                flush=True,
            )  # never the URL: it may hold a password
        return db_path
    if storage_type in ("postgres", "postgresql"):
        raise SystemExit(
            f"simulate: --db-path {redact(db_path)!r} is not a postgresql:// URL "
            "but --storage-type is postgres"
        )
    return "sqlite://" + os.path.abspath(db_path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    try:
        url = normalise_url(args.db_path, args.storage_type)
    except SystemExit as exc:
        print(exc, file=sys.stderr, flush=True)
        return 2
    if args.from_export is not None:
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
