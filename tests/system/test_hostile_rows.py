"""Hostile rows against a real gunicorn (issue 20, item 7): a group_id with newlines and terminal
escapes never forges a line of the service's log, in its file or on its console."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests
from servers import Server
from support import Writer, wait_until

pytestmark = pytest.mark.slow

FORGED_LINE = "2026-12-04 12:00:00,000 [ERROR] rollout_buffer.lease: FORGED"
FORGED_GROUP = f"g\n{FORGED_LINE}\r\x1b[2K"


def test_a_group_id_with_newlines_never_forges_a_log_line(db_url, tmp_path):
    srv = Server(
        db_url, tmp_path / "srv", env={"AIEVOBOX_BUFFER_INCOMPLETE_GROUP_TTL_SECONDS": "0.5"}
    )
    writer = Writer(db_url, job="J")
    try:
        srv.start()
        r = requests.post(
            srv.url + "/start_rollout", json={"num_repeat_per_sample": 2, "job_session": "J"}
        )
        assert r.status_code == 200, r.text
        writer.step(FORGED_GROUP, "s-1", 1)  # an incomplete group: dropped at the TTL, and logged

        def dropped() -> bool:
            stats = requests.get(srv.url + "/stats", timeout=10).json()
            return stats["groups"]["dropped"].get("incomplete_group_ttl") == 1

        wait_until(dropped, 15, "the TTL drop")
        log_file = Path(tmp_path / "srv" / "logs" / "rollout_buffer.log")
        wait_until(lambda: "dropped group g" in log_file.read_text(), 10, "the drop in the log")
    finally:
        srv.stop()
        writer.close()
    for text in (log_file.read_text(), srv.log()):
        assert "\\n" + FORGED_LINE + "\\r\\x1b[2K" in text  # the drop was logged, escaped
        assert not any(line.startswith(FORGED_LINE) for line in text.splitlines())
        assert "\x1b" not in text
