"""HTTP API (SPEC §4): routes, input validation and JSON responses.

Bodies are parsed as JSON whatever the Content-Type says (the original did), capped in size,
and validated strictly: a wrong type is a 400 whose message says what was expected. On a
standby, what needs the owner (polls, /start_rollout, /stop_rollout) is turned away after
authentication; /health, /stats, /status and /metrics answer locally with the role.

Owns: the routes, parsing and validating bodies, the token and the same-origin check, and turning
the service's answers into responses. It must not hold state or decide anything: every action is a
call to the service (the page and /metrics render what the service reports).
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import re
from typing import Any
from urllib.parse import urlsplit

from flask import Blueprint, Response, current_app, g, request

from rollout_buffer.core.errors import ApiError
from rollout_buffer.core.model import PollRequest
from rollout_buffer.core.response import iter_bytes
from rollout_buffer.service import Service
from rollout_buffer.serving.redelivery import parse_skip
from rollout_buffer.storage.connections import LazyPair
from rollout_buffer.web.metrics import render_metrics
from rollout_buffer.web.page import page_html, status_document

logger = logging.getLogger(__name__)

bp = Blueprint("rollout_buffer", __name__)

JOB_SESSION_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")
MAX_K = 4096


def service() -> Service:
    """The Service of the current app."""
    return current_app.extensions["rollout_buffer"]


def conns() -> LazyPair:
    """This request's database connections, opened on first use."""
    if "rb_conns" not in g:
        g.rb_conns = service().connection()
    return g.rb_conns


@bp.teardown_app_request
def _close_conns(exc: BaseException | None) -> None:
    c = g.pop("rb_conns", None)
    if c is not None:
        c.close()


@bp.before_app_request
def _same_origin() -> None:
    """Refuse a browser's cross-site request: without a token, any page a user opens could POST
    text/plain to /start_rollout or take groups. Browsers say where a request comes from
    (Sec-Fetch-Site, Origin); trainers and curl send neither, and are never refused here."""
    site = request.headers.get("Sec-Fetch-Site", "")
    origin = request.headers.get("Origin")
    if site == "cross-site" or (
        origin and origin != "null" and urlsplit(origin).netloc != request.host
    ):
        raise ApiError(
            403,
            "cross-site browser requests are refused; call the API from the trainer or from "
            "this service's own page",
        )
    if origin == "null" and request.method != "GET":
        raise ApiError(403, "requests from an opaque origin are refused")


@bp.before_app_request
def _auth() -> None:
    token = service().config.token
    # the status page's HTML holds no data: it must load without the token, to ask for it
    if token is None or request.path in ("/health", "/"):
        return
    header = request.headers.get("Authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not given:
        raise ApiError(401, "missing bearer token: send 'Authorization: Bearer <token>'")
    if not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise ApiError(401, "wrong bearer token")


# What needs the owner of the job: a standby answers 307 to it (method and body kept), or 503.
OWNER_PATHS = {"/get_rollout_data": 2.0, "/start_rollout": 10.0, "/stop_rollout": 2.0}


@bp.before_app_request
def _owner_only() -> None:
    """After authentication: LeaseLost on a standby (answered by the app with 307 or 503)."""
    wait_s = OWNER_PATHS.get(request.path)
    if wait_s is not None and request.method == "POST":
        service().lease.check(wait_s, sure=request.path != "/stop_rollout")


def json_body() -> dict[str, Any]:
    """The request body as a JSON object ({} when empty), whatever the Content-Type."""
    raw = request.get_data(cache=False)
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(
            400, f"request body is not valid JSON ({exc}); expected a JSON object"
        ) from None
    except RecursionError:
        raise ApiError(
            400, "request body is nested too deeply; expected a small, flat JSON object"
        ) from None
    if not isinstance(body, dict):
        raise ApiError(400, f"request body is a JSON {type(body).__name__}; expected a JSON object")
    return body


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_k(v: Any) -> int:
    """num_repeat_per_sample: int 1-4096 or a string of one; default 16."""
    if v is None:
        return 16
    if (isinstance(v, str) and re.fullmatch(r"\s*[+]?\d+\s*", v)) or (
        isinstance(v, float) and math.isfinite(v) and v.is_integer()
    ):
        v = int(v)
    if not _is_int(v) or not 1 <= v <= MAX_K:
        raise ApiError(
            400,
            f"num_repeat_per_sample={v!r} is invalid: expected an integer from 1 to {MAX_K} "
            "(or a string of one)",
            field="num_repeat_per_sample",
        )
    return v


def parse_bool(name: str, v: Any, default: bool = False) -> bool:
    """A boolean field that also takes 0/1."""
    if v is None:
        return default
    if isinstance(v, bool):
        return v
    if _is_int(v) and v in (0, 1):
        return bool(v)
    raise ApiError(400, f"{name}={v!r} is invalid: expected true/false (or 0/1)", field=name)


def parse_job_session(v: Any) -> str | None:
    """job_session: 1-64 chars of [A-Za-z0-9._-]; absent/null = a new one."""
    if v is None:
        return None
    if not isinstance(v, str) or not JOB_SESSION_RE.fullmatch(v):
        raise ApiError(
            400,
            f"job_session={v!r} is invalid: expected 1-64 characters of A-Z a-z 0-9 . _ -",
            field="job_session",
        )
    if v.startswith("-"):  # the launcher's argparse would read it as an option: --job-id -rf
        raise ApiError(
            400, f"job_session={v!r} is invalid: it must not start with '-'", field="job_session"
        )
    return v


def parse_max_groups(v: Any) -> int | None:
    """max_groups: a positive int caps; absent, null, 0 or negative = no cap."""
    if v is None:
        return None
    if isinstance(v, float) and math.isfinite(v) and v.is_integer():
        v = int(v)
    if not _is_int(v):
        raise ApiError(
            400,
            f"max_groups={v!r} is invalid: expected an integer (<= 0 or null for no cap)",
            field="max_groups",
        )
    return v if v > 0 else None


def parse_request_id(v: Any) -> str | None:
    """request_id: an optional string of 1-128 printable characters."""
    if v is None:
        return None
    if not isinstance(v, str) or not 1 <= len(v) <= 128 or not v.isprintable():
        raise ApiError(
            400,
            f"request_id={v!r} is invalid: expected a string of 1-128 printable characters "
            "(one fresh uuid4 per logical poll)",
            field="request_id",
        )
    return v


MAX_WAIT_S = 60.0


def parse_wait_s(v: Any) -> float:
    """wait_s: seconds to long-poll, a number from 0 to 60; default 0 (answer at once)."""
    if v is None:
        return 0.0
    if (
        isinstance(v, bool)
        or not isinstance(v, (int, float))
        or not math.isfinite(v)
        or not 0 <= v <= MAX_WAIT_S
    ):
        raise ApiError(
            400,
            f"wait_s={v!r} is invalid: expected a number of seconds from 0 to {MAX_WAIT_S:g}",
            field="wait_s",
        )
    return float(v)


def parse_version(name: str, v: Any) -> int | None:
    """max_off_policy / current_weight_version: an optional int >= 0."""
    if v is None:
        return None
    if isinstance(v, float) and math.isfinite(v) and v.is_integer():
        v = int(v)
    if not _is_int(v) or v < 0 or v > 2**53:
        raise ApiError(400, f"{name}={v!r} is invalid: expected an integer >= 0", field=name)
    return v


def parse_min_groups(v: Any) -> int:
    """min_groups: with wait_s, answer once this many groups are ready; an int >= 1, default 1."""
    if v is None:
        return 1
    if isinstance(v, float) and math.isfinite(v) and v.is_integer():
        v = int(v)
    if not _is_int(v) or v < 1:
        raise ApiError(
            400, f"min_groups={v!r} is invalid: expected an integer >= 1", field="min_groups"
        )
    return v


@bp.post("/start_rollout")
def start_rollout() -> tuple[dict[str, Any], int]:
    body = json_body()
    k = parse_k(body.get("num_repeat_per_sample"))
    restart = parse_bool("restart_training", body.get("restart_training"))
    job = parse_job_session(body.get("job_session"))
    skip = parse_skip(
        body.get("skip_instance_ids")
    )  # a checkpoint's groups: the others are delivered again
    status, out = service().start_rollout(
        conns(), k=k, restart_training=restart, job_session=job, skip=skip
    )
    return out, status


@bp.post("/get_rollout_data")
def get_rollout_data() -> Response:
    b = json_body()
    poll = PollRequest(
        parse_max_groups(b.get("max_groups")),
        parse_request_id(b.get("request_id")),
        parse_wait_s(b.get("wait_s")),
        parse_min_groups(b.get("min_groups")),
        parse_version("max_off_policy", b.get("max_off_policy")),
        parse_version("current_weight_version", b.get("current_weight_version")),
    )
    body = service().get_rollout_data(conns(), poll)
    resp = Response(iter_bytes(body), status=200, mimetype="application/json")
    resp.headers["Content-Length"] = str(sum(len(c) for c in body))
    resp.call_on_close(body.close)  # a replay's rebuilt copy counts against the bound until sent
    return resp


@bp.post("/stop_rollout")
def stop_rollout() -> dict[str, Any]:
    json_body()
    return service().stop_rollout()


@bp.get("/health")
def health() -> dict[str, Any]:
    return service().health()


@bp.get("/stats")
def stats() -> dict[str, Any]:
    return service().stats(conns())


@bp.get("/metrics")
def metrics() -> Response:
    return Response(render_metrics(service()), mimetype="text/plain; version=0.0.4; charset=utf-8")


@bp.get("/")
def status_page() -> Response:
    resp = Response(page_html(), mimetype="text/html; charset=utf-8")
    # nothing external, ever: the page only talks to this service
    resp.headers["Content-Security-Policy"] = (
        "default-src 'none'; script-src 'unsafe-inline'; "
        "style-src 'unsafe-inline'; connect-src 'self'; img-src 'self' data:"
    )
    resp.headers["Cache-Control"] = "no-store"
    return resp


@bp.get("/status")
def status() -> dict[str, Any]:
    return status_document(service(), conns())
