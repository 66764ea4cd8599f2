#!/usr/bin/env python3
"""The real launcher with pacing off and on: the figures of docs/benchmarks.md (issue 34).

Runs the unmodified upstream launcher (Safactory ``launcher.py``, ``math500_text``,
``--env-transport inproc``) under ``rollout-buffer serve``, with a stand-in LLM proxy and a
trainer that polls ``{}`` as the upstream client does: the harness of the real-launcher tier,
``tests/realstack/stack.py``, which says what a run is. Runs alternate pacing off and on.

It needs the setup of that tier: ``python tests/realstack/setup_upstream.py --copy PATH``, then
``RBTEST_REALSTACK`` (or ``--setup DIR``) names the directory it made.

Per run: groups served of those the launcher listed, groups dropped by reason, sessions without a
result, the gate's held first calls (how many, the mean hold, the call-seconds held, the most at
once, from when to when, and how many at the end; sampled from ``/admission`` every 0.25 s), when
the last group was served and the wall time (``/start_rollout`` to the trainer's last step), and
on/off of the wall times.

    python tests/bench/realstack.py                       # one run each, about two minutes
    python tests/bench/realstack.py --runs 3 --batch-groups 2 4
    python tests/bench/realstack.py --json /tmp/realstack.json --dump /tmp/realstack-runs
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "realstack")]

from stack import (  # noqa: E402  (importable once sys.path has tests/realstack, above)
    VARIABLE,
    Outcome,
    Params,
    Upstream,
    UpstreamError,
    run,
    skip_reason,
)


def held_text(held: dict[str, Any], pacing: str) -> str:
    if not held:
        return "none (no gate)" if pacing == "off" else "n/a (no held count in /admission)"
    if not held["max"]:
        return "none"
    return (
        f"{held['calls']} calls, {held['mean_s']:g} s each on average ({held['call_s']:g} "
        f"call-s), {held['max']} at most at once, from {held['first_s']:g} to "
        f"{held['last_s']:g} s; {held['at_end']} at the end"
    )


def dump(path: Path, outcome: Outcome) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "figures": outcome.figures(),
        "admission": [{"t": round(t, 3), **doc} for t, doc in outcome.admission],
        "calls": [{k: v for k, v in c.items() if k != "body"} for c in outcome.calls],
        "stats": outcome.stats,
    }
    path.write_text(json.dumps(doc) + "\n")


def row(fig: dict[str, Any], batch: int, ratio: str) -> str:
    dropped = ", ".join(f"{r} {n}" for r, n in sorted(fig["dropped"].items())) or "none"
    wall = f"not done at {fig['elapsed_s']:g}" if fig["wall_s"] is None else f"{fig['wall_s']:g}"
    served_s = "-" if fig["served_s"] is None else f"{fig['served_s']:g}"
    held = held_text(fig["held"], fig["pacing"])
    return (
        f"| {fig['pacing']} | {batch} | {fig['served']} of {fig['groups']} | {dropped} | "
        f"{fig['sessions_without_result']} of {fig['sessions']} | {held} | "
        f"{served_s} | {wall} | {ratio} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setup", help=f"the setup directory (default: ${VARIABLE})")
    parser.add_argument("--runs", type=int, default=1, help="runs each way, alternating")
    parser.add_argument(
        "--batch-groups", type=int, nargs="+", default=[Params.batch_groups], help="B values"
    )
    parser.add_argument("--train-s", type=float, default=Params.train_s)
    parser.add_argument("--groups", type=int, default=Params.groups)
    parser.add_argument("--latency-s", type=float, default=Params.latency_s)
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=150.0,
        help="a run that has not ended by then stops (its figures say what was left)",
    )
    parser.add_argument(
        "--untold",
        action="store_true",
        help="leave ROLLOUT_BUFFER_PACING_BATCH_GROUPS unset (the gate's own B)",
    )
    parser.add_argument("--json", help="write every run's figures to this file")
    parser.add_argument(
        "--dump",
        help="write each run's /admission samples, model calls and /stats to DIR/<run>.json",
    )
    parser.add_argument("--keep", action="store_true", help="keep the runs' directories")
    args = parser.parse_args()
    if args.setup:
        os.environ[VARIABLE] = args.setup
    try:
        upstream = Upstream.from_env()
    except UpstreamError as exc:
        print(exc, file=sys.stderr)
        return 2
    if upstream is None:
        print(skip_reason(), file=sys.stderr)
        return 2
    base = Path(tempfile.mkdtemp(prefix="realstack-bench-"))
    print(f"upstream {upstream.commit or 'unknown commit'} from {upstream.dest}; runs in {base}")
    results: list[dict[str, Any]] = []
    lines: list[str] = []
    for batch in args.batch_groups:
        params = Params(
            groups=args.groups,
            batch_groups=batch,
            tell_batch_groups=not args.untold,
            train_s=args.train_s,
            latency_s=args.latency_s,
            timeout_s=args.timeout_s,
        )
        for index in range(args.runs):
            off_wall = None
            for pacing in (False, True):
                name = f"b{batch}-{index + 1}-{'on' if pacing else 'off'}"
                outcome = run(upstream, params, pacing, base / name)
                fig = outcome.figures()
                ratio = "-"
                if not pacing:
                    off_wall = outcome.wall_s
                elif off_wall and outcome.wall_s:
                    ratio = f"{outcome.wall_s / off_wall:.2f}"
                elif off_wall:
                    ratio = f"> {outcome.elapsed_s / off_wall:.2f}"
                results.append({"run": name, "params": dataclasses.asdict(params), **fig})
                if args.dump:
                    dump(Path(args.dump) / f"{name}.json", outcome)
                lines.append(row(fig, batch, ratio))
                print(f"{name}: {json.dumps(fig)}", flush=True)
    print()
    print(
        "| pacing | B | groups served | dropped | sessions without a result | held first calls "
        "| last group served (s) | wall time (s) | on/off |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
