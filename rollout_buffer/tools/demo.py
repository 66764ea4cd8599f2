"""``rollout-buffer demo``: the whole system on one machine, with no configuration.

It says what is about to happen, makes a work directory (SQLite database, logs; a temporary one
is removed at the end unless ``--workdir`` names one), starts the service under gunicorn as a
subprocess with the built-in simulated launcher (the original's defaults: message-cut 0,
max-steps 10, so each session gives one item), prints the status page's URL, then acts as a
trainer with
:class:`rollout_buffer.client.BufferClient`: one ``/start_rollout``, then polls
``/get_rollout_data`` with a live progress line until the launcher has finished and nothing is
pending or ready. Every group received is checked (exactly K distinct sessions, one reward per
session, never a group twice), a summary table is printed that explains every drop, and the
server is stopped (with ``--keep`` only after Ctrl-C, so the page can be looked at).

Exit status: 0 when every check passed and at least one group was served, 1 otherwise
(including a timeout or a server that did not start), 130 on Ctrl-C.

Owns: the demo's work directory, its trainer loop, checks and summary. It must not reach into the
service: it runs it through the runner and talks to it through the client, as a user would.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from typing import Any

from rollout_buffer.client import BufferClient, BufferError, groups_of
from rollout_buffer.storage.store import init_database
from rollout_buffer.tools.demo_summary import Checker, summarize
from rollout_buffer.tools.progress import Progress
from rollout_buffer.tools.runner import ServerProcess, clean_env, free_port, log_tail

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 30.0
POLL_INTERVAL_S = 0.5
STOP_WAIT_S = 15.0


# --policies: what the demo turns on (the simulator's weight_version moves every 0.2 s, and a
# fifth of its groups end with equal rewards, so each policy has something to do)
POLICY_ENV = {
    "ROLLOUT_BUFFER_MAX_OFF_POLICY": "3",
    "ROLLOUT_BUFFER_DROP_ZERO_VARIANCE": "1",
    "ROLLOUT_BUFFER_OVERSAMPLE": "1",
}


def server_env(
    db_url: str,
    run_dir: str,
    *,
    groups: int,
    pace: float,
    policies: bool = False,
    seed: int | None = None,
) -> dict[str, str]:
    """The server's environment: ours without any rollout-buffer setting, plus the demo's."""
    # the original's launcher defaults (message-cut 0, max-steps 10) come with the argv
    sim = f"--groups {groups} --pace {pace} --flush-interval 0.5" + (
        " --flat-rate 0.2 --weight-version-interval 0.2" if policies else ""
    )
    if seed is not None:
        sim += f" --seed {seed}"
    return clean_env(
        {
            "AIEVOBOX_DB_URL": db_url,
            "AIEVOBOX_RUN_DIR": run_dir,
            "ROLLOUT_BUFFER_LAUNCHER": "simulate",
            "ROLLOUT_BUFFER_SIMULATE_ARGS": sim,
            "AIEVOBOX_BUFFER_INCOMPLETE_GROUP_TTL_SECONDS": "60",
            "ROLLOUT_BUFFER_STOP_GRACE_SECONDS": "5",
            "ROLLOUT_BUFFER_GRACEFUL_TIMEOUT_SECONDS": "20",
            **(POLICY_ENV if policies else {}),
        }
    )


def _finished(stats: dict[str, Any]) -> bool:
    """The launcher has finished, every row is read and no group is pending, ready or in flight."""
    launcher = stats.get("launcher") or {}
    groups = stats.get("groups") or {}
    if not launcher.get("finished") or stats.get("lag_rows") != 0:
        return False
    return sum(int(groups.get(k) or 0) for k in ("pending", "ready", "in_flight")) == 0


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo (see the module docstring). Returns the exit status."""
    groups = int(getattr(args, "groups", 24))
    k = int(getattr(args, "k", 4))
    pace = float(getattr(args, "pace", 0.005))
    timeout = float(getattr(args, "timeout", 300.0))
    if groups < 1 or k < 1 or pace < 0 or timeout <= 0:
        print(
            f"rollout-buffer demo: invalid arguments groups={groups} k={k} pace={pace} "
            f"timeout={timeout}: "
            "expected groups >= 1, k >= 1, pace >= 0, timeout > 0",
            file=sys.stderr,
        )
        return 2
    named = getattr(args, "workdir", None) or getattr(args, "dir", None)
    workdir = os.path.abspath(named) if named else tempfile.mkdtemp(prefix="rollout-buffer-demo-")
    try:
        return _run(args, workdir, groups=groups, k=k, pace=pace, timeout=timeout)
    finally:
        if not named:
            shutil.rmtree(workdir, ignore_errors=True)
            print(f"  removed the work directory {workdir} (keep one with --workdir DIR)")


def _run(
    args: argparse.Namespace, workdir: str, *, groups: int, k: int, pace: float, timeout: float
) -> int:
    logs = os.path.join(workdir, "logs")
    os.makedirs(logs, exist_ok=True)
    db_path = os.path.join(workdir, "demo.db")
    db_url = "sqlite://" + db_path
    server_log = os.path.join(workdir, "server.log")
    port = int(getattr(args, "port", 0) or 0) or free_port()
    url = f"http://127.0.0.1:{port}"
    out = sys.stdout

    # The launcher's tables, so the service never reads before the simulator has created them.
    init_database(db_url)

    print(
        f"rollout-buffer demo: {groups} groups x K={k} sessions, simulated launcher "
        f"(pace {pace:g} s/row)"
    )
    print(
        "  What happens: the service starts under gunicorn on SQLite and starts the simulated\n"
        "  launcher, which plays K sessions per prompt group and writes one row per step. The\n"
        "  service groups the rows until all K sessions of a group have a result, and this demo\n"
        "  polls it as a trainer would, checking every group it receives. Some sessions crash or\n"
        "  hit the step cap, as real ones do: their groups can never complete and are dropped,\n"
        "  and the summary says why."
    )
    print(f"  work dir {workdir}")
    print(f"  server   {url}  (log {server_log})")
    print(f"  status page  {url}/  (open it in a browser while the demo runs)")
    policies = bool(getattr(args, "policies", False))
    if policies:
        print(
            "  policies "
            + ", ".join(f"{k.replace('ROLLOUT_BUFFER_', '')}={v}" for k, v in POLICY_ENV.items())
        )
    server = ServerProcess(
        port,
        server_env(
            db_url,
            logs,
            groups=groups,
            pace=pace,
            policies=policies,
            seed=getattr(args, "seed", None),
        ),
        server_log,
        cwd=workdir,
    )
    started = time.monotonic()
    server.spawn()
    client: BufferClient | None = None
    progress = Progress(out)
    try:
        problem = server.wait_healthy(HEALTH_TIMEOUT_S)
        if problem:
            print(f"rollout-buffer demo: the server did not start: {problem}", file=sys.stderr)
            print(f"--- last lines of {server_log} ---\n{log_tail(server_log)}", file=sys.stderr)
            return 1
        client = BufferClient(url, timeout=60.0, retries=5, backoff_s=0.2, backoff_max_s=2.0)
        started_doc = client.start_rollout(num_repeat_per_sample=k)
        job = started_doc.get("job_session")
        print(f"  job      {job}  (launcher pid {started_doc.get('pid')})")
        checker = Checker(k)
        t0 = time.monotonic()
        stats: dict[str, Any] = {}
        stats_at = 0.0
        timed_out = False
        while True:
            elapsed = time.monotonic() - t0
            if elapsed > timeout:
                timed_out = True
                break
            doc = client.get_rollout_data()
            got = groups_of(doc) if doc.get("success") else []
            for gid, items in got:
                checker.add(gid, items)
            now = time.monotonic()
            if not got or now - stats_at >= POLL_INTERVAL_S:
                stats = client.stats()
                stats_at = now
                g = stats.get("groups") or {}
                r = stats.get("rows") or {}
                rate = (r.get("read") or 0) / max(elapsed, 1e-6)
                progress.show(
                    f"  {elapsed:6.1f} s  groups {len(checker.groups):4d}  "
                    f"items {checker.items:6d}  "
                    f"{rate:8.0f} rows/s  pending {g.get('pending', 0):3d}  "
                    f"dropped {g.get('dropped_total', 0):3d}"
                )
                if not got and _finished(stats):
                    progress.show(progress.last_text, force=True)
                    break
            if not got:
                time.sleep(POLL_INTERVAL_S)
        wall = time.monotonic() - started
        if not timed_out:
            stats = client.stats()
        progress.end()
        code = summarize(
            out,
            checker,
            stats,
            wall=wall,
            workdir=workdir,
            db_path=db_path,
            logs=logs,
            server_log=server_log,
            timed_out=timed_out,
            timeout=timeout,
            policies=policies,
        )
        if getattr(args, "keep", False):
            print(f"\n  the server stays up at {url}/ (status page); Ctrl-C stops it", flush=True)
            _wait_for_ctrl_c()
        return code
    except BufferError as exc:
        progress.end()
        print(f"rollout-buffer demo: the buffer failed: {exc}", file=sys.stderr)
        print(f"--- last lines of {server_log} ---\n{log_tail(server_log)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        progress.end()
        print("rollout-buffer demo: interrupted", file=sys.stderr)
        return 130
    finally:
        if client is not None:
            client.close()
        exit_code = server.stop(wait_s=STOP_WAIT_S)
        if exit_code not in (0, None, -signal.SIGTERM):
            print(
                f"rollout-buffer demo: the server exited with code {exit_code} (see {server_log})",
                file=sys.stderr,
            )


def _wait_for_ctrl_c() -> None:
    """Block until Ctrl-C (or SIGTERM), then return, so the caller stops the server."""

    def interrupt(_signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        while True:
            signal.pause()
    except KeyboardInterrupt:
        print("  stopping the server", flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
