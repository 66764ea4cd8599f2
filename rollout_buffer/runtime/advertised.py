"""Whether ``ROLLOUT_BUFFER_ADVERTISE_URL`` reaches this instance.

Owns: the one check, at the first look at the lease, that the advertised URL answers GET /health as
this instance (standbys redirect clients to it), and what it says when it does not. It must not
change a role: the lease decides what a wrong URL means (a correctly configured standby takes an
ended lease first).
"""

from __future__ import annotations

import logging

import requests

logger = logging.getLogger(__name__)

OK, UNVERIFIED, WRONG = "ok", "unverified", "wrong"


def check_advertised(url: str, instance_id: str) -> tuple[str, str | None]:
    """(OK, UNVERIFIED or WRONG, the problem to report when WRONG)."""
    try:
        r = requests.get(url + "/health", timeout=(1.0, 2.0))
        seen = r.json().get("instance") if r.status_code == 200 else f"HTTP {r.status_code}"
    except (requests.RequestException, ValueError, AttributeError) as exc:
        logger.warning(
            "could not check ROLLOUT_BUFFER_ADVERTISE_URL=%s from here (%s); standbys redirect "
            "clients to it",
            url,
            type(exc).__name__,
        )
        return UNVERIFIED, None
    if seen == instance_id:
        return OK, None
    problem = (
        f"ROLLOUT_BUFFER_ADVERTISE_URL={url} answers as another instance ({seen!r}), not as this "
        "one: while this instance owns the job, standbys redirect clients there; set it to this "
        "instance's own URL"
    )
    logger.error("%s", problem)
    return WRONG, problem
