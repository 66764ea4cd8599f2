#!/usr/bin/env python3
"""Poll latency with 500 model calls in flight through the pacing gate (issue 23).

Starts the service under gunicorn with ``ROLLOUT_BUFFER_PACING=gate`` in front of a stand-in LLM
proxy (a real HTTP server) whose answers take --call-s seconds, opens --calls concurrent model calls
through the gate, and measures empty ``/get_rollout_data`` polls (p50 and p99) before and while
they are in flight. The gate is an asyncio server in the service: its calls must not take the
request threads the polls need.

With --held, the calls are first calls of sessions of a job whose budget is spent (S 0, B 1, one
group admitted): the gate holds them and asks for them every 0.25 s and whenever rows arrive.
Both ways it prints the service's CPU over 5 s with no poll, before and with the calls.

    python tests/bench/gate_polls.py                 # 500 calls of 20 s
    python tests/bench/gate_polls.py --held          # 500 first calls held
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from fakes.fake_llm import FakeLLM  # noqa: E402  (a real HTTP server standing in for the proxy)

from rollout_buffer.storage import launcher_sql  # noqa: E402
from rollout_buffer.storage.db import connect  # noqa: E402
from rollout_buffer.storage.launcher_writes import create_tables, insert_sessions  # noqa: E402
from rollout_buffer.tools.runner import ServerProcess, clean_env, free_port  # noqa: E402

K = 4  # sessions a group, with --held
IDLE_S = 5.0  # the service's CPU is measured this long with no poll, before and with the calls


def polls(url: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        started = time.perf_counter()
        req = urllib.request.Request(
            url + "/get_rollout_data", data=b"{}", headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            json.loads(resp.read())
        out.append(time.perf_counter() - started)
    return out


async def one_call(port: int, session: str) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    writer.write(
        f"POST /v1/{session}/chat/completions HTTP/1.1\r\nHost: x\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    await writer.drain()
    await reader.read()
    writer.close()


def in_flight(port: int, calls: int) -> threading.Thread:
    def run() -> None:
        async def all_calls() -> None:
            await asyncio.gather(*(one_call(port, f"s{i}") for i in range(calls)))

        asyncio.run(all_calls())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def schedule(db_url: str, job: str, sessions: int) -> None:
    """The launcher's list of sessions (job_environments), K to a group."""
    db = connect(db_url)
    try:
        create_tables(db, lambda exc: None)
        now = time.strftime("%Y-%m-%d %H:%M:%S+00:00", time.gmtime())
        insert_sessions(
            db,
            [(job, f"s{i}", "env", "{}", None, f"g{i // K}", 0, 0, now) for i in range(sessions)],
        )
    finally:
        db.close()
    assert launcher_sql.ENV_COLUMNS[1] == "env_id"  # (the rows above follow ENV_COLUMNS)


def service_cpu_s(pid: int) -> float:
    """CPU seconds of the service's processes (gunicorn's master and its worker)."""
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(entry) == pid or int(fields[1]) == pid:
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def idle_cpu(pid: int) -> float:
    """The service's CPU over IDLE_S seconds with no poll: a share of a core."""
    cpu, clock = service_cpu_s(pid), time.monotonic()
    time.sleep(IDLE_S)
    return (service_cpu_s(pid) - cpu) / (time.monotonic() - clock)


def summary(name: str, values: list[float]) -> str:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return f"{name}: p50 {statistics.median(ordered) * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--calls", type=int, default=500, help="model calls in flight at once")
    p.add_argument("--call-s", type=float, default=20.0, help="seconds the proxy takes to answer")
    p.add_argument("--polls", type=int, default=300, help="polls measured in each phase")
    p.add_argument("--held", action="store_true", help="first calls held by a spent budget")
    args = p.parse_args()
    workdir = tempfile.mkdtemp(prefix="gate-polls-")
    with FakeLLM(delay_s=args.call_s) as llm:
        port, gate = free_port(), free_port()
        env = clean_env(
            {
                "AIEVOBOX_DB_URL": "sqlite://" + os.path.join(workdir, "launcher.db"),
                "AIEVOBOX_RUN_DIR": os.path.join(workdir, "logs"),
                "ROLLOUT_BUFFER_LAUNCHER": "none",
                "ROLLOUT_BUFFER_PACING": "gate",
                "ROLLOUT_BUFFER_GATE_PORT": str(gate),
                "LLM_PROXY_HOST": "127.0.0.1",
                "LLM_PROXY_PORT": str(llm.port),
                "ROLLOUT_BUFFER_PACING_STALENESS": "0",
                "ROLLOUT_BUFFER_PACING_BATCH_GROUPS": "1",
            },
            package_parent=ROOT,
        )
        server = ServerProcess(port, env, os.path.join(workdir, "server.log"), cwd=workdir)
        server.spawn()
        url = f"http://127.0.0.1:{port}"
        try:
            problem = server.wait_healthy(30)
            if problem:
                raise SystemExit(f"the service did not start: {problem}")
            if args.held:  # one group admitted (its first call), the rest held
                db_url = env["AIEVOBOX_DB_URL"]
                schedule(db_url, "held", args.calls + K)
                body = json.dumps({"num_repeat_per_sample": K, "job_session": "held"}).encode()
                start = urllib.request.Request(
                    url + "/start_rollout", data=body, headers={"Content-Type": "application/json"}
                )
                with urllib.request.urlopen(start, timeout=30) as resp:
                    json.loads(resp.read())
                time.sleep(1.0)  # the service reads job_environments
            pid = server.pid or 0
            idle_before = idle_cpu(pid)
            before = polls(url, args.polls)
            thread = in_flight(gate, args.calls + (K if args.held else 0))
            what = "held_calls" if args.held else "in_flight"
            deadline = time.monotonic() + args.call_s / 2
            while time.monotonic() < deadline:
                with urllib.request.urlopen(url + "/admission", timeout=10) as resp:
                    doc = json.loads(resp.read())
                if doc["gate"].get(what, 0) >= args.calls * 0.95:
                    break
                time.sleep(0.2)
            flying = doc["gate"].get(what, 0)
            idle_during = idle_cpu(pid)
            during = polls(url, args.polls)
            if not args.held:  # (held calls end when the service stops)
                thread.join(args.call_s * 3)
        finally:
            server.stop()
    state = "held" if args.held else "in flight"
    print(f"gate: {flying} model calls {state} while the second phase was measured")
    print(
        f"the service's CPU with no poll, over {IDLE_S:.0f} s: {idle_before:.1%} of a core before, "
        f"{idle_during:.1%} with the calls {state}"
    )
    print(summary("polls before", before))
    print(summary(f"polls with {flying} calls {state}", during))
    print(f"p50 ratio during / before: {statistics.median(during) / statistics.median(before):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
