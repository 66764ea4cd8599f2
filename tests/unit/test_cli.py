"""The command line's texts (issue 39): written for users, every default shown, and a bare
``rollout-buffer`` that says what each command does."""

from __future__ import annotations

import argparse
import re

import pytest

from rollout_buffer.tools import cli

COMMANDS = ("serve", "init-db", "demo", "stats", "export", "settings")


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("no commands")


def help_of(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as done:
        cli.main([*argv, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def test_a_bare_command_prints_every_command_and_what_it_does(capsys):
    assert cli.main([]) == 0  # the user asked what there is: nothing went wrong
    out, err = capsys.readouterr()
    assert err == ""
    commands = subparsers(cli.build_parser())
    assert tuple(commands) == COMMANDS
    for name in COMMANDS:
        # each command on a line of its own, with its one-line summary
        assert re.search(rf"^\s+{name}\s+\w", out, re.MULTILINE), (name, out)
    assert "rollout-buffer demo" in out  # where to start


def test_the_top_help_is_for_users_not_a_module_docstring(capsys):
    out = help_of([], capsys)
    assert out == cli.build_parser().format_help()
    for developer_text in ("Owns:", "must not", "``", "cmd_", "{serve,"):
        assert developer_text not in out, developer_text
    assert "trainer" in out and "COMMAND --help" in out


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_help_describes_it_and_shows_every_default(command, capsys):
    out = help_of([command], capsys)
    parser = subparsers(cli.build_parser())[command]
    assert parser.description and parser.description.split()[0] in out
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.required:
            continue
        if action.nargs == 0:  # a flag: off unless given
            continue
        assert action.help, f"{command} {action.dest} has no help"
        shown = parser._get_formatter()._expand_help(action)  # as --help prints it
        assert "default" in shown, f"{command} {action.option_strings or action.dest}: {shown!r}"
        if action.default not in (None, False):
            assert str(action.default) in shown, (command, action.dest, shown)


def test_demo_help_shows_the_defaults_a_newcomer_asks_about(capsys):
    out = " ".join(help_of(["demo"], capsys).split())  # lines joined: argparse wraps them
    for option, default in (
        ("--groups", "24"),
        ("--k", "4"),
        ("--pace", "0.02"),
        ("--timeout", "300.0"),
        ("--seed", str(cli.DEMO_SEED)),
    ):
        assert re.search(rf"{option} \S+ .*?\(default: {re.escape(default)}\)", out), option
    assert "removed at the end" in out  # --workdir's default, in words


def test_the_demo_seed_is_fixed_by_default():
    args = cli.build_parser().parse_args(["demo"])
    assert args.seed == cli.DEMO_SEED and isinstance(args.seed, int)
