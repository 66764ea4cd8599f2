"""A stand-in for the upstream launcher's front door (Safactory ``launcher.py``), to be copied as
``$AIEVOBOX_ROOT/launcher.py`` and run by the service exactly as the real one is (SPEC §5).

It checks its flags as the real one does, with argparse: ``--storage-type`` is ``sqlite`` or
``cloud`` and anything else exits 2 with argparse's usage error within a second (what the real one
does with ``STORAGE_TYPE=postgres``); ``--env-transport http`` fails as the real one does without
Ray (exit 1, after 61 s there; at once here). Otherwise it says it started, echoes its
``--db-path`` (a password in it must never reach an answer) and a line with a terminal escape,
then runs until signalled, or exits 1 after ``FAKE_UPSTREAM_EXIT_AFTER_S`` seconds when that is set
(a launcher that dies later).
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(prog="launcher.py")
    parser.add_argument("--mode", default="local")
    parser.add_argument("--db-path", required=True)
    parser.add_argument("--storage-type", choices=["sqlite", "cloud"], default="sqlite")
    parser.add_argument("--env-transport", choices=["http", "inproc"], default="http")
    args, _unknown = parser.parse_known_args()
    print(f"launcher starting, db {args.db_path}", flush=True)
    print("\x1b[31mcolour\x1b[0m from a progress bar", flush=True)
    if args.env_transport == "http":
        print("ModuleNotFoundError: No module named 'ray'", file=sys.stderr, flush=True)
        return 1
    exit_after = os.environ.get("FAKE_UPSTREAM_EXIT_AFTER_S")
    if exit_after:
        time.sleep(float(exit_after))
        print("environment server crashed", file=sys.stderr, flush=True)
        return 1
    while True:
        time.sleep(600)


if __name__ == "__main__":
    sys.exit(main())
