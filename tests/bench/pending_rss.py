#!/usr/bin/env python3
"""Memory per pending row of the accumulator, in this interpreter's checkout (issue 36).

bench.py's idle scenario reads RSS once the peer has started, and the peer has ingested its rows
by then: its "KB RSS / pending row" is no longer a measure. This measures the accumulator alone:
5,000 groups of K=8 sessions, one row each, none completed (40,000 pending rows, as the idle
scenario's), ingested as the reader hands them over; the growth of RSS (``/proc/self/statm``) and
of the Python heap (tracemalloc, a second run) divided by the rows. Median of three runs.

    python tests/bench/pending_rss.py
    /work/base/.venv/bin/python tests/bench/pending_rss.py      # another checkout
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import tracemalloc

import rollout_buffer
from rollout_buffer.core.accumulator import Accumulator

GROUPS, K = 5000, 8


def rows() -> list[tuple]:
    """(step_pk, session_id, group_id, completed, step_id, reward, weight_version)."""
    return [
        (1 + g * K + s, f"s-{g}-{s}-{'x' * 24}", f"g-{g}-{'y' * 24}", 0, 1, 0.0, 1)
        for g in range(GROUPS)
        for s in range(K)
    ]


def rss_kb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1024


def one() -> tuple[float, float]:
    batch = rows()
    gc.collect()
    before = rss_kb()
    keep = Accumulator("job", K)
    keep.ingest(batch)
    gc.collect()
    rss = (rss_kb() - before) / len(batch)
    assert keep.stats()["rows"]["pending"] == len(batch)
    del keep
    gc.collect()
    tracemalloc.start()
    keep = Accumulator("job", K)
    keep.ingest(batch)
    gc.collect()
    heap = tracemalloc.get_traced_memory()[0] / 1024 / len(batch)
    tracemalloc.stop()
    return rss, heap


def main() -> int:
    runs = [one() for _ in range(3)]
    out = {
        "checkout": os.path.dirname(os.path.dirname(rollout_buffer.__file__)),
        "pending_rows": GROUPS * K,
        "rss_kb_per_row": round(statistics.median(r for r, _ in runs), 3),
        "heap_kb_per_row": round(statistics.median(h for _, h in runs), 3),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
