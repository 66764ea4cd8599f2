"""The DB-API shim against the real backends: timeouts, values the driver cannot decode, options."""

from __future__ import annotations

import time

import psycopg
import pytest
from support import Writer, assert_balanced, groups_of, make_launcher_db

from rollout_buffer.core.config import Config
from rollout_buffer.core.errors import StorageError
from rollout_buffer.storage import queries as q
from rollout_buffer.storage.db import connect, service_connect, to_pyformat


def test_a_locked_table_fails_fast_instead_of_hanging(pg_url, tmp_path):
    make_launcher_db(pg_url)
    config = Config.from_env(
        {}, db_url=pg_url, run_dir=str(tmp_path), lock_timeout_s=1.0, statement_timeout_s=3.0
    )
    db = service_connect(config, pg_url)
    assert db.scalar("SHOW lock_timeout") == "1s" and db.scalar("SHOW statement_timeout") == "3s"
    assert db.scalar("SELECT COUNT(*) FROM session_steps") == 0  # the URL's search_path is kept
    locker = psycopg.connect(pg_url, autocommit=False)
    try:
        locker.execute("LOCK TABLE session_steps IN ACCESS EXCLUSIVE MODE")
        t0 = time.monotonic()
        with pytest.raises(StorageError, match="lock timeout"):
            db.rows("SELECT id FROM session_steps")
        assert time.monotonic() - t0 < 3.0
        with pytest.raises(StorageError, match="statement timeout"):
            db.scalar("SELECT pg_sleep(10)")
    finally:
        locker.rollback()
        locker.close()
        db.close()
    plain = connect(pg_url)  # without timeouts (the simulator, export): the server's defaults
    try:
        assert plain.scalar("SHOW lock_timeout") == "0"
    finally:
        plain.close()


@pytest.mark.parametrize("created_at", ["infinity", "20000-01-01 00:00:00+00"])
def test_a_timestamp_python_cannot_hold_drops_its_group_only(pg_url, harness_factory, created_at):
    make_launcher_db(pg_url)
    h = harness_factory(pg_url)
    h.start(k=2)
    w = Writer(pg_url)
    try:
        bad = w.group("bad", 2, steps=2)
        w.step("bad", bad[0], 3, created_at=created_at)  # a row of a served session with that time
        w.step("bad", bad[0], 4, completed=True, step_reward=0.7)
        w.group("good", 2, steps=2)
    finally:
        w.close()
    doc = h.poll()
    assert list(groups_of(doc)) == ["good"]
    s = h.stats()
    assert s["rows"]["rejected"] == {"invalid_created_at": 1}
    assert s["groups"]["dropped"] == {"malformed_row": 1}
    assert_balanced(s)
    assert h.poll()["success"] is False


def test_sqlite_service_connections_are_durable(lite_url, tmp_path):
    config = Config.from_env({}, db_url=lite_url, run_dir=str(tmp_path))
    db = service_connect(config, lite_url)
    try:
        assert db.scalar("PRAGMA synchronous") == 2  # FULL
    finally:
        db.close()


def test_service_connections_never_prepare_statements_for_a_transaction_pooler(pg_url, tmp_path):
    """Also suspected in issue 14: psycopg prepares a statement run 5 times on a connection, and
    behind a transaction-pooling PgBouncer the next run lands on another server connection where it
    does not exist ("prepared statement ... does not exist"). The store records plans with
    executemany."""
    make_launcher_db(pg_url)
    config = Config.from_env({}, db_url=pg_url, run_dir=str(tmp_path))
    db = service_connect(config, pg_url)
    try:
        db.execute("CREATE TEMP TABLE decided (job_id TEXT, step_pk BIGINT)")
        for i in range(10):
            db.rows("SELECT id FROM session_steps WHERE job_id = ? AND id > ?", ("j", i))
            db.executemany(
                "INSERT INTO decided (job_id, step_pk) VALUES (?, ?)", [("j", i), ("j", -i)]
            )
        assert db.scalar("SELECT COUNT(*) FROM decided") == 20
        assert db.scalar("SELECT COUNT(*) FROM pg_prepared_statements") == 0
    finally:
        db.close()


def test_a_readonly_sqlite_connection_opens_any_path_and_never_creates_one(tmp_path):
    odd = tmp_path / "a dir?with#odd%chars"
    odd.mkdir()
    for url in (
        f"sqlite://{odd}/launcher.db",
        f"sqlite:///{odd}/launcher.db",
    ):  # '/abs' and '//abs'
        make_launcher_db(f"sqlite://{odd}/launcher.db")
        db = connect(url, readonly=True)
        try:
            assert db.scalar("SELECT COUNT(*) FROM session_steps") == 0
            with pytest.raises(StorageError):
                db.execute("DELETE FROM session_steps")
        finally:
            db.close()
    with pytest.raises(StorageError, match="cannot open SQLite database"):
        connect(f"sqlite://{tmp_path}/missing.db", readonly=True)
    assert not (tmp_path / "missing.db").exists()


def test_pyformat_translation_refuses_ambiguous_sql():
    assert (
        to_pyformat("SELECT a FROM t WHERE b = ? AND c = ?")
        == "SELECT a FROM t WHERE b = %s AND c = %s"
    )
    with pytest.raises(StorageError):
        to_pyformat("SELECT a FROM t WHERE b LIKE '%x'")
    with pytest.raises(StorageError):
        to_pyformat("SELECT '?' FROM t")
    for name in dir(q):  # every statement of the package translates
        value = getattr(q, name)
        if isinstance(value, str) and value.lstrip().upper().startswith(
            ("SELECT", "INSERT", "UPDATE", "DELETE")
        ):
            to_pyformat(value)
