"""The Postgres backend: psycopg 3 in autocommit mode, with ``?`` placeholders translated.

Owns: connecting (timeouts and the application name in the startup packet, no server-side prepared
statements), translating ``?`` to ``%s`` once per statement, loading timestamps Python cannot hold
as text, and translating psycopg's errors (a data exception apart) with the password redacted.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Sequence
from typing import Any, ClassVar

from rollout_buffer.core.errors import DataError, IntegrityError, StorageError
from rollout_buffer.core.redact import redact
from rollout_buffer.storage.database import Database
from rollout_buffer.storage.launcher_sql import TABLE_WRITERS
from rollout_buffer.storage.session import Session

PG_CONNECT_TIMEOUT_S = 5


_QUOTED = re.compile(r"'[^']*'")


def to_pyformat(sql: str) -> str:
    """Translate ``?`` placeholders to psycopg's ``%s``; refuse SQL that would be ambiguous."""
    if "%" in sql:
        raise StorageError(f"SQL for Postgres must not contain '%': {sql[:120]}")
    if any("?" in q for q in _QUOTED.findall(sql)):
        raise StorageError(f"SQL must not contain a quoted '?': {sql[:120]}")
    return sql.replace("?", "%s")


def _tolerant_timestamps(conn: Any) -> None:
    """Load a timestamp Python cannot hold ('infinity', a year after 9999) as its text instead of
    failing the whole query: the row is then rejected by values.epoch (invalid_created_at) and only
    its group is dropped, instead of every read that touches it failing for good."""
    from psycopg.types import datetime as pgdt

    def tolerant(base: type) -> type:
        # base is one of psycopg's loader classes, known only at run time: mypy cannot check a
        # class derived from a variable.
        class Tolerant(base):  # type: ignore[misc]
            def load(self, data: Any) -> Any:
                try:
                    return super().load(data)
                except Exception:
                    raw = bytes(data)
                    return (
                        raw.decode("utf-8", "replace")
                        if self.format == 0
                        else f"unrepresentable:{raw.hex()}"
                    )

        return Tolerant

    for name, oid in (
        ("TimestamptzLoader", "timestamptz"),
        ("TimestamptzBinaryLoader", "timestamptz"),
        ("TimestampLoader", "timestamp"),
        ("TimestampBinaryLoader", "timestamp"),
    ):
        conn.adapters.register_loader(oid, tolerant(getattr(pgdt, name)))


class PostgresDatabase(Database):
    """psycopg 3 in autocommit mode; ``transaction()`` issues BEGIN / COMMIT / ROLLBACK."""

    backend = "postgres"
    _begin_read_sql = "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY"
    # One cache of translated statements for every connection of the process (the SQL is fixed).
    _translated: ClassVar[dict[str, str]] = {}

    def __init__(self, url: str, *, session: Session) -> None:
        super().__init__()
        self.url = url
        try:
            import psycopg
            from psycopg.conninfo import conninfo_to_dict
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise StorageError("Postgres needs psycopg 3: pip install 'psycopg[binary]'") from exc
        self._psycopg = psycopg
        self._driver_errors = (psycopg.Error,)
        try:
            params: dict[str, Any] = session.conninfo(conninfo_to_dict(url))
            # prepare_threshold=None: no server-side prepared statements, which break behind a
            # transaction-pooling PgBouncer (the next transaction may land on another server
            # connection)
            self.conn = psycopg.connect(
                autocommit=True,
                connect_timeout=PG_CONNECT_TIMEOUT_S,
                prepare_threshold=None,
                **params,
            )
            _tolerant_timestamps(self.conn)
        except psycopg.Error as exc:
            raise StorageError(
                redact(f"cannot connect to Postgres {self.safe_url}: {exc}")
            ) from exc

    def _sql(self, sql: str) -> str:
        out = self._translated.get(sql)
        if out is None:
            out = to_pyformat(sql)
            if len(self._translated) < 10000:
                self._translated[sql] = out
        return out

    def _run(
        self, sql: str, params: Sequence[Any], many: bool = False, binary: bool = False
    ) -> Any:
        psycopg = self._psycopg
        try:
            cur = self.conn.cursor()
            if many:
                cur.executemany(self._sql(sql), params)
            else:
                cur.execute(
                    self._sql(sql), params if params else None, prepare=False, binary=binary
                )
            return cur
        except psycopg.IntegrityError as exc:
            raise IntegrityError(f"{exc} (in: {sql[:120]})") from exc
        except psycopg.Error as exc:
            kind = DataError if self._is_data_error(exc) else StorageError
            raise kind(
                redact(f"Postgres error on {self.safe_url}: {exc} (in: {sql[:120]})")
            ) from exc

    def _begin(self) -> None:
        self._run("BEGIN", ())

    def _is_data_error(self, exc: BaseException) -> bool:
        """SQLSTATE class 22 (data exception), e.g. a timestamp out of range while loading a row."""
        return isinstance(exc, self._psycopg.DataError)

    def table_writers(self) -> frozenset[str] | None:
        return frozenset(r[0] for r in self.rows(TABLE_WRITERS))

    @property
    def broken(self) -> bool:
        """True when the server connection is gone."""
        return bool(self.conn.closed or self.conn.broken)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            with contextlib.suppress(Exception):
                self.conn.close()
