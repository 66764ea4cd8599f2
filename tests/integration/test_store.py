"""The state store alone (unit tier), on SQLite and Postgres: the ``rollout_buffer_*`` tables
through :class:`rollout_buffer.storage.store.Store`, with plans built by hand (no accumulator, no
service)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from rollout_buffer.core.errors import IntegrityError, JobOwned, StorageError
from rollout_buffer.core.model import (
    INCOMPLETE_IN_SERVED,
    LATE_SERVED,
    MISSING_GROUP,
    REJECTED,
    ROW_DROPPED,
    TTL,
    Batch,
    Decisions,
    Drop,
    GroupKey,
    LauncherState,
    RowEvent,
    RowKey,
    Served,
    Take,
)
from rollout_buffer.storage import queries as q
from rollout_buffer.storage.db import connect
from rollout_buffer.storage.store import LauncherRecord, Store

JOB = "store-job"


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    db = connect(db_url)
    s = Store(db)
    s.ensure_schema()
    yield s
    db.close()


def _plan(batch_id: str = "b1", request_id: str | None = "r1") -> Decisions:
    """A poll's plan: a batch of one served group (one incomplete session), a TTL drop, a rejected
    row without a group and a late row of the served group."""
    take = Take("g-served", {"s1": (1, 3), "s2": (2, 4)}, {"s3": (5,)})
    return Decisions(
        served=[Served(take, batch_id)],
        drops=[Drop("g-ttl", TTL, [6, 7], ["s4"])],
        rows=[
            RowEvent(8, REJECTED, MISSING_GROUP, None, "s5"),
            RowEvent(9, ROW_DROPPED, LATE_SERVED, "g-served", "s6"),
        ],
        batch=Batch(
            batch_id, JOB, request_id, bytes(range(16)), ["g-served"], n_items=4, n_bytes=1234
        ),
    )


def test_a_plan_is_recorded_and_loads_back_as_the_same_decisions(store):
    store.record(JOB, _plan())
    t = store.load_totals(JOB)
    assert t.decided == {"g-served": "served", "g-ttl": "dropped"}
    assert (t.groups_served, t.served_rows, dict(t.groups_dropped)) == (1, 4, {TTL: 1})
    assert dict(t.dropped) == {INCOMPLETE_IN_SERVED: 1, TTL: 2, LATE_SERVED: 1}
    assert dict(t.rejected) == {MISSING_GROUP: 1}
    assert t.accounted_rows == 9  # every pk of the plan, once
    assert store.group_pks(JOB, "g-served") == [1, 2, 3, 4, 5] and store.group_pks(
        JOB, "g-ttl"
    ) == [6, 7]
    assert (
        store.group_decision(JOB, "g-ttl") == ("dropped", TTL)
        and store.group_decision(JOB, "nope") is None
    )
    assert store.tainted_sessions(JOB) == ["s5"]
    assert store.row_pks_from(JOB, 9) == {9}
    batch, at = store.batch_for_request(JOB, "r1")
    assert batch == _plan().batch and abs(at - time.time()) < 60
    assert store.batch_exists("b1") and store.recent_request_ids(JOB, time.time() - 60) == ["r1"]


def test_a_plan_that_fails_leaves_nothing_of_it(store):
    store.record(JOB, _plan())
    again = _plan(batch_id="b2", request_id="r2")  # serves g-served a second time: refused
    again.drops.append(Drop("g-other", TTL, [10], []))
    with pytest.raises(IntegrityError):
        store.record(JOB, again)
    assert not store.batch_exists("b2") and store.batch_for_request(JOB, "r2") is None
    assert store.group_decision(JOB, "g-other") is None
    assert store.load_totals(JOB).accounted_rows == 9


def test_drops_and_rows_are_idempotent_so_an_uncertain_commit_can_be_retried(store):
    plan = Decisions(
        drops=[Drop("g-ttl", TTL, [6, 7], ["s4"])],
        rows=[RowEvent(8, REJECTED, MISSING_GROUP, None, "s5")],
    )
    store.record(JOB, plan)
    store.record(JOB, plan)
    t = store.load_totals(JOB)
    assert dict(t.groups_dropped) == {TTL: 1} and t.accounted_rows == 3


def test_unconfirmed_notifications_are_listed_until_marked(store):
    store.record(JOB, _plan())
    pending = {u.key: (u.reason, u.sessions) for u in store.unnotified()}
    assert pending == {
        GroupKey(JOB, "g-served"): (INCOMPLETE_IN_SERVED, ["s3"]),
        GroupKey(JOB, "g-ttl"): (TTL, ["s4"]),
        RowKey(JOB, 8): (MISSING_GROUP, ["s5"]),
        RowKey(JOB, 9): (LATE_SERVED, ["s6"]),
    }
    store.mark_notified([GroupKey(JOB, "g-ttl"), RowKey(JOB, 9)])
    assert {u.key for u in store.unnotified()} == {GroupKey(JOB, "g-served"), RowKey(JOB, 8)}


def test_each_buffer_has_its_own_active_job_ended_jobs_and_notifications(store):
    """Buffers on one state database (ROLLOUT_BUFFER_NAME): a job belongs to the buffer that first
    selected it; another buffer can neither activate it nor see its notifications."""
    other = Store(store.db, buffer="other")
    store.activate_job(JOB, 2, 0, 0, 0, [])
    other.activate_job("theirs", 2, 0, 0, 0, [Drop("g-old", TTL, [1], ["s-old"])])
    assert store.active_job()["job_id"] == JOB and other.active_job()["job_id"] == "theirs"
    with pytest.raises(JobOwned, match="'other'"):
        store.activate_job("theirs", 3, 0, 0, 0, [])
    assert store.active_job()["job_id"] == JOB and other.get_job("theirs")["k"] == 2
    store.record(JOB, _plan())
    assert {u.key.job_id for u in store.unnotified()} == {JOB}
    assert {u.key.job_id for u in other.unnotified()} == {"theirs"}
    store.activate_job("next", 2, 0, 0, 0, [])  # ends JOB in this buffer only
    assert [j["job_id"] for j in store.ended_jobs(time.time() + 1)] == [JOB]
    assert other.ended_jobs(time.time() + 1) == [] and other.active_job()["job_id"] == "theirs"
    assert store.job_buffer("theirs") == "other" and store.job_buffer("nobody's") is None


def test_one_active_job_with_its_tombstones_cursor_and_launcher(store):
    store.activate_job("a", 4, 0, 0, 0, [])
    store.activate_job("b", 2, 100, 100, 100, [Drop("old", "restart_training", [50, 60], [])])
    active = store.active_job()
    assert (active["job_id"], int(active["k"]), int(active["floor_pk"])) == ("b", 2, 100)
    assert store.group_decision("b", "old") == ("dropped", "restart_training")
    assert int(store.get_job("a")["active"]) == 0
    store.save_cursor("b", 150, 120)
    job = store.get_job("b")
    assert (int(job["cursor_pk"]), int(job["low_water_pk"])) == (150, 120)
    store.save_launcher("b", LauncherRecord(4242, 4242, 99, LauncherState.RUNNING), "instance-1")
    job = store.get_job("b")
    assert (job["launcher_pid"], LauncherState.parse(job["launcher_state"])) == (
        4242,
        LauncherState.RUNNING,
    )
    assert store.launcher_owner("b") == "instance-1"


def test_retention_prunes_old_batches_and_purges_an_ended_job_in_steps(store):
    store.activate_job(JOB, 2, 0, 0, 0, [])
    store.record(JOB, _plan())
    assert store.prune_batches(time.time() - 3600) == 0  # recorded just now: kept
    assert store.prune_batches(time.time() + 1) == 1 and not store.batch_exists("b1")
    store.activate_job("next", 2, 0, 0, 0, [])
    assert [j["job_id"] for j in store.ended_jobs(time.time() + 1)] == [JOB]
    removed = 0
    while n := store.purge_step(JOB, limit=1):
        removed += n
    assert removed == 4 and store.load_totals(JOB).accounted_rows == 0  # 2 groups, 2 rows
    store.mark_purged(JOB, 200)
    assert store.ended_jobs(time.time() + 1) == []


def test_the_schema_is_created_once_and_a_newer_one_is_refused(store):
    store.ensure_schema()  # again: nothing changes
    assert int(store.db.scalar(q.GET_META, ("schema_version",))) == q.SCHEMA_VERSION
    store.db.execute(q.PUT_META, ("schema_version", str(q.SCHEMA_VERSION + 1)))
    with pytest.raises(StorageError, match="upgrade rollout-buffer"):
        store.ensure_schema()


def test_state_written_before_names_belongs_to_the_unnamed_buffer(db_url):
    """A database at schema version 5 (before ROLLOUT_BUFFER_NAME) with an active job: after the
    migration its job is the unnamed buffer's, active as before (the unnamed buffer's lease row
    keeps its scope, "job"), and a named buffer has none of it and cannot take its job."""
    db = connect(db_url)
    try:
        with db.transaction():
            for ddl in q.STATE_DDL:
                db.execute(ddl)
            db.execute(q.PUT_META, ("schema_version", "1"))
            for version in range(1, 5):
                for ddl in q.MIGRATIONS[version]:
                    db.execute(ddl)
            db.execute(q.PUT_META, ("schema_version", "5"))
            db.execute(
                "INSERT INTO rollout_buffer_jobs (job_id, k, floor_pk, cursor_pk, low_water_pk, "
                "active, started_at, updated_at) VALUES ('old-job', 4, 0, 17, 9, 1, 0, 0)"
            )
        unnamed, named = Store(db), Store(db, buffer="x")
        unnamed.ensure_schema()
        assert int(db.scalar(q.GET_META, ("schema_version",))) == q.SCHEMA_VERSION
        row = unnamed.active_job()
        assert row is not None and row["job_id"] == "old-job" and int(row["cursor_pk"]) == 17
        assert named.active_job() is None and unnamed.job_buffer("old-job") == ""
        with pytest.raises(JobOwned):
            named.activate_job("old-job", 4, 0, 0, 0, [])
        assert unnamed.active_job()["job_id"] == "old-job"
    finally:
        db.close()
