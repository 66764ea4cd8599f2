"""``rollout-buffer demo`` end to end: real gunicorn, SQLite, the simulated launcher, a polling
trainer."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
SCRUB_PREFIXES = ("AIEVOBOX_", "AIEVOBOC_", "ROLLOUT_BUFFER_", "LLM_PROXY_")


@pytest.mark.slow
def test_demo_runs_end_to_end_and_prints_the_summary(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(SCRUB_PREFIXES)}
    # settings in the caller's environment must not leak into the demo's server
    env["ROLLOUT_BUFFER_LAUNCHER"] = "none"
    env["AIEVOBOX_DB_URL"] = "sqlite:///nonexistent/elsewhere.db"
    workdir = tmp_path / "demo"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollout_buffer",
            "demo",
            "--groups",
            "6",
            "--k",
            "3",
            "--pace",
            "0.001",
            "--dir",
            str(workdir),
            "--timeout",
            "100",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{proc.stderr}"
    assert "summary" in out
    m = re.search(r"groups served\s+(\d+)", out)
    assert m and int(m.group(1)) >= 1, out
    for label in (
        "items (steps)",
        "sessions",
        "dropped groups",
        "rejected rows",
        "avg reward",
        "wall time",
        "database",
        "logs",
    ):
        assert label in out, out
    assert re.search(r"accounting balanced\s+yes", out), out
    assert re.search(r"checks\s+passed", out), out
    assert (workdir / "demo.db").exists() and (workdir / "server.log").exists()
    assert list((workdir / "logs").glob("launcher-*.log"))
    # the server was stopped: nothing listens on its port any more
    port = int(re.search(r"http://127\.0\.0\.1:(\d+)", out).group(1))
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.slow
def test_demo_with_policies_shows_their_counts(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(SCRUB_PREFIXES)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollout_buffer",
            "demo",
            "--policies",
            "--groups",
            "20",
            "--k",
            "3",
            "--pace",
            "0.001",
            "--dir",
            str(tmp_path / "demo"),
            "--timeout",
            "100",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{proc.stderr}"
    m = re.search(
        r"policies\s+stale (\d+) groups, zero_variance (\d+) groups, oversampled (\d+) rows", out
    )
    assert m, out
    # 20 groups of K+1 sessions: over-sampling always has extra sessions to drop
    assert int(m.group(3)) > 0, out
    assert re.search(r"accounting balanced\s+yes", out), out
    assert re.search(r"checks\s+passed", out), out
