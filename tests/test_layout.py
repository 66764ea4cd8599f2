"""The package's layout keeps the rules of its map (README "The map"), read from the README itself.

- every module of ``rollout_buffer/`` is in the map, once;
- every import of a package module (at the top, under TYPE_CHECKING, or inside a function) goes to
  the importer's own row or a row below it, and there is no import cycle;
- no module is over 450 lines, and the ``Service`` class is at most 250;
- every module's opening docstring says what it owns ("Owns") and what it must not touch ("must not").
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "rollout_buffer"
MAX_MODULE_LINES = 450
MAX_SERVICE_LINES = 250


def _modules() -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text(), str(p)) for p in sorted(PKG.glob("*.py"))}


def _map_rows() -> list[list[str]]:
    """The README map's rows, top first: the module names of each row."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("### The map"):]
    section = section[:section.index("\n### ", 1)]
    rows = []
    for line in section.splitlines():
        if line.startswith("| `"):
            first_cell = line.split("|")[1]
            rows.append(re.findall(r"`([A-Za-z_]+)\.py`", first_cell))
    return rows


def _imports(tree: ast.Module, modules: set[str]) -> set[str]:
    """The package modules a module imports, anywhere in it."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0 and not (node.module or "").startswith("rollout_buffer"):
                continue
            base = (node.module or "").removeprefix("rollout_buffer").lstrip(".")
            if base:
                out.add(base.split(".")[0])
            else:  # from . import x, y
                out.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[1] for a in node.names if a.name.startswith("rollout_buffer."))
    return out & modules


def test_every_module_is_in_the_map_once():
    rows = _map_rows()
    listed = [m for row in rows for m in row]
    assert len(rows) >= 10
    assert sorted(set(listed)) == sorted(listed), "a module is listed twice"
    assert set(listed) == set(_modules()), (f"not in the map: {sorted(set(_modules()) - set(listed))}; "
                                            f"in the map but not in the package: {sorted(set(listed) - set(_modules()))}")


def test_imports_only_go_down_the_map_and_never_in_a_cycle():
    modules = _modules()
    row_of = {m: i for i, row in enumerate(_map_rows()) for m in row}
    graph = {m: _imports(tree, set(modules)) - {m} for m, tree in modules.items()}
    upward = sorted(f"{m} imports {d}" for m, deps in graph.items() for d in deps if row_of[d] < row_of[m])
    assert not upward, f"imports that go up the README map: {upward}"

    state: dict[str, int] = {}  # 1 on the stack, 2 done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                raise AssertionError(f"import cycle: {' -> '.join(path[path.index(d):] + [d])}")
            if d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_no_module_is_over_450_lines_and_service_is_at_most_250():
    long = {p.name: n for p in PKG.glob("*.py") if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"
    service = next(n for n in _modules()["service"].body if isinstance(n, ast.ClassDef) and n.name == "Service")
    assert service.end_lineno - service.lineno + 1 <= MAX_SERVICE_LINES


def test_every_module_says_what_it_owns_and_what_it_must_not_touch():
    missing = {}
    for name, tree in _modules().items():
        doc = " ".join((ast.get_docstring(tree) or "").split())
        lacks = [w for w in ("Owns", "must not") if w.lower() not in doc.lower()]
        if lacks:
            missing[name] = lacks
    assert not missing, f"opening docstrings without {missing}"
