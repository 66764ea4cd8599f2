"""GET /metrics is valid Prometheus text; bearer-token auth on every endpoint but /health."""

from __future__ import annotations

import math
import re

import pytest

SAMPLE = re.compile(
    r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*",?)*\})? '
    r"(-?[0-9.eE+-]+|\+Inf|-Inf|NaN)$"
)


def parse_prometheus(text: str) -> dict[str, dict]:
    """A strict reader of the text exposition format 0.0.4 (what we emit): families, types,
    samples."""
    assert text.endswith("\n")
    families: dict[str, dict] = {}
    current = None
    for line in text.splitlines():
        assert line == line.strip() and line, f"blank or padded line: {line!r}"
        if line.startswith("# HELP "):
            name, _, help_ = line[7:].partition(" ")
            assert name not in families, f"family {name} declared twice"
            families[name] = {"help": help_, "type": None, "samples": []}
            current = name
        elif line.startswith("# TYPE "):
            name, _, kind = line[7:].partition(" ")
            assert name == current and kind in (
                "counter",
                "gauge",
                "histogram",
                "summary",
                "untyped",
            )
            families[name]["type"] = kind
        else:
            m = SAMPLE.match(line)
            assert m, f"not a sample line: {line!r}"
            name = m.group(1)
            base = (
                re.sub(r"_(bucket|sum|count)$", "", name)
                if families.get(current, {}).get("type") == "histogram"
                else name
            )
            assert base == current, f"sample {name} outside its family {current}"
            labels = dict(
                re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(2) or "")
            )
            value = float(m.group(3).replace("+Inf", "inf").replace("-Inf", "-inf"))
            families[current]["samples"].append((name, labels, value))
    for name, fam in families.items():
        assert fam["type"], f"{name} has no TYPE"
        if fam["type"] == "counter":
            assert all(v >= 0 for _, _, v in fam["samples"]), name
        if fam["type"] == "histogram":
            buckets = [(lab["le"], v) for n, lab, v in fam["samples"] if n.endswith("_bucket")]
            values = [v for _, v in buckets]
            assert values == sorted(values) and buckets[-1][0] == "+Inf"
            count = next(v for n, _, v in fam["samples"] if n.endswith("_count"))
            assert buckets[-1][1] == count
    return families


def test_metrics_parse_and_agree_with_stats(harness, writer):
    harness.start(k=2)
    writer.group("a", 2, steps=2)
    writer.group("b", 2, steps=1, complete=1)
    harness.poll()
    harness.poll()
    r = harness.client.get("/metrics")
    assert r.status_code == 200 and r.mimetype == "text/plain"
    fams = parse_prometheus(r.get_data(as_text=True))
    stats = harness.stats()

    def value(name, **labels):
        full = "rollout_buffer_" + name
        family = fams.get(full) or fams[re.sub(r"_(sum|count|bucket)$", "", full)]
        for n, sample_labels, v in family["samples"]:
            if n == full and all(sample_labels.get(k) == str(x) for k, x in labels.items()):
                return v
        raise KeyError(name)

    assert value("rows_read_total", job_session="job1") == stats["rows"]["read"] == 6
    # Prometheus owns the job and instance labels (a scraped one is renamed exported_job)
    assert not [
        (n, lab)
        for f in fams.values()
        for n, lab, _ in f["samples"]
        if {"job", "instance"} & set(lab)
    ]
    assert value("rows_served_total") == 4 and value("rows_pending") == 2
    assert value("groups", state="pending") == 1
    assert value("polls_total") >= 2 and math.isfinite(value("poll_duration_seconds_sum"))
    assert value("launcher_running") == 0 and value("database_up") == 1


def test_metrics_before_any_job(harness):
    fams = parse_prometheus(harness.client.get("/metrics").get_data(as_text=True))
    assert "rollout_buffer_polls_total" in fams and "rollout_buffer_rows_read_total" not in fams


@pytest.fixture
def authed(lite_url, harness_factory):
    return harness_factory(lite_url, token="s3cret-token")


@pytest.mark.parametrize(
    "method,path",
    [
        ("post", "/start_rollout"),
        ("post", "/get_rollout_data"),
        ("post", "/stop_rollout"),
        ("get", "/stats"),
        ("get", "/metrics"),
        ("get", "/admission"),
    ],
)
def test_auth_required_everywhere_but_health(authed, method, path):
    c = authed.client
    call = getattr(c, method)
    r = call(path, json={}) if method == "post" else call(path)
    assert r.status_code == 401 and r.get_json()["error"].startswith("missing bearer token")
    r = call(
        path,
        headers={"Authorization": "Bearer wrong"},
        **({"json": {}} if method == "post" else {}),
    )
    assert r.status_code == 401 and r.get_json() == {
        "ok": False,
        "error": "wrong bearer token",
        "status": 401,
        **(
            {"success": False, "message": "wrong bearer token"}
            if path == "/get_rollout_data"
            else {}
        ),
    }
    r = call(
        path,
        headers={"Authorization": "Basic s3cret-token"},
        **({"json": {}} if method == "post" else {}),
    )
    assert r.status_code == 401
    r = call(
        path,
        headers={"Authorization": "Bearer s3cret-token"},
        **({"json": {}} if method == "post" else {}),
    )
    assert r.status_code == 200
    assert c.get("/health").status_code == 200


def test_no_token_means_open(harness):
    assert harness.client.get("/stats").status_code == 200


def test_the_status_page_loads_without_the_token_and_holds_no_data_and_no_markup_from_data(authed):
    """GET / is the page's static HTML (it asks for the token); its data is /status, behind the
    token. The page builds everything it shows with textContent and DOM nodes, so a job id, a reason
    or an error text can never become markup, and it names no address but its own."""
    r = authed.client.get("/")
    assert r.status_code == 200 and r.mimetype == "text/html"
    assert "default-src 'none'" in r.headers["Content-Security-Policy"]
    html = r.get_data(as_text=True)
    for sink in (
        "innerHTML",
        "outerHTML",
        "insertAdjacentHTML",
        "document.write",
        "eval(",
        "new Function",
    ):
        assert sink not in html, sink
    assert re.findall(r"https?://[^\s\"')]+", html) == [
        "http://www.w3.org/2000/svg"
    ]  # a namespace, never fetched
    assert authed.client.get("/status").status_code == 401
