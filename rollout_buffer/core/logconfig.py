"""Logging handlers, configured only at entry points (gunicorn hooks, the CLI), before the app is
built.

Owns: the handlers, the log file's rotation, the rate limit of lines per kind of event, and the
rule that one record is one line of its own: row data (a group_id, an exception's message) can hold
newlines and other control characters, and a log line must never be forged from it. It must not
configure anything on import: only entry points call it.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import re
import threading
import time
from collections.abc import Callable

from rollout_buffer.core.config import Config

FORMAT = "%(asctime)s [%(levelname)s] %(name)s: %(message)s"
_configured: set[str] = set()
# C0 and C1 controls, DEL, and the Unicode line and paragraph separators: whatever a terminal, a
# log viewer or a line-splitting reader may take as the end of a line or a command
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
CONTINUATION = "  | "  # begins every line of a traceback: no real record begins so


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    code = ord(char)
    return _NAMED.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def escape_controls(text: str) -> str:
    """``text`` with every control character written as a Python escape (a newline as \\n)."""
    return _CONTROLS.sub(_escape, text)


class OneLineFormatter(logging.Formatter):
    """Every record's message is one line: its control characters (the message's own, and those of
    its arguments: row data) are escaped. A traceback or stack keeps its lines, each escaped and
    begun with ``CONTINUATION``, so no line of it can pass for a record in the log's format."""

    def format(self, record: logging.LogRecord) -> str:
        record.message = escape_controls(record.getMessage())
        if self.usesTime():
            record.asctime = self.formatTime(record, self.datefmt)
        line = self.formatMessage(record)
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        extra = [record.exc_text, record.stack_info and self.formatStack(record.stack_info)]
        for text in extra:
            if text:
                line += "".join(
                    "\n" + CONTINUATION + escape_controls(part) for part in text.split("\n")
                )
        return line


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
    formatter = OneLineFormatter(FORMAT)
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
