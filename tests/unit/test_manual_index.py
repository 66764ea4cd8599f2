"""Every page of the manual is in both of its indexes: the README's table and docs/README.md
(docs/client.md was in neither, issue 39)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def test_every_manual_page_is_in_both_indexes():
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    readme = set(
        re.findall(r"^\| \[[^]]+\]\(docs/([\w-]+\.md)\)", (ROOT / "README.md").read_text(), re.M)
    )
    docs_index = set(
        re.findall(r"^- \[[^]]+\]\(([\w-]+\.md)\)", (ROOT / "docs" / "README.md").read_text(), re.M)
    )
    assert "client.md" in pages
    assert readme == pages, f"README's table: missing {pages - readme}, extra {readme - pages}"
    assert docs_index == pages, f"docs/README.md: missing {pages - docs_index}"
