"""gunicorn settings for rollout-buffer: exactly one worker (in-process state), gthread, no preload.

The top-level gunicorn.conf.py imports this module, so plain ``gunicorn wsgi:app`` from the
repository root uses it; ``rollout-buffer serve`` passes it with ``-c
python:rollout_buffer.web.gunicorn_conf``. A worker count other than 1 (from WEB_CONCURRENCY,
GUNICORN_CMD_ARGS or -w) is refused at startup: N workers would mean N accumulators, N cursors and N
launchers, i.e. split or duplicated groups.

Owns: gunicorn's settings and hooks (logging, starting and stopping the service in the worker). It
must not build the app before the worker forks (no preload, no threads in the master).
"""

from __future__ import annotations

import faulthandler
import logging
import math
import os
import sys

from rollout_buffer.core.config import Config
from rollout_buffer.core.hosts import is_loopback
from rollout_buffer.core.logconfig import configure_logging

_config = Config.from_env()

wsgi_app = "rollout_buffer.web.app:create_app()"
bind = [f"{_config.host}:{_config.port}"]
workers = 1
# gthread, with request heads read in the event loop so that stalled clients never hold a thread
worker_class = "rollout_buffer.web.gunicorn_worker.HeadFirstWorker"
WORKER_CLASS = worker_class
threads = _config.threads
preload_app = False
max_requests = 0
max_requests_jitter = 0
timeout = 300  # a poll that builds a 256 MiB response must not be mistaken for a hung worker
graceful_timeout = math.ceil(_config.graceful_timeout_s)  # gunicorn accepts only an int here
keepalive = 75
loglevel = _config.log_level.lower()
# gunicorn 27 opens a control socket by default, at one path shared by every gunicorn of the user
# ($XDG_RUNTIME_DIR/gunicorn.ctl or ~/.gunicorn/gunicorn.ctl): a second instance would take it
# over, and through it anyone with access could change the worker count. The service uses none.
control_socket_disable = True
BOOT_DECISION_S = 10.0  # longest an unnamed worker waits at boot for its first look at the lease


def on_starting(server) -> None:
    """Refuse any setting that would split the in-memory state."""
    cfg = server.cfg
    problems = []
    if cfg.workers != 1:
        problems.append(f"workers={cfg.workers} (WEB_CONCURRENCY, GUNICORN_CMD_ARGS or -w)")
    # this file sets workers = 1, which silently wins over WEB_CONCURRENCY: refuse it explicitly
    web_concurrency = os.environ.get("WEB_CONCURRENCY", "").strip()
    if web_concurrency not in ("", "1"):
        problems.append(f"WEB_CONCURRENCY={web_concurrency}")
    if cfg.preload_app:
        problems.append("preload_app=True")
    if cfg.worker_class_str != WORKER_CLASS:
        problems.append(
            f"worker_class={cfg.worker_class_str} (rollout-buffer runs {WORKER_CLASS}, a gthread "
            "worker that reads request heads without tying up a thread)"
        )
    if cfg.max_requests:
        problems.append(f"max_requests={cfg.max_requests}")
    if problems:
        raise RuntimeError(
            "rollout-buffer must run as exactly 1 gthread worker without preload or "
            "max_requests (its state lives in the worker's memory); refusing " + ", ".join(problems)
        )
    config = Config.from_env()
    if config.token is None:
        for addr in cfg.bind:
            if not is_loopback(addr.rsplit(":", 1)[0].strip("[]")):
                server.log.warning(
                    "rollout-buffer listens on %s without ROLLOUT_BUFFER_TOKEN: anyone who can "
                    "reach it can start rollouts and take groups; set a token",
                    addr,
                )


def nworkers_changed(server, new_value, old_value) -> None:
    """Refuse TTIN/TTOU: a second worker would duplicate the state."""
    if new_value != 1:
        server.log.error("refusing to run %s workers; rollout-buffer needs exactly 1", new_value)
        server.num_workers = 1


def post_fork(server, worker) -> None:
    """Configure logging in the worker before the app is loaded."""
    configure_logging(Config.from_env())


def post_worker_init(worker) -> None:
    """The app is loaded in this worker: start the service (background thread, notifier)."""
    service = worker.wsgi.extensions["rollout_buffer"]
    service.start(host=worker)  # SIGTERM (worker.alive turns False): waiting long-polls answer
    # An unnamed instance next to a live owner must not run: failing the boot makes gunicorn (and
    # `rollout-buffer serve`) exit 3 with the message. Found only later (the database was down at
    # boot), the worker stops, and the next one fails its boot the same way.
    service.on_refused = lambda: setattr(worker, "alive", False)
    lease = service.lease
    unnamed = lease.enabled and not lease.buffer  # (only it can be refused)
    if unnamed and lease.decided.wait(BOOT_DECISION_S) and lease.refused:
        raise RuntimeError(lease.refused)


def worker_abort(worker) -> None:
    """gunicorn aborts a worker that stopped answering it (its timeout): that is a crash, not a
    stop."""
    worker.rb_crashed = True


def worker_exit(server, worker) -> None:
    """Stop the service when the worker exits; also runs after a failed boot. The launcher is
    stopped only when the worker was asked to stop (SIGTERM, SIGINT): a worker that crashed (an
    exception out of its loop, an abort) leaves it running, as a kill -9 would, and the next worker
    adopts it."""
    app = getattr(worker, "wsgi", None)
    service = getattr(app, "extensions", {}).get("rollout_buffer") if app is not None else None
    if service is not None:
        service.stop(keep_launcher=worker.alive or getattr(worker, "rb_crashed", False))


def worker_int(worker) -> None:
    """On SIGINT/SIGQUIT, dump every thread's stack: the way to see a hung thread."""
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    logging.getLogger("rollout_buffer").warning(
        "worker interrupted; thread stacks dumped to stderr"
    )
