"""A stand-in for the real launcher, run with ``sys.executable`` by the real supervisor.

Behaviour is chosen with ``--mode``:

- ``exit0`` / ``exit1``: sleep ``--sleep`` seconds, then exit 0 or 1;
- ``hang``: sleep until signalled (default SIGTERM handling, so TERM kills it);
- ``ignore-term``: ignore SIGTERM and sleep, so only SIGKILL ends it;
- ``spawn-child``: start a grandchild in the same process group that sleeps (its pid is
  written to ``--child-pid-file``), ignore SIGTERM, and sleep (or, with ``--sleep`` > 0,
  exit 3 after that long, leaving the grandchild behind).

``--marker FILE`` appends a line with our pid on start so tests can count starts; ``--dump FILE``
writes our argv and environment as JSON. Unknown
arguments (the real launcher's ``--job-id``, ``--rl-group-size``, ...) are accepted and
ignored.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time


def main(argv: list[str] | None = None) -> int:
    """Run the fake launcher; return its exit code."""
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--mode", default="exit0", choices=["exit0", "exit1", "hang", "ignore-term", "spawn-child"]
    )
    parser.add_argument("--marker", default=None)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--child-pid-file", default=None)
    parser.add_argument("--dump", default=None, help="write our argv and environment here as JSON")
    args, _unknown = parser.parse_known_args(argv)
    if args.dump:
        import json

        with open(args.dump, "w", encoding="utf-8") as f:
            json.dump({"argv": sys.argv, "env": dict(os.environ)}, f)

    # Install the handler before announcing the start, so a test that saw the marker knows
    # SIGTERM is already ignored.
    if args.mode in ("ignore-term", "spawn-child"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.marker:
        with open(args.marker, "a", encoding="utf-8") as f:
            f.write(f"{os.getpid()}\n")
    print(f"fake launcher pid {os.getpid()} mode {args.mode}", flush=True)

    if args.mode in ("exit0", "exit1"):
        time.sleep(args.sleep)
        return 0 if args.mode == "exit0" else 1
    if args.mode == "spawn-child":
        # The grandchild inherits our process group; it also ignores TERM (SIG_IGN survives
        # exec), so only the group KILL can end it.
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        if args.child_pid_file:
            tmp = args.child_pid_file + ".tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(f"{child.pid}\n")
            os.replace(tmp, args.child_pid_file)
        if args.sleep > 0:
            # Exit while the grandchild keeps running: an orphan left in the group.
            time.sleep(args.sleep)
            return 3
    while True:
        time.sleep(600)


if __name__ == "__main__":
    sys.exit(main())
