"""The Flask application factory: builds and wires objects, starts nothing.

Owns: building the Service and the Flask app around it, and the one JSON error shape. It must not
start threads or touch a database (gunicorn's hooks start the service).
"""
from __future__ import annotations

import logging
from typing import Any

from flask import Flask, jsonify, request
from werkzeug.exceptions import HTTPException

from .api import bp
from .config import Config
from .errors import ApiError
from .service import Service

logger = logging.getLogger(__name__)

ROLLOUT_PATHS = ("/get_rollout_data",)


def error_response(status: int, message: str, **context: Any):
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
    return resp


def create_app(config: Config | None = None, *, service: Service | None = None) -> Flask:
    """Build the app around a Service; ``config`` defaults to ``Config.from_env()``.

    No thread or process is started here: the caller (gunicorn's post_worker_init hook, the CLI
    or a test fixture) calls ``app.extensions["rollout_buffer"].start()``.
    """
    if service is None:
        service = Service(config or Config.from_env())
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = service.config.max_request_bytes
    app.json.sort_keys = False  # type: ignore[attr-defined]
    app.extensions["rollout_buffer"] = service

    app.register_blueprint(bp)

    @app.errorhandler(ApiError)
    def _api_error(exc: ApiError):
        return error_response(exc.status, exc.message, **exc.context)

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException):
        message = exc.description or exc.name
        if exc.code == 413:
            message = (f"request body is larger than {service.config.max_request_bytes} bytes; "
                       "expected a small JSON object")
        elif exc.code == 405:
            message = f"method {request.method} is not allowed on {request.path}"
        elif exc.code == 404:
            message = (f"no such endpoint: {request.path}; endpoints are POST /start_rollout, "
                       "POST /get_rollout_data, POST /stop_rollout, GET /health, GET /stats, GET /metrics, "
                       "GET / (the status page), GET /status")
        return error_response(exc.code or 500, message)

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception):
        logger.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(500, "internal error; see the service log")

    return app
