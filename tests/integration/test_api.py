"""Behaviour through the Flask test client, on SQLite and Postgres (the `db_url` fixture)."""

from __future__ import annotations

import json
import logging
from urllib.parse import urlsplit

import pytest
from fakes.tcp_forwarder import TcpForwarder
from support import (
    PG_DSN,
    Writer,
    assert_balanced,
    groups_of,
    make_launcher_db,
    now_text,
    wait_until,
)


def test_complete_groups_are_served_whole_with_terminal_rewards(harness, writer):
    harness.start(k=3)
    sessions = writer.group("g1", 3, steps=3)
    writer.group("g2", 3, steps=2, complete=2)  # not ready: 2 of 3 completed
    doc = harness.poll()
    assert doc["success"] is True
    groups = groups_of(doc)
    assert list(groups) == ["g1"]
    items = groups["g1"]
    assert len(items) == 9
    # sorted by (session_id, step_id, step_pk)
    keys = [
        (i["extra_info"]["session_id"], i["extra_info"]["steps"], i["extra_info"]["step_pk"])
        for i in items
    ]
    assert keys == sorted(keys)
    for i, sid in enumerate(sessions):
        mine = [it for it in items if it["extra_info"]["session_id"] == sid]
        terminal = round(0.1 * (i + 1), 3)
        assert [it["reward"] for it in mine] == [terminal] * 3
        assert [it["extra_info"]["step_reward"] for it in mine] == [0.0, 0.0, terminal]
        assert all(it["extra_info"]["terminal_reward"] == terminal for it in mine)
    meta = doc["data"]["meta_info"]
    assert meta["total_samples"] == 9
    assert meta["finished_groups"] == ["g1"]
    assert meta["avg_reward"] == pytest.approx(sum(it["reward"] for it in items) / 9)
    assert harness.poll()["success"] is False


def test_item_matches_the_row_exactly(harness, writer):
    harness.start(k=1)
    msgs = [{"role": "system", "content": "sÿstem ✓"}, {"role": "user", "content": 'q "quoted"\n'}]
    pk = writer.step(
        "gx",
        "sess-1",
        1,
        completed=True,
        step_reward=0.75,
        truncated=True,
        messages=msgs,
        response="final → answer",
        env_state={"weight_version": 7, "other": [1]},
        created_at="2026-12-02 13:35:10.889937+00:00",
    )
    item = harness.poll()["data"]["data"][0]
    assert item["instance_id"] == "gx"
    assert item["messages"] == [*msgs, {"role": "assistant", "content": "final → answer"}]
    assert item["reward"] == 0.75
    assert isinstance(item["uid"], str) and len(item["uid"]) == 36 and item["uid"][14] == "4"
    assert item["extra_info"] == {
        "timestamp": 1796218510.889937,
        "steps": 1,
        "finish_reason": "length",
        "session_id": "sess-1",
        "env_id": "sess-1",
        "group_id": "gx",
        "rollout_group_key": "gx:0",
        "weight_version": 7,
        "truncated": True,
        "step_pk": pk,
        "is_session_completed": True,
        "step_reward": 0.75,
        "terminal_reward": 0.75,
    }


def test_naive_timestamp_is_utc_and_empty_history_is_spliced(harness, writer):
    harness.start(k=1)
    writer.step("g", "s", 1, completed=True, messages=[], created_at="2026-12-02 13:35:10")
    item = harness.poll()["data"]["data"][0]
    assert item["extra_info"]["timestamp"] == 1796218510.0
    assert item["messages"] == [{"role": "assistant", "content": "answer s 1"}]


@pytest.mark.parametrize(
    "env_state,expected",
    [
        (None, 0),
        ({}, 0),
        ({"weight_version": None}, 0),
        ({"weight_version": "12"}, 12),
        ({"weight_version": 3.9}, 3),
        ({"weight_version": "abc"}, 0),
        ("null", 0),
    ],
)
def test_weight_version_is_tolerant(harness, writer, env_state, expected):
    # SPEC §7.2: a missing weight_version raised KeyError and the row was silently skipped.
    harness.start(k=1)
    writer.step("g", "s", 1, completed=True, env_state=env_state)
    items = harness.poll()["data"]["data"]
    assert len(items) == 1
    assert items[0]["extra_info"]["weight_version"] == expected


def test_health_answers_200(harness):
    # SPEC §7.1: the original's /health raised NameError.
    r = harness.client.get("/health")
    assert r.status_code == 200
    body = r.get_json()
    assert body["status"] == "healthy"
    assert body["aievobox_running"] is False
    assert body["data_manager_initialized"] is False
    harness.start()
    assert harness.client.get("/health").get_json()["data_manager_initialized"] is True


def test_before_start_rollout_there_is_no_data(harness, writer):
    """SPEC §4: the original's message; issue 39: and why, with what to do about it."""
    writer.group("g1", 2)
    for body in ({}, {"wait_s": 0.2}):
        doc = harness.poll(**body)
        assert doc["success"] is False
        assert doc["message"] == "No data available to read"
        assert doc["reason"] == "no_job"
        assert "POST /start_rollout" in doc["hint"]
        assert doc["data"]["data"] == []
    harness.start(k=4)  # g1 has 2 of 4 sessions: a job, and still nothing to read
    doc = harness.poll()
    assert doc["success"] is False and doc["message"] == "No data available to read"
    assert "reason" not in doc and "hint" not in doc


def test_whole_backlog_in_one_poll(harness, writer):
    # SPEC §7.3: the original read at most 100 rows per poll.
    harness.start(k=4)
    for g in range(40):
        writer.group(f"g{g:02d}", 4, steps=2)
    doc = harness.poll()
    assert len(groups_of(doc)) == 40
    assert doc["data"]["meta_info"]["total_samples"] == 320


@pytest.mark.parametrize(
    "value,cap", [(None, None), (0, None), (-3, None), (1, 1), (2, 2), (2.0, 2)]
)
def test_max_groups_caps_or_not(harness, writer, value, cap):
    harness.start(k=2)
    for g in range(5):
        writer.group(f"g{g}", 2, steps=1)
    body = {} if value is None and cap is None else {"max_groups": value}
    doc = harness.poll(**body)
    got = list(groups_of(doc))
    assert len(got) == (5 if cap is None else cap)
    # first ready first
    assert got == [f"g{i}" for i in range(len(got))]


@pytest.mark.parametrize("value", ["2", True, 1.5, [1], {"a": 1}])
def test_max_groups_bad_types_are_400(harness, value):
    harness.start()
    r = harness.client.post("/get_rollout_data", json={"max_groups": value})
    assert r.status_code == 400
    body = r.get_json()
    assert body["ok"] is False and body["status"] == 400 and body["success"] is False
    assert "max_groups" in body["error"] and body["message"] == body["error"]


def test_body_parsing(harness):
    harness.start()
    c = harness.client
    assert c.post("/get_rollout_data", data=b"").status_code == 200
    assert c.post("/get_rollout_data", data=b"{}", content_type="text/plain").status_code == 200
    r = c.post("/get_rollout_data", data=b"{not json")
    assert r.status_code == 400 and "not valid JSON" in r.get_json()["error"]
    r = c.post("/get_rollout_data", data=b"[1, 2]")
    assert r.status_code == 400 and "expected a JSON object" in r.get_json()["error"]
    r = c.post("/get_rollout_data", data=b"{" + b'"x": "' + b"a" * (2 * 1024 * 1024) + b'"}')
    assert r.status_code == 413 and r.get_json()["ok"] is False


@pytest.mark.parametrize(
    "k,status",
    [
        (8, 200),
        ("8", 200),
        (1, 200),
        (4096, 200),
        (0, 400),
        (4097, 400),
        (True, 400),
        (2.5, 400),
        ("8.5", 400),
        ("x", 400),
        ([8], 400),
    ],
)
def test_num_repeat_per_sample_validation(harness, k, status):
    r = harness.client.post("/start_rollout", json={"num_repeat_per_sample": k, "job_session": "j"})
    assert r.status_code == status, r.get_json()
    if status == 200:
        assert r.get_json()["k"] == int(k)
    else:
        assert "num_repeat_per_sample" in r.get_json()["error"]


@pytest.mark.parametrize(
    "job,status",
    [("abc-1.2_x", 200), ("", 400), ("a b", 400), ("x" * 65, 400), (5, 400), ("ok" * 32, 200)],
)
def test_job_session_validation(harness, job, status):
    r = harness.client.post("/start_rollout", json={"job_session": job})
    assert r.status_code == status, r.get_json()


def test_job_session_absent_means_new_uuid_and_other_keys_ignored(harness):
    r = harness.client.post(
        "/start_rollout", json={"num_repeat_per_sample": 2, "foo": 1, "batch": [1]}
    )
    body = r.get_json()
    assert r.status_code == 200 and len(body["job_session"]) == 32
    assert body["message"] == "Rollout started"


@pytest.mark.parametrize(
    "value,status", [(True, 200), (1, 200), (0, 200), (False, 200), ("true", 400), (2, 400)]
)
def test_restart_training_validation(harness, value, status):
    r = harness.client.post("/start_rollout", json={"restart_training": value, "job_session": "j"})
    assert r.status_code == status


def test_k_from_start_rollout(harness, writer):
    harness.start(k=3)
    writer.group("g1", 2, steps=1)
    assert harness.poll()["success"] is False
    harness.start(k=2)  # same job, new K: the group is ready now
    assert list(groups_of(harness.poll())) == ["g1"]


def test_restart_training_skips_written_rows_and_tombstones_their_groups(harness, writer):
    writer.group("old", 2, steps=2)
    half = writer.group("half", 2, steps=1, complete=0)  # rows at or below the floor, no completion
    writer.group("done", 2, steps=1)  # the last terminal row sets the floor
    harness.start(k=2, restart_training=True)
    # rows of "half" after the floor must not make it ready with half its rows
    for sid in half:
        writer.step("half", sid, 2, completed=True, step_reward=1.0)
    writer.group("new", 2, steps=2)
    doc = harness.poll()
    assert list(groups_of(doc)) == ["new"]
    s = harness.stats()
    assert s["groups"]["dropped"].get("restart_training", 0) >= 3
    assert s["rows"]["dropped"]["late_rows_from_dropped_groups"] == 2
    assert_balanced(s)


def test_restart_training_counts_the_rows_below_the_floor(harness, writer):
    harness.start(k=2)
    writer.group("g", 2, steps=2, complete=0)  # 4 rows, read while pending
    writer.group("h", 2, steps=1)  # served; its terminal rows set the floor
    assert list(groups_of(harness.poll())) == ["h"]
    assert harness.stats()["rows"]["read"] == 6
    harness.start(k=2, restart_training=True)  # same job: g is tombstoned with its 4 rows
    s = harness.stats()
    assert s["rows"]["read"] == 6 and s["rows"]["dropped"] == {"restart_training": 4}
    assert s["groups"]["dropped"] == {"restart_training": 1} and s["rows"]["served"] == 2
    assert_balanced(s)


def test_job_isolation_drop_in_a_does_not_blacklist_b(harness, writer):
    # SPEC §7.8: dropped ids leaked across jobs.
    harness.start(k=2, job="A")
    writer.group("shared", 2, steps=1, complete=1, job="A")
    writer.group("onlyA", 2, steps=1, job="A")
    assert list(groups_of(harness.poll())) == ["onlyA"]
    harness.start(k=2, job="B")  # job A ends: its pending "shared" is dropped
    sa = harness.stats()
    assert sa["job_session"] == "B"
    writer.group("shared", 2, steps=1, job="B")
    doc = harness.poll()
    assert list(groups_of(doc)) == ["shared"]
    assert {i["extra_info"]["session_id"] for i in doc["data"]["data"]}  # rows of job B only
    assert harness.poll()["success"] is False


def test_more_than_k_completed_are_all_served(harness, writer, caplog):
    harness.start(k=2)
    writer.group("g", 3, steps=1)
    doc = harness.poll()
    assert len({i["extra_info"]["session_id"] for i in doc["data"]["data"]}) == 3


def test_incomplete_session_of_served_group_is_dropped_and_counted(harness, writer):
    harness.start(k=2)
    sessions = writer.group("g", 3, steps=2, complete=2)
    doc = harness.poll()
    served = {i["extra_info"]["session_id"] for i in doc["data"]["data"]}
    assert served == set(sessions[:2])
    s = harness.stats()
    assert s["rows"]["dropped"]["incomplete_session_in_served_group"] == 2
    writer.step("g", sessions[2], 3, completed=True)  # late row of a served group
    harness.poll()
    s = harness.stats()
    assert s["rows"]["dropped"]["late_rows_from_served_groups"] == 1
    assert_balanced(s)


def test_duplicate_step_rows_are_both_served(harness, writer):
    harness.start(k=1)
    writer.step("g", "s", 1, created_at="2026-12-02 10:00:00+00:00")
    writer.step("g", "s", 1, created_at="2026-12-02 10:00:01+00:00")
    writer.step("g", "s", 2, completed=True, step_reward=1.0)
    items = harness.poll()["data"]["data"]
    assert [i["extra_info"]["steps"] for i in items] == [1, 1, 2]


def test_terminal_reward_is_last_completed_row(harness, writer):
    harness.start(k=1)
    writer.step("g", "s", 1, completed=True, step_reward=0.2)
    writer.step("g", "s", 2, completed=True, step_reward=0.9)
    items = harness.poll()["data"]["data"]
    assert [i["reward"] for i in items] == [0.9, 0.9]


def test_non_trainable_rows_are_not_read(harness, writer):
    harness.start(k=1)
    writer.step("g", "s", 1, trainable=False)
    writer.step("g", "s", 2, completed=True, step_reward=1.0)
    items = harness.poll()["data"]["data"]
    assert [i["extra_info"]["steps"] for i in items] == [2]


@pytest.mark.parametrize(
    "kind,reason",
    [
        ("messages", "invalid_json_messages"),
        ("not_list", "messages_not_a_list"),
        ("env_state", "invalid_json_env_state"),
        ("env_list", "env_state_not_an_object"),
        ("nan", "invalid_json_messages"),
    ],
)
def test_malformed_row_drops_its_group_and_others_are_served(harness, writer, kind, reason):
    harness.start(k=2)
    writer.group("good1", 2, steps=2)
    sessions = writer.group("bad", 2, steps=1, complete=0)
    kw = (
        {"messages": '[{"role": "user", "content": "x"}'}
        if kind == "messages"
        else {"messages": '{"role": "user"}'}
        if kind == "not_list"
        else {"env_state": "{not json"}
        if kind == "env_state"
        else {"env_state": "[1, 2]"}
        if kind == "env_list"
        else {"messages": '[{"role": "user", "content": NaN}]'}
    )
    writer.step("bad", sessions[0], 2, completed=True, step_reward=0.5, **kw)
    writer.step("bad", sessions[1], 2, completed=True, step_reward=0.5)
    writer.group("good2", 2, steps=1)
    doc = harness.poll()
    assert sorted(groups_of(doc)) == ["good1", "good2"]
    s = harness.stats()
    assert s["rows"]["rejected"] == {reason: 1}
    assert s["rows"]["dropped"]["malformed_row"] == 3
    assert s["groups"]["dropped"]["malformed_row"] == 1
    assert_balanced(s)
    writer.step("bad", sessions[0], 3)
    harness.poll()
    s = harness.stats()
    assert s["rows"]["dropped"]["late_rows_from_dropped_groups"] == 1
    assert_balanced(s)


def test_row_without_group_id_is_rejected_and_taints_its_group(harness, writer):
    harness.start(k=2)
    writer.step("g", "s1", 1)
    writer.step(None, "s1", 2)  # no group_id
    writer.step("g", "s1", 3, completed=True, step_reward=1.0)
    writer.step("g", "s2", 1, completed=True, step_reward=1.0)
    writer.step(None, "lonely", 1, completed=True)
    writer.group("ok", 2, steps=1)
    doc = harness.poll()
    assert list(groups_of(doc)) == ["ok"]
    s = harness.stats()
    assert s["rows"]["rejected"] == {"missing_group_id": 2}
    assert s["groups"]["dropped"]["malformed_row"] == 1
    assert_balanced(s)


def test_a_blob_group_id_is_rejected_and_a_numeric_one_names_its_group(lite_url, harness_factory):
    """A BLOB group_id was served under the instance_id "b'g-blob'" (its Python repr); a number in
    an untyped column names its group as its text does (SQLite's TEXT affinity stores it so)."""
    import sqlite3

    h = harness_factory(lite_url)
    h.start(k=2)
    conn = sqlite3.connect(lite_url[len("sqlite://") :])
    cols = (
        "session_id, step_id, env_name, llm_model, group_id, job_id, messages, response, "
        "step_reward, reward, env_state, is_terminal, is_truncated, is_session_completed, "
        "is_trainable, created_at"
    )
    sql = (
        f"INSERT INTO session_steps ({cols}) "
        "VALUES (?, 1, 'e', 'm', ?, 'job1', '[]', 'r', 1, 1, NULL, 1, 0, 1, 1, ?)"
    )
    with conn:
        for sid, gid in (("b1", b"g-blob"), ("b2", b"g-blob"), ("n1", 42), ("n2", "42")):
            conn.execute(sql, (sid, gid, now_text()))
    conn.close()
    doc = h.poll()
    assert list(groups_of(doc)) == ["42"]
    s = h.stats()
    assert s["rows"]["rejected"] == {"invalid_utf8_group_id": 2} and s["rows"]["served"] == 2
    assert_balanced(s)


def test_polls_do_not_log_pending_state_at_info(harness, writer, caplog):
    # SPEC §7.12: every poll logged the whole pending dictionary at INFO.
    harness.start(k=4)
    for g in range(20):
        writer.group(f"p{g}", 4, steps=1, complete=1)
    harness.settle()
    caplog.set_level(logging.INFO, logger="rollout_buffer")
    caplog.clear()
    for _ in range(20):
        harness.client.post("/get_rollout_data", json={})
    assert [r for r in caplog.records if r.levelno >= logging.INFO] == []


def test_error_shape_everywhere(harness):
    c = harness.client
    for r in (
        c.get("/nope"),
        c.get("/get_rollout_data"),
        c.post("/start_rollout", json={"job_session": ""}),
    ):
        body = r.get_json()
        assert set(body) >= {"ok", "error", "status"}
        assert body["ok"] is False and body["status"] == r.status_code and body["error"]
    assert c.get("/nope").status_code == 404
    assert c.get("/get_rollout_data").status_code == 405


def test_the_404_lists_every_endpoint_from_the_routing_table(harness):
    """Issue 39: the list left out GET /admission; it is now read from the table that routes."""
    c = harness.client
    body = c.get("/nope").get_json()
    routed = {
        f"{method} {rule.rule}"
        for rule in harness.app.url_map.iter_rules()
        for method in rule.methods - {"HEAD", "OPTIONS"}
    }
    assert set(body["endpoints"]) == routed
    assert len(body["endpoints"]) == len(routed)  # each once
    assert set(body["endpoints"]) >= {
        "POST /start_rollout",
        "POST /get_rollout_data",
        "POST /stop_rollout",
        "GET /health",
        "GET /stats",
        "GET /admission",
        "GET /metrics",
        "GET /",
        "GET /status",
    }
    assert body["error"] == "no such endpoint: /nope; endpoints are " + ", ".join(body["endpoints"])
    for endpoint in body["endpoints"]:  # every one listed is answered
        method, path = endpoint.split(" ")
        answer = c.open(path, method=method, json={} if method == "POST" else None)
        assert answer.status_code not in (404, 405), (endpoint, answer.status_code)
    assert c.get("/static/status.html").status_code == 404  # no file route besides the page


def test_each_content_type_names_one_charset(harness):
    """Issue 39: the status page and /metrics said ``charset=utf-8`` twice."""
    for path, expected in (
        ("/", "text/html; charset=utf-8"),
        ("/metrics", "text/plain; version=0.0.4; charset=utf-8"),
        ("/stats", "application/json"),
    ):
        r = harness.client.get(path)
        assert r.status_code == 200, path
        assert r.headers.get_all("Content-Type") == [expected], path


def test_stats_identity_and_lag(harness, writer):
    harness.start(k=2)
    writer.group("a", 2, steps=2)
    writer.group("b", 2, steps=2, complete=1)
    harness.poll()
    s = harness.stats()
    assert s["rows"]["read"] == 8 and s["rows"]["served"] == 4 and s["rows"]["pending"] == 4
    assert s["groups"]["pending"] == 1 and s["groups"]["served"] == 1
    assert s["lag_rows"] == 0
    assert s["accounting_balanced"] is True
    assert json.loads(json.dumps(s)) == s  # plain JSON: no NaN, no objects the encoder would mangle


@pytest.mark.parametrize(
    "second",
    [
        # form feed: not JSON
        '[{"role": "user", "content": "q"}\x0c, {"role": "assistant", "content": "a1"}]',
        '[{"role": "user", "content": "q"}, ]',  # trailing comma
        # NaN in the new tail
        '[{"role": "user", "content": "q"}, {"role": "assistant", "content": NaN}]',
        '[{"role": "user", "content": "q"}]x',  # garbage after the list
    ],
)
def test_growing_history_is_validated_even_when_only_its_tail_is_new(harness, writer, second):
    """The second step's history extends the first's byte for byte; a bad tail still drops the
    group."""
    harness.start(k=1)
    writer.step("g", "s", 1, messages='[{"role": "user", "content": "q"}]')
    writer.step("g", "s", 2, completed=True, step_reward=1.0, messages=second)
    writer.group("ok", 1, steps=2)
    doc = harness.poll()
    assert list(groups_of(doc)) == ["ok"]
    s = harness.stats()
    assert s["groups"]["dropped"] == {"malformed_row": 1} and s["rows"]["rejected_total"] == 1


def test_growing_history_with_valid_tails_is_served_exactly(harness, writer):
    harness.start(k=1)
    h1 = '[ {"role": "user", "content": "q"} ]'
    h2 = (
        '[ {"role": "user", "content": "q"} ,\n {"role": "assistant", "content": "a1"}, '
        '{"role": "user", "content": "o1"}]'
    )
    h3 = h2[:-1] + "\t]"
    for i, h in enumerate((h1, h2, h3), start=1):
        writer.step(
            "g",
            "s",
            i,
            completed=i == 3,
            step_reward=1.0 if i == 3 else 0.0,
            messages=h,
            response=f"r{i}",
        )
    items = harness.poll()["data"]["data"]
    assert [i["messages"] for i in items] == [
        [*json.loads(h), {"role": "assistant", "content": f"r{n}"}]
        for n, h in enumerate((h1, h2, h3), start=1)
    ]


def test_invalid_utf8_text_drops_its_group_instead_of_failing_every_poll(lite_url, harness_factory):
    """SQLite stores any bytes as TEXT; a strict decode would make every read touching the row
    fail."""
    import sqlite3

    h = harness_factory(lite_url)
    h.start(k=1)
    w = Writer(lite_url)
    w.group("ok1", 1, steps=1)
    conn = sqlite3.connect(lite_url[len("sqlite://") :])
    cols = (
        "session_id, step_id, env_name, llm_model, group_id, job_id, messages, response, "
        "step_reward, reward, env_state, is_terminal, is_truncated, is_session_completed, "
        "is_trainable, created_at"
    )
    sql = (
        f"INSERT INTO session_steps ({cols}) VALUES "
        "(?, 1, 'e', 'm', {gid}, 'job1', '[]', {resp}, 1, 1, NULL, 1, 0, 1, 1, ?)"
    )
    with conn:
        conn.execute(
            sql.format(gid="'badresp'", resp="CAST(? AS TEXT)"), ("s-bad", b"caf\xe9", now_text())
        )
        conn.execute(
            sql.format(gid="CAST(? AS TEXT)", resp="'r'"), ("s-badgid", b"g\xff", now_text())
        )
    conn.close()
    w.group("ok2", 1, steps=1)
    w.close()
    doc = h.poll()
    assert sorted(groups_of(doc)) == ["ok1", "ok2"]
    s = h.stats()
    assert s["rows"]["rejected"] == {"invalid_utf8_text": 1, "invalid_utf8_group_id": 1}
    assert s["groups"]["dropped"] == {"malformed_row": 1}
    assert_balanced(s)


def test_a_commit_that_failed_after_it_happened_is_settled_not_served_again(
    harness, writer, monkeypatch
):
    """The serving COMMIT reaches the server but reports an error: the groups are recorded as
    decided. The next polls must neither re-serve them nor 503 forever; the batch replays to its
    request_id."""
    import contextlib

    from rollout_buffer.core.errors import StorageError
    from rollout_buffer.storage import db as db_mod

    harness.start(k=1)
    writer.step("bad", "sb", 1, completed=True, step_reward=1.0, messages="{not json")
    for g in ("g1", "g2", "g3"):
        writer.group(g, 1, steps=1)
    harness.settle()
    real = db_mod.Database.transaction
    failed = []

    @contextlib.contextmanager
    def commit_then_raise(self):
        with real(self) as db:
            yield db
        if not failed:
            failed.append(1)
            raise StorageError("connection lost after COMMIT")

    monkeypatch.setattr(db_mod.Database, "transaction", commit_then_raise)
    r = harness.client.post("/get_rollout_data", json={"request_id": "R1"})
    assert r.status_code == 503
    monkeypatch.setattr(db_mod.Database, "transaction", real)
    # the trainer retries its id: the recorded batch comes back
    doc = harness.poll(request_id="R1")
    assert doc["data"]["meta_info"]["replayed"] is True and sorted(groups_of(doc)) == [
        "g1",
        "g2",
        "g3",
    ]
    # a new id: nothing is served twice, and the service answers normally
    for rid in ("R2", "R3"):
        assert harness.poll(request_id=rid)["success"] is False
    writer.group("g4", 1, steps=1)
    assert list(groups_of(harness.poll())) == ["g4"]
    s = harness.stats()
    assert s["groups"]["served"] == 4 and s["groups"]["dropped"] == {"malformed_row": 1}
    assert s["rows"]["rejected"] == {"invalid_json_messages": 1}
    assert_balanced(s)


def test_huge_but_finite_values_never_break_the_response(harness, writer):
    harness.start(k=2)
    sids = writer.group("huge", 2, steps=1, complete=0)
    for sid in sids:
        writer.step(
            "huge", sid, 2, completed=True, step_reward=1e308, env_state={"weight_version": 10**400}
        )
    doc = harness.poll()
    meta = doc["data"]["meta_info"]
    assert list(groups_of(doc)) == ["huge"] and meta["avg_reward"] == pytest.approx(1e308)
    assert {i["extra_info"]["weight_version"] for i in doc["data"]["data"]} == {0, 1}


def test_the_byte_budget_covers_the_whole_body(db_url, harness_factory):
    h = harness_factory(db_url, max_response_bytes=4096)
    h.start(k=1)
    w = Writer(db_url)
    for g in range(40):
        w.step(
            f"group-with-a-rather-long-identifier-{g:03d}",
            f"s{g}",
            1,
            completed=True,
            step_reward=1.0,
            messages=[{"role": "user", "content": "x" * 40}],
        )
    w.close()
    seen = set()
    for _ in range(40):
        h.settle()
        r = h.client.post("/get_rollout_data", json={"request_id": "r" * 100 + str(len(seen))})
        doc = r.get_json()
        if not doc["success"]:
            break
        assert len(r.data) <= 4096, len(r.data)
        seen |= set(groups_of(doc))
    assert len(seen) == 40


def test_a_group_too_large_to_build_is_dropped_and_others_are_served(db_url, harness_factory):
    h = harness_factory(db_url, max_group_bytes=20_000)
    h.start(k=2)
    w = Writer(db_url)
    try:
        w.group("big", 2, steps=3, response="x" * 6000)  # 36 KB of responses: over the cap
        w.group("small", 2, steps=2)
    finally:
        w.close()
    h.settle()
    doc = h.poll()
    assert list(groups_of(doc)) == ["small"]
    s = h.stats()
    assert s["groups"]["dropped"] == {"group_too_large": 1}
    assert s["rows"]["dropped"]["group_too_large"] == 6
    assert_balanced(s)
    assert h.poll()["success"] is False  # decided once, never retried


def test_a_group_whose_build_keeps_failing_is_dropped_after_bounded_tries(
    harness, writer, monkeypatch
):
    from rollout_buffer.serving import draft
    from rollout_buffer.serving import poll as serving

    real = draft.build_group

    def build(take, *a, **kw):
        if take.group_id == "poison":
            raise RuntimeError("an unexpected failure nobody anticipated")
        return real(take, *a, **kw)

    monkeypatch.setattr(draft, "build_group", build)
    harness.start(k=2)
    writer.group("poison", 2, steps=2)
    harness.settle()
    served: list[str] = []
    for i in range(serving.MAX_BUILD_FAILURES):
        writer.group(f"ok{i}", 2, steps=1)
        harness.settle()
        doc = harness.poll()
        assert doc["success"] is True, doc  # the other groups keep being served, never a 500
        served += list(groups_of(doc))
    assert sorted(served) == [f"ok{i}" for i in range(serving.MAX_BUILD_FAILURES)]
    s = harness.stats()
    assert s["groups"]["dropped"] == {"build_failed": 1}
    assert s["rows"]["dropped"]["build_failed"] == 4
    assert_balanced(s)
    assert harness.poll()["success"] is False  # decided: never retried again


def test_deeply_nested_rows_drop_their_group_and_others_are_served(harness, writer):
    harness.start(k=2)
    deep = "[" * 3000 + "]" * 3000
    writer.group("deep2", 2, steps=1, messages=deep)
    writer.group("deep3", 2, steps=1, env_state='{"a":' * 3000 + "1" + "}" * 3000)
    writer.group("fine", 2, steps=1)
    doc = harness.poll()
    assert "fine" in groups_of(doc) and not {"deep2", "deep3"} & set(groups_of(doc))
    s = harness.stats()
    assert s["rows"]["rejected"].get("json_too_deep_messages") == 2
    assert s["rows"]["rejected"].get("json_too_deep_env_state") == 2
    assert s["groups"]["dropped"].get("malformed_row") == 2
    assert_balanced(s)


def test_a_deeply_nested_request_body_is_a_400_not_a_500(harness):
    body = "[" * 100_000 + "]" * 100_000  # 200 KB: under the 1 MiB cap
    for path in ("/get_rollout_data", "/start_rollout", "/stop_rollout"):
        r = harness.client.post(path, data=body)
        assert r.status_code == 400, (path, r.status_code)
        assert "nested too deeply" in r.get_json()["error"]


def test_a_job_session_that_argparse_would_read_as_an_option_is_refused(harness):
    for job in ("-rf", "--job-id", "-"):
        r = harness.client.post("/start_rollout", json={"job_session": job})
        assert r.status_code == 400 and "must not start with '-'" in r.get_json()["error"], job
    assert harness.client.post("/start_rollout", json={"job_session": "a-b_c.d"}).status_code == 200


def test_cross_site_browser_requests_are_refused_and_clients_are_not(harness):
    harness.start(k=2)
    hostile = [
        {"Sec-Fetch-Site": "cross-site"},
        {"Origin": "http://evil.example"},
        {"Origin": "null"},
    ]
    for headers in hostile:
        r = harness.client.post(
            "/start_rollout", data='{"job_session":"x"}', headers=headers, content_type="text/plain"
        )
        assert r.status_code == 403, headers
        assert r.get_json()["status"] == 403
    same = harness.client.post(
        "/get_rollout_data",
        json={},
        headers={"Origin": "http://localhost", "Sec-Fetch-Site": "same-origin"},
    )
    assert same.status_code == 200
    assert (
        harness.client.post("/get_rollout_data", json={}).status_code == 200
    )  # no headers: a trainer


def test_a_flood_of_bad_rows_is_logged_per_kind_not_per_row(harness, writer, caplog):
    harness.start(k=2)
    for i in range(300):
        writer.step(None, f"orphan-{i}", 1)  # no group_id: rejected one by one
    with caplog.at_level(logging.INFO, logger="rollout_buffer"):
        harness.settle()
        assert harness.stats()["rows"]["rejected"] == {"missing_group_id": 300}
    lines = [r for r in caplog.records if "rejected row" in r.getMessage()]
    assert 1 <= len(lines) <= 3, [r.getMessage() for r in lines][:5]


def test_duplicate_steps_in_many_groups_are_logged_per_kind_not_per_row(harness, writer, caplog):
    """A launcher that retries inserts writes a step twice in every session: one WARNING per row
    served (and again per replay) flooded the log."""
    harness.start(k=1)
    for g in range(60):
        writer.step(f"g{g}", f"s{g}", 1, created_at="2026-12-02 10:00:00+00:00")
        writer.step(f"g{g}", f"s{g}", 1, created_at="2026-12-02 10:00:01+00:00", completed=True)
    with caplog.at_level(logging.INFO, logger="rollout_buffer"):
        assert len(groups_of(harness.poll())) == 60
    lines = [r for r in caplog.records if "two rows for step" in r.getMessage()]
    assert len(lines) <= 1, [r.getMessage() for r in lines][
        :5
    ]  # (0: an earlier test opened the window)


def test_stats_and_status_answer_from_memory_while_the_database_is_down(
    pg_url, harness_factory, caplog
):
    """The figures an operator needs most when the database is gone (/stats, the status page's
    /status) are in memory: only the lag needs the database, so they answer, with the problem."""
    make_launcher_db(pg_url)
    dsn = urlsplit(PG_DSN)
    relay = TcpForwarder(dsn.port or 5432, dsn.hostname or "127.0.0.1")
    try:  # the service reaches Postgres through the relay; the test's writer directly
        h = harness_factory(
            pg_url.replace(dsn.netloc.rsplit("@", 1)[-1], f"127.0.0.1:{relay.port}", 1),
            db_unhealthy_after_s=0.5,
        )
        h.start(k=2, job="J")
        w = Writer(pg_url, job="J")
        w.group("g", 2)
        w.group("p", 2, complete=1)
        w.close()
        assert list(groups_of(h.poll())) == ["g"]
        relay.down()
        for path in ("/stats", "/status"):  # before the loop has noticed, and after
            r = h.client.get(path)
            assert r.status_code == 200, r.get_data(as_text=True)
        wait_until(
            lambda: h.client.get("/health").get_json()["status"] == "degraded",
            15,
            "the loop sees the database down",
        )
        s = h.client.get("/stats").get_json()
        assert s["database"] != "ok" and s["lag_rows"] is None
        assert (s["rows"]["served"], s["rows"]["pending"], s["groups"]["pending"]) == (4, 4, 1)
        doc = h.client.get("/status").get_json()
        assert doc["status"] == "degraded" and doc["stats"]["rows"] == s["rows"]
        assert not [r for r in caplog.records if r.getMessage().startswith("unhandled error")]
    finally:
        relay.close()
