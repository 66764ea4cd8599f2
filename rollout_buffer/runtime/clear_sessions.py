"""The LLM proxy's ``POST /admin/clear_sessions``: what waits to be sent, what its answers mean.

What waits to be sent is coalesced per reason (:class:`Entry`): repeated ids are kept once, so
memory is bounded by the sessions in flight (SPEC §3). What an answer means (:func:`outcome`): any
2xx: the sessions are cleared. 404 or 405: the proxy has no such endpoint (the upstream
``rl/llm_proxy.py`` has none), so no retry can ever succeed. 408, 425, 429, any 3xx (never
followed: an auth gateway's redirect to its login page is not a clear) and any 5xx or no answer at
all: retried with backoff, as long as it takes. Any other 4xx: the proxy refuses this request; it is
tried a few times (the proxy may be mid-deploy), then given up.

Owns: the path, the pending entry, that classification and the words that explain it. It must not
do I/O: :class:`~rollout_buffer.runtime.proxy.ProxyNotifier` sends.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

CLEAR_PATH = "/admin/clear_sessions"

#: What one POST came to.
DELIVERED, RETRY, ABSENT, REJECTED = "delivered", "retry", "absent", "rejected"

#: Answers that say the proxy has no clear-sessions endpoint.
ABSENT_STATUSES = frozenset({404, 405})
#: 4xx answers that ask the caller to come back later: retried like a 5xx.
TRANSIENT_4XX = frozenset({408, 425, 429})

ABSENT_WARNING = (
    "the LLM proxy answered HTTP %s to POST %s: it has no clear_sessions endpoint (the upstream "
    "rl/llm_proxy.py has none), or LLM_PROXY_HOST/LLM_PROXY_PORT name another server. Sessions of "
    "dropped groups are not cleared there: their notifications are dropped (counted in /health and "
    "/stats as proxy_notifications.dropped_sessions), and the proxy is asked again after %.0f s"
)


def outcome(status: int | None) -> str:
    """What an HTTP status (None: no answer at all) means for the sessions it was about."""
    if status is None:
        return RETRY
    if 200 <= status < 300:
        return DELIVERED
    if status in ABSENT_STATUSES:
        return ABSENT
    if 400 <= status < 500 and status not in TRANSIENT_4XX:
        return REJECTED
    return RETRY


@dataclass
class Entry:
    """What is waiting to be sent for one reason; ids are sets so repeats are stored once."""

    sessions: set[str] = field(default_factory=set)
    groups: set[str] = field(default_factory=set)
    keys: list[Any] = field(default_factory=list)
    # Hashable keys already in ``keys``: repeated notifies must not grow memory (SPEC §3 "bounded").
    seen_keys: set[Any] = field(default_factory=set)

    def merge(self, sessions: Iterable[str], groups: Iterable[str], keys: Iterable[Any]) -> None:
        """Add ids and keys, keeping each distinct id and hashable key once."""
        self.sessions.update(sessions)
        self.groups.update(groups)
        for key in keys:
            try:
                if key in self.seen_keys:
                    continue
                self.seen_keys.add(key)
            except TypeError:  # unhashable token: keep it, we cannot dedupe it
                pass
            self.keys.append(key)


def merge_into(pending: dict[str, Entry], more: dict[str, Entry]) -> None:
    """Merge what is left of ``more`` (not acknowledged) into ``pending``, reason by reason."""
    for reason, entry in more.items():
        if entry.sessions or entry.groups or entry.keys:
            pending.setdefault(reason, Entry()).merge(entry.sessions, entry.groups, entry.keys)


def sessions_per_reason(*maps: dict[str, Entry]) -> dict[str, int]:
    """How many distinct sessions wait per reason, across the maps (pending and in flight)."""
    sessions: dict[str, set[str]] = {}
    for entries in maps:
        for reason, entry in entries.items():
            sessions.setdefault(reason, set()).update(entry.sessions)
    return {reason: len(ids) for reason, ids in sessions.items()}
