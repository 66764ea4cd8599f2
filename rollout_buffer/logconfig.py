"""Logging handlers, configured only at entry points (gunicorn hooks, the CLI), before the app is built."""
from __future__ import annotations

import logging
import logging.handlers
import os

from .config import Config

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
        logging.getLogger(__name__).warning("cannot create log directory %s: %s", config.run_dir, exc)
    key = path or "<console>"
    if key in _configured:
        return path
    _configured.add(key)
    formatter = logging.Formatter(FORMAT)
    if path:
        fh = logging.handlers.RotatingFileHandler(path, maxBytes=50 * 1024 * 1024, backupCount=5, encoding="utf-8")
        fh.setFormatter(formatter)
        root.addHandler(fh)
    if console:
        ch = logging.StreamHandler()
        ch.setFormatter(formatter)
        root.addHandler(ch)
    root.propagate = False
    return path
