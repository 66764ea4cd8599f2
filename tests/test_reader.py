"""The reader (unit tier): the ingest cursor on both backends, and Postgres commit order (a smaller id
committed after a larger one is read once, after it commits, never skipped)."""
from __future__ import annotations

import json

import psycopg

from support import Writer, assert_balanced, make_launcher_db, now_text
from rollout_buffer import queries as q
from rollout_buffer.db import connect, to_pyformat
from rollout_buffer.reader import Reader


def test_reader_rereads_rows_that_were_not_ingested(db_url):
    """A failure between read and ingest (e.g. a lookup after a restart) must not lose the rows."""
    w = Writer(db_url, job="J")
    db = connect(db_url)
    try:
        pks = [w.step("g", f"s{i}", 1) for i in range(3)]
        reader = Reader("J", 0, 1000)
        assert [r[0] for r in reader.read(db)] == pks   # ... and the caller fails before advance()
        assert [r[0] for r in reader.read(db)] == pks   # read again, nothing lost
        reader.advance()
        assert reader.read(db) == []
    finally:
        w.close()
        db.close()


def test_reader_cursor_waits_for_in_flight_transactions(pg_url):
    make_launcher_db(pg_url)
    db = connect(pg_url)
    w = Writer(pg_url, job="J")
    now = [0.0]
    reader = Reader("J", 0, 1000, clock=lambda: now[0])
    slow = psycopg.connect(pg_url, autocommit=False)
    try:
        held = slow.execute(to_pyformat(q.INSERT_STEP) + " RETURNING id",
                            ("s", 1, "e", "m", "g", "J", "[]", "r", 0, 0, None, 0, 0, 0, 1, now_text())).fetchone()[0]
        later = [w.step("g", f"s{i}", 1) for i in range(3)]
        seen = []
        for _ in range(3):
            seen += [r[0] for r in reader.read(db)]
            reader.advance()
            reader.end_tick()
            now[0] += 2.0
        assert seen == later
        assert reader.cursor < held  # cannot move past a transaction that may still commit
        slow.commit()
        for _ in range(3):
            seen += [r[0] for r in reader.read(db)]
            reader.advance()
            reader.end_tick()
            now[0] += 2.0
        assert sorted(seen) == sorted(later + [held]) and len(seen) == 4
        assert reader.cursor == max(later)
    finally:
        slow.close()
        w.close()
        db.close()


def test_postgres_out_of_order_commit_is_read_exactly_once(pg_url, harness_factory):
    """Two writers: the larger id commits first and is ingested; the smaller one commits later."""
    make_launcher_db(pg_url)
    h = harness_factory(pg_url)
    h.start(k=2, job="J")
    msgs = json.dumps([{"role": "user", "content": "hi"}])

    def row(sid, completed):
        return (sid, 1, "env", "m", "g", "J", msgs, "r", 0.5, 0.5, None, completed, 0, completed, 1, now_text())

    slow = psycopg.connect(pg_url, autocommit=False)
    fast = psycopg.connect(pg_url, autocommit=True)
    try:
        sql = to_pyformat(q.INSERT_STEP) + " RETURNING id"
        small = slow.execute(sql, row("s1", 1)).fetchone()[0]          # takes the smaller id, not committed
        large = fast.execute(sql, row("s2", 1)).fetchone()[0]          # larger id, committed first
        assert small < large
        h.settle()                                                     # ingests `large` only
        assert h.poll()["success"] is False
        s = h.stats()
        assert s["rows"]["read"] == 1
        slow.commit()                                                  # now the smaller id appears
        doc = h.poll()
        items = doc["data"]["data"]
        assert sorted(i["extra_info"]["step_pk"] for i in items) == [small, large]
        for _ in range(5):
            assert h.poll()["success"] is False
        s = h.stats()
        assert s["rows"]["read"] == 2 and s["rows"]["served"] == 2
        assert_balanced(s)
    finally:
        slow.close()
        fast.close()
