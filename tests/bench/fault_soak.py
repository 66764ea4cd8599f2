#!/usr/bin/env python3
"""Run the fault-injection scenario (tests/faultlib.py) for any seeds, longer than CI does.

    python tests/bench/fault_soak.py --seed 7 --rounds 20 --backend sqlite
    python tests/bench/fault_soak.py --seed 7 --backend postgres --groups 20 --kills 10

Round i runs seed ``seed + i`` on a fresh database (a temporary SQLite file, or a fresh schema on
``ROLLOUT_BUFFER_TEST_PG`` / postgresql://root@127.0.0.1:5432/test). It prints one summary line
per round and stops at the first failure, printing the report (with the seed and the command
that reruns it) and exiting 1. ``--keep`` keeps the work directories (server and writer logs).
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(TESTS), str(TESTS.parent)]

import faultlib  # noqa: E402 - after the path setup
from support import fresh_pg_schema  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument(
        "--rounds", type=int, default=1, help="scenarios to run, seeds seed..seed+rounds-1"
    )
    ap.add_argument("--backend", choices=["sqlite", "postgres"], default="sqlite")
    ap.add_argument("--writers", type=int, default=faultlib.Settings.writers)
    ap.add_argument(
        "--groups", type=int, default=faultlib.Settings.groups_per_writer, help="groups per writer"
    )
    ap.add_argument("--kills", type=int, default=faultlib.Settings.kills)
    ap.add_argument("--k", type=int, default=faultlib.Settings.k)
    ap.add_argument("--ttl", type=float, default=faultlib.Settings.ttl_s)
    ap.add_argument(
        "--kinds", default="", help="comma-separated malformed kinds to draw from (default: all)"
    )
    ap.add_argument(
        "--hostile",
        type=float,
        default=faultlib.Settings.p_hostile,
        help="share of groups with hostile versions, ids or control characters "
        "(tests/hostile_rows.py; 0: none)",
    )
    ap.add_argument("--keep", action="store_true", help="keep the work directories")
    args = ap.parse_args(argv)
    kinds = tuple(k for k in args.kinds.split(",") if k) or None
    for i in range(args.rounds):
        s = faultlib.Settings(
            seed=args.seed + i,
            backend=args.backend,
            writers=args.writers,
            groups_per_writer=args.groups,
            kills=args.kills,
            k=args.k,
            ttl_s=args.ttl,
            kinds=kinds,
            p_hostile=args.hostile,
        )
        workdir = Path(tempfile.mkdtemp(prefix=f"fault-soak-{s.seed}-"))
        try:
            with contextlib.ExitStack() as stack:
                if s.backend == "sqlite":
                    url = "sqlite://" + str(workdir / "launcher.db")
                else:
                    url = stack.enter_context(fresh_pg_schema())
                outcome = faultlib.run(s, url, workdir)
            print(f"ok  {outcome.summary()}", flush=True)
        except faultlib.FaultSuiteFailure as exc:
            print(str(exc), flush=True)
            print(f"work directory kept: {workdir}")
            return 1
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"    work directory: {workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
