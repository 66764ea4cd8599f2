"""The SQLite lease's lock (runtime/ownership.py): one per database file and buffer name, whatever
path reaches the file, on real files in one process (open-file-description locks conflict between
descriptors, so two descriptors here stand for two instances)."""

from __future__ import annotations

import contextlib
import os
import sqlite3

from rollout_buffer.runtime.ownership import file_lock


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
    held = file_lock(url, "one")
    assert held is not None
    try:
        for other in ("alias.db", "hard.db", "dir/rl.db", "rl.db"):
            assert file_lock("sqlite://" + str(tmp_path / other), "one") is None, other
        named = file_lock("sqlite://" + str(tmp_path / "alias.db"), "two")  # another buffer
        unnamed = file_lock(url, "")
        assert named is not None and unnamed is not None
        os.close(named)
        os.close(unnamed)
    finally:
        os.close(held)
    again = file_lock("sqlite://" + str(tmp_path / "hard.db"), "one")  # released with its holder
    assert again is not None
    os.close(again)


def test_sqlite_closing_its_own_descriptors_keeps_the_lock(tmp_path):
    """POSIX record locks go when any descriptor of the file closes; the lease's must not."""
    url = make_db(tmp_path / "rl.db")
    held = file_lock(url, "")
    assert held is not None
    try:
        for _ in range(3):
            conn = sqlite3.connect(tmp_path / "rl.db")
            conn.execute("INSERT INTO t VALUES (1)")
            conn.commit()
            conn.close()
        assert file_lock(url, "") is None
        with contextlib.closing(sqlite3.connect(tmp_path / "rl.db")) as conn:  # SQLite still works
            assert conn.execute("SELECT COUNT(*) FROM t").fetchone()[0] == 3
    finally:
        os.close(held)
