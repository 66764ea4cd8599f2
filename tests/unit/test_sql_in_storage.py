"""SQL only in storage (issue 37): no module of the package outside ``rollout_buffer/storage``
runs a statement or holds one. The scan reads every module's syntax tree: a use of a connection's
statement method (``execute``, ``fetchone``, ``transaction``..., called or passed on), or a string
that is a statement, fails the test with the module, the line and what it found."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import rollout_buffer

PACKAGE = Path(rollout_buffer.__file__).parent
# what a connection (ours, sqlite3's or psycopg's) runs a statement with
STATEMENT_METHODS = frozenset(
    {
        "execute",
        "executemany",
        "executescript",
        "fetchone",
        "fetchall",
        "scalar",
        "transaction",
        "read_snapshot",
    }
)
STATEMENT = re.compile(
    r"^\s*(?:(?:SELECT|DELETE)\b.*\bFROM\b|INSERT\s+INTO\b|UPDATE\s+\w+\s+SET\b"
    r"|(?:CREATE|ALTER|DROP)\s+(?:TABLE|INDEX)\b|(?:BEGIN|COMMIT|ROLLBACK|PRAGMA)\b)",
    re.IGNORECASE | re.DOTALL,
)


def offenders(root: Path) -> list[str]:
    """Every place under ``root`` (a package) outside its ``storage`` package that runs or holds
    SQL, as "path:line: what"."""
    found: list[tuple[str, int, str]] = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if relative.parts[0] == "storage":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in STATEMENT_METHODS:
                found.append((str(relative), node.lineno, f"uses .{node.attr}"))
            elif (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and STATEMENT.match(node.value)
            ):
                found.append((str(relative), node.lineno, f"holds SQL {node.value[:40]!r}"))
    return [f"{path}:{line}: {what}" for path, line, what in sorted(found)]


def test_no_module_outside_storage_runs_or_holds_sql():
    found = offenders(PACKAGE)
    assert not found, "SQL outside rollout_buffer/storage (move it there):\n" + "\n".join(found)


def test_the_scan_names_an_offender(tmp_path):
    """The scan would catch a statement run outside storage, and a statement held there, and
    leaves storage's own alone."""
    (tmp_path / "storage").mkdir()
    (tmp_path / "storage" / "db.py").write_text("def go(db):\n    db.execute('SELECT 1')\n")
    (tmp_path / "runtime").mkdir()
    (tmp_path / "runtime" / "lease.py").write_text(
        "RENEW = 'UPDATE rollout_buffer_lease SET epoch = 2'\n\n"
        "def renew(db):\n    return db.execute(RENEW)\n\n"
        "def later(db):\n    run = db.fetchone\n    return run\n"
    )
    (tmp_path / "runtime" / "words.py").write_text("TEXT = 'select the job, then begin'\n")
    assert offenders(tmp_path) == [
        "runtime/lease.py:1: holds SQL 'UPDATE rollout_buffer_lease SET epoch = '",
        "runtime/lease.py:4: uses .execute",
        "runtime/lease.py:7: uses .fetchone",
    ]
