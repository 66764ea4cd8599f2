"""The real stack's failures, said where a trainer looks (issue 22): a launcher that dies after
its start shows in the client's log, through a real gunicorn server."""

from __future__ import annotations

import logging
import shlex
import sys
from pathlib import Path

import pytest
from servers import serve
from support import make_launcher_db, wait_until

from rollout_buffer.client import BufferClient

FAKE_LAUNCHER = Path(__file__).parent.parent / "fakes" / "fake_launcher.py"


def test_the_client_warns_once_when_the_launcher_has_exited(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    db_url = "sqlite://" + str(tmp_path / "launcher.db")
    make_launcher_db(db_url)
    # exits 1 past the 3 s launch grace: /start_rollout said "Rollout started"
    cmd = shlex.join([sys.executable, str(FAKE_LAUNCHER), "--mode", "exit1", "--sleep", "3.5"])
    env = {"ROLLOUT_BUFFER_LAUNCHER_CMD": cmd}
    caplog.set_level(logging.WARNING, logger="rollout_buffer.client")
    with serve(db_url, tmp_path, launcher="auto", env=env) as srv, BufferClient(srv.url) as client:
        assert client.start_rollout(2, job_session="j1")["message"] == "Rollout started"

        def exited() -> bool:
            meta = client.get_rollout_data()["data"]["meta_info"]
            return (meta.get("launcher") or {}).get("state") == "exited"

        assert wait_until(exited, timeout=15)
        for _ in range(3):
            client.get_rollout_data()
    warnings = [r.getMessage() for r in caplog.records if "launcher of job j1" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "exited with code 1" in warnings[0]
