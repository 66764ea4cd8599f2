"""Drafts, the prebuilder's tick and replays (unit tier), through the real serving object with no
HTTP and no thread: a draft takes ready groups and leaves the rest; the prebuilder's ``tick()``
builds a draft a poll then claims; a poll's request_id is answered again, byte for byte, by a
replay; a malformed group is refused and dropped with its rows. Real SQLite files, a fake clock."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from parts import Parts

from rollout_buffer.core.model import MALFORMED, PollRequest
from rollout_buffer.serving.draft import Draft, Shape
from rollout_buffer.serving.poll import Serving
from rollout_buffer.storage.store import LazyPair


class Served:
    """Parts plus the serving object the service would build on them (no lease)."""

    def __init__(self, tmp_path, **overrides) -> None:
        self.parts = Parts(tmp_path, **overrides)
        parts = self.parts
        self.serving = Serving(parts.config, **parts.shared)
        self.request = LazyPair(parts.config)  # one request's connections

    def poll(self, **fields) -> dict:
        body = self.serving.get_rollout_data(self.request, PollRequest(**fields))
        try:
            return json.loads(b"".join(bytes(c) for c in body))
        finally:
            body.close()

    def close(self) -> None:
        self.serving.prebuilt.close()
        self.request.close()
        self.parts.close()


@pytest.fixture
def served(tmp_path) -> Iterator[Served]:
    made = Served(tmp_path)
    made.parts.tick()
    made.parts.select(k=2)
    yield made
    made.close()


def group_ids(doc: dict) -> set[str]:
    return {item["instance_id"] for item in doc["data"]["data"]}


def test_a_draft_takes_what_the_shape_allows_and_gives_the_rest_back(served: Served) -> None:
    for g in ("g1", "g2", "g3"):
        served.parts.writer.group(g, 2)
    served.parts.tick()
    job_state = served.parts.jobs.current
    assert job_state is not None and job_state.ready_count() == 3
    draft = Draft(job_state.job_id, Shape(max_groups=2), served.parts.config.max_response_bytes)
    with served.parts.locks.serving():
        draft.build(
            served.request.get(), job_state, served.parts.config.policy, 1 << 30, lambda t, e: False
        )
        assert [t.group_id for t, _ in draft.built] == ["g1", "g2"] and not draft.room()
        assert draft.give_back() == [] and job_state.ready_count() == 1  # g3 was never taken
        job_state.accumulator.release(draft.taken)
    assert job_state.ready_count() == 3


def test_the_prebuilders_tick_builds_a_draft_that_the_next_poll_claims(tmp_path) -> None:
    served = Served(tmp_path, prebuild=True)
    try:
        served.parts.tick()
        served.parts.select(k=2)
        served.parts.writer.group("g1", 2)
        served.parts.tick()
        prebuilt = served.serving.prebuilt
        assert prebuilt.tick() == 0.0 and prebuilt.draft is not None
        assert prebuilt.stats()["builds"] == 1 and prebuilt.stats()["draft"]["groups"] == 1
        doc = served.poll()
        assert group_ids(doc) == {"g1"} and prebuilt.stats()["claims"] == 1
        assert prebuilt.tick() == prebuilt.IDLE_S  # nothing ready: no draft, no spin
    finally:
        served.close()


def test_a_request_id_is_answered_again_by_a_replay(served: Served) -> None:
    served.parts.writer.group("g1", 2)
    served.parts.tick()
    first = served.poll(request_id="r1")
    assert group_ids(first) == {"g1"}
    served.parts.writer.group("g2", 2)
    served.parts.tick()
    again = served.poll(request_id="r1")
    assert again["data"]["data"] == first["data"]["data"]  # the same items and uids: not g2
    meta = again["data"]["meta_info"]
    assert meta["replayed"] is True and meta["batch_id"] == first["data"]["meta_info"]["batch_id"]
    assert group_ids(served.poll(request_id="r2")) == {"g2"}


def test_a_malformed_group_is_refused_and_dropped_with_its_rows(served: Served) -> None:
    served.parts.writer.group("g1", 2, messages="{not json")
    served.parts.tick()
    doc = served.poll()
    assert doc["data"]["data"] == []
    decision = served.parts.conns.get().store.group_decision("job1", "g1")
    assert decision == ("dropped", MALFORMED)
