"""A simulated AIEvoBox launcher: writes ``session_steps`` / ``job_environments`` rows as the real
one does.

Run it as ``python -m rollout_buffer.simulate --db-path URL --job-id JOB [options]``. The buffer
service starts it in place of the real launcher when no ``AIEVOBOX_ROOT`` is configured, so it
accepts the original launcher's command line: the flags that matter here are read, every other
one (``--mode``, ``--llm-base-url``, ``--no-rebuild-table``, ...) is accepted and ignored.

What it writes (SPEC §2, what the real launcher writes step by step), INSERT only:

* ``--groups`` prompt groups of ``--rl-group-size`` (K) sessions each. ``group_id`` is
  ``uuid5(NAMESPACE_OID, f"{env_name}:{task_idx}")`` with ``task_idx = g + (rl_epoch - 1) *
  groups``: unique within a job, the same across jobs of one epoch, as the launcher derives it.
* One ``job_environments`` row per scheduled session (``env_id`` = ``session_id``, a uuid4),
  all written at start; ``finished`` is never set.
* A pool of ``--pool-size`` running sessions takes sessions in group order; each step goes to a
  randomly chosen running session, so rows of different sessions and groups interleave.
* One ``session_steps`` row per step. ``messages`` is the prompt the model saw: the whole
  history with ``--message-cut`` N <= 0 (the default, as the original's), else the system message
  and the last 2N-1 messages. ``response`` is this step's answer; ``reward`` the running sum of
  ``step_reward``.
* With N <= 0 only a session's terminal row is trainable (a complete session gives the trainer
  ONE item); with N > 0 every row is.
* How sessions end: most are ended by their environment (a terminal, completed row with the
  session's reward); ``--truncate-rate`` of them get an answer cut by the length limit (that row
  is terminal and truncated, reward 0); ``--cap-rate`` reach ``--max-steps`` without their
  environment ending them and write no terminal row; ``--fail-rate`` fail for good after 0..n-1
  rows and write no terminal row. Under N <= 0 the last two kinds leave no trainable row at all.
* ``env_state`` is ``{"weight_version": v}`` with v advancing every
  ``--weight-version-interval`` seconds (the simulator plays the LLM proxy's part), or NULL when
  that is 0 (the default: a proxy that reports no version).
* Rows are flushed in batches, as the real launcher does: ``--flush-rows`` rows (100) or every
  ``--flush-interval`` seconds (5), in one transaction each; ``created_at`` is the flush time,
  tz-aware (ISO text ``2026-12-02 13:35:10.889937+00:00`` on SQLite, TIMESTAMPTZ on Postgres).

* With ``--llm-calls`` (the service passes it with ``ROLLOUT_BUFFER_PACING=gate``) each step is
  first a model call to ``<--llm-base-url>/<session_id>/chat/completions``, retried as the real
  launcher retries; a session's first call runs on a thread of its own (a pacing gate may hold
  it) and holds a place in the ``--pool-size`` pool meanwhile, as a real launcher's worker does.

Not modelled: the environments themselves (text is random words), the model's answer (the text
is random words whatever the model says), token ids and log-probs, the ``cloud`` storage
gateway, Ray and the http environment transport, and a launcher crash mid-batch (a stop flushes
what it holds).

The launcher's tables are created if missing (the real launcher runs with ``--no-rebuild-table``,
but a default setup starts from an empty database); a concurrent creator is tolerated.

Output: progress lines on stdout unless ``--quiet``, then always a last line
``SIMULATE {json}`` (groups, k, sessions, rows, completed_sessions, failed_sessions,
truncated_sessions, capped_sessions, trainable_rows, complete_groups = groups whose K sessions all
completed, interrupted, ...).

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
from rollout_buffer.tools.session_pool import Stop
from rollout_buffer.tools.simulator import Simulator


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
    p = argparse.ArgumentParser(
        prog="python -m rollout_buffer.simulate",
        description="Simulated AIEvoBox launcher: writes launcher rows (one per step) into "
        "session_steps and job_environments. Unknown launcher flags are ignored.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )  # an unknown launcher flag must never be taken for a prefix of ours
    g = p.add_argument_group("the original launcher's flags")
    g.add_argument(
        "--db-path",
        required=True,
        help="database URL: sqlite:///abs/path, sqlite://rel/path or postgresql://... "
        "(a bare file path is taken as SQLite)",
    )
    g.add_argument(
        "--storage-type",
        choices=("sqlite", "postgres", "postgresql"),
        default=None,
        help="backend; must agree with --db-path (the URL decides)",
    )
    g.add_argument("--job-id", required=True, help="job_id of every row")
    g.add_argument(
        "--llm-base-url",
        default=None,
        help="the LLM proxy (or the pacing gate): with --llm-calls, each step is a model call "
        "to <this>/<session_id>/chat/completions first",
    )
    g.add_argument("--llm-model", default="default", help="the model named in model calls")
    g.add_argument("--rl-group-size", type=_pos_int, default=8, help="sessions per group (K)")
    g.add_argument(
        "--max-steps",
        type=_pos_int,
        default=10,
        help="step cap: a session reaching it without its environment ending it writes no "
        "terminal row",
    )
    g.add_argument(
        "--message-cut",
        type=int,
        default=0,
        help="<= 0: messages hold the whole history and only terminal rows are trainable; "
        "N > 0: the system message and the last 2N-1 messages, every row trainable",
    )
    g.add_argument("--pool-size", type=_pos_int, default=16, help="concurrently running sessions")
    g.add_argument(
        "--rl-epoch",
        type=int,
        default=1,
        help="epoch: shifts the task index (and so the group ids) by (epoch-1)*groups",
    )
    s = p.add_argument_group("simulator knobs")
    s.add_argument("--groups", type=_pos_int, default=32, help="prompt groups G")
    s.add_argument(
        "--min-steps",
        type=_pos_int,
        default=1,
        help="the fewest steps of a session its environment ends (the most is --max-steps)",
    )
    s.add_argument(
        "--fail-rate",
        type=_rate,
        default=0.05,
        help="fraction of sessions that fail for good after 0..n-1 rows (no terminal row)",
    )
    s.add_argument(
        "--cap-rate",
        type=_rate,
        default=0.05,
        help="fraction of sessions that reach --max-steps without their environment ending them "
        "(no terminal row)",
    )
    s.add_argument(
        "--truncate-rate",
        type=_rate,
        default=0.05,
        help="fraction of sessions whose answer is cut by the length limit (terminal, truncated, "
        "reward 0)",
    )
    s.add_argument(
        "--flat-rate",
        type=_rate,
        default=0.0,
        help="fraction of groups whose sessions all end with the same reward (zero variance)",
    )
    s.add_argument(
        "--weight-version-interval",
        type=_nonneg_float,
        default=0.0,
        help="seconds between weight versions, as a trainer's steps would move them "
        "(0 = no version: env_state is NULL)",
    )
    s.add_argument(
        "--llm-calls",
        action="store_true",
        help="make a model call before each step, as the real launcher does (retried on 429, 5xx "
        "and connection errors with a backoff up to 30 s; another 4xx fails the session); the "
        "version the answer carries is the row's. The service passes it with pacing on",
    )
    s.add_argument(
        "--flush-rows", type=_pos_int, default=100, help="rows per flush (one transaction)"
    )
    s.add_argument(
        "--flush-interval",
        type=_nonneg_float,
        default=5.0,
        help="seconds after which held rows are flushed even when fewer than --flush-rows",
    )
    s.add_argument(
        "--pace",
        type=_nonneg_float,
        default=0.02,
        help="seconds to sleep between rows (0 = as fast as possible)",
    )
    s.add_argument(
        "--prompt-bytes",
        type=_pos_int,
        default=600,
        help="approximate size of the first user prompt",
    )
    s.add_argument(
        "--seed",
        type=int,
        default=None,
        help="random seed for the run's shape (session ids are always fresh uuid4s)",
    )
    s.add_argument("--quiet", action="store_true", help="print only the final SIMULATE line")
    s.add_argument(
        "--from-export",
        metavar="FILE",
        default=None,
        help="write the records of a `rollout-buffer export` file (JSONL, .gz or plain) back as "
        "this job's rows, at --pace, instead of simulating (see rollout_buffer.tools.from_export)",
    )
    return p


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
    if args.fail_rate + args.cap_rate + args.truncate_rate > 1.0:
        print(
            "simulate: --fail-rate + --cap-rate + --truncate-rate must be at most 1, got "
            f"{args.fail_rate + args.cap_rate + args.truncate_rate:g}",
            file=sys.stderr,
            flush=True,
        )
        return 2
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
