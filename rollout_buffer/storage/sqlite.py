"""The SQLite backend: stdlib sqlite3 in autocommit mode, WAL, a busy timeout, BEGIN IMMEDIATE.

Owns: opening a SQLite file (read-only by URI, or read-write in WAL), decoding its text (invalid
UTF-8 arrives as :class:`~rollout_buffer.core.model.BadText`, not as an error for the whole query)
and translating sqlite3's errors.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import urllib.parse
from collections.abc import Sequence
from typing import Any

from rollout_buffer.core.errors import ConfigError, IntegrityError, StorageError
from rollout_buffer.core.model import BadText
from rollout_buffer.storage.database import Database

SQLITE_BUSY_TIMEOUT_S = 5.0


def sqlite_path(url: str) -> str:
    """'sqlite:///abs/path' -> '/abs/path'; 'sqlite://rel/path' -> 'rel/path' (the launcher's
    rule)."""
    if not url.startswith("sqlite://"):
        raise ConfigError(f"not a sqlite URL: {url!r}")
    return url[len("sqlite://") :]


def _sqlite_text(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return BadText(raw.decode("utf-8", "replace"))


class SqliteDatabase(Database):
    """stdlib sqlite3, autocommit, WAL, busy timeout, BEGIN IMMEDIATE for writes."""

    backend = "sqlite"

    def __init__(self, url: str, *, readonly: bool = False, durable: bool = False) -> None:
        super().__init__()
        self.url = url
        self.path = sqlite_path(url)
        try:
            if readonly:
                # a URI of the absolute path, quoted: '?', '#', '%' or a leading '//' in it stay a
                # path
                uri = f"file:{urllib.parse.quote(os.path.realpath(self.path))}?mode=ro"
                self.conn = sqlite3.connect(
                    uri, uri=True, timeout=SQLITE_BUSY_TIMEOUT_S, isolation_level=None
                )
            else:
                self.conn = sqlite3.connect(
                    self.path, timeout=SQLITE_BUSY_TIMEOUT_S, isolation_level=None
                )
            self.conn.text_factory = _sqlite_text
            self.conn.execute(f"PRAGMA busy_timeout={int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
            if not readonly:
                mode = self.conn.execute("PRAGMA journal_mode").fetchone()[0]
                if mode != "wal":
                    self.conn.execute("PRAGMA journal_mode=WAL")
            # NORMAL in WAL mode survives a crash of the process but not of the machine; the
            # service's
            # decisions must survive both (a batch the trainer has must stay recorded as served)
            self.conn.execute("PRAGMA synchronous=FULL" if durable else "PRAGMA synchronous=NORMAL")
        except sqlite3.Error as exc:
            raise StorageError(f"cannot open SQLite database {self.path!r}: {exc}") from exc

    def _run(
        self, sql: str, params: Sequence[Any], many: bool = False, binary: bool = False
    ) -> Any:
        try:
            if many:
                return self.conn.executemany(sql, params)
            return self.conn.execute(sql, params)
        except sqlite3.IntegrityError as exc:
            raise IntegrityError(f"{exc} (in: {sql[:120]})") from exc
        except sqlite3.Error as exc:
            raise StorageError(f"SQLite error on {self.path}: {exc} (in: {sql[:120]})") from exc

    def _begin(self) -> None:
        self._run("BEGIN IMMEDIATE", ())

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            with contextlib.suppress(Exception):
                self.conn.close()
