"""The SQLite lease's lock (storage/lease.py): one per database file and buffer name, whatever
path reaches the file, on real files in one process (open-file-description locks conflict between
descriptors, so two descriptors here stand for two instances)."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import sys

from rollout_buffer.storage.lease import file_lock, file_unlock


def make_db(path) -> str:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("CREATE TABLE t (x INTEGER)")
    return "sqlite://" + str(path)


def test_every_path_to_one_database_file_reaches_one_lock_per_buffer(tmp_path):
    url = make_db(tmp_path / "rl.db")
    (tmp_path / "alias.db").symlink_to(tmp_path / "rl.db")
    os.link(tmp_path / "rl.db", tmp_path / "hard.db")
    (tmp_path / "dir").symlink_to(tmp_path)
    held = file_lock(url, "one", "owner")
    assert held is not None
    for other in ("alias.db", "hard.db", "dir/rl.db", "rl.db"):
        assert file_lock("sqlite://" + str(tmp_path / other), "one", "standby") is None, other
    named = file_lock("sqlite://" + str(tmp_path / "alias.db"), "two", "standby")  # another buffer
    unnamed = file_lock(url, "", "standby")
    assert named is not None and unnamed is not None
    file_unlock(named, "two")
    file_unlock(unnamed, "")
    file_unlock(held, "one")
    again = file_lock("sqlite://" + str(tmp_path / "hard.db"), "one", "standby")  # given up
    assert again is not None
    file_unlock(again, "one")


def test_sqlite_closing_its_own_descriptors_keeps_the_lock(tmp_path):
    """POSIX record locks go when any descriptor of the file closes; the lease's must not."""
    url = make_db(tmp_path / "rl.db")
    held = file_lock(url, "", "owner")
    assert held is not None
    try:
        for _ in range(3):
            conn = sqlite3.connect(tmp_path / "rl.db")
            conn.execute("INSERT INTO t VALUES (1)")
            conn.commit()
            conn.close()
        assert file_lock(url, "", "standby") is None
        with contextlib.closing(sqlite3.connect(tmp_path / "rl.db")) as conn:  # SQLite still works
            assert conn.execute("SELECT COUNT(*) FROM t").fetchone()[0] == 3
    finally:
        file_unlock(held, "")


def test_a_failed_attempt_never_drops_sqlites_own_locks(tmp_path):
    """A standby that fails to take the lease must not close a descriptor of the database file:
    that would drop every POSIX lock of its process on it, SQLite's write lock included, and
    another process could write under it (an owner and a standby in one process, as the tests
    run them, saw "disk I/O error")."""
    path = tmp_path / "rollback.db"  # a rollback journal: SQLite's write lock is on the file
    with contextlib.closing(sqlite3.connect(path)) as setup:
        setup.execute("CREATE TABLE t (x INTEGER)")
    url = "sqlite://" + str(path)
    held = file_lock(url, "", "owner")
    assert held is not None
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")  # this process holds SQLite's write lock
        for _ in range(3):
            assert file_lock(url, "", "standby") is None
        other = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sqlite3, sys; c = sqlite3.connect(sys.argv[1], timeout=0.2); "
                "c.execute('BEGIN IMMEDIATE')",
                str(path),
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert other.returncode != 0 and "locked" in other.stderr, other.stderr
    finally:
        conn.execute("ROLLBACK")
        conn.close()
        file_unlock(held, "")
