"""Operators' tools against a real server (gunicorn): the shipped Grafana dashboard queries only
metrics that a running service's /metrics has, and ``rollout-buffer stats --watch`` refreshes
(in place on a terminal, one block per refresh otherwise)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid
from importlib import resources
from pathlib import Path

import pytest
import requests
from fakes.fake_proxy import closed_port
from servers import serve
from support import Writer, run_on_a_terminal

ROOT = Path(__file__).resolve().parent.parent.parent
pytestmark = pytest.mark.slow


def _running_job(srv_url: str, db_url: str) -> None:
    """A job with a served group, a pending one and a malformed one (a rejected row, a drop)."""
    # The rows are written before the job starts, so its first read sees g2's malformed row with
    # the rest of g2: written after the start, g2 could be read complete and served before it.
    w = Writer(db_url, job="ops")
    try:
        w.group("g1", 2)
        bad = w.group("g2", 2)
        w.step("g2", bad[0], 3, messages="[broken", completed=False)
        w.group("g3", 2, complete=1)
    finally:
        w.close()
    r = requests.post(
        srv_url + "/start_rollout",
        json={"num_repeat_per_sample": 2, "job_session": "ops"},
        timeout=10,
    )
    assert r.status_code == 200, r.text
    for _ in range(100):
        doc = requests.post(
            srv_url + "/get_rollout_data", json={"request_id": uuid.uuid4().hex}, timeout=10
        ).json()
        stats = requests.get(srv_url + "/stats", timeout=10).json()
        if stats["groups"]["served"] == 1 and stats["groups"]["dropped_total"] == 1:
            return
        assert doc is not None
    pytest.fail(f"the job did not settle: {stats}")


def _dashboard() -> dict:
    # read as package data: it ships with the package, where the README tells operators to find it
    return json.loads((resources.files("rollout_buffer.web") / "dashboard.json").read_text())


def _queries(dash: dict) -> list[str]:
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [
        v["definition"] for v in dash.get("templating", {}).get("list", []) if v.get("definition")
    ]
    return exprs


def test_every_metric_of_the_dashboard_is_in_metrics(lite_url, tmp_path):
    dash = _dashboard()
    exprs = _queries(dash)
    assert len(dash["panels"]) >= 10 and len(exprs) >= 15
    used = {name for e in exprs for name in re.findall(r"\brollout_buffer_[a-z_]+", e)}
    assert len(used) >= 15
    # a label Prometheus attaches itself (job, instance) is never the one the dashboard selects on:
    # a scraped job label is renamed exported_job, so it would select the scrape job instead
    assert not [
        e
        for e in exprs
        if re.search(r"\b(job|instance)\s*(=~|=|!=)|\b(by|on) \((job|instance)\)|, job\)", e)
    ]
    with serve(lite_url, tmp_path / "srv") as srv:
        _running_job(srv.url, lite_url)
        text = requests.get(srv.url + "/metrics", timeout=10).text
    samples: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            m = re.match(r"([a-z_]+)(\{[^}]*\})?\s", line)
            assert m, line
            samples.setdefault(m.group(1), []).append(m.group(2) or "")
    missing = sorted(used - set(samples))
    assert not missing, f"the dashboard queries metrics that /metrics does not have: {missing}"
    # the labels the dashboard selects or groups by are on those metrics
    for e in exprs:
        for name in re.findall(r"\brollout_buffer_[a-z_]+", e):
            for label in (
                re.findall(r"\bby \(([a-z_]+)\)", e)
                + re.findall(r"\b([a-z_]+)=~", e)
                + re.findall(r"label_values\([a-z_]+, ([a-z_]+)\)", e)
            ):
                if label == "le" and not name.endswith("_bucket"):
                    continue
                assert all(f'{label}="' in s for s in samples[name]), (
                    e,
                    name,
                    label,
                    samples[name],
                )


def _watch(url: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "rollout_buffer",
            "stats",
            url,
            "--watch",
            "--interval",
            "0.2",
            "--count",
            "3",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        **kw,
    )


def test_stats_watch_refreshes(lite_url, tmp_path):
    with serve(lite_url, tmp_path / "srv") as srv:
        _running_job(srv.url, lite_url)
        r = _watch(srv.url)
        assert r.returncode == 0, r.stderr
        # not a terminal: one block per refresh, each a whole table, no escape codes
        assert r.stdout.count(f"rollout-buffer {srv.url}") == 3
        assert r.stdout.count("  job ") == 3 and "\x1b" not in r.stdout
        assert "malformed_row: 1" in r.stdout
        # on a terminal: the table is redrawn in place (cursor home, clear) at each refresh
        code, text, _ = run_on_a_terminal(
            [
                sys.executable,
                "-m",
                "rollout_buffer",
                "stats",
                srv.url,
                "--watch",
                "--interval",
                "0.2",
                "--count",
                "3",
            ],
            cwd=ROOT,
        )
        assert code == 0
        assert text.count("\x1b[H\x1b[2J") == 3 and text.count("  job ") == 3
        assert "ops" in text


def test_stats_against_a_service_that_is_down_says_so_without_retrying_or_a_traceback():
    url = f"http://127.0.0.1:{closed_port()}"
    # the watch is the retry loop: one attempt per refresh, no retry warnings over the table
    r = _watch(url)
    assert r.returncode == 0 and r.stdout.count(f"cannot read {url}/stats") == 3, r.stdout
    assert "after 1 attempt(s)" in r.stdout and r.stderr == "", r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "rollout_buffer", "stats", url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1 and f"rollout-buffer stats: cannot read {url}/stats" in r.stderr
    assert "Traceback" not in r.stderr
    for bad in (["--interval", "0"], ["--interval", "-1"], ["--count", "-1"]):
        r = subprocess.run(
            [sys.executable, "-m", "rollout_buffer", "stats", url, "--watch", *bad],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 2 and "expected" in r.stderr and "Traceback" not in r.stderr, (
            bad,
            r.stderr,
        )
