"""A proxy that stamps one version forever (issue 34, item 4: never stall the launcher for good),
through a real gate socket and a real HTTP server standing in for the LLM proxy."""

from __future__ import annotations

from typing import Any

from fakes.fake_llm import FakeLLM
from gatelib import admission, call, gated, schedule
from support import Writer, wait_until


def test_a_constant_version_leaves_room_for_the_trainers_batch(
    harness_factory: Any, lite_url: str
) -> None:
    """S 0, B 2, a trainer that polls min_groups 2 and sends no version, rows all at version 0
    (the proxy stamps 0 forever). After two batches served, the trainer's next poll arrived: it
    holds nothing it has not trained on as far as any version says, and two groups must be able
    to become ready for its batch. (A ceiling of B - 1 held at steps 0 leaves a budget of 1: one
    group, never the batch of 2 the trainer waits for.)"""
    with FakeLLM(version=0) as llm:
        h, port = gated(harness_factory, lite_url, llm, pacing_staleness=0, pacing_batch_groups=2)
        w = Writer(lite_url)
        try:
            groups = [f"g{i}" for i in range(1, 7)]
            for group in groups:
                schedule(w, group, [f"{group}-a"])
            h.start(k=1)
            h.settle()
            for pair in (groups[0:2], groups[2:4]):
                for group in pair:
                    assert call(port, f"{group}-a").status_code == 200
                    w.step(group, f"{group}-a", 1, completed=True, env_state={"weight_version": 0})
                h.settle()
                assert len(h.poll(min_groups=2)["data"]["data"]) == 2
                h.poll(min_groups=2)  # the trainer is back, asking for its next batch
            wait_until(lambda: "rows" in admission(h)["trainer"]["versions"], 5, "rows' version")
            doc = admission(h)
            assert doc["budget"] >= 2, doc
        finally:
            w.close()
