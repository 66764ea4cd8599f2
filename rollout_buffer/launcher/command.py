"""The launcher's command: an argv list from configuration plus the validated job id and K
(SPEC §5), never a shell string, and the environment it runs with.

Owns: :func:`launch_spec` for the three kinds of launcher (a configured command, the built-in
simulator, AIEvoBox's launcher.py). It must not start anything: the supervisor does.
"""

from __future__ import annotations

import os
import sys

from rollout_buffer.core.config import Config
from rollout_buffer.core.errors import OperationFailed
from rollout_buffer.launcher.supervisor import LaunchSpec

# the service's own secrets stay with the service: the launcher needs none of them
LAUNCHER_ENV_DROP = ("ROLLOUT_BUFFER_TOKEN",)


def launch_spec(config: Config, job_id: str, k: int) -> LaunchSpec:
    """The launcher command for a job, from configuration only (argv list, never a shell).

    With over-sampling the launcher runs K + N sessions per group (its --rl-group-size and
    ``{k}``); the buffer serves the first K of each group to complete."""
    k += config.oversample
    env = {name: value for name, value in os.environ.items() if name not in LAUNCHER_ENV_DROP}
    env["PYTHONUNBUFFERED"] = "1"
    log_path = os.path.join(config.run_dir, f"launcher-{job_id}.log")
    kind = config.launcher_kind
    if kind == "command":
        subs = {
            "job_id": job_id,
            "k": str(k),
            "db_url": config.db_url,
            "storage_type": config.storage_type,
        }
        # (the templates were validated by Config)
        argv = [arg.format(**subs) for arg in (config.launcher_cmd or ())]
        if "--job-id" not in argv:
            argv += ["--job-id", job_id]
        if "--rl-group-size" not in argv:
            argv += ["--rl-group-size", str(k)]
        return LaunchSpec(tuple(argv), config.aievobox_root or None, env, log_path)
    if kind == "simulate":
        argv = [
            sys.executable,
            "-m",
            "rollout_buffer.simulate",
            "--db-path",
            config.db_url,
            "--storage-type",
            config.storage_type,
            "--job-id",
            job_id,
            "--rl-group-size",
            str(k),
            "--pool-size",
            str(config.pool_size),
            "--rl-epoch",
            str(config.rl_epoch),
        ]
        argv += list(config.simulate_args or ())
        # the directory that holds this package (rollout_buffer/launcher/command.py: three up), so
        # that the child imports this very copy of it
        package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        package_parent = os.path.dirname(package)
        env["PYTHONPATH"] = os.pathsep.join(
            path for path in (package_parent, env.get("PYTHONPATH")) if path
        )
        return LaunchSpec(tuple(argv), None, env, log_path)
    root = config.aievobox_root or "."
    if config.env_config:
        env_args = ["--env-config", config.env_config]
    elif config.env_root:
        env_args = ["--env-root", config.env_root]
    else:
        raise OperationFailed(
            "the AIEvoBox launcher needs AIEVOBOX_ENV_CONFIG or AIEVOBOX_ENV_ROOT; neither is set",
        )
    proxy = (
        f"http://{config.proxy_host}:{config.proxy_port}/v1"
        if config.proxy_host
        else "http://127.0.0.1:8000/v1"
    )
    argv = [
        "python3",
        os.path.join(root, "launcher.py"),
        "--mode",
        config.aievobox_mode,
        "--db-path",
        config.db_url,
        "--storage-type",
        config.storage_type,
        *env_args,
        "--llm-base-url",
        proxy,
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
    return LaunchSpec(tuple(argv), root, env, log_path)
