"""Connection pairs: the launcher's database (source) and the buffer's state database.

Owns: opening and closing a (source, state) pair for one thread. They are the same connection
unless a separate state database is configured. A pair belongs to one thread and never crosses
a fork (STYLE §9.7): the loop thread keeps one, each request opens one lazily and closes it at
teardown, and the notifier thread opens the state side when it needs it. The pair's store runs
the lease's fence (``fence``) in every transaction that records a decision.

It must not share a connection between threads or keep one across a fork.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable, Iterator

from rollout_buffer.core.config import Config
from rollout_buffer.storage.db import Database, connect
from rollout_buffer.storage.session import Session
from rollout_buffer.storage.store import Store

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


class Pair:
    """A source and a state connection (one object when they share the database)."""

    def __init__(self, config: Config, fence: Callable[[Database], None] | None = None) -> None:
        self.source = service_connect(config, config.db_url)
        self.state_db = self.source
        if config.state_db_url and config.state_db_url != config.db_url:
            try:
                self.state_db = service_connect(config, config.state_db_url)
            except BaseException:
                self.source.close()
                raise
        self.store = Store(self.state_db, fence, config.buffer_name)

    def close(self) -> None:
        self.source.close()
        if self.state_db is not self.source:
            self.state_db.close()


@contextlib.contextmanager
def state_connection(config: Config) -> Iterator[Database]:
    """The state database alone, for one short piece of work (the notifier thread)."""
    db = service_connect(config, config.effective_state_db_url)
    try:
        yield db
    finally:
        db.close()


class LazyPair:
    """A pair opened on first use and closed by ``close()`` (one request, or the loop thread)."""

    def __init__(self, config: Config, fence: Callable[[Database], None] | None = None) -> None:
        self.config = config
        self.fence = fence
        self._pair: Pair | None = None

    def get(self) -> Pair:
        if self._pair is None:
            self._pair = Pair(self.config, self.fence)
        return self._pair

    @property
    def opened(self) -> bool:
        return self._pair is not None

    def close(self) -> None:
        if self._pair is not None:
            pair, self._pair = self._pair, None
            pair.close()

    def __enter__(self) -> LazyPair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
