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
        # fail here, with the variable named, rather than inside gunicorn (which warns, once, of
        # a removed setting)
        Config.from_env(warn=False)
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


DEMO_SEED = 1  # the demo's default seed: two runs of `rollout-buffer demo` give the same counts

DESCRIPTION = """\
rollout-buffer sits between the environment side and the trainer in agentic RL.
It starts the launcher and reads the rows its sessions write. It groups them by
prompt group until all K sessions have finished, and serves complete groups to
the trainer over HTTP."""

EPILOG = """\
Start with `rollout-buffer demo`: the whole system on this machine, in under a
minute. `rollout-buffer COMMAND --help` shows a command's options. The service's
settings come from the environment: `rollout-buffer settings` lists them all."""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's lines, and shows each option's default: an option whose default
    is not a plain value says what it is in its own help."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            "default" in text
            or action.required
            or action.default in (None, False, argparse.SUPPRESS)
        ):
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    """The command line: every command, its options and their defaults."""
    parser = argparse.ArgumentParser(
        prog="rollout-buffer",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"rollout-buffer {__version__}")
    sub = parser.add_subparsers(dest="cmd", title="commands", metavar="COMMAND")

    def command(name: str, summary: str, description: str) -> argparse.ArgumentParser:
        return sub.add_parser(
            name, help=summary, description=description, formatter_class=HelpFormatter
        )

    serve = command(
        "serve",
        "run the service (gunicorn, one worker); settings come from the environment",
        "Run the service under gunicorn: one worker with threads, as in production.\n"
        "Every setting comes from the environment: `rollout-buffer settings` lists them.",
    )
    serve.add_argument(
        "--host", help="address to listen on (default: $ROLLOUT_BUFFER_HOST, else 0.0.0.0)"
    )
    serve.add_argument(
        "--port", type=int, help="port to listen on (default: $BUFFER_SERVER_PORT, else 18889)"
    )
    serve.set_defaults(func=cmd_serve)

    init_db = command(
        "init-db",
        "create the launcher's tables in a database, if they are missing",
        "Create the launcher's tables, and the buffer's own, in a database if they are\nmissing.",
    )
    init_db.add_argument(
        "--db",
        required=True,
        help="database URL: sqlite:///abs/path, sqlite://rel/path or postgresql://...",
    )
    init_db.set_defaults(func=cmd_init_db)

    demo = command(
        "demo",
        "run the whole system on this machine and poll it as a trainer would",
        "Run the whole system on this machine, with no configuration: a SQLite database,\n"
        "the service under gunicorn, the simulated launcher, and a trainer that polls and\n"
        "checks every group. The summary explains every drop. Exit status 0 when every\n"
        "check passed.",
    )
    demo.add_argument("--groups", type=int, default=24, help="prompt groups the simulator plays")
    demo.add_argument("--k", type=int, default=4, help="sessions per group, K")
    demo.add_argument(
        "--seed",
        type=int,
        default=DEMO_SEED,
        help="the simulator's seed: the same seed plays the same sessions, so the counts repeat "
        "(with --policies, staleness also depends on timing)",
    )
    demo.add_argument(
        "--pace", type=float, default=0.02, help="seconds the simulator waits between rows"
    )
    demo.add_argument(
        "--timeout", type=float, default=300.0, help="give up after this many seconds"
    )
    demo.add_argument(
        "--policies",
        action="store_true",
        help="turn the training-data policies on (staleness, zero variance, over-sampling) and "
        "explain their counts",
    )
    demo.add_argument(
        "--workdir",
        "--dir",
        dest="workdir",
        help="keep the database and the logs in this directory (default: a temporary "
        "directory, removed at the end)",
    )
    demo.add_argument(
        "--keep",
        action="store_true",
        help="leave the server up after the summary, until Ctrl-C (to look at the status page)",
    )
    demo.add_argument("--port", type=int, default=0, help="port (default: a free one)")
    demo.set_defaults(func=cmd_demo)

    stats = command(
        "stats",
        "show a running service's figures (GET /stats) as a table",
        "Show a running service's figures (GET /stats) as a table, once or refreshed.",
    )
    stats.add_argument("url", nargs="?", default="http://127.0.0.1:18889", help="the service's URL")
    stats.add_argument("--token", help="bearer token (default: $ROLLOUT_BUFFER_TOKEN, else none)")
    stats.add_argument("--json", action="store_true", help="print the raw JSON")
    stats.add_argument("--watch", action="store_true", help="refresh in place until Ctrl-C")
    stats.add_argument(
        "--interval", type=_positive, default=2.0, help="seconds between refreshes with --watch"
    )
    stats.add_argument(
        "--count",
        type=_count,
        default=0,
        help="with --watch: stop after this many refreshes (default: 0, never)",
    )
    stats.set_defaults(func=cmd_stats)

    export = command(
        "export",
        "write a job's served and dropped groups to a JSONL file",
        "Write every served and dropped group of a job, and its rejected rows, as JSONL\n"
        '(the format: docs/operations.md, "Export"). A name ending in .gz is gzipped.',
    )
    export.add_argument(
        "--db", required=True, help="the launcher's database URL (as AIEVOBOX_DB_URL)"
    )
    export.add_argument(
        "--state-db",
        help="the buffer's state database (default: the launcher's, as when "
        "ROLLOUT_BUFFER_STATE_DB_URL is unset)",
    )
    export.add_argument("--job", required=True, help="the job (its job_session)")
    export.add_argument(
        "--out", required=True, help="the output file; gzipped when its name ends in .gz"
    )
    export.add_argument(
        "--what",
        choices=("served", "dropped", "all"),
        default="all",
        help="served groups, dropped groups and rejected rows, or all",
    )
    export.set_defaults(func=cmd_export)

    settings = command(
        "settings",
        "print every setting, its default and meaning (markdown)",
        "Print every setting, its default and its meaning, as markdown: the page\n"
        "docs/settings.md is this command's output.",
    )
    settings.set_defaults(func=cmd_settings)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rollout-buffer`` command. Without a command it prints the help (the
    commands and what each does) and exits 0: nothing went wrong, the user asked what there is."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cmd is None:
        parser.print_help()
        return 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
