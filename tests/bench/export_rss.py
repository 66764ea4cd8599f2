#!/usr/bin/env python3
"""The export's memory does not grow with the job: ``rollout-buffer export`` of N and 10 N groups.

python tests/bench/export_rss.py [--groups 2000,20000] [--backend sqlite|postgres] [--prompt-bytes
1024]

For each size: writes N groups (K=2 sessions of 2 steps, a history of about --prompt-bytes) into a
fresh database (a SQLite file, or a fresh schema of ``postgresql://root@127.0.0.1:5432/test`` or
--pg), serves every group through a real service (``rollout-buffer serve``, no launcher), then runs
``rollout-buffer export --out FILE.jsonl.gz`` against it while the service is still running, and
reads the export's peak RSS (VmHWM). Prints one line per size and the ratio of the largest to the
smallest peak RSS (constant memory: close to 1, while the job is 10 times larger).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime, timezone

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)

import requests  # noqa: E402

from rollout_buffer.storage import launcher_sql  # noqa: E402
from rollout_buffer.storage.db import connect  # noqa: E402
from rollout_buffer.storage.launcher_tables import create_launcher_tables  # noqa: E402
from rollout_buffer.tools.runner import ServerProcess, clean_env, free_port  # noqa: E402

JOB = "export-rss"


def write_job(url: str, groups: int, prompt_bytes: int) -> int:
    db = connect(url)
    try:
        create_launcher_tables(db)
        now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f+00:00")
        rows = []
        for g in range(groups):
            history = json.dumps([{"role": "user", "content": f"task {g} " + "x" * prompt_bytes}])
            for s in range(2):
                for step in (1, 2):
                    done = int(step == 2)
                    rows.append(
                        (
                            f"s{g}-{s}",
                            step,
                            "env",
                            "model",
                            f"g{g:07d}",
                            JOB,
                            history,
                            f"answer {step}",
                            0.25 * (s + 1) * done,
                            0.25 * (s + 1) * done,
                            '{"weight_version": 1}',
                            done,
                            0,
                            done,
                            1,
                            now,
                        )
                    )
            if len(rows) >= 20000:
                with db.transaction():
                    db.executemany(launcher_sql.INSERT_STEP, rows)
                rows = []
        with db.transaction():
            db.executemany(launcher_sql.INSERT_STEP, rows)
    finally:
        db.close()
    return groups * 4


def serve_all(base: str, groups: int) -> None:
    r = requests.post(
        base + "/start_rollout", json={"num_repeat_per_sample": 2, "job_session": JOB}, timeout=30
    )
    r.raise_for_status()
    served, deadline = 0, time.monotonic() + 600
    while served < groups:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {served} of {groups} groups served")
        doc = requests.post(
            base + "/get_rollout_data", json={"max_groups": 1000}, timeout=120
        ).json()
        if doc.get("success"):
            served += len(doc["data"]["meta_info"]["finished_groups"])
        else:
            time.sleep(0.1)


def _hwm_mb(pid: int) -> float | None:
    """VmHWM of a live process (its peak RSS since its exec) in MB; None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def export_peak(url: str, out: str) -> tuple[int, float, float]:
    """(records, seconds, peak RSS MB) of one export subprocess. The peak is read from /proc while
    it runs (ru_maxrss would count the memory of this process, which Linux carries across the
    exec)."""
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollout_buffer", "export", "--db", url, "--job", JOB, "--out", out],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    peak = 0.0
    while proc.poll() is None:
        peak = max(
            peak, _hwm_mb(proc.pid) or 0.0
        )  # a zombie has no VmHWM: the last read is the peak
        time.sleep(0.02)
    took = time.monotonic() - started
    stdout, stderr = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"export exited {proc.returncode}: {stderr[-2000:]}")
    return int(stdout.split()[1]), took, peak


def one(size: int, args: argparse.Namespace, tmp: str) -> dict:
    work = os.path.join(tmp, f"n{size}")
    os.makedirs(work)
    schema = None
    if args.backend == "sqlite":
        url = "sqlite:///" + os.path.join(work, "launcher.db")
    else:
        import psycopg

        schema = "rbexport_" + uuid.uuid4().hex[:12]
        with psycopg.connect(args.pg, autocommit=True) as conn:
            conn.execute(f"CREATE SCHEMA {schema}")
        url = f"{args.pg}{'&' if '?' in args.pg else '?'}options=-csearch_path%3D{schema}"
    try:
        rows = write_job(url, size, args.prompt_bytes)
        port = free_port()
        server = ServerProcess(
            port,
            clean_env(
                {
                    "AIEVOBOX_DB_URL": url,
                    "AIEVOBOX_RUN_DIR": os.path.join(work, "logs"),
                    "ROLLOUT_BUFFER_LAUNCHER": "none",
                }
            ),
            os.path.join(work, "server.log"),
        )
        server.spawn()
        try:
            problem = server.wait_healthy(60)
            if problem is not None:
                raise RuntimeError(f"the service did not start: {problem}")
            serve_all(server.url, size)
            out = os.path.join(work, "job.jsonl.gz")
            records, took, rss = export_peak(url, out)  # while the service runs
        finally:
            server.stop()
        return {
            "groups": size,
            "rows": rows,
            "records": records,
            "seconds": took,
            "rss_mb": rss,
            "file_mb": os.path.getsize(out) / 1e6,
        }
    finally:
        if schema is not None:
            import psycopg

            with psycopg.connect(args.pg, autocommit=True) as conn:
                conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", default="2000,20000", help="comma-separated job sizes in groups")
    p.add_argument("--backend", choices=("sqlite", "postgres"), default="sqlite")
    p.add_argument(
        "--pg",
        default=os.environ.get("ROLLOUT_BUFFER_TEST_PG", "postgresql://root@127.0.0.1:5432/test"),
    )
    p.add_argument("--prompt-bytes", type=int, default=1024)
    args = p.parse_args()
    sizes = [int(x) for x in args.groups.split(",")]
    results = []
    with tempfile.TemporaryDirectory(prefix="export-rss-") as tmp:
        for size in sizes:
            r = one(size, args, tmp)
            results.append(r)
            print(
                f"{args.backend}: {r['groups']:>7} groups ({r['rows']} rows): "
                f"{r['records']} records, {r['file_mb']:.1f} MB gzipped in {r['seconds']:.1f} s, "
                f"peak RSS {r['rss_mb']:.1f} MB",
                flush=True,
            )
    lo, hi = min(results, key=lambda r: r["groups"]), max(results, key=lambda r: r["groups"])
    print(
        f"peak RSS {hi['groups']} / {lo['groups']} groups: {hi['rss_mb'] / lo['rss_mb']:.2f}x "
        f"(job {hi['groups'] / lo['groups']:.0f}x larger)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
