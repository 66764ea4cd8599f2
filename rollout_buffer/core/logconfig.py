"""Logging handlers, configured only at entry points (gunicorn hooks, the CLI), before the app is
built.

Owns: the handlers, the log file's rotation and the rate limit of lines per kind of event. It must
not configure anything on import: only entry points call it.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import threading
import time
from collections.abc import Callable

from rollout_buffer.core.config import Config

FORMAT = "%(asctime)s [%(levelname)s] %(name)s: %(message)s"
_configured: set[str] = set()


def configure_logging(config: Config, *, console: bool = True) -> str | None:
    """A rotating file in the run directory (50 MB x 5) plus the console; returns the file path.

    Idempotent per log file. Per-poll lines are DEBUG, so the default INFO level writes lines per
    event (groups dropped, launcher events), never per poll.
    """
    root = logging.getLogger("rollout_buffer")
    root.setLevel(config.log_level)
    path = None
    try:
        os.makedirs(config.run_dir, exist_ok=True)
        path = os.path.join(config.run_dir, "rollout_buffer.log")
    except OSError as exc:
        logging.getLogger(__name__).warning(
            "cannot create log directory %s: %s", config.run_dir, exc
        )
    key = path or "<console>"
    if key in _configured:
        return path
    _configured.add(key)
    formatter = logging.Formatter(FORMAT)
    if path:
        fh = logging.handlers.RotatingFileHandler(
            path, maxBytes=50 * 1024 * 1024, backupCount=5, encoding="utf-8"
        )
        fh.setFormatter(formatter)
        root.addHandler(fh)
    if console:
        ch = logging.StreamHandler()
        ch.setFormatter(formatter)
        root.addHandler(ch)
    root.propagate = False
    return path


class EventLog:
    """Log lines per kind of event, rate-limited: the first of a kind is logged at once, the next
    ones of that kind within ``window_s`` are counted and summed up in one line when the window
    has passed (at the next event of any kind, or a ``flush``). A flood of bad rows or drops costs
    a few lines a minute, never one per row."""

    def __init__(
        self,
        logger: logging.Logger,
        window_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.window_s = window_s
        self.clock = clock
        self._lock = threading.Lock()
        self._windows: dict[
            str, tuple[float, int, int]
        ] = {}  # kind -> (window start, suppressed, level)

    def event(self, kind: str, level: int, msg: str, *args: object) -> None:
        now = self.clock()
        with self._lock:
            due = self._due(now)
            start, suppressed, _ = self._windows.get(kind, (None, 0, level))
            if start is None or now - start >= self.window_s:
                self._windows[kind] = (now, 0, level)
                log_now = True
            else:
                self._windows[kind] = (start, suppressed + 1, level)
                log_now = False
        for k, n, lvl in due:
            self.logger.log(
                lvl,
                "%d more %s events in the last %.0f s (not logged one by one)",
                n,
                k,
                self.window_s,
            )
        if log_now:
            self.logger.log(level, msg, *args)

    def flush(self) -> None:
        """Write the summaries whose window has passed."""
        with self._lock:
            due = self._due(self.clock())
        for k, n, lvl in due:
            self.logger.log(
                lvl,
                "%d more %s events in the last %.0f s (not logged one by one)",
                n,
                k,
                self.window_s,
            )

    def _due(self, now: float) -> list[tuple[str, int, int]]:
        due = []
        for kind, (start, n, lvl) in list(self._windows.items()):
            if now - start >= self.window_s:
                if n:
                    due.append((kind, n, lvl))
                del self._windows[kind]
        return due
