"""``rollout-buffer export`` on hostile rows (issue 20, item 7), on SQLite and Postgres: a history
that parses but cannot be written again as JSON (nested about a thousand deep, an escaped lone
surrogate) goes out as its raw text with a note, and every decided group is exported."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from support import groups_of

from rollout_buffer.tools import export as export_mod

ROOT = Path(__file__).resolve().parent.parent.parent
JOB = "hostile-job"
NEARLY_TOO_DEEP = 995  # json.loads takes it; json.dumps inside a record runs out of stack


def export_cli(db_url: str, out: Path) -> subprocess.CompletedProcess:
    argv = ["-m", "rollout_buffer", "export", "--db", db_url, "--job", JOB, "--out", str(out)]
    return subprocess.run(
        [sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


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
