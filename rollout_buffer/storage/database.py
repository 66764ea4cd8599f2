"""The common interface of both database backends: statements, result rows, transactions.

Owns: what every connection does the same way whatever its driver (the closed-connection tripwire,
reading results with driver errors translated, ``transaction()`` and ``read_snapshot()``, the
liveness probe). The drivers live in :mod:`~rollout_buffer.storage.sqlite` and
:mod:`~rollout_buffer.storage.postgres`; :func:`~rollout_buffer.storage.db.connect` picks one.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from rollout_buffer.core.errors import ClosedError, DataError, StorageError
from rollout_buffer.core.redact import redact


class Database:
    """Common interface of both backends."""

    backend = "?"
    url: str

    def __init__(self) -> None:
        self._closed = False
        self._in_tx = False
        self.thread_id = threading.get_ident()

    @property
    def broken(self) -> bool:
        """True once the server connection is gone (Postgres; a SQLite file does not go away)."""
        return False

    # -- subclass hooks -----------------------------------------------------------------
    def _run(
        self, sql: str, params: Sequence[Any], many: bool = False, binary: bool = False
    ) -> Any:
        raise NotImplementedError

    def _begin(self) -> None:
        raise NotImplementedError

    # -- public API -------------------------------------------------------------------------
    def _check(self) -> None:
        if self._closed:
            raise ClosedError(f"database connection to {self.safe_url} used after close")

    @property
    def safe_url(self) -> str:
        """The URL without a password."""
        return redact(self.url)

    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Run a statement; returns the affected row count."""
        self._check()
        cur = self._run(sql, params)
        count: int = cur.rowcount
        return count

    def executemany(self, sql: str, seq: Sequence[Sequence[Any]]) -> None:
        """Run a statement once per parameter tuple."""
        self._check()
        if seq:
            self._run(sql, seq, many=True)

    def _fetch(self, cur: Any, how: str, sql: str) -> Any:
        """cur.fetchall()/fetchone(): values are decoded here, so driver errors can happen here
        too."""
        try:
            return cur.fetchall() if how == "all" else cur.fetchone()
        except self._driver_errors as exc:
            kind = DataError if self._is_data_error(exc) else StorageError
            raise kind(
                redact(f"{self.backend} error reading the results of {sql[:120]}: {exc}")
            ) from exc

    def _is_data_error(self, exc: BaseException) -> bool:
        return False

    _driver_errors: tuple[type[BaseException], ...] = (sqlite3.Error,)

    def rows(
        self, sql: str, params: Sequence[Any] = (), *, binary: bool = False
    ) -> list[tuple[Any, ...]]:
        """All result rows as tuples (the fast path); ``binary`` asks Postgres for binary results
        (bytea arrives as raw bytes instead of hex text)."""
        self._check()
        rows: list[tuple[Any, ...]] = self._fetch(self._run(sql, params, binary=binary), "all", sql)
        return rows

    def fetchall(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        """All result rows as dicts keyed by column name."""
        self._check()
        cur = self._run(sql, params)
        names = [d[0] for d in cur.description]
        return [dict(zip(names, row, strict=True)) for row in self._fetch(cur, "all", sql)]

    def fetchone(self, sql: str, params: Sequence[Any] = ()) -> dict[str, Any] | None:
        """The first result row as a dict, or None."""
        self._check()
        cur = self._run(sql, params)
        row = self._fetch(cur, "one", sql)
        if row is None:
            return None
        return dict(zip([d[0] for d in cur.description], row, strict=True))

    def scalar(self, sql: str, params: Sequence[Any] = ()) -> Any:
        """The first column of the first row, or None."""
        self._check()
        row = self._fetch(self._run(sql, params), "one", sql)
        return None if row is None else row[0]

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Database]:
        """BEGIN ... COMMIT, or ROLLBACK if the block raises. Not re-entrant."""
        self._check()
        if self._in_tx:
            raise StorageError("nested transaction")
        self._begin()
        self._in_tx = True
        try:
            yield self
        except BaseException:
            self._in_tx = False
            with contextlib.suppress(Exception):
                self._run("ROLLBACK", ())
            raise
        self._in_tx = False
        self._run("COMMIT", ())

    @contextlib.contextmanager
    def read_snapshot(self) -> Iterator[Database]:
        """A read-only transaction: every statement inside sees one snapshot."""
        self._check()
        self._run(self._begin_read_sql, ())
        try:
            yield self
        finally:
            with contextlib.suppress(Exception):
                self._run("COMMIT", ())

    _begin_read_sql = "BEGIN"

    def close(self) -> None:
        """Close the connection; idempotent."""
        raise NotImplementedError

    def table_writers(self) -> frozenset[str] | None:
        """Where writers can commit out of id order: the transactions writing session_steps now,
        else None (SQLite serialises writers)."""
        return None

    def answers(self) -> bool:
        """True when a trivial statement succeeds: the server is there and this connection works (so
        a failure just before was about the statement or its data, not the database)."""
        try:
            return bool(self.scalar("SELECT 1") == 1)
        except StorageError:
            return False

    def __enter__(self) -> Database:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
