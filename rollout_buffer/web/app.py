"""The Flask application factory: builds and wires objects, starts nothing.

Owns: building the Service and the Flask app around it, routing every error to the one JSON error
shape (web.errors), and what an instance that does not own the job answers a request that needs the
owner (307 to it, or 503).
It must not start threads or touch a database (gunicorn's hooks start the service).
"""

from __future__ import annotations

import logging
import math

from flask import Flask, current_app, request
from werkzeug.exceptions import HTTPException

from rollout_buffer.core.config import Config
from rollout_buffer.core.errors import LeaseLost, RequestError
from rollout_buffer.runtime.lease import OWNER, STANDBY, STARTING, Lease
from rollout_buffer.service import Service
from rollout_buffer.web.api import bp
from rollout_buffer.web.errors import ApiError, error_response, status_of

logger = logging.getLogger(__name__)


def standby_answer(lease: Lease, path: str) -> ApiError:
    """What a request that needs the owner gets from an instance that is not (yet) it: 307 to the
    owner's advertised URL, or 503 with Retry-After and the reason while that would not help."""
    now = lease.clock()
    holder = lease.holder
    if lease.role == OWNER:  # the loop is still loading the job (or has just lost it)
        return ApiError(
            503, "this instance owns the job and is loading its state; retry", retry_after=1
        )
    if lease.role == STARTING or holder is None:
        return ApiError(
            503,
            "this instance has not read who owns the job yet"
            + (f": {lease.problem}" if lease.problem else ""),
            retry_after=1,
            role=lease.role,
        )
    owner = holder.shown(now)
    left = holder.left(now)
    if left <= 0 or holder.released:
        return ApiError(
            503,
            "no instance owns the job at the moment (the last owner's lease has ended); a standby "
            "takes it over within a second",
            retry_after=1,
            role=STANDBY,
            owner=owner,
        )
    if not holder.url:
        return ApiError(
            503,
            f"this instance is a standby, and the owner (instance {holder.instance} on host "
            f"{holder.host}) has no ROLLOUT_BUFFER_ADVERTISE_URL to redirect to: set it on every "
            "instance, or call the owner directly",
            retry_after=5,
            role=STANDBY,
            owner=owner,
        )
    # (a URL that reaches another instance is no loop)
    if holder.url == lease.url and lease.advertised != "wrong":
        return ApiError(
            503,
            f"the owner advertises {holder.url}, which is this standby's own "
            "ROLLOUT_BUFFER_ADVERTISE_URL: one of the two is misconfigured",
            retry_after=5,
            role=STANDBY,
            owner=owner,
        )
    # it missed two renewals: probably gone, and a redirect there would fail
    if left < holder.length / 3:
        return ApiError(
            503,
            f"this instance is a standby; the owner at {holder.url} has not renewed its lease "
            f"for {holder.length - left:.0f} s: if it is gone, this instance takes over in "
            f"{left:.0f} s",
            retry_after=math.ceil(left) + 1,
            role=STANDBY,
            owner=owner,
        )
    return ApiError(
        307,
        f"this instance is a standby; the owner is {holder.url}",
        location=holder.url + path,
        role=STANDBY,
        owner=owner,
    )


def endpoints() -> list[str]:
    """Every endpoint as "METHOD /path", read from the routing table that routes the requests."""
    return [
        f"{method} {rule.rule}"
        for rule in current_app.url_map.iter_rules()
        for method in sorted((rule.methods or set()) - {"HEAD", "OPTIONS"})
    ]


def create_app(config: Config | None = None, *, service: Service | None = None) -> Flask:
    """Build the app around a Service; ``config`` defaults to ``Config.from_env()``.

    No thread or process is started here: the caller (gunicorn's post_worker_init hook, the CLI
    or a test fixture) calls ``app.extensions["rollout_buffer"].start()``.
    """
    if service is None:
        service = Service(config or Config.from_env())
    app = Flask(__name__, static_folder=None)  # the page is served at /, with all it needs
    app.config["MAX_CONTENT_LENGTH"] = service.config.max_request_bytes
    app.json.sort_keys = False  # type: ignore[attr-defined]
    app.extensions["rollout_buffer"] = service

    app.register_blueprint(bp)

    @app.errorhandler(ApiError)
    def _api_error(exc: ApiError):
        return error_response(exc.status, exc.message, **exc.context)

    @app.errorhandler(RequestError)
    def _refused(exc: RequestError):
        return error_response(status_of(exc), exc.message, **exc.context)

    @app.errorhandler(LeaseLost)
    def _not_owner(exc: LeaseLost):
        path = request.path + (
            f"?{request.query_string.decode('latin-1')}" if request.query_string else ""
        )
        answer = standby_answer(service.lease, path)
        return error_response(answer.status, answer.message, **answer.context)

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException):
        message = exc.description or exc.name
        if exc.code == 413:
            message = (
                f"request body is larger than {service.config.max_request_bytes} bytes; "
                "expected a small JSON object"
            )
        elif exc.code == 405:
            message = f"method {request.method} is not allowed on {request.path}"
        elif exc.code == 404:
            known = endpoints()
            message = f"no such endpoint: {request.path}; endpoints are {', '.join(known)}"
            return error_response(404, message, endpoints=known)
        return error_response(exc.code or 500, message)

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception):
        logger.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(500, "internal error; see the service log")

    return app
