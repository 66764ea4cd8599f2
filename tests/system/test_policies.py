"""Training-data policies at the source (issue 10), through the Flask test client on SQLite and
Postgres: staleness, zero-variance groups, over-sampling, partial groups at the TTL, serve order,
and the group figures. Each policy: off (the original's behaviour), on, at the bound and one past
it, the proxy told with the reason, the accounting balanced, items the upstream client accepts.
The restart tests (kill -9 of a real gunicorn) are in test_policies_restart.py."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from fakes.fake_proxy import FakeProxy
from support import Harness, assert_balanced, groups_of, wait_until

from rollout_buffer.core.config import Config
from rollout_buffer.service import Service

ROOT = Path(__file__).resolve().parent.parent.parent
UPSTREAM_KEYS = ("uid", "instance_id", "messages", "reward", "extra_info")
UPSTREAM_EXTRA = ("session_id", "weight_version", "finish_reason", "group_id")


def upstream_accepts(doc: dict) -> None:
    """The upstream trainer client's checks on every item it is given."""
    for item in doc["data"]["data"]:
        assert all(k in item for k in UPSTREAM_KEYS), item.keys()
        assert all(k in item["extra_info"] for k in UPSTREAM_EXTRA), item["extra_info"].keys()


def cleared(proxy: FakeProxy, reason: str) -> set[str]:
    return {s for b in proxy.calls if b["reason"] == reason for s in b["session_ids"]}


def cleared_groups(proxy: FakeProxy, reason: str) -> set[str]:
    return {g for b in proxy.calls if b["reason"] == reason for g in b["group_ids"]}


@pytest.fixture
def proxy(fake_proxy: FakeProxy) -> FakeProxy:
    return fake_proxy


@pytest.fixture
def make(proxied: Any) -> Any:
    """A started service on the test's backend, notifying the fake proxy, with policy overrides."""
    return proxied


def version(v: int) -> dict:
    return {"weight_version": v}


def served_groups(h: Harness, **body: Any) -> list[str]:
    """Poll once; the group ids served, in the order they were built (group_stats' order)."""
    doc = h.poll(**body)
    upstream_accepts(doc)
    if not doc["success"]:
        return []
    return [s["group_id"] for s in doc["data"]["meta_info"]["group_stats"]]


# -- staleness
# ------------------------------------------------------------------------------------------------


def test_staleness_off_serves_every_version(make, writer):
    h = make()
    h.start(k=2)
    writer.group("old", 2, env_state=version(0))
    writer.group("new", 2, env_state=version(50))
    doc = h.poll(current_weight_version=100)
    assert sorted(groups_of(doc)) == ["new", "old"]
    assert doc["data"]["meta_info"]["filtered"] == {}
    assert_balanced(h.stats())


def test_staleness_drops_at_ready_by_the_rows_version_bound_and_one_past(make, writer, proxy):
    h = make(max_off_policy=2)
    h.start(k=2)
    # two complete groups report 5: the rows' version is now 5, whatever the trainer sends ({})
    writer.group("newest", 2, env_state=version(5))
    writer.group("newest2", 2, env_state=version(5))
    writer.group("at_bound", 2, env_state=version(3))  # 5 - 3 = 2: kept
    stale = writer.group("one_past", 2, env_state=version(2))  # 5 - 2 = 3 > 2: stale
    h.settle()
    s = h.stats()
    assert s["groups"]["dropped"] == {"stale": 1} and s["versions"]["current"] == 5
    assert_balanced(s)
    assert proxy.wait_for(lambda p: cleared(p, "stale") == set(stale))
    assert cleared_groups(proxy, "stale") == {"one_past"}
    doc = h.poll()
    assert sorted(groups_of(doc)) == ["at_bound", "newest", "newest2"]
    assert doc["data"]["meta_info"]["filtered"] == {"stale": 1}
    upstream_accepts(doc)
    # its late rows are late rows of a dropped group
    writer.step("one_past", stale[0], 9, env_state=version(2))
    h.settle()
    assert h.stats()["rows"]["dropped"]["late_rows_from_dropped_groups"] == 1
    assert_balanced(h.stats())


def test_a_group_that_goes_stale_while_it_waits_is_dropped_before_it_is_served(make, writer, proxy):
    h = make(max_off_policy=1)
    h.start(k=2)
    waiting = writer.group("waiting", 2, env_state=version(3))
    h.settle()
    assert h.stats()["groups"]["ready"] == 1
    # the trainer moved on to version 5: 5 - 3 > 1
    doc = h.poll(current_weight_version=5)
    assert doc["success"] is False
    s = h.stats()
    assert s["groups"]["dropped"] == {"stale": 1} and s["versions"]["trainer"] == 5
    assert_balanced(s)
    assert proxy.wait_for(lambda p: cleared(p, "stale") == set(waiting))
    writer.group("fresh", 2, env_state=version(5))
    doc = h.poll()
    assert list(groups_of(doc)) == ["fresh"]
    assert doc["data"]["meta_info"]["filtered"] == {"stale": 1}  # dropped since the previous batch
    writer.group("fresh2", 2, env_state=version(5))
    assert h.poll()["data"]["meta_info"]["filtered"] == {}


def test_a_poll_overrides_max_off_policy_and_the_trainer_version_is_the_last_sent(make, writer):
    h = make()  # the setting is unset: only the poll asks
    h.start(k=2)
    writer.group("v9", 2, env_state=version(9))
    writer.group("v8", 2, env_state=version(8))
    doc = h.poll(current_weight_version=10, max_off_policy=1)
    assert list(groups_of(doc)) == ["v9"]  # 10 - 9 = 1 kept, 10 - 8 = 2 > 1 stale
    assert doc["data"]["meta_info"]["filtered"] == {"stale": 1}
    # the last version a poll sent wins, even when it goes back (a trainer restored an older
    # checkpoint)
    h.poll(current_weight_version=4)
    assert h.stats()["versions"]["trainer"] == 4
    assert h.stats()["versions"]["current"] == 4  # row data never overrides the trainer's word
    assert_balanced(h.stats())


def test_a_long_env_state_is_not_read_at_ingest_and_its_version_counts_once_built(make, writer):
    """Ingest reads env_state only up to 4,096 characters (a batch of long ones would take
    gigabytes): a longer one's version is unknown until its group is built, never taken as 0 (stale)
    at ready."""
    h = make(max_off_policy=1)
    h.start(k=2)
    pad = "x" * 5000
    writer.group("short", 2, env_state=version(5))
    writer.group("short2", 2, env_state=version(5))  # two groups agree: the rows' version is 5
    writer.group("old-long", 2, env_state={"weight_version": 2, "pad": pad})
    writer.group("new-long", 2, env_state={"weight_version": 9, "pad": pad})
    h.settle()
    s = h.stats()
    assert s["versions"]["rows"] == 5 and s["groups"]["ready"] == 4 and s["groups"]["dropped"] == {}
    doc = h.poll()
    assert [x["group_id"] for x in doc["data"]["meta_info"]["group_stats"]] == [
        "short",
        "short2",
        "new-long",
    ]
    assert {i["extra_info"]["weight_version"] for i in groups_of(doc)["new-long"]} == {9}
    assert doc["data"]["meta_info"]["filtered"] == {
        "stale": 1
    }  # old-long: 5 - 2 > 1, judged when built
    s = h.stats()
    assert s["versions"]["rows"] == 5  # one group at 9 does not move it; a second one would
    assert_balanced(s)


def fetch_counter(monkeypatch) -> list[int]:
    """Counts the rows a poll reads from the database (every body is read by draft.fetch_takes)."""
    import rollout_buffer.serving.draft as draft

    read = [0]
    real = draft.fetch_takes

    def counting(source, takes, cap):
        read[0] += sum(len(t.served_pks) for t in takes)
        return real(source, takes, cap)

    monkeypatch.setattr(draft, "fetch_takes", counting)
    return read


def test_groups_stale_by_their_ingested_versions_are_dropped_without_reading_a_row(
    make, writer, monkeypatch
):
    """The trainer's version jumps past every ready group: the poll drops them all from what ingest
    knows, instead of reading and building the whole backlog to throw it away."""
    h = make(max_off_policy=2)
    h.start(k=2)
    for g in range(40):
        writer.group(f"g{g}", 2, steps=3, env_state=version(5))
    h.settle()
    assert h.stats()["groups"]["ready"] == 40
    read = fetch_counter(monkeypatch)
    doc = h.poll(current_weight_version=8, max_groups=4)  # 8 - 5 > 2
    assert doc["success"] is False and read == [0]
    s = h.stats()
    assert s["groups"]["dropped"] == {"stale": 40} and s["groups"]["ready"] == 0
    assert_balanced(s)


def test_a_poll_builds_about_one_budget_of_groups_it_refuses(make, writer, monkeypatch):
    """Versions not known at ingest (the setting unset, the bound sent by the poll): a refused group
    is built before it is judged, so the bytes it took count against the poll's byte budget. (No
    response is built ahead here: what is counted is the poll's own build.)"""
    h = make(max_response_bytes=16 * 1024, prebuild=False)
    h.start(k=2)
    for g in range(40):
        writer.group(f"g{g}", 2, steps=3, env_state=version(5))
    h.settle()
    import rollout_buffer.serving.draft as draft

    built, real = [0], draft.build_group

    def counting(*a, **kw):
        built[0] += 1
        return real(*a, **kw)

    monkeypatch.setattr(draft, "build_group", counting)
    doc = h.poll(current_weight_version=8, max_off_policy=2)
    assert doc["success"] is False
    first = h.stats()["groups"]["dropped"]["stale"]
    assert (
        1 <= first < 40 and built[0] == first
    )  # about a budget's worth; the others wait for the next polls
    for _ in range(40):
        if (
            not h.poll(current_weight_version=8, max_off_policy=2)["success"]
            and not h.stats()["groups"]["ready"]
        ):
            break
    s = h.stats()
    assert s["groups"]["dropped"] == {"stale": 40}
    assert_balanced(s)


@pytest.mark.parametrize(
    "body",
    [
        {"max_off_policy": -1},
        {"max_off_policy": "2"},
        {"max_off_policy": 1.5},
        {"current_weight_version": -3},
        {"current_weight_version": True},
    ],
)
def test_bad_policy_fields_in_a_poll_are_400(make, body):
    h = make()
    r = h.client.post("/get_rollout_data", json=body)
    assert r.status_code == 400
    doc = r.get_json()
    assert doc["success"] is False and next(iter(body)) in doc["error"]


# -- zero variance
# --------------------------------------------------------------------------------------------


def test_zero_variance_off_serves_equal_rewards(make, writer):
    h = make()
    h.start(k=2)
    for sid in ("a", "b"):
        writer.session("flat", f"flat-{sid}", 2, reward=0.5)
    assert list(groups_of(h.poll())) == ["flat"]


def test_zero_variance_bound_is_over_sessions_not_items(make, writer, proxy):
    h = make(drop_zero_variance=True, zero_variance_epsilon=0.25)
    h.start(k=2)
    # equal terminal rewards, sessions of different lengths (their items' step_rewards differ)
    writer.session("flat", "flat-a", 1, reward=0.5)
    writer.session("flat", "flat-b", 3, reward=0.5)
    writer.session("at_bound", "ab-a", 2, reward=0.5)  # spread 0.25 <= epsilon: dropped
    writer.session("at_bound", "ab-b", 2, reward=0.75)
    writer.session("one_past", "op-a", 2, reward=0.5)  # spread 0.3125 > epsilon: served
    writer.session("one_past", "op-b", 2, reward=0.8125)
    h.settle()
    s = h.stats()
    assert s["groups"]["dropped"] == {"zero_variance": 2}
    assert_balanced(s)
    doc = h.poll()
    assert list(groups_of(doc)) == ["one_past"]
    assert doc["data"]["meta_info"]["filtered"] == {"zero_variance": 2}
    assert proxy.wait_for(
        lambda p: cleared(p, "zero_variance") == {"flat-a", "flat-b", "ab-a", "ab-b"}
    )
    upstream_accepts(doc)


# -- over-sampling
# --------------------------------------------------------------------------------------------


def aievobox_config(tmp_path, url: str, **env: str) -> Config:
    return Config.from_env(
        {
            "AIEVOBOX_ROOT": str(tmp_path),
            "AIEVOBOX_DB_URL": url,
            "AIEVOBOX_ENV_ROOT": "/envs",
            "AIEVOBOX_RUN_DIR": str(tmp_path / "logs"),
            **env,
        }
    )


def test_oversampling_off_keeps_the_seed_argv_and_on_asks_k_plus_n(tmp_path, lite_url):
    seed = list(Service(aievobox_config(tmp_path, lite_url)).launch_spec("J", 8).argv)
    assert seed[seed.index("--rl-group-size") + 1] == "8"
    assert (
        list(
            Service(aievobox_config(tmp_path, lite_url, ROLLOUT_BUFFER_OVERSAMPLE="0"))
            .launch_spec("J", 8)
            .argv
        )
        == seed
    )
    over = list(
        Service(aievobox_config(tmp_path, lite_url, ROLLOUT_BUFFER_OVERSAMPLE="3"))
        .launch_spec("J", 8)
        .argv
    )
    assert over == [
        ("11" if i == seed.index("--rl-group-size") + 1 else a) for i, a in enumerate(seed)
    ]


def test_oversampling_serves_the_first_k_completed_and_clears_the_others_at_once(
    make, writer, proxy
):
    h = make(oversample=2)
    h.start(k=2)
    w = writer
    w.step("g", "s1", 1)  # s1 starts, never completes in time
    w.session("g", "s0", 2, reward=0.1)  # s0 completes first
    w.step("g", "s3", 1)
    w.session("g", "s2", 1, reward=0.9)  # s2 completes second: the group is ready (K=2)
    h.settle()
    s = h.stats()
    assert s["groups"]["ready"] == 1
    assert s["rows"]["dropped"] == {"oversampled": 2}  # s1's and s3's rows, read already
    assert proxy.wait_for(lambda p: cleared(p, "oversampled") == {"s1", "s3"})  # before any poll
    w.step("g", "s3", 2, completed=True, step_reward=0.5)  # s3 completes later: still not served
    w.step("g", "s1", 2)
    doc = h.poll()
    items = groups_of(doc)["g"]
    assert {i["extra_info"]["session_id"] for i in items} == {"s0", "s2"}
    assert doc["data"]["meta_info"]["group_stats"][0]["sessions"] == 2
    w.step("g", "s1", 3)  # after it was served
    h.settle()
    s = h.stats()
    assert s["rows"]["dropped"] == {"oversampled": 5}
    assert "incomplete_session_in_served_group" not in s["rows"]["dropped"]
    assert_balanced(s)
    upstream_accepts(doc)


def test_oversampling_bound_k_completed_is_ready_k_minus_one_is_not(make, writer):
    h = make(oversample=1)
    h.start(k=3)
    writer.group("short", 4, complete=2)  # 2 of K=3 completed
    writer.group("exact", 4, complete=3)
    assert list(groups_of(h.poll())) == ["exact"]
    assert h.stats()["groups"]["pending"] == 1


def sessions_served(doc: dict, gid: str) -> dict[str, list[int]]:
    """session -> the step_ids served for it (a whole session is 1..n)."""
    out: dict[str, list[int]] = {}
    for i in groups_of(doc).get(gid, []):
        out.setdefault(i["extra_info"]["session_id"], []).append(i["extra_info"]["steps"])
    return out


def test_a_session_dropped_as_oversampled_stays_out_when_k_is_raised(make, writer, proxy):
    """K raised on a running job sends a chosen group back to pending: the session it dropped as
    oversampled (its first rows accounted and cleared) must never come back, half, as a new
    session."""
    h = make(oversample=1)
    h.start(k=2)
    writer.step("g", "s2", 1)
    writer.session("g", "s0", 2, reward=0.1)
    writer.session("g", "s1", 2, reward=0.9)  # ready: s2's first row is dropped as oversampled
    h.settle()
    h.start(k=3)  # the same job, K raised: g needs a third session
    writer.step("g", "s2", 2, completed=True, step_reward=0.4)
    assert h.poll()["success"] is False  # s2 completing does not make it the third session
    writer.session("g", "s3", 2, reward=0.5)
    doc = h.poll()
    assert sessions_served(doc, "g") == {"s0": [1, 2], "s1": [1, 2], "s3": [1, 2]}
    s = h.stats()
    assert s["rows"]["dropped"] == {"oversampled": 2}
    assert_balanced(s)
    assert proxy.wait_for(lambda p: cleared(p, "oversampled") == {"s2"})


def test_a_session_first_seen_after_the_choice_stays_out_when_k_is_raised(make, writer, proxy):
    """A session whose first row comes after its group chose its K is dropped as oversampled; K
    raised later must not let it in with its later rows."""
    h = make(oversample=1)
    h.start(k=2)
    writer.session("g", "s0", 2, reward=0.1)
    writer.session("g", "s1", 2, reward=0.9)
    writer.step("g", "s2", 1)  # after the choice: oversampled
    h.settle()
    h.start(k=3)
    writer.step("g", "s2", 2, completed=True, step_reward=0.4)
    writer.session("g", "s3", 2, reward=0.5)
    doc = h.poll()
    assert sessions_served(doc, "g") == {"s0": [1, 2], "s1": [1, 2], "s3": [1, 2]}
    s = h.stats()
    assert s["rows"]["dropped"] == {"oversampled": 2}
    assert_balanced(s)


def test_k_lowered_on_a_running_job_cuts_a_ready_group_to_its_first_k(make, writer, proxy):
    h = make(oversample=1)
    h.start(k=3)
    writer.session("g", "s0", 2, reward=0.1)
    writer.session("g", "s1", 2, reward=0.9)
    writer.session("g", "s2", 2, reward=0.5)  # ready with three
    h.settle()
    h.start(k=2)
    doc = h.poll()
    assert sessions_served(doc, "g") == {"s0": [1, 2], "s1": [1, 2]}
    s = h.stats()
    assert s["rows"]["dropped"] == {"oversampled": 2}
    assert_balanced(s)
    assert proxy.wait_for(lambda p: cleared(p, "oversampled") == {"s2"})


def test_a_partial_group_reaching_k_while_it_waits_serves_k_sessions(make, writer, proxy):
    """Ready short of K at the TTL, a group with over-sampling gets its other sessions' completions:
    it is served with the first K, never with K + N."""
    h = make(oversample=2, ttl_s=0.3, min_group_size=2)
    h.start(k=3)
    for i in range(5):
        writer.step("g", f"s{i}", 1)
    for i in range(2):
        writer.step("g", f"s{i}", 2, completed=True, step_reward=0.1 * i)
    wait_until(lambda: h.stats()["groups"]["ready"] == 1, 10, "the partial group ready")
    for i in range(2, 5):
        writer.step("g", f"s{i}", 2, completed=True, step_reward=0.1 * i)
    doc = h.poll()
    assert sessions_served(doc, "g") == {"s0": [1, 2], "s1": [1, 2], "s2": [1, 2]}
    assert doc["data"]["meta_info"]["partial_groups"] == []
    assert "partial_group" not in doc["data"]["data"][0]["extra_info"]
    s = h.stats()
    assert s["rows"]["dropped"] == {"oversampled": 4}
    assert_balanced(s)
    assert proxy.wait_for(lambda p: cleared(p, "oversampled") == {"s3", "s4"})


# -- partial groups at the TTL
# --------------------------------------------------------------------------------


def test_partial_groups_off_drops_at_the_ttl(make, writer):
    h = make(ttl_s=0.3)
    h.start(k=4)
    writer.group("half", 4, complete=2)
    wait_until(
        lambda: h.stats()["groups"]["dropped"].get("incomplete_group_ttl") == 1, 10, "TTL drop"
    )
    assert h.poll()["success"] is False


def test_partial_groups_at_the_ttl_bound_and_one_past(make, writer, proxy):
    h = make(ttl_s=0.3, min_group_size=2)
    h.start(k=4)
    half = writer.group("half", 4, complete=2)  # 2 completed >= 2: served partial
    writer.group("one", 4, complete=1)  # 1 completed < 2: dropped at the TTL
    writer.group("whole", 4)  # complete: served as usual
    wait_until(
        lambda: h.stats()["groups"]["dropped"].get("incomplete_group_ttl") == 1, 10, "TTL decisions"
    )
    wait_until(lambda: h.stats()["groups"]["ready"] == 2, 10, "the partial group ready")
    doc = h.poll()
    groups = groups_of(doc)
    assert sorted(groups) == ["half", "whole"]
    assert {i["extra_info"]["session_id"] for i in groups["half"]} == set(half[:2])
    assert all(i["extra_info"]["partial_group"] is True for i in groups["half"])
    assert all("partial_group" not in i["extra_info"] for i in groups["whole"])
    assert doc["data"]["meta_info"]["partial_groups"] == ["half"]
    assert proxy.wait_for(
        lambda p: cleared(p, "incomplete_session_in_served_group") == set(half[2:])
    )
    assert_balanced(h.stats())
    upstream_accepts(doc)


def test_min_group_size_of_k_or_more_is_off(make, writer):
    h = make(ttl_s=0.3, min_group_size=4)
    h.start(k=4)
    writer.group("three", 4, complete=3)
    wait_until(
        lambda: h.stats()["groups"]["dropped"].get("incomplete_group_ttl") == 1, 10, "TTL drop"
    )


# -- serve order
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "order, expected",
    [
        ("ready", ["a5", "b1", "c3", "d1"]),
        ("oldest_version", ["b1", "d1", "c3", "a5"]),  # ties (b1, d1) by readiness
        ("newest_version", ["a5", "c3", "b1", "d1"]),
    ],
)
def test_serve_order(make, writer, order, expected):
    h = make(serve_order=order)
    h.start(k=2)
    for gid in ("a5", "b1", "c3", "d1"):
        writer.group(gid, 2, env_state=version(int(gid[1])))
    h.settle()
    got = []
    for _ in range(4):
        got += served_groups(h, max_groups=1)
    assert got == expected
    assert_balanced(h.stats())


def test_a_group_given_back_by_a_poll_keeps_its_place_in_the_version_order(make, writer):
    h = make(
        serve_order="oldest_version", max_response_bytes=1024
    )  # one group per poll, the next given back
    h.start(k=2)
    for gid in ("a5", "b1", "c3", "d1"):
        writer.group(gid, 2, env_state=version(int(gid[1])))
    h.settle()
    got = []
    for _ in range(4):
        got += served_groups(h)
    assert got == ["b1", "d1", "c3", "a5"]


# -- figures
# --------------------------------------------------------------------------------------------------


def test_group_figures_in_meta_info_stats_and_metrics(make, writer):
    h = make(drop_zero_variance=True)
    h.start(k=2)
    writer.session("g", "g-a", 2, reward=0.25, env_state=version(3))
    writer.session("g", "g-b", 4, reward=0.75, env_state=version(4))
    writer.session("flat", "f-a", 1, reward=1.0)
    writer.session("flat", "f-b", 3, reward=1.0)
    doc = h.poll()
    [st] = doc["data"]["meta_info"]["group_stats"]
    assert st["group_id"] == "g" and st["sessions"] == 2 and st["items"] == 6
    assert st["reward_mean"] == pytest.approx(0.5) and st["reward_std"] == pytest.approx(0.25)
    assert (st["reward_min"], st["reward_max"]) == (0.25, 0.75)
    assert (st["weight_version_min"], st["weight_version_max"]) == (3, 4)
    assert st["steps_mean"] == 3.0
    assert st["wait_s"] >= 0 and st["age_s"] >= 0
    figures = h.stats()["figures"]
    assert figures["served"] == {"groups": 1, "steps_per_session": 3.0, "terminal_reward_mean": 0.5}
    assert figures["dropped"]["zero_variance"] == {
        "groups": 1,
        "steps_per_session": 2.0,
        "terminal_reward_mean": 1.0,
    }
    text = h.client.get("/metrics").get_data(as_text=True)
    assert (
        'rollout_buffer_group_steps_per_session{job_session="job1",outcome="served",reason=""} 3.0'
        in text
    )
    mean = "rollout_buffer_group_terminal_reward_mean"
    assert f'{mean}{{job_session="job1",outcome="dropped",reason="zero_variance"}} 1.0' in text
    # one group never moves the current version (two must agree)
    assert 'rollout_buffer_weight_version{job_session="job1",kind="current"} 0' in text


def test_a_replayed_batch_carries_the_same_figures_and_partial_flags(make, writer):
    h = make(ttl_s=0.3, min_group_size=1)
    h.start(k=3)
    writer.group("short", 3, complete=1)
    wait_until(lambda: h.stats()["groups"]["ready"] == 1, 10, "the partial group ready")
    first = h.poll(request_id="r1")
    again = h.poll(request_id="r1")
    assert again["data"]["meta_info"]["replayed"] is True
    assert again["data"]["data"] == first["data"]["data"]
    for key in ("group_stats", "filtered", "partial_groups"):
        assert again["data"]["meta_info"][key] == first["data"]["meta_info"][key]
    assert first["data"]["meta_info"]["partial_groups"] == ["short"]


def test_every_policy_on_keeps_the_accounting_and_the_upstream_contract(make, writer, proxy):
    h = make(
        max_off_policy=3,
        drop_zero_variance=True,
        oversample=1,
        ttl_s=0.4,
        min_group_size=2,
        serve_order="oldest_version",
    )
    h.start(k=3)
    h.poll(current_weight_version=7)  # the trainer's version: one group alone never moves it
    writer.group("ok", 4, complete=3, env_state=version(7))
    writer.group("stale", 4, complete=3, env_state=version(2))
    for i in range(3):
        writer.session("flat", f"flat-{i}", 2, reward=0.5, env_state=version(7))
    writer.group("partial", 4, complete=2, env_state=version(6))
    wait_until(lambda: h.stats()["groups"]["ready"] == 2, 10, "ok and partial ready")
    doc = h.poll()
    upstream_accepts(doc)
    assert [s["group_id"] for s in doc["data"]["meta_info"]["group_stats"]] == ["partial", "ok"]
    s = h.stats()
    assert s["groups"]["dropped"] == {"stale": 1, "zero_variance": 1}
    assert_balanced(s)
    assert proxy.wait_for(
        lambda p: (
            cleared_groups(p, "stale") == {"stale"}
            and cleared_groups(p, "zero_variance") == {"flat"}
            and cleared_groups(p, "oversampled") == {"ok"}
        )
    )


def test_policy_settings_are_validated_at_startup(lite_url):
    for name, value in (
        ("MAX_OFF_POLICY", "-1"),
        ("OVERSAMPLE", "x"),
        ("MIN_GROUP_SIZE", "0"),
        ("SERVE_ORDER", "random"),
        ("DROP_ZERO_VARIANCE", "maybe"),
    ):
        with pytest.raises(Exception) as err:
            Config.from_env({"AIEVOBOX_DB_URL": lite_url, f"ROLLOUT_BUFFER_{name}": value})
        assert f"ROLLOUT_BUFFER_{name}" in str(err.value)
    assert (
        Config.from_env(
            {"AIEVOBOX_DB_URL": lite_url, "ROLLOUT_BUFFER_MAX_OFF_POLICY": ""}
        ).max_off_policy
        is None
    )


PART_LAUNCHER = """\
import argparse, sys
sys.path[:0] = [{repo!r}, {tests!r}]
from support import Writer
p = argparse.ArgumentParser()
p.add_argument("--db-path"); p.add_argument("--job-id"); p.add_argument("--rl-group-size", type=int)
a = p.parse_args()
w = Writer(a.db_path, a.job_id)
w.group("g-two", a.rl_group_size, complete=2)
w.group("g-one", a.rl_group_size, complete=1)
w.close()
"""


def test_partial_groups_when_the_launcher_exits(make, tmp_path):
    """Once the launcher has exited its incomplete groups can never complete: the same rule as at
    the TTL."""
    script = tmp_path / "part_launcher.py"
    script.write_text(PART_LAUNCHER.format(repo=str(ROOT), tests=str(ROOT / "tests")))
    h = make(min_group_size=2, launcher_cmd=(sys.executable, str(script), "--db-path", "{db_url}"))
    h.start(k=3, job="jobP")
    s = wait_until(
        lambda: (lambda s: s if s.get("groups", {}).get("dropped") else None)(h.stats()),
        15,
        "the launcher_exited decision",
    )
    assert s["groups"]["dropped"] == {"launcher_exited": 1} and s["groups"]["ready"] == 1
    doc = h.poll()
    assert list(groups_of(doc)) == ["g-two"] and doc["data"]["meta_info"]["partial_groups"] == [
        "g-two"
    ]
    assert_balanced(h.stats())
