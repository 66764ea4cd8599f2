"""A small DB-API shim over stdlib sqlite3 and psycopg 3, and the service's connections.

``connect(url)`` returns a :class:`SqliteDatabase` or a :class:`PostgresDatabase`. Both run in
autocommit mode; ``with db.transaction():`` groups writes (``BEGIN IMMEDIATE`` on SQLite so a
writer never deadlocks on a lock upgrade). SQL is written once with ``?`` placeholders; the
Postgres backend translates it to ``%s`` once per statement and refuses SQL that contains a
``%`` or a quoted ``?``. Driver errors are translated to :class:`StorageError` here, so nothing
else in the package imports a driver.

A connection belongs to one thread (SQLite's ``check_same_thread`` stays on as a tripwire) and
never crosses a fork: each long-lived thread opens its own, request handlers open one per request.

Owns: choosing the backend for a URL; what both backends do the same way (the closed-connection
tripwire, reading results with driver errors translated, ``transaction()`` and ``read_snapshot()``,
the liveness probe); per backend, connecting, placeholder translation, decoding and error
translation with the password redacted; the Postgres session a service connection asks for
(timeouts, keepalives, its name: :class:`Session`, :func:`service_connect`). It must not hold a
statement beyond transaction control and the connection's own settings (the statements are in
queries.py, launcher_sql.py and lease.py) nor know what a table means.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import sqlite3
import threading
import urllib.parse
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from rollout_buffer.core.config import Config
from rollout_buffer.core.errors import (
    ClosedError,
    ConfigError,
    DataError,
    IntegrityError,
    StorageError,
)
from rollout_buffer.core.model import BadText
from rollout_buffer.core.redact import redact
from rollout_buffer.storage.launcher_sql import TABLE_WRITERS


@dataclass(frozen=True)
class Session:
    """A Postgres session's settings (None or 0: the server's default)."""

    statement_timeout_s: float | None = None
    lock_timeout_s: float | None = None
    idle_in_transaction_timeout_s: float | None = None
    keepalive_s: float | None = None  # a dead peer is noticed within about this long
    application_name: str | None = None  # shown in pg_stat_activity

    def conninfo(self, params: dict[str, Any]) -> dict[str, Any]:
        """``params`` (libpq's, parsed from the URL) with this session's settings added."""
        out = dict(params)
        if self.application_name and not os.environ.get("PGAPPNAME"):
            out.setdefault("application_name", self.application_name)
        options = [
            f"-c {name}={int(value * 1000)}"
            for name, value in (
                ("statement_timeout", self.statement_timeout_s),
                ("lock_timeout", self.lock_timeout_s),
                ("idle_in_transaction_session_timeout", self.idle_in_transaction_timeout_s),
                ("tcp_user_timeout", self.keepalive_s),
            )
            if value
        ]
        if self.keepalive_s:
            probe = max(
                1, int(self.keepalive_s) // 3
            )  # idle, then two probes: about 3 probes' time
            keepalives = {"idle": probe, "interval": probe, "count": 2}
            # the server's end: the backend of a client that vanished ends, and its locks go
            options += [f"-c tcp_keepalives_{name}={value}" for name, value in keepalives.items()]
            # this end: a read from a server that vanished fails instead of hanging for hours
            out.setdefault("keepalives", 1)
            for name, value in keepalives.items():
                out.setdefault(f"keepalives_{name}", value)
            out.setdefault("tcp_user_timeout", int(self.keepalive_s * 1000))
        if options:
            out["options"] = " ".join(filter(None, [out.get("options"), *options]))
        return out


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


def connect(
    url: str, *, readonly: bool = False, durable: bool = False, session: Session | None = None
) -> Database:
    """Open a connection for the calling thread. The service passes its ``session`` (Postgres:
    statement, lock and idle-transaction timeouts, keepalives, its name; see Session), so that a
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


LEASE_SHARE = 0.8  # of the lease: the longest a statement or an idle transaction may last
KEEPALIVE_S = 30.0  # without a lease: a vanished peer is noticed within about this long


def application_name() -> str:
    """How the service's Postgres backends are named (pg_stat_activity): this host and process."""
    return f"rollout-buffer {socket.gethostname()}:{os.getpid()}"[:63]


def service_connect(config: Config, url: str, *, bound_s: float | None = None) -> Database:
    """A connection of the service itself: with its statement and lock timeouts (when ``bound_s``
    is given, the lease's: a statement at most that long, a lock wait at most half of it).

    Under a lease, nothing of this connection may outlive the lease by much if this process is
    paused or cut off (a standby must take over within the lease plus a few seconds): statements
    and idle transactions end within LEASE_SHARE of it, and keepalives notice a vanished peer
    within about the lease."""
    lease = config.lease_s
    share = lease * LEASE_SHARE if lease > 0 else None

    def timeout(value: float, *bounds: float | None) -> float:
        for bound in bounds:
            if bound is not None:
                value = min(value or bound, bound)
        return value

    return connect(
        url,
        durable=True,
        session=Session(
            statement_timeout_s=timeout(config.statement_timeout_s, bound_s, share),
            lock_timeout_s=timeout(config.lock_timeout_s, bound_s and bound_s / 2),
            idle_in_transaction_timeout_s=share,
            keepalive_s=max(3.0, lease) if lease > 0 else KEEPALIVE_S,
            application_name=application_name(),
        ),
    )


@contextlib.contextmanager
def state_connection(config: Config) -> Iterator[Database]:
    """The state database alone, for one short piece of work (the notifier thread)."""
    db = service_connect(config, config.effective_state_db_url)
    try:
        yield db
    finally:
        db.close()
