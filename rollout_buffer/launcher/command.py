"""The launcher's command: an argv list from configuration plus the validated job id and K
(SPEC §5), never a shell string, and the environment it runs with.

Owns: :func:`launch_spec` for the three kinds of launcher (a configured command, the built-in
simulator, AIEvoBox's launcher.py), and :class:`ModelRoute`, where the launcher's model calls go
(the LLM proxy, or what the composition root gives: the pacing gate). It must not start anything:
the supervisor does.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from rollout_buffer.core.config import Config
from rollout_buffer.core.errors import OperationFailed
from rollout_buffer.launcher.supervisor import LaunchSpec

# the service's own secrets stay with the service: the launcher needs none of them (the gate's is
# in the URL it is handed)
LAUNCHER_ENV_DROP = ("ROLLOUT_BUFFER_TOKEN", "ROLLOUT_BUFFER_GATE_SECRET")


@dataclass(frozen=True)
class ModelRoute:
    """Where the launcher's model calls go: ``base_url`` (None: the LLM proxy's), with ``env``
    added to its environment and ``simulator_args`` to the built-in simulator's argv."""

    base_url: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    simulator_args: tuple[str, ...] = ()


def launch_spec(config: Config, job_id: str, k: int, route: ModelRoute | None = None) -> LaunchSpec:
    """The launcher command for a job, from configuration only (argv list, never a shell).

    With over-sampling the launcher runs K + N sessions per group (its --rl-group-size and
    ``{k}``); the buffer serves the first K of each group to complete."""
    route = route or ModelRoute()
    k += config.oversample
    env = {name: value for name, value in os.environ.items() if name not in LAUNCHER_ENV_DROP}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(route.env)
    base_url = route.base_url or proxy_url(config)
    log_path = os.path.join(config.run_dir, f"launcher-{job_id}.log")
    kind = config.launcher_kind
    if kind == "command":
        subs = {
            "job_id": job_id,
            "k": str(k),
            "db_url": config.db_url,
            "storage_type": config.storage_type,
            "llm_base_url": base_url,
        }
        # (the templates were validated by Config)
        argv = [arg.format(**subs) for arg in (config.launcher_cmd or ())]
        if "--job-id" not in argv:
            argv += ["--job-id", job_id]
        if "--rl-group-size" not in argv:
            argv += ["--rl-group-size", str(k)]
        return LaunchSpec(tuple(argv), config.aievobox_root or None, env, log_path)
    if kind == "simulate":
        # the same argv as the real launcher's (SPEC §5), so the simulator sees what it would
        argv = [
            sys.executable,
            "-m",
            "rollout_buffer.simulate",
            *_launcher_flags(config, job_id, k, _env_args(config), base_url),
            *route.simulator_args,
            *(config.simulate_args or ()),
        ]
        # the directory that holds this package (rollout_buffer/launcher/command.py: three up), so
        # that the child imports this very copy of it
        package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        package_parent = os.path.dirname(package)
        env["PYTHONPATH"] = os.pathsep.join(
            path for path in (package_parent, env.get("PYTHONPATH")) if path
        )
        return LaunchSpec(tuple(argv), None, env, log_path)
    root = config.aievobox_root or "."
    env_args = _env_args(config)
    if not env_args:
        raise OperationFailed(
            "the AIEvoBox launcher needs AIEVOBOX_ENV_CONFIG or AIEVOBOX_ENV_ROOT; neither is set",
        )
    argv = [
        "python3",
        os.path.join(root, "launcher.py"),
        *_launcher_flags(config, job_id, k, env_args, base_url),
    ]
    return LaunchSpec(tuple(argv), root, env, log_path)


def step_cap(config: Config) -> int | None:
    """The launcher's ``--max-steps`` (the last one of its argv): a session that reaches it without
    a terminal row has ended without a result. None when the launcher gets no such flag (none, or
    a command without it), so that no session is ever taken for capped by a guess."""
    if config.launcher_kind == "none":
        return None
    try:
        argv = launch_spec(config, "job", 1).argv
    except OperationFailed:  # a launcher that cannot be built has no cap (its start says why)
        return None
    value = flag_value(argv, "--max-steps")
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _env_args(config: Config) -> list[str]:
    """The launcher's environment flags: --env-config wins over --env-root; none when unset."""
    if config.env_config:
        return ["--env-config", config.env_config]
    if config.env_root:
        return ["--env-root", config.env_root]
    return []


def proxy_url(config: Config) -> str:
    """The LLM proxy's base URL as the original passed it (SPEC §5)."""
    if config.proxy_host:
        return f"http://{config.proxy_host}:{config.proxy_port}/v1"
    return "http://127.0.0.1:8000/v1"


def llm_base_url(argv: Sequence[str]) -> str | None:
    """The ``--llm-base-url`` of a launcher's argv (its last one), or None."""
    return flag_value(argv, "--llm-base-url")


def flag_value(argv: Sequence[str], flag: str) -> str | None:
    """The value of ``flag`` in an argv, as ``flag value`` or ``flag=value`` (the last one wins,
    as in argparse), or None."""
    found = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            found = argv[i + 1]
        elif arg.startswith(flag + "="):
            found = arg.partition("=")[2]
    return found


def _launcher_flags(
    config: Config, job_id: str, k: int, env_args: list[str], base_url: str
) -> list[str]:
    """Every flag of the original command after ``launcher.py`` (SPEC §5), in its order."""
    return [
        "--mode",
        config.aievobox_mode,
        "--db-path",
        config.db_url,
        "--storage-type",
        config.storage_type,
        *env_args,
        "--llm-base-url",
        base_url,
        "--llm-model",
        config.rl_model,
        "--llm-temperature",
        str(config.llm_temperature),
        "--max-steps",
        str(config.max_steps),
        "--message-cut",
        str(config.message_cut),
        "--pool-size",
        str(config.pool_size),
        "--multiplier",
        str(config.multiplier),
        "--job-id",
        job_id,
        "--no-rebuild-table",
        "--rl-use-session-suffix-url",
        "--rl-group-size",
        str(k),
        "--rl-epoch",
        str(config.rl_epoch),
        "--env-transport",
        config.env_transport,
        "--env-http-timeout-s",
        "600",
    ]
