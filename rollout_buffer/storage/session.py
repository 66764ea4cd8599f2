"""What a service connection asks of its Postgres session: timeouts, keepalives, its name.

Owns: turning those wishes into libpq connection parameters (the server's settings go into the
startup packet's ``options``, next to any the URL carries; what the URL or ``PGAPPNAME`` sets
wins). A paused, stuck or cut-off owner must never hold the lease row's lock for long (issue 20):
``idle_in_transaction_session_timeout`` ends a transaction left idle, ``statement_timeout`` a
statement left running, and TCP keepalives on both ends (plus ``tcp_user_timeout``) end a
connection whose peer vanished. It must not open anything or import a driver.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


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
