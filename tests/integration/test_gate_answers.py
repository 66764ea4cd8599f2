"""The weight version the pacing gate reads on the answers it relays (issue 34, item 4: never
over-admit because of a value the proxy sends), through a real gate socket and a real HTTP server
standing in for the LLM proxy."""

from __future__ import annotations

import concurrent.futures
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from fakes.fake_llm import FakeLLM
from gatelib import admission, call, gated, schedule
from support import Writer, wait_until


@pytest.fixture
def pool() -> Any:
    executor = concurrent.futures.ThreadPoolExecutor(4)
    yield executor
    executor.shutdown(wait=False, cancel_futures=True)


def ended(h: Any) -> bool:
    return bool(admission(h)["gate"]["connections"] == 0)


def rows_at_version_0(
    h: Any, w: Writer, job: str, served: list[str], running: str, suffix: str = "a"
) -> None:
    """The job's groups ``served`` complete at version 0 and are served (the accumulator then
    knows the current version, and vouches for rows' versions); ``running`` writes a row of 0."""
    for group in served:
        w.step(
            group, f"{group}-{suffix}", 1, completed=True, env_state={"weight_version": 0}, job=job
        )
    assert len(h.poll()["data"]["data"]) == len(served)
    w.step(running, f"{running}-{suffix}", 1, env_state={"weight_version": 0}, job=job)
    h.settle()
    wait_until(lambda: admission(h)["trainer"]["versions"] == {"rows": 0}, 5, "rows")


def test_answers_versions_never_climb_past_s_plus_1_above_the_rows(
    harness_factory: Any, lite_url: str
) -> None:
    """A proxy that stamps a version climbing by S + 1 at each call (a counter of its own, say)
    must not ratchet the trainer's steps: each answer is bounded by the newest version a row
    showed, not by the newest an earlier answer claimed. Else the steps grow without end and the
    trainer's holds read 0 whatever it takes: the budget over-admits past (S + 1) x B."""
    with FakeLLM(version=0) as llm:
        h, port = gated(harness_factory, lite_url, llm, pacing_staleness=1, pacing_batch_groups=2)
        w = Writer(lite_url)
        try:
            for group in ("g1", "g2", "g3"):
                schedule(w, group, [f"{group}-a"])
            h.start(k=1)
            rows_at_version_0(h, w, "job1", ["g1", "g2"], "g3")
            for version in (2, 4, 6, 8):  # each within S + 1 of the one before
                llm.version = version
                assert call(port, "g3-a").status_code == 200
                wait_until(lambda: ended(h), 5, "the call ended at the gate")
            doc = admission(h)
            assert doc["trainer"]["versions"] == {"rows": 2}, doc  # rows show 0; S + 1 is 2
            assert doc["trainer"]["steps"] == 2, doc
        finally:
            w.close()


def test_an_answer_of_the_previous_jobs_call_moves_nothing_in_the_next_job(
    harness_factory: Any, lite_url: str, pool: Any
) -> None:
    """Group ids are not unique across jobs. A call of job1's group g1, answered after the switch
    to job2 (which has a group g1 too), carries job1's version: it is not job2's trainer's step."""
    with FakeLLM(version=0, delay_s=2.0) as llm:
        h, port = gated(harness_factory, lite_url, llm, pacing_staleness=1, pacing_batch_groups=2)
        w = Writer(lite_url)
        try:
            schedule(w, "g1", ["g1-a"])
            h.start(k=1)
            h.settle()
            llm.version = 1  # job1's trainer is a step ahead
            old = pool.submit(call, port, "g1-a")
            wait_until(lambda: admission(h)["gate"]["connections"] == 1, 5, "a1 in flight")
            for group in ("g1", "g2", "g3"):  # job2's groups: g1 again (its own session)
                schedule(w, group, [f"{group}-b"], job="job2")
            h.start(k=1, job="job2")
            rows_at_version_0(h, w, "job2", ["g2", "g3"], "g1", suffix="b")
            assert old.result(timeout=10).json()["metadata"]["weight_version"] == 1
            wait_until(lambda: ended(h), 5, "the call ended at the gate")
            doc = admission(h)
            assert doc["job_session"] == "job2"
            assert doc["trainer"]["versions"] == {"rows": 0}, doc
            assert doc["trainer"]["steps"] is None, doc  # (one version: no step shows yet)
        finally:
            w.close()


class NestedProxy:
    """A proxy whose 200 answer names weight_version, then nests 50,000 arrays deep (under
    ANSWER_KEPT_BYTES): Python's JSON parser raises RecursionError on it, not ValueError."""

    BODY = b'{"metadata": {"weight_version": 1}, "x": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"

    def __enter__(self) -> NestedProxy:
        body = self.BODY

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_an_answer_nested_too_deep_to_parse_is_relayed_and_counted_as_forwarded(
    harness_factory: Any, lite_url: str
) -> None:
    """The proxy answered: its client gets the whole answer, and /admission counts it forwarded,
    not as the proxy's failure (the version it carries is simply not read)."""
    with NestedProxy() as proxy:
        h, port = gated(harness_factory, lite_url, proxy)  # type: ignore[arg-type]
        w = Writer(lite_url)
        try:
            schedule(w, "g1", ["g1-a"])
            h.start(k=1)
            h.settle()
            r = call(port, "g1-a")
            assert r.status_code == 200 and r.content == NestedProxy.BODY
            wait_until(lambda: ended(h), 5, "the call ended at the gate")
            gate = admission(h)["gate"]
            assert (gate["forwarded"], gate["upstream_errors"]) == (1, 0), gate
        finally:
            w.close()
