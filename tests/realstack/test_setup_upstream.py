"""The real-launcher tier's setup and its skip, without the upstream project: a git repository
made here stands in for the copy a user gives (these run in every suite, not only with
RBTEST_REALSTACK)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import setup_upstream
import stack

FILES = {
    "launcher.py": "print('launcher')\n",
    "interactor.py": "",
    "log_setup.py": "",
    "requirements.txt": "aiohttp==3.13.2\nrayjob_sdk-0.3.11-py3-none-any.whl\n",
    "core/__init__.py": "",
    "manager/__init__.py": "",
    "utils/__init__.py": "",
    "rl/utils/__init__.py": "",
    "env/__init__.py": "",
    "env/registry.py": "",
    "env/env_factory.py": "",
    "env/math500_text/math500_text_env.py": "",
    "rl/buffer_server.py": "not needed\n",  # beside rl/utils: left out
    "README.md": "not needed\n",
    "fig/visualize.gif": "GIF89a",  # its blob is taken away below, as in the fetched copy
}
NAMED = {name for name in FILES if not name.startswith(("rl/buffer", "README", "fig/"))}


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *args], check=True, capture_output=True, text=True
    ).stdout.strip()


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """A checked-out repository shaped like the upstream one, whose fig/visualize.gif blob is
    absent (a whole-tree git archive fails on it)."""
    repo = tmp_path / "Safactory"
    for name, text in FILES.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "upstream")
    blob = git(repo, "rev-parse", "HEAD:fig/visualize.gif")
    (repo / ".git" / "objects" / blob[:2] / blob[2:]).unlink()
    return repo


def files(tree: Path) -> set[str]:
    return {str(p.relative_to(tree)) for p in tree.rglob("*") if p.is_file()}


def test_only_the_named_paths_of_the_commit_are_extracted(copy: Path, tmp_path: Path) -> None:
    whole = subprocess.run(
        ["git", "-C", str(copy), "archive", "HEAD"], capture_output=True, text=False
    )
    assert whole.returncode != 0  # the reason for naming paths
    (copy / "launcher.py").write_text("print('changed, not committed')\n")
    for source in (copy, copy / ".git"):  # a checked-out tree, and its git directory
        tree = tmp_path / f"tree-{source.name}"
        tree.mkdir()
        origin = setup_upstream.extract(source, "HEAD", tree)
        assert origin["commit"] == git(copy, "rev-parse", "HEAD")
        assert files(tree) == NAMED
        assert (tree / "launcher.py").read_text() == "print('launcher')\n"  # the commit's


def test_a_tree_without_git_is_copied_as_found(copy: Path, tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    setup_upstream.extract(copy, "HEAD", plain)  # (a tree with no .git)
    tree = tmp_path / "tree"
    tree.mkdir()
    origin = setup_upstream.extract(plain, "HEAD", tree)
    assert origin["commit"] is None
    assert files(tree) == NAMED


def test_a_copy_of_something_else_is_refused(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    with pytest.raises(setup_upstream.SetupError, match="is missing"):
        setup_upstream.extract(tmp_path / "tree", "HEAD", tmp_path / "out")
    with pytest.raises(setup_upstream.SetupError, match="git archive"):
        setup_upstream.extract(setup_upstream.ROOT, "HEAD", tree)  # this repository


def test_the_venv_takes_the_requirements_pins(tmp_path: Path) -> None:
    (tmp_path / "requirements.txt").write_text(
        "\n".join(
            [f"{name.upper()}==1.{i}" for i, name in enumerate(setup_upstream.PACKAGES)]
            + ["ray==2.49.2", "rayjob_sdk-0.3.11-py3-none-any.whl", "# a comment"]
        )
    )
    out = tmp_path / "constraints.txt"
    pins = setup_upstream.constraints(tmp_path, out)
    assert pins[0] == "AIOHTTP==1.0" and len(pins) == len(setup_upstream.PACKAGES)
    assert "ray==2.49.2" in out.read_text() and "whl" not in out.read_text()
    (tmp_path / "requirements.txt").write_text("aiohttp==3.13.2\n")
    with pytest.raises(setup_upstream.SetupError, match="pins none of"):
        setup_upstream.constraints(tmp_path, out)


def test_nothing_is_made_inside_the_repository(copy: Path, tmp_path: Path, capsys) -> None:
    inside = setup_upstream.ROOT / "tests" / "upstream"
    assert setup_upstream.main(["--copy", str(copy), "--dest", str(inside)]) == 1
    assert "inside this repository" in capsys.readouterr().err
    assert not inside.exists()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    assert setup_upstream.main(["--copy", str(copy), "--dest", str(foreign)]) == 1
    assert "not made by this script" in capsys.readouterr().err
    assert (foreign / "keep.txt").exists()


def test_the_tier_skips_or_fails_saying_what_to_do(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.delenv(stack.VARIABLE, raising=False)
    assert stack.Upstream.from_env() is None
    reason = stack.skip_reason()
    assert stack.VARIABLE in reason and "tests/realstack/setup_upstream.py" in reason
    assert "postgres" not in reason.lower()  # .ci/run takes a skip that says so for a failure
    monkeypatch.setenv(stack.VARIABLE, str(tmp_path))
    with pytest.raises(stack.UpstreamError, match=r"setup_upstream\.py"):
        stack.Upstream.from_env()
