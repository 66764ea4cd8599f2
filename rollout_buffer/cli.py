"""Command line: ``rollout-buffer serve | init-db | demo | stats | export | settings``, and the
``/stats`` table that ``stats`` prints."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Sequence

from . import __version__


def cmd_serve(args: argparse.Namespace) -> int:
    """Run the service under gunicorn with rollout_buffer.gunicorn_conf (1 gthread worker)."""
    from .config import Config
    from .errors import ConfigError

    if args.port is not None:
        os.environ["BUFFER_SERVER_PORT"] = str(args.port)
    if args.host is not None:
        os.environ["ROLLOUT_BUFFER_HOST"] = args.host
    try:
        Config.from_env()  # fail here, with the variable named, rather than inside gunicorn
    except ConfigError as exc:
        print(f"rollout-buffer: {exc}", file=sys.stderr)
        return 2
    argv = [sys.executable, "-m", "gunicorn", "-c", "python:rollout_buffer.gunicorn_conf",
            "rollout_buffer.app:create_app()"]
    os.execv(sys.executable, argv)
    return 0  # pragma: no cover


def cmd_init_db(args: argparse.Namespace) -> int:
    """Create the launcher's tables (and the buffer's own) if they are missing."""
    from .store import init_database

    print(f"tables ready in {init_database(args.db)}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args)


def cmd_stats(args: argparse.Namespace) -> int:
    from .client import BufferClient

    client = BufferClient(args.url, token=args.token or os.environ.get("ROLLOUT_BUFFER_TOKEN"))
    if args.watch:
        from .client import BufferError
        from .progress import watch

        def render() -> str:
            try:
                stats = client.stats()
            except BufferError as exc:  # keep watching: the service may come back
                return f"  cannot read {args.url}/stats: {exc}"
            return json.dumps(stats, indent=1) if args.json else format_stats(stats)
        return watch(render, sys.stdout, interval=args.interval, count=args.count, title=f"rollout-buffer {args.url}")
    stats = client.stats()
    print(json.dumps(stats, indent=1) if args.json else format_stats(stats))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """Write every decided group of a job as JSONL (see README "Export format")."""
    from .export import main_export

    return main_export(args.db, args.state_db, args.job, args.out, args.what)


def cmd_settings(args: argparse.Namespace) -> int:
    from .config import settings_table

    print(settings_table())
    return 0


# -- /stats as a table --------------------------------------------------------------------------------
def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.3f}".rstrip("0").rstrip(".") if v != int(v) else f"{int(v)}"
    return str(v)


def _by_reason(d: Any) -> str:
    if not isinstance(d, dict) or not d:
        return ""
    return "  (" + ", ".join(f"{k}: {v}" for k, v in sorted(d.items())) + ")"


def format_stats(stats: dict[str, Any]) -> str:
    """GET /stats as a readable fixed-width table."""
    rows: list[tuple[str, str]] = []

    def add(label: str, value: Any, extra: str = "") -> None:
        rows.append((label, _fmt(value) + extra))

    def section(title: str) -> None:
        rows.append(("", ""))
        rows.append((f"[{title}]", ""))

    job = stats.get("job_session") or stats.get("job_id")
    add("job", job if job is not None else "(none: no /start_rollout yet)")
    if "k" in stats:
        add("K (sessions per group)", stats.get("k"))
    lease = stats.get("lease")
    if isinstance(lease, dict) and lease.get("role"):
        add("role", lease.get("role"))  # owner, standby (its /health names the owner) or starting
    add("database", stats.get("database"))
    r = stats.get("rows")
    if isinstance(r, dict):
        section("rows")
        add("read", r.get("read"))
        add("served", r.get("served"))
        add("dropped", r.get("dropped_total"), _by_reason(r.get("dropped")))
        add("rejected", r.get("rejected_total"), _by_reason(r.get("rejected")))
        add("pending", r.get("pending"))
        if "accounting_balanced" in stats:
            add("accounting balanced", stats.get("accounting_balanced"))
    g = stats.get("groups")
    if isinstance(g, dict):
        section("groups")
        add("pending", g.get("pending"))
        add("ready", g.get("ready"))
        if "in_flight" in g:
            add("in flight", g.get("in_flight"))
        add("served", g.get("served"))
        add("dropped", g.get("dropped_total"), _by_reason(g.get("dropped")))
    if r is not None or "cursor" in stats:
        section("ingest")
        add("cursor (last id read)", stats.get("cursor"))
        if stats.get("floor_pk"):
            add("restart floor id", stats.get("floor_pk"))
        add("lag (rows not yet read)", stats.get("lag_rows"))
        age = stats.get("oldest_pending_group_age_s")
        add("oldest pending group age", None if age is None else f"{age:.1f} s")
    la = stats.get("launcher")
    if isinstance(la, dict):
        section("launcher")
        add("running", la.get("running"))
        add("pid", la.get("pid"))
        add("exit code", la.get("exit_code"))
        add("restarts", la.get("restarts"))
        add("finished", la.get("finished"))
        if la.get("stopped_by"):
            add("stopped by", la.get("stopped_by"))
        if la.get("log_path"):
            add("log", la.get("log_path"))
    px = stats.get("proxy_notifications")
    if isinstance(px, dict):
        section("proxy")
        add("sessions pending clear", px.get("sessions"), _by_reason(px.get("reasons")))
        if "failures" in px:
            add("delivery failures", px.get("failures"))
    polls = stats.get("polls")
    if isinstance(polls, dict):
        section("polls")
        add("count", polls.get("count"))
        add("with data", polls.get("with_data"))
    width = max(len(label) for label, _ in rows)
    lines = []
    for label, value in rows:
        if not label and not value:
            lines.append("")
        elif label.startswith("[") and not value:
            lines.append(label)
        else:
            lines.append(f"  {label:<{width}}  {value}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rollout-buffer`` command."""
    p = argparse.ArgumentParser(prog="rollout-buffer", description=__doc__)
    p.add_argument("--version", action="version", version=f"rollout-buffer {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run the service under gunicorn (settings from the environment)")
    s.add_argument("--host", help="bind address (ROLLOUT_BUFFER_HOST, default 0.0.0.0)")
    s.add_argument("--port", type=int, help="port (BUFFER_SERVER_PORT, default 18889)")
    s.set_defaults(func=cmd_serve)
    s = sub.add_parser("init-db", help="create the launcher's tables if missing")
    s.add_argument("--db", required=True, help="sqlite:///abs/path, sqlite://rel/path or postgresql://...")
    s.set_defaults(func=cmd_init_db)
    s = sub.add_parser("demo", help="one-command demo: SQLite, server, simulated launcher, a polling trainer")
    s.add_argument("--dir", help="work directory (default: a new temporary directory)")
    s.add_argument("--groups", type=int, default=24, help="prompt groups the simulator runs")
    s.add_argument("--k", type=int, default=4, help="sessions per group")
    s.add_argument("--port", type=int, default=0, help="port (default: a free one)")
    s.add_argument("--pace", type=float, default=0.02, help="simulator seconds between rows")
    s.add_argument("--timeout", type=float, default=300.0, help="give up after this many seconds")
    s.set_defaults(func=cmd_demo)
    s = sub.add_parser("stats", help="print GET /stats of a running service as a table")
    s.add_argument("url", nargs="?", default="http://127.0.0.1:18889")
    s.add_argument("--token", help="bearer token (default $ROLLOUT_BUFFER_TOKEN)")
    s.add_argument("--json", action="store_true", help="print the raw JSON")
    s.add_argument("--watch", action="store_true", help="refresh in place until Ctrl-C")
    s.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes with --watch")
    s.add_argument("--count", type=int, default=0, help="with --watch: stop after this many refreshes (0 = never)")
    s.set_defaults(func=cmd_stats)
    s = sub.add_parser("export", help="write every served and dropped group of a job as JSONL (.gz: gzipped)")
    s.add_argument("--db", required=True, help="the launcher database URL (as AIEVOBOX_DB_URL)")
    s.add_argument("--state-db", help="the buffer's state database, when ROLLOUT_BUFFER_STATE_DB_URL is set")
    s.add_argument("--job", required=True, help="the job (job_session)")
    s.add_argument("--out", required=True, help="output file; gzipped when it ends in .gz")
    s.add_argument("--what", choices=("served", "dropped", "all"), default="all",
                   help="served groups, dropped groups and rejected rows, or all")
    s.set_defaults(func=cmd_export)
    s = sub.add_parser("settings", help="print every setting as a markdown table")
    s.set_defaults(func=cmd_settings)
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
