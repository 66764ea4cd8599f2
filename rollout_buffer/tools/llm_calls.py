"""The simulated launcher's model calls, made as the real launcher makes them (SPEC §5), so that
the path under test (the pacing gate, a proxy) is the real one.

Each call of a session is ``POST <--llm-base-url>/<session_id>/chat/completions`` with an
OpenAI-shaped body. It is retried forever on 429, on any 5xx, on a refused connection and on a
timeout, with a backoff that starts at 2 s, doubles, is capped at 30 s and has up to 20% jitter;
any other 4xx fails the session for good. The answer's ``metadata.weight_version``, when there is
one, is the version the row records (the proxy stamps it).

Owns: one HTTP session per thread and the retry policy. It must not write rows.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import Any

import requests

BACKOFF_START_S = 2.0
BACKOFF_MAX_S = 30.0
JITTER = 0.2
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 900.0


class SessionFailed(Exception):
    """The model answered a 4xx other than 429: the session fails for good (as upstream)."""


class ModelCalls:
    """Model calls with the upstream client's retries; ``wait(seconds)`` sleeps between tries
    and raises to stop (a signal arrived)."""

    def __init__(self, base_url: str, model: str, wait: Callable[[float], None]) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.wait = wait
        self._local = threading.local()
        self.retries = 0

    def _http(self) -> requests.Session:
        http = getattr(self._local, "http", None)
        if http is None:
            http = self._local.http = requests.Session()
        return http

    def call(self, session_id: str, messages: list[dict[str, str]]) -> int | None:
        """One model call; the weight version the answer carries, or None."""
        url = f"{self.base_url}/{session_id}/chat/completions"
        body = {"model": self.model, "messages": messages[-2:]}
        delay = BACKOFF_START_S
        while True:
            try:
                answer = self._http().post(
                    url, json=body, timeout=(CONNECT_TIMEOUT_S, READ_TIMEOUT_S)
                )
            except requests.RequestException:
                answer = None  # refused, reset or timed out: retried, as upstream does
            if answer is not None and answer.status_code < 400:
                return _version(answer)
            if answer is not None and answer.status_code != 429 and answer.status_code < 500:
                raise SessionFailed(f"{url} answered {answer.status_code}")
            self.retries += 1
            self.wait(delay * (1 + random.uniform(0, JITTER)))
            delay = min(delay * 2, BACKOFF_MAX_S)


def _version(answer: requests.Response) -> int | None:
    try:
        doc: Any = answer.json()
    except ValueError:
        return None
    meta = doc.get("metadata") if isinstance(doc, dict) else None
    version = meta.get("weight_version") if isinstance(meta, dict) else None
    return version if isinstance(version, int) and not isinstance(version, bool) else None
