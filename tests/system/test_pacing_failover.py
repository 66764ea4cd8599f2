"""Failover and restarts carry a paced job (issue 34, item 6), with real gunicorn servers, the
built-in simulator as the launcher making its model calls through the gate (item 9), and a real
HTTP server standing in for the LLM proxy.

- the owner stopped (SIGTERM) or killed (kill -9): the standby on the same host adopts the
  launcher, serves the gate on the port and with the secret in that launcher's --llm-base-url
  (each instance is configured with a port and a secret of its own), and its calls get answers
  within 30 s of the takeover; every complete group is served exactly once; no log shows a
  secret;
- on Postgres, the owner paused (SIGSTOP) past its lease: when it wakes, fenced, it closes its
  gate within 10 s, and the new owner (which retried binding meanwhile) answers within 30 s.
"""

from __future__ import annotations

import collections
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import requests
from fakes.fake_llm import FakeLLM
from servers import Server, complete_groups, free_port, kill9
from support import make_launcher_db, wait_until

from rollout_buffer.client import BufferClient, groups_of

pytestmark = pytest.mark.slow

K = 2
GROUPS = 24
LEASE_S = 3.0


def secret(name: str) -> str:
    return f"secret-of-{name}-0123456789"


def paced(url: str, tmp_path: Path, name: str, llm: FakeLLM, gate_port: int | None) -> Server:
    port = free_port()
    env = {
        "ROLLOUT_BUFFER_ADVERTISE_URL": f"http://127.0.0.1:{port}",
        "ROLLOUT_BUFFER_LEASE_SECONDS": str(LEASE_S),
        "ROLLOUT_BUFFER_NAME": "paced",
        "ROLLOUT_BUFFER_PACING": "gate",
        "ROLLOUT_BUFFER_GATE_PORT": str(gate_port or free_port()),
        "ROLLOUT_BUFFER_GATE_SECRET": secret(name),  # each its own: the launcher keeps a's
        "ROLLOUT_BUFFER_PACING_STALENESS": "1",
        "ROLLOUT_BUFFER_PACING_BATCH_GROUPS": "2",
        "LLM_PROXY_HOST": "127.0.0.1",
        "LLM_PROXY_PORT": str(llm.port),
        "AIEVOBOX_POOL_SIZE": "6",
        "ROLLOUT_BUFFER_SIMULATE_ARGS": f"--groups {GROUPS} --pace 0.2 --fail-rate 0 "
        "--cap-rate 0 --truncate-rate 0 --min-steps 2 --max-steps 4 --flush-interval 0.2 --seed 5",
    }
    return Server(url, tmp_path / name, port=port, launcher="simulate", env=env, name=name)


def get(srv: Server, path: str) -> dict[str, Any]:
    return dict(requests.get(srv.url + path, timeout=10).json())


def role(srv: Server) -> str | None:
    try:
        return get(srv, "/health")["role"]
    except (requests.RequestException, ValueError):
        return None


def listening(srv: Server) -> str | None:
    try:
        return get(srv, "/admission")["gate"]["listening"]
    except (requests.RequestException, ValueError, KeyError):
        return None


class Trainer:
    """Polls every URL on a thread of its own until stopped; counts each group it gets."""

    def __init__(self, urls: list[str]) -> None:
        self.client = BufferClient(urls, retries=60, backoff_s=0.1, backoff_max_s=1.0, timeout=30)
        self.got: collections.Counter[str] = collections.Counter()
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                doc = self.client.get_rollout_data(max_groups=2, wait_s=0.5)
                for gid, _items in groups_of(doc) if doc.get("success") else []:
                    self.got[gid] += 1
        except BaseException as exc:
            self.error = exc

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)
        self.client.close()
        assert self.error is None, f"the trainer failed: {self.error!r}"


def run(pg_url: str, tmp_path: Path, how: str, gate_port: int | None = None) -> None:
    """``gate_port``: both instances configured with that ROLLOUT_BUFFER_GATE_PORT (None: each
    its own)."""
    make_launcher_db(pg_url)
    with FakeLLM(delay_s=0.05) as llm:
        a = paced(pg_url, tmp_path, "a", llm, gate_port)
        b = paced(pg_url, tmp_path, "b", llm, gate_port)
        try:
            a.start()
            wait_until(lambda: role(a) == "owner", 15, "a owns the job")
            b.start()
            wait_until(lambda: role(b) == "standby", 15, "b waits as a standby")
            assert listening(b) is None  # only the owner listens
            gate = listening(a)
            assert gate is not None
            trainer = Trainer([a.url, b.url])
            trainer.client.start_rollout(num_repeat_per_sample=K, job_session="job1")
            wait_until(lambda: get(a, "/admission")["gate"]["held_calls"], 30, "calls held")
            trainer.start()
            took_over = fail_over(a, b, how, gate, llm)
            calls_before = len(llm.calls)
            wait_until(lambda: len(llm.calls) > calls_before, 40, "a model call through b's gate")
            answered_after = llm.calls[calls_before]["answered"] - took_over
            assert answered_after <= 30.0, f"first answer {answered_after:.1f} s after takeover"

            def drained() -> bool:
                return bool(get(b, "/stats")["launcher"].get("finished")) and set(
                    trainer.got
                ) >= set(complete_groups(pg_url, "job1", k=K))

            wait_until(drained, 180, "every complete group served")
            time.sleep(1.0)  # (a group served twice would show by now)
            trainer.stop()
        finally:
            for srv in (a, b):
                if srv.proc is not None:
                    os.killpg(srv.proc.pid, signal.SIGCONT)
                srv.stop()
    assert set(trainer.got) == set(complete_groups(pg_url, "job1", k=K))
    assert set(trainer.got.values()) == {1}, "a group served twice"
    for srv in (a, b):
        log = srv.log_path.read_text()
        assert secret("a") not in log and secret("b") not in log, f"a secret in {srv.name}'s log"


def fail_over(a: Server, b: Server, how: str, gate: str, llm: FakeLLM) -> float:
    """Take the owner down (``how``); when b took over and serves the gate a's launcher calls."""
    if how == "sigstop":
        assert a.proc is not None
        os.killpg(a.proc.pid, signal.SIGSTOP)  # it keeps its socket: nothing answers there
        wait_until(lambda: role(b) == "owner", LEASE_S + 15, "b takes over from the paused a")
        wait_until(lambda: get(b, "/health")["launcher"]["adopted"], 15, "b adopts the launcher")
        wait_until(
            lambda: "in use" in str(get(b, "/admission")["gate"]["bind_error"]),
            10,
            "b retrying to bind the port the paused a holds",
        )
        assert listening(b) is None
        os.killpg(a.proc.pid, signal.SIGCONT)
        woke = time.monotonic()
        wait_until(lambda: listening(b) == gate, 40, "b serves the gate once a closed it")
        closed_after = time.monotonic() - woke
        assert closed_after <= 10.0 + 1.0, f"a closed its gate {closed_after:.1f} s after waking"
        return time.monotonic()
    if how == "sigterm":
        a.stop(signal.SIGTERM)
    else:
        kill9(a)
    wait_until(lambda: role(b) == "owner", 30, "b takes over")
    wait_until(lambda: get(b, "/health")["launcher"]["adopted"], 15, "b adopts the launcher")
    took_over = time.monotonic()
    wait_until(lambda: listening(b) == gate, 10, "b serves the gate on a's launcher's port")
    return took_over


@pytest.mark.parametrize("how", ["sigterm", "kill9"])
def test_a_same_host_standby_serves_the_adopted_launchers_gate(tmp_path, pg_url, how):
    run(pg_url, tmp_path, how)


def test_a_standby_configured_with_the_owners_gate_port_starts_and_serves_it(tmp_path, pg_url):
    """Issue 34: with one fixed ROLLOUT_BUFFER_GATE_PORT on both (an operator's one config), the
    standby did not start at all. It starts (only the owner listens), and serves the gate on that
    port when the owner stops."""
    run(pg_url, tmp_path, "sigterm", gate_port=free_port())


def test_a_paused_owner_closes_its_gate_when_it_wakes_and_the_new_owner_serves_it(tmp_path, pg_url):
    run(pg_url, tmp_path, "sigstop")
