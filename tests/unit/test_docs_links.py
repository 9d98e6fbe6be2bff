"""Every relative link of the project's Markdown pages reaches a file, and its anchor a heading.

Pages move (run logs went to ``bench/results/``, summaries stayed in ``docs/``); a link left
pointing at the old place, or at a section that moved away, fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted(
    [ROOT / "README.md", ROOT / "CHANGELOG.md", *ROOT.glob("*/README.md"),
     *ROOT.glob("docs/*.md"), *ROOT.glob("bench/results/*.md")]
)  # fmt: skip
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    text = FENCE.sub("", page.read_text())
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked here
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no such heading")
    return broken


def test_pages_exist() -> None:
    assert ROOT / "docs" / "README.md" in PAGES and len(PAGES) > 20


def test_every_relative_link_resolves() -> None:
    found = {
        str(page.relative_to(ROOT)): broken for page in PAGES if (broken := broken_links(page))
    }
    assert found == {}
