#!/usr/bin/env python3
"""The rollout_buffer modules one poll passes through (issue 36's closing figure).

Starts the service in this process on a fresh SQLite file (the test harness of the checkout whose
``rollout_buffer`` this interpreter imports), writes one complete group of K=2, lets the loop read
it, then serves it with one ``POST /get_rollout_data`` through the Flask test client under
``sys.setprofile``: every Python function called in the request's thread is recorded with its
module, and the distinct ``rollout_buffer`` modules are listed. The draft is built by the poll
itself (``prebuild`` off), so the whole serving path is in the poll's thread. An empty poll follows.

    python tests/bench/poll_modules.py                          # this checkout
    /work/base/.venv/bin/python tests/bench/poll_modules.py     # another checkout's venv
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any

import rollout_buffer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(rollout_buffer.__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from support import Harness, Writer, make_config, make_launcher_db  # noqa: E402


def traced(harness: Harness, body: dict[str, Any]) -> tuple[dict[str, Any], set[str]]:
    """One poll under the profiler: its answer, and the rollout_buffer modules it ran code of."""
    modules: set[str] = set()

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event == "call":
            name = frame.f_globals.get("__name__", "")
            if name == "rollout_buffer" or name.startswith("rollout_buffer."):
                modules.add(name)

    sys.setprofile(profile)
    try:
        answer = harness.client.post("/get_rollout_data", json=body).get_json()
    finally:
        sys.setprofile(None)
    return answer, modules


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/launcher.db"
        make_launcher_db(url)
        harness = Harness(make_config(url, Path(tmp), prebuild=False))
        try:
            harness.start(k=2)
            writer = Writer(url)
            writer.group("g1", 2, steps=2)
            writer.close()
            harness.settle()
            served, modules = traced(harness, {})
            assert served["success"] and len(served["data"]["data"]) == 4, served
            empty, empty_modules = traced(harness, {})
            assert not empty["success"], empty
        finally:
            harness.stop()
    print(f"checkout: {ROOT}")
    print(f"a poll that serves one group passes through {len(modules)} modules:")
    for name in sorted(modules):
        print(f"  {name}")
    print(f"an empty poll passes through {len(empty_modules)} modules")
    print(json.dumps({"serving_poll": sorted(modules), "empty_poll": sorted(empty_modules)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
