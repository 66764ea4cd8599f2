#!/usr/bin/env python3
"""A poll's latency while one 20,000-row batch is ingested, peers side by side (issue 36).

Each peer starts (through the peer interface of ../shared/bench) on a job with one group that never
completes. A trainer then polls ``{"max_groups": 1}`` over one kept-alive connection, in a tight
loop, while gen_rows.py appends 5,000 complete groups of K=4 one-step sessions (20,000 rows) in ONE
transaction: the peer's next read takes the whole batch (ROLLOUT_BUFFER_INGEST_BATCH is 20,000).
The figures are over every poll in the ``--window`` seconds after the append's commit, which holds
the read and the ingest of the batch: p50, p99 and the slowest poll, and the groups served in it.
A poll that waits behind the whole batch shows as the slowest poll.

    tests/bench/ingest_poll.py --peers "base=/work/base/.venv/bin/python \
        /work/base/tests/bench/peer.py,new"

A peer is ``new`` (tests/bench/peer.py on this interpreter) or NAME=COMMAND. Stdlib only.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
BENCH = os.environ.get("BENCH_DIR", os.path.join(os.path.dirname(ROOT), "shared", "bench"))
K = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(values: list[float], p: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, round(p / 100 * (len(v) - 1)))]


def gen_command(db: str, *extra: str) -> list[str]:
    """gen_rows.py writing this bench's rows: K=4 sessions of one step, 256 bytes."""
    cmd = [sys.executable, os.path.join(BENCH, "gen_rows.py"), "--db", db, "--job", "ING"]
    return [*cmd, "--k", str(K), "--steps", "1", "--prompt-bytes", "256", "--quiet", *extra]


def measure(name: str, command: list[str], args: argparse.Namespace, workdir: str) -> dict:
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    db = os.path.join(workdir, "ingest.db")
    first = gen_command(db, "--groups", "1", "--incomplete-frac", "1.0", "--force")
    subprocess.run(first, check=True, capture_output=True)
    start = ["start", "--port", str(free_port()), "--db", db, "--job", "ING", "--k", str(K)]
    out = subprocess.run(
        [*command, *start, "--workdir", os.path.join(workdir, "peer")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if out.returncode != 0:
        raise SystemExit(f"{name} did not start:\n{out.stdout}\n{out.stderr}")
    info = dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)
    host, port = info["URL"].rsplit("//", 1)[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)

    def poll() -> tuple[float, int]:
        t0 = time.perf_counter()
        conn.request(
            "POST",
            "/get_rollout_data",
            body=json.dumps({"max_groups": 1}).encode(),
            headers={"Content-Type": "application/json"},
        )
        doc = json.loads(conn.getresponse().read())
        groups = doc["data"]["meta_info"].get("finished_groups") or [] if doc["success"] else []
        return time.perf_counter() - t0, len(groups)

    try:
        for _ in range(20):  # warm: the connection, the worker, the empty path
            poll()
        batch = ["--append", "--groups", str(args.groups), "--batch", str(args.groups * K)]
        writer = subprocess.Popen(gen_command(db, *batch), stdout=subprocess.DEVNULL)
        while writer.poll() is None:  # polls before the commit see nothing new: not counted
            poll()
        started, served, seconds = time.perf_counter(), 0, []
        while time.perf_counter() - started < args.window:
            s, n = poll()
            seconds.append(s * 1000)
            served += n
    finally:
        conn.close()
        subprocess.run([*command, "stop", info["PID"]], capture_output=True, timeout=120)
    if not served:
        raise SystemExit(f"{name}: no group served in the {args.window} s after the commit")
    return {
        "peer": name,
        "polls": len(seconds),
        "p50_ms": pct(seconds, 50),
        "p99_ms": pct(seconds, 99),
        "max_ms": max(seconds),
        "served": served,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--groups", type=int, default=5000, help="groups of K=4 rows in the batch")
    p.add_argument("--peers", default="new", help="new, or NAME=COMMAND, comma-separated")
    p.add_argument("--repeat", type=int, default=3, help="runs per peer, peers alternating")
    p.add_argument("--window", type=float, default=2.0, help="seconds of polls after the commit")
    p.add_argument("--workdir", default="/tmp/ingest-poll")
    args = p.parse_args(argv)
    peers = {"new": [sys.executable, os.path.join(HERE, "peer.py")]}
    for spec in args.peers.split(","):
        if "=" in spec:
            name, command = spec.split("=", 1)
            peers[name] = shlex.split(command)
    names = [spec.split("=")[0] for spec in args.peers.split(",")]
    rows = [
        measure(name, peers[name], args, os.path.join(args.workdir, name))
        for _ in range(args.repeat)
        for name in names
    ]
    print("| peer | polls | poll p50 | p99 | slowest | groups served |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['peer']} | {r['polls']} | {r['p50_ms']:.2f} ms | {r['p99_ms']:.2f} ms | "
            f"{r['max_ms']:.1f} ms | {r['served']} |"
        )
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
