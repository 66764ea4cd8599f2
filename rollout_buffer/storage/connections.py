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
from rollout_buffer.storage.store import Store


def application_name() -> str:
    """How the service's Postgres backends are named (pg_stat_activity): this host and process."""
    return f"rollout-buffer {socket.gethostname()}:{os.getpid()}"[:63]


def service_connect(config: Config, url: str, *, bound_s: float | None = None) -> Database:
    """A connection of the service itself: with its statement and lock timeouts (when ``bound_s``
    is given, the lease's: a statement at most that long, a lock wait at most half of it)."""

    def timeout(value: float, bound: float | None) -> float:
        return value if bound is None else min(value or bound, bound)

    return connect(
        url,
        statement_timeout_s=timeout(config.statement_timeout_s, bound_s),
        lock_timeout_s=timeout(config.lock_timeout_s, bound_s and bound_s / 2),
        durable=True,
        application_name=application_name(),
    )


class Pair:
    """A source and a state connection (one object when they share the database)."""

    def __init__(self, config: Config, fence: Callable[[Database], None] | None = None) -> None:
        self.src = service_connect(config, config.db_url)
        self.st = self.src
        if config.state_db_url and config.state_db_url != config.db_url:
            try:
                self.st = service_connect(config, config.state_db_url)
            except BaseException:
                self.src.close()
                raise
        self.store = Store(self.st, fence)

    def close(self) -> None:
        self.src.close()
        if self.st is not self.src:
            self.st.close()


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
