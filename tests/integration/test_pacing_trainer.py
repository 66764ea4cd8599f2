"""The trainer as the admission budget sees it (issue 23): B, when not set, is learned from the
groups the trainer takes between its idle gaps, the time it trains. While it collects a batch, it
polls and waits for groups; when the producers are slower than it (groups complete further apart
than the idle gap, as when generating one takes minutes and the budget lets (S + 1) x B run),
the gaps between the polls that took groups are not steps."""

from __future__ import annotations

import time
from typing import Any

import pytest
from support import Writer


@pytest.fixture
def db_url(lite_url: str) -> str:
    """The budget does not depend on the backend: SQLite only."""
    return lite_url


def test_b_is_learned_from_the_trainers_steps_not_from_the_producers_pace(
    harness_factory: Any, db_url: str
) -> None:
    """The trainer takes 4 groups a step, polling every 50 ms while it collects; a group
    completes every half second. Every group was taken for a burst of its own: B was learned as
    1, so the budget let (S + 1) x 1 groups run, the producers slowed down to that, and every
    later burst was 1 group again (a run of the benchmark's trainer with groups of 75 s fell
    from 4 to 2 groups in progress within two steps)."""
    h = harness_factory(db_url, pacing_idle_gap_s=0.4)
    h.start(k=2)
    w = Writer(db_url)
    try:
        made = 0
        for _step in range(3):
            got = polls = 0
            while got < 4:  # collecting
                if polls % 10 == 0:
                    w.group(f"g{made}", 2, steps=1)
                    made += 1
                got += len(h.poll()["data"]["data"]) // 2
                polls += 1
                time.sleep(0.05)
            time.sleep(0.8)  # training: no poll
        h.poll()
    finally:
        w.close()
    batch = h.client.get("/admission").get_json()["inputs"]["batch_groups"]
    assert batch["value"] == 4, batch
