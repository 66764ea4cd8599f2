"""The reader (unit tier): the ingest cursor on both backends (ids at or below 0 too), and Postgres
commit order (a smaller id committed after a larger one is read once, after it commits, never
skipped)."""

from __future__ import annotations

import json

import psycopg
from support import PG_DSN, Writer, assert_balanced, groups_of, make_launcher_db, now_text

from rollout_buffer.storage import launcher_sql
from rollout_buffer.storage.db import connect, to_pyformat
from rollout_buffer.storage.reader import Reader


def test_reader_rereads_rows_that_were_not_ingested(db_url):
    """A failure between read and ingest (e.g. a lookup after a restart) must not lose the rows."""
    w = Writer(db_url, job="J")
    db = connect(db_url)
    try:
        pks = [w.step("g", f"s{i}", 1) for i in range(3)]
        reader = Reader("J", 0, 1000)
        assert [r[0] for r in reader.read(db)] == pks  # ... and the caller fails before advance()
        assert [r[0] for r in reader.read(db)] == pks  # read again, nothing lost
        reader.advance()
        assert reader.read(db) == []
    finally:
        w.close()
        db.close()


def read_ticks(reader: Reader, db, now: list[float], n: int = 3) -> list[int]:
    """``n`` ticks of the reader, 2 s apart on its clock; the ids it returned."""
    seen = []
    for _ in range(n):
        seen += [r[0] for r in reader.read(db)]
        reader.advance()
        reader.end_tick()
        now[0] += 2.0
    return seen


def test_reader_cursor_waits_for_in_flight_transactions(pg_url):
    make_launcher_db(pg_url)
    db = connect(pg_url)
    w = Writer(pg_url, job="J")
    now = [0.0]
    reader = Reader("J", 0, 1000, clock=lambda: now[0])
    slow = psycopg.connect(pg_url, autocommit=False)
    try:
        held = slow.execute(
            to_pyformat(launcher_sql.INSERT_STEP) + " RETURNING id",
            ("s", 1, "e", "m", "g", "J", "[]", "r", 0, 0, None, 0, 0, 0, 1, now_text()),
        ).fetchone()[0]
        later = [w.step("g", f"s{i}", 1) for i in range(3)]
        seen = read_ticks(reader, db, now)
        assert seen == later
        assert reader.cursor < held  # cannot move past a transaction that may still commit
        slow.commit()
        seen += read_ticks(reader, db, now)
        assert sorted(seen) == sorted([*later, held]) and len(seen) == 4
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
        return (
            sid,
            1,
            "env",
            "m",
            "g",
            "J",
            msgs,
            "r",
            0.5,
            0.5,
            None,
            completed,
            0,
            completed,
            1,
            now_text(),
        )

    slow = psycopg.connect(pg_url, autocommit=False)
    fast = psycopg.connect(pg_url, autocommit=True)
    try:
        sql = to_pyformat(launcher_sql.INSERT_STEP) + " RETURNING id"
        small = slow.execute(sql, row("s1", 1)).fetchone()[0]  # takes the smaller id, not committed
        large = fast.execute(sql, row("s2", 1)).fetchone()[0]  # larger id, committed first
        assert small < large
        h.settle()  # ingests `large` only
        assert h.poll()["success"] is False
        s = h.stats()
        assert s["rows"]["read"] == 1
        slow.commit()  # now the smaller id appears
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


def insert_with_id(
    url: str, pk: int, group: str, session: str, *, completed: bool, job: str = "job1"
) -> None:
    """A row written by hand with an explicit id (an identity column accepts one)."""
    db = connect(url)
    try:
        db.execute(
            f"INSERT INTO session_steps (id, {', '.join(launcher_sql.STEP_COLUMNS)}) VALUES "
            f"(?, {', '.join('?' * len(launcher_sql.STEP_COLUMNS))})",
            (
                pk,
                session,
                1,
                "env",
                "model",
                group,
                job,
                "[]",
                "r",
                1.0 if completed else 0.0,
                0.0,
                None,
                int(completed),
                0,
                int(completed),
                1,
                now_text(),
            ),
        )
    finally:
        db.close()


def test_rows_with_ids_at_or_below_zero_are_read_and_survive_a_restart(db_url, harness_factory):
    """The cursor started at 0: a row with id 0 or below was never read, never accounted, and its
    group waited for its TTL while /stats said balanced with no lag."""
    h = harness_factory(db_url)
    h.start(k=2)
    # in id order, as a sequence would hand them out (a row below what was read is not read again)
    insert_with_id(
        db_url, -9, "g-later", "t1", completed=True
    )  # its group completes after a restart
    insert_with_id(db_url, -5, "g-neg", "s1", completed=True)
    insert_with_id(db_url, 0, "g-neg", "s2", completed=True)
    w = Writer(db_url)
    try:
        w.group("ok", 2, steps=1)
        assert sorted(groups_of(h.poll())) == ["g-neg", "ok"]
        assert h.stats()["rows"]["read"] == 5 and h.stats()["groups"]["pending"] == 1
        assert h.service.sync()
        h.stop()
        h2 = harness_factory(db_url)
        w.step("g-later", "t2", 1, completed=True)
        doc = h2.poll()
        assert list(groups_of(doc)) == ["g-later"]
        assert sorted(i["extra_info"]["step_pk"] for i in doc["data"]["data"])[0] == -9
        s = h2.stats()
        assert s["rows"]["read"] == 6 and s["rows"]["served"] == 6 and s["lag_rows"] == 0
        assert_balanced(s)
    finally:
        w.close()


def test_a_transaction_left_open_elsewhere_on_the_server_does_not_hold_the_cursor_back(pg_url):
    """The safe cursor waited for the snapshot's xmin, which any transaction on the server holds
    back (another database, pg_dump, an idle session): while one stayed open the cursor never moved,
    every tick re-read a window that kept growing, and launcher_exited drops waited (never caught
    up)."""
    make_launcher_db(pg_url)
    db = connect(pg_url)
    w = Writer(pg_url, job="J")
    now = [0.0]
    reader = Reader("J", 0, 1000, clock=lambda: now[0])
    elsewhere = psycopg.connect(
        PG_DSN.rsplit("/", 1)[0] + "/postgres", autocommit=False
    )  # another database
    same = psycopg.connect(pg_url, autocommit=False)  # this database, another table
    try:
        elsewhere.execute("SELECT txid_current()")  # an xid held open, idle in transaction
        same.execute("CREATE TEMP TABLE t (a int)")
        same.execute("INSERT INTO t VALUES (1)")
        pks = [w.step("g", f"s{i}", 1) for i in range(5)]
        read_ticks(reader, db, now)
        assert reader.cursor == max(pks) and reader.caught_up, (reader.cursor, pks)
        # a writer of session_steps itself is still waited for
        held = same.execute(
            to_pyformat(launcher_sql.INSERT_STEP) + " RETURNING id",
            ("s-late", 1, "e", "m", "g", "J", "[]", "r", 0, 0, None, 0, 0, 0, 1, now_text()),
        ).fetchone()[0]
        more = [w.step("g", f"t{i}", 1) for i in range(2)]
        read_ticks(reader, db, now)
        assert reader.cursor < held < max(more)
        same.commit()
        assert read_ticks(reader, db, now) == [held] and reader.cursor == max(more)
    finally:
        elsewhere.close()
        same.close()
        w.close()
        db.close()
