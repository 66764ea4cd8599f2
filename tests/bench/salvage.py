#!/usr/bin/env python3
"""Salvage (issue 38): what ROLLOUT_BUFFER_SALVAGE=truncate keeps, against salvage off.

Each run starts the real service (gunicorn, SQLite) with the built-in simulated launcher: K = 8,
``--fail-rate 0.05`` (sessions that fail for good after 0..max-steps-1 rows), ``--cap-rate 0.05``
(sessions that reach --max-steps 10 without a result), the simulator's other defaults
(``--truncate-rate 0.05``: answers cut by the length limit, which complete). A trainer polls it
with the real client until the launcher has finished and every group is decided. Salvage off and
on play the same seed, so each pair of runs sees the same sessions crash and hit the cap.

Printed per setting, as the median of ``--runs`` runs (default 3):
  served    the share of the simulator's groups served to the trainer
  gen kept  the share of the generation seconds (the buffer's census: each session's first row to
            its last) that went into served groups, not discarded ones
  groups/min  groups the trainer received per minute, from /start_rollout to its last group

    tests/bench/salvage.py                 # 3 runs each, 48 groups
    tests/bench/salvage.py --groups 96 --runs 5

``--drain`` measures what salvage costs instead (issue 38, item 7): a database of
``../shared/bench/gen_rows.py --trainable last --incomplete-frac 0.2`` (256 groups x K=8 x 4 steps
x 2 KB; a fifth of the groups never complete) is drained by ``../shared/bench/drain.py`` (without
``--db``) from ``tests/bench/peer.py`` with salvage off and on, trials alternating on a fresh copy
of the database; it prints the median groups/s and items/s of each and the ratio on/off.

    tests/bench/salvage.py --drain --runs 5
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from rollout_buffer.client import BufferClient, groups_of  # noqa: E402
from rollout_buffer.storage.store import init_database  # noqa: E402
from rollout_buffer.tools.runner import ServerProcess, clean_env, free_port  # noqa: E402

K = 8
ROOT = os.path.dirname(os.path.dirname(HERE))
# ../shared/bench from the project's root (from a worktree under /work/wt, two levels up)
BENCH = os.environ.get("BENCH_DIR") or next(
    (
        d
        for d in (
            os.path.join(os.path.dirname(ROOT), "shared", "bench"),
            os.path.join(os.path.dirname(os.path.dirname(ROOT)), "shared", "bench"),
        )
        if os.path.exists(os.path.join(d, "gen_rows.py"))
    ),
    os.path.join(os.path.dirname(ROOT), "shared", "bench"),
)
os.environ["BENCH_DIR"] = BENCH  # (peer.py finds the fake proxy there)


def one_run(salvage: str, *, groups: int, pace: float, seed: int, workdir: str) -> dict[str, Any]:
    """One job, start to drained: the figures of one run."""
    db_url = "sqlite://" + os.path.join(workdir, "bench.db")
    init_database(db_url)
    sim = (
        f"--groups {groups} --pace {pace} --flush-interval 0.5 --fail-rate 0.05 --cap-rate 0.05 "
        f"--seed {seed}"
    )
    env = clean_env(
        {
            "AIEVOBOX_DB_URL": db_url,
            "AIEVOBOX_RUN_DIR": os.path.join(workdir, "logs"),
            "ROLLOUT_BUFFER_LAUNCHER": "simulate",
            "ROLLOUT_BUFFER_SIMULATE_ARGS": sim,
            "ROLLOUT_BUFFER_SALVAGE": salvage,
            "ROLLOUT_BUFFER_STOP_GRACE_SECONDS": "5",
        }
    )
    port = free_port()
    server = ServerProcess(port, env, os.path.join(workdir, "server.log"), cwd=workdir)
    server.spawn()
    try:
        problem = server.wait_healthy(30.0)
        if problem:
            raise SystemExit(f"the server did not start: {problem}")
        client = BufferClient(f"http://127.0.0.1:{port}", timeout=60.0)
        try:
            return _train(client, groups)
        finally:
            client.close()
    finally:
        server.stop(wait_s=15.0)


def _train(client: BufferClient, groups: int) -> dict[str, Any]:
    t0 = time.monotonic()
    client.start_rollout(num_repeat_per_sample=K)
    received: set[str] = set()
    last_group_at = t0
    while True:
        doc = client.get_rollout_data()
        got = groups_of(doc) if doc.get("success") else []
        for gid, items in got:
            assert gid not in received, f"group {gid} received twice"
            assert len({i["extra_info"]["session_id"] for i in items}) == K, gid
            received.add(gid)
            last_group_at = time.monotonic()
        if got:
            continue
        stats = client.stats()
        g = stats.get("groups") or {}
        launcher = stats.get("launcher") or {}
        if (
            launcher.get("finished")
            and stats.get("lag_rows") == 0
            and not (g.get("pending") or g.get("ready") or g.get("in_flight"))
        ):
            break
        time.sleep(0.2)
    assert stats.get("accounting_balanced"), stats.get("rows")
    waste = stats["waste"]
    served_s = waste["served"]["generation_s"]
    total_s = served_s + waste["discarded"]["generation_s"]
    return {
        "served": len(received) / groups,
        "gen_kept": served_s / total_s if total_s else 0.0,
        "per_min": len(received) / max(last_group_at - t0, 1e-9) * 60.0,
        "dropped": g.get("dropped") or {},
        "salvaged": sum((stats.get("salvaged") or {}).get("groups", {}).values()),
    }


def drain_cost(runs: int, groups: int) -> int:
    """Drain the same database with salvage off and on (see the module docstring)."""

    with tempfile.TemporaryDirectory(prefix="salvage-drain-") as work:
        src = os.path.join(work, "src.db")
        gen = subprocess.run(
            [
                sys.executable,
                os.path.join(BENCH, "gen_rows.py"),
                *("--db", src, "--job", "J", "--groups", str(groups), "--k", str(K)),
                *("--steps", "4", "--prompt-bytes", "2048", "--trainable", "last"),
                *("--incomplete-frac", "0.2", "--seed", "1", "--force", "--quiet"),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        summary = json.loads(gen.stdout.split("SUMMARY ", 1)[1].splitlines()[0])
        expect = summary["complete_groups"]
        print(
            f"database: {summary['rows']} rows, {summary['groups']} groups x K={K}, "
            f"{expect} complete, {summary['incomplete_groups']} incomplete (--trainable last)"
        )
        figures: dict[str, list[dict[str, Any]]] = {"off": [], "truncate": []}
        for run in range(runs):
            for salvage in ("off", "truncate"):  # alternated
                trial = os.path.join(work, f"{salvage}-{run}")
                os.makedirs(trial)
                db = os.path.join(trial, "b.db")
                shutil.copyfile(src, db)
                figures[salvage].append(_drain_once(trial, db, salvage, expect))
                r = figures[salvage][-1]
                print(
                    f"run {run + 1} salvage={salvage:8s} {r['groups_per_s']:8.1f} groups/s "
                    f"{r['items_per_s']:9.1f} items/s  server CPU {r['cpu_s']:6.2f} s",
                    flush=True,
                )
    med = {
        s: {
            key: statistics.median(r[key] for r in rs)
            for key in ("groups_per_s", "items_per_s", "cpu_s")
        }
        for s, rs in figures.items()
    }
    print(f"\nmedian of {runs}: salvage off / on")
    for key in ("groups_per_s", "items_per_s", "cpu_s"):
        off, on = med["off"][key], med["truncate"][key]
        print(f"  {key:13s} {off:9.2f} {on:9.2f}  on/off {on / off:.3f}")
    return 0


def _drain_once(trial: str, db: str, salvage: str, expect: int) -> dict[str, Any]:
    peer = os.path.join(HERE, "peer.py")
    started = subprocess.run(
        [
            sys.executable,
            peer,
            "start",
            *("--port", str(free_port()), "--db", db, "--job", "J", "--k", str(K)),
            *(
                "--workdir",
                os.path.join(trial, "peer"),
                "--env",
                f"ROLLOUT_BUFFER_SALVAGE={salvage}",
            ),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    keys = dict(line.split("=", 1) for line in started.stdout.splitlines() if "=" in line)
    out = os.path.join(trial, "drain.json")
    try:
        subprocess.run(
            [
                sys.executable,
                os.path.join(BENCH, "drain.py"),
                *("--url", keys["URL"], "--expect-groups", str(expect), "--k", str(K)),
                *("--timeout", "600", "--json-out", out, "--quiet"),
            ],
            check=True,
            capture_output=True,
        )
        cpu = _cpu_s(keys.get("MEM_PIDS", keys["PID"]))
    finally:
        subprocess.run(
            [sys.executable, peer, "stop", keys["PID"]], check=False, capture_output=True
        )

    with open(out) as fh:
        return {**json.load(fh), "cpu_s": cpu}


def _cpu_s(pids: str) -> float:
    """CPU seconds (user + system) the server's processes used so far: a figure that the other
    loads of a shared machine disturb less than the wall clock."""
    total = 0
    for pid in pids.split(","):
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return total / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--groups", type=int, default=48, help="prompt groups per run (K = 8)")
    p.add_argument("--runs", type=int, default=3, help="runs per setting (the median is shown)")
    p.add_argument("--pace", type=float, default=0.002, help="the simulator's seconds per row")
    p.add_argument("--drain", action="store_true", help="measure the drain cost of salvage instead")
    args = p.parse_args(argv)
    if args.drain:
        return drain_cost(args.runs, 256 if args.groups == 48 else args.groups)
    # the client warns once per run that the launcher exited: every run ends so
    logging.getLogger("rollout_buffer.client").setLevel(logging.ERROR)
    results: dict[str, list[dict[str, Any]]] = {"off": [], "truncate": []}
    for run in range(args.runs):
        for salvage in ("off", "truncate"):  # alternated: both settings see the same machine
            with tempfile.TemporaryDirectory(prefix="salvage-bench-") as workdir:
                r = one_run(
                    salvage, groups=args.groups, pace=args.pace, seed=run + 1, workdir=workdir
                )
            results[salvage].append(r)
            print(
                f"run {run + 1} salvage={salvage:8s} served {r['served']:6.1%}  gen kept "
                f"{r['gen_kept']:6.1%}  {r['per_min']:7.1f} groups/min  salvaged "
                f"{r['salvaged']:3d}  dropped {r['dropped']}",
                flush=True,
            )
    print(
        f"\nK={K}, {args.groups} groups, 5 % crashing, 5 % at the step cap; median of {args.runs}"
    )
    print(f"{'salvage':10s} {'served':>8s} {'gen kept':>9s} {'groups/min':>11s}")
    for salvage, rs in results.items():
        print(
            f"{salvage:10s} {statistics.median(r['served'] for r in rs):8.1%} "
            f"{statistics.median(r['gen_kept'] for r in rs):9.1%} "
            f"{statistics.median(r['per_min'] for r in rs):11.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
