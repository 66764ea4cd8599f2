"""Configuration: typed, strict, read once; the docs' settings page is generated from it."""

from __future__ import annotations

import logging
import os

import pytest

from rollout_buffer.core.config import Config, settings_table
from rollout_buffer.core.errors import ConfigError
from rollout_buffer.launcher.launcher import launch_spec
from rollout_buffer.tools import cli
from rollout_buffer.tools.settings_page import REGENERATE


def test_defaults_without_aievobox_root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    c = Config.from_env({})
    assert c.port == 18889 and c.host == "0.0.0.0" and c.ttl_s == 1800.0
    assert c.db_url == "sqlite://" + str(tmp_path / "rollout_buffer.db")
    assert c.storage_type == "sqlite" and c.run_dir == str(tmp_path / "logs")
    assert c.launcher_kind == "simulate" and c.proxy_url is None


def test_defaults_with_aievobox_root(tmp_path):
    c = Config.from_env(
        {"AIEVOBOX_ROOT": str(tmp_path), "LLM_PROXY_HOST": "h", "LLM_PROXY_PORT": "9"}
    )
    assert c.db_url == f"sqlite://{tmp_path}/rl/rl.db" and c.run_dir == f"{tmp_path}/logs"
    assert c.launcher_kind == "aievobox" and c.proxy_url == "http://h:9"


@pytest.mark.parametrize(
    "env,needle",
    [
        ({"BUFFER_SERVER_PORT": "abc"}, "BUFFER_SERVER_PORT='abc' is invalid: expected an integer"),
        ({"BUFFER_SERVER_PORT": "70000"}, "expected an integer from 1 to 65535"),
        (
            {"AIEVOBOX_BUFFER_INCOMPLETE_GROUP_TTL_SECONDS": "nan"},
            "AIEVOBOX_BUFFER_INCOMPLETE_GROUP_TTL_SECONDS",
        ),
        ({"STORAGE_TYPE": "mysql"}, "expected one of sqlite, postgres"),
        ({"STORAGE_TYPE": "postgres"}, "does not match AIEVOBOX_DB_URL"),
        ({"AIEVOBOX_DB_URL": "mysql://x"}, "AIEVOBOX_DB_URL='mysql://x' is invalid"),
        ({"ROLLOUT_BUFFER_RESTART_POLICY": "always"}, "expected one of never, on-failure"),
        ({"ROLLOUT_BUFFER_TTL": "5"}, "unknown setting ROLLOUT_BUFFER_TTL;"),
        ({"LLM_PROXY_HOST": "h"}, "LLM_PROXY_PORT is not"),
        ({"ROLLOUT_BUFFER_LAUNCHER_CMD": "a 'b"}, "ROLLOUT_BUFFER_LAUNCHER_CMD"),
        ({"ROLLOUT_BUFFER_LAUNCHER_CMD": "run --x {"}, "is not a valid template"),
        (
            {"ROLLOUT_BUFFER_LAUNCHER_CMD": "run --job {jobid}"},
            "expected only {job_id}, {k}, {db_url}, {storage_type}",
        ),
        ({"ROLLOUT_BUFFER_TOKN": "secret-token"}, "unknown setting ROLLOUT_BUFFER_TOKN;"),
        ({"ROLLOUT_BUFFER_GATE_SECRET": "short"}, "16-256 characters"),
        ({"ROLLOUT_BUFFER_GATE_STALL_SECONDS": "0"}, "ROLLOUT_BUFFER_GATE_STALL_SECONDS='0'"),
    ],
)
def test_bad_values_name_the_variable(env, needle):
    with pytest.raises(ConfigError) as exc:
        Config.from_env(env)
    assert needle in str(exc.value)


def test_misspelled_multiplier_is_read_with_a_warning(tmp_path, lite_url, caplog):
    caplog.set_level(logging.WARNING, logger="rollout_buffer.core.config")
    cfg = Config.from_env(
        {
            "AIEVOBOC_MULTIPLIER": "2.5",
            "AIEVOBOX_ROOT": str(tmp_path),
            "AIEVOBOX_DB_URL": lite_url,
            "AIEVOBOX_ENV_ROOT": "/envs",
        }
    )
    assert cfg.multiplier == 2.5
    warnings = [r for r in caplog.records if "AIEVOBOC_MULTIPLIER" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert "AIEVOBOX_MULTIPLIER" in warnings[0].getMessage()
    argv = list(launch_spec(cfg, "J", 4).argv)  # and the launcher gets it
    assert argv[argv.index("--multiplier") + 1] == "2.5"

    # Both set: the right name wins, no warning.
    caplog.clear()
    cfg = Config.from_env(
        {"AIEVOBOC_MULTIPLIER": "2.5", "AIEVOBOX_MULTIPLIER": "3.0", "AIEVOBOX_DB_URL": lite_url}
    )
    assert cfg.multiplier == 3.0
    assert not [r for r in caplog.records if "AIEVOBOC_MULTIPLIER" in r.getMessage()]
    assert Config.from_env({"AIEVOBOX_DB_URL": lite_url}).multiplier == 1.2


def test_postgres_url_sets_storage_type_and_overrides_win():
    c = Config.from_env({"AIEVOBOX_DB_URL": "postgresql://root@127.0.0.1:5432/test"}, port=1234)
    assert c.storage_type == "postgres" and c.port == 1234


def test_launcher_cmd_is_split_like_a_shell():
    c = Config.from_env({"ROLLOUT_BUFFER_LAUNCHER_CMD": "python3 'my launcher.py' --x {k}"})
    assert (
        c.launcher_cmd == ("python3", "my launcher.py", "--x", "{k}")
        and c.launcher_kind == "command"
    )


def test_the_settings_page_is_the_settings_commands_output(capsys):
    assert cli.main(["settings"]) == 0
    printed = capsys.readouterr().out
    assert settings_table() in printed  # the page holds every setting
    page = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "settings.md")
    with open(page, encoding="utf-8") as fh:
        committed = fh.read()
    assert printed == committed, (
        f"docs/settings.md is out of date: regenerate it with `{REGENERATE}`"
    )


def test_an_unknown_setting_is_named_without_its_value():
    with pytest.raises(ConfigError) as info:
        Config.from_env({"ROLLOUT_BUFFER_TOKN": "secret-token"})
    assert "secret-token" not in str(info.value)


def test_a_valid_launcher_template_and_literal_braces_pass():
    c = Config.from_env({"ROLLOUT_BUFFER_LAUNCHER_CMD": "run --job {job_id} --json {{}}"})
    assert c.launcher_cmd == ("run", "--job", "{job_id}", "--json", "{{}}")


def test_a_relative_sqlite_url_is_resolved_once_where_the_launcher_resolves_it(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "aievobox"
    c = Config.from_env({"AIEVOBOX_DB_URL": "sqlite://rl/rl.db", "AIEVOBOX_ROOT": str(root)})
    assert c.db_url == f"sqlite://{root}/rl/rl.db"  # the launcher runs in AIEVOBOX_ROOT
    c = Config.from_env(
        {"AIEVOBOX_DB_URL": "sqlite://data/x.db", "ROLLOUT_BUFFER_STATE_DB_URL": "sqlite://st.db"}
    )
    assert (
        c.db_url == f"sqlite://{tmp_path}/data/x.db"
        and c.state_db_url == f"sqlite://{tmp_path}/st.db"
    )
    assert Config.from_env({"AIEVOBOX_DB_URL": "sqlite:///abs/x.db"}).db_url == "sqlite:///abs/x.db"


def test_a_removed_setting_is_accepted_once_with_a_warning_naming_its_replacement(caplog):
    """Issue 34: a pacing setting removed still starts the service this release, ignored, with
    one warning that names what replaced it; a name that never existed still refuses."""
    env = {"ROLLOUT_BUFFER_PACING_IDLE_GAP_SECONDS": "5", "ROLLOUT_BUFFER_PACING_SPARE_WASTE": "x"}
    with caplog.at_level(logging.WARNING, logger="rollout_buffer.core.config"):
        config = Config.from_env(env)
        Config.from_env(env)  # read again (gunicorn does): no second warning
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2, warnings
    assert "ROLLOUT_BUFFER_PACING_IDLE_GAP_SECONDS" in warnings[0]
    assert "ROLLOUT_BUFFER_PACING_BATCH_GROUPS" in warnings[0]  # what replaced it
    assert "ROLLOUT_BUFFER_PACING_SESSION_TIMEOUT_SECONDS" in warnings[1]
    assert not hasattr(config, "pacing_idle_gap_s")
    with pytest.raises(ConfigError, match="ROLLOUT_BUFFER_PACING_IDLE_GAP"):
        Config.from_env({"ROLLOUT_BUFFER_PACING_IDLE_GAP": "5"})
    assert "ROLLOUT_BUFFER_PACING_SPARE_WASTE" in settings_table()  # listed as removed


def test_a_gate_beyond_loopback_needs_a_secret():
    proxy = {"LLM_PROXY_HOST": "127.0.0.1", "LLM_PROXY_PORT": "8000"}
    gate = {**proxy, "ROLLOUT_BUFFER_PACING": "gate", "ROLLOUT_BUFFER_GATE_HOST": "0.0.0.0"}
    with pytest.raises(ConfigError, match="ROLLOUT_BUFFER_GATE_SECRET"):
        Config.from_env(gate)
    Config.from_env({**gate, "ROLLOUT_BUFFER_GATE_SECRET": "a" * 16})
    Config.from_env({**proxy, "ROLLOUT_BUFFER_PACING": "gate"})  # loopback: no secret needed
    with pytest.raises(ConfigError, match="LLM_PROXY_HOST"):
        Config.from_env({"ROLLOUT_BUFFER_PACING": "gate"})


def test_an_invalid_gate_secret_is_not_shown_in_the_error():
    """Issue 34: no message shows the gate's secret. A base64 one (``openssl rand -base64``) has
    ``+``, ``/`` or ``=``: refused, and the error does not print it to the terminal or the log."""
    near_miss = "q8Zr+T1/vX0pL2mN4bC6dE=="
    with pytest.raises(ConfigError) as exc:
        Config.from_env({"ROLLOUT_BUFFER_GATE_SECRET": near_miss})
    assert "ROLLOUT_BUFFER_GATE_SECRET" in str(exc.value) and "16-256" in str(exc.value)
    assert near_miss not in str(exc.value) and "q8Zr" not in str(exc.value)


def test_pacing_on_without_its_extra_refuses_to_start_naming_it(monkeypatch):
    import builtins

    from rollout_buffer import pacing

    real_import = builtins.__import__

    def no_h11(name, *args, **kwargs):
        if name == "h11":
            raise ImportError("No module named 'h11'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_h11)
    config = Config.from_env(
        {"ROLLOUT_BUFFER_PACING": "gate", "LLM_PROXY_HOST": "127.0.0.1", "LLM_PROXY_PORT": "1"}
    )
    with pytest.raises(ConfigError, match=r"pip install 'rollout-buffer\[pacing\]'"):
        pacing.build(config, owner=lambda: False, launcher_url=lambda: None)


def test_the_launcher_template_takes_the_model_base_url():
    c = Config.from_env(
        {
            "ROLLOUT_BUFFER_LAUNCHER_CMD": "run --base {llm_base_url}",
            "LLM_PROXY_HOST": "proxy",
            "LLM_PROXY_PORT": "9",
        }
    )
    assert launch_spec(c, "j", 1).argv[:3] == ("run", "--base", "http://proxy:9/v1")


def test_pacing_on_refuses_a_launcher_command_that_bypasses_the_gate():
    """Issue 34, item 7: with pacing on, the launcher's command must take the gate's URL as
    {llm_base_url}: without it the launcher calls the proxy directly, unpaced, and with
    AIEVOBOX_LLM_MAX_CONCURRENCY=0 it would have no concurrency limit either."""
    gate = {"ROLLOUT_BUFFER_PACING": "gate", "LLM_PROXY_HOST": "127.0.0.1", "LLM_PROXY_PORT": "8"}
    bypass = "python3 launcher.py --llm-base-url http://127.0.0.1:8/v1"
    with pytest.raises(ConfigError, match=r"must hand the launcher the gate's URL as \{llm_base"):
        Config.from_env({**gate, "ROLLOUT_BUFFER_LAUNCHER_CMD": bypass})
    Config.from_env({**gate, "ROLLOUT_BUFFER_LAUNCHER_CMD": "run --llm-base-url={llm_base_url}"})
    Config.from_env({"ROLLOUT_BUFFER_LAUNCHER_CMD": bypass})  # pacing off: the proxy's own


def test_the_thresholds_that_became_constants_warn_once_and_are_ignored(caplog):
    """Issue 37: a threshold nobody would tune is a documented constant; its old variable still
    starts the service this release, ignored, with one warning naming what replaced it."""
    env = {
        "ROLLOUT_BUFFER_MAX_GROUP_BYTES": "2048",
        "ROLLOUT_BUFFER_ZERO_VARIANCE_EPSILON": "0.5",
        "ROLLOUT_BUFFER_GRACEFUL_TIMEOUT_SECONDS": "20",
    }
    with caplog.at_level(logging.WARNING, logger="rollout_buffer.core.config"):
        config = Config.from_env(env)
        Config.from_env(env)
    warnings = sorted(r.getMessage() for r in caplog.records)
    assert len(warnings) == 3, warnings
    assert "ROLLOUT_BUFFER_GRACEFUL_TIMEOUT_SECONDS" in warnings[0]
    assert "ROLLOUT_BUFFER_STOP_GRACE_SECONDS" in warnings[0]  # what replaced it
    assert "the constant MAX_GROUP_BYTES" in warnings[1]
    assert "the constant ZERO_VARIANCE_EPSILON" in warnings[2]
    assert config.max_group_bytes == 1 << 30 and config.zero_variance_epsilon == 1e-6
    assert config.graceful_timeout_s == 60.0
    page = settings_table()
    assert "| `MAX_GROUP_BYTES` | `1073741824` |" in page  # documented as a constant
    assert "| `ROLLOUT_BUFFER_MAX_GROUP_BYTES` | the constant MAX_GROUP_BYTES" in page


def test_no_removed_setting_is_still_read_and_every_constant_has_its_reason():
    from rollout_buffer.core.config import CONSTANTS, KNOWN_ENV, REMOVED

    assert not set(REMOVED) & KNOWN_ENV
    assert all(f.metadata["constant"] for f in CONSTANTS)
    # every constant that was a setting names its constant in the removed table
    names = {f.name.upper() for f in CONSTANTS}
    assert {n for n in names if n != "GRACEFUL_MARGIN_S"} <= {
        word.strip("()") for why in REMOVED.values() for word in why.split()
    }


def test_gunicorn_always_outlasts_the_launcher_stop_and_waiting_polls_leave_threads_free():
    config = Config.from_env({"ROLLOUT_BUFFER_STOP_GRACE_SECONDS": "100"})
    assert config.graceful_timeout_s > config.stop_grace_s  # (was a refusal to start)
    assert Config.from_env({}).max_waiting_polls == 8
    assert Config.from_env({"ROLLOUT_BUFFER_THREADS": "4"}).max_waiting_polls == 2
    # one thread: no poll waits, or it would hold the only thread (and /health with it)
    assert Config.from_env({"ROLLOUT_BUFFER_THREADS": "1"}).max_waiting_polls == 0
    assert Config.from_env({}, max_waiting_polls=3).max_waiting_polls == 3  # tests may shrink it
