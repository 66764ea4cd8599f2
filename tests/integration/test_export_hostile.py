"""``rollout-buffer export`` and ``simulate --from-export`` on hostile rows (issue 20, item 7): a
history that parses but cannot be written again as JSON (nested about a thousand deep, an escaped
lone surrogate) goes out as its raw text with a note, and every decided group is exported; a SQLite
export written into Postgres writes every row it can (NUL replaced) and reports each row it changed
or skipped."""

from __future__ import annotations

import json
import subprocess
import tracemalloc
from pathlib import Path
from typing import Any

from support import Writer, groups_of, run_module

from rollout_buffer.storage.db import connect
from rollout_buffer.tools import export as export_mod

JOB = "hostile-job"
NEARLY_TOO_DEEP = 995  # json.loads takes it; json.dumps inside a record runs out of stack


def export_cli(db_url: str, out: Path) -> subprocess.CompletedProcess:
    argv = ("export", "--db", db_url, "--job", JOB, "--out", str(out))
    return run_module("rollout_buffer", *argv)


def test_a_history_that_cannot_be_written_again_is_exported_as_its_raw_text(
    db_url, harness_factory, writer, tmp_path
):
    h = harness_factory(db_url)
    h.start(k=2, job=JOB)
    writer.job = JOB
    deep = "[" * NEARLY_TOO_DEEP + "]" * NEARLY_TOO_DEEP
    surrogate = '[{"role": "user", "content": "half a pair \\ud800"}]'
    for gid, messages in (("g-deep", deep), ("g-surrogate", surrogate)):
        writer.step(gid, f"{gid}-a", 1, messages=messages)
        writer.step(gid, f"{gid}-a", 2, completed=True)
        writer.step(gid, f"{gid}-b", 1, completed=True)
    writer.group("g-fine", 2)
    served = set(groups_of(h.poll()))
    h.settle()
    decided = h.stats()["groups"]
    assert "g-fine" in served and decided["pending"] == decided["ready"] == 0
    out = tmp_path / "hostile.jsonl"
    r = export_cli(db_url, out)
    assert r.returncode == 0, r.stderr
    records = {rec["group_id"]: rec for rec in export_mod.read_export(str(out))}
    assert set(records) == {"g-deep", "g-surrogate", "g-fine"}
    for gid, raw in (("g-deep", deep), ("g-surrogate", surrogate)):
        first = records[gid]["sessions"][0]["steps"][0]
        assert first["messages"] is None and first["messages_text"] == raw, gid
        assert "kept as its raw text" in first["messages_note"], gid


def test_writing_a_sqlite_export_into_postgres_writes_every_row_it_can_and_reports_the_others(
    lite_url, pg_url, harness_factory, tmp_path
):
    h = harness_factory(lite_url)
    h.start(k=2, job=JOB)
    writer = Writer(lite_url, job=JOB)
    try:
        writer.group("g-fine", 2)
        writer.step("g-nul\x00id", "nul-id-a", 1, completed=True)
        writer.step("g-nul\x00id", "nul-id-b", 1, completed=True)
        writer.step("g-nul-text", "nul-text-a", 1, completed=True, response="an\x00swer")
        writer.step("g-nul-text", "nul-text-b", 1, completed=True, env_state='{"a": "\x00"}')
        text_step: Any = "one"  # a SQLite INT column holds text as it is given
        writer.step("g-text-step", "text-step-a", text_step, completed=True, messages=[])
        writer.step("g-text-step", "text-step-b", 1, completed=True)
    finally:
        writer.close()
    h.poll()
    h.settle()
    out = tmp_path / "nul.jsonl"
    assert export_cli(lite_url, out).returncode == 0
    exported = [
        st
        for rec in export_mod.read_export(str(out))
        for se in rec["sessions"]
        for st in se["steps"]
    ]
    argv = ["--from-export", str(out), "--db-path", pg_url, "--job-id", "again", "--pace", "0"]
    r = run_module("rollout_buffer.simulate", *argv)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.splitlines()[-1][len("SIMULATE ") :])
    assert (summary["changed_rows"], summary["skipped_rows"]) == (4, 1), r.stderr
    assert summary["rows"] == len(exported) - 1
    reports = [
        line for line in r.stderr.splitlines() if " changed: " in line or " skipped: " in line
    ]
    assert len(reports) == 5, r.stderr
    assert sum("changed: NUL replaced by U+FFFD in group_id" in line for line in reports) == 2
    assert any('step "one") skipped: the database refused it' in line for line in reports)
    db = connect(pg_url)
    try:
        stored = db.rows("SELECT group_id, response FROM session_steps WHERE job_id = 'again'")
    finally:
        db.close()
    assert len(stored) == summary["rows"]
    assert ("g-nul\ufffdid",) in {(g,) for g, _ in stored}
    assert "an\ufffdswer" in {resp for _, resp in stored}


def test_a_group_dropped_as_too_large_is_exported_without_holding_it_whole(
    db_url, harness_factory, tmp_path
):
    """Proved: the export read a dropped group's rows all at once, so a group dropped as
    group_too_large (as large as its launcher made it) was held whole, more than once. Its record
    is streamed now: the same bytes, in the memory of a few rows."""
    row_text = 2 * 1024 * 1024
    h = harness_factory(db_url, max_group_bytes=1024 * 1024)
    h.start(k=2, job=JOB)
    writer = Writer(db_url, job=JOB)
    try:
        for sid in ("huge-a", "huge-b"):
            for step in range(1, 5):  # 8 rows of 2 MB: 16 MB of text
                writer.step("huge", sid, step, completed=step == 4, response="x" * row_text)
    finally:
        writer.close()
    assert not h.poll()["success"]
    h.settle()
    assert h.stats()["groups"]["dropped"] == {"group_too_large": 1}
    source = connect(db_url, readonly=True)
    out = tmp_path / "huge.jsonl"
    tracemalloc.start()
    try:
        export_mod.export(source, source, JOB, str(out))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        source.close()
    [record] = export_mod.read_export(str(out))
    steps = [st for se in record["sessions"] for st in se["steps"]]
    assert (record["reason"], len(steps)) == ("group_too_large", 8)
    assert all(len(st["response"]) == row_text for st in steps)
    assert peak < 6 * row_text, f"the export held {peak / 1e6:.0f} MB for 2 MB rows"
