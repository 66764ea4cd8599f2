"""The one place where errors become HTTP statuses, and the one JSON error shape.

Owns: the status of each kind of refused request (core.errors.RequestError: the service says what
went wrong, never which status), :class:`ApiError` for the answers only the web layer decides (the
token, a browser's origin and host, a standby's redirect), and :func:`error_response`.
"""

from __future__ import annotations

from typing import Any

from flask import Response, jsonify, request

from rollout_buffer.core.errors import (
    Conflict,
    Expired,
    Invalid,
    OperationFailed,
    Overloaded,
    RequestError,
    RolloutBufferError,
    Unavailable,
)

ROLLOUT_PATHS = ("/get_rollout_data",)

STATUS: dict[type[RequestError], int] = {
    Invalid: 400,
    Conflict: 409,
    Expired: 410,
    Overloaded: 429,
    OperationFailed: 500,
    Unavailable: 503,
}


def status_of(exc: RequestError) -> int:
    """The HTTP status of a refused request, by its kind (500 for a kind not listed)."""
    for kind in type(exc).__mro__:
        if kind in STATUS:
            return STATUS[kind]
    return 500


class ApiError(RolloutBufferError):
    """An answer the web layer decides itself, with its status: 401 (the token), 403 (a browser's
    origin or host), a standby's 307 to the owner or its 503."""

    def __init__(self, status: int, message: str, **context: Any) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.context = context


def error_response(status: int, message: str, **context: Any) -> Response:
    """The one JSON error shape: {"ok": false, "error": ..., "status": N, ...context}.

    On /get_rollout_data it also carries "success": false and "message", which the original's
    clients read.
    """
    body: dict[str, Any] = {"ok": False, "error": message, "status": status}
    body.update({k: v for k, v in context.items() if k not in body})
    if request and request.path in ROLLOUT_PATHS:
        body["success"] = False
        body["message"] = message
    resp = jsonify(body)
    resp.status_code = status
    if "retry_after" in context:
        resp.headers["Retry-After"] = str(context["retry_after"])
    if "location" in context:  # a standby's 307 to the owner
        resp.headers["Location"] = context["location"]
    return resp
