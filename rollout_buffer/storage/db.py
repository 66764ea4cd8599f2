"""A small DB-API shim over stdlib sqlite3 and psycopg 3.

``connect(url)`` returns a :class:`SqliteDatabase` or a :class:`PostgresDatabase`. Both run in
autocommit mode; ``with db.transaction():`` groups writes (``BEGIN IMMEDIATE`` on SQLite so a
writer never deadlocks on a lock upgrade). SQL is written once with ``?`` placeholders; the
Postgres backend translates it to ``%s`` once per statement and refuses SQL that contains a
``%`` or a quoted ``?``. Driver errors are translated to :class:`StorageError` here, so nothing
else in the package imports a driver.

A connection belongs to one thread (SQLite's ``check_same_thread`` stays on as a tripwire) and
never crosses a fork: each long-lived thread opens its own, request handlers open one per request.

Owns: choosing the backend for a URL and creating the launcher's tables. The backends are in
database.py (what both do the same way), sqlite.py and postgres.py (connecting, placeholder
translation, driver error translation, redacting URLs); callers import them from here. It must not
hold a statement of its own beyond the launcher's DDL (every statement is in queries.py) nor know
what a table means.
"""

from __future__ import annotations

from rollout_buffer.core.errors import ConfigError, StorageError
from rollout_buffer.storage.database import Database
from rollout_buffer.storage.launcher_sql import LAUNCHER_DDL
from rollout_buffer.storage.postgres import PostgresDatabase, to_pyformat
from rollout_buffer.storage.session import Session
from rollout_buffer.storage.sqlite import SqliteDatabase, sqlite_path

# The backends, the helpers and the error callers use through this module (every driver error
# becomes a StorageError), the shim's one public face.
__all__ = [
    "Database",
    "PostgresDatabase",
    "SqliteDatabase",
    "StorageError",
    "connect",
    "create_launcher_tables",
    "sqlite_path",
    "to_pyformat",
]


def connect(
    url: str, *, readonly: bool = False, durable: bool = False, session: Session | None = None
) -> Database:
    """Open a connection for the calling thread. The service passes its ``session`` (Postgres:
    statement, lock and idle-transaction timeouts, keepalives, its name; see session.py), so that a
    stuck statement, a table locked by someone else (ALTER TABLE, VACUUM FULL, TRUNCATE) or a peer
    that vanished fails in seconds instead of hanging a poll, the loop or a takeover. ``durable``:
    SQLite commits survive a power loss too (synchronous=FULL), for the service's own few writes."""
    if url.startswith("sqlite://"):
        return SqliteDatabase(url, readonly=readonly, durable=durable)
    if url.startswith(("postgresql://", "postgres://")):
        return PostgresDatabase(url, session=session or Session())
    raise ConfigError(
        f"unsupported database URL {url!r}: expected sqlite:///path or postgresql://..."
    )


def create_launcher_tables(db: Database) -> None:
    """Create the launcher's two tables and their indexes if they are missing (init-db, tests)."""
    for ddl in LAUNCHER_DDL[db.backend]:
        db.execute(ddl)
