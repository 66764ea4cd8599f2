"""What an install brings: the runtime needs four packages, and the tools are pinned extras.

A quickstart that pulled in a test-only package (two selenium wheels, issue 22) is what these
guard against; docs/development.md, "Runtime dependencies", says why each runtime package is there.
"""

from __future__ import annotations

import configparser
import os
import re

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
RUNTIME = {"flask", "gunicorn", "requests", "psycopg"}
TEST_ONLY = {"pytest", "selenium"}


def _setup_cfg() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None)
    parser.read(os.path.join(ROOT, "setup.cfg"), encoding="utf-8")
    return parser


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip() and line[0] != "#"]


def _name(requirement: str) -> str:
    return re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].lower()


def test_requirements_are_the_runtime_and_match_install_requires():
    with open(os.path.join(ROOT, "requirements.txt"), encoding="utf-8") as fh:
        requirements = _lines(fh.read())
    install_requires = _lines(_setup_cfg()["options"]["install_requires"])
    assert requirements == install_requires, "requirements.txt and install_requires must agree"
    assert {_name(r) for r in requirements} == RUNTIME


def test_the_tools_are_pinned_extras_and_dev_includes_test():
    extras = _setup_cfg()["options.extras_require"]
    test, dev = _lines(extras["test"]), _lines(extras["dev"])
    assert {_name(r) for r in test} == TEST_ONLY
    assert "rollout-buffer[test,pacing]" in dev  # CI installs dev: the pacing extra's tests run
    assert {_name(r) for r in dev} >= {"ruff", "mypy", "import-linter", "types-requests"}
    unpinned = [r for r in test + dev if "==" not in r and r != "rollout-buffer[test,pacing]"]
    assert not unpinned, (
        f"pin every tool exactly (a tool upgrade is a change of its own): {unpinned}"
    )


def test_the_pacing_extra_is_h11_pinned_to_the_tested_minor_range():
    """An opt-in feature's dependency goes in its extra, pinned to the range CI tests."""
    pacing = _lines(_setup_cfg()["options.extras_require"]["pacing"])
    assert pacing == ["h11>=0.16,<0.17"]
