"""The launcher's command from configuration (launcher.command): argv lists, never a shell."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import rollout_buffer
from rollout_buffer.core.config import Config
from rollout_buffer.launcher.command import flag_value, launch_spec


def test_the_simulated_launcher_imports_this_very_copy_of_the_package(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    config = Config.from_env({}, launcher="simulate", run_dir=str(tmp_path))
    spec = launch_spec(config, "job-7", 4)
    first, *rest = spec.env["PYTHONPATH"].split(os.pathsep)
    # the directory that holds the package, not the package itself: a child started where the
    # package is not installed could not import it
    assert Path(first) == Path(rollout_buffer.__file__).resolve().parent.parent
    assert rest == ["/elsewhere"]
    assert spec.argv[1:3] == ("-m", "rollout_buffer.simulate")
    assert spec.argv[spec.argv.index("--job-id") + 1] == "job-7"


def test_the_service_token_never_reaches_the_launcher(tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLOUT_BUFFER_TOKEN", "s3cret")
    config = Config.from_env({}, launcher="simulate", run_dir=str(tmp_path))
    assert "ROLLOUT_BUFFER_TOKEN" not in launch_spec(config, "job-7", 4).env


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["run", "--max-steps", "7"], "7"),
        (["run", "--max-steps=7"], "7"),
        (["run", "--max-steps", "7", "--max-steps=9"], "9"),  # the last one wins, as in argparse
        (["run", "--max-steps=9", "--max-steps", "7"], "7"),
        (["run", "--max-steps"], None),  # no value follows
        (["run", "--max-steps-x", "7"], None),
    ],
)
def test_a_flag_s_value_is_its_last_one_in_either_form(argv, expected):
    assert flag_value(argv, "--max-steps") == expected
