#!/usr/bin/env python3
"""Poll latency with the LLM proxy up, down (closed port) and hung (answers after 30 s).

    python tests/bench/proxy_p99.py [--groups 400] [--polls 300]

For each mode: a job where half the groups have a session that never completes (served groups
then clear that session at the proxy) and the TTL is 1 s (incomplete groups are dropped and
cleared), drained through tests/bench/peer.py (gunicorn) with ../shared/bench/drain.py, while a
second generator appends more such groups during the drain so drops keep happening; then
--polls empty polls. Prints poll p50/p99/max per mode and how many proxy calls were recorded.
The point: a dead or hung proxy must not slow a poll (the notifier has its own thread).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
BENCH = os.environ.get("BENCH_DIR", os.path.join(os.path.dirname(ROOT), "shared", "bench"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gen(db: str, groups: int, append: bool, seed: int) -> dict:
    cmd = [
        sys.executable,
        os.path.join(BENCH, "gen_rows.py"),
        "--db",
        db,
        "--job",
        "J",
        "--groups",
        str(groups),
        "--k",
        "4",
        "--steps",
        "2",
        "--prompt-bytes",
        "1024",
        "--incomplete-frac",
        "0.5",
        "--seed",
        str(seed),
        "--quiet",
        "--append" if append else "--force",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1].split(" ", 1)[1])


def one(mode: str, args: argparse.Namespace, work: str) -> dict:
    db = os.path.join(work, f"{mode}.db")
    first = gen(db, args.groups, False, 1)
    env = [
        "--env",
        "AIEVOBOX_BUFFER_INCOMPLETE_GROUP_TTL_SECONDS=1",
        "--env",
        "ROLLOUT_BUFFER_PROXY_CONNECT_TIMEOUT_SECONDS=2",
        "--env",
        "ROLLOUT_BUFFER_PROXY_READ_TIMEOUT_SECONDS=60",
    ]
    held = None
    if mode == "down":
        env += ["--env", f"LLM_PROXY_PORT={free_port()}"]
    elif mode == "hung":
        port = free_port()
        held = subprocess.Popen(
            [
                sys.executable,
                os.path.join(BENCH, "fake_proxy.py"),
                "--port",
                str(port),
                "--record",
                os.path.join(work, "held.jsonl"),
                "--delay-ms",
                "30000",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        env += ["--env", f"LLM_PROXY_PORT={port}"]
        time.sleep(0.5)
    peer = subprocess.run(
        [
            sys.executable,
            os.path.join(HERE, "peer.py"),
            "start",
            "--port",
            str(args.port),
            "--db",
            db,
            "--job",
            "J",
            "--k",
            "4",
            "--workdir",
            os.path.join(work, f"peer-{mode}"),
            *env,
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    info = dict(line.split("=", 1) for line in peer.stdout.splitlines() if "=" in line)
    out = os.path.join(work, f"{mode}.json")
    try:
        time.sleep(1.5)  # let the TTL expire some groups: drops queue notifications
        more = subprocess.Popen(
            [
                sys.executable,
                os.path.join(BENCH, "gen_rows.py"),
                "--db",
                db,
                "--job",
                "J",
                "--groups",
                str(args.groups),
                "--k",
                "4",
                "--steps",
                "2",
                "--prompt-bytes",
                "1024",
                "--incomplete-frac",
                "0.5",
                "--seed",
                "2",
                "--quiet",
                "--append",
                "--time-offset",
                "0",
            ],
            stdout=subprocess.DEVNULL,
        )
        subprocess.run(
            [
                sys.executable,
                os.path.join(BENCH, "drain.py"),
                "--url",
                info["URL"],
                "--expect-groups",
                str(first["complete_groups"]),
                "--k",
                "4",
                "--idle-polls",
                str(args.polls),
                "--json-out",
                out,
                "--quiet",
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        more.wait(120)
        with open(out) as fh:
            d = json.load(fh)
        stats = json.loads(
            subprocess.run(
                ["curl", "-s", info["URL"] + "/stats"], capture_output=True, text=True
            ).stdout
            or "{}"
        )
    finally:
        subprocess.run(
            [sys.executable, os.path.join(HERE, "peer.py"), "stop", info["PID"]],
            capture_output=True,
        )
        if held is not None:
            held.kill()
    lat = d["poll_latencies_ms"] + d["idle_latencies_ms"]
    lat.sort()
    recorded = 0
    rec = info.get("PROXY_RECORD")
    if mode == "up" and rec and os.path.exists(rec):
        with open(rec) as fh:
            recorded = sum(1 for _ in fh)
    return {
        "mode": mode,
        "polls": len(lat),
        "p50": lat[len(lat) // 2],
        "p99": lat[int(len(lat) * 0.99) - 1],
        "max": lat[-1],
        "violations": d["violation_count"],
        "proxy_calls_recorded": recorded,
        "dropped_groups": (stats.get("groups") or {}).get("dropped_total"),
        "pending_sessions": (stats.get("proxy_notifications") or {}).get("sessions"),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--groups", type=int, default=400)
    p.add_argument("--polls", type=int, default=300)
    p.add_argument("--port", type=int, default=18082)
    args = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="rb-proxy-p99-")
    rows = [one(mode, args, work) for mode in ("up", "down", "hung")]
    print(
        "| proxy | polls | p50 ms | p99 ms | max ms | groups dropped | sessions pending at proxy | "
        "calls recorded | violations |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['polls']} | {r['p50']:.2f} | {r['p99']:.2f} | {r['max']:.2f} | "
            f"{r['dropped_groups']} | {r['pending_sessions']} | "
            f"{r['proxy_calls_recorded'] if r['mode'] == 'up' else '-'} | {r['violations']} |"
        )
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
