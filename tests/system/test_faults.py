"""The fault-injection suite (issue 14): the class of crash, ordering, poison and dependency faults,
not instances.

One seeded scenario per backend (see tests/faultlib.py for what it does and checks): writers
committing out of order, a retrying trainer, kill -9 of the real gunicorn service at random
points, malformed rows, hostile rows (versions that cannot be true, ids and text with control
characters: tests/hostile_rows.py), a proxy that goes down or hangs. The seed is fixed for CI; set
``RBTEST_FAULT_SEED`` to run another one, or run ``tests/bench/fault_soak.py`` for many.
"""

from __future__ import annotations

import os

import faultlib
import pytest

pytestmark = pytest.mark.slow

SEED = int(os.environ.get("RBTEST_FAULT_SEED", "1414"))


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_faults_lose_duplicate_and_block_nothing(backend, tmp_path, request):
    url = (
        "sqlite://" + str(tmp_path / "launcher.db")
        if backend == "sqlite"
        else request.getfixturevalue("pg_url")
    )
    outcome = faultlib.run(faultlib.Settings(seed=SEED, backend=backend), url, tmp_path)
    assert len(outcome.kills) >= 5, outcome.summary()
    print(outcome.summary())
