"""Whether background work against the database fails, and since when (GET /health's answer).

Owns: the failing-since clock and the last error (redacted: /health is unauthenticated), and the
rate-limited log line of a failing tick. It must not retry anything: the workers do.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from rollout_buffer.core.config import Config
from rollout_buffer.core.errors import ConfigError, StorageError
from rollout_buffer.core.redact import redact

logger = logging.getLogger(__name__)


class Health:
    """Whether background work against the database is failing, and since when."""

    def __init__(self, config: Config, clock: Callable[[], float]) -> None:
        self.config = config
        self.clock = clock
        self.failing_since: float | None = None
        self.last_error: str | None = None
        self._logged_at = 0.0

    def failed(self, exc: BaseException) -> None:
        now = self.clock()
        if self.failing_since is None:
            self.failing_since = now
        self.last_error = redact(
            f"{type(exc).__name__}: {exc}"
        )  # /health shows it, unauthenticated
        if now - self._logged_at > 30.0:
            self._logged_at = now
            if isinstance(exc, (StorageError, ConfigError)):
                logger.error("background work failed (retrying): %s", exc)
            else:
                logger.exception("background tick failed (retrying)", exc_info=exc)

    def ok(self) -> None:
        if self.failing_since is not None:
            logger.info("database reachable again after %.1f s", self.clock() - self.failing_since)
        self.failing_since = None
        self.last_error = None

    def problem(self) -> str | None:
        """An error message when background work has been failing too long, else None."""
        since = self.failing_since
        if since is not None and self.clock() - since >= self.config.db_unhealthy_after_s:
            return self.last_error or "database unreachable"
        return None
