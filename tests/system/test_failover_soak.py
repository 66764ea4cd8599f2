"""The seeded failover soak (tests/bench/failover_soak.py) in CI, short and with a fixed seed, on
both backends: three instances of one buffer attacked at random (kill -9, SIGSTOP, and on Postgres
first of all a SIGSTOP inside a fenced transaction), next to a second buffer on the same database
with its own job and trainer. Every group reaches its own trainer exactly once, the other trainer
never; a paused owner never blocks failover past the lease plus 5 s. Set ``RBTEST_SOAK_SEED`` to run
another seed."""

from __future__ import annotations

import argparse
import os
import sys

import pytest
from servers import ROOT

sys.path.insert(0, str(ROOT / "tests" / "bench"))
import failover_soak  # (a script's module: importable once its folder is on the path)

pytestmark = pytest.mark.slow

SEED = int(os.environ.get("RBTEST_SOAK_SEED", "2020"))
SECONDS = 20.0


def test_failover_soak_with_a_second_buffer(db_url, tmp_path):
    args = argparse.Namespace(seed=SEED, seconds=SECONDS, lease=3.0)
    backend = "postgres" if db_url.startswith("postgres") else "sqlite"
    assert failover_soak.soak(args, db_url, str(tmp_path)), (
        f"rerun: python tests/bench/failover_soak.py --seed {SEED} --backend {backend} "
        f"--seconds {SECONDS:g} --lease 3"
    )
