"""What the demo prints (issue 39): its progress line, its notices and its summary. The demo end to
end, with a real server and launcher, is tests/system/test_demo.py."""

from __future__ import annotations

import io
from typing import Any

from rollout_buffer.tools.demo import RATE_AFTER_S, launcher_notice, progress_line
from rollout_buffer.tools.demo_summary import Checker, explain_counts, summarize
from rollout_buffer.tools.progress import Progress

STATS = {"groups": {"pending": 6, "dropped_total": 1}, "rows": {"read": 30}}


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def checker_with(groups: int, k: int) -> Checker:
    checker = Checker(k)
    for g in range(groups):
        items = [{"reward": 0.5, "extra_info": {"session_id": f"g{g}-s{s}"}} for s in range(k)]
        checker.add(f"g{g}", items)
    return checker


def test_the_first_progress_line_shows_no_rate_until_a_second_has_passed():
    """The first line said 15000000 rows/s: a rate over a near-zero interval."""
    first = progress_line(0.004, checker_with(0, 4), STATS)
    assert "rows/s" not in first
    assert "0.0 s" in first and "6 pending" in first
    assert "rows/s" not in progress_line(RATE_AFTER_S - 0.01, checker_with(0, 4), STATS)
    # from the job's start: 30 rows in 2 s
    assert progress_line(2.0, checker_with(1, 4), STATS).endswith(" 15 rows/s")


def test_every_count_of_the_progress_line_has_its_unit():
    line = progress_line(3.0, checker_with(2, 4), STATS)
    assert "groups:   2 served,   6 pending,   1 dropped" in line
    assert "items     8" in line


def test_a_notice_starts_on_a_line_of_its_own_and_the_progress_line_comes_back():
    """On a terminal the launcher's notice was glued to the progress line ("dropped 3the ...")."""
    out = Terminal()
    progress = Progress(out)
    progress.show("  2.0 s  groups: 1 served")
    progress.note("  the notice")
    text = out.getvalue()
    # the notice takes the live line's place (\r), padded over it, and ends its line
    before, notice_line, after = text.split("\r")[1:]
    assert notice_line.endswith("\n") and notice_line.strip() == "the notice"
    assert len(notice_line) - 1 >= len(before)  # nothing of the old line left showing
    assert after == before == "  2.0 s  groups: 1 served"  # drawn again below it
    plain = io.StringIO()
    Progress(plain).note("  the notice")
    assert plain.getvalue() == "  the notice\n"


def test_the_launcher_notice_speaks_the_demo_language():
    done = launcher_notice({"exit_code": 0, "log_path": "/tmp/x/launcher.log"}, kept=False)
    failed = launcher_notice({"exit_code": 3, "log_path": "/tmp/x/launcher.log"}, kept=False)
    for text in (done, failed):
        for words in ("/start_rollout", "on the server", "/tmp/x"):
            assert words not in text, (words, text)
    assert "played every session" in done
    assert "exit code 3" in failed and "--workdir" in failed
    kept = launcher_notice({"exit_code": 3, "log_path": "/w/logs/launcher.log"}, kept=True)
    assert "/w/logs/launcher.log" in kept


def summary(paths: dict[str, str], **kw: Any) -> str:
    out = io.StringIO()
    stats = {
        "groups": {"served": 2, "dropped_total": 0},
        "rows": {"read": 8, "served": 8},
        "accounting_balanced": True,
        "launcher": {},
    }
    code = summarize(
        out,
        checker_with(2, 4),
        stats,
        wall=5.0,
        job_time=3.2,
        paths=paths,
        timed_out=False,
        timeout=300,
        **kw,
    )
    assert code == 0
    return out.getvalue()


def test_the_summary_names_a_path_only_when_it_is_kept():
    removed = summary({})
    assert "/" not in removed.replace("(steps)", "")
    assert "database" not in removed
    kept = summary({"database": "/w/demo.db", "logs": "/w/logs"})
    assert "/w/demo.db" in kept and "/w/logs" in kept


def test_the_summary_times_agree_with_the_last_progress_line():
    """The last line said 8.7 s and the summary 12.1 s, with no word on the difference."""
    assert "5.0 s, of which 3.2 s from the job's start to its last group" in summary({})


def test_with_the_policies_each_count_that_differs_is_explained():
    """Over-sampling plays K+1 sessions a group and serves K; a policy drops complete groups."""
    checker = checker_with(19, 4)
    sim = {"k": 5, "groups": 24, "sessions": 120, "complete_groups": 20}
    groups = {"dropped": {"launcher_exited": 1, "stale": 2, "zero_variance": 2}, "dropped_total": 5}
    rows = {"dropped": {"oversampled": 18}}
    lines = explain_counts(checker, groups, rows, sim)
    assert len(lines) == 3, lines
    sessions, complete, oversampled = lines
    assert "24 groups x 5 = 120" in sessions and "19 groups x 4 = 76" in sessions
    assert "over-sampling plays 5 sessions a group and serves the first 4" in sessions
    assert "20 complete groups" in complete and "2 stale, 2 zero_variance" in complete
    assert "19 served" in complete
    assert oversampled.startswith("oversampled 18 rows")
    # nothing differs: nothing to explain
    same = {"k": 4, "groups": 19, "sessions": 76, "complete_groups": 19}
    assert explain_counts(checker, {"dropped_total": 0}, {}, same) == []


def test_with_salvage_a_drop_of_a_group_salvage_could_keep_fails_the_checks(tmp_path):
    """Salvage on: the trainer gets the complete groups and those salvage kept; a drop is right
    only for a group with a session that wrote no row (the simulator counts those)."""
    checker = checker_with(7, 3)
    log = tmp_path / "launcher.log"
    log.write_text('SIMULATE {"complete_groups": 4, "groups_with_silent_session": 1}\n')
    salvaged = {
        "groups": {"step_cap": 2, "launcher_exited": 1},
        "sessions": {"step_cap": 2, "launcher_exited": 1},
        "generation_seconds_kept": 4.25,
    }
    stats = {
        "groups": {"served": 7, "dropped": {"launcher_exited": 1}, "dropped_total": 1},
        "rows": {"read": 21, "served": 21},
        "accounting_balanced": True,
        "salvaged": salvaged,
        "launcher": {"log_path": str(log)},
    }

    def run(stats: dict[str, Any]) -> tuple[int, str]:
        out = io.StringIO()
        code = summarize(
            out,
            checker,
            stats,
            wall=1.0,
            job_time=1.0,
            paths={},
            timed_out=False,
            timeout=9.0,
            salvage=True,
        )
        return code, out.getvalue()

    code, text = run(stats)
    assert code == 0, text
    assert "kept 3 groups (launcher_exited 1, step_cap 2) with 3 truncated sessions" in text
    assert "4.2 s of generation" in text
    assert "failed before writing any row" in text
    wrong = {**stats, "groups": {**stats["groups"], "dropped_total": 2}}
    code, text = run(wrong)
    assert code == 1 and "only the 1 with a session that wrote no row" in text
