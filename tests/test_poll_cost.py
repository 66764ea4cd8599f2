"""Regression guards for the poll path (structure, not timing): an empty poll touches neither the
database nor any pending group, and a data poll's queries scale with the rows served, not with
what is pending."""
from __future__ import annotations

import threading

from support import groups_of
from rollout_buffer import db as db_mod
from rollout_buffer import connections as service_mod


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
        writer.group(f"p{g:03d}", 4, steps=1, complete=3)   # 300 pending groups, none ready
    harness.settle()
    assert harness.stats()["groups"]["pending"] == 300
    counting = Counting(monkeypatch)

    class Tripwire(dict):
        def __iter__(self):
            raise AssertionError("an empty poll iterated the pending groups")
        values = items = keys = __iter__

    acc = harness.service.current.acc
    with acc.lock:
        pending = acc.pending
        acc.pending = Tripwire()  # type: ignore[assignment]
    try:
        for _ in range(50):
            r = harness.client.post("/get_rollout_data", json={})
            assert r.status_code == 200 and r.get_json()["success"] is False
    finally:
        with acc.lock:
            acc.pending = pending
    assert counting.connects == 0 and counting.statements == 0


def test_data_poll_queries_scale_with_rows_served_not_pending(harness, writer, monkeypatch):
    harness.start(k=2)
    for g in range(200):
        writer.group(f"p{g:03d}", 2, steps=1, complete=1)   # pending, never ready
    for g in range(20):
        writer.group(f"r{g:02d}", 2, steps=2)               # 20 ready groups, 80 rows
    harness.settle()
    counting = Counting(monkeypatch)
    doc = harness.client.post("/get_rollout_data", json={}).get_json()
    assert len(groups_of(doc)) == 20
    # one connection; a body query per 900 rows, then BEGIN, the batch, the group records, COMMIT
    assert counting.connects == 1
    assert counting.statements <= 8, counting.statements
