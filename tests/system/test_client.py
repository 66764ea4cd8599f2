"""rollout_buffer.client.BufferClient against a real gunicorn server (and a tiny scripted HTTP
server).

The real server runs with ``ROLLOUT_BUFFER_LAUNCHER=none`` on a SQLite file that the simulated
launcher filled beforehand (every group complete), so the set of groups to expect is known.
The scripted server (stdlib ``http.server``) is used only where a server must misbehave on cue:
a 503 on the first attempt, an always-empty answer, a duplicated group.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import requests
from servers import ROOT, serve
from support import Writer, make_launcher_db, wait_until

from rollout_buffer.client import BufferClient, BufferError, BufferUnavailable
from rollout_buffer.storage.db import connect
from rollout_buffer.tools.stats_table import format_stats

JOB = "client-job"
K = 4


def simulate(db_url: str, groups: int, k: int = K, job: str = JOB) -> dict[str, Any]:
    """Fill the database with ``groups`` complete groups of ``k`` sessions (the simulated
    launcher)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollout_buffer.simulate",
            "--db-path",
            db_url,
            "--job-id",
            job,
            "--groups",
            str(groups),
            "--rl-group-size",
            str(k),
            "--pace",
            "0",
            "--fail-rate",
            "0",
            "--cap-rate",
            "0",
            "--quiet",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1].split(" ", 1)[1])
    assert summary["complete_groups"] == groups, summary
    return summary


def group_ids(db_url: str, job: str = JOB) -> set[str]:
    """Every group id the launcher wrote for the job."""
    db = connect(db_url)
    try:
        return {
            r[0]
            for r in db.rows("SELECT DISTINCT group_id FROM session_steps WHERE job_id = ?", (job,))
        }
    finally:
        db.close()


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    return "sqlite://" + str(tmp_path / "launcher.db")


def check_group(gid: str, items: list[dict[str, Any]], k: int = K) -> None:
    assert items and all(it["instance_id"] == gid for it in items)
    sessions = {it["extra_info"]["session_id"] for it in items}
    assert len(sessions) == k
    for it in items:
        assert {"uid", "instance_id", "messages", "reward", "extra_info"} <= it.keys()


# -- against a real gunicorn
# --------------------------------------------------------------------------
def test_iter_groups_returns_every_group_exactly_once(db_url: str, tmp_path: Path) -> None:
    simulate(db_url, 10)
    expected = group_ids(db_url)
    with serve(db_url, tmp_path) as srv, BufferClient(srv.url, backoff_s=0.1) as client:
        started = client.start_rollout(num_repeat_per_sample=K, job_session=JOB)
        assert started["job_session"] == JOB
        got = list(client.iter_groups(10, poll_interval=0.1, timeout=60))
        ids = [gid for gid, _ in got]
        assert len(ids) == len(set(ids)) == 10
        assert set(ids) == expected
        for gid, items in got:
            check_group(gid, items)
        # nothing is left, and asking again does not re-serve anything
        doc = client.get_rollout_data()
        assert doc["success"] is False and doc["message"] == "No data available to read"
        stats = client.stats()
        assert stats["groups"]["served"] == 10 and stats["accounting_balanced"] is True
        table = format_stats(stats)
        for label in (
            "job",
            JOB,
            "read",
            "served",
            "dropped",
            "pending",
            "cursor",
            "launcher",
            "accounting balanced",
        ):
            assert label in table, table
        cli = subprocess.run(
            [sys.executable, "-m", "rollout_buffer", "stats", srv.url],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert cli.returncode == 0, cli.stderr
        assert JOB in cli.stdout and "accounting balanced" in cli.stdout


def test_get_rollout_data_with_max_groups(db_url: str, tmp_path: Path) -> None:
    simulate(db_url, 8)
    expected = group_ids(db_url)
    with serve(db_url, tmp_path) as srv, BufferClient(srv.url, backoff_s=0.1) as client:
        client.start_rollout(num_repeat_per_sample=K, job_session=JOB)
        wait_until(
            lambda: client.stats()["groups"]["ready"] == 8,
            30,
            "the service has ingested the 8 groups",
        )
        doc = client.get_rollout_data(max_groups=3)
        assert doc["success"] is True
        first = {it["instance_id"] for it in doc["data"]["data"]}
        assert len(first) == 3
        assert doc["data"]["meta_info"]["finished_groups"] == sorted(first)
        rest = [
            gid for gid, _ in client.iter_groups(5, max_groups=2, poll_interval=0.1, timeout=30)
        ]
        assert len(rest) == 5 and not first & set(rest)
        assert first | set(rest) == expected


def test_the_client_sends_the_trainer_version_and_the_staleness_bound(
    db_url: str, tmp_path: Path
) -> None:
    make_launcher_db(db_url)
    w = Writer(db_url, job=JOB)
    w.group("v7", K, env_state={"weight_version": 7})  # ready first: the poll meets it first
    w.group("v9", K, env_state={"weight_version": 9})
    w.close()
    with serve(db_url, tmp_path) as srv, BufferClient(srv.url, backoff_s=0.1) as client:
        client.start_rollout(num_repeat_per_sample=K, job_session=JOB)
        deadline = time.monotonic() + 30
        while client.stats().get("groups", {}).get("ready") != 2:
            assert time.monotonic() < deadline, "the two groups never became ready"
            time.sleep(0.05)
        asked = []
        got = [
            gid
            for gid, _ in client.iter_groups(
                1,
                current_weight_version=lambda: asked.append(1) or 10,
                max_off_policy=1,
                poll_interval=0.1,
                timeout=30,
            )
        ]
        assert got == ["v9"] and asked  # 10 - 7 > 1: v7 is dropped as stale, never sent
        stats = client.stats()
        assert stats["versions"]["trainer"] == 10 and stats["groups"]["dropped"] == {"stale": 1}
        table = format_stats(stats)
        assert "weight version" in table and "stale" in table


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["term", "kill"])
def test_retries_survive_a_server_restart_mid_iteration(
    db_url: str, tmp_path: Path, sig: int, caplog: pytest.LogCaptureFixture
) -> None:
    simulate(db_url, 12)
    expected = group_ids(db_url)
    with serve(db_url, tmp_path) as srv:
        client = BufferClient(srv.url, retries=30, backoff_s=0.1, backoff_max_s=0.5, timeout=30)
        client.start_rollout(num_repeat_per_sample=K, job_session=JOB)
        down = threading.Event()
        errors: list[BaseException] = []

        def restart() -> None:
            try:
                srv.stop(sig)
                down.set()
                time.sleep(1.0)  # the client polls a dead port meanwhile
                srv.start()
            except BaseException as exc:
                errors.append(exc)
                down.set()

        thread = threading.Thread(target=restart, name="restart-server")
        got: list[str] = []
        try:
            for gid, items in client.iter_groups(12, max_groups=1, poll_interval=0.1, timeout=90):
                check_group(gid, items)
                got.append(gid)
                if len(got) == 3:
                    thread.start()
                    assert down.wait(30), "the server did not stop"
        finally:
            if thread.ident is not None:  # started
                thread.join(60)
            client.close()
        assert not errors, errors
        assert srv.starts == 2
        assert any(
            "retry" in r.getMessage() for r in caplog.records if r.name == "rollout_buffer.client"
        ), "the client never had to retry: the restart did not happen mid-iteration"
        assert len(got) == len(set(got)) == 12, got
        assert set(got) == expected
        with BufferClient(srv.url) as c2:
            stats = c2.stats()
            assert stats["groups"]["served"] == 12 and stats["accounting_balanced"] is True
            assert c2.get_rollout_data()["success"] is False
        assert "resumed job" in srv.log()


def test_4xx_raises_buffer_error_with_the_server_message(db_url: str, tmp_path: Path) -> None:
    with serve(db_url, tmp_path) as srv, BufferClient(srv.url, backoff_s=0.01) as client:
        client.start_rollout(num_repeat_per_sample=K, job_session=JOB)
        with pytest.raises(BufferError) as info:
            client.get_rollout_data(max_groups="x")  # type: ignore[arg-type]
        assert info.value.status == 400
        assert "max_groups" in str(info.value) and "expected" in str(info.value)
        assert isinstance(info.value, BufferError) and not isinstance(info.value, BufferUnavailable)
        with pytest.raises(BufferError) as info:
            client.start_rollout(num_repeat_per_sample=0)
        assert info.value.status == 400 and "num_repeat_per_sample" in str(info.value)


def test_auth_with_a_token(db_url: str, tmp_path: Path) -> None:
    simulate(db_url, 2)
    with serve(db_url, tmp_path, env={"ROLLOUT_BUFFER_TOKEN": "s3cret-token"}) as srv:
        r = requests.get(srv.url + "/health", timeout=10)
        assert r.status_code == 200 and r.json()["status"] == "healthy"
        for token in (None, "wrong-token"):
            with BufferClient(srv.url, token=token, backoff_s=0.01) as bad:
                with pytest.raises(BufferError) as info:
                    bad.stats()
                assert info.value.status == 401
                assert "token" in str(info.value)
                with pytest.raises(BufferError) as info:
                    bad.get_rollout_data()
                assert info.value.status == 401
        with BufferClient(srv.url, token="s3cret-token") as good:
            assert good.health()["status"] == "healthy"
            good.start_rollout(num_repeat_per_sample=K, job_session=JOB)
            got = list(good.iter_groups(2, poll_interval=0.1, timeout=30))
            assert len(got) == 2
            assert good.stats()["groups"]["served"] == 2


# -- against a scripted server
# ---------------------------------------------------------------------------
class Scripted:
    """A stdlib HTTP server: answers POSTs from a script of (status, body, headers), records request
    bodies."""

    def __init__(
        self,
        script: list[tuple[int, Any, dict[str, str]]],
        default: tuple[int, Any, dict[str, str]],
    ):
        self.script = list(script)
        self.default = default
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                outer.bodies.append(json.loads(raw or b"{}"))
                outer.headers.append(dict(self.headers))
                status, body, headers = outer.script.pop(0) if outer.script else outer.default
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}
        )

    def __enter__(self) -> Scripted:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


EMPTY = (
    200,
    {
        "success": False,
        "message": "No data available to read",
        "data": {"data": [], "meta_info": {"total_samples": 0}},
    },
    {},
)
UNAVAILABLE = (
    503,
    {
        "ok": False,
        "error": "the database is unreachable: locked",
        "status": 503,
        "success": False,
        "message": "the database is unreachable: locked",
    },
    {"Retry-After": "0"},
)


def batch(*groups: str) -> tuple[int, Any, dict[str, str]]:
    items = [
        {
            "uid": f"{g}-{i}",
            "instance_id": g,
            "messages": [],
            "reward": 1.0,
            "extra_info": {"session_id": f"{g}-s{i}", "group_id": g},
        }
        for g in groups
        for i in range(2)
    ]
    return (
        200,
        {
            "success": True,
            "message": f"Successfully read {len(items)} items",
            "data": {"data": items, "meta_info": {"total_samples": len(items)}},
        },
        {},
    )


def test_request_id_is_reused_across_retries_and_fresh_per_call() -> None:
    with (
        Scripted([UNAVAILABLE, batch("g1")], EMPTY) as srv,
        BufferClient(srv.url, backoff_s=0.01) as client,
    ):
        doc = client.get_rollout_data(max_groups=1)
        assert doc["success"] is True
        assert len(srv.bodies) == 2
        first, retry = srv.bodies
        assert first["request_id"] == retry["request_id"]
        assert len(first["request_id"]) == 32 and int(first["request_id"], 16) >= 0  # a uuid4 hex
        assert first["max_groups"] == retry["max_groups"] == 1
        client.get_rollout_data()
        client.get_rollout_data()
        ids = [b["request_id"] for b in srv.bodies[1:]]
        assert len(set(ids)) == 3, ids  # each logical call has its own id
        client.get_rollout_data(request_id="mine-1")
        assert srv.bodies[-1]["request_id"] == "mine-1"


def test_no_request_id_for_the_original_server() -> None:
    with (
        Scripted([UNAVAILABLE, batch("g1")], EMPTY) as srv,
        BufferClient(srv.url, backoff_s=0.01, use_request_id=False) as client,
    ):
        assert client.get_rollout_data()["success"] is True
        assert srv.bodies == [{}, {}]
        srv.script.append(batch("g2"))
        got = list(client.iter_groups(1, poll_interval=0.01, timeout=5))
        assert [g for g, _ in got] == ["g2"]
        assert all("request_id" not in b for b in srv.bodies)


def test_retries_exhausted_raise_buffer_unavailable() -> None:
    with (
        Scripted([], UNAVAILABLE) as srv,
        BufferClient(srv.url, retries=2, backoff_s=0.01) as client,
    ):
        with pytest.raises(BufferUnavailable) as info:
            client.get_rollout_data()
        assert info.value.status == 503 and "database is unreachable" in str(info.value)
        assert len(srv.bodies) == 3 and len({b["request_id"] for b in srv.bodies}) == 1


def test_retry_after_is_honoured_and_capped() -> None:
    slow = (503, {"error": "busy"}, {"Retry-After": "3600"})
    with (
        Scripted([slow], EMPTY) as srv,
        BufferClient(srv.url, backoff_s=0.01, backoff_max_s=0.3) as client,
    ):
        t0 = time.monotonic()
        client.get_rollout_data()
        waited = time.monotonic() - t0
        assert 0.25 <= waited < 5, waited


def test_connection_refused_is_retried_then_unavailable() -> None:
    from tests.servers import free_port

    with (
        BufferClient(f"http://127.0.0.1:{free_port()}", retries=2, backoff_s=0.01) as client,
        pytest.raises(BufferUnavailable),
    ):
        client.get_rollout_data()


def test_iter_groups_skips_duplicates_and_times_out() -> None:
    with (
        Scripted([batch("a", "b"), EMPTY, batch("b", "c")], EMPTY) as srv,
        BufferClient(srv.url, backoff_s=0.01) as client,
    ):
        got = []
        with pytest.raises(TimeoutError):
            for gid, items in client.iter_groups(4, poll_interval=0.02, timeout=1.0):
                assert len(items) == 2 and all(it["instance_id"] == gid for it in items)
                got.append(gid)
        assert got == ["a", "b", "c"]
        # it never asks for more groups than it still wants
        assert [b.get("max_groups") for b in srv.bodies[:3]] == [4, 2, 2]


def test_iter_groups_stops_after_n() -> None:
    with (
        Scripted([batch("a"), batch("b"), batch("c")], EMPTY) as srv,
        BufferClient(srv.url) as client,
    ):
        assert [g for g, _ in client.iter_groups(2, poll_interval=0.01, timeout=5)] == ["a", "b"]
        assert len(srv.bodies) == 2


def test_bearer_header_is_sent() -> None:
    with Scripted([], EMPTY) as srv, BufferClient(srv.url, token="tok") as client:
        client.get_rollout_data()
        assert srv.headers[0]["Authorization"] == "Bearer tok"


def test_start_rollout_500_is_not_retried_and_unsent_failures_are() -> None:
    spawn_failed = (
        500,
        {"ok": False, "error": "the launcher could not be started: no such file", "status": 500},
        {},
    )
    started = (200, {"message": "Rollout started", "pid": 7, "job_session": "j"}, {})
    with (
        Scripted([spawn_failed, UNAVAILABLE, started], EMPTY) as srv,
        BufferClient(srv.url, backoff_s=0.01) as client,
    ):
        with pytest.raises(BufferError) as info:
            client.start_rollout(num_repeat_per_sample=2)
        assert info.value.status == 500 and "launcher could not be started" in str(info.value)
        assert len(srv.bodies) == 1
        # a 503 did not select a job: retried even without job_session
        assert client.start_rollout(num_repeat_per_sample=2, extra_key="kept")["pid"] == 7
        assert srv.bodies[-1] == {
            "num_repeat_per_sample": 2,
            "restart_training": False,
            "extra_key": "kept",
        }
        assert len(srv.bodies) == 3


# -- failover (issue 12): a standby's 307 and a list of URLs
# ----------------------------------------------
def to_owner(owner: Scripted) -> tuple[int, Any, dict[str, str]]:
    """What a standby answers: 307 to the owner's URL, the path kept."""
    return (
        307,
        {
            "ok": False,
            "error": f"this instance is a standby; the owner is {owner.url}",
            "status": 307,
        },
        {"Location": owner.url + "/get_rollout_data"},
    )


def test_a_standbys_307_is_followed_with_the_same_body_request_id_and_token() -> None:
    with (
        Scripted([batch("g1"), batch("g2")], EMPTY) as owner,
        Scripted([], to_owner(owner)) as standby,
        BufferClient([standby.url, owner.url], token="tok", backoff_s=0.01) as client,
    ):
        doc = client.get_rollout_data(max_groups=3)
        assert doc["success"] is True and len(standby.bodies) == 1 and len(owner.bodies) == 1
        assert owner.bodies[0] == standby.bodies[0]  # the same body, request_id included
        assert owner.headers[0]["Authorization"] == "Bearer tok"  # requests would have dropped it
        assert client.url == owner.url  # the owner goes first from now on
        client.get_rollout_data()
        assert len(standby.bodies) == 1 and len(owner.bodies) == 2


def test_a_url_that_refuses_the_connection_is_left_for_the_next_at_once() -> None:
    from tests.servers import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    with (
        Scripted([batch("g1")], EMPTY) as alive,
        BufferClient([dead, alive.url], retries=0) as client,
    ):
        assert (
            client.get_rollout_data()["success"] is True
        )  # no retry was needed: the next URL, at once
        assert client.url == alive.url and len(alive.bodies) == 1
    with BufferClient(
        f"{dead},{dead}/", retries=1, backoff_s=0.01
    ) as client:  # one string with commas
        assert client.urls == [dead, dead]
        with pytest.raises(BufferUnavailable):
            client.get_rollout_data()


def test_a_redirect_loop_and_a_redirect_to_another_scheme_are_refused() -> None:
    with Scripted([], EMPTY) as srv:
        srv.default = (
            307,
            {},
            {"Location": srv.url + "/get_rollout_data"},
        )  # it names itself, forever
        with (
            BufferClient(srv.url, retries=1, backoff_s=0.01) as client,
            pytest.raises(BufferUnavailable, match="redirected more than"),
        ):
            client.get_rollout_data()
        assert len(srv.bodies) == 2 * 6  # each attempt: the request and 5 redirects
        srv.default = (307, {}, {"Location": "ftp://elsewhere/x"})
        with (
            BufferClient(srv.url, retries=0) as client,
            pytest.raises(BufferError, match="refusing a redirect"),
        ):
            client.get_rollout_data()
