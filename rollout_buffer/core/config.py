"""Configuration: one frozen dataclass, read once from the environment, typed and strict.

Every setting is a row of ``SETTINGS`` (field, environment variable, default, parser, help);
the README's settings table is generated from the same rows (``rollout-buffer settings``).
Precedence: defaults < environment < explicit overrides (``Config.from_env(env, **over)``).
A bad value fails at startup naming the variable, the value and what was expected, and so
does an unknown ``ROLLOUT_BUFFER_*`` variable (a typo must not silently fall back).

Owns: the SETTINGS table and the frozen Config built from it. It must not read the environment after
startup, nor open anything: a URL is checked, never connected to.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from rollout_buffer.core.errors import ConfigError
from rollout_buffer.core.hosts import parse_allowed_hosts
from rollout_buffer.core.model import Policy
from rollout_buffer.core.redact import redact

logger = logging.getLogger(__name__)

PREFIX = "ROLLOUT_BUFFER_"


def _int(lo: int | None = None, hi: int | None = None) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        try:
            value = int(raw.strip())
        except ValueError:
            raise ValueError("an integer") from None
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise ValueError(
                f"an integer from {lo} to {hi}" if hi is not None else f"an integer >= {lo}"
            )
        return value

    return parse


def _float(lo: float | None = None) -> Callable[[str], float]:
    def parse(raw: str) -> float:
        try:
            value = float(raw.strip())
        except ValueError:
            raise ValueError("a number") from None
        if not math.isfinite(value) or (lo is not None and value < lo):
            raise ValueError(f"a finite number >= {lo}" if lo is not None else "a finite number")
        return value

    return parse


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip().lower()
        if value not in choices:
            raise ValueError("one of " + ", ".join(choices))
        return value

    return parse


def _bool(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError("a boolean (1/0, true/false, yes/no, on/off)")


def _opt_int(lo: int) -> Callable[[str], int | None]:
    """An integer >= lo, or None (off) when empty."""
    parse = _int(lo)
    return lambda raw: parse(raw) if raw.strip() else None


def _str(raw: str) -> str:
    return raw


def _opt_str(raw: str) -> str | None:
    return raw.strip() or None


def _argv(raw: str) -> tuple[str, ...] | None:
    if not raw.strip():
        return None
    try:
        return tuple(shlex.split(raw))
    except ValueError as exc:
        raise ValueError(f"a command line that shlex can split ({exc})") from None


def _url(raw: str) -> str | None:
    value = raw.strip().rstrip("/")
    if not value:
        return None
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            "an http:// or https:// URL with a host, as clients reach this instance, "
            "e.g. http://buffer-1:18889"
        )
    if parts.username is not None or parts.password is not None:
        raise ValueError("a URL without user or password (it is shown on /health and in redirects)")
    if parts.query or parts.fragment:
        raise ValueError("a URL without ?query or #fragment")
    try:
        _ = parts.port
    except ValueError:
        raise ValueError("a URL whose port is a number from 1 to 65535") from None
    return value


def _lease(raw: str) -> float:
    value = _float(0.0)(raw)
    if 0 < value < 1:
        raise ValueError("0 (no lease) or a number of seconds >= 1")
    return value


def _buffer_name(raw: str) -> str:
    value = raw.strip()
    if value and not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", value):
        raise ValueError("1-64 characters of A-Z a-z 0-9 . _ - (or empty: the unnamed buffer)")
    return value


def _log_level(raw: str) -> str:
    value = raw.strip().upper()
    if value not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ValueError("one of DEBUG, INFO, WARNING, ERROR")
    return value


@dataclass(frozen=True)
class Setting:
    """One configurable value: where it comes from and how it is parsed."""

    field: str
    env: str
    default: Any
    parse: Callable[[str], Any]
    help: str
    aliases: tuple[str, ...] = ()


SETTINGS: tuple[Setting, ...] = (
    # --- the original's variables (same names, meanings and defaults) ---
    Setting("port", "BUFFER_SERVER_PORT", 18889, _int(1, 65535), "HTTP port"),
    Setting(
        "storage_type",
        "STORAGE_TYPE",
        None,
        _choice("sqlite", "postgres"),
        "sqlite or postgres; default: taken from the database URL",
    ),
    Setting(
        "db_url",
        "AIEVOBOX_DB_URL",
        None,
        _str,
        "launcher database URL: sqlite:///abs/path, sqlite://rel/path or postgresql://user@host:port/db; "
        "default sqlite:///$AIEVOBOX_ROOT/rl/rl.db, or sqlite:///./rollout_buffer.db without AIEVOBOX_ROOT",
    ),
    Setting(
        "aievobox_root",
        "AIEVOBOX_ROOT",
        None,
        _opt_str,
        "AIEvoBox checkout; when set, its launcher.py is the launcher, otherwise the built-in simulator is",
    ),
    Setting(
        "run_dir",
        "AIEVOBOX_RUN_DIR",
        None,
        _opt_str,
        "log directory; default $AIEVOBOX_ROOT/logs, or ./logs without AIEVOBOX_ROOT",
    ),
    Setting(
        "proxy_host",
        "LLM_PROXY_HOST",
        None,
        _opt_str,
        "LLM proxy host; unset disables clear_sessions notifications (one warning)",
    ),
    Setting("proxy_port", "LLM_PROXY_PORT", None, _int(1, 65535), "LLM proxy port"),
    Setting(
        "ttl_s",
        "AIEVOBOX_BUFFER_INCOMPLETE_GROUP_TTL_SECONDS",
        1800.0,
        _float(),
        "drop an incomplete group after this many idle seconds (<= 0 disables)",
    ),
    Setting("aievobox_mode", "AIEVOBOX_MODE", "local", _str, "launcher --mode"),
    Setting(
        "env_config",
        "AIEVOBOX_ENV_CONFIG",
        None,
        _opt_str,
        "launcher --env-config (wins over --env-root)",
    ),
    Setting("env_root", "AIEVOBOX_ENV_ROOT", None, _opt_str, "launcher --env-root"),
    Setting("rl_model", "RL_MODEL", "default", _str, "launcher --llm-model"),
    Setting("llm_temperature", "LLM_TEMPERATURE", 1.0, _float(0.0), "launcher --llm-temperature"),
    Setting("max_steps", "AIEVOBOX_MAX_STEPS", 10, _int(1), "launcher --max-steps"),
    Setting("message_cut", "AIEVOBOX_MESSAGE_CUT", 0, _int(), "launcher --message-cut"),
    Setting("pool_size", "AIEVOBOX_POOL_SIZE", 16, _int(1), "launcher --pool-size"),
    Setting(
        "multiplier",
        "AIEVOBOX_MULTIPLIER",
        1.2,
        _float(0.0),
        "launcher --multiplier (the original's misspelled AIEVOBOC_MULTIPLIER is accepted with a warning)",
        aliases=("AIEVOBOC_MULTIPLIER",),
    ),
    Setting("rl_epoch", "RL_EPOCH", 1, _int(0), "launcher --rl-epoch"),
    Setting("env_transport", "AIEVOBOX_ENV_TRANSPORT", "http", _str, "launcher --env-transport"),
    # --- rollout-buffer's own settings ---
    Setting("host", PREFIX + "HOST", "0.0.0.0", _str, "address to bind"),
    Setting(
        "state_db_url",
        PREFIX + "STATE_DB_URL",
        None,
        _opt_str,
        "database for the buffer's own rollout_buffer_* tables; default: the launcher database",
    ),
    Setting(
        "launcher",
        PREFIX + "LAUNCHER",
        "auto",
        _choice("auto", "aievobox", "simulate", "none"),
        "which launcher /start_rollout starts: auto (aievobox with AIEVOBOX_ROOT, else simulate), "
        "aievobox, simulate, none (rows are written by something else)",
    ),
    Setting(
        "launcher_cmd",
        PREFIX + "LAUNCHER_CMD",
        None,
        _argv,
        "override the launcher command (split like a shell, never run by one); {job_id}, {k}, "
        "{db_url}, {storage_type} are substituted, and --job-id/--rl-group-size appended if absent",
    ),
    Setting(
        "simulate_args",
        PREFIX + "SIMULATE_ARGS",
        None,
        _argv,
        "extra arguments for the built-in simulator, e.g. '--groups 64 --pace 0.01'",
    ),
    Setting(
        "restart_policy",
        PREFIX + "RESTART_POLICY",
        "never",
        _choice("never", "on-failure"),
        "restart the launcher when it exits non-zero",
    ),
    Setting("restart_max", PREFIX + "RESTART_MAX", 3, _int(0), "restarts allowed with on-failure"),
    Setting(
        "restart_backoff_s",
        PREFIX + "RESTART_BACKOFF_SECONDS",
        2.0,
        _float(0.0),
        "first restart delay, doubled per attempt (capped at 60 s)",
    ),
    Setting(
        "stop_grace_s",
        PREFIX + "STOP_GRACE_SECONDS",
        10.0,
        _float(0.0),
        "seconds between TERM and KILL when stopping the launcher",
    ),
    Setting(
        "launch_grace_s",
        PREFIX + "LAUNCH_GRACE_S",
        3.0,
        _float(0.0),
        "seconds /start_rollout waits for a launcher that exits at once (its answer is then an "
        "error with the exit code and the log's last lines); 0 = answer at once",
    ),
    Setting(
        "max_response_bytes",
        PREFIX + "MAX_RESPONSE_BYTES",
        256 * 1024 * 1024,
        _int(1024),
        "byte budget of one /get_rollout_data response (at least one group is always sent)",
    ),
    Setting(
        "max_group_bytes",
        PREFIX + "MAX_GROUP_BYTES",
        1024 * 1024 * 1024,
        _int(1024),
        "a group whose rows alone hold more bytes is dropped as group_too_large instead of being built "
        "(bounds the memory one group can take)",
    ),
    Setting(
        "max_waiting_polls",
        PREFIX + "MAX_WAITING_POLLS",
        8,
        _int(0, 1024),
        "long-polls (wait_s > 0) that may wait at once; more answer at once",
    ),
    Setting(
        "prebuild",
        PREFIX + "PREBUILD",
        True,
        _bool,
        "build the next response in the background while ready groups wait and no poll runs, for the "
        "shape the trainer last asked for (at most one, within MAX_RESPONSE_BYTES)",
    ),
    # --- training-data policies (issue 10); every one is off by default ---
    Setting(
        "max_off_policy",
        PREFIX + "MAX_OFF_POLICY",
        None,
        _opt_int(0),
        "drop a group as stale when current version - min weight_version of its items > this (unset: off); "
        "a poll's max_off_policy overrides it for that poll",
    ),
    Setting(
        "drop_zero_variance",
        PREFIX + "DROP_ZERO_VARIANCE",
        False,
        _bool,
        "drop a ready group whose sessions' terminal rewards are all equal (max - min <= epsilon)",
    ),
    Setting(
        "zero_variance_epsilon",
        PREFIX + "ZERO_VARIANCE_EPSILON",
        1e-6,
        _float(0.0),
        "the epsilon of DROP_ZERO_VARIANCE",
    ),
    Setting(
        "oversample",
        PREFIX + "OVERSAMPLE",
        0,
        _int(0),
        "start K + N sessions per group (--rl-group-size), serve the first K to complete, clear the others",
    ),
    Setting(
        "min_group_size",
        PREFIX + "MIN_GROUP_SIZE",
        None,
        _opt_int(1),
        "at the TTL, serve a group with at least this many completed sessions (partial) instead of dropping "
        "it; unset or >= K: off",
    ),
    Setting(
        "serve_order",
        PREFIX + "SERVE_ORDER",
        "ready",
        _choice("ready", "oldest_version", "newest_version"),
        "which ready groups go first: ready (first ready), oldest_version or newest_version (by the min "
        "weight_version of their items)",
    ),
    Setting(
        "max_version_jump",
        PREFIX + "MAX_VERSION_JUMP",
        1000,
        _opt_int(0),
        "once the current version is known, a group with a version more than this above it "
        "(or below 0) is dropped as implausible_version; row data moves the current version "
        "only when two complete groups agree (unset: no bound)",
    ),
    Setting(
        "max_request_bytes",
        PREFIX + "MAX_REQUEST_BYTES",
        1024 * 1024,
        _int(1024),
        "request body cap",
    ),
    Setting(
        "ingest_interval_s",
        PREFIX + "INGEST_INTERVAL_SECONDS",
        0.2,
        _float(0.001),
        "how often the background thread reads new rows",
    ),
    Setting("ingest_batch", PREFIX + "INGEST_BATCH", 20000, _int(1), "rows per read"),
    Setting(
        "db_unhealthy_after_s",
        PREFIX + "DB_UNHEALTHY_AFTER_SECONDS",
        5.0,
        _float(0.0),
        "polls answer 503 once background reads have failed for this long",
    ),
    Setting(
        "statement_timeout_s",
        PREFIX + "STATEMENT_TIMEOUT_SECONDS",
        8.0,
        _float(0.0),
        "Postgres statement_timeout of the service's connections (0 = none): a stuck statement fails "
        "instead of hanging polls and the loop",
    ),
    Setting(
        "lock_timeout_s",
        PREFIX + "LOCK_TIMEOUT_SECONDS",
        2.0,
        _float(0.0),
        "Postgres lock_timeout of the service's connections (0 = none): a table locked by ALTER TABLE, "
        "VACUUM FULL or TRUNCATE answers 503 within seconds",
    ),
    Setting(
        "replay_retention_s",
        PREFIX + "REPLAY_RETENTION_SECONDS",
        3600.0,
        _float(0.0),
        "how long a request_id can be replayed; afterwards it answers 410 (batches are deleted after twice this)",
    ),
    Setting(
        "job_retention_s",
        PREFIX + "JOB_RETENTION_SECONDS",
        7 * 86400.0,
        _float(),
        "delete an ended job's decisions this long after it was last active (<= 0 keeps them forever); "
        "selected again, it reads only rows written after the purge",
    ),
    Setting(
        "proxy_connect_timeout_s",
        PREFIX + "PROXY_CONNECT_TIMEOUT_SECONDS",
        2.0,
        _float(0.001),
        "connect timeout for proxy notifications",
    ),
    Setting(
        "proxy_read_timeout_s",
        PREFIX + "PROXY_READ_TIMEOUT_SECONDS",
        10.0,
        _float(0.001),
        "read timeout for proxy notifications",
    ),
    Setting(
        "pacing",
        PREFIX + "PACING",
        "off",
        _choice("off", "gate"),
        "gate: the launcher's --llm-base-url is the pacing gate, which holds the first model call "
        "of a session of a group not admitted while the admission budget is spent (GET "
        "/admission); off: every session starts at once",
    ),
    Setting(
        "gate_port",
        PREFIX + "GATE_PORT",
        None,
        _opt_int(1),
        "the pacing gate's port on 127.0.0.1 (default BUFFER_SERVER_PORT + 1); keep it fixed so "
        "that the launcher's sessions find it again after a restart",
    ),
    Setting(
        "pacing_staleness",
        PREFIX + "PACING_STALENESS",
        None,
        _opt_int(0),
        "S of the admission budget (S + 1) x B: versions a group may lag behind the trainer's "
        "(default: MAX_OFF_POLICY, else 1)",
    ),
    Setting(
        "pacing_batch_groups",
        PREFIX + "PACING_BATCH_GROUPS",
        None,
        _opt_int(1),
        "B of the admission budget: groups the trainer takes a step (default: learned from the "
        "groups it takes between idle gaps, 8 until then)",
    ),
    Setting(
        "pacing_idle_gap_s",
        PREFIX + "PACING_IDLE_GAP_SECONDS",
        10.0,
        _float(0.001),
        "a gap between the trainer's polls longer than this ends a burst (how B is learned)",
    ),
    Setting(
        "advertise_url",
        PREFIX + "ADVERTISE_URL",
        None,
        _url,
        "this instance's URL as clients reach it (http[s]://host:port); a standby redirects polls, "
        "/start_rollout and /stop_rollout to the owner's; no user or password",
    ),
    Setting(
        "lease_s",
        PREFIX + "LEASE_SECONDS",
        10.0,
        _lease,
        "ownership of the job: a lease in the state database, renewed every third of this; a standby takes "
        "over when it expires; 0 = no lease (one instance only: a second one would not be fenced)",
    ),
    Setting(
        "buffer_name",
        PREFIX + "NAME",
        None,
        _buffer_name,
        "this buffer's name: instances with the same name on one state database are one buffer "
        "(one owner, the others standbys), with different names they are independent buffers; "
        "unnamed, an instance refuses to start while another owns the database's unnamed buffer",
    ),
    Setting(
        "host_id",
        PREFIX + "HOST_ID",
        None,
        _opt_str,
        "this host for launcher adoption; default hostname/boot id/pid namespace (set it only to tell "
        "apart instances that cannot see each other's processes)",
    ),
    Setting(
        "token",
        PREFIX + "TOKEN",
        None,
        _opt_str,
        "when set, every endpoint but /health needs 'Authorization: Bearer <token>'",
    ),
    Setting(
        "allowed_hosts",
        PREFIX + "ALLOWED_HOSTS",
        None,
        parse_allowed_hosts,
        "without a token: host names (comma-separated, no port) by which a browser page may "
        "start, poll or stop, besides localhost, loopback addresses and the "
        "ROLLOUT_BUFFER_ADVERTISE_URL host; a browser's request by another Host gets a 403 (DNS "
        "rebinding). Trainers and tools send no browser headers and are not affected",
    ),
    Setting(
        "log_level",
        PREFIX + "LOG_LEVEL",
        "INFO",
        _log_level,
        "log level (per-poll lines are DEBUG)",
    ),
    Setting(
        "threads",
        PREFIX + "THREADS",
        16,
        _int(1, 256),
        "gunicorn gthread threads (the worker count is always 1)",
    ),
    Setting(
        "graceful_timeout_s",
        PREFIX + "GRACEFUL_TIMEOUT_SECONDS",
        60.0,
        _float(1.0),
        "gunicorn graceful timeout; must exceed the launcher stop grace",
    ),
)

_KNOWN_ENV = {s.env for s in SETTINGS} | {a for s in SETTINGS for a in s.aliases}


@dataclass(frozen=True)
class Config:
    """Validated settings; build it with :meth:`from_env` (or directly in tests)."""

    port: int = 18889
    storage_type: str = "sqlite"
    db_url: str = "sqlite:///./rollout_buffer.db"
    aievobox_root: str | None = None
    run_dir: str = "./logs"
    proxy_host: str | None = None
    proxy_port: int | None = None
    ttl_s: float = 1800.0
    aievobox_mode: str = "local"
    env_config: str | None = None
    env_root: str | None = None
    rl_model: str = "default"
    llm_temperature: float = 1.0
    max_steps: int = 10
    message_cut: int = 0
    pool_size: int = 16
    multiplier: float = 1.2
    rl_epoch: int = 1
    env_transport: str = "http"
    host: str = "0.0.0.0"
    state_db_url: str | None = None
    launcher: str = "auto"
    launcher_cmd: tuple[str, ...] | None = None
    simulate_args: tuple[str, ...] | None = None
    restart_policy: str = "never"
    restart_max: int = 3
    restart_backoff_s: float = 2.0
    stop_grace_s: float = 10.0
    launch_grace_s: float = 3.0
    max_response_bytes: int = 256 * 1024 * 1024
    max_group_bytes: int = 1024 * 1024 * 1024
    max_waiting_polls: int = 8
    prebuild: bool = True
    max_off_policy: int | None = None
    drop_zero_variance: bool = False
    zero_variance_epsilon: float = 1e-6
    oversample: int = 0
    min_group_size: int | None = None
    serve_order: str = "ready"
    max_version_jump: int | None = 1000
    max_request_bytes: int = 1024 * 1024
    ingest_interval_s: float = 0.2
    ingest_batch: int = 20000
    db_unhealthy_after_s: float = 5.0
    statement_timeout_s: float = 8.0
    lock_timeout_s: float = 2.0
    replay_retention_s: float = 3600.0
    job_retention_s: float = 7 * 86400.0
    proxy_connect_timeout_s: float = 2.0
    proxy_read_timeout_s: float = 10.0
    pacing: str = "off"
    gate_port: int | None = None
    pacing_staleness: int | None = None
    pacing_batch_groups: int | None = None
    pacing_idle_gap_s: float = 10.0
    advertise_url: str | None = None
    lease_s: float = 10.0
    buffer_name: str = ""
    host_id: str | None = None
    token: str | None = None
    allowed_hosts: tuple[str, ...] = ()
    log_level: str = "INFO"
    threads: int = 16
    graceful_timeout_s: float = 60.0

    @property
    def gate_url(self) -> str:
        """The pacing gate's base URL, as the launcher's --llm-base-url."""
        return f"http://127.0.0.1:{self.gate_port or self.port + 1}/v1"

    def __post_init__(self) -> None:
        if self.storage_type not in ("sqlite", "postgres"):
            raise ConfigError(f"storage_type must be sqlite or postgres, got {self.storage_type!r}")
        kind = url_kind(self.db_url, "AIEVOBOX_DB_URL")
        if kind != self.storage_type:
            raise ConfigError(
                f"STORAGE_TYPE={self.storage_type} does not match AIEVOBOX_DB_URL={redact(self.db_url)!r} "
                f"(a {kind} URL); set both to the same backend"
            )
        if self.state_db_url is not None:
            url_kind(self.state_db_url, PREFIX + "STATE_DB_URL")
        for arg in self.launcher_cmd or ():
            try:
                arg.format(job_id="job", k="1", db_url="sqlite:///x", storage_type="sqlite")
            except (KeyError, ValueError, IndexError, AttributeError) as exc:
                raise ConfigError(
                    f"{PREFIX}LAUNCHER_CMD argument {arg!r} is not a valid template ({type(exc).__name__}: {exc}): "
                    "expected only {job_id}, {k}, {db_url}, {storage_type}; write a literal brace as {{ or }}"
                ) from None
        if self.graceful_timeout_s <= self.stop_grace_s:
            raise ConfigError(
                f"{PREFIX}GRACEFUL_TIMEOUT_SECONDS={self.graceful_timeout_s} must exceed "
                f"{PREFIX}STOP_GRACE_SECONDS={self.stop_grace_s}: gunicorn would KILL the worker "
                "before the launcher is stopped"
            )
        try:
            _buffer_name(self.buffer_name)
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

    def replace(self, **changes: Any) -> Config:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Config:
        """Read the settings from ``environ`` (default ``os.environ``), then apply ``overrides``."""
        env = os.environ if environ is None else environ
        unknown = sorted(k for k in env if k.startswith(PREFIX) and k not in _KNOWN_ENV)
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
                raise ConfigError(redact(f"{name}={raw!r} is invalid: expected {exc}")) from None
        values.update(overrides)
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


def settings_table() -> str:
    """The settings as a markdown table (for the README)."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for s in SETTINGS:
        default = "" if s.default is None else f"`{s.default}`"
        names = f"`{s.env}`" + "".join(f" (or `{a}`)" for a in s.aliases)
        rows.append(f"| {names} | {default} | {s.help} |")
    return "\n".join(rows)
