"""``rollout-buffer demo``: the whole system on one machine, with no configuration.

It says what is about to happen, makes a work directory (SQLite database, logs; a temporary one
is removed at the end unless ``--workdir`` names one), starts the service under gunicorn as a
subprocess with the built-in simulated launcher (the original's defaults: message-cut 0,
max-steps 10, so each session gives one item), prints the status page's URL, then acts as a
trainer with :class:`rollout_buffer.client.BufferClient`: one ``/start_rollout``, then polls
``/get_rollout_data`` with a live progress line until the launcher has finished and nothing is
pending or ready. The progress line counts from the job's start. Notices (the launcher's end,
the client's warnings) come on lines of their own, in the demo's words.

Every group received is checked (exactly K distinct sessions, one reward per session, never a
group twice), a summary table is printed that explains every drop, and the server is stopped
(with ``--keep`` only after Ctrl-C, so the page can be looked at). The summary names the
database and the logs only when they are kept (``--workdir``).

Exit status: 0 when every check passed and at least one group was served, 1 otherwise
(including a timeout or a server that did not start), 130 on Ctrl-C.

Owns: the demo's work directory, its trainer loop, checks and summary. It must not reach into the
service: it runs it through the runner and talks to it through the client, as a user would.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
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
RATE_AFTER_S = 1.0  # the progress line shows a rate once the job has run this long


# --policies: what the demo turns on (the simulator's weight_version moves every 0.2 s, and a
# fifth of its groups end with equal rewards, so each policy has something to do)
POLICY_ENV = {
    "ROLLOUT_BUFFER_MAX_OFF_POLICY": "3",
    "ROLLOUT_BUFFER_DROP_ZERO_VARIANCE": "1",
    "ROLLOUT_BUFFER_OVERSAMPLE": "1",
}


# Salvage (issue 38): the settings the demo passes on from its own environment to the server
SALVAGE_SETTINGS = ("ROLLOUT_BUFFER_SALVAGE", "ROLLOUT_BUFFER_SALVAGE_REWARD")


def salvage_env(environ: dict[str, str] | os._Environ[str]) -> dict[str, str]:
    """The salvage settings of the demo's environment (``ROLLOUT_BUFFER_SALVAGE=truncate
    rollout-buffer demo``): the server gets them, and every other rollout-buffer setting is
    scrubbed."""
    return {name: environ[name] for name in SALVAGE_SETTINGS if name in environ}


def server_env(
    db_url: str,
    run_dir: str,
    *,
    groups: int,
    pace: float,
    policies: bool = False,
    seed: int | None = None,
    salvage: dict[str, str] | None = None,
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
            **(POLICY_ENV if policies else {}),
            **(salvage or {}),
        }
    )


def _finished(stats: dict[str, Any]) -> bool:
    """The launcher has finished, every row is read and no group is pending, ready or in flight."""
    launcher = stats.get("launcher") or {}
    groups = stats.get("groups") or {}
    if not launcher.get("finished") or stats.get("lag_rows") != 0:
        return False
    return sum(int(groups.get(k) or 0) for k in ("pending", "ready", "in_flight")) == 0


def progress_line(elapsed: float, checker: Checker, stats: dict[str, Any]) -> str:
    """The live line: time since the job started, the groups by state, the items received, and
    the rows read per second since the job started (shown once a second has passed: over a
    shorter time the rate means nothing)."""
    g = stats.get("groups") or {}
    rows = (stats.get("rows") or {}).get("read") or 0
    line = (
        f"  {elapsed:5.1f} s  groups: {len(checker.groups):3d} served, "
        f"{g.get('pending', 0):3d} pending, {g.get('dropped_total', 0):3d} dropped  "
        f"items {checker.items:5d}"
    )
    if elapsed >= RATE_AFTER_S:
        line += f"  {rows / elapsed:5.0f} rows/s"
    return line


def launcher_notice(launcher: dict[str, Any], kept: bool) -> str:
    """What the demo says once its launcher has finished, in the demo's words."""
    code = launcher.get("exit_code")
    if code == 0:
        return "  the simulated launcher has played every session; the last groups come next"
    where = (
        f" (its log: {launcher.get('log_path')})"
        if kept and launcher.get("log_path")
        else " (keep its log with --workdir DIR)"
    )
    return f"  the simulated launcher stopped early, with exit code {code}{where}"


class NoticeHandler(logging.Handler):
    """The package's warnings, each on a line of its own between the progress line's updates.
    The client's notice that the launcher exited is left out: the demo says it in its own words
    (the client's speaks to a trainer, of /start_rollout and of a log on the server)."""

    def __init__(self, progress: Progress) -> None:
        super().__init__(logging.WARNING)
        self.progress = progress

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "launcher_exited", False):
            return
        self.progress.note(f"  {record.levelname.lower()}: {record.getMessage()}")


@contextlib.contextmanager
def notices_through(progress: Progress) -> Iterator[None]:
    """While the demo runs, the package's log records go through ``progress`` (not to stderr,
    where they would be glued to the progress line)."""
    package = logging.getLogger("rollout_buffer")
    handler = NoticeHandler(progress)
    propagate = package.propagate
    package.addHandler(handler)
    package.propagate = False
    try:
        yield
    finally:
        package.removeHandler(handler)
        package.propagate = propagate


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo (see the module docstring). Returns the exit status."""
    groups, k, pace, timeout = int(args.groups), int(args.k), float(args.pace), float(args.timeout)
    if groups < 1 or k < 1 or pace < 0 or timeout <= 0:
        print(
            f"rollout-buffer demo: invalid arguments groups={groups} k={k} pace={pace} "
            f"timeout={timeout}: "
            "expected groups >= 1, k >= 1, pace >= 0, timeout > 0",
            file=sys.stderr,
        )
        return 2
    named = args.workdir
    workdir = os.path.abspath(named) if named else tempfile.mkdtemp(prefix="rollout-buffer-demo-")
    try:
        return _run(args, workdir, kept=bool(named), groups=groups, k=k, pace=pace, timeout=timeout)
    finally:
        if not named:
            shutil.rmtree(workdir, ignore_errors=True)
            print(f"\n  removed the work directory {workdir} (keep one with --workdir DIR)")


def _run(
    args: argparse.Namespace,
    workdir: str,
    *,
    kept: bool,
    groups: int,
    k: int,
    pace: float,
    timeout: float,
) -> int:
    logs = os.path.join(workdir, "logs")
    os.makedirs(logs, exist_ok=True)
    db_path = os.path.join(workdir, "demo.db")
    db_url = "sqlite://" + db_path
    server_log = os.path.join(workdir, "server.log")
    port = int(args.port or 0) or free_port()
    url = f"http://127.0.0.1:{port}"
    out = sys.stdout
    # the server's log, in what the demo prints: a temporary one is gone once the demo ends
    log_name = server_log if kept else "the server's log"

    # The launcher's tables, so the service never reads before the simulator has created them.
    init_database(db_url)

    print(
        f"rollout-buffer demo: {groups} groups x K={k} sessions, simulated launcher "
        f"(pace {pace:g} s/row, seed {args.seed})"
    )
    print(
        "  What happens: the service starts under gunicorn on SQLite and starts the simulated\n"
        "  launcher, which plays K sessions per prompt group and writes one row per step. The\n"
        "  service groups the rows until all K sessions of a group have a result, and this demo\n"
        "  polls it as a trainer would, checking every group it receives. Some sessions crash or\n"
        "  hit the step cap, as real ones do: their groups can never complete and are dropped,\n"
        "  and the summary says why (with ROLLOUT_BUFFER_SALVAGE=truncate such groups are\n"
        "  served with those sessions truncated, unless one of them wrote no row at all)."
    )
    print(
        f"  work dir {workdir}"
        + ("" if kept else "  (removed at the end; keep it with --workdir DIR)")
    )
    print(f"  server   {url}")
    print(f"  status page  {url}/  (open it in a browser while the demo runs)")
    policies = bool(args.policies)
    salvage = salvage_env(os.environ)
    salvaging = salvage.get("ROLLOUT_BUFFER_SALVAGE", "off").strip().lower() == "truncate"
    if salvage:
        print("  salvage  " + ", ".join(f"{k}={v}" for k, v in salvage.items()))
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
            seed=args.seed,
            salvage=salvage,
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
            print(f"--- last lines of {log_name} ---\n{log_tail(server_log)}", file=sys.stderr)
            return 1
        client = BufferClient(url, timeout=60.0, retries=5, backoff_s=0.2, backoff_max_s=2.0)
        with notices_through(progress):
            result = _trainer(client, progress, k=k, timeout=timeout, kept=kept)
        checker, stats, job_time, timed_out = result
        wall = time.monotonic() - started
        progress.end()
        code = summarize(
            out,
            checker,
            stats,
            wall=wall,
            job_time=job_time,
            paths=(
                {"database": db_path, "logs": f"{logs}  (server: {server_log})"} if kept else {}
            ),
            timed_out=timed_out,
            timeout=timeout,
            policies=policies,
            salvage=salvaging,
        )
        if args.keep:
            print(f"\n  the server stays up at {url}/ (status page); Ctrl-C stops it", flush=True)
            _wait_for_ctrl_c()
        return code
    except BufferError as exc:
        progress.end()
        print(f"rollout-buffer demo: the buffer failed: {exc}", file=sys.stderr)
        print(f"--- last lines of {log_name} ---\n{log_tail(server_log)}", file=sys.stderr)
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
                f"rollout-buffer demo: the server exited with code {exit_code} (see {log_name})",
                file=sys.stderr,
            )


def _trainer(
    client: BufferClient, progress: Progress, *, k: int, timeout: float, kept: bool
) -> tuple[Checker, dict[str, Any], float, bool]:
    """Start the job and poll it as a trainer would, until the launcher has finished and every
    group is decided. Returns what was received, the last /stats, the job's time (from the
    start of /start_rollout) and whether it timed out."""
    t0 = time.monotonic()  # the job starts with /start_rollout: every rate counts from here
    started_doc = client.start_rollout(num_repeat_per_sample=k)
    progress.note(
        f"  job      {started_doc.get('job_session')}  (launcher pid {started_doc.get('pid')})"
    )
    checker = Checker(k)
    stats: dict[str, Any] = {}
    stats_at = 0.0
    told_exit = False
    while True:
        if time.monotonic() - t0 > timeout:
            return checker, stats, time.monotonic() - t0, True
        doc = client.get_rollout_data()
        got = groups_of(doc) if doc.get("success") else []
        for gid, items in got:
            checker.add(gid, items)
        now = time.monotonic()
        if not got or now - stats_at >= POLL_INTERVAL_S:
            stats = client.stats()
            stats_at = time.monotonic()
            elapsed = stats_at - t0
            launcher = stats.get("launcher") or {}
            if launcher.get("finished") and not told_exit:
                told_exit = True
                progress.note(launcher_notice(launcher, kept))
            progress.show(progress_line(elapsed, checker, stats))
            if not got and _finished(stats):
                progress.show(progress.last_text, force=True)
                return checker, client.stats(), elapsed, False
        if not got:
            time.sleep(POLL_INTERVAL_S)


def _wait_for_ctrl_c() -> None:
    """Block until Ctrl-C (SIGINT) or SIGTERM, then return, so the caller stops the server. The
    two signals are blocked, then waited for: one that comes at any moment is taken. (With
    signal.pause(), a signal between Python's check for signals and the pause itself was taken by
    the handler, and the pause then waited for another one forever.)"""

    def interrupt(_signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    wanted = {signal.SIGINT, signal.SIGTERM}
    previous = signal.signal(signal.SIGTERM, interrupt)  # as Ctrl-C, until it is blocked
    try:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, wanted)
        try:
            signal.sigwait(wanted)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
    except KeyboardInterrupt:  # it came before the signals were blocked
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
    print("  stopping the server", flush=True)
