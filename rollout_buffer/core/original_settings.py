"""The original's settings: the variables of the service this one replaces, with the same names,
meanings and defaults, as AIEvoBox's launcher and its operators set them (SPEC §1).

Owns: those rows of the settings table (:mod:`~rollout_buffer.core.settings` puts them first, then
rollout-buffer's own ``ROLLOUT_BUFFER_*`` settings). Renaming one breaks an existing deployment.
"""

from __future__ import annotations

from rollout_buffer.core.parsers import (
    Setting,
    choice,
    integer,
    number,
    optional_text,
    text,
)

ORIGINAL: tuple[Setting, ...] = (
    Setting("port", "BUFFER_SERVER_PORT", 18889, integer(1, 65535), "HTTP port"),
    Setting(
        "storage_type",
        "STORAGE_TYPE",
        None,
        choice("sqlite", "postgres"),
        "sqlite or postgres; default: taken from the database URL",
    ),
    Setting(
        "db_url",
        "AIEVOBOX_DB_URL",
        None,
        text,
        "launcher database URL: sqlite:///abs/path, sqlite://rel/path or "
        "postgresql://user@host:port/db; "
        "default sqlite:///$AIEVOBOX_ROOT/rl/rl.db, or sqlite:///./rollout_buffer.db without "
        "AIEVOBOX_ROOT",
    ),
    Setting(
        "aievobox_root",
        "AIEVOBOX_ROOT",
        None,
        optional_text,
        "AIEvoBox checkout; when set, its launcher.py is the launcher, otherwise the built-in "
        "simulator is",
    ),
    Setting(
        "run_dir",
        "AIEVOBOX_RUN_DIR",
        None,
        optional_text,
        "log directory; default $AIEVOBOX_ROOT/logs, or ./logs without AIEVOBOX_ROOT",
    ),
    Setting(
        "proxy_host",
        "LLM_PROXY_HOST",
        None,
        optional_text,
        "LLM proxy host; unset disables clear_sessions notifications (one warning)",
    ),
    Setting("proxy_port", "LLM_PROXY_PORT", None, integer(1, 65535), "LLM proxy port"),
    Setting(
        "ttl_s",
        "AIEVOBOX_BUFFER_INCOMPLETE_GROUP_TTL_SECONDS",
        1800.0,
        number(),
        "drop an incomplete group after this many idle seconds (<= 0 disables)",
    ),
    Setting("aievobox_mode", "AIEVOBOX_MODE", "local", text, "launcher --mode"),
    Setting(
        "env_config",
        "AIEVOBOX_ENV_CONFIG",
        None,
        optional_text,
        "launcher --env-config (wins over --env-root)",
    ),
    Setting("env_root", "AIEVOBOX_ENV_ROOT", None, optional_text, "launcher --env-root"),
    Setting("rl_model", "RL_MODEL", "default", text, "launcher --llm-model"),
    Setting("llm_temperature", "LLM_TEMPERATURE", 1.0, number(0.0), "launcher --llm-temperature"),
    Setting("max_steps", "AIEVOBOX_MAX_STEPS", 10, integer(1), "launcher --max-steps"),
    Setting("message_cut", "AIEVOBOX_MESSAGE_CUT", 0, integer(), "launcher --message-cut"),
    Setting("pool_size", "AIEVOBOX_POOL_SIZE", 16, integer(1), "launcher --pool-size"),
    Setting(
        "multiplier",
        "AIEVOBOX_MULTIPLIER",
        1.2,
        number(0.0),
        "launcher --multiplier (the original's misspelled AIEVOBOC_MULTIPLIER is accepted with a "
        "warning)",
        aliases=("AIEVOBOC_MULTIPLIER",),
    ),
    Setting("rl_epoch", "RL_EPOCH", 1, integer(0), "launcher --rl-epoch"),
    Setting("env_transport", "AIEVOBOX_ENV_TRANSPORT", "http", text, "launcher --env-transport"),
)
