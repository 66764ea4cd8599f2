"""``rollout-buffer export`` and its reverse, ``simulate --from-export``, on SQLite and Postgres.

A job with served groups (one with an incomplete session), a TTL drop, a malformed row (its group
dropped), a row without a group (rejected) and a late row is served to a trainer through the API
while the service runs; the export (the real command, plain and gzip; and in small pages in
process) is checked record by record against the database, and its served items against what the
trainer received. The round trip writes an export back into a new job and drains it.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from support import Writer, groups_of, now_text, run_on_a_terminal, wait_until

from rollout_buffer.storage.db import connect
from rollout_buffer.storage.launcher_sql import STEP_COLUMNS
from rollout_buffer.tools import export as export_mod

ROOT = Path(__file__).resolve().parent.parent.parent
JOB = "exp-job"


@pytest.fixture
def harness(db_url, harness_factory):
    """The service, with a TTL short enough to drop the incomplete group during the test."""
    return harness_factory(db_url, ttl_s=1.5)


def _job(harness, writer: Writer) -> dict[str, list[dict]]:
    """Write and serve the job; returns the trainer's items by group."""
    harness.start(k=2, job=JOB)
    writer.job = JOB
    writer.group("g-served-a", 2, steps=3)
    writer.group("g-served-b", 3, steps=2, complete=2)  # its third session is incomplete
    writer.group("g-ttl", 2, steps=2, complete=1)
    bad = writer.group("g-bad", 2, steps=2)
    writer.step("g-bad", bad[0], 3, messages="{not json", completed=False)
    writer.step(None, "orphan-session", 1, completed=True, step_reward=0.3)
    got: dict[str, list[dict]] = {}
    doc = harness.poll(request_id=uuid.uuid4().hex)
    got.update(groups_of(doc))
    writer.step("g-served-a", "late-session", 1, completed=True)  # after its group was served
    wait_until(
        lambda: harness.stats()["groups"]["dropped"].get("incomplete_group_ttl") == 1,
        10,
        "the TTL drop",
    )
    harness.settle()
    s = harness.stats()
    assert sorted(got) == ["g-served-a", "g-served-b"]
    assert s["groups"]["dropped"] == {"incomplete_group_ttl": 1, "malformed_row": 1}, s
    assert s["rows"]["rejected"] == {"missing_group_id": 1, "invalid_json_messages": 1}, s
    assert s["rows"]["dropped"]["late_rows_from_served_groups"] == 1, s
    return got


def _export_cli(db_url: str, out: Path, what: str = "all") -> list[dict]:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollout_buffer",
            "export",
            "--db",
            db_url,
            "--job",
            JOB,
            "--out",
            str(out),
            "--what",
            what,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "exported" in r.stdout and r.stderr == ""  # no progress bar off a terminal
    assert not Path(str(out) + ".partial").exists()
    return list(export_mod.read_export(str(out)))


def _check_against_db(db_url: str, records: list[dict], trainer: dict[str, list[dict]]) -> None:
    """Every record holds what the database holds, and served items are what the trainer got."""
    db = connect(db_url)
    try:
        groups = {
            r["group_id"]: r
            for r in db.fetchall("SELECT * FROM rollout_buffer_groups WHERE job_id = ?", (JOB,))
        }
        accounted = {
            int(r["step_pk"]): r
            for r in db.fetchall("SELECT * FROM rollout_buffer_rows WHERE job_id = ?", (JOB,))
        }
        steps = {
            int(r["id"]): r
            for r in db.fetchall("SELECT * FROM session_steps WHERE job_id = ?", (JOB,))
        }
    finally:
        db.close()
    by_group = {r["group_id"]: r for r in records}
    orphans = [r for r in records if r["group_id"] is None]
    assert set(by_group) - {None} == set(groups)
    assert len(orphans) == sum(1 for r in accounted.values() if r["group_id"] is None) == 1
    seen_pks: set[int] = set()
    for rec in records:
        assert rec["job_id"] == JOB and rec["missing_step_pks"] == []
        pks = [st["step_pk"] for s in rec["sessions"] for st in s["steps"]]
        seen_pks.update(pks)
        if rec["group_id"] is None:
            row = accounted[pks[0]]
            assert (rec["status"], rec["reason"], rec["decided_at"]) == (
                "rejected",
                row["reason"],
                row["recorded_at"],
            )
            assert rec["sessions"][0]["steps"][0]["outcome"] == "rejected"
            continue
        g = groups[rec["group_id"]]
        assert (rec["status"], rec["reason"], rec["batch_id"], rec["decided_at"]) == (
            g["status"],
            g["reason"],
            g["batch_id"],
            g["resolved_at"],
        )
        mine = {pk for pk, r in accounted.items() if r["group_id"] == rec["group_id"]}
        assert sorted(pks) == sorted({int(p) for p in g["pks"].split(",")} | mine)
        for s in rec["sessions"]:
            done = [st for st in s["steps"] if st["completed"]]
            assert s["terminal_reward"] == (done[-1]["step_reward"] if done else None)
            for st in s["steps"]:
                row = steps[st["step_pk"]]
                assert (
                    s["session_id"],
                    st["step_id"],
                    st["response"],
                    st["step_reward"],
                    st["env_state"],
                ) == (
                    row["session_id"],
                    row["step_id"],
                    row["response"],
                    row["step_reward"],
                    row["env_state"],
                )
                if st["messages"] is None:
                    assert st["messages_text"] == row["messages"] == "{not json"
                    assert (st["outcome"], st["reason"]) == ("rejected", "invalid_json_messages")
                else:
                    assert st["messages"] == json.loads(row["messages"])
                if st["step_pk"] in accounted and accounted[st["step_pk"]]["outcome"] == "dropped":
                    assert st["reason"] == "late_rows_from_served_groups"
                assert st["weight_version"] == json.loads(row["env_state"])["weight_version"]
        if rec["status"] == "served":
            assert rec["uids"] == "as_served"
            assert rec["items"] == trainer[rec["group_id"]]  # same uids, same everything
        else:
            assert "items" not in rec
    assert seen_pks == set(steps), "every row of the job is in the export"
    ttl = by_group["g-ttl"]
    assert ttl["reason"] == "incomplete_group_ttl" and [
        s["completed"] for s in ttl["sessions"]
    ] == [True, False]
    served_b = by_group["g-served-b"]
    assert sorted(st["reason"] or "" for s in served_b["sessions"] for st in s["steps"]) == [
        "",
        "",
        "",
        "",
        "incomplete_session_in_served_group",
        "incomplete_session_in_served_group",
    ]


def test_export_of_served_dropped_and_rejected_rows(harness, writer, db_url, tmp_path):
    trainer = _job(harness, writer)
    plain = _export_cli(db_url, tmp_path / "job.jsonl")
    gz = _export_cli(db_url, tmp_path / "job.jsonl.gz")
    with gzip.open(tmp_path / "job.jsonl.gz") as unzipped:
        assert unzipped.read() == (tmp_path / "job.jsonl").read_bytes()
    assert plain == gz
    assert [r["group_id"] for r in plain] == ["g-bad", "g-served-a", "g-served-b", "g-ttl", None]
    _check_against_db(db_url, plain, trainer)
    served = _export_cli(db_url, tmp_path / "served.jsonl", "served")
    assert [r["group_id"] for r in served] == ["g-served-a", "g-served-b"]
    dropped = _export_cli(db_url, tmp_path / "dropped.jsonl", "dropped")
    assert [r["group_id"] for r in dropped] == ["g-bad", "g-ttl", None]


def test_export_pages_merge_at_every_page_boundary(harness, writer, db_url, tmp_path, monkeypatch):
    # pages of 2 make every keyset page boundary and the groups/rows merge run (the memory this
    # keeps
    # constant is measured by tests/bench/export_rss.py, not here)
    trainer = _job(harness, writer)
    monkeypatch.setattr(export_mod, "PAGE", 2)
    db = connect(db_url)
    try:
        summary = export_mod.export(db, db, JOB, str(tmp_path / "p.jsonl"))
    finally:
        db.close()
    records = list(export_mod.read_export(str(tmp_path / "p.jsonl")))
    assert summary.records == len(records) == 5
    _check_against_db(db_url, records, trainer)


def test_export_of_an_unknown_job_names_the_known_ones(harness, writer, db_url, tmp_path):
    _job(harness, writer)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollout_buffer",
            "export",
            "--db",
            db_url,
            "--job",
            "nope",
            "--out",
            str(tmp_path / "x.jsonl"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "no job 'nope'" in r.stderr and JOB in r.stderr
    assert not (tmp_path / "x.jsonl").exists()


def _session_shapes(items: list[dict]) -> list[tuple]:
    """A group's sessions without their ids: (terminal reward, [(step, messages, response)...])."""
    by: dict[str, list[dict]] = {}
    for it in items:
        by.setdefault(it["extra_info"]["session_id"], []).append(it)
    return sorted(
        (
            its[0]["reward"],
            [
                (
                    i["extra_info"]["steps"],
                    json.dumps(i["messages"]),
                    i["extra_info"]["step_reward"],
                    i["extra_info"]["truncated"],
                )
                for i in its
            ],
        )
        for its in by.values()
    )


def test_round_trip_export_replay_drain(harness, writer, db_url, tmp_path):
    trainer = _job(harness, writer)
    out = tmp_path / "all.jsonl.gz"
    _export_cli(db_url, out)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollout_buffer.simulate",
            "--from-export",
            str(out),
            "--db-path",
            db_url,
            "--job-id",
            "replayed",
            "--pace",
            "0",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.splitlines()[-1][len("SIMULATE ") :])
    assert summary["records"] == 5 and summary["groups"] == 4
    harness.start(k=2, job="replayed")
    again: dict[str, list[dict]] = {}
    for _ in range(5):
        doc = harness.poll()
        if doc["success"]:
            again.update(groups_of(doc))
    assert sorted(again) == sorted(trainer)
    for gid, items in trainer.items():
        assert _session_shapes(again[gid]) == _session_shapes(items)
    s = harness.stats()
    # the malformed row is malformed again, the row without a group rejected again
    assert s["rows"]["rejected"] == {"missing_group_id": 1, "invalid_json_messages": 1}, s
    assert s["groups"]["dropped"].get("malformed_row") == 1, s


# -- hostile rows, hostile arguments
# ---------------------------------------------------------------------

DEEP = 2000


def _raw_step(
    db, gid: str, sid: Any, step: int, completed: bool, as_text: tuple[str, ...] = (), **spoil: Any
) -> None:
    """One launcher row written with exactly the given values (bytes are bound as a BLOB, or as
    undecodable TEXT for the columns in ``as_text``), as a buggy launcher could write it."""
    row = {
        "session_id": sid,
        "step_id": step,
        "env_name": "env",
        "llm_model": "m",
        "group_id": gid,
        "job_id": JOB,
        "messages": json.dumps([{"role": "user", "content": f"task {gid}"}]),
        "response": "answer",
        "step_reward": 0.5 if completed else 0.0,
        "reward": 0.0,
        "env_state": '{"weight_version": 3}',
        "is_terminal": int(completed),
        "is_truncated": 0,
        "is_session_completed": int(completed),
        "is_trainable": 1,
        "created_at": now_text(),
    }
    row.update(spoil)
    marks = ", ".join("CAST(? AS TEXT)" if c in as_text else "?" for c in STEP_COLUMNS)
    db.execute(
        f"INSERT INTO session_steps ({', '.join(STEP_COLUMNS)}) VALUES ({marks})",
        [row[c] for c in STEP_COLUMNS],
    )


def _hostile_rows(backend: str) -> dict[str, dict[str, Any]]:
    """One spoiled first row per kind of group (the kinds a backend can store)."""
    kinds: dict[str, dict[str, Any]] = {
        "deep_messages": {"messages": "[" * DEEP + "]" * DEEP},
        "deep_env_state": {"env_state": '{"a": ' * DEEP + "1" + "}" * DEEP},
        "bad_created_at": {
            "created_at": "infinity" if backend == "postgres" else "garbage, not a time"
        },
        "nan_messages": {"messages": '[{"role": "user", "content": NaN}]'},
        "nan_reward": {"step_reward": float("nan") if backend == "postgres" else float("inf")},
    }
    if backend == "sqlite":  # values only SQLite's loose typing can hold
        kinds.update(
            {
                "blob_session_id": {"session_id": b"blob-session"},
                "undecodable_messages": {
                    "messages": b'["\xff\xfe broken"]',
                    "as_text": ("messages",),
                },
                "undecodable_response": {"response": b"answer \xc3\x28", "as_text": ("response",)},
                "text_reward": {"step_reward": "not a number"},
                "text_step_id": {"step_id": "one"},
            }
        )
    return kinds


def test_every_bad_row_is_exported_with_its_reason_and_written_back(
    db_url, harness_factory, tmp_path
):
    """Rows of every malformed kind: the export holds each of them with its reason (none skipped, no
    crash), and simulate --from-export writes the file back without stopping."""
    h = harness_factory(db_url)
    h.start(k=2, job=JOB)
    db = connect(db_url)
    kinds = _hostile_rows(db.backend)
    try:
        for kind, spoil in kinds.items():
            gid = f"g-{kind}"
            _raw_step(db, gid, f"{gid}-a", 1, False, **spoil)
            _raw_step(db, gid, f"{gid}-a", 2, True)
            _raw_step(db, gid, f"{gid}-b", 1, True)
        _raw_step(db, "g-fine", "g-fine-a", 1, True)
        _raw_step(db, "g-fine", "g-fine-b", 1, True)
        written = int(db.scalar("SELECT COUNT(*) FROM session_steps WHERE job_id = ?", (JOB,)))
    finally:
        db.close()
    assert groups_of(h.poll()).keys() == {"g-fine"}
    h.settle()
    s = h.stats()
    assert s["groups"]["dropped"] == {"malformed_row": len(kinds)}, s
    records = _export_cli(db_url, tmp_path / "hostile.jsonl.gz")
    steps = {
        st["step_pk"]: (rec["group_id"], st["outcome"], st["reason"])
        for rec in records
        for se in rec["sessions"]
        for st in se["steps"]
    }
    assert len(steps) == written, "a row is missing from the export"
    for kind in kinds:
        mine = [v for v in steps.values() if v[0] == f"g-{kind}"]
        rejected = [reason for _, outcome, reason in mine if outcome == "rejected"]
        assert len(mine) == 3 and len(rejected) == 1 and rejected[0], (kind, mine)
        rec = next(r for r in records if r["group_id"] == f"g-{kind}")
        assert (rec["status"], rec["reason"]) == ("dropped", "malformed_row")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollout_buffer.simulate",
            "--from-export",
            str(tmp_path / "hostile.jsonl.gz"),
            "--db-path",
            db_url,
            "--job-id",
            "again",
            "--pace",
            "0",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    late = sum(1 for _, _, reason in steps.values() if (reason or "").startswith("late_rows_"))
    assert json.loads(r.stdout.splitlines()[-1][len("SIMULATE ") :])["rows"] == written - late


def test_export_shows_its_progress_bar_on_a_terminal_only(harness, writer, tmp_path):
    _job(harness, writer)
    code, err, out = run_on_a_terminal(
        [
            sys.executable,
            "-m",
            "rollout_buffer",
            "export",
            "--db",
            harness.config.db_url,
            "--job",
            JOB,
            "--out",
            str(tmp_path / "t.jsonl"),
        ],
        cwd=ROOT,
        stream="stderr",
    )
    assert code == 0 and "exported 5 records" in out
    assert "export [########################] 100%" in err


def test_export_refuses_a_missing_database_and_an_unwritable_file_clearly(
    harness, writer, db_url, tmp_path
):
    _job(harness, writer)

    def export(db: str, out: Path) -> subprocess.CompletedProcess:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "rollout_buffer",
                "export",
                "--db",
                db,
                "--job",
                JOB,
                "--out",
                str(out),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )

    typo = tmp_path / "no-such.db"
    r = export(f"sqlite://{typo}", tmp_path / "x.jsonl")
    assert (
        r.returncode == 1
        and "cannot open SQLite database" in r.stderr
        and "Traceback" not in r.stderr
    )
    assert not typo.exists(), "the export created a database where there was none"
    r = export(db_url, tmp_path / "no-such-dir" / "x.jsonl")
    assert r.returncode == 1 and "cannot write" in r.stderr and "Traceback" not in r.stderr
    secret = "s3cret-" + uuid.uuid4().hex[:6]
    r = export(f"postgresql://root:{secret}@127.0.0.1:1/test", tmp_path / "x.jsonl")
    assert r.returncode == 1 and "127.0.0.1" in r.stderr
    assert secret not in r.stderr + r.stdout


def test_writing_back_a_file_that_is_not_an_export_is_an_error_not_a_traceback(lite_url, tmp_path):
    good = tmp_path / "good.jsonl.gz"
    with gzip.open(good, "wt") as f:
        for i in range(200):  # enough for the gzip stream to span several blocks
            f.write(
                json.dumps(
                    {"format": 1, "group_id": f"g{i}", "sessions": [], "pad": uuid.uuid4().hex * 40}
                )
                + "\n"
            )
    data = good.read_bytes()
    cases = {
        "truncated.jsonl.gz": data[: len(data) // 2],
        "list.jsonl": b"[1, 2]\n",
        "binary.jsonl": b"\xff\xfe\n",
        "text.jsonl": b'{"format": 1, "sessions": "none"}\n',
    }
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "rollout_buffer.simulate",
                "--from-export",
                str(tmp_path / name),
                "--db-path",
                lite_url,
                "--job-id",
                "again",
                "--pace",
                "0",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 1, (name, r.returncode, r.stderr)
        assert f"simulate: error: {tmp_path / name}" in r.stderr and "Traceback" not in r.stderr, (
            name,
            r.stderr,
        )


def test_export_counts_what_generating_each_group_cost(harness_factory, db_url, tmp_path):
    """Issues 22 and 23: every record says its generation seconds and rows, and names the sessions
    that never wrote a trainable row (scheduled in job_environments, or only non-trainable rows)."""
    from rollout_buffer.storage import launcher_sql as q

    h = harness_factory(db_url, ttl_s=0.5)
    h.start(k=2, job=JOB)
    w = Writer(db_url, job=JOB)
    try:
        for sid in ("c-1", "c-2", "c-silent"):
            w.db.execute(q.INSERT_ENV, (JOB, sid, "env", "{}", None, "g-cost", 0, 0, now_text()))
        w.step("g-cost", "c-1", 1, trainable=False, created_at="2026-01-01 00:00:00+00:00")
        w.step("g-cost", "c-1", 2, completed=True, created_at="2026-01-01 00:00:04+00:00")
        w.step("g-cost", "c-2", 1, trainable=False, created_at="2026-01-01 00:00:01+00:00")
        h.settle()
        wait_until(lambda: h.stats()["groups"]["dropped"], 10, "the TTL drop")
    finally:
        w.close()
    records = {r["group_id"]: r for r in _export_cli(db_url, tmp_path / "cost.jsonl")}
    generation = records["g-cost"]["generation"]
    assert generation["rows"] == 3 and generation["sessions"] == 3
    assert generation["generation_s"] == 4.0  # c-1 from its first row to its last; c-2 one row
    assert generation["sessions_without_trainable_row"] == ["c-2", "c-silent"]
