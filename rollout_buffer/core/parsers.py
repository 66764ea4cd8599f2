"""The parsers of the settings' text: each turns an environment variable's value into its typed
value, or raises ValueError saying what was expected (the caller names the variable and the value).

Owns: the accepted forms of integers, numbers, booleans, choices, command lines, URLs and the
lease; nothing else (the table of settings is :mod:`~rollout_buffer.core.config`'s). A parser
opens nothing: a URL is checked, never connected to.
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Callable
from urllib.parse import urlsplit


def integer(lo: int | None = None, hi: int | None = None) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        try:
            value = int(raw.strip())
        except ValueError:
            raise ValueError("an integer") from None
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise ValueError(
                f"an integer from {lo} to {hi}" if hi is not None else f"an integer >= {lo}"
            )
        return value

    return parse


def number(lo: float | None = None) -> Callable[[str], float]:
    def parse(raw: str) -> float:
        try:
            value = float(raw.strip())
        except ValueError:
            raise ValueError("a number") from None
        if not math.isfinite(value) or (lo is not None and value < lo):
            raise ValueError(f"a finite number >= {lo}" if lo is not None else "a finite number")
        return value

    return parse


def choice(*choices: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip().lower()
        if value not in choices:
            raise ValueError("one of " + ", ".join(choices))
        return value

    return parse


def boolean(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError("a boolean (1/0, true/false, yes/no, on/off)")


def optional_integer(lo: int) -> Callable[[str], int | None]:
    """An integer >= lo, or None (off) when empty."""
    parse = integer(lo)
    return lambda raw: parse(raw) if raw.strip() else None


def text(raw: str) -> str:
    return raw


def optional_text(raw: str) -> str | None:
    return raw.strip() or None


def command_line(raw: str) -> tuple[str, ...] | None:
    if not raw.strip():
        return None
    try:
        return tuple(shlex.split(raw))
    except ValueError as exc:
        raise ValueError(f"a command line that shlex can split ({exc})") from None


def http_url(raw: str) -> str | None:
    value = raw.strip().rstrip("/")
    if not value:
        return None
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            "an http:// or https:// URL with a host, as clients reach this instance, "
            "e.g. http://buffer-1:18889"
        )
    if parts.username is not None or parts.password is not None:
        raise ValueError("a URL without user or password (it is shown on /health and in redirects)")
    if parts.query or parts.fragment:
        raise ValueError("a URL without ?query or #fragment")
    try:
        _ = parts.port
    except ValueError:
        raise ValueError("a URL whose port is a number from 1 to 65535") from None
    return value


def lease_seconds(raw: str) -> float:
    value = number(0.0)(raw)
    if 0 < value < 1:
        raise ValueError("0 (no lease) or a number of seconds >= 1")
    return value


def buffer_name(raw: str) -> str:
    value = raw.strip()
    if value and not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", value):
        raise ValueError("1-64 characters of A-Z a-z 0-9 . _ - (or empty: the unnamed buffer)")
    return value


def path_secret(raw: str) -> str | None:
    """A secret that is a whole URL path segment, or None (none) when empty."""
    value = raw.strip()
    if value and not re.fullmatch(r"[A-Za-z0-9._~-]{16,256}", value):
        raise ValueError("16-256 characters of A-Z a-z 0-9 . _ ~ - (a path segment of a URL)")
    return value or None


def log_level(raw: str) -> str:
    value = raw.strip().upper()
    if value not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ValueError("one of DEBUG, INFO, WARNING, ERROR")
    return value
