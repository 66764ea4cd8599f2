"""Serving a poll (through the Flask test client, on both backends): what a poll costs (structure,
not timing: an empty poll touches neither the database nor any pending group, a data poll's queries
scale with the rows served, not with what is pending), many pollers while rows are written, and a
drain of 8,192 rows checked item by item against what was written."""

from __future__ import annotations

import json
import threading
import uuid

import pytest
from support import Writer, assert_balanced, groups_of, now_text

from rollout_buffer.storage import db as db_mod
from rollout_buffer.storage import db as service_mod
from rollout_buffer.storage import launcher_sql
from rollout_buffer.storage.db import connect


class Counting:
    """Counts connections opened and statements run by request threads (not the loop thread)."""

    def __init__(self, monkeypatch):
        self.connects = 0
        self.statements = 0
        self.loop = "rollout-buffer-loop"
        real_connect = service_mod.connect
        real_run = {cls: cls._run for cls in (db_mod.SqliteDatabase, db_mod.PostgresDatabase)}

        def connect(*a, **kw):
            if threading.current_thread().name != self.loop:
                self.connects += 1
            return real_connect(*a, **kw)

        monkeypatch.setattr(service_mod, "connect", connect)
        for cls, run in real_run.items():

            def counted(obj, sql, params, many=False, binary=False, _run=run):
                if threading.current_thread().name != self.loop:
                    self.statements += 1
                return _run(obj, sql, params, many, binary)

            monkeypatch.setattr(cls, "_run", counted)


def test_empty_poll_touches_no_database_and_no_pending_group(harness, writer, monkeypatch):
    harness.start(k=4)
    for g in range(300):
        writer.group(f"p{g:03d}", 4, steps=1, complete=3)  # 300 pending groups, none ready
    harness.settle()
    assert harness.stats()["groups"]["pending"] == 300
    counting = Counting(monkeypatch)

    class Tripwire(dict):
        def __iter__(self):
            raise AssertionError("an empty poll iterated the pending groups")

        values = items = keys = __iter__

    accumulator = harness.service.current.accumulator
    with accumulator.lock:
        pending = accumulator.pending
        accumulator.pending = Tripwire()  # type: ignore[assignment]
    try:
        for _ in range(50):
            r = harness.client.post("/get_rollout_data", json={})
            assert r.status_code == 200 and r.get_json()["success"] is False
    finally:
        with accumulator.lock:
            accumulator.pending = pending
    assert counting.connects == 0 and counting.statements == 0


def test_data_poll_queries_scale_with_rows_served_not_pending(harness, writer, monkeypatch):
    harness.start(k=2)
    for g in range(200):
        writer.group(f"p{g:03d}", 2, steps=1, complete=1)  # pending, never ready
    for g in range(20):
        writer.group(f"r{g:02d}", 2, steps=2)  # 20 ready groups, 80 rows
    harness.settle()
    counting = Counting(monkeypatch)
    doc = harness.client.post("/get_rollout_data", json={}).get_json()
    assert len(groups_of(doc)) == 20
    # one connection; a body query per 900 rows, then BEGIN, the batch, the group records, COMMIT
    assert counting.connects == 1
    assert counting.statements <= 8, counting.statements


def test_many_concurrent_pollers_while_rows_are_written(db_url, harness_factory):
    """SPEC §7.10: no lock in the original. Every group reaches exactly one poller, whole."""
    h = harness_factory(db_url)
    h.start(k=3, job="J")
    n_groups = 60
    got: list[tuple[str, list[dict]]] = []
    got_lock = threading.Lock()
    done = threading.Event()
    errors: list[str] = []

    def writer_thread():
        w = Writer(db_url, job="J")
        try:
            for g in range(n_groups):
                w.group(f"g{g:03d}", 3, steps=2)
            # every row is ingested before the pollers may count empty answers as the end
            h.settle()
        finally:
            w.close()
            done.set()

    def poller():
        client = h.app.test_client()
        empty_after_done = 0
        while empty_after_done < 20:
            r = client.post("/get_rollout_data", json={"max_groups": 2})
            if r.status_code != 200:
                errors.append(r.get_data(as_text=True))
                return
            doc = r.get_json()
            groups = groups_of(doc)
            with got_lock:
                got.extend(groups.items())
            if not groups and done.is_set():
                empty_after_done += 1

    threads = [threading.Thread(target=writer_thread)] + [
        threading.Thread(target=poller) for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    ids = [g for g, _ in got]
    assert len(ids) == len(set(ids)), "a group was delivered twice"
    assert sorted(ids) == [f"g{g:03d}" for g in range(n_groups)]
    for _gid, items in got:
        assert len(items) == 6 and len({i["extra_info"]["session_id"] for i in items}) == 3
    pks = [i["extra_info"]["step_pk"] for _, items in got for i in items]
    assert len(pks) == len(set(pks))
    s = h.stats()
    assert s["rows"]["served"] == n_groups * 6
    assert_balanced(s)


@pytest.mark.slow
def test_drain_256_groups_of_8_sessions_of_4_steps_exactly(db_url, harness_factory, tmp_path):
    """The contract's items, every group exactly once (256 x 8 x 4 = 8,192 rows)."""
    db = connect(db_url)
    rows = []
    expected: dict[str, dict[str, list]] = {}
    for g in range(256):
        gid = f"group-{g:03d}"
        for s in range(8):
            sid = str(uuid.uuid4())
            history = [
                {"role": "system", "content": "sys"},
                {"role": "user", "content": f"task {g} ✓"},
            ]
            for step in range(1, 5):
                last = step == 4
                reward = round((g * 8 + s) / 2048.0, 6) if last else 0.0
                rows.append(
                    (
                        sid,
                        step,
                        "env",
                        "m",
                        gid,
                        "J",
                        json.dumps(history, ensure_ascii=False),
                        f"answer {step}",
                        reward,
                        reward,
                        json.dumps({"weight_version": g % 5}),
                        int(last),
                        0,
                        int(last),
                        1,
                        now_text(),
                    )
                )
                expected.setdefault(gid, {}).setdefault(sid, []).append(
                    (step, [*history, {"role": "assistant", "content": f"answer {step}"}])
                )
                history = [
                    *history,
                    {"role": "assistant", "content": f"answer {step}"},
                    {"role": "user", "content": f"obs {step}"},
                ]
    # interleave sessions as a worker pool would
    rows.sort(key=lambda r: (r[1], hash(r[0]) % 97))
    with db.transaction():
        db.executemany(launcher_sql.INSERT_STEP, rows)
    db.close()
    h = harness_factory(db_url, max_response_bytes=4 * 1024 * 1024)
    h.start(k=8, job="J")
    seen: set[str] = set()
    polls = 0
    while len(seen) < 256 and polls < 200:
        polls += 1
        doc = h.poll()
        for gid, items in groups_of(doc).items():
            assert gid not in seen
            seen.add(gid)
            by_session: dict[str, list[dict]] = {}
            for it in items:
                by_session.setdefault(it["extra_info"]["session_id"], []).append(it)
            assert set(by_session) == set(expected[gid])
            for sid, its in by_session.items():
                exp = expected[gid][sid]
                assert [it["extra_info"]["steps"] for it in its] == [1, 2, 3, 4]
                assert [it["messages"] for it in its] == [m for _, m in exp]
                terminal = its[-1]["extra_info"]["step_reward"]
                assert all(
                    it["reward"] == terminal and it["extra_info"]["terminal_reward"] == terminal
                    for it in its
                )
                assert all(it["extra_info"]["weight_version"] == int(gid[-3:]) % 5 for it in its)
    assert len(seen) == 256
    assert polls > 1, "the byte budget should have split the backlog"
    s = h.stats()
    assert s["rows"]["read"] == 8192 and s["rows"]["served"] == 8192
    assert_balanced(s)
