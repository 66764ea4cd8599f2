"""Salvage (issue 38): with ROLLOUT_BUFFER_SALVAGE=truncate a group whose sessions ended without a
result (the step cap, the launcher's exit, the TTL), each with a row, is served with them truncated;
a group with a listed session that never wrote a row is dropped as before. Both backends, a real
HTTP server for the proxy, a real launcher subprocess where the launcher matters."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest
from fakes.fake_proxy import FakeProxy
from support import Writer, assert_balanced, groups_of, wait_until

from rollout_buffer.storage.db import connect
from rollout_buffer.tools import export as export_mod
from rollout_buffer.tools.stats_table import format_stats

FAKE_LAUNCHER = Path(__file__).resolve().parent.parent / "fakes" / "fake_launcher.py"
MAX_STEPS = 3


@pytest.fixture
def proxy(fake_proxy: FakeProxy) -> FakeProxy:
    return fake_proxy


def start(
    harness_factory: Any, db_url: str, proxy: FakeProxy, mode: str = "hang", **overrides: Any
) -> Any:
    """A salvaging service whose launcher (a fake one) gets ``--max-steps 3``."""
    cmd = (sys.executable, str(FAKE_LAUNCHER), "--mode", mode, "--max-steps", str(MAX_STEPS))
    overrides.setdefault("launch_grace_s", 0.0)
    overrides.setdefault("salvage", "truncate")
    return harness_factory(
        db_url,
        launcher="command",
        launcher_cmd=cmd,
        proxy_host="127.0.0.1",
        proxy_port=proxy.port,
        **overrides,
    )


def completed_session(writer: Writer, group: str, sid: str, reward: float) -> None:
    """A session that ends with a result at --message-cut 0: one trainable row, its last."""
    writer.session(group, sid, 1, trainable=False, complete=False)
    writer.step(group, sid, 2, completed=True, step_reward=reward)


def cleared(proxy: FakeProxy) -> dict[str, set[str]]:
    """Sessions cleared at the proxy, by reason."""
    out: dict[str, set[str]] = {}
    for call in proxy.calls:
        out.setdefault(call["reason"], set()).update(call["session_ids"])
    return out


def by_session(items: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for item in items:
        out.setdefault(item["extra_info"]["session_id"], []).append(item)
    return out


def test_a_step_capped_session_is_served_truncated_from_its_last_row(
    harness_factory: Any, db_url: str, writer: Writer, proxy: FakeProxy
) -> None:
    h = start(harness_factory, db_url, proxy, salvage_reward=-0.5)
    h.start(k=3)
    writer.schedule("g", ["ok-1", "ok-2", "capped"])
    completed_session(writer, "g", "ok-1", 1.0)
    completed_session(writer, "g", "ok-2", 0.25)
    # the capped session: 3 rows, none trainable, none terminal (SPEC §2 at --message-cut 0)
    capped_pks = writer.session("g", "capped", MAX_STEPS, trainable=False, complete=False)
    started = time.monotonic()
    assert wait_until(lambda: h.stats()["groups"]["ready"] == 1, 10)
    assert time.monotonic() - started < 10  # the TTL (1,800 s) had nothing to do with it
    doc = h.poll()
    items = groups_of(doc)["g"]
    sessions = by_session(items)
    assert sorted(sessions) == ["capped", "ok-1", "ok-2"]
    (item,) = sessions["capped"]  # one item, from its last row
    assert item["extra_info"]["step_pk"] == capped_pks[-1]
    assert item["extra_info"]["steps"] == MAX_STEPS
    assert item["messages"][-1] == {"role": "assistant", "content": "answer capped 3"}
    assert [m["content"] for m in item["messages"][:2]] == ["sys", "task g"]
    assert len(item["messages"]) == 2 + 2 * (MAX_STEPS - 1) + 1  # its whole history
    assert item["reward"] == -0.5 and item["extra_info"]["terminal_reward"] == -0.5
    assert item["extra_info"]["finish_reason"] == "length"
    assert item["extra_info"]["truncated"] is True
    assert item["extra_info"]["salvaged"] == "step_cap"
    assert item["extra_info"]["is_session_completed"] is False
    for sid, reward in (("ok-1", 1.0), ("ok-2", 0.25)):
        (done,) = sessions[sid]
        assert done["reward"] == reward and "salvaged" not in done["extra_info"]
        assert done["extra_info"]["finish_reason"] == "stop"
    stats = h.stats()
    assert stats["salvaged"]["sessions"] == {"step_cap": 1}
    assert stats["salvaged"]["groups"] == {"step_cap": 1}
    assert stats["salvaged"]["generation_seconds_kept"] >= 0
    assert stats["groups"]["served"] == 1 and stats["groups"]["dropped_total"] == 0
    # the served non-trainable row counts as read and served
    assert stats["rows"]["served"] == 3 and stats["rows"]["read"] == 3
    assert_balanced(stats)
    # a salvaged session is served, not dropped: never cleared at the proxy
    h.settle()
    assert all("capped" not in sessions for sessions in cleared(proxy).values())
    assert h.client.get("/status").get_json()["stats"]["salvaged"] == stats["salvaged"]
    page = h.client.get("/").get_data(as_text=True)
    assert 'id="salvaged"' in page and "s.salvaged" in page  # the page shows them
    metrics = h.client.get("/metrics").get_data(as_text=True)
    for kind in ("sessions", "groups"):
        name = f"rollout_buffer_{kind}_salvaged_total"
        assert f'{name}{{job_session="job1",reason="step_cap"}} 1' in metrics
        assert f'{name}{{job_session="job1",reason="launcher_exited"}} 0' in metrics


def test_without_salvage_the_same_group_is_dropped(
    harness_factory: Any, db_url: str, writer: Writer, proxy: FakeProxy
) -> None:
    """Off is the default: the service stays a drop-in (the group is dropped as before)."""
    h = start(harness_factory, db_url, proxy, salvage="off")
    h.start(k=3)
    writer.schedule("g", ["ok-1", "ok-2", "capped"])
    completed_session(writer, "g", "ok-1", 1.0)
    completed_session(writer, "g", "ok-2", 0.25)
    h.settle()
    writer.session("g", "capped", MAX_STEPS, trainable=False, complete=False)
    h.settle()
    stats = h.stats()
    assert stats["groups"]["dropped"] == {"session_without_result": 1}
    assert stats["salvaged"] == {"sessions": {}, "groups": {}, "generation_seconds_kept": 0.0}
    assert not h.poll()["success"]


def test_a_slow_session_is_never_taken_for_ended_before_its_group_can_be_salvaged(
    harness_factory: Any, db_url: str, writer: Writer, proxy: FakeProxy
) -> None:
    """A session at the step cap waits for its siblings: one still running (rows below the cap)
    keeps the group pending; once it completes, the group is served with the capped one."""
    h = start(harness_factory, db_url, proxy)
    h.start(k=3)
    writer.schedule("g", ["ok-1", "slow", "capped"])
    completed_session(writer, "g", "ok-1", 1.0)
    writer.session("g", "capped", MAX_STEPS, trainable=False, complete=False)
    writer.session("g", "slow", 2, trainable=False, complete=False)
    h.settle()
    h.settle()
    stats = h.stats()
    assert stats["groups"]["pending"] == 1 and stats["groups"]["ready"] == 0, stats["groups"]
    assert not h.poll()["success"]
    writer.step("g", "slow", 3, completed=True, step_reward=0.5)
    assert wait_until(lambda: h.stats()["groups"]["ready"] == 1, 10)
    sessions = by_session(groups_of(h.poll())["g"])
    assert sessions["slow"][0]["reward"] == 0.5
    assert sessions["capped"][0]["extra_info"]["salvaged"] == "step_cap"
    assert_balanced(h.stats())


def test_a_session_whose_launcher_exited_is_salvaged_and_one_without_rows_drops_its_group(
    harness_factory: Any, db_url: str, writer: Writer, proxy: FakeProxy
) -> None:
    h = start(harness_factory, db_url, proxy, mode="hang")
    # rows written before the launcher starts: its exit then comes after all of them
    writer.schedule("kept", ["k-1", "k-2", "k-crashed"])
    writer.schedule("lost", ["l-1", "l-2", "l-silent"])
    for gid in ("kept", "lost"):
        completed_session(writer, gid, f"{gid[0]}-1", 1.0)
        completed_session(writer, gid, f"{gid[0]}-2", 0.0)
    writer.session("kept", "k-crashed", 2, trainable=False, complete=False)  # below the cap
    h.start(k=3)
    h.settle()
    assert h.stats()["groups"]["pending"] == 2  # the launcher still runs: nothing is decided
    h.client.post("/stop_rollout")  # the launcher ends: its sessions can never complete
    assert wait_until(lambda: h.stats()["groups"]["dropped"].get("launcher_exited") == 1, 20)
    stats = h.stats()
    assert stats["groups"]["ready"] == 1
    assert stats["salvaged"]["sessions"] == {}  # counted when served
    doc = h.poll()
    got = groups_of(doc)
    assert set(got) == {"kept"}
    sessions = by_session(got["kept"])
    (item,) = sessions["k-crashed"]
    assert item["extra_info"]["finish_reason"] == "abort"
    assert item["extra_info"]["salvaged"] == "launcher_exited"
    assert item["extra_info"]["steps"] == 2 and item["reward"] == 0.0
    stats = h.stats()
    assert stats["salvaged"]["sessions"] == {"launcher_exited": 1}
    assert stats["salvaged"]["groups"] == {"launcher_exited": 1}
    assert_balanced(stats)
    assert wait_until(lambda: "launcher_exited" in cleared(proxy), 10)
    assert cleared(proxy)["launcher_exited"] == {"l-1", "l-2", "l-silent"}


def test_a_session_is_salvaged_at_the_ttl_and_a_silent_one_drops_its_group(
    harness_factory: Any, db_url: str, writer: Writer, proxy: FakeProxy
) -> None:
    h = start(harness_factory, db_url, proxy, ttl_s=1.5, min_group_size=2)
    h.start(k=3)
    writer.schedule("kept", ["k-1", "k-2", "k-stuck"])
    writer.schedule("lost", ["l-1", "l-2", "l-silent"])
    for gid in ("kept", "lost"):
        completed_session(writer, gid, f"{gid[0]}-1", 1.0)
        completed_session(writer, gid, f"{gid[0]}-2", 0.0)
    writer.session("kept", "k-stuck", 1, trainable=False, complete=False)  # waits on a model call
    h.settle()
    assert h.stats()["groups"]["pending"] == 2 and not h.poll()["success"]  # not before the TTL
    assert wait_until(lambda: h.stats()["groups"]["pending"] == 0, 15)
    doc = h.poll()
    got = groups_of(doc)
    # salvage goes first; the minimum group size serves the group it cannot salvage
    assert set(got) == {"kept", "lost"}
    (item,) = by_session(got["kept"])["k-stuck"]
    assert item["extra_info"]["salvaged"] == "incomplete_group_ttl"
    assert item["extra_info"]["finish_reason"] == "abort"
    assert all("salvaged" not in i["extra_info"] for i in got["lost"])
    assert all(i["extra_info"].get("partial_group") for i in got["lost"])
    stats = h.stats()
    assert stats["salvaged"]["groups"] == {"incomplete_group_ttl": 1}
    assert stats["groups"]["partial"] == 1
    assert_balanced(stats)


def test_a_session_with_no_row_drops_its_group_at_the_ttl(
    harness_factory: Any, db_url: str, writer: Writer, proxy: FakeProxy
) -> None:
    h = start(harness_factory, db_url, proxy, ttl_s=1.0)
    h.start(k=3)
    writer.schedule("lost", ["l-1", "l-2", "l-silent"])
    completed_session(writer, "lost", "l-1", 1.0)
    completed_session(writer, "lost", "l-2", 0.0)
    assert wait_until(lambda: h.stats()["groups"]["dropped"].get("incomplete_group_ttl") == 1, 15)
    assert wait_until(lambda: "incomplete_group_ttl" in cleared(proxy), 10)
    assert cleared(proxy)["incomplete_group_ttl"] == {"l-1", "l-2", "l-silent"}
    stats = h.stats()
    assert stats["salvaged"]["groups"] == {}
    assert_balanced(stats)
    assert not h.poll()["success"]


def test_a_late_terminal_row_of_a_salvaged_session_is_a_late_row_of_a_served_group(
    harness_factory: Any, db_url: str, writer: Writer, proxy: FakeProxy
) -> None:
    h = start(harness_factory, db_url, proxy)
    h.start(k=2)
    writer.schedule("g", ["ok", "capped"])
    completed_session(writer, "g", "ok", 1.0)
    writer.session("g", "capped", MAX_STEPS, trainable=False, complete=False)
    assert wait_until(lambda: h.stats()["groups"]["ready"] == 1, 10)
    assert set(groups_of(h.poll())) == {"g"}
    late = writer.step("g", "capped", MAX_STEPS + 1, completed=True, step_reward=1.0)
    h.settle()
    stats = h.stats()
    assert stats["rows"]["dropped"] == {"late_rows_from_served_groups": 1}, stats["rows"]
    assert_balanced(stats)
    assert wait_until(lambda: "late_rows_from_served_groups" in cleared(proxy), 10)
    assert cleared(proxy)["late_rows_from_served_groups"] == {"capped"}
    assert not h.poll()["success"]  # never served
    assert late > 0


def test_at_message_cut_above_0_a_truncated_sessions_items_are_its_trainable_rows(
    harness_factory: Any, db_url: str, writer: Writer, proxy: FakeProxy
) -> None:
    h = start(harness_factory, db_url, proxy, message_cut=2)
    h.start(k=2)
    writer.schedule("g", ["ok", "capped"])
    writer.session("g", "ok", 2, reward=0.75)  # every row trainable
    capped = writer.session("g", "capped", MAX_STEPS, complete=False)
    assert wait_until(lambda: h.stats()["groups"]["ready"] == 1, 10)
    sessions = by_session(groups_of(h.poll())["g"])
    items = sessions["capped"]
    assert [i["extra_info"]["step_pk"] for i in items] == capped
    assert all(i["reward"] == 0.0 for i in items)
    assert [i["extra_info"].get("salvaged") for i in items] == [None, None, "step_cap"]
    assert [i["extra_info"]["finish_reason"] for i in items] == ["stop", "stop", "length"]
    assert items[-1]["extra_info"]["truncated"] is True
    assert all(i["reward"] == 0.75 for i in sessions["ok"])
    stats = h.stats()
    assert stats["rows"]["served"] == 5 and stats["salvaged"]["sessions"] == {"step_cap": 1}
    assert_balanced(stats)


def test_a_salvaged_batch_is_sent_again_byte_for_byte_and_exported(
    harness_factory: Any, db_url: str, writer: Writer, proxy: FakeProxy, tmp_path: Path
) -> None:
    """A retried poll (same request_id) gets the salvaged group as first sent: its truncated
    sessions rebuilt from the recorded rows, with their reasons and rewards."""
    h = start(harness_factory, db_url, proxy, ttl_s=1.0, salvage_reward=-1.0)
    h.start(k=3)
    writer.schedule("g", ["ok", "capped", "stuck"])
    completed_session(writer, "g", "ok", 1.0)
    writer.session("g", "capped", MAX_STEPS, trainable=False, complete=False)
    writer.session("g", "stuck", 1, trainable=False, complete=False)
    assert wait_until(lambda: h.stats()["groups"]["ready"] == 1, 15)
    h.settle()
    first = h.client.post("/get_rollout_data", json={"request_id": "r-1"})
    again = h.client.post("/get_rollout_data", json={"request_id": "r-1"})
    assert first.status_code == again.status_code == 200
    doc = first.get_json()
    sessions = by_session(groups_of(doc)["g"])
    assert sessions["capped"][0]["extra_info"]["salvaged"] == "step_cap"
    assert sessions["stuck"][0]["extra_info"]["salvaged"] == "incomplete_group_ttl"
    assert sessions["stuck"][0]["reward"] == -1.0
    replayed = again.get_json()
    assert replayed["data"]["meta_info"].get("replayed") is True
    assert replayed["data"]["data"] == doc["data"]["data"]
    stats = h.stats()
    assert stats["salvaged"]["sessions"] == {"step_cap": 1, "incomplete_group_ttl": 1}
    assert stats["salvaged"]["groups"] == {"incomplete_group_ttl": 1}
    assert_balanced(stats)
    table = format_stats(stats)
    assert "salvaged" in table and "incomplete_group_ttl: 1" in table
    # the export shows the salvaged sessions, and the items exactly as the trainer got them
    db = connect(db_url)
    try:
        export_mod.export(db, db, "job1", str(tmp_path / "x.jsonl"))
    finally:
        db.close()
    (record,) = export_mod.read_export(str(tmp_path / "x.jsonl"))
    assert record["status"] == "served"
    assert record["salvaged"] == {"capped": "step_cap", "stuck": "incomplete_group_ttl"}
    assert record["items"] == doc["data"]["data"]
    outcomes = {
        step["step_pk"]: step["outcome"] for sess in record["sessions"] for step in sess["steps"]
    }
    assert set(outcomes.values()) == {"served"}


def test_a_truncated_session_that_completes_before_its_group_is_served_is_served_completed(
    harness_factory: Any, db_url: str, writer: Writer, proxy: FakeProxy
) -> None:
    """Its terminal row came while its salvaged group waited for a poll: the session is served as
    any completed one (its terminal row, its reward), and the group is salvaged no more."""
    h = start(harness_factory, db_url, proxy)
    h.start(k=2)
    writer.schedule("g", ["ok", "capped"])
    completed_session(writer, "g", "ok", 1.0)
    writer.session("g", "capped", MAX_STEPS, trainable=False, complete=False)
    assert wait_until(lambda: h.stats()["groups"]["ready"] == 1, 10)
    terminal = writer.step("g", "capped", MAX_STEPS + 1, completed=True, step_reward=0.5)
    h.settle()
    (item,) = by_session(groups_of(h.poll())["g"])["capped"]
    assert item["extra_info"]["step_pk"] == terminal and item["reward"] == 0.5
    assert "salvaged" not in item["extra_info"]
    stats = h.stats()
    assert stats["salvaged"]["groups"] == {} and stats["rows"]["served"] == 2
    assert_balanced(stats)


def test_a_truncated_sessions_last_row_that_cannot_be_an_item_drops_its_group_accounted(
    harness_factory: Any, db_url: str, writer: Writer, proxy: FakeProxy
) -> None:
    """A hostile last row (its messages are not JSON): the group is dropped as malformed_row,
    the row is rejected with its reason, and the accounting balances (it was read to build it)."""
    h = start(harness_factory, db_url, proxy)
    h.start(k=2)
    writer.schedule("g", ["ok", "capped"])
    completed_session(writer, "g", "ok", 1.0)
    writer.session("g", "capped", MAX_STEPS - 1, trainable=False, complete=False)
    bad = writer.step("g", "capped", MAX_STEPS, trainable=False, messages="{not json")
    assert wait_until(lambda: h.stats()["groups"]["ready"] == 1, 10)
    assert not h.poll()["success"]
    stats = h.stats()
    assert stats["groups"]["dropped"] == {"malformed_row": 1}, stats["groups"]
    assert stats["rows"]["rejected_total"] == 1 and stats["rows"]["read"] == 2, stats["rows"]
    assert stats["salvaged"]["groups"] == {}
    assert_balanced(stats)
    assert wait_until(lambda: "malformed_row" in cleared(proxy), 10)
    assert cleared(proxy)["malformed_row"] == {"ok", "capped"}
    assert bad > 0


def test_without_job_environments_a_groups_sessions_are_those_its_rows_show(
    harness_factory: Any, db_url: str, writer: Writer, proxy: FakeProxy
) -> None:
    """No listing: a group whose K sessions all wrote rows is salvaged at the step cap; one with
    fewer sessions seen than K cannot be (the missing one may not have started) and waits."""
    h = start(harness_factory, db_url, proxy)
    h.start(k=2)
    completed_session(writer, "seen", "s-ok", 1.0)
    writer.session("seen", "s-capped", MAX_STEPS, trainable=False, complete=False)
    writer.session("short", "t-capped", MAX_STEPS, trainable=False, complete=False)
    assert wait_until(lambda: h.stats()["groups"]["ready"] == 1, 10)
    got = groups_of(h.poll())
    assert set(got) == {"seen"}
    assert by_session(got["seen"])["s-capped"][0]["extra_info"]["salvaged"] == "step_cap"
    stats = h.stats()
    assert stats["groups"]["dropped_total"] == 0 and stats["sessions"]["known"] == 3
    assert_balanced(stats)


def test_a_redelivered_salvaged_group_keeps_its_truncated_sessions(
    harness_factory: Any, db_url: str, writer: Writer, proxy: FakeProxy
) -> None:
    """The trainer crashed before its checkpoint held the group: it is delivered again, rebuilt
    from its record, with the same truncated session, reason and reward."""
    h = start(harness_factory, db_url, proxy, salvage_reward=-1.0)
    h.start(k=2)
    writer.schedule("g", ["ok", "capped"])
    completed_session(writer, "g", "ok", 1.0)
    writer.session("g", "capped", MAX_STEPS, trainable=False, complete=False)
    assert wait_until(lambda: h.stats()["groups"]["ready"] == 1, 10)
    first = by_session(groups_of(h.poll())["g"])
    r = h.start(k=2, restart_training=False, skip_instance_ids=["other"])
    assert r["redelivery"]["queued"] == 1, r
    again = by_session(groups_of(h.poll())["g"])
    (item,) = again["capped"]
    assert item["extra_info"]["redelivered"] is True
    assert item["extra_info"]["salvaged"] == "step_cap" and item["reward"] == -1.0
    for sid in ("ok", "capped"):
        (a,), (b,) = first[sid], again[sid]
        assert a["messages"] == b["messages"] and a["reward"] == b["reward"]
        assert {k: v for k, v in a["extra_info"].items() if k != "redelivered"} == {
            k: v for k, v in b["extra_info"].items() if k != "redelivered"
        }
    assert_balanced(h.stats())


def test_a_database_error_reading_the_last_rows_gives_the_group_back(
    harness_factory: Any, db_url: str, writer: Writer, proxy: FakeProxy
) -> None:
    """The source fails while a poll reads a truncated session's last row: the poll fails, and
    the salvaged group it had taken goes back to the ready queue (it was lost, taken for ever)."""
    h = start(harness_factory, db_url, proxy)
    h.start(k=2)
    writer.schedule("g", ["ok", "capped"])
    completed_session(writer, "g", "ok", 1.0)
    capped = writer.session("g", "capped", MAX_STEPS, trainable=False, complete=False)
    assert wait_until(lambda: h.stats()["groups"]["ready"] == 1, 10)
    h.settle()
    db = connect(db_url)
    try:
        db.execute("ALTER TABLE session_steps RENAME TO session_steps_away")
        try:
            failed = h.client.post("/get_rollout_data", json={})
        finally:
            db.execute("ALTER TABLE session_steps_away RENAME TO session_steps")
    finally:
        db.close()
    assert failed.status_code >= 500 and failed.get_json()["success"] is False
    assert h.stats()["groups"]["ready"] == 1
    (item,) = by_session(groups_of(h.poll())["g"])["capped"]
    assert item["extra_info"]["step_pk"] == capped[-1]
    assert item["extra_info"]["salvaged"] == "step_cap"
    assert_balanced(h.stats())


def test_a_salvaged_group_is_served_with_k_sessions_the_others_cleared(
    harness_factory: Any, db_url: str, writer: Writer, proxy: FakeProxy
) -> None:
    """Over-sampling (the launcher runs K + 1 sessions): one completed and two at the step cap.
    The group is served with K sessions, the completed one and one truncated; the other truncated
    session is not served, and is cleared at the proxy with the group (it had no trainable row).
    A retried poll gets the same batch."""
    h = start(harness_factory, db_url, proxy, oversample=1)
    h.start(k=2)
    writer.schedule("g", ["ok", "capped-1", "capped-2"])
    completed_session(writer, "g", "ok", 1.0)
    first = writer.session("g", "capped-1", MAX_STEPS, trainable=False, complete=False)
    writer.session("g", "capped-2", MAX_STEPS, trainable=False, complete=False)
    assert wait_until(lambda: h.stats()["groups"]["prebuilt"] == 1, 10)  # built before the poll
    doc = h.client.post("/get_rollout_data", json={"request_id": "r-1"}).get_json()
    sessions = by_session(groups_of(doc)["g"])
    assert sorted(sessions) == ["capped-1", "ok"]
    assert sessions["capped-1"][0]["extra_info"]["step_pk"] == first[-1]
    stats = h.stats()
    assert stats["salvaged"]["sessions"] == {"step_cap": 1}
    assert stats["rows"]["served"] == 2
    assert_balanced(stats)
    assert wait_until(lambda: "incomplete_session_in_served_group" in cleared(proxy), 10)
    assert cleared(proxy) == {"incomplete_session_in_served_group": {"capped-2"}}
    again = h.client.post("/get_rollout_data", json={"request_id": "r-1"}).get_json()
    assert again["data"]["data"] == doc["data"]["data"]


def test_a_replayed_salvaged_group_at_message_cut_above_0_keeps_its_k_sessions(
    harness_factory: Any, db_url: str, writer: Writer, proxy: FakeProxy
) -> None:
    """The truncated session beyond K has trainable rows (recorded as the group's other rows): a
    retried poll rebuilds the group with the same K sessions, not with it as a truncated one."""
    h = start(harness_factory, db_url, proxy, oversample=1, message_cut=2)
    h.start(k=2)
    writer.schedule("g", ["ok", "capped-1", "capped-2"])
    writer.session("g", "ok", 2, reward=0.75)
    writer.session("g", "capped-1", MAX_STEPS, complete=False)
    surplus = writer.session("g", "capped-2", MAX_STEPS, complete=False)
    assert wait_until(lambda: h.stats()["groups"]["ready"] == 1, 10)
    doc = h.client.post("/get_rollout_data", json={"request_id": "r-1"}).get_json()
    assert sorted(by_session(groups_of(doc)["g"])) == ["capped-1", "ok"]
    stats = h.stats()
    assert stats["rows"]["dropped"] == {"incomplete_session_in_served_group": len(surplus)}
    assert_balanced(stats)
    again = h.client.post("/get_rollout_data", json={"request_id": "r-1"}).get_json()
    assert again["data"]["meta_info"].get("replayed") is True
    assert again["data"]["data"] == doc["data"]["data"]


def test_with_over_sampling_a_truncated_sessions_late_row_is_a_late_row_of_a_served_group(
    harness_factory: Any, db_url: str, writer: Writer, proxy: FakeProxy
) -> None:
    """Over-sampling counts a served group's late rows as its unserved sessions' (oversampled):
    the late terminal row of a session it served truncated is still a late row of a served group,
    cleared with that reason; the unserved session's is oversampled."""
    h = start(harness_factory, db_url, proxy, oversample=1)
    h.start(k=2)
    writer.schedule("g", ["ok", "capped-1", "capped-2"])
    completed_session(writer, "g", "ok", 1.0)
    writer.session("g", "capped-1", MAX_STEPS, trainable=False, complete=False)
    writer.session("g", "capped-2", MAX_STEPS, trainable=False, complete=False)
    assert wait_until(lambda: h.stats()["groups"]["ready"] == 1, 10)
    assert sorted(by_session(groups_of(h.poll())["g"])) == ["capped-1", "ok"]
    writer.step("g", "capped-1", MAX_STEPS + 1, completed=True, step_reward=1.0)
    writer.step("g", "capped-2", MAX_STEPS + 1, completed=True, step_reward=1.0)
    h.settle()
    stats = h.stats()
    assert stats["rows"]["dropped"] == {"late_rows_from_served_groups": 1, "oversampled": 1}
    assert_balanced(stats)
    assert wait_until(lambda: "late_rows_from_served_groups" in cleared(proxy), 10)
    assert cleared(proxy)["late_rows_from_served_groups"] == {"capped-1"}
    assert not h.poll()["success"]
