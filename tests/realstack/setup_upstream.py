#!/usr/bin/env python3
"""Set up the upstream launcher for the real-launcher tier (tests/realstack/).

Nothing of the upstream project is kept in this repository. This script takes a copy that you give
(AI45Lab/Safactory: a git directory, bare or not, or a checked-out tree) and makes, in a directory
outside the repository:

- ``tree/``: the named paths only (PATHS), as the commit has them. A whole-tree ``git archive``
  stops on an absent blob of that repository (``fig/visualize.gif``); the launcher needs none of it.
- ``venv/``: the launcher's own virtual environment, with the packages it imports (PACKAGES) at
  the pins of the copy's ``requirements.txt`` (the whole file is the constraints: their
  dependencies get its pins too), plus ``python-dotenv`` (imported, not listed).
- ``stubs/wandb/``: an empty ``wandb`` package, on the venv's path through a ``.pth`` file.
  ``launcher.py`` imports wandb at import time (``utils`` -> ``rl.utils.metrics``) and never calls
  it; ``requirements.txt`` does not list it. Without it the launcher fails with a misleading
  "circular import" error.
- ``realstack.json``: where the copy came from, its commit, the venv's python.

Then it runs ``python launcher.py --help`` in the tree, with the venv, as a smoke test.

    python tests/realstack/setup_upstream.py --copy /path/to/Safactory [--dest DIR]
    export RBTEST_REALSTACK=DIR          # what it prints last; the tier reads it

Installing needs the package registry (pip, as configured on this machine); everything after
that runs offline.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VARIABLE = "RBTEST_REALSTACK"  # the tier's variable: the directory this script made
MANIFEST = "realstack.json"
DEFAULT_DEST = Path(tempfile.gettempdir()) / "rollout-buffer-realstack"

# what the launcher needs with --env-transport inproc and the math500_text environment
PATHS = (
    "launcher.py",
    "interactor.py",
    "log_setup.py",
    "requirements.txt",
    "core",
    "manager",
    "utils",
    "rl/utils",
    "env/__init__.py",
    "env/registry.py",
    "env/env_factory.py",
    "env/math500_text",
)
# what those modules import (a requirements.txt pin each), then what it imports but does not list
PACKAGES = (
    "aiohttp",
    "requests",
    "PyYAML",
    "tortoise-orm",
    "aiosqlite",
    "pypika-tortoise",
    "iso8601",
    "pytz",
    "typing_extensions",
    "numpy",
    "pandas",
    "pydantic",
    "gymnasium",
    "openai",
)
UNLISTED = ("python-dotenv",)
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)")


class SetupError(Exception):
    """What went wrong, said for the person who runs the script."""


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def run(argv: list[str]) -> None:
    print("+ " + " ".join(argv), flush=True)
    subprocess.run(argv, check=True)


def git(source: Path, *args: str) -> bytes:
    out = subprocess.run(
        ["git", f"--git-dir={source}", *args], check=True, capture_output=True, timeout=120
    )
    return out.stdout


def git_dir_of(copy: Path) -> Path | None:
    """The git directory of ``copy`` (itself when bare, else its .git), None for a plain tree."""
    for candidate in (copy, copy / ".git"):
        probe = subprocess.run(
            ["git", f"--git-dir={candidate}", "rev-parse", "--git-dir"],
            capture_output=True,
            timeout=60,
        )
        if probe.returncode == 0:
            return candidate
    return None


def extract(copy: Path, rev: str, tree: Path) -> dict[str, object]:
    """The named paths of ``copy`` at ``rev`` into ``tree``; returns where they came from."""
    source = git_dir_of(copy)
    if source is None:  # a plain checked-out tree: its files as they are
        for rel in PATHS:
            src = copy / rel
            if not src.exists():
                raise SetupError(f"{src} is missing: is {copy} a copy of Safactory?")
            if src.is_dir():
                shutil.copytree(src, tree / rel, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                (tree / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, tree / rel)
        return {"copy": str(copy), "commit": None, "note": "a tree without git: files as found"}
    try:
        commit = git(source, "rev-parse", "--verify", f"{rev}^{{commit}}").decode().strip()
    except subprocess.CalledProcessError as exc:
        raise SetupError(f"{copy} has no commit {rev!r}: {exc.stderr.decode().strip()}") from None
    try:  # named paths only: the whole tree has a blob that is not in the fetched copy
        data = git(source, "archive", "--format=tar", commit, "--", *PATHS)
    except subprocess.CalledProcessError as exc:
        raise SetupError(
            f"git archive of {copy} at {commit[:12]} failed: {exc.stderr.decode().strip()}"
        ) from None
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        # (the "data" filter refuses links and paths out of the tree; Python 3.10.12+, 3.11.4+)
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        archive.extractall(tree, **safe)
    subject = git(source, "log", "-1", "--format=%s", commit).decode().strip()
    return {"copy": str(copy), "commit": commit, "subject": subject}


def constraints(tree: Path, out: Path) -> list[str]:
    """The ``name==version`` lines of the tree's requirements.txt into ``out`` (a constraints
    file: a path or URL line, like its local wheel, cannot constrain); returns the pins of
    PACKAGES, in its spelling, each checked to be there."""
    pins: dict[str, str] = {}
    for line in (tree / "requirements.txt").read_text().splitlines():
        match = PIN.match(line.strip())
        if match:
            pins[normalized(match.group(1))] = f"{match.group(1)}=={match.group(2)}"
    missing = [name for name in PACKAGES if normalized(name) not in pins]
    if missing:
        raise SetupError(f"requirements.txt pins none of {missing}: is this the expected copy?")
    out.write_text("\n".join(pins.values()) + "\n")
    return [pins[normalized(name)] for name in PACKAGES]


def make_venv(dest: Path, tree: Path, python: str) -> Path:
    venv = dest / "venv"
    run([python, "-m", "venv", str(venv)])
    py = venv / "bin" / "python"
    pinned = constraints(tree, dest / "constraints.txt")
    pip = [str(py), "-m", "pip", "install", "--quiet"]
    run([*pip, "--upgrade", "pip"])
    run([*pip, "-c", str(dest / "constraints.txt"), *pinned, *UNLISTED])
    stubs = dest / "stubs" / "wandb"
    stubs.mkdir(parents=True, exist_ok=True)
    (stubs / "__init__.py").write_text(
        '"""An empty stand-in: the launcher imports wandb and never calls it."""\n'
    )
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (Path(site) / "realstack-stubs.pth").write_text(str(dest / "stubs") + "\n")
    return py


def smoke(py: Path, tree: Path) -> None:
    """``python launcher.py --help`` in the tree: every module it imports at start loads."""
    out = subprocess.run(
        [str(py), "launcher.py", "--help"],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if out.returncode != 0 or "--rl-group-size" not in out.stdout:
        raise SetupError(
            f"`python launcher.py --help` failed (exit {out.returncode}):\n"
            f"{out.stdout[-2000:]}{out.stderr[-4000:]}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--copy",
        required=True,
        type=Path,
        help="a copy of AI45Lab/Safactory: a git directory (bare or not) or a checked-out tree",
    )
    parser.add_argument("--rev", default="HEAD", help="the commit to extract (git copies only)")
    parser.add_argument(
        "--dest",
        type=Path,
        default=DEFAULT_DEST,
        help=f"where to make it, outside the repository (default {DEFAULT_DEST}); replaced",
    )
    parser.add_argument(
        "--python", default=sys.executable, help="the interpreter of the launcher's venv"
    )
    args = parser.parse_args(argv)
    copy, dest = args.copy.resolve(), args.dest.resolve()
    try:
        if not copy.exists():
            raise SetupError(f"--copy {copy} does not exist")
        if dest == ROOT or ROOT in dest.parents:
            raise SetupError(f"--dest {dest} is inside this repository: nothing upstream goes here")
        if dest.exists():
            if not (dest / MANIFEST).exists() and any(dest.iterdir()):
                raise SetupError(f"--dest {dest} exists and was not made by this script")
            shutil.rmtree(dest)
        tree = dest / "tree"
        tree.mkdir(parents=True)
        origin = extract(copy, args.rev, tree)
        py = make_venv(dest, tree, args.python)
        smoke(py, tree)
    except SetupError as exc:
        print(f"setup_upstream: {exc}", file=sys.stderr)
        return 1
    except subprocess.CalledProcessError as exc:  # venv or pip: their output is above
        print(
            f"setup_upstream: {' '.join(map(str, exc.cmd))} failed (exit {exc.returncode}); "
            "installing needs the package registry that pip is set up for",
            file=sys.stderr,
        )
        return 1
    manifest = {
        **origin,
        "paths": list(PATHS),
        "tree": str(tree),
        "python": str(py),
        "made": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"\nupstream launcher ready at {dest} (commit {origin['commit'] or 'unknown'})")
    print(f"export {VARIABLE}={dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
