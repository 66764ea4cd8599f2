#!/usr/bin/env python3
"""Pacing: how much generation the trainer throws away, with the gate off and on (issues 23, 34).

Fixed parameters (printed with the results):
- K 4. The trainer trains B = 8 groups a step; each step takes T seconds (--train-s). Before each
  step it waits for B groups no older than its current version - 1 (S = 1) and throws the older
  ones away. Two trainers (--trainer):
  - poller: like the upstream client, {} polls on a 5 s cadence while it waits (--poll-s),
    keeping the surplus for later steps;
  - longpoll: docs/client.md's loop, BufferClient.get_batch(min_groups=B, max_groups=B,
    current_weight_version=its version), asking again for what it threw away.
- The producers: the service's simulated launcher, making its model calls to a stand-in LLM proxy
  (a real HTTP server) that answers each call after --call-s and stamps the weight version, which
  the trainer advances at each step. A pool of --pool sessions (24), session lengths 2-6 steps (3x
  spread), 5% of sessions crashing. With the defaults the producers are about twice as fast as the
  trainer: each run prints the complete groups generated per minute (with pacing off, about 128
  against the trainer's 60).
- Runs alternate pacing off and on (--runs each), each --steps trainer steps long.

Per run and as medians (with min-max): the share of generated groups and of generation seconds
that were discarded (dropped by the buffer's policies, or thrown away by the trainer as stale),
and the groups trained per minute. Groups left incomplete by a crashed session are counted apart:
no pacing can save them. A group's generation seconds are its sessions' seconds from
their first model call to their last answer, as the stand-in proxy saw them. Groups still in
progress, or fresh and not yet taken, when the last step ends are left out of both.

    python tests/bench/pacing.py                 # 3 runs each, ~10 minutes
    python tests/bench/pacing.py --runs 1 --steps 6
    python tests/bench/pacing.py --only on --dump /tmp/d   # calls, polls and /admission over time
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections import defaultdict
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from fakes.fake_llm import FakeLLM  # noqa: E402  (a real HTTP server standing in for the proxy)

from rollout_buffer.client import BufferClient  # noqa: E402
from rollout_buffer.storage.db import connect  # noqa: E402
from rollout_buffer.tools.runner import ServerProcess, clean_env, free_port  # noqa: E402

K = 4
B = 8
S = 1
POLICY_REASONS = ("stale", "zero_variance", "oversampled")


def http(url: str, body: dict[str, Any] | None = None, timeout: float = 120) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def groups_of_sessions(db_url: str, job: str) -> dict[str, str]:
    db = connect(db_url)
    try:
        rows = db.rows("SELECT env_id, group_id FROM job_environments WHERE job_id = ?", (job,))
    finally:
        db.close()
    return {r[0]: r[1] for r in rows}


def one_run(
    args: argparse.Namespace, pacing: bool, index: int, trainer_kind: str
) -> dict[str, Any]:
    workdir = tempfile.mkdtemp(prefix=f"pacing-{'on' if pacing else 'off'}-")
    db_url = "sqlite://" + os.path.join(workdir, "launcher.db")
    job = f"pacing{index}"
    groups = args.steps * B * 4  # more than the producers can make in the run
    with FakeLLM(delay_s=args.call_s, version=0) as llm:
        port = free_port()
        env = clean_env(
            {
                "AIEVOBOX_DB_URL": db_url,
                "AIEVOBOX_RUN_DIR": os.path.join(workdir, "logs"),
                "ROLLOUT_BUFFER_LAUNCHER": "simulate",
                "LLM_PROXY_HOST": "127.0.0.1",
                "LLM_PROXY_PORT": str(llm.port),
                "AIEVOBOX_POOL_SIZE": str(args.pool),
                "ROLLOUT_BUFFER_SIMULATE_ARGS": f"--groups {groups} --pace 0 --llm-calls "
                f"--min-steps 2 --max-steps 6 --fail-rate {args.fail_rate} --cap-rate 0 "
                "--truncate-rate 0 "
                f"--flush-interval 0.5 --seed {index}",
                "ROLLOUT_BUFFER_PACING": "gate" if pacing else "off",
                "ROLLOUT_BUFFER_GATE_PORT": str(free_port()),
                "ROLLOUT_BUFFER_PACING_STALENESS": str(S),
                "ROLLOUT_BUFFER_PACING_SESSION_TIMEOUT_SECONDS": str(args.session_timeout_s),
                # the {} poller states no B: the docs tell its users to set it
                **(
                    {"ROLLOUT_BUFFER_PACING_BATCH_GROUPS": str(B)}
                    if trainer_kind == "poller"
                    else {}
                ),
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
            http(url + "/start_rollout", {"num_repeat_per_sample": K, "job_session": job})
            result = (poller if trainer_kind == "poller" else longpoll)(args, url, llm)
            stats = http(url + "/stats")
            if args.dump:
                with open(f"{args.dump}.{job}.json", "w") as out:
                    json.dump({"calls": llm.calls, "events": result["events"]}, out)
        finally:
            server.stop()
        sessions = groups_of_sessions(db_url, job)
        if args.dump:
            with open(f"{args.dump}.{job}.sessions.json", "w") as out:
                json.dump(sessions, out)
        out = account(result, stats, llm, sessions, pacing)
        out["trainer"] = trainer_kind
        out["waits"] = result["waits"]
        return out


def longpoll(args: argparse.Namespace, url: str, llm: FakeLLM) -> dict[str, Any]:
    """docs/client.md's loop: long-poll for B groups, throw away the stale ones (and ask for as
    many again), train T seconds, advance the version."""
    version = 0
    trained: list[str] = []
    stale: list[str] = []
    waits: list[float] = []
    started = time.monotonic()
    with BufferClient(url, timeout=180) as client:
        for _step in range(args.steps):
            batch: list[str] = []
            collect_from = time.monotonic()
            while len(batch) < B:
                need = B - len(batch)
                got = client.get_batch(
                    min_groups=need, max_groups=need, current_weight_version=version
                )
                for group in got.groups:
                    v = min(int(i["extra_info"].get("weight_version") or 0) for i in group.items)
                    (stale if v < version - S else batch).append(group.group_id)
            waits.append(time.monotonic() - collect_from)
            trained.extend(batch)
            if args.trace:
                doc = http(url + "/admission")
                print(f"  step {_step}: waited {waits[-1]:.1f} s; {doc}", flush=True)
            time.sleep(args.train_s)
            version += 1
            llm.version = version
    return {
        "trained": trained,
        "stale": stale,
        "elapsed_s": time.monotonic() - started,
        "version": version,
        "events": [],
        "waits": waits,
    }


def poller(args: argparse.Namespace, url: str, llm: FakeLLM) -> dict[str, Any]:
    """The upstream client's loop: collect B fresh groups, train T seconds, advance the version."""
    version = 0
    held: dict[str, int] = {}  # group -> its oldest weight_version, kept across steps
    trained: list[str] = []
    stale: list[str] = []
    started = time.monotonic()
    events: list[tuple[float, str, Any]] = []  # for --dump: (time, what, detail)
    sampling = threading.Event()
    if args.dump:  # the budget every half second, to see what held it

        def sample() -> None:
            while not sampling.wait(0.5):
                events.append((time.monotonic(), "admission", http(url + "/admission")))

        threading.Thread(target=sample, daemon=True).start()
    waits: list[float] = []
    for _step in range(args.steps):
        collect_from = time.monotonic()
        while True:
            for gid in [g for g, v in held.items() if v < version - S]:
                stale.append(gid)  # older than current - 1: thrown away, as upstream does
                del held[gid]
            if len(held) >= B:
                break
            doc = http(url + "/get_rollout_data", {})
            got = {
                item["instance_id"]: int(item["extra_info"].get("weight_version") or 0)
                for item in (doc.get("data") or {}).get("data") or []
            }
            events.append((time.monotonic(), "poll", got))
            if doc.get("success"):
                for item in doc["data"]["data"]:
                    v = int(item["extra_info"].get("weight_version") or 0)
                    gid = item["instance_id"]
                    held[gid] = min(held.get(gid, v), v)
                continue
            time.sleep(args.poll_s)
        waits.append(time.monotonic() - collect_from)
        batch = sorted(held, key=lambda g: held[g])[:B]
        for gid in batch:
            del held[gid]
        trained.extend(batch)
        events.append((time.monotonic(), "train", {"step": _step, "version": version}))
        if args.trace:
            doc = http(url + "/admission")
            print(
                f"  step {_step}: t={time.monotonic() - started:.1f}s collected in "
                f"{time.monotonic() - collect_from:.1f}s version {version} held "
                f"{len(held)} stale {len(stale)} admission {doc['budget']}/{doc['capacity']} "
                f"{doc['terms']}",
                flush=True,
            )
        time.sleep(args.train_s)  # training
        version += 1
        llm.version = version  # the proxy stamps the new policy's version from now on
    sampling.set()
    elapsed = time.monotonic() - started
    # what is left: the trainer's surplus and the buffer's ready groups, stale or not
    stale.extend(g for g, v in held.items() if v < version - S)
    return {
        "trained": trained,
        "stale": stale,
        "elapsed_s": elapsed,
        "version": version,
        "events": events,
        "waits": waits,
    }


def account(
    result: dict[str, Any],
    stats: dict[str, Any],
    llm: FakeLLM,
    sessions: dict[str, str],
    pacing: bool,
) -> dict[str, Any]:
    """Generation seconds per group from the proxy's view; discarded = dropped by the buffer or
    thrown away by the trainer."""
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    for call in llm.calls:
        sid = call["session"]
        first[sid] = min(first.get(sid, call["arrived"]), call["arrived"])
        last[sid] = max(last.get(sid, call["answered"]), call["answered"])
    per_group: dict[str, float] = defaultdict(float)
    for sid, t0 in first.items():
        per_group[sessions.get(sid, sid)] += last[sid] - t0
    trained = set(result["trained"])
    stale = set(result["stale"])
    waste = (stats.get("waste") or {}).get("discarded_by_reason") or {}
    # the buffer's policies (none is set here, so normally 0); incomplete groups (a session
    # crashed) are counted apart: no pacing can save them
    policy = [waste[r] for r in POLICY_REASONS if r in waste]
    policy_groups = sum(int(w["groups"]) for w in policy)
    policy_s = sum(float(w["generation_s"]) for w in policy)
    incomplete = sum(int(w["groups"]) for r, w in waste.items() if r not in POLICY_REASONS)
    gen_trained = sum(per_group[g] for g in trained)
    gen_discarded = sum(per_group[g] for g in stale) + policy_s
    n_discarded = len(stale) + policy_groups
    n_total = len(trained) + n_discarded
    return {
        "pacing": "on" if pacing else "off",
        "trained": len(trained),
        "discarded_groups": n_discarded,
        "incomplete_groups": incomplete,
        "discarded_share_groups": n_discarded / n_total if n_total else 0.0,
        "discarded_share_s": gen_discarded / (gen_trained + gen_discarded)
        if gen_trained + gen_discarded
        else 0.0,
        "trained_per_min": len(trained) / result["elapsed_s"] * 60,
        # complete groups made per minute: with pacing off, the producers' speed
        "generated_per_min": n_total / result["elapsed_s"] * 60,
        "elapsed_s": result["elapsed_s"],
    }


def summarize(kind: str, results: dict[str, list[dict[str, Any]]]) -> None:
    for mode, rs in results.items():
        if not rs:
            continue

        def med(key: str, rs: list[dict[str, Any]] = rs) -> str:
            values = [r[key] for r in rs]
            return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"

        print(
            f"{kind} median pacing {mode}: discarded share of generation seconds "
            f"{med('discarded_share_s')}, of groups {med('discarded_share_groups')}, "
            f"groups trained per minute {med('trained_per_min')}"
        )
    if results["off"] and results["on"]:
        off = statistics.median(r["trained_per_min"] for r in results["off"])
        on = statistics.median(r["trained_per_min"] for r in results["on"])
        print(f"{kind} trained per minute, on / off: {on / off:.3f}" if off else "none trained")


def main() -> int:
    # a TERM (timeout, kill) unwinds the run: its service and launcher are stopped, not orphaned
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", type=int, default=3, help="runs with pacing off and with it on")
    p.add_argument("--steps", type=int, default=10, help="trainer steps per run")
    p.add_argument("--train-s", type=float, default=8.0, help="T: seconds a training step takes")
    p.add_argument("--poll-s", type=float, default=5.0, help="the trainer's poll cadence")
    p.add_argument("--call-s", type=float, default=0.5, help="seconds a model call takes")
    p.add_argument("--pool", type=int, default=24, help="the launcher's concurrent sessions")
    p.add_argument(
        "--session-timeout-s",
        type=float,
        default=60.0,
        help="ROLLOUT_BUFFER_PACING_SESSION_TIMEOUT_SECONDS (the environment's steps take 0 s)",
    )
    p.add_argument(
        "--fail-rate",
        type=float,
        default=0.05,
        help="the share of sessions that crash (no terminal row, no more calls)",
    )
    p.add_argument("--trace", action="store_true", help="print each step's admission figures")
    p.add_argument("--only", choices=("off", "on"), help="run one mode only")
    p.add_argument(
        "--trainer", choices=("poller", "longpoll", "both"), default="both", help="which trainer"
    )
    p.add_argument("--dump", help="write each run's model calls and trainer events to DUMP.*.json")
    args = p.parse_args()
    print(
        f"pacing bench: K={K} B={B} S={S} T={args.train_s}s steps={args.steps} "
        f"poll every {args.poll_s}s, model call {args.call_s}s, pool {args.pool}, session "
        f"length 2-6 steps, {args.fail_rate:.0%} crashing, session timeout "
        f"{args.session_timeout_s:g}s, runs alternate off/on",
        flush=True,
    )
    kinds = ("poller", "longpoll") if args.trainer == "both" else (args.trainer,)
    for kind in kinds:
        results: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
        for i in range(args.runs):
            for pacing in (False, True):
                if args.only and args.only != ("on" if pacing else "off"):
                    continue
                r = one_run(args, pacing, 2 * i + int(pacing), kind)
                results[r["pacing"]].append(r)
                waits = ", ".join(f"{w:.1f}" for w in r["waits"])
                print(
                    f"{kind} run {i + 1} pacing {r['pacing']:3}: trained {r['trained']:3d} "
                    f"groups, {r['trained_per_min']:6.1f}/min; discarded "
                    f"{r['discarded_groups']:3d} groups ({r['discarded_share_groups']:.1%} of "
                    f"groups, {r['discarded_share_s']:.1%} of generation seconds); "
                    f"{r['incomplete_groups']} incomplete (a session crashed); "
                    f"{r['generated_per_min']:.1f} complete groups generated/min; waits per step "
                    f"[{waits}] s",
                    flush=True,
                )
        summarize(kind, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
