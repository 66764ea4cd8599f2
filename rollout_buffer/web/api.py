"""HTTP API (SPEC §4): routes, input validation and JSON responses.

Bodies are parsed as JSON whatever the Content-Type says (the original did), capped in size,
and validated strictly: a wrong type is a 400 whose message says what was expected. On a
standby, what needs the owner (polls, /start_rollout, /stop_rollout) is turned away after
authentication; /health, /stats, /status and /metrics answer locally with the role.

Owns: the routes, parsing and validating bodies, the token, the same-origin and Host checks, and
turning the service's answers into responses. It must not hold state or decide anything: every
action is a call to the service (the page and /metrics render what the service reports).
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

from rollout_buffer.core.config import Config
from rollout_buffer.core.errors import Invalid
from rollout_buffer.core.hosts import host_name, is_loopback
from rollout_buffer.core.items import iter_bytes
from rollout_buffer.core.model import PollRequest
from rollout_buffer.service import Service
from rollout_buffer.serving.redelivery import parse_skip
from rollout_buffer.storage.store import LazyPair
from rollout_buffer.web.errors import ApiError
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
    connections = g.pop("rb_conns", None)
    if connections is not None:
        connections.close()


# Methods that change nothing; a browser's request with any other method changes state, and so do
# the paths that act on the job whatever the method (a GET poll would take groups if it existed).
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
STATE_PATHS = ("/start_rollout", "/get_rollout_data", "/stop_rollout")


@bp.before_app_request
def _same_origin() -> None:
    """Refuse a browser's cross-site request: without a token, any page a user opens could POST
    text/plain to /start_rollout or take groups. Browsers say where a request comes from
    (Sec-Fetch-Site, Origin); trainers and curl send neither, and are never refused here. A
    browser's request that changes state must also come by a Host the service is reached by
    (:func:`_known_host`)."""
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
    if (origin is not None or site) and (
        request.method not in SAFE_METHODS or request.path in STATE_PATHS
    ):
        _known_host()


def _known_host() -> None:
    """A browser's state-changing request without a token: only by a name the service is really
    reached by. A page whose own name was rebound to this address (DNS rebinding) passes the
    same-origin check above, and only its Host gives it away."""
    config = service().config
    if config.token is not None:
        return  # the page cannot know the token: _auth refuses it
    header = request.headers.get("Host")
    name = host_name(header)
    if name is not None and (is_loopback(name) or name in service_hosts(config)):
        return
    shown = "no Host header" if header is None else f"Host {header[:100]!r}"
    raise ApiError(
        403,
        f"a browser request by {shown} is refused: without ROLLOUT_BUFFER_TOKEN, a browser page "
        "may start, poll or stop only by localhost, a loopback address, the host of "
        "ROLLOUT_BUFFER_ADVERTISE_URL or a name in ROLLOUT_BUFFER_ALLOWED_HOSTS (a page on "
        "another name may be a DNS rebinding attack); add the name to "
        "ROLLOUT_BUFFER_ALLOWED_HOSTS if the service is reached by it",
        host=header[:100] if header is not None else None,
    )


def service_hosts(config: Config) -> frozenset[str]:
    """The names besides loopback by which this service is reached: its advertise URL's host and
    ROLLOUT_BUFFER_ALLOWED_HOSTS, as :func:`host_name` reads them."""
    names = set(config.allowed_hosts)
    if config.advertise_url:
        advertised = host_name(urlsplit(config.advertise_url).netloc)
        if advertised is not None:
            names.add(advertised)
    return frozenset(names)


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
        raise Invalid(f"request body is not valid JSON ({exc}); expected a JSON object") from None
    except RecursionError:
        raise Invalid(
            "request body is nested too deeply; expected a small, flat JSON object"
        ) from None
    if not isinstance(body, dict):
        raise Invalid(f"request body is a JSON {type(body).__name__}; expected a JSON object")
    return body


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_k(value: Any) -> int:
    """num_repeat_per_sample: int 1-4096 or a string of one; default 16."""
    if value is None:
        return 16
    if (isinstance(value, str) and re.fullmatch(r"\s*[+]?\d+\s*", value)) or (
        isinstance(value, float) and math.isfinite(value) and value.is_integer()
    ):
        value = int(value)
    if not _is_int(value) or not 1 <= value <= MAX_K:
        raise Invalid(
            f"num_repeat_per_sample={value!r} is invalid: expected an integer from 1 to {MAX_K} "
            "(or a string of one)",
            field="num_repeat_per_sample",
        )
    return value


def parse_bool(name: str, value: Any, default: bool = False) -> bool:
    """A boolean field that also takes 0/1."""
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    if _is_int(value) and value in (0, 1):
        return bool(value)
    raise Invalid(f"{name}={value!r} is invalid: expected true/false (or 0/1)", field=name)


def parse_job_session(value: Any) -> str | None:
    """job_session: 1-64 chars of [A-Za-z0-9._-]; absent/null = a new one."""
    if value is None:
        return None
    if not isinstance(value, str) or not JOB_SESSION_RE.fullmatch(value):
        raise Invalid(
            f"job_session={value!r} is invalid: expected 1-64 characters of A-Z a-z 0-9 . _ -",
            field="job_session",
        )
    if value.startswith("-"):  # the launcher's argparse would read it as an option: --job-id -rf
        raise Invalid(
            f"job_session={value!r} is invalid: it must not start with '-'", field="job_session"
        )
    return value


def parse_max_groups(value: Any) -> int | None:
    """max_groups: a positive int caps; absent, null, 0 or negative = no cap."""
    if value is None:
        return None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if not _is_int(value):
        raise Invalid(
            f"max_groups={value!r} is invalid: expected an integer (<= 0 or null for no cap)",
            field="max_groups",
        )
    return value if value > 0 else None


def parse_request_id(value: Any) -> str | None:
    """request_id: an optional string of 1-128 printable characters."""
    if value is None:
        return None
    if not isinstance(value, str) or not 1 <= len(value) <= 128 or not value.isprintable():
        raise Invalid(
            f"request_id={value!r} is invalid: expected a string of 1-128 printable characters "
            "(one fresh uuid4 per logical poll)",
            field="request_id",
        )
    return value


MAX_WAIT_S = 60.0


def parse_wait_s(value: Any) -> float:
    """wait_s: seconds to long-poll, a number from 0 to 60; default 0 (answer at once)."""
    if value is None:
        return 0.0
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not 0 <= value <= MAX_WAIT_S
    ):
        raise Invalid(
            f"wait_s={value!r} is invalid: expected a number of seconds from 0 to {MAX_WAIT_S:g}",
            field="wait_s",
        )
    return float(value)


def parse_version(name: str, value: Any) -> int | None:
    """max_off_policy / current_weight_version: an optional int >= 0."""
    if value is None:
        return None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if not _is_int(value) or value < 0 or value > 2**53:
        raise Invalid(f"{name}={value!r} is invalid: expected an integer >= 0", field=name)
    return value


def parse_min_groups(value: Any) -> int | None:
    """min_groups: with wait_s, answer once this many groups are ready; an int >= 1 (None: not
    stated, which waits for 1)."""
    if value is None:
        return None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if not _is_int(value) or value < 1:
        raise Invalid(
            f"min_groups={value!r} is invalid: expected an integer >= 1", field="min_groups"
        )
    return value


@bp.post("/start_rollout")
def start_rollout() -> tuple[dict[str, Any], int]:
    body = json_body()
    k = parse_k(body.get("num_repeat_per_sample"))
    restart = parse_bool("restart_training", body.get("restart_training"))
    job = parse_job_session(body.get("job_session"))
    skip = parse_skip(
        body.get("skip_instance_ids")
    )  # a checkpoint's groups: the others are delivered again
    return service().start_rollout(
        conns(), k=k, restart_training=restart, job_session=job, skip=skip
    ), 200


@bp.post("/get_rollout_data")
def get_rollout_data() -> Response:
    fields = json_body()
    poll = PollRequest(
        parse_max_groups(fields.get("max_groups")),
        parse_request_id(fields.get("request_id")),
        parse_wait_s(fields.get("wait_s")),
        parse_min_groups(fields.get("min_groups")),
        parse_version("max_off_policy", fields.get("max_off_policy")),
        parse_version("current_weight_version", fields.get("current_weight_version")),
    )
    body = service().get_rollout_data(conns(), poll)
    resp = Response(iter_bytes(body), status=200, mimetype="application/json")
    resp.headers["Content-Length"] = str(sum(len(chunk) for chunk in body))
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


@bp.get("/admission")
def admission() -> dict[str, Any]:
    """How many more groups may start now without producing more than the trainer will take
    within the staleness bound (issue 23)."""
    return service().admission()


@bp.get("/metrics")
def metrics() -> Response:
    # content_type is sent as given; a mimetype would get a second charset appended
    return Response(
        render_metrics(service()), content_type="text/plain; version=0.0.4; charset=utf-8"
    )


@bp.get("/")
def status_page() -> Response:
    resp = Response(page_html(), mimetype="text/html")  # Flask adds "; charset=utf-8"
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
