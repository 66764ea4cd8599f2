#!/usr/bin/env python3
"""Freshness: how long a completed group waits before the trainer has it, with peers side by side.

A live scenario (issue 11): a writer process inserts launcher rows into a SQLite database at a
steady rate (default 20 groups/s, K=8, 4 steps per session, 2 KB prompts; one transaction per
row, sessions interleaved as a launcher's workers write them) and records, per group, the wall
time at which the COMMIT of its completing row (the last of its K completed rows) returned. A
trainer-like client polls the peer and records when each group arrived. For every peer and
client mode it reports the delivery latency (commit of the completing row -> received), p50 and
p99, and the trainer's wait per batch of 64 groups (from the start of collecting a batch to
having 64 groups), p50 and p99, and checks that no group came twice or short of K sessions.

Client modes:
  upstream  the unchanged upstream client: sleep 5 s, POST {} ; while empty: sleep 3 s, POST {};
            repeat until it has 64 groups (a batch), then start the next batch
  longpoll  POST {"wait_s": 30} in a loop (rollout-buffer's long-poll; the original ignores
            wait_s, so against it this mode is a tight loop of empty polls)

Peers are started through the peer interface of ../shared/bench (PEER start --port --db --job
--k --workdir, PEER stop PID); runs alternate peers within one invocation, so ratios come from
one run on this shared machine.

    tests/bench/freshness.py --duration 60
    tests/bench/freshness.py --runs original:upstream,new:upstream,new:longpoll --duration 30

Stdlib only.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from datetime import datetime, timezone

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
BENCH = os.environ.get("BENCH_DIR", os.path.join(os.path.dirname(ROOT), "shared", "bench"))
sys.path.insert(0, BENCH)
import schema  # noqa: E402  (../shared/bench: the launcher's v1 DDL)

PEERS = {
    "original": [sys.executable, os.path.join(BENCH, "peer_original.py")],
    "new": [sys.executable, os.path.join(HERE, "peer.py")],
}
BATCH_GROUPS = 64


# -- the writer (a subprocess) -------------------------------------------------------------------
def write(args: argparse.Namespace) -> int:
    """Insert rows at the rate until --duration has passed; print one JSON line per completed
    group."""
    rng = random.Random(args.seed)
    db = sqlite3.connect(args.db, isolation_level=None, timeout=30)
    for p in schema.PRAGMAS:
        db.execute(p)
    filler = "".join(rng.choice("abcdefghij klmnopqrstuvwxyz") for _ in range(args.prompt_bytes))
    t0 = time.time()
    # every row's due time: group g starts at g / rate; its K sessions write step s at
    # start + s * step_s (+ jitter), so the group completes about steps * step_s after it starts
    due: list[tuple[float, int, int, int]] = []
    n_groups = int(args.rate * args.duration)
    for g in range(n_groups):
        start = t0 + g / args.rate
        for k in range(args.k):
            for s in range(1, args.steps + 1):
                due.append((start + s * args.step_s + rng.uniform(0, args.step_s / 2), g, k, s))
    due.sort()
    gids = [f"g{g:06d}-{uuid.uuid4().hex[:6]}" for g in range(n_groups)]
    sids = [[str(uuid.uuid4()) for _ in range(args.k)] for _ in range(n_groups)]
    completed = [0] * n_groups
    out = sys.stdout
    for when, g, k, s in due:
        delay = when - time.time()
        if delay > 0:
            time.sleep(delay)
        last = s == args.steps
        messages = [
            {"role": "system", "content": "You are an agent."},
            {"role": "user", "content": filler},
        ]
        for i in range(1, s):
            messages += [
                {"role": "assistant", "content": f"Action: step {i}"},
                {"role": "user", "content": f"obs {i}"},
            ]
        now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f+00:00")
        reward = round(0.1 * (k + 1), 3) if last else 0.0
        db.execute(
            schema.INSERT_STEP,
            (
                sids[g][k],
                s,
                "bench",
                "model",
                gids[g],
                args.job,
                json.dumps(messages),
                f"Action: step {s}",
                reward,
                reward,
                json.dumps({"weight_version": 1}),
                1 if last else 0,
                0,
                1 if last else 0,
                1,
                now,
            ),
        )
        if last:  # autocommit: the COMMIT has returned
            completed[g] += 1
            if completed[g] == args.k:
                out.write(json.dumps({"group": gids[g], "committed": time.time()}) + "\n")
                out.flush()
    return 0


# -- one run: a peer, a client mode
# ------------------------------------------------------------------
def post(url: str, body: dict, timeout: float = 120.0) -> dict:
    req = urllib.request.Request(
        url + "/get_rollout_data",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, round(p / 100 * (len(v) - 1)))]


class Client:
    """The trainer: polls in one of the modes, records when each group arrived."""

    def __init__(self, url: str, mode: str, k: int) -> None:
        self.url, self.mode, self.k = url, mode, k
        self.received: dict[str, float] = {}
        self.duplicates: list[str] = []
        self.short: list[str] = []
        self.batch_waits: list[float] = []
        self.polls = 0
        self.stop = threading.Event()

    def _poll(self, body: dict) -> int:
        doc = post(self.url, body)
        self.polls += 1
        if not doc.get("success"):
            return 0
        now = time.time()
        sessions: dict[str, set[str]] = {}
        for item in doc["data"]["data"]:
            sessions.setdefault(item["instance_id"], set()).add(item["extra_info"]["session_id"])
        for gid, sids in sessions.items():
            if gid in self.received:
                self.duplicates.append(gid)
            self.received[gid] = now
            if len(sids) != self.k:
                self.short.append(gid)
        return len(sessions)

    def run(self) -> None:
        while not self.stop.is_set():
            started, got = time.time(), 0
            while got < BATCH_GROUPS and not self.stop.is_set():
                if self.mode == "upstream":
                    self.stop.wait(5)  # the upstream loop sleeps 5 s before each get_rollout_data
                    n = self._poll({})
                    while n == 0 and not self.stop.is_set():
                        self.stop.wait(3)
                        n = self._poll({})
                else:
                    n = self._poll({"wait_s": 30})
                got += n
            if got >= BATCH_GROUPS:
                self.batch_waits.append(time.time() - started)


def run_one(peer: str, mode: str, args: argparse.Namespace, workdir: str) -> dict:
    os.makedirs(workdir, exist_ok=True)
    db_path = os.path.join(workdir, "live.db")
    db = sqlite3.connect(db_path, isolation_level=None)
    for p in schema.PRAGMAS:
        db.execute(p)
    for ddl in schema.DDL:
        db.execute(ddl)
    db.close()
    job = "fresh"
    out = subprocess.run(
        PEERS[peer]
        + [
            "start",
            "--port",
            str(free_port()),
            "--db",
            db_path,
            "--job",
            job,
            "--k",
            str(args.k),
            "--workdir",
            os.path.join(workdir, "peer"),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    if out.returncode != 0:
        raise SystemExit(f"{peer} did not start:\n{out.stdout}\n{out.stderr}")
    info = dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)
    writer = subprocess.Popen(
        [
            sys.executable,
            os.path.abspath(__file__),
            "write",
            "--db",
            db_path,
            "--job",
            job,
            "--rate",
            str(args.rate),
            "--duration",
            str(args.duration),
            "--k",
            str(args.k),
            "--steps",
            str(args.steps),
            "--prompt-bytes",
            str(args.prompt_bytes),
            "--step-s",
            str(args.step_s),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    client = Client(info["URL"], mode, args.k)
    thread = threading.Thread(target=client.run, daemon=True)
    thread.start()
    committed: dict[str, float] = {}
    try:
        assert writer.stdout is not None
        for line in writer.stdout:
            rec = json.loads(line)
            committed[rec["group"]] = rec["committed"]
        writer.wait()
        deadline = time.time() + args.tail
        while time.time() < deadline and not set(committed) <= set(client.received):
            time.sleep(0.2)
    finally:
        client.stop.set()
        thread.join(150)
        subprocess.run(PEERS[peer] + ["stop", info["PID"]], capture_output=True, timeout=120)
    lat = [client.received[g] - t for g, t in committed.items() if g in client.received]
    return {
        "peer": peer,
        "mode": mode,
        "groups_written": len(committed),
        "groups_received": len(lat),
        "duplicates": len(client.duplicates),
        "short": len(client.short),
        "polls": client.polls,
        "latency_p50_s": pct(lat, 50),
        "latency_p99_s": pct(lat, 99),
        "latency_max_s": max(lat, default=None),
        "batches": len(client.batch_waits),
        "batch_wait_p50_s": pct(client.batch_waits, 50),
        "batch_wait_p99_s": pct(client.batch_waits, 99),
    }


def fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd")
    w = sub.add_parser("write", help="(internal) the live writer")
    for a in (p, w):
        a.add_argument("--rate", type=float, default=20.0, help="groups completed per second")
        a.add_argument("--duration", type=float, default=60.0, help="seconds of writing per run")
        a.add_argument("--k", type=int, default=8)
        a.add_argument("--steps", type=int, default=4)
        a.add_argument("--prompt-bytes", type=int, default=2048)
        a.add_argument(
            "--step-s", type=float, default=0.5, help="seconds between a session's steps"
        )
    w.add_argument("--db", required=True)
    w.add_argument("--job", required=True)
    w.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--runs",
        default="original:upstream,new:upstream,new:longpoll",
        help="peer:mode pairs, run in this order",
    )
    p.add_argument(
        "--tail", type=float, default=30.0, help="seconds to wait for the last groups after writing"
    )
    p.add_argument("--workdir", default="/tmp/freshness")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    if args.cmd == "write":
        return write(args)
    results = []
    for i, pair in enumerate(args.runs.split(",")):
        peer, mode = pair.split(":")
        print(
            f"run {i + 1}: {peer} / {mode} "
            f"({args.duration:g} s of {args.rate:g} groups/s, K={args.k})",
            file=sys.stderr,
            flush=True,
        )
        results.append(
            run_one(peer, mode, args, os.path.join(args.workdir, f"run{i}-{peer}-{mode}"))
        )
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    print(
        "| peer | client | groups written / received | dup / short | polls | latency p50 | p99 | "
        "max | batches of 64 | wait per batch p50 | p99 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['peer']} | {r['mode']} | {r['groups_written']} / {r['groups_received']} | "
            f"{r['duplicates']} / {r['short']} | {r['polls']} | {fmt(r['latency_p50_s'])} s | "
            f"{fmt(r['latency_p99_s'])} s | {fmt(r['latency_max_s'])} s | {r['batches']} | "
            f"{fmt(r['batch_wait_p50_s'])} s | {fmt(r['batch_wait_p99_s'])} s |"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return (
        1
        if any(
            r["duplicates"] or r["short"] or r["groups_received"] < r["groups_written"]
            for r in results
        )
        else 0
    )


if __name__ == "__main__":
    sys.exit(main())
