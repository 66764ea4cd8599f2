#!/usr/bin/env python3
"""Empty polls with and without a request_id, with 5,000 pending groups, peers side by side.

BufferClient sends a fresh request_id with every poll, so the idle figure that matters for it is
an empty poll *with* an id (issue 11's idle target: p99 <= 5 ms with a request_id too). This
generates the idle scenario of ../shared/bench (5,000 groups whose sessions never complete, 2 KB
rows) with gen_rows.py, starts each peer on its own copy through the peer interface, waits until
the peer has read the rows (a sentinel group is served), then times N empty polls with a body of
``{}`` and N with ``{"request_id": <fresh uuid4>}``, alternating, over one kept-alive connection.
The original ignores request_id (its figure with an id is the same poll).

    tests/bench/idle_rid.py --polls 500

Stdlib only.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
BENCH = os.environ.get("BENCH_DIR", os.path.join(os.path.dirname(ROOT), "shared", "bench"))
PEERS = {
    "original": [sys.executable, os.path.join(BENCH, "peer_original.py")],
    "new": [sys.executable, os.path.join(HERE, "peer.py")],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(values: list[float], p: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, round(p / 100 * (len(v) - 1)))]


def measure(peer: str, db: str, args: argparse.Namespace, workdir: str) -> dict:
    os.makedirs(workdir, exist_ok=True)
    copy = os.path.join(workdir, "idle.db")
    shutil.copy(db, copy)
    out = subprocess.run(
        PEERS[peer]
        + [
            "start",
            "--port",
            str(free_port()),
            "--db",
            copy,
            "--job",
            "IDLE",
            "--k",
            "8",
            "--workdir",
            os.path.join(workdir, "peer"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if out.returncode != 0:
        raise SystemExit(f"{peer} did not start:\n{out.stdout}\n{out.stderr}")
    info = dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)
    host, port = info["URL"].rsplit("//", 1)[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)

    def poll(body: dict) -> tuple[float, dict]:
        data = json.dumps(body).encode()
        t0 = time.perf_counter()
        conn.request(
            "POST", "/get_rollout_data", body=data, headers={"Content-Type": "application/json"}
        )
        doc = json.loads(conn.getresponse().read())
        return time.perf_counter() - t0, doc

    try:
        deadline, got = time.time() + 600, 0
        while (
            got < args.sentinel and time.time() < deadline
        ):  # the sentinels: every row has been read
            _, doc = poll({})
            got += (
                len(doc["data"]["meta_info"].get("finished_groups") or [])
                if doc.get("success")
                else 0
            )
            if not doc.get("success"):
                time.sleep(0.2)
        plain, with_id = [], []
        for _ in range(args.polls):
            s, doc = poll({})
            assert not doc["success"], "an idle poll got data"
            plain.append(s * 1000)
            s, doc = poll({"request_id": uuid.uuid4().hex})
            assert not doc["success"], "an idle poll got data"
            with_id.append(s * 1000)
    finally:
        conn.close()
        subprocess.run(PEERS[peer] + ["stop", info["PID"]], capture_output=True, timeout=120)
    return {
        "peer": peer,
        "sentinels": got,
        "plain_p50_ms": pct(plain, 50),
        "plain_p99_ms": pct(plain, 99),
        "rid_p50_ms": pct(with_id, 50),
        "rid_p99_ms": pct(with_id, 99),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--polls", type=int, default=500, help="empty polls of each kind")
    p.add_argument("--groups", type=int, default=5000, help="pending groups")
    p.add_argument("--sentinel", type=int, default=4, help="complete groups written last")
    p.add_argument(
        "--peers",
        default="original,new",
        help="original, new, or NAME=PEER_SCRIPT, comma-separated",
    )
    p.add_argument("--workdir", default="/tmp/idle-rid")
    args = p.parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)
    db = os.path.join(args.workdir, "base.db")
    gen = [
        sys.executable,
        os.path.join(BENCH, "gen_rows.py"),
        "--db",
        db,
        "--job",
        "IDLE",
        "--k",
        "8",
        "--steps",
        "1",
        "--prompt-bytes",
        "2048",
        "--force",
        "--quiet",
    ]
    subprocess.run(
        [
            *gen,
            "--groups",
            str(args.groups),
            "--incomplete-frac",
            "1.0",
            "--incomplete-sessions",
            "8",
        ],
        check=True,
        capture_output=True,
    )
    subprocess.run(
        [a for a in gen if a != "--force"] + ["--groups", str(args.sentinel), "--append"],
        check=True,
        capture_output=True,
    )
    for spec in args.peers.split(
        ","
    ):  # NAME=PEER_SCRIPT adds a peer (another checkout's tests/bench/peer.py)
        if "=" in spec:
            PEERS[spec.split("=")[0]] = [sys.executable, spec.split("=", 1)[1]]
    names = [spec.split("=")[0] for spec in args.peers.split(",")]
    rows = [measure(peer, db, args, os.path.join(args.workdir, peer)) for peer in names]
    print("| peer | empty poll p50 | p99 | with a fresh request_id p50 | p99 |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['peer']} | {r['plain_p50_ms']:.2f} ms | {r['plain_p99_ms']:.2f} ms | "
            f"{r['rid_p50_ms']:.2f} ms | "
            f"{r['rid_p99_ms']:.2f} ms |"
        )
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
