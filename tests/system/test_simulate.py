"""The simulated launcher (``python -m rollout_buffer.simulate``), run as a real subprocess.

Its rows are read back from SQLite and from Postgres and checked against the SPEC §2
invariants the buffer relies on. Postgres (support.PG_DSN: ``ROLLOUT_BUFFER_TEST_PG``) runs in a
fresh schema per test, dropped after; when the server is unreachable the Postgres case is
skipped, or fails when ``CI`` is set.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from support import fresh_pg_schema, require_pg, wait_until

from rollout_buffer.storage import db as dbmod

ROOT = Path(__file__).resolve().parent.parent.parent
UNKNOWN_LAUNCHER_FLAGS = [
    "--mode",
    "local",
    "--llm-base-url",
    "http://127.0.0.1:9/v1",
    "--no-rebuild-table",
    "--rl-use-session-suffix-url",
    "--llm-model",
    "default",
    "--env-root",
    "/nonexistent",
    "--message-cut",
    "0",
]


def run_sim(url: str, job: str, *extra: str, timeout: float = 60) -> tuple[dict[str, Any], str]:
    """Run the simulator to completion; return (SIMULATE summary, stdout)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollout_buffer.simulate",
            "--db-path",
            url,
            "--job-id",
            job,
            "--pace",
            "0",
            *extra,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"simulate exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("SIMULATE "), proc.stdout
    return json.loads(last[len("SIMULATE ") :]), proc.stdout


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield "sqlite://" + str(tmp_path / "launcher.db")
        return
    require_pg()
    with fresh_pg_schema() as url:
        yield url


def read_rows(url: str, job: str) -> list[dict[str, Any]]:
    with dbmod.connect(url) as db:
        return db.fetchall("SELECT * FROM session_steps WHERE job_id = ? ORDER BY id", (job,))


def read_envs(url: str, job: str) -> list[dict[str, Any]]:
    with dbmod.connect(url) as db:
        return db.fetchall("SELECT * FROM job_environments WHERE job_id = ? ORDER BY id", (job,))


def check_session_rows(
    srows: list[dict[str, Any]], job: str, backend: str, message_cut: int, versions: bool
) -> None:
    """One session's rows, in step order: flags, rewards, the prompt the model saw, versions and
    timestamps as SPEC §2 says the real launcher writes them."""
    cum = 0.0
    history: list[Any] = []
    prev_response = None
    for r in srows:
        terminal = int(r["is_terminal"]) == 1
        assert int(r["is_trainable"]) == (1 if message_cut > 0 or terminal else 0), (
            "message-cut <= 0: only the terminal row is trainable; > 0: every row"
        )
        assert r["llm_model"] == "simulated" and r["job_id"] == job
        cum += r["step_reward"]
        assert abs(r["reward"] - cum) < 1e-6, "reward is the running sum of step_reward"
        msgs = json.loads(r["messages"])
        assert isinstance(msgs, list) and all(isinstance(m, dict) for m in msgs)
        if not history:
            assert [m["role"] for m in msgs] == ["system", "user"]
            history = msgs
        else:
            history = [
                *history,
                {"role": "assistant", "content": prev_response},
                {"role": "user", "content": msgs[-1]["content"]},
            ]
            assert msgs[-1]["role"] == "user"
            expected = (
                history
                if message_cut <= 0
                else [history[0], *history[1:][-(2 * message_cut - 1) :]]
            )
            assert msgs == expected, "the prompt the model saw (SPEC §2, --message-cut)"
        prev_response = r["response"]
        assert isinstance(r["response"], str) and r["response"]
        if versions:
            state = json.loads(r["env_state"])
            assert isinstance(state, dict) and type(state["weight_version"]) is int
        else:
            assert r["env_state"] is None, "no version unless --weight-version-interval"
        created = r["created_at"]
        if backend == "sqlite":
            assert isinstance(created, str) and "+00:00" in created, created
            created = datetime.fromisoformat(created)
        assert isinstance(created, datetime) and created.utcoffset() is not None
        if int(r["is_session_completed"]) == 0:
            assert int(r["is_terminal"]) == 0 and int(r["is_truncated"]) == 0


def check_invariants(
    url: str,
    job: str,
    summary: dict[str, Any],
    k: int,
    max_steps: int,
    message_cut: int = 0,
    versions: bool = False,
) -> dict[str, Any]:
    """Assert SPEC §2 (what the real launcher writes, step by step) on a job's rows; return
    per-session facts."""
    rows = read_rows(url, job)
    envs = read_envs(url, job)
    backend = "sqlite" if url.startswith("sqlite") else "postgres"
    assert len(rows) == summary["rows"]
    assert sum(int(r["is_trainable"]) for r in rows) == summary["trainable_rows"]

    by_session: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_session[r["session_id"]].append(r)

    # job_environments: one row per scheduled session, env_id = session_id, the session's group.
    env_group = {e["env_id"]: e["group_id"] for e in envs}
    assert len(envs) == len(env_group) == summary["sessions"] == summary["groups"] * k
    sessions_per_group: dict[str, int] = defaultdict(int)
    for e in envs:
        sessions_per_group[e["group_id"]] += 1
        json.loads(e["env_params"])
        assert int(e["finished"]) == 0, "the launcher never sets finished"
    assert len(sessions_per_group) == summary["groups"]
    assert set(sessions_per_group.values()) == {k}

    completed_per_group: dict[str, int] = defaultdict(int)
    completed = truncated = capped = 0
    for sid, srows in by_session.items():
        uuid.UUID(sid)
        assert sid in env_group, "a row for a session that was never scheduled"
        assert {r["group_id"] for r in srows} == {env_group[sid]}
        assert [r["step_id"] for r in srows] == list(range(1, len(srows) + 1)), (
            "step ids 1..n in id order"
        )
        assert len(srows) <= max_steps
        flags = [int(r["is_session_completed"]) for r in srows]
        assert sum(flags) <= 1 and flags[:-1] == [0] * (len(srows) - 1), (
            "completed only on the last row"
        )
        check_session_rows(srows, job, backend, message_cut, versions)
        last = srows[-1]
        if int(last["is_session_completed"]):
            assert int(last["is_terminal"]) == 1
            completed += 1
            completed_per_group[last["group_id"]] += 1
            if int(last["is_truncated"]):
                truncated += 1
                assert last["step_reward"] == 0.0, "an answer cut by its length limit: reward 0"
        elif len(srows) == max_steps:
            capped += 1  # reached the step cap: no terminal row
    assert completed == summary["completed_sessions"]
    assert truncated == summary["truncated_sessions"]
    assert capped == summary["capped_sessions"]
    assert (
        summary["completed_sessions"] + summary["failed_sessions"] + summary["capped_sessions"]
        == summary["sessions"]
    )
    # Sessions that failed before their first step have no rows at all.
    assert len(by_session) <= summary["sessions"]
    complete_groups = sum(1 for n in completed_per_group.values() if n == k)
    assert complete_groups == summary["complete_groups"]
    # Terminal rewards are distinct within a group (a truncated session's is 0).
    terminal: dict[str, list[float]] = defaultdict(list)
    for srows in by_session.values():
        if int(srows[-1]["is_session_completed"]) and not int(srows[-1]["is_truncated"]):
            terminal[srows[-1]["group_id"]].append(srows[-1]["step_reward"])
    for rewards in terminal.values():
        assert len(set(rewards)) == len(rewards)
    # Rows are flushed in batches: each flush is one created_at, at most --flush-rows rows.
    per_flush: dict[Any, int] = defaultdict(int)
    for r in rows:
        per_flush[r["created_at"]] += 1
    assert len(per_flush) == summary["flushes"] and max(per_flush.values()) <= 100
    version = [json.loads(r["env_state"])["weight_version"] for r in rows if r["env_state"]]
    assert version == sorted(version) or backend == "postgres"
    return {
        "max_weight_version": max(version, default=None),
        "group_ids": set(sessions_per_group),
        "sessions_with_rows": len(by_session),
        "flush_sizes": sorted(per_flush.values()),
    }


def test_rows_satisfy_spec_invariants(db_url: str) -> None:
    k, steps = 4, 5
    common = ["--rl-group-size", str(k), "--max-steps", str(steps), "--pool-size", "6", "--quiet"]

    # A launcher-like command line: unknown flags are accepted; tables are created on demand.
    a, _ = run_sim(
        db_url,
        "job-a",
        "--storage-type",
        "postgres" if "postgres" in db_url else "sqlite",
        "--groups",
        "8",
        "--fail-rate",
        "0",
        "--cap-rate",
        "0",
        "--truncate-rate",
        "0.3",
        "--seed",
        "1",
        *common,
        *UNKNOWN_LAUNCHER_FLAGS,
    )
    fa = check_invariants(db_url, "job-a", a, k, steps)
    assert a["failed_sessions"] == 0 and a["complete_groups"] == 8
    assert a["truncated_sessions"] > 0
    assert a["interrupted"] is False and a["exit_code"] == 0

    # Half the sessions crash: some never write a completed row; some groups stay incomplete.
    b, _ = run_sim(db_url, "job-b", "--groups", "8", "--fail-rate", "0.5", "--seed", "2", *common)
    fb = check_invariants(db_url, "job-b", b, k, steps)
    assert b["failed_sessions"] > 0 and b["complete_groups"] < 8
    rows_b = read_rows(db_url, "job-b")
    sessions_b = defaultdict(list)
    for r in rows_b:
        sessions_b[r["session_id"]].append(r)
    assert any(not int(s[-1]["is_session_completed"]) for s in sessions_b.values()), (
        "with --fail-rate 0.5 some sessions must stop without a completed row"
    )

    # Group ids are deterministic: the same across jobs of one epoch; --rl-epoch 2 shifts the
    # task index by --groups, so its groups are new.
    assert fa["group_ids"] == fb["group_ids"]
    c, _ = run_sim(db_url, "job-c", "--groups", "8", "--rl-epoch", "2", "--fail-rate", "0", *common)
    fc = check_invariants(db_url, "job-c", c, k, steps)
    assert not fc["group_ids"] & fa["group_ids"]


def test_step_capped_sessions_and_the_message_cut(tmp_path: Path) -> None:
    """Under --message-cut 0 a session that reaches --max-steps writes rows, none trainable (its
    group can never complete); under --message-cut 2 every row is trainable and holds the system
    message and the last 3 messages."""
    url = "sqlite://" + str(tmp_path / "cap.db")
    common = ["--groups", "6", "--rl-group-size", "4", "--max-steps", "5", "--quiet"]
    capped = ["--cap-rate", "0.5", "--fail-rate", "0", "--truncate-rate", "0", "--seed", "4"]
    a, _ = run_sim(url, "job-cut0", *common, *capped)
    check_invariants(url, "job-cut0", a, 4, 5)
    assert a["capped_sessions"] > 0 and a["complete_groups"] < 6
    rows = read_rows(url, "job-cut0")
    assert a["trainable_rows"] == a["completed_sessions"], "one trainable row per session"
    by_session: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_session[r["session_id"]].append(r)
    capped_sessions = [s for s in by_session.values() if not int(s[-1]["is_terminal"])]
    assert capped_sessions and all(len(s) == 5 for s in capped_sessions)
    assert all(int(r["is_trainable"]) == 0 for s in capped_sessions for r in s)

    b, _ = run_sim(url, "job-cut2", *common, *capped, "--message-cut", "2")
    check_invariants(url, "job-cut2", b, 4, 5, message_cut=2)
    assert b["trainable_rows"] == b["rows"]


def test_rows_are_flushed_in_batches(tmp_path: Path) -> None:
    """Up to --flush-rows rows a transaction, all with the flush's created_at."""
    url = "sqlite://" + str(tmp_path / "flush.db")
    summary, _ = run_sim(
        url,
        "job-flush",
        "--groups",
        "10",
        "--rl-group-size",
        "4",
        "--seed",
        "5",
        "--quiet",
        "--flush-rows",
        "30",
    )
    facts = check_invariants(url, "job-flush", summary, 4, 10)
    sizes = facts["flush_sizes"]
    assert summary["flushes"] == len(sizes) >= 2 and max(sizes) == 30
    assert sum(sizes) == summary["rows"]


def test_weight_version_rises_and_progress_is_printed(tmp_path: Path) -> None:
    """The simulator plays the proxy's part: the version advances every interval."""
    url = "sqlite://" + str(tmp_path / "wv.db")
    summary, out = run_sim(
        url,
        "job-wv",
        "--groups",
        "20",
        "--rl-group-size",
        "4",
        "--max-steps",
        "4",
        "--fail-rate",
        "0",
        "--seed",
        "3",
        "--pace",
        "0.002",
        "--flush-rows",
        "10",
        "--weight-version-interval",
        "0.05",
    )
    assert "simulate: job job-wv" in out
    facts = check_invariants(url, "job-wv", summary, 4, 4, versions=True)
    assert facts["max_weight_version"] == summary["max_weight_version"] >= 2


def test_bare_path_and_missing_required_flag(tmp_path: Path) -> None:
    path = tmp_path / "bare.db"
    summary, _ = run_sim(
        str(path),
        "job-bare",
        "--storage-type",
        "sqlite",
        "--groups",
        "1",
        "--rl-group-size",
        "2",
        "--fail-rate",
        "0",
        "--quiet",
    )
    assert len(read_rows("sqlite://" + str(path), "job-bare")) == summary["rows"] > 0
    proc = subprocess.run(
        [sys.executable, "-m", "rollout_buffer.simulate", "--db-path", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2 and "--job-id" in proc.stderr


def test_sigterm_stops_a_slow_run_promptly(tmp_path: Path) -> None:
    url = "sqlite://" + str(tmp_path / "slow.db")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rollout_buffer.simulate",
            "--db-path",
            url,
            "--job-id",
            "job-slow",
            "--pace",
            "0.5",
            "--groups",
            "50",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:

        def writing() -> bool:
            try:
                return bool(read_rows(url, "job-slow"))
            except Exception:
                return False

        wait_until(writing, 15, "the simulator writing rows")
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=10)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, out, err)
    assert took < 1.5, f"took {took:.2f}s to stop after SIGTERM"
    summary = json.loads(out.strip().splitlines()[-1][len("SIMULATE ") :])
    assert summary["interrupted"] is True and summary["exit_code"] == 143
    assert 0 < summary["rows"] < 50 * 8
    assert len(read_rows(url, "job-slow")) == summary["rows"]
