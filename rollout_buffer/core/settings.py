"""The settings table: every setting's field, environment variable, default, parser and help.

Every setting is a row of ``SETTINGS``; :class:`~rollout_buffer.core.config.Config` is read from
them, and the settings page is generated from the same rows (``rollout-buffer settings``).

Owns: the SETTINGS rows (the original's variables first, from
:mod:`~rollout_buffer.core.original_settings`, then rollout-buffer's own), the names of the known
variables and their markdown table. Parsing a value is :mod:`~rollout_buffer.core.parsers`';
building and checking a Config is config's.
"""

from __future__ import annotations

from rollout_buffer.core.hosts import parse_allowed_hosts
from rollout_buffer.core.original_settings import ORIGINAL
from rollout_buffer.core.parsers import (
    Setting,
    boolean,
    buffer_name,
    choice,
    command_line,
    http_url,
    integer,
    lease_seconds,
    log_level,
    number,
    optional_integer,
    optional_text,
    path_secret,
    text,
)

PREFIX = "ROLLOUT_BUFFER_"


SETTINGS: tuple[Setting, ...] = (
    *ORIGINAL,
    # --- rollout-buffer's own settings ---
    Setting("host", PREFIX + "HOST", "0.0.0.0", text, "address to bind"),
    Setting(
        "state_db_url",
        PREFIX + "STATE_DB_URL",
        None,
        optional_text,
        "database for the buffer's own rollout_buffer_* tables; default: the launcher database",
    ),
    Setting(
        "launcher",
        PREFIX + "LAUNCHER",
        "auto",
        choice("auto", "aievobox", "simulate", "none"),
        "which launcher /start_rollout starts: auto (aievobox with AIEVOBOX_ROOT, else simulate), "
        "aievobox, simulate, none (rows are written by something else)",
    ),
    Setting(
        "launcher_cmd",
        PREFIX + "LAUNCHER_CMD",
        None,
        command_line,
        "override the launcher command (split like a shell, never run by one); {job_id}, {k}, "
        "{db_url}, {storage_type}, {llm_base_url} (the proxy's, or the pacing gate's) are "
        "substituted, and --job-id/--rl-group-size appended if absent",
    ),
    Setting(
        "simulate_args",
        PREFIX + "SIMULATE_ARGS",
        None,
        command_line,
        "extra arguments for the built-in simulator, e.g. '--groups 64 --pace 0.01'",
    ),
    Setting(
        "restart_policy",
        PREFIX + "RESTART_POLICY",
        "never",
        choice("never", "on-failure"),
        "restart the launcher when it exits non-zero",
    ),
    Setting(
        "restart_max", PREFIX + "RESTART_MAX", 3, integer(0), "restarts allowed with on-failure"
    ),
    Setting(
        "restart_backoff_s",
        PREFIX + "RESTART_BACKOFF_SECONDS",
        2.0,
        number(0.0),
        "first restart delay, doubled per attempt (capped at 60 s)",
    ),
    Setting(
        "stop_grace_s",
        PREFIX + "STOP_GRACE_SECONDS",
        10.0,
        number(0.0),
        "seconds between TERM and KILL when stopping the launcher",
    ),
    Setting(
        "launch_grace_s",
        PREFIX + "LAUNCH_GRACE_S",
        3.0,
        number(0.0),
        "seconds /start_rollout waits for a launcher that exits at once (its answer is then an "
        "error with the exit code and the log's last lines); 0 = answer at once",
    ),
    Setting(
        "max_response_bytes",
        PREFIX + "MAX_RESPONSE_BYTES",
        256 * 1024 * 1024,
        integer(1024),
        "byte budget of one /get_rollout_data response (at least one group is always sent)",
    ),
    Setting(
        "max_group_bytes",
        PREFIX + "MAX_GROUP_BYTES",
        1024 * 1024 * 1024,
        integer(1024),
        "a group whose rows alone hold more bytes is dropped as group_too_large instead of being "
        "built "
        "(bounds the memory one group can take)",
    ),
    Setting(
        "max_waiting_polls",
        PREFIX + "MAX_WAITING_POLLS",
        8,
        integer(0, 1024),
        "long-polls (wait_s > 0) that may wait at once; more answer at once",
    ),
    Setting(
        "prebuild",
        PREFIX + "PREBUILD",
        True,
        boolean,
        "build the next response in the background while ready groups wait and no poll runs, for "
        "the "
        "shape the trainer last asked for (at most one, within MAX_RESPONSE_BYTES)",
    ),
    # --- training-data policies (issue 10); every one is off by default ---
    Setting(
        "max_off_policy",
        PREFIX + "MAX_OFF_POLICY",
        None,
        optional_integer(0),
        "drop a group as stale when current version - min weight_version of its items > this "
        "(unset: off); "
        "a poll's max_off_policy overrides it for that poll",
    ),
    Setting(
        "drop_zero_variance",
        PREFIX + "DROP_ZERO_VARIANCE",
        False,
        boolean,
        "drop a ready group whose sessions' terminal rewards are all equal (max - min <= epsilon)",
    ),
    Setting(
        "zero_variance_epsilon",
        PREFIX + "ZERO_VARIANCE_EPSILON",
        1e-6,
        number(0.0),
        "the epsilon of DROP_ZERO_VARIANCE",
    ),
    Setting(
        "oversample",
        PREFIX + "OVERSAMPLE",
        0,
        integer(0),
        "start K + N sessions per group (--rl-group-size), serve the first K to complete, clear "
        "the others",
    ),
    Setting(
        "min_group_size",
        PREFIX + "MIN_GROUP_SIZE",
        None,
        optional_integer(1),
        "at the TTL, serve a group with at least this many completed sessions (partial) instead of "
        "dropping "
        "it; unset or >= K: off",
    ),
    Setting(
        "serve_order",
        PREFIX + "SERVE_ORDER",
        "ready",
        choice("ready", "oldest_version", "newest_version"),
        "which ready groups go first: ready (first ready), oldest_version or newest_version (by "
        "the min "
        "weight_version of their items)",
    ),
    Setting(
        "max_version_jump",
        PREFIX + "MAX_VERSION_JUMP",
        1000,
        optional_integer(0),
        "once the current version is known, a group with a version more than this above it "
        "(or below 0) is dropped as implausible_version; row data moves the current version "
        "only when two complete groups agree (unset: no bound)",
    ),
    Setting(
        "salvage",
        PREFIX + "SALVAGE",
        "off",
        choice("off", "truncate"),
        "a group whose sessions ended without a result (step_cap, launcher_exited, "
        "incomplete_group_ttl), each with a row, is served with them truncated: off or truncate "
        "(see docs/policies.md)",
    ),
    Setting(
        "salvage_reward",
        PREFIX + "SALVAGE_REWARD",
        0.0,
        number(),
        "the terminal reward of every item of a session truncated by ROLLOUT_BUFFER_SALVAGE",
    ),
    Setting(
        "max_request_bytes",
        PREFIX + "MAX_REQUEST_BYTES",
        1024 * 1024,
        integer(1024),
        "request body cap",
    ),
    Setting(
        "ingest_interval_s",
        PREFIX + "INGEST_INTERVAL_SECONDS",
        0.2,
        number(0.001),
        "how often the background thread reads new rows",
    ),
    Setting("ingest_batch", PREFIX + "INGEST_BATCH", 20000, integer(1), "rows per read"),
    Setting(
        "db_unhealthy_after_s",
        PREFIX + "DB_UNHEALTHY_AFTER_SECONDS",
        5.0,
        number(0.0),
        "polls answer 503 once background reads have failed for this long",
    ),
    Setting(
        "statement_timeout_s",
        PREFIX + "STATEMENT_TIMEOUT_SECONDS",
        8.0,
        number(0.0),
        "Postgres statement_timeout of the service's connections (0 = none): a stuck statement "
        "fails "
        "instead of hanging polls and the loop",
    ),
    Setting(
        "lock_timeout_s",
        PREFIX + "LOCK_TIMEOUT_SECONDS",
        2.0,
        number(0.0),
        "Postgres lock_timeout of the service's connections (0 = none): a table locked by ALTER "
        "TABLE, "
        "VACUUM FULL or TRUNCATE answers 503 within seconds",
    ),
    Setting(
        "replay_retention_s",
        PREFIX + "REPLAY_RETENTION_SECONDS",
        3600.0,
        number(0.0),
        "how long a request_id can be replayed; afterwards it answers 410 (batches are deleted "
        "after twice this)",
    ),
    Setting(
        "job_retention_s",
        PREFIX + "JOB_RETENTION_SECONDS",
        7 * 86400.0,
        number(),
        "delete an ended job's decisions this long after it was last active (<= 0 keeps them "
        "forever); "
        "selected again, it reads only rows written after the purge",
    ),
    Setting(
        "proxy_connect_timeout_s",
        PREFIX + "PROXY_CONNECT_TIMEOUT_SECONDS",
        2.0,
        number(0.001),
        "connect timeout for proxy notifications",
    ),
    Setting(
        "proxy_read_timeout_s",
        PREFIX + "PROXY_READ_TIMEOUT_SECONDS",
        10.0,
        number(0.001),
        "read timeout for proxy notifications",
    ),
    Setting(
        "pacing",
        PREFIX + "PACING",
        "off",
        choice("off", "gate"),
        "gate: the launcher's --llm-base-url is the pacing gate, which forwards only its model "
        "calls to the LLM proxy and holds a new group's first call while the admission budget is "
        "spent (GET /admission); needs the pacing extra; off: every session starts at once",
    ),
    Setting(
        "gate_host",
        PREFIX + "GATE_HOST",
        "127.0.0.1",
        text,
        "the address the pacing gate listens on; beyond loopback it needs GATE_SECRET",
    ),
    Setting(
        "gate_port",
        PREFIX + "GATE_PORT",
        None,
        optional_integer(1),
        "the pacing gate's port (default BUFFER_SERVER_PORT + 1)",
    ),
    Setting(
        "gate_secret",
        PREFIX + "GATE_SECRET",
        None,
        path_secret,
        "a path segment of the gate's URL that callers must know; required beyond loopback. "
        "Local users can read it in the launcher's argv",
    ),
    Setting(
        "gate_max_body_bytes",
        PREFIX + "GATE_MAX_BODY_BYTES",
        64 * 1024 * 1024,
        integer(1024),
        "the largest model call the gate takes (larger: 413 body_too_large)",
    ),
    Setting(
        "gate_stall_s",
        PREFIX + "GATE_STALL_SECONDS",
        30.0,
        number(0.1),
        "a request head not whole within this, or a body with no byte for this long: the gate "
        "closes the connection (stalled)",
    ),
    Setting(
        "gate_max_held_bytes",
        PREFIX + "GATE_MAX_HELD_BYTES",
        1024 * 1024 * 1024,
        integer(0),
        "the bytes of held calls the gate keeps in all; past it a new first call gets 503 "
        "held_bytes (the launcher retries)",
    ),
    Setting(
        "gate_max_hold_s",
        PREFIX + "GATE_MAX_HOLD_SECONDS",
        300.0,
        number(1.0),
        "no call is held longer: it gets 503 max_hold and the launcher retries it (below its "
        "900 s request timeout)",
    ),
    Setting(
        "pacing_staleness",
        PREFIX + "PACING_STALENESS",
        None,
        optional_integer(0),
        "S of the budget (S + 1) x B: versions a group may lag behind the trainer's (default: "
        "MAX_OFF_POLICY, else 1)",
    ),
    Setting(
        "pacing_batch_groups",
        PREFIX + "PACING_BATCH_GROUPS",
        None,
        optional_integer(1),
        "B of the budget: groups the trainer trains on a step (default: the min_groups its polls "
        "state, else 8); set it for trainers that poll with {}",
    ),
    Setting(
        "pacing_session_timeout_s",
        PREFIX + "PACING_SESSION_TIMEOUT_SECONDS",
        60.0,
        number(1.0),
        "a session with no model call in flight at the gate and none for this long is gone: its "
        "group frees its place in the budget (above the launcher's longest retry backoff, 36 s)",
    ),
    Setting(
        "advertise_url",
        PREFIX + "ADVERTISE_URL",
        None,
        http_url,
        "this instance's URL as clients reach it (http[s]://host:port); a standby redirects polls, "
        "/start_rollout and /stop_rollout to the owner's; no user or password",
    ),
    Setting(
        "lease_s",
        PREFIX + "LEASE_SECONDS",
        10.0,
        lease_seconds,
        "ownership of the job: a lease in the state database, renewed every third of this; a "
        "standby takes "
        "over when it expires; 0 = no lease (one instance only: a second one would not be fenced)",
    ),
    Setting(
        "buffer_name",
        PREFIX + "NAME",
        None,
        buffer_name,
        "this buffer's name: instances with the same name on one state database are one buffer "
        "(one owner, the others standbys), with different names they are independent buffers; "
        "unnamed, an instance refuses to start while another owns the database's unnamed buffer",
    ),
    Setting(
        "host_id",
        PREFIX + "HOST_ID",
        None,
        optional_text,
        "this host for launcher adoption; default hostname/boot id/pid namespace (set it only to "
        "tell "
        "apart instances that cannot see each other's processes)",
    ),
    Setting(
        "token",
        PREFIX + "TOKEN",
        None,
        optional_text,
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
        log_level,
        "log level (per-poll lines are DEBUG)",
    ),
    Setting(
        "threads",
        PREFIX + "THREADS",
        16,
        integer(1, 256),
        "gunicorn gthread threads (the worker count is always 1)",
    ),
    Setting(
        "graceful_timeout_s",
        PREFIX + "GRACEFUL_TIMEOUT_SECONDS",
        60.0,
        number(1.0),
        "gunicorn graceful timeout; must exceed the launcher stop grace",
    ),
)

# Settings that are no longer read, with what replaced them: still accepted for one release, with
# a warning at start, and ignored.
REMOVED = {
    PREFIX + "PACING_IDLE_GAP_SECONDS": "B is ROLLOUT_BUFFER_PACING_BATCH_GROUPS, else the "
    "min_groups of the trainer's polls, else 8 (it was learned from idle gaps)",
    PREFIX + "PACING_SPARE_WASTE": "the budget has no spare groups any more; "
    "ROLLOUT_BUFFER_PACING_SESSION_TIMEOUT_SECONDS frees a lost group's place",
}

# Every variable a setting reads, aliases included: any other ROLLOUT_BUFFER_* is a typo.
KNOWN_ENV = {s.env for s in SETTINGS} | {a for s in SETTINGS for a in s.aliases}


def settings_table() -> str:
    """The settings as a markdown table (for the README)."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for s in SETTINGS:
        default = "" if s.default is None else f"`{s.default}`"
        names = f"`{s.env}`" + "".join(f" (or `{a}`)" for a in s.aliases)
        rows.append(f"| {names} | {default} | {s.help} |")
    rows += [
        "",
        "Removed settings: still accepted for this release, with a warning at start, and ignored.",
        "",
        "| variable | what replaced it |",
        "|---|---|",
    ]
    rows += [f"| `{name}` | {why} |" for name, why in sorted(REMOVED.items())]
    return "\n".join(rows)
