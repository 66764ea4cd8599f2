#!/usr/bin/env python3
"""Failover figures (issue 12): takeover time over many kills, and what fencing costs a drain.

    python tests/bench/failover_bench.py [--kills 20] [--lease 10] [--hosts other|same]
    python tests/bench/failover_bench.py --part fencing [--repeat 3] [--max-groups N]

``takeover``: two ``rollout-buffer serve`` (gunicorn, LAUNCHER=none) on one fresh Postgres schema
(``postgresql://root@127.0.0.1:5432/test`` or --pg), an external writer adding a complete group
every 20 ms, and a BufferClient holding both URLs that drains all the time. Each round kills -9
the owner's whole process group at a random moment of its renewal cycle, measures until the
standby owns the job (its /health, every 20 ms) and until the client receives its next group, then
starts the killed instance again as the new standby. ``--hosts other`` (default) gives the two
instances different ROLLOUT_BUFFER_HOST_IDs, so the standby must wait for the lease to end (a
cluster); ``same`` lets it see the dead pid at once. At the end every group written must have
reached the client exactly once. Prints p50/p99 and the target (p99 <= lease + 2 s).

``fencing``: the small drain (../shared/bench gen_rows 256 groups x K=8 x 4 steps x 2 KB, drained by
../shared/bench/drain.py through tests/bench/peer.py) with the lease (ROLLOUT_BUFFER_LEASE_SECONDS
=10: every decision's transaction runs the fence) and without it (0), alternating in one run, on
SQLite and on Postgres. Prints medians and the ratio (target: fencing costs <= 5%)."""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import pg_bench  # noqa: E402  (the Postgres copy of the drain's rows, and its runner)
import psycopg  # noqa: E402
import requests  # noqa: E402

from rollout_buffer.client import BufferClient, groups_of  # noqa: E402
from rollout_buffer.core.config import Config  # noqa: E402
from rollout_buffer.core.model import Batch, Decisions, Served, Take  # noqa: E402
from rollout_buffer.launcher import procfs  # noqa: E402
from rollout_buffer.runtime.lease import Lease  # noqa: E402
from rollout_buffer.storage.db import connect, service_connect  # noqa: E402
from rollout_buffer.storage.launcher_sql import INSERT_STEP  # noqa: E402
from rollout_buffer.storage.launcher_tables import create_launcher_tables  # noqa: E402
from rollout_buffer.storage.store import Store  # noqa: E402
from rollout_buffer.tools.runner import ServerProcess, clean_env, free_port, serve_argv  # noqa: E402


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * len(xs) + 0.5) - 1))]


# -- takeover
# -----------------------------------------------------------------------------------------
class Instance:
    """One server of a buffer (ROLLOUT_BUFFER_NAME: instances of one buffer are an owner and its
    standbys; another name is an independent buffer on the same database)."""

    def __init__(
        self, name: str, url: str, work: str, lease: float, host: str | None, buffer: str = "bench"
    ) -> None:
        self.name, self.port = name, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        settings = {
            "AIEVOBOX_DB_URL": url,
            "AIEVOBOX_RUN_DIR": os.path.join(work, name),
            "ROLLOUT_BUFFER_LAUNCHER": "none",
            "ROLLOUT_BUFFER_ADVERTISE_URL": self.url,
            "ROLLOUT_BUFFER_LEASE_SECONDS": str(lease),
            "ROLLOUT_BUFFER_NAME": buffer,
        }
        if host:
            settings["ROLLOUT_BUFFER_HOST_ID"] = host
        self.env = clean_env(settings)
        self.log = os.path.join(work, f"{name}.log")
        self.proc: ServerProcess | None = None

    def start(self) -> None:
        self.proc = ServerProcess(self.port, self.env, self.log, argv=serve_argv(self.port))
        self.proc.spawn()
        problem = self.proc.wait_healthy(60)
        if problem:
            raise RuntimeError(f"{self.name}: {problem}")

    def kill9(self) -> None:
        assert self.proc is not None and self.proc.pid is not None
        pgid = self.proc.pid
        self.proc.stop(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while procfs.group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.01)
        self.proc = None

    def role(self) -> str | None:
        try:
            return requests.get(self.url + "/health", timeout=2).json()["role"]
        except (requests.RequestException, ValueError):
            return None


def wait(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout:g} s")
        time.sleep(0.02)


def fresh_database(args: argparse.Namespace, prefix: str) -> tuple[str, str]:
    """A new Postgres schema with the launcher's tables: (its URL, the schema)."""
    schema = prefix + os.urandom(6).hex()
    with psycopg.connect(args.pg, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    url = f"{args.pg}{'&' if '?' in args.pg else '?'}options=-csearch_path%3D{schema}"
    db = connect(url)
    create_launcher_tables(db)
    db.close()
    return url, schema


def keep_writing(
    url: str,
    written: list[str],
    stop: threading.Event,
    pace_s: float,
    job: str = "J",
    prefix: str = "g",
) -> None:
    """An external writer (a launcher elsewhere): a complete group of two one-step sessions of the
    job every pace_s, its group ids starting with prefix."""
    w = connect(url)
    i = 0
    while not stop.is_set():
        gid = f"{prefix}{i:06d}"
        for s in range(2):
            w.execute(
                INSERT_STEP,
                (
                    f"{gid}-s{s}",
                    1,
                    "env",
                    "model",
                    gid,
                    job,
                    '[{"role":"user","content":"x"}]',
                    "y",
                    0.5,
                    0.5,
                    '{"weight_version": 1}',
                    1,
                    0,
                    1,
                    1,
                    "2026-01-01 00:00:00+00",
                ),
            )
        written.append(gid)
        i += 1
        time.sleep(pace_s)
    w.close()


def takeover(args: argparse.Namespace) -> int:
    logging.getLogger("rollout_buffer.client").setLevel(
        logging.ERROR
    )  # (a retry line per failed attempt)
    work = tempfile.mkdtemp(prefix="rb-failover-")
    url, schema = fresh_database(args, "rbfail_")
    other = args.hosts == "other"
    insts = [Instance(n, url, work, args.lease, f"host-{n}" if other else None) for n in ("a", "b")]
    written: list[str] = []
    got: collections.Counter = collections.Counter()
    received: list[float] = []
    stop = threading.Event()

    def trainer(client: BufferClient) -> None:
        while not stop.is_set():
            doc = client.get_rollout_data(max_groups=16, wait_s=0.5)
            for gid, _items in groups_of(doc) if doc.get("success") else []:
                got[gid] += 1
                received.append(time.monotonic())

    owner_s: list[float] = []
    serve_s: list[float] = []
    with ExitStack() as stack:
        for inst in insts:
            stack.callback(lambda inst=inst: inst.proc and inst.proc.stop())
        insts[0].start()
        wait(lambda: insts[0].role() == "owner", 30, "a owns the job")
        insts[1].start()
        wait(lambda: insts[1].role() == "standby", 30, "b is a standby")
        client = BufferClient(
            [i.url for i in insts], retries=200, backoff_s=0.05, backoff_max_s=0.5, timeout=30
        )
        client.start_rollout(num_repeat_per_sample=2, job_session="J")
        threads = [
            threading.Thread(target=keep_writing, args=(url, written, stop, 0.02), daemon=True),
            threading.Thread(target=trainer, args=(client,), daemon=True),
        ]
        for t in threads:
            t.start()
        for n in range(1, args.kills + 1):
            owner, standby = (
                (insts[0], insts[1]) if insts[0].role() == "owner" else (insts[1], insts[0])
            )
            time.sleep(random.uniform(0.5, 0.5 + args.lease / 3))  # anywhere in the renewal cycle
            killed = time.monotonic()
            owner.kill9()
            wait(
                lambda standby=standby: standby.role() == "owner",
                args.lease + 30,
                f"round {n}: takeover",
            )
            owner_s.append(time.monotonic() - killed)
            wait(
                lambda killed=killed: any(r > killed + owner_s[-1] for r in received),
                30,
                f"round {n}: a group served after it",
            )
            serve_s.append(next(r for r in received if r > killed + owner_s[-1]) - killed)
            # (the first group after the takeover: one received between the kill and the takeover
            # was recorded by the old owner before it died, and only its answer was late)
            print(
                f"  kill {n:2d}: standby owns the job after {owner_s[-1]:.2f} s, "
                f"serves after {serve_s[-1]:.2f} s",
                flush=True,
            )
            owner.start()
            wait(
                lambda owner=owner: owner.role() == "standby",
                60,
                f"round {n}: the killed instance back as a standby",
            )
        stop.set()
        time.sleep(1.0)
        threads[0].join(10)
        # drain what the writer wrote last
        deadline = time.monotonic() + 30
        while set(written) - set(got) and time.monotonic() < deadline:
            time.sleep(0.1)
        threads[1].join(10)
        client.close()
    with psycopg.connect(args.pg, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
    missing = sorted(set(written) - set(got))
    twice = {g: c for g, c in got.items() if c != 1}
    print(
        f"\n{len(written)} groups written, {len(got)} received; missing {len(missing)}, "
        f"more than once {len(twice)}"
    )
    print(
        f"\n| {args.kills} kills -9 of the owner, lease {args.lease:g} s, hosts {args.hosts} "
        "| p50 | p99 | max |"
    )
    print("|---|---|---|---|")
    for label, xs in (("standby owns the job", owner_s), ("client gets its next group", serve_s)):
        print(f"| {label} | {pct(xs, 50):.2f} s | {pct(xs, 99):.2f} s | {max(xs):.2f} s |")
    target = args.lease + 2.0
    print(
        f"\ntarget: takeover p99 <= lease + 2 s = {target:g} s: "
        f"{'met' if pct(owner_s, 99) <= target else 'MISSED'} "
        f"(owner), {'met' if pct(serve_s, 99) <= target else 'MISSED'} (serving)"
    )
    return 1 if missing or twice else 0


# -- fencing
# --------------------------------------------------------------------------------------------
def drain_trial(
    backend: str,
    lease: str,
    template: str,
    args: argparse.Namespace,
    work: str,
    n: int,
    groups: int,
) -> dict:
    db = os.path.join(work, f"{backend}-{lease}-{n}.db")
    shutil.copyfile(template, db)
    extra = ["--env", f"ROLLOUT_BUFFER_LEASE_SECONDS={lease}"]
    schema = None
    if backend == "postgres":
        url, schema = pg_bench.pg_copy(template, args.pg)
        extra += ["--env", f"AIEVOBOX_DB_URL={url}", "--env", "STORAGE_TYPE=postgres"]
    peer = pg_bench.run(
        [
            sys.executable,
            os.path.join(HERE, "peer.py"),
            "start",
            "--port",
            str(free_port()),
            "--db",
            db,
            "--job",
            "J",
            "--k",
            str(args.k),
            "--workdir",
            os.path.join(work, f"peer-{backend}-{lease}-{n}"),
            *extra,
        ],
        timeout=120,
    )
    info = dict(line.split("=", 1) for line in peer.stdout.splitlines() if "=" in line)
    out = os.path.join(work, f"drain-{backend}-{lease}-{n}.json")
    cmd = [
        sys.executable,
        os.path.join(pg_bench.BENCH, "drain.py"),
        "--url",
        info["URL"],
        "--expect-groups",
        str(groups),
        "--k",
        str(args.k),
        "--json-out",
        out,
        "--quiet",
    ]
    if args.max_groups:
        cmd += ["--max-groups", str(args.max_groups)]
    try:
        subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    finally:
        subprocess.run(
            [sys.executable, os.path.join(HERE, "peer.py"), "stop", info["PID"]],
            capture_output=True,
        )
        if schema:
            pg_bench.drop_schema(args.pg, schema)
        os.remove(db)
    with open(out) as fh:
        d = json.load(fh)
    print(
        f"  {backend} lease={lease} trial {n}: {d['items_per_server_s']} items/s in requests, "
        f"{d['items_per_s']} items/s, polls {d['polls']}, violations {d['violation_count']}",
        flush=True,
    )
    return d


def record_cost(url: str, backend: str, n: int) -> None:
    """The fence alone: Store.record of a poll-sized plan (a batch, 8 served groups of 8 sessions)
    with the lease's fence and without, alternating blocks of 50, on one connection. Prints µs per
    record."""
    config = Config.from_env(
        {}, db_url=url, run_dir=tempfile.mkdtemp(prefix="rb-fence-"), lease_s=10.0
    )
    lease = Lease(config, "bench")
    lease.start()
    wait(lambda: lease.role == "owner", 30, "the lease")
    lease.state_epoch = lease.epoch
    db = service_connect(config, url)
    fenced, bare = Store(db, lease.fence), Store(db)
    times: dict[str, list[float]] = {"with the fence": [], "without": []}
    i = 0
    for block in range(2 * n // 50):
        store, label = (fenced, "with the fence") if block % 2 == 0 else (bare, "without")
        for _ in range(50):
            i += 1
            bid = f"b{i}"
            served = [
                Served(Take(f"g{i}-{k}", {f"s{k}-{j}": (i * 100 + j,) for j in range(8)}, {}), bid)
                for k in range(8)
            ]
            plan = Decisions(
                served=served,
                batch=Batch(bid, "J", None, b"0" * 16, [s.group_id for s in served], 64, 0),
            )
            t0 = time.perf_counter()
            store.record("J", plan)
            times[label].append(time.perf_counter() - t0)
    db.close()
    lease.stop()
    med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    print(
        f"  {backend}: record of a poll's plan {med['with the fence']:.0f} µs with the fence, "
        f"{med['without']:.0f} µs without "
        f"(+{med['with the fence'] - med['without']:.0f} µs, median of {n} each)",
        flush=True,
    )


def fencing(args: argparse.Namespace) -> int:
    print("fencing, the store alone:", flush=True)
    sq = os.path.join(tempfile.mkdtemp(prefix="rb-fence-"), "fence.db")
    record_cost("sqlite://" + sq, "sqlite", 1000)
    schema = "rbfence_" + os.urandom(6).hex()
    with psycopg.connect(args.pg, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    try:
        record_cost(
            f"{args.pg}{'&' if '?' in args.pg else '?'}options=-csearch_path%3D{schema}",
            "postgres",
            1000,
        )
    finally:
        pg_bench.drop_schema(args.pg, schema)
    work = tempfile.mkdtemp(prefix="rb-fencing-")
    template = os.path.join(work, "template.db")
    gen = pg_bench.run(
        [
            sys.executable,
            os.path.join(pg_bench.BENCH, "gen_rows.py"),
            "--db",
            template,
            "--job",
            "J",
            "--groups",
            str(args.groups),
            "--k",
            str(args.k),
            "--steps",
            str(args.steps),
            "--prompt-bytes",
            str(args.prompt_bytes),
            "--force",
            "--quiet",
        ]
    )
    summary = json.loads(gen.stdout.strip().splitlines()[-1].split(" ", 1)[1])
    print(
        f"fencing: {summary['rows']} rows, {summary['complete_groups']} complete groups; "
        f"drain max_groups {args.max_groups or 'none'}",
        flush=True,
    )
    res: dict[tuple[str, str], list[dict]] = collections.defaultdict(list)
    for n in range(1, args.repeat + 1):
        for backend in ("sqlite", "postgres"):
            for lease in ("10", "0"):
                res[backend, lease].append(
                    drain_trial(backend, lease, template, args, work, n, summary["complete_groups"])
                )
    print("\n| backend | lease | items/s in requests | items/s | polls | violations |")
    print("|---|---|---|---|---|---|")
    med = {}
    for (backend, lease), ds in sorted(res.items()):
        m = {
            k: statistics.median(d[k] for d in ds)
            for k in ("items_per_server_s", "items_per_s", "polls", "violation_count")
        }
        med[backend, lease] = m
        print(
            f"| {backend} | {'on (10 s)' if lease != '0' else 'off'} | "
            f"{m['items_per_server_s']:.0f} | "
            f"{m['items_per_s']:.0f} | {m['polls']:.0f} | {m['violation_count']:.0f} |"
        )
    for backend in ("sqlite", "postgres"):
        on, off = med[backend, "10"]["items_per_server_s"], med[backend, "0"]["items_per_server_s"]
        print(
            f"{backend}: with the lease {on / off:.3f} of the throughput without it "
            f"(fencing costs {100 * (1 - on / off):+.1f}%; target <= 5%)"
        )
    return 1 if any(m["violation_count"] for m in med.values()) else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--part", choices=("takeover", "fencing", "both"), default="both")
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--lease", type=float, default=10.0)
    p.add_argument("--hosts", choices=("other", "same"), default="other")
    p.add_argument("--pg", default="postgresql://root@127.0.0.1:5432/test")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--groups", type=int, default=256)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompt-bytes", type=int, default=2048)
    p.add_argument(
        "--max-groups",
        type=int,
        default=0,
        help="drain with max_groups (default: none, as the harness)",
    )
    args = p.parse_args(argv)
    status = 0
    if args.part in ("takeover", "both"):
        status |= takeover(args)
    if args.part in ("fencing", "both"):
        status |= fencing(args)
    return status


if __name__ == "__main__":
    sys.exit(main())
