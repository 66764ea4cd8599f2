"""The status page: ``GET /`` (one static HTML file) and the document it shows, ``GET /status``.

Owns: the page's data, composed from what the service already reports (``/stats``, ``/health``)
plus the recent history (rates over 15 minutes, the last batches). The page itself holds no data
and needs no token, so it can ask for one; ``/status`` is behind the token like ``/stats``. The
HTML, its script and its charts are in ``static/status.html``: no framework, nothing loaded from
outside (it must work on an air-gapped cluster).

It must not compute figures of its own: everything it shows comes from the service's stats, health
and history.
"""

from __future__ import annotations

import functools
import time
from importlib import resources
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from rollout_buffer.service import Service
    from rollout_buffer.storage.store import LazyPair


@functools.lru_cache(maxsize=1)
def page_html() -> bytes:
    """The status page (package data ``rollout_buffer/static/status.html``)."""
    return (resources.files(__package__) / "static" / "status.html").read_bytes()


def status_document(service: Service, conns: LazyPair | None) -> dict[str, Any]:
    """Everything the status page shows, in one JSON object."""
    stats = service.stats(conns)
    health = service.health()
    return {
        "now": time.time(),
        "status": health["status"],
        "role": health["role"],  # owner, standby (the owner's URL is in /health), or starting
        "last_tick_age_s": health.get("last_tick_age_s"),
        "token_required": service.config.token is not None,
        "stats": stats,
        "history": service.history.snapshot(),
    }
