#!/usr/bin/env python3
"""The drain scenario on Postgres next to SQLite, in one run (../shared/bench is SQLite-only).

    python tests/bench/pg_bench.py [--groups 256 --k 8 --steps 4 --prompt-bytes 2048] [--repeat 3]

Generates one job with ../shared/bench/gen_rows.py into SQLite, copies the same rows into a
fresh Postgres schema per trial (``postgresql://root@127.0.0.1:5432/test`` or --pg), and drains
each with ../shared/bench/drain.py through tests/bench/peer.py (gunicorn), alternating backends.
Prints items/s, items/s in requests, polls and poll p99 per backend (medians) and the ratio
Postgres / SQLite. Needs the project's requirements (psycopg).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
BENCH = os.environ.get("BENCH_DIR", os.path.join(os.path.dirname(ROOT), "shared", "bench"))
sys.path.insert(0, ROOT)

from rollout_buffer.storage.launcher_sql import STEP_COLUMNS  # noqa: E402

COLUMNS = ("id", *STEP_COLUMNS)


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode not in (0,):
        raise RuntimeError(f"{cmd} exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return r


def pg_copy(sqlite_path: str, dsn: str) -> tuple[str, str]:
    """A fresh schema holding the SQLite job's rows; returns (url, schema)."""
    import sqlite3

    import psycopg

    from rollout_buffer.storage.launcher_sql import LAUNCHER_DDL

    schema = "rbbench_" + uuid.uuid4().hex[:12]
    url = f"{dsn}{'&' if '?' in dsn else '?'}options=-csearch_path%3D{schema}"
    source = sqlite3.connect(sqlite_path)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    with psycopg.connect(url, autocommit=True) as conn:
        for ddl in LAUNCHER_DDL["postgres"]:
            conn.execute(ddl)
        copy = f"COPY session_steps ({', '.join(COLUMNS)}) FROM STDIN"
        with conn.transaction(), conn.cursor() as cur, cur.copy(copy) as cp:
            for row in source.execute(
                f"SELECT {', '.join(COLUMNS)} FROM session_steps ORDER BY id"
            ):
                cp.write_row(row)
        conn.execute(
            "SELECT setval(pg_get_serial_sequence('session_steps', 'id'), "
            "(SELECT MAX(id) FROM session_steps))"
        )
        conn.execute("ANALYZE session_steps")
    source.close()
    return url, schema


def drop_schema(dsn: str, schema: str) -> None:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


def trial(
    backend: str, template: str, args: argparse.Namespace, work: str, n: int, groups: int
) -> dict:
    db = os.path.join(work, f"{backend}-{n}.db")
    shutil.copyfile(template, db)
    extra: list[str] = []
    schema = None
    if backend == "postgres":
        url, schema = pg_copy(template, args.pg)
        extra = ["--env", f"AIEVOBOX_DB_URL={url}", "--env", "STORAGE_TYPE=postgres"]
    peer = run(
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
            str(args.k),
            "--workdir",
            os.path.join(work, f"peer-{backend}-{n}"),
            *extra,
        ],
        timeout=120,
    )
    info = dict(line.split("=", 1) for line in peer.stdout.splitlines() if "=" in line)
    out = os.path.join(work, f"drain-{backend}-{n}.json")
    try:
        subprocess.run(
            [
                sys.executable,
                os.path.join(BENCH, "drain.py"),
                "--url",
                info["URL"],
                "--expect-groups",
                str(groups),
                "--k",
                str(args.k),
                "--json-out",
                out,
                "--quiet",
            ],
            capture_output=True,
            text=True,
            timeout=900,
        )
    finally:
        subprocess.run(
            [sys.executable, os.path.join(HERE, "peer.py"), "stop", info["PID"]],
            capture_output=True,
        )
        if schema:
            drop_schema(args.pg, schema)
        os.remove(db)
    with open(out) as fh:
        d = json.load(fh)
    print(
        f"  {backend} trial {n}: {d['groups']} groups, {d['items_per_s']} items/s, "
        f"{d['items_per_server_s']} items/s in requests, polls {d['polls']}, "
        f"p99 {d['poll_ms_p99']} ms, violations {d['violation_count']}",
        flush=True,
    )
    return d


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--groups", type=int, default=256)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompt-bytes", type=int, default=2048)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--port", type=int, default=18081)
    p.add_argument("--pg", default="postgresql://root@127.0.0.1:5432/test")
    p.add_argument("--workdir", default=None)
    args = p.parse_args(argv)
    work = args.workdir or tempfile.mkdtemp(prefix="rb-pgbench-")
    os.makedirs(work, exist_ok=True)
    template = os.path.join(work, "template.db")
    gen = run(
        [
            sys.executable,
            os.path.join(BENCH, "gen_rows.py"),
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
        f"pg_bench: {summary['rows']} rows, {summary['complete_groups']} complete groups",
        flush=True,
    )
    results: dict[str, list[dict]] = {"sqlite": [], "postgres": []}
    for n in range(1, args.repeat + 1):
        for backend in ("sqlite", "postgres"):
            results[backend].append(
                trial(backend, template, args, work, n, summary["complete_groups"])
            )
    med = {
        b: {
            k: statistics.median(d[k] for d in ds)
            for k in (
                "items_per_s",
                "items_per_server_s",
                "polls",
                "poll_ms_p99",
                "violation_count",
            )
        }
        for b, ds in results.items()
    }
    print("\n| backend | items/s | items/s in requests | polls | poll p99 ms | violations |")
    print("|---|---|---|---|---|---|")
    for b, m in med.items():
        print(
            f"| {b} | {m['items_per_s']:.0f} | {m['items_per_server_s']:.0f} | {m['polls']:.0f} | "
            f"{m['poll_ms_p99']:.1f} | {m['violation_count']:.0f} |"
        )
    ratio = med["postgres"]["items_per_server_s"] / med["sqlite"]["items_per_server_s"]
    print(f"\nPostgres / SQLite, items/s in requests: {ratio:.2f} (target >= 0.5, i.e. within 2x)")
    return 1 if any(m["violation_count"] for m in med.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
