"""A launcher-like writer process for the fault-injection suite: runs a plan of INSERT transactions.

Usage: ``python tests/fakes/fault_writer.py PLAN.json``. The plan (written by ``tests/faultlib.py``)
names the database URL and a list of transactions. Each transaction waits ``delay_s``, inserts its
rows in one transaction, keeps it open ``hold_s`` seconds, then commits. A transaction marked
``detach`` (Postgres only) is left open on a second connection while the next transactions are
written and committed, and committed when its hold is over: a smaller id becomes visible after
larger ones, as with many concurrent launcher workers.

Rows are inserted with the raw drivers, because some are deliberately ones the launcher's own
code would not write: a BLOB ``session_id`` or TEXT that is not valid UTF-8 (SQLite, via
``CAST(? AS TEXT)`` of bytes), ``'infinity'`` or garbage ``created_at``, NULL ``group_id``.
Each commit is appended to ``log_path`` as a JSON line ``{"txn", "t", "pks"}`` (wall time), so a
failure report can tell a gap in the writing from a gap in the reading.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from rollout_buffer.storage.launcher_sql import STEP_COLUMNS

COLUMNS = STEP_COLUMNS  # the launcher's columns, as storage names them
# Columns a row may give as {"bytes_hex": ...}: bound as bytes, stored as BLOB or (cast) invalid
# TEXT.
BLOB_KINDS = {"blob", "text_bytes"}


def decode(value: Any) -> tuple[Any, str | None]:
    """(parameter, kind) for one plan value; kind is 'blob' or 'text_bytes' for raw bytes."""
    if isinstance(value, dict):
        kind = value["kind"]
        assert kind in BLOB_KINDS, value
        return bytes.fromhex(value["hex"]), kind
    return value, None


class Conn:
    """One connection on either backend, with explicit transactions."""

    def __init__(self, url: str, backend: str, app_name: str = "fault_writer") -> None:
        self.backend = backend
        if backend == "sqlite":
            import sqlite3

            path = url[len("sqlite://") :]
            self.conn = sqlite3.connect(path, timeout=30, isolation_level=None)
            self.conn.execute("PRAGMA journal_mode=WAL")
            self.conn.execute("PRAGMA busy_timeout=30000")
        else:
            import psycopg

            self.conn = psycopg.connect(url, autocommit=True, application_name=app_name)
        self.open = False

    def begin(self) -> None:
        self.conn.execute("BEGIN IMMEDIATE" if self.backend == "sqlite" else "BEGIN")
        self.open = True

    def insert(self, row: dict[str, Any]) -> int:
        values, marks = [], []
        for col in COLUMNS:
            value, kind = decode(row[col])
            values.append(value)
            mark = "?" if self.backend == "sqlite" else "%s"
            marks.append(f"CAST({mark} AS TEXT)" if kind == "text_bytes" else mark)
        sql = "INSERT INTO session_steps ({}) VALUES ({}) RETURNING id".format(
            ", ".join(COLUMNS), ", ".join(marks)
        )
        cur = self.conn.execute(sql, values)
        return int(cur.fetchone()[0])

    def commit(self) -> None:
        self.conn.execute("COMMIT")
        self.open = False


def main(argv: list[str]) -> int:
    with open(argv[1], encoding="utf-8") as f:
        plan = json.load(f)
    backend = plan["backend"]
    main_conn = Conn(plan["url"], backend, plan.get("app_name", "fault_writer"))
    side_conn: Conn | None = None
    detached: tuple[float, int, list[int]] | None = None  # (commit at, txn index, pks) on side_conn
    # held open for the writer's whole life (it is killed, never returns): closed by its exit
    log = open(plan["log_path"], "a", encoding="utf-8")  # noqa: SIM115

    def logged(txn: int, pks: list[int]) -> None:
        log.write(json.dumps({"txn": txn, "t": time.time(), "pks": pks}) + "\n")
        log.flush()

    def settle_detached(force: bool = False) -> None:
        nonlocal detached
        if detached is not None and (force or time.monotonic() >= detached[0]):
            if force:
                time.sleep(max(0.0, detached[0] - time.monotonic()))
            assert side_conn is not None
            side_conn.commit()
            logged(detached[1], detached[2])
            detached = None

    for index, txn in enumerate(plan["txns"]):
        time.sleep(txn["delay_s"])
        settle_detached()
        if txn.get("detach") and detached is None and backend == "postgres":
            side_conn = side_conn or Conn(
                plan["url"], backend, plan.get("app_name", "fault_writer")
            )
            side_conn.begin()
            pks = [side_conn.insert(r) for r in txn["rows"]]
            detached = (time.monotonic() + txn["hold_s"], index, pks)
            continue
        main_conn.begin()
        pks = [main_conn.insert(r) for r in txn["rows"]]
        time.sleep(txn["hold_s"])
        main_conn.commit()
        logged(index, pks)
    settle_detached(force=True)
    log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
