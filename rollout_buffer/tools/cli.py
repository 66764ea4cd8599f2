"""Command line: ``rollout-buffer serve | init-db | demo | stats | export | settings``.

Owns: parsing the commands, their messages and exit statuses. It must not hold a command's logic:
each one calls its module, imported when the command runs (so ``rollout-buffer stats`` never imports
Flask).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from rollout_buffer import __version__


def cmd_serve(args: argparse.Namespace) -> int:
    """Run the service under gunicorn with rollout_buffer.web.gunicorn_conf (1 gthread worker)."""
    from rollout_buffer.core.config import Config
    from rollout_buffer.core.errors import ConfigError

    if args.port is not None:
        os.environ["BUFFER_SERVER_PORT"] = str(args.port)
    if args.host is not None:
        os.environ["ROLLOUT_BUFFER_HOST"] = args.host
    try:
        Config.from_env()  # fail here, with the variable named, rather than inside gunicorn
    except ConfigError as exc:
        print(f"rollout-buffer: {exc}", file=sys.stderr)
        return 2
    argv = [
        sys.executable,
        "-m",
        "gunicorn",
        "-c",
        "python:rollout_buffer.web.gunicorn_conf",
        "rollout_buffer.web.app:create_app()",
    ]
    os.execv(sys.executable, argv)
    return 0  # pragma: no cover


def cmd_init_db(args: argparse.Namespace) -> int:
    """Create the launcher's tables (and the buffer's own) if they are missing."""
    from rollout_buffer.storage.store import init_database

    print(f"tables ready in {init_database(args.db)}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from rollout_buffer.tools.demo import run_demo

    return run_demo(args)


def cmd_stats(args: argparse.Namespace) -> int:
    from rollout_buffer.client import BufferClient, BufferError
    from rollout_buffer.tools.stats_table import format_stats

    token = args.token or os.environ.get("ROLLOUT_BUFFER_TOKEN")
    if args.watch:
        from rollout_buffer.tools.progress import watch

        # one attempt per refresh, answered within the interval: the watch is the retry loop (the
        # client's own retries and their warnings would freeze the table and scribble over it)
        client = BufferClient(
            args.url, token=token, retries=0, timeout=max(1.0, min(args.interval, 10.0))
        )

        def render() -> str:
            try:
                stats = client.stats()
            except BufferError as exc:  # keep watching: the service may come back
                return f"  cannot read {args.url}/stats: {exc}"
            return json.dumps(stats, indent=1) if args.json else format_stats(stats)

        return watch(
            render,
            sys.stdout,
            interval=args.interval,
            count=args.count,
            title=f"rollout-buffer {args.url}",
        )
    try:
        stats = BufferClient(args.url, token=token, retries=1, timeout=30).stats()
    except BufferError as exc:
        print(f"rollout-buffer stats: cannot read {args.url}/stats: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(stats, indent=1) if args.json else format_stats(stats))
    return 0


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def cmd_export(args: argparse.Namespace) -> int:
    """Write every decided group of a job as JSONL (the format: docs/operations.md, "Export")."""
    from rollout_buffer.tools.export import main_export

    return main_export(args.db, args.state_db, args.job, args.out, args.what)


def cmd_settings(args: argparse.Namespace) -> int:
    """Print docs/settings.md (the page is this command's output, committed)."""
    from rollout_buffer.tools.settings_page import settings_page

    sys.stdout.write(settings_page())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rollout-buffer`` command."""
    parser = argparse.ArgumentParser(prog="rollout-buffer", description=__doc__)
    parser.add_argument("--version", action="version", version=f"rollout-buffer {__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True)
    command = sub.add_parser(
        "serve", help="run the service under gunicorn (settings from the environment)"
    )
    command.add_argument("--host", help="bind address (ROLLOUT_BUFFER_HOST, default 0.0.0.0)")
    command.add_argument("--port", type=int, help="port (BUFFER_SERVER_PORT, default 18889)")
    command.set_defaults(func=cmd_serve)
    command = sub.add_parser("init-db", help="create the launcher's tables if missing")
    command.add_argument(
        "--db", required=True, help="sqlite:///abs/path, sqlite://rel/path or postgresql://..."
    )
    command.set_defaults(func=cmd_init_db)
    command = sub.add_parser(
        "demo", help="one-command demo: SQLite, server, simulated launcher, a polling trainer"
    )
    command.add_argument(
        "--workdir",
        "--dir",
        dest="workdir",
        help="work directory, kept afterwards (default: a temporary directory, removed at the end)",
    )
    command.add_argument(
        "--seed", type=int, default=None, help="the simulator's seed (the same shape every run)"
    )
    command.add_argument(
        "--keep",
        action="store_true",
        help="leave the server up after the summary, until Ctrl-C (to look at the status page)",
    )
    command.add_argument("--groups", type=int, default=24, help="prompt groups the simulator runs")
    command.add_argument("--k", type=int, default=4, help="sessions per group")
    command.add_argument("--port", type=int, default=0, help="port (default: a free one)")
    command.add_argument("--pace", type=float, default=0.02, help="simulator seconds between rows")
    command.add_argument(
        "--timeout", type=float, default=300.0, help="give up after this many seconds"
    )
    command.add_argument(
        "--policies",
        action="store_true",
        help="turn the training-data policies on (staleness, zero variance, over-sampling) and "
        "show their counts",
    )
    command.set_defaults(func=cmd_demo)
    command = sub.add_parser("stats", help="print GET /stats of a running service as a table")
    command.add_argument("url", nargs="?", default="http://127.0.0.1:18889")
    command.add_argument("--token", help="bearer token (default $ROLLOUT_BUFFER_TOKEN)")
    command.add_argument("--json", action="store_true", help="print the raw JSON")
    command.add_argument("--watch", action="store_true", help="refresh in place until Ctrl-C")
    command.add_argument(
        "--interval", type=_positive, default=2.0, help="seconds between refreshes with --watch"
    )
    command.add_argument(
        "--count",
        type=_count,
        default=0,
        help="with --watch: stop after this many refreshes (0 = never)",
    )
    command.set_defaults(func=cmd_stats)
    command = sub.add_parser(
        "export", help="write every served and dropped group of a job as JSONL (.gz: gzipped)"
    )
    command.add_argument(
        "--db", required=True, help="the launcher database URL (as AIEVOBOX_DB_URL)"
    )
    command.add_argument(
        "--state-db", help="the buffer's state database, when ROLLOUT_BUFFER_STATE_DB_URL is set"
    )
    command.add_argument("--job", required=True, help="the job (job_session)")
    command.add_argument("--out", required=True, help="output file; gzipped when it ends in .gz")
    command.add_argument(
        "--what",
        choices=("served", "dropped", "all"),
        default="all",
        help="served groups, dropped groups and rejected rows, or all",
    )
    command.set_defaults(func=cmd_export)
    command = sub.add_parser(
        "settings", help="print the settings page (docs/settings.md): every setting, as markdown"
    )
    command.set_defaults(func=cmd_settings)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
