"""Configuration: one frozen dataclass, read once from the environment, typed and strict.

Every setting is a row of ``SETTINGS`` (:mod:`~rollout_buffer.core.settings`: field, environment
variable, default, parser, help). Precedence: defaults < environment < explicit overrides
(``Config.from_env(env, **over)``). A bad value fails at startup naming the variable, the value
and what was expected, and so does an unknown ``ROLLOUT_BUFFER_*`` variable (a typo must not
silently fall back).

Owns: the frozen Config built from the SETTINGS rows, and the checks across settings (database
URLs, the launcher command template, timeouts). It must not read the environment after startup,
nor open anything: a URL is checked, never connected to.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rollout_buffer.core.errors import ConfigError
from rollout_buffer.core.hosts import is_loopback
from rollout_buffer.core.model import Policy
from rollout_buffer.core.parsers import buffer_name as parse_buffer_name
from rollout_buffer.core.redact import redact
from rollout_buffer.core.settings import KNOWN_ENV, PREFIX, REMOVED, SETTINGS

logger = logging.getLogger(__name__)
_warned: set[str] = set()  # removed settings warned of in this process


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
    salvage: str = "off"
    salvage_reward: float = 0.0
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
    gate_host: str = "127.0.0.1"
    gate_port: int | None = None
    gate_secret: str | None = None
    gate_max_body_bytes: int = 64 * 1024 * 1024
    gate_stall_s: float = 30.0
    gate_max_held_bytes: int = 1024 * 1024 * 1024
    gate_max_hold_s: float = 300.0
    pacing_staleness: int | None = None
    pacing_batch_groups: int | None = None
    pacing_session_timeout_s: float = 60.0
    advertise_url: str | None = None
    lease_s: float = 10.0
    buffer_name: str = ""
    host_id: str | None = None
    token: str | None = None
    allowed_hosts: tuple[str, ...] = ()
    log_level: str = "INFO"
    threads: int = 16
    graceful_timeout_s: float = 60.0

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
        if self.graceful_timeout_s <= self.stop_grace_s:
            raise ConfigError(
                f"{PREFIX}GRACEFUL_TIMEOUT_SECONDS={self.graceful_timeout_s} must exceed "
                f"{PREFIX}STOP_GRACE_SECONDS={self.stop_grace_s}: gunicorn would KILL the worker "
                "before the launcher is stopped"
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

    def replace(self, **changes: Any) -> Config:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Config:
        """Read the settings from ``environ`` (default ``os.environ``), then apply ``overrides``."""
        env = os.environ if environ is None else environ
        warn_removed(env)
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
