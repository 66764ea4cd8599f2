"""Configuration: the one settings table, read once from the environment, typed and strict.

Every field of :class:`Config` is a row of the table. A setting names its environment variable,
parser and help; a constant is a threshold nobody would tune, documented with its reason. The
settings page is generated from the same fields (``rollout-buffer settings``). Precedence: defaults
< environment < explicit overrides (``Config.from_env(env, **over)``). A bad value fails at startup
naming the variable, the value and what was expected, and so does an unknown ``ROLLOUT_BUFFER_*``
variable (a typo must not silently fall back). A removed setting is still accepted for this release,
with one warning naming what replaced it, and ignored.

Owns: the table, the frozen Config built from it, and the checks across settings (database URLs,
the launcher command template, the gate's exposure). It must not read the environment after
startup, nor open anything: a URL is checked, never connected to. Parsing one value is
:mod:`~rollout_buffer.core.parsers`'.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rollout_buffer.core.errors import ConfigError
from rollout_buffer.core.hosts import is_loopback, parse_allowed_hosts
from rollout_buffer.core.model import Policy
from rollout_buffer.core.parsers import (
    boolean,
    choice,
    command_line,
    http_url,
    integer,
    lease_seconds,
    number,
    optional_integer,
    optional_text,
    path_secret,
    text,
)
from rollout_buffer.core.parsers import buffer_name as parse_buffer_name
from rollout_buffer.core.parsers import log_level as parse_log_level
from rollout_buffer.core.redact import redact

logger = logging.getLogger(__name__)
_warned: set[str] = set()  # removed settings warned of in this process

PREFIX = "ROLLOUT_BUFFER_"
_UNSET: Any = object()


def setting(
    env: str,
    default: Any,
    parse: Callable[[str], Any],
    help: str,
    *,
    aliases: tuple[str, ...] = (),
    shown: Any = _UNSET,
) -> Any:
    """A field read from the environment variable ``env``; ``shown`` is the default the settings
    page shows when the field's own is computed at startup (None: described in ``help``)."""
    shown = default if shown is _UNSET else shown
    meta = {"env": env, "parse": parse, "help": help, "aliases": aliases, "shown": shown}
    return dataclasses.field(default=default, metadata=meta)


def constant(value: Any, why: str, *, shown: Any = _UNSET) -> Any:
    """A field no environment variable sets: a threshold nobody would tune, with its reason.
    Tests and embedding code may still pass another value."""
    shown = value if shown is _UNSET else shown
    return dataclasses.field(default=value, metadata={"constant": why, "shown": shown})


@dataclass(frozen=True)
class Config:
    """Validated settings and constants; build it with :meth:`from_env` (or directly in tests).

    The original's variables come first, with their names, meanings and defaults (SPEC §6):
    renaming one breaks an existing deployment. Then rollout-buffer's own ``ROLLOUT_BUFFER_*``.
    """

    port: int = setting("BUFFER_SERVER_PORT", 18889, integer(1, 65535), "HTTP port")
    storage_type: str = setting(
        "STORAGE_TYPE",
        "sqlite",
        choice("sqlite", "postgres"),
        "sqlite or postgres; default: taken from the database URL",
        shown=None,
    )
    db_url: str = setting(
        "AIEVOBOX_DB_URL",
        "sqlite:///./rollout_buffer.db",
        text,
        "launcher database URL: sqlite:///abs/path, sqlite://rel/path or "
        "postgresql://user@host:port/db; "
        "default sqlite:///$AIEVOBOX_ROOT/rl/rl.db, or sqlite:///./rollout_buffer.db without "
        "AIEVOBOX_ROOT",
        shown=None,
    )
    aievobox_root: str | None = setting(
        "AIEVOBOX_ROOT",
        None,
        optional_text,
        "AIEvoBox checkout; when set, its launcher.py is the launcher, otherwise the built-in "
        "simulator is",
    )
    run_dir: str = setting(
        "AIEVOBOX_RUN_DIR",
        "./logs",
        optional_text,
        "log directory; default $AIEVOBOX_ROOT/logs, or ./logs without AIEVOBOX_ROOT",
        shown=None,
    )
    proxy_host: str | None = setting(
        "LLM_PROXY_HOST",
        None,
        optional_text,
        "LLM proxy host; unset disables clear_sessions notifications (one warning)",
    )
    proxy_port: int | None = setting("LLM_PROXY_PORT", None, integer(1, 65535), "LLM proxy port")
    ttl_s: float = setting(
        "AIEVOBOX_BUFFER_INCOMPLETE_GROUP_TTL_SECONDS",
        1800.0,
        number(),
        "drop an incomplete group after this many idle seconds (<= 0 disables)",
    )
    aievobox_mode: str = setting("AIEVOBOX_MODE", "local", text, "launcher --mode")
    env_config: str | None = setting(
        "AIEVOBOX_ENV_CONFIG", None, optional_text, "launcher --env-config (wins over --env-root)"
    )
    env_root: str | None = setting("AIEVOBOX_ENV_ROOT", None, optional_text, "launcher --env-root")
    rl_model: str = setting("RL_MODEL", "default", text, "launcher --llm-model")
    llm_temperature: float = setting(
        "LLM_TEMPERATURE", 1.0, number(0.0), "launcher --llm-temperature"
    )
    max_steps: int = setting("AIEVOBOX_MAX_STEPS", 10, integer(1), "launcher --max-steps")
    message_cut: int = setting("AIEVOBOX_MESSAGE_CUT", 0, integer(), "launcher --message-cut")
    pool_size: int = setting("AIEVOBOX_POOL_SIZE", 16, integer(1), "launcher --pool-size")
    multiplier: float = setting(
        "AIEVOBOX_MULTIPLIER",
        1.2,
        number(0.0),
        "launcher --multiplier (the original's misspelled AIEVOBOC_MULTIPLIER is accepted with a "
        "warning)",
        aliases=("AIEVOBOC_MULTIPLIER",),
    )
    rl_epoch: int = setting("RL_EPOCH", 1, integer(0), "launcher --rl-epoch")
    env_transport: str = setting("AIEVOBOX_ENV_TRANSPORT", "http", text, "launcher --env-transport")
    # --- rollout-buffer's own settings ---
    host: str = setting(PREFIX + "HOST", "0.0.0.0", text, "address to bind")
    state_db_url: str | None = setting(
        PREFIX + "STATE_DB_URL",
        None,
        optional_text,
        "database for the buffer's own rollout_buffer_* tables; default: the launcher database",
    )
    launcher: str = setting(
        PREFIX + "LAUNCHER",
        "auto",
        choice("auto", "aievobox", "simulate", "none"),
        "which launcher /start_rollout starts: auto (aievobox with AIEVOBOX_ROOT, else simulate), "
        "aievobox, simulate, none (rows are written by something else)",
    )
    launcher_cmd: tuple[str, ...] | None = setting(
        PREFIX + "LAUNCHER_CMD",
        None,
        command_line,
        "override the launcher command (split like a shell, never run by one); {job_id}, {k}, "
        "{db_url}, {storage_type}, {llm_base_url} (the proxy's, or the pacing gate's) are "
        "substituted, and --job-id/--rl-group-size appended if absent; with pacing on it must "
        "pass {llm_base_url}",
    )
    simulate_args: tuple[str, ...] | None = setting(
        PREFIX + "SIMULATE_ARGS",
        None,
        command_line,
        "extra arguments for the built-in simulator, e.g. '--groups 64 --pace 0.01'",
    )
    restart_policy: str = setting(
        PREFIX + "RESTART_POLICY",
        "never",
        choice("never", "on-failure"),
        "restart the launcher when it exits non-zero",
    )
    restart_max: int = constant(
        3, "restarts allowed with on-failure: a launcher that fails three times needs a human"
    )
    restart_backoff_s: float = setting(
        PREFIX + "RESTART_BACKOFF_SECONDS",
        2.0,
        number(0.0),
        "first restart delay, doubled per attempt (capped at 60 s)",
    )
    stop_grace_s: float = setting(
        PREFIX + "STOP_GRACE_SECONDS",
        10.0,
        number(0.0),
        "seconds between TERM and KILL when stopping the launcher",
    )
    launch_grace_s: float = constant(
        3.0,
        "seconds /start_rollout waits for a launcher that exits at once; its answer is then an "
        "error with the exit code and the log's last lines",
    )
    max_response_bytes: int = setting(
        PREFIX + "MAX_RESPONSE_BYTES",
        256 * 1024 * 1024,
        integer(1024),
        "byte budget of one /get_rollout_data response (at least one group is always sent)",
    )
    max_group_bytes: int = constant(
        1024 * 1024 * 1024,
        "a group whose rows alone hold more bytes is dropped as group_too_large, never built. It "
        "bounds the memory one group takes",
    )
    max_waiting_polls: int = constant(
        8,
        "long-polls that may wait at once; more answer at once. It is half of "
        "ROLLOUT_BUFFER_THREADS, so waiting polls never hold every thread",
        shown="THREADS / 2",
    )
    prebuild: bool = constant(
        True,
        "the next response is built in the background while ready groups wait and no poll runs. "
        "It has the shape the trainer last asked for",
    )
    # --- training-data policies (issue 10); every one is off by default ---
    max_off_policy: int | None = setting(
        PREFIX + "MAX_OFF_POLICY",
        None,
        optional_integer(0),
        "drop a group as stale when current version - min weight_version of its items > this "
        "(unset: off); "
        "a poll's max_off_policy overrides it for that poll",
    )
    drop_zero_variance: bool = setting(
        PREFIX + "DROP_ZERO_VARIANCE",
        False,
        boolean,
        "drop a ready group whose sessions' terminal rewards are all equal (max - min <= epsilon)",
    )
    zero_variance_epsilon: float = constant(
        1e-6,
        "with ROLLOUT_BUFFER_DROP_ZERO_VARIANCE, a group whose terminal rewards differ by at most "
        "this is dropped",
    )
    oversample: int = setting(
        PREFIX + "OVERSAMPLE",
        0,
        integer(0),
        "start K + N sessions per group (--rl-group-size), serve the first K to complete, clear "
        "the others",
    )
    min_group_size: int | None = setting(
        PREFIX + "MIN_GROUP_SIZE",
        None,
        optional_integer(1),
        "at the TTL, serve a group with at least this many completed sessions (partial) instead of "
        "dropping "
        "it; unset or >= K: off",
    )
    serve_order: str = setting(
        PREFIX + "SERVE_ORDER",
        "ready",
        choice("ready", "oldest_version", "newest_version"),
        "which ready groups go first: ready (first ready), oldest_version or newest_version (by "
        "the min "
        "weight_version of their items)",
    )
    max_version_jump: int | None = setting(
        PREFIX + "MAX_VERSION_JUMP",
        1000,
        optional_integer(0),
        "a group more than this above the current version (or below 0) is dropped as "
        "implausible_version, once that version is known. Row data moves the current version only "
        "when two complete groups agree (unset: no bound)",
    )
    salvage: str = setting(
        PREFIX + "SALVAGE",
        "off",
        choice("off", "truncate"),
        "a group whose sessions ended without a result (step_cap, launcher_exited, "
        "incomplete_group_ttl), each with a row, is served with them truncated: off or truncate "
        "(see docs/policies.md)",
    )
    salvage_reward: float = setting(
        PREFIX + "SALVAGE_REWARD",
        0.0,
        number(),
        "the terminal reward of every item of a session truncated by ROLLOUT_BUFFER_SALVAGE",
    )
    max_request_bytes: int = setting(
        PREFIX + "MAX_REQUEST_BYTES", 1024 * 1024, integer(1024), "request body cap"
    )
    ingest_interval_s: float = setting(
        PREFIX + "INGEST_INTERVAL_SECONDS",
        0.2,
        number(0.001),
        "how often the background thread reads new rows",
    )
    ingest_batch: int = constant(20000, "rows per read of the launcher's table")
    db_unhealthy_after_s: float = setting(
        PREFIX + "DB_UNHEALTHY_AFTER_SECONDS",
        5.0,
        number(0.0),
        "polls answer 503 once background reads have failed for this long",
    )
    statement_timeout_s: float = setting(
        PREFIX + "STATEMENT_TIMEOUT_SECONDS",
        8.0,
        number(0.0),
        "Postgres statement_timeout of the service's connections (0 = none). A stuck statement "
        "fails instead of hanging polls and the loop",
    )
    lock_timeout_s: float = constant(
        2.0,
        "Postgres lock_timeout of the service's connections. A table locked by ALTER TABLE, "
        "VACUUM FULL or TRUNCATE answers 503 within seconds",
    )
    replay_retention_s: float = setting(
        PREFIX + "REPLAY_RETENTION_SECONDS",
        3600.0,
        number(0.0),
        "how long a request_id can be replayed; afterwards it answers 410 (batches are deleted "
        "after twice this)",
    )
    job_retention_s: float = setting(
        PREFIX + "JOB_RETENTION_SECONDS",
        7 * 86400.0,
        number(),
        "delete an ended job's decisions this long after it was last active (<= 0 keeps them "
        "forever); "
        "selected again, it reads only rows written after the purge",
    )
    proxy_connect_timeout_s: float = constant(
        2.0, "connect timeout of proxy notifications (a proxy on the network answers in far less)"
    )
    proxy_read_timeout_s: float = setting(
        PREFIX + "PROXY_READ_TIMEOUT_SECONDS",
        10.0,
        number(0.001),
        "read timeout for proxy notifications",
    )
    pacing: str = setting(
        PREFIX + "PACING",
        "off",
        choice("off", "gate"),
        "gate: the launcher's --llm-base-url is the pacing gate, which forwards only its model "
        "calls to the LLM proxy and holds a new group's first call while the admission budget is "
        "spent (GET /admission); needs the pacing extra; off: every session starts at once",
    )
    gate_host: str = setting(
        PREFIX + "GATE_HOST",
        "127.0.0.1",
        text,
        "the address the pacing gate listens on; beyond loopback it needs GATE_SECRET",
    )
    gate_port: int | None = setting(
        PREFIX + "GATE_PORT",
        None,
        optional_integer(1),
        "the pacing gate's port (default BUFFER_SERVER_PORT + 1)",
    )
    gate_secret: str | None = setting(
        PREFIX + "GATE_SECRET",
        None,
        path_secret,
        "a path segment of the gate's URL that callers must know; required beyond loopback. "
        "Local users can read it in the launcher's argv",
    )
    gate_max_body_bytes: int = setting(
        PREFIX + "GATE_MAX_BODY_BYTES",
        64 * 1024 * 1024,
        integer(1024),
        "the largest model call the gate takes (larger: 413 body_too_large)",
    )
    gate_stall_s: float = setting(
        PREFIX + "GATE_STALL_SECONDS",
        30.0,
        number(0.1),
        "a request head not whole within this, or a body with no byte for this long: the gate "
        "closes the connection (stalled)",
    )
    gate_max_held_bytes: int = setting(
        PREFIX + "GATE_MAX_HELD_BYTES",
        1024 * 1024 * 1024,
        integer(0),
        "the bytes of held calls the gate keeps in all; past it a new first call gets 503 "
        "held_bytes (the launcher retries)",
    )
    gate_max_hold_s: float = setting(
        PREFIX + "GATE_MAX_HOLD_SECONDS",
        300.0,
        number(1.0),
        "no call is held longer: it gets 503 max_hold and the launcher retries it (below its "
        "900 s request timeout)",
    )
    pacing_staleness: int | None = setting(
        PREFIX + "PACING_STALENESS",
        None,
        optional_integer(0),
        "S of the budget (S + 1) x B: versions a group may lag behind the trainer's (default: "
        "MAX_OFF_POLICY, else 1)",
    )
    pacing_batch_groups: int | None = setting(
        PREFIX + "PACING_BATCH_GROUPS",
        None,
        optional_integer(1),
        "B of the budget: groups the trainer trains on a step (default: the min_groups its polls "
        "state, else 8); set it for trainers that poll with {}",
    )
    pacing_session_timeout_s: float = setting(
        PREFIX + "PACING_SESSION_TIMEOUT_SECONDS",
        60.0,
        number(1.0),
        "a session with no model call in flight at the gate and none for this long is gone: its "
        "group frees its place in the budget (above the launcher's longest retry backoff, 36 s)",
    )
    advertise_url: str | None = setting(
        PREFIX + "ADVERTISE_URL",
        None,
        http_url,
        "this instance's URL as clients reach it (http[s]://host:port); a standby redirects polls, "
        "/start_rollout and /stop_rollout to the owner's; no user or password",
    )
    lease_s: float = setting(
        PREFIX + "LEASE_SECONDS",
        10.0,
        lease_seconds,
        "ownership of the job: a lease in the state database, renewed every third of this; a "
        "standby takes "
        "over when it expires; 0 = no lease (one instance only: a second one would not be fenced)",
    )
    buffer_name: str = setting(
        PREFIX + "NAME",
        "",
        parse_buffer_name,
        "this buffer's name. On one state database, instances with the same name are one buffer "
        "(one owner, the others standbys); different names are independent buffers. An unnamed "
        "instance refuses to start while another owns the database's unnamed buffer",
        shown=None,
    )
    host_id: str | None = setting(
        PREFIX + "HOST_ID",
        None,
        optional_text,
        "this host for launcher adoption; default hostname/boot id/pid namespace (set it only to "
        "tell "
        "apart instances that cannot see each other's processes)",
    )
    token: str | None = setting(
        PREFIX + "TOKEN",
        None,
        optional_text,
        "when set, every endpoint but /health needs 'Authorization: Bearer <token>'",
    )
    allowed_hosts: tuple[str, ...] = setting(
        PREFIX + "ALLOWED_HOSTS",
        (),
        parse_allowed_hosts,
        "without a token: more host names (comma-separated, no port) by which a browser page may "
        "start, poll or stop. Localhost, loopback and the ROLLOUT_BUFFER_ADVERTISE_URL host are "
        "always allowed. A browser's request by another Host gets a 403 (DNS rebinding). "
        "Trainers and tools send no browser headers and are not affected",
        shown=None,
    )
    log_level: str = setting(
        PREFIX + "LOG_LEVEL", "INFO", parse_log_level, "log level (per-poll lines are DEBUG)"
    )
    threads: int = setting(
        PREFIX + "THREADS",
        16,
        integer(1, 256),
        "gunicorn gthread threads (the worker count is always 1)",
    )
    graceful_margin_s: float = constant(
        50.0,
        "gunicorn's graceful timeout is ROLLOUT_BUFFER_STOP_GRACE_SECONDS plus this. The worker "
        "stops the launcher first, then answers waiting polls and closes the database",
    )

    def __post_init__(self) -> None:
        if self.storage_type not in ("sqlite", "postgres"):
            raise ConfigError(f"storage_type must be sqlite or postgres, got {self.storage_type!r}")
        kind = url_kind(self.db_url, "AIEVOBOX_DB_URL")
        if kind != self.storage_type:
            raise ConfigError(
                f"STORAGE_TYPE={self.storage_type} does not match "
                f"AIEVOBOX_DB_URL={redact(self.db_url)!r} "
                f"(a {kind} URL); set both to the same backend"
            )
        if self.state_db_url is not None:
            url_kind(self.state_db_url, PREFIX + "STATE_DB_URL")
        for arg in self.launcher_cmd or ():
            try:
                arg.format(
                    job_id="job",
                    k="1",
                    db_url="sqlite:///x",
                    storage_type="sqlite",
                    llm_base_url="http://x/v1",
                )
            except (KeyError, ValueError, IndexError, AttributeError) as exc:
                raise ConfigError(
                    f"{PREFIX}LAUNCHER_CMD argument {arg!r} is not a valid template "
                    f"({type(exc).__name__}: {exc}): "
                    "expected only {job_id}, {k}, {db_url}, {storage_type}, {llm_base_url}; write "
                    "a literal brace "
                    "as {{ or }}"
                ) from None
        if (
            self.pacing == "gate"
            and self.launcher_cmd
            and not any("{llm_base_url}" in arg for arg in self.launcher_cmd)
        ):
            raise ConfigError(
                f"{PREFIX}PACING=gate: {PREFIX}LAUNCHER_CMD must hand the launcher the gate's URL "
                "as {llm_base_url} (e.g. --llm-base-url {llm_base_url}); without it the "
                "launcher's model calls bypass the gate, with no concurrency limit of its own"
            )
        if self.pacing == "gate" and not self.gate_secret and not is_loopback(self.gate_host):
            raise ConfigError(
                f"{PREFIX}GATE_HOST={self.gate_host!r} is beyond loopback: anyone who reaches it "
                f"could call the LLM proxy; set {PREFIX}GATE_SECRET (at least 16 of "
                "A-Z a-z 0-9 . _ ~ -), or keep the gate on 127.0.0.1"
            )
        try:
            parse_buffer_name(self.buffer_name)
        except ValueError as exc:
            raise ConfigError(
                f"{PREFIX}NAME={self.buffer_name!r} is invalid: expected {exc}"
            ) from None

    @property
    def policy(self) -> Policy:
        """The training-data policies as one value (the accumulator applies them)."""
        return Policy(
            self.max_off_policy,
            self.drop_zero_variance,
            self.zero_variance_epsilon,
            self.oversample,
            self.min_group_size,
            self.serve_order,
            self.max_version_jump,
            salvage=self.salvage,
            salvage_reward=self.salvage_reward,
            message_cut=self.message_cut,
        )

    @property
    def effective_state_db_url(self) -> str:
        """Where the buffer's own tables live."""
        return self.state_db_url or self.db_url

    @property
    def proxy_url(self) -> str | None:
        """Base URL of the LLM proxy, or None when no proxy host is configured."""
        if not self.proxy_host:
            return None
        return f"http://{self.proxy_host}:{self.proxy_port or 80}"

    @property
    def launcher_kind(self) -> str:
        """The launcher actually used: command, aievobox, simulate or none."""
        if self.launcher_cmd:
            return "command"
        if self.launcher == "auto":
            return "aievobox" if self.aievobox_root else "simulate"
        return self.launcher

    @property
    def graceful_timeout_s(self) -> float:
        """gunicorn's graceful timeout: always past the launcher's stop grace, or gunicorn would
        KILL the worker before the launcher is stopped."""
        return self.stop_grace_s + self.graceful_margin_s

    def replace(self, **changes: Any) -> Config:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, *, warn: bool = True, **overrides: Any
    ) -> Config:
        """Read the settings from ``environ`` (default ``os.environ``), then apply ``overrides``.
        ``warn=False`` only checks them: the process that reads them for real warns of removed
        settings."""
        env = os.environ if environ is None else environ
        if warn:
            warn_removed(env)
        values = read_settings(env)
        values.update(overrides)
        values.setdefault("max_waiting_polls", values.get("threads", 16) // 2)
        root = values.get("aievobox_root")
        if values.get("db_url") is None:
            values["db_url"] = "sqlite://" + (
                os.path.join(os.path.abspath(root), "rl", "rl.db")
                if root
                else os.path.abspath("rollout_buffer.db")
            )
        if values.get("run_dir") is None:
            values["run_dir"] = os.path.join(root, "logs") if root else os.path.abspath("logs")
        # A relative SQLite path is resolved once, where the launcher resolves it (its cwd is
        # AIEVOBOX_ROOT when set): the service and the launcher must name the same file.
        base = os.path.abspath(root) if root else os.getcwd()
        for key in ("db_url", "state_db_url"):
            if values.get(key):
                values[key] = absolute_sqlite_url(values[key], base)
        if values.get("storage_type") is None:
            values["storage_type"] = url_kind(values["db_url"], "AIEVOBOX_DB_URL")
        if values.get("proxy_host") and values.get("proxy_port") is None:
            raise ConfigError(
                f"LLM_PROXY_HOST={values['proxy_host']!r} is set but LLM_PROXY_PORT is not: "
                "expected both (or neither, to disable proxy notifications)"
            )
        if values.get("pacing") == "gate" and not values.get("proxy_host"):
            raise ConfigError(
                "ROLLOUT_BUFFER_PACING=gate forwards the launcher's model calls to the LLM proxy: "
                "expected LLM_PROXY_HOST and LLM_PROXY_PORT to name it"
            )
        return cls(**values)


# Settings that are no longer read, with what replaced them: still accepted for one release, with
# one warning at start, and ignored.
REMOVED = {
    PREFIX + "PACING_IDLE_GAP_SECONDS": "B is ROLLOUT_BUFFER_PACING_BATCH_GROUPS, else the "
    "min_groups of the trainer's polls, else 8 (it was learned from idle gaps)",
    PREFIX + "PACING_SPARE_WASTE": "the budget has no spare groups any more; "
    "ROLLOUT_BUFFER_PACING_SESSION_TIMEOUT_SECONDS frees a lost group's place",
    PREFIX + "RESTART_MAX": "the constant RESTART_MAX (3 restarts)",
    PREFIX + "LAUNCH_GRACE_S": "the constant LAUNCH_GRACE_S (3 s)",
    PREFIX + "MAX_GROUP_BYTES": "the constant MAX_GROUP_BYTES (1 GiB)",
    PREFIX + "MAX_WAITING_POLLS": "half of ROLLOUT_BUFFER_THREADS (MAX_WAITING_POLLS)",
    PREFIX + "PREBUILD": "always on (the constant PREBUILD)",
    PREFIX + "ZERO_VARIANCE_EPSILON": "the constant ZERO_VARIANCE_EPSILON (1e-6)",
    PREFIX + "INGEST_BATCH": "the constant INGEST_BATCH (20000 rows)",
    PREFIX + "LOCK_TIMEOUT_SECONDS": "the constant LOCK_TIMEOUT_S (2 s)",
    PREFIX + "PROXY_CONNECT_TIMEOUT_SECONDS": "the constant PROXY_CONNECT_TIMEOUT_S (2 s)",
    PREFIX + "GRACEFUL_TIMEOUT_SECONDS": "ROLLOUT_BUFFER_STOP_GRACE_SECONDS plus the constant "
    "GRACEFUL_MARGIN_S (50 s)",
}


@dataclass(frozen=True)
class Setting:
    """One row of the table read from the environment: where it comes from and how it is parsed."""

    field: str
    env: str
    default: Any
    parse: Callable[[str], Any]
    help: str
    aliases: tuple[str, ...] = ()


SETTINGS: tuple[Setting, ...] = tuple(
    Setting(
        f.name,
        f.metadata["env"],
        f.metadata["shown"],
        f.metadata["parse"],
        f.metadata["help"],
        f.metadata["aliases"],
    )
    for f in dataclasses.fields(Config)
    if "env" in f.metadata
)
CONSTANTS: tuple[dataclasses.Field[Any], ...] = tuple(
    f for f in dataclasses.fields(Config) if "constant" in f.metadata
)

# Settings whose value is a secret: an error about one never shows the value.
SECRETS = (PREFIX + "TOKEN", PREFIX + "GATE_SECRET")

# Every variable a setting reads, aliases included: any other ROLLOUT_BUFFER_* is a typo.
KNOWN_ENV = {s.env for s in SETTINGS} | {a for s in SETTINGS for a in s.aliases}


def settings_table() -> str:
    """The settings, the constants and the removed settings as markdown (docs/settings.md)."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for s in SETTINGS:
        default = "" if s.default is None else f"`{s.default}`"
        names = f"`{s.env}`" + "".join(f" (or `{a}`)" for a in s.aliases)
        rows.append(f"| {names} | {default} | {s.help} |")
    rows += [
        "",
        "Constants: thresholds nobody would tune. No variable sets them.",
        "",
        "| constant | value | why |",
        "|---|---|---|",
    ]
    rows += [
        f"| `{f.name.upper()}` | `{f.metadata['shown']}` | {f.metadata['constant']} |"
        for f in CONSTANTS
    ]
    rows += [
        "",
        "Removed settings: still accepted for this release, with one warning at start, and "
        "ignored.",
        "",
        "| variable | what replaced it |",
        "|---|---|",
    ]
    rows += [f"| `{name}` | {why} |" for name, why in sorted(REMOVED.items())]
    return "\n".join(rows)


def read_settings(env: Mapping[str, str]) -> dict[str, Any]:
    """The settings ``env`` sets, parsed, by field; an unknown ``ROLLOUT_BUFFER_*`` variable or a
    bad value raises ConfigError naming it."""
    unknown = sorted(
        k for k in env if k.startswith(PREFIX) and k not in KNOWN_ENV and k not in REMOVED
    )
    if unknown:
        raise ConfigError(  # the value is not shown: a misspelt token or URL is a secret too
            f"unknown setting {unknown[0]}; known {PREFIX}* settings: "
            + ", ".join(sorted(s.env for s in SETTINGS if s.env.startswith(PREFIX)))
        )
    values: dict[str, Any] = {}
    for s in SETTINGS:
        name, raw = s.env, env.get(s.env)
        if raw is None:
            for alias in s.aliases:
                if alias in env:
                    name, raw = alias, env[alias]
                    logger.warning(
                        "%s is the original's misspelling; read it, but please set %s",
                        alias,
                        s.env,
                    )
                    break
        if raw is None:
            continue
        try:
            values[s.field] = s.parse(raw)
        except ValueError as exc:
            shown = (
                " (its value not shown)" if name in SECRETS else f"={raw!r}"
            )  # a near-miss is a secret too
            raise ConfigError(redact(f"{name}{shown} is invalid: expected {exc}")) from None
    return values


def warn_removed(env: Mapping[str, str]) -> None:
    """One warning per removed setting that is set, naming what replaced it (once per process:
    gunicorn reads the settings several times)."""
    for name in sorted(set(env) & set(REMOVED) - _warned):
        _warned.add(name)
        logger.warning("%s is no longer read (ignored): %s", name, REMOVED[name])


def absolute_sqlite_url(url: str, base: str) -> str:
    """'sqlite://rel/path' -> 'sqlite:///<base>/rel/path'; any other URL unchanged."""
    if (
        isinstance(url, str)
        and url.startswith("sqlite://")
        and not url.startswith("sqlite:///")
        and len(url) > len("sqlite://")
    ):
        return "sqlite://" + os.path.normpath(os.path.join(base, url[len("sqlite://") :]))
    return url


def url_kind(url: str, name: str = "database URL") -> str:
    """Return 'sqlite' or 'postgres' for a database URL, or raise ConfigError naming ``name``."""
    if not isinstance(url, str) or not url:
        raise ConfigError(
            f"{name} is empty: expected sqlite:///path or postgresql://user@host:port/db"
        )
    if url.startswith("sqlite://") and len(url) > len("sqlite://"):
        return "sqlite"
    if url.startswith(("postgresql://", "postgres://")):
        return "postgres"
    raise ConfigError(
        redact(
            f"{name}={url!r} is invalid: expected sqlite:///abs/path, sqlite://relative/path "
            "or postgresql://user@host:port/db"
        )
    )
